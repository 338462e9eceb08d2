"""compression.replica_sync = "diloco": the outer step against torch's Nesterov SGD, a lone replica's sync, state
transfer and the anchor's checksum, and the config; and a 2-stage x 2-replica run in which replicas share their anchor bit for bit, drift
within the stated bound between syncs, survive a replica's SIGKILL, and the returning replica takes the state."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from geotrain.config import ConfigError, RunConfig, load_config
from geotrain.node.diloco import OuterSync, drift_bound
from geotrain.node.stage import StageRuntime
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.transport import make_channel
from tests.conftest import LocalCluster, local_cluster, small_run, wait_until
from tests.fakedevice import FakeDevice


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]


@pytest.mark.timeout(10)
def test_the_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient_and_replicas_end_equal():
    anchor = _params(0)
    replicas = [[p.clone() for p in anchor] for _ in range(2)]
    syncs = [OuterSync(r, every=4, lr=0.7, momentum=0.9) for r in replicas]
    reference = [p.clone().requires_grad_(True) for p in anchor]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for round_, seed in enumerate((1, 2)):  # two syncs: the second uses the momentum of the first
        for r, replica in enumerate(replicas):  # each replica trains apart
            for p, step in zip(replica, _params(10 * seed + r)):
                p.sub_(0.01 * step)
        pseudo = [s.pseudo_gradient(r) for s, r in zip(syncs, replicas)]
        mean = [(a + b) / 2 for a, b in zip(*pseudo)]
        for s in syncs:
            s.stage(4 * (round_ + 1), [m.clone() for m in mean])
        assert all(s.apply_pending(4 * (round_ + 1), r) for s, r in zip(syncs, replicas))
        for p, g in zip(reference, mean):
            p.grad = g.float()
        sgd.step()
        for replica in replicas:
            assert all(torch.allclose(p, q.detach(), atol=1e-6) for p, q in zip(replica, reference))
        assert all(torch.equal(p, q) for p, q in zip(*replicas))  # bit for bit: the same inputs, the same steps
        assert all(torch.equal(a, p) for a, p in zip(syncs[0].anchor, replicas[0]))


@pytest.mark.timeout(10)
def test_a_lone_replica_takes_its_parameters_as_anchor_and_nothing_else_moves():
    params = _params(0)
    sync = OuterSync(params, every=2, lr=0.7, momentum=0.9)
    params[0].add_(1.0)
    before = [p.clone() for p in params]
    assert not sync.due(0) and not sync.due(1) and sync.due(2) and sync.due(4)
    sync.stage(2, None)
    assert not sync.apply_pending(3, params)  # staged for another step: nothing
    assert sync.apply_pending(2, params)
    assert all(torch.equal(a, p) for a, p in zip(sync.anchor, params))
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and all(not v.any() for v in sync.velocity)
    sync.stage(4, [torch.ones(4, 3, dtype=torch.float64), torch.ones(5, dtype=torch.float64)])
    sync.stage(4, None)  # the step redone in a new plan epoch, alone: its commit stages again
    assert sync.apply_pending(4, params) and not sync.apply_pending(4, params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.timeout(10)
def test_a_sync_on_a_device_widens_on_the_host_and_takes_the_same_outer_step():
    """Parameters on an accelerator (tests.fakedevice's stand-in): the pseudo-gradient is moved to the host before
    it is widened to float64 (MPS has none), no float64 op runs on the device, and the outer step leaves the bits the
    same code leaves on the CPU."""
    anchor, trained = _params(0), _params(1)
    results = []
    for device in (None, FakeDevice()):
        put = (lambda t: t.clone()) if device is None else device.put
        params, start = [put(p) for p in trained], [put(p) for p in anchor]
        with device or contextlib.nullcontext():
            sync = OuterSync(start, every=2, lr=0.7, momentum=0.9)
            pseudo = sync.pseudo_gradient(params)
            assert {t.device.type for t in pseudo} == {"cpu"} and {t.dtype for t in pseudo} == {torch.float64}
            sync.stage(2, pseudo)
            assert sync.apply_pending(2, params)
        results.append([p if device is None else device.value(p) for p in params])
        if device is not None:
            assert device.device_ops(torch.float64) == []
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("replicas", [2, 3, 7])
def test_the_sync_grid_holds_each_replicas_values_and_their_sum_in_int16(replicas):
    from geotrain.node.diloco import WIRE_DTYPE, from_grid, grid_steps, largest_values, to_grid

    # The worst case: one replica moved, the others not, so their mean largest value is its largest / replicas; and
    # that mean rounded below the true one, as a float32 mean may be.
    moved = [torch.tensor([-3e-3, 1e-3, 3e-3], dtype=torch.float64)]
    mean_largest = largest_values(moved) / replicas * (1 - 2**-24)
    steps = grid_steps(mean_largest, replicas)
    top = int(torch.iinfo(WIRE_DTYPE).max) // replicas
    assert to_grid(moved, steps, replicas)[0].tolist() == [-top, round(top / 3), top]
    all_top = sum(to_grid(moved, steps, replicas)[0].int() for _ in range(replicas))  # every replica at its bound
    assert int(all_top.abs().max()) <= torch.iinfo(WIRE_DTYPE).max
    assert torch.allclose(from_grid(to_grid(moved, steps, replicas), steps, 1)[0], moved[0], rtol=0, atol=float(steps[0]))
    assert grid_steps(torch.zeros(1, dtype=torch.float64), replicas).tolist() == [1.0]  # nothing moved: any step


def _diloco(*overrides: str) -> RunConfig:
    return load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16",
                              "compression.replica_sync=diloco", "compression.replica_sync_every=2", *overrides])


@pytest.mark.timeout(30)
def test_state_carries_anchor_and_momentum_and_the_checksum_covers_the_anchor():
    cfg = _diloco()
    a, b = StageRuntime(cfg, 0, 2), StageRuntime(cfg, 0, 2)
    assert a.checksum() == b.checksum()
    with torch.no_grad():
        a.parameters()[0].add_(0.5)  # trained apart: the parameters differ, the anchor not
    assert a.checksum() == b.checksum()
    a.sync.velocity[0].fill_(0.25)
    a.sync.anchor[1].fill_(2.0)
    assert a.checksum() != b.checksum()
    state = dict(a.full_state())
    assert any(k.startswith("sync.anchor.layers.") for k in state) and any(k.startswith("sync.momentum.") for k in state)
    b.load_full_state(state, 3)
    assert b.checksum() == a.checksum() and torch.equal(b.sync.velocity[0], a.sync.velocity[0])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    del state[next(k for k in state if k.startswith("sync.momentum."))]
    with pytest.raises(ValueError, match="state has no sync.momentum"):
        b.load_full_state(state, 3)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("settings", "message"), [
    (["compression.replica_sync=sometimes"], "replica_sync must be every_step or diloco"),
    (["compression.replica_sync=diloco", "compression.replica_sync_every=0"], "replica_sync_every must be in"),
    (["compression.replica_sync=diloco", "compression.replica_sync_every=2.5"], "must be an integer"),
    (["compression.replica_sync=diloco", "compression.replica_grads=powersgd:rank=2"], "averages no gradients"),
    (["compression.replica_sync=diloco", "compression.replica_robust=centered_clip"], "averages no gradients"),
])
def test_config_refuses_bad_sync_settings(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, settings)


@pytest.mark.timeout(10)
def test_the_config_says_when_replicas_are_not_exact():
    assert load_config(None, []).compression.inexact_replicas == ""
    assert _diloco("compression.replica_sync_every=32").compression.inexact_replicas == (
        "replicas sync every 32 steps (DiLoCo): not exact"
    )


# -- a live run ---------------------------------------------------------------------------------------------------

_H = 3
_STEPS = 8


def _fetch(address: str, token: str, key, steps_done: int) -> dict[str, torch.Tensor]:
    channel = make_channel(address, token, lambda: "tester", key=key)
    try:
        stream = rpc.StageStub(channel).FetchState(pb.FetchStateRequest(steps_done=steps_done), timeout=30)
        return framing.read_state(stream)
    finally:
        channel.close()


def _split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, anchor) of a stage's state, both under the parameters' names."""
    params = {k: v for k, v in state.items() if k.startswith("layers.")}
    return params, {k: state[f"sync.anchor.{k}"] for k in params}


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_two_by_two_diloco_run_shares_anchors_drifts_within_bound_and_survives_a_replica_kill(tmp_path):
    cfg = small_run(f"run.steps={_STEPS}", "scheduler.stages=2", "scheduler.step_timeout_s=60",
                    "compression.replica_sync=diloco", f"compression.replica_sync_every={_H}")
    t = cfg.train
    victim = "node-4"
    killed, restarted, rejoined, compared = (threading.Event() for _ in range(4))
    running: list[LocalCluster] = []
    seen: dict[int, dict[int, list[tuple[str, dict]]]] = {}  # step -> stage -> (node, state) after its apply
    rejoin_states: dict[str, dict] = {}

    def watch(kind: str, data: dict) -> None:
        cluster = wait_until(lambda: running and running[0], 30, "the cluster handed to the test")
        coordinator = cluster.coordinator
        if kind == "phase" and data["phase"] == "committed":
            # The coordinator waits here: every replica has applied this step and none has begun the next.
            plan = coordinator.plan
            seen[data["step"]] = {
                s.index: [(n, _fetch(a, cluster.token, coordinator.key, data["step"] + 1))
                          for n, a in zip(s.node_ids, s.addresses)]
                for s in plan.stages
            }
        if kind == "phase" and (data["step"], data["phase"]) == (2, "microbatches_done") and not killed.is_set():
            cluster.nodes.kill(victim)  # mid-period: before the sync of step 3
            killed.set()
        if kind == "step" and restarted.is_set() and not rejoined.is_set():
            wait_until(lambda: coordinator.members[victim].alive, 60, "the restarted victim registered")
        if kind == "plan" and restarted.is_set() and not rejoined.is_set() and any(
            victim in s.node_ids for s in data["plan"].stages
        ):
            # The victim is back in a plan, its state loaded from its stage's other replica, no step applied yet.
            stage = next(s for s in data["plan"].stages if victim in s.node_ids)
            for n, a in zip(stage.node_ids, stage.addresses):
                rejoin_states[n] = _fetch(a, cluster.token, coordinator.key, coordinator.step)
            rejoined.set()

    with local_cluster(cfg, 4, tmp_path, on_event=watch, in_order=True) as cluster:
        running.append(cluster)
        assert killed.wait(90)
        wait_until(lambda: not cluster.coordinator.members[victim].alive, 30, "the victim's death noticed")
        cluster.nodes.start(victim)
        restarted.set()
        summary = cluster.wait(150)
        status = cluster.coordinator.status()
    assert summary.steps == _STEPS and cluster.coordinator.failures >= 1
    assert status.exactness == f"replicas sync every {_H} steps (DiLoCo): not exact"

    # The returning replica took its peer's whole state: parameters, AdamW's, the anchor and the outer momentum.
    assert rejoined.is_set() and len(rejoin_states) == 2
    mine, theirs = rejoin_states.pop(victim), rejoin_states.popitem()[1]
    assert any(k.startswith("sync.momentum.") for k in mine)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    anchors_before: dict[int, dict[str, torch.Tensor]] = {}
    drifted = False
    for step in range(_STEPS):
        for index, replicas in seen[step].items():
            states = [_split(state) for _, state in replicas]
            anchor = states[0][1]
            # Every replica of a stage holds the same anchor, bit for bit (the coordinator checks it each step too).
            assert all(all(torch.equal(a[k], anchor[k]) for k in anchor) for _, a in states)
            previous = anchors_before.get(index)
            if previous is not None and previous.keys() == anchor.keys():
                unchanged = all(torch.equal(previous[k], anchor[k]) for k in anchor)
                assert unchanged == (step % _H != 0), f"step {step}: the anchor moves at syncs only"
            anchors_before[index] = anchor
            # Each replica is the inner steps since the anchor away from it: within the bound's half.
            last_sync = step - step % _H
            lrs = [t.lr_at(j, _STEPS) for j in range(last_sync, step + 1)]
            for params, _ in states:
                largest = max(float(torch.maximum(params[k].abs(), anchor[k].abs()).max()) for k in params)
                bound = drift_bound(lrs, t.beta1, t.beta2, t.weight_decay, largest) / 2
                assert max(float((params[k] - anchor[k]).abs().max()) for k in params) <= bound
            if len(states) == 2 and step < 2:
                drifted |= any(not torch.equal(states[0][0][k], states[1][0][k]) for k in anchor)
    assert drifted  # replicas trained apart between syncs, each on its own microbatches
