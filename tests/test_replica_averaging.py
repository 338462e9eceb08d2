"""Replicas averaging PowerSGD factors: every replica ends with the same bits, the result is the projection PowerSGD
defines, error feedback keeps the accumulated error bounded, and a live 2x2 run with it trains."""

from __future__ import annotations

import threading

import pytest
import torch

from geotrain.compression import get_codec
from geotrain.config import ConfigError, load_config
from geotrain.node.lowrank import LowRankAveraging, orthonormal_columns
from geotrain.node.local import train_local
from geotrain.scheduler.service import fetch_model_state
from tests.conftest import local_cluster


class _Group:
    """An in-process stand-in for the all-reduce: replicas meet at a barrier each round and take the weighted mean."""

    def __init__(self, weights: list[float]) -> None:
        self.weights = weights
        self.barrier = threading.Barrier(len(weights))
        self.tensors: dict[int, list[torch.Tensor]] = {}

    def all_reduce(self, replica: int):
        def reduce(round_: int, tensors: list[torch.Tensor]) -> None:
            self.tensors[replica] = tensors
            if self.barrier.wait(10) == 0:  # one replica computes the means for all
                total = sum(self.weights)
                for k in range(len(tensors)):
                    mean = sum(w * self.tensors[r][k] for r, w in enumerate(self.weights)) / total
                    for r in range(len(self.weights)):
                        self.tensors[r][k].copy_(mean)
            self.barrier.wait(10)

        return reduce


def _average_together(averagers, grads, weights, epoch=1):
    group = _Group(weights)
    threads = [
        threading.Thread(target=a.average, args=(epoch, g, group.all_reduce(r)))
        for r, (a, g) in enumerate(zip(averagers, grads))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)


def test_orthonormal_columns():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(300, 4, generator=g, dtype=torch.float64)
    q = orthonormal_columns(p)
    assert torch.allclose(q.T @ q, torch.eye(4, dtype=torch.float64), atol=1e-12)
    # Same span: projecting p onto the columns gives p back.
    assert torch.allclose(q @ (q.T @ p), p, atol=1e-10)
    dependent = torch.cat([p[:, :2], p[:, :1] * 3], 1)
    assert torch.equal(orthonormal_columns(dependent)[:, 2], torch.zeros(300, dtype=torch.float64))


def test_replicas_end_bit_identical_with_the_powersgd_projection():
    codec = get_codec("powersgd:rank=2")
    g = torch.Generator().manual_seed(1)
    weights = [3.0, 1.0]
    grads = [[torch.randn(64, 48, generator=g), torch.randn(48, generator=g)] for _ in weights]
    originals = [[t.clone() for t in replica] for replica in grads]
    averagers = [LowRankAveraging(codec) for _ in weights]
    _average_together(averagers, grads, weights)

    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    # The 1-D tensor is averaged whole; the matrix is mean(M) projected on span(orth(mean(M) Q)).
    mean = [sum(w * r[k].double() for r, w in zip(originals, weights)) / sum(weights) for k in range(2)]
    assert torch.allclose(grads[0][1].double(), mean[1], atol=1e-6)
    q0 = torch.randn(48, 2, generator=torch.Generator().manual_seed(64 * 48), dtype=torch.float64)
    p_hat = orthonormal_columns(mean[0] @ q0)
    assert torch.allclose(grads[0][0].double(), p_hat @ (p_hat.T @ mean[0]), atol=1e-5)
    assert not torch.allclose(grads[0][0].double(), mean[0], atol=1e-2)  # rank 2 of a 64x48 matrix is lossy


def test_error_feedback_keeps_the_accumulated_error_bounded():
    codec = get_codec("powersgd:rank=1")
    g = torch.Generator().manual_seed(2)
    targets = [torch.randn(32, 32, generator=g) for _ in range(2)]
    mean = (targets[0] + targets[1]) / 2
    averagers = [LowRankAveraging(codec) for _ in targets]
    applied = torch.zeros(32, 32)
    gaps = {}
    for step in range(1, 121):
        grads = [[t.clone()] for t in targets]
        _average_together(averagers, grads, [1.0, 1.0])
        applied += grads[0][0]
        gaps[step] = float((applied - step * mean).norm())
    # Rank 1 of a rank-32 matrix: without feedback the gap would grow by nearly |mean| every step; with it, it
    # levels off (measured: 334 at step 30, 366 at 60, 376 at 120, against |mean| = 22.7).
    assert gaps[120] < 1.15 * gaps[60]
    assert gaps[120] < 0.15 * 120 * float(mean.norm())


def test_config_accepts_powersgd_and_rejects_lossy_replica_codecs():
    assert load_config(None, ["compression.replica_grads=powersgd:rank=2"]).compression.replica_grads == "powersgd:rank=2"
    with pytest.raises(ConfigError, match="replica_grads must be 'none' or 'powersgd"):
        load_config(None, ["compression.replica_grads=int8"])


@pytest.mark.timeout(150)
def test_two_by_two_run_with_powersgd_replica_averaging(tmp_path):
    # The coordinator stops a run whose replicas' parameter checksums differ, so finishing is the identity check.
    settings = [
        "run.steps=6", "run.eval_every=0", "train.microbatches=4", "scheduler.stages=2", "scheduler.placement=uniform",
        "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=2.5",
    ]
    cfg = load_config(None, [*settings, "compression.replica_grads=powersgd:rank=2"])
    with local_cluster(cfg, 4, tmp_path) as cluster:
        summary = cluster.wait(120)
        plan = cluster.coordinator.plan
        state = fetch_model_state(plan, cluster.token, summary.steps)
        steps = cluster.coordinator.store.steps()
    assert all(len(stage.node_ids) == 2 for stage in plan.stages)
    assert summary.steps == 6 and steps[-1].loss < steps[0].loss
    runtime, _ = train_local(load_config(None, settings))
    exact = {name: t.detach() for name, t in runtime.named_state()}
    # The low-rank averages changed the training: it is not the exact run.
    assert max(float((state[k] - exact[k]).abs().max()) for k in state) > 1e-4
