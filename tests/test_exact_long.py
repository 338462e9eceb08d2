"""Exact means exact over long runs: gradient means that do not depend on the order microbatches arrive in or on how
replicas split them, a clip factor that does not depend on how stages split the norm, and 100-step pipeline and
replica runs (one with a replica killed) that end bit-identical to train-local. Before the order-independent sums,
such runs were 0.03 apart after 60 steps; bench/exactness.py runs the same layouts for 300 steps."""

from __future__ import annotations

import math

import pytest
import torch

from geotrain.config import RunConfig, load_config
from geotrain.node.data import Corpus
from geotrain.node.stage import StageRuntime
from geotrain.scheduler.service import fetch_model_state
from tests.conftest import SMALL_RUN, local_cluster, max_diff, train_local_state, wait_until
from tests.test_replica_averaging import _together, averagers  # noqa: F401 - averagers is a fixture

# A model so small that a step costs the RPCs, not the compute: 100 steps fit in a test.
_TINY = [
    "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.seq_len=16", "train.microbatch_size=2",
    "train.inflight=4", "scheduler.step_timeout_s=60",
]


_STEPS = 100


def _tiny(*overrides: str) -> RunConfig:
    return load_config(None, [*SMALL_RUN, *_TINY, *overrides])


def _gradients(runtime: StageRuntime, corpus: Corpus, microbatches: list[int], reduce=None) -> list[torch.Tensor]:
    """Forward and backward `microbatches` of step 0 in that order, then the stage's mean gradients."""
    cfg = runtime.cfg
    for mb in microbatches:
        x, y = corpus.batch(seed=cfg.run.seed, step=0, microbatch=mb, size=cfg.train.microbatch_size,
                            seq_len=cfg.model.seq_len)
        runtime.forward((0, mb), x)
        runtime.loss_backward((0, mb), y)
    runtime.mean_gradients(0, reduce)
    return [g.clone() for g in runtime.gradients()]


def test_gradient_means_do_not_depend_on_microbatch_order_or_replica_split():
    cfg = _tiny("train.microbatches=8")
    corpus = Corpus.load(cfg.data)
    whole = lambda: StageRuntime(cfg, 0, cfg.model.total_layers)  # noqa: E731
    in_order = _gradients(whole(), corpus, list(range(8)))
    shuffled = _gradients(whole(), corpus, [5, 2, 7, 0, 3, 6, 1, 4])
    # Two replicas, each with its own microbatches, whose float64 sums are added and divided as the all-reduce does.
    odd_sums: list[torch.Tensor] = []
    _gradients(whole(), corpus, [7, 1, 5, 3], lambda sums: odd_sums.extend(s.clone() for s in sums))

    def add_odd_and_divide(sums: list[torch.Tensor]) -> None:
        for total, odd in zip(sums, odd_sums):
            total.add_(odd).div_(8)

    split = _gradients(whole(), corpus, [6, 0, 4, 2], add_odd_and_divide)
    assert all(g.dtype == torch.float32 for g in in_order)
    assert all(torch.equal(a, b) for a, b in zip(in_order, shuffled))
    assert all(torch.equal(a, b) for a, b in zip(in_order, split))


def test_the_clip_factor_does_not_depend_on_how_stages_split_the_norm():
    train = load_config(None, ["train.grad_clip=0.5"]).train
    parts = [0.1, 0.2, 0.3]
    # Stage sums added up (what a coordinator summing stage norms did) depend on where the stages split.
    assert (0.1 + 0.2) + 0.3 != 0.1 + (0.2 + 0.3)
    coefficient = train.clip_coefficient_from(parts)
    assert coefficient == train.clip_coefficient(math.fsum(parts)) < 1.0
    assert all(train.clip_coefficient_from(p) == coefficient for p in ([0.3, 0.2, 0.1], [0.2, 0.3, 0.1]))


@pytest.mark.cluster
@pytest.mark.timeout(60)
@pytest.mark.parametrize("regions", [["eu", "eu", "eu"], ["eu", "us", "eu"]], ids=["flat", "region-by-region"])
def test_the_presummed_all_reduce_gives_every_replica_the_exact_mean(averagers, regions, request):  # noqa: F811
    from geotrain.node.allreduce import HierarchicalAllReduce, replica_all_reduce
    from geotrain.node.averaging import group_id

    g = torch.Generator().manual_seed(5)
    counts = [3, 1, 2]
    # Each replica's microbatch gradients (float32, magnitudes 2^-12..2^4 apart), summed in float64 as stages do.
    grads = [[torch.randn(4000, generator=g) * 2.0 ** torch.randint(-12, 4, (4000,), generator=g) for _ in range(c)]
             for c in counts]
    sums = [[sum(x.double() for x in own)] for own in grads]
    everything = [x for own in reversed(grads) for x in reversed(own)]
    expected = (sum(x.double() for x in everything) / sum(counts)).float().double()
    peers = [a.peer_id for a in averagers[:3]]
    reduces = [
        replica_all_reduce(a, peers, regions, float(c), lambda r, part: group_id(request.node.name, 0, 0, 1, r, part),
                           hierarchical=True, presummed=True)
        for a, c in zip(averagers, counts)
    ]
    assert isinstance(reduces[0], HierarchicalAllReduce) == (len(set(regions)) > 1)
    _together([lambda r=r, t=t: r(0, t) for r, t in zip(reduces, sums)])
    for (got,) in sums:
        assert torch.equal(got, expected)


def _run_against_local(tmp_path, n_nodes: int, stages: int, kill_after: int | None = None) -> float:
    """_STEPS steps on n_nodes nodes in `stages` stages (SIGKILLing the last stage's second replica once step
    kill_after is committed), then in one process; the largest parameter difference."""
    settings = [f"run.steps={_STEPS}", f"scheduler.stages={stages}"]
    with local_cluster(_tiny(*settings), n_nodes, tmp_path) as cluster:
        if kill_after is not None:
            coordinator = cluster.coordinator
            wait_until(lambda: coordinator.step > kill_after, 120, f"step {kill_after} committed", interval=0.02)
            victim = coordinator.plan.stages[-1].node_ids[1]
            cluster.nodes.kill(victim)
        summary = cluster.wait(240)
        plan = cluster.coordinator.plan
        state = fetch_model_state(plan, cluster.token, summary.steps, cluster.coordinator.key)
    assert summary.steps == _STEPS
    if kill_after is not None:
        assert victim not in {n for stage in plan.stages for n in stage.node_ids}
    return max_diff(state, train_local_state(_tiny(*settings)))


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_three_stages_100_steps_end_bit_identical_to_train_local(tmp_path):
    assert _run_against_local(tmp_path, 3, 3) == 0.0


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_replica_killed_mid_run_still_ends_bit_identical_to_train_local(tmp_path):
    assert _run_against_local(tmp_path, 4, 2, kill_after=40) == 0.0
