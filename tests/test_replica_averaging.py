"""Replica averaging. PowerSGD factors: every replica ends with the same bits, the result is the projection PowerSGD
defines, error feedback keeps the accumulated error bounded, and a live 2x2 run with it trains. Region by region
(HierarchicalAllReduce, over real in-process hivemind peers): every replica ends with the same bits, the weighted
mean over all replicas, and a live run of four replicas in two regions equals train-local."""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from geotrain.compression import get_codec
from geotrain.config import ConfigError, load_config
from geotrain.node.local import train_local
from geotrain.node.lowrank import LowRankAveraging, orthonormal_columns
from geotrain.node.stage import StageRuntime
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.coordinator import Coordinator, Member
from geotrain.scheduler.placement import hierarchical_allreduce
from geotrain.scheduler.service import fetch_model_state
from tests.conftest import free_ports, local_cluster
from tests.fakedevice import FakeDevice


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


@pytest.mark.timeout(10)
def test_powersgd_on_a_device_runs_on_the_host_and_hands_the_all_reduce_host_tensors():
    """Gradients on an accelerator (tests.fakedevice's stand-in): the averaging moves them to the host before any
    float64 op (MPS has none), multiplies them only with host factors, hands the all-reduce host tensors (hivemind
    averages those), and leaves the gradients the bits the same code leaves on the CPU."""
    codec = get_codec("powersgd:rank=2")
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(24, 16, generator=g), torch.randn(16, generator=g)]
    handed: list[torch.device] = []

    def all_reduce(round_: int, tensors: list[torch.Tensor]) -> None:
        handed.extend(t.device for t in tensors)  # one replica: the mean is itself

    on_cpu = [v.clone() for v in values]
    LowRankAveraging(codec).average(1, on_cpu, all_reduce)
    device = FakeDevice()
    grads = [device.put(v) for v in values]
    with device:
        LowRankAveraging(codec).average(1, grads, all_reduce)
    assert device.device_ops(torch.float64) == []
    assert {d.type for d in handed} == {"cpu"} and len(handed) == 2 * 3  # both runs: P and the whole one, then Q
    assert all(torch.equal(device.value(m), c) for m, c in zip(grads, on_cpu))


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


def _live_and_local(tmp_path, settings, averaging, wait_s, node_args=None):
    """Train on four local nodes with settings and the averaging settings, and in one process with settings alone;
    returns the nodes' final plan, step records, maximum parameter difference from the one process, and summary."""
    # The coordinator stops a run whose replicas' parameter checksums differ, so finishing is the identity check.
    settings = [
        "run.eval_every=0", "train.microbatches=4", "scheduler.placement=uniform", "profile.layer_repeats=1",
        "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=2.5", *settings,
    ]
    cfg = load_config(None, [*settings, *averaging])
    with local_cluster(cfg, 4, tmp_path, node_args=node_args) as cluster:
        summary = cluster.wait(wait_s)
        plan = cluster.coordinator.plan
        state = fetch_model_state(plan, cluster.token, summary.steps, cluster.coordinator.key)
        steps = cluster.coordinator.store.steps()
    runtime, _ = train_local(load_config(None, settings))
    exact = {name: t.detach() for name, t in runtime.named_state()}
    return plan, steps, max(float((state[k] - exact[k]).abs().max()) for k in state), summary


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_two_by_two_run_with_powersgd_replica_averaging(tmp_path):
    plan, steps, diff, summary = _live_and_local(
        tmp_path, ["run.steps=6", "scheduler.stages=2"], ["compression.replica_grads=powersgd:rank=2"], 120
    )
    assert all(len(stage.node_ids) == 2 for stage in plan.stages)
    assert summary.steps == 6 and steps[-1].loss < steps[0].loss
    assert diff > 1e-4  # the low-rank averages changed the training: it is not the exact run


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_two_by_two_run_with_centered_clip_and_a_wide_radius_trains_as_the_mean(tmp_path):
    # Honest replicas' gradients lie well inside a radius of 10 per value: CenteredClip clips nothing and its
    # estimate is the mean (to float64 rounding), so the run ends where training in one process ends.
    plan, steps, diff, summary = _live_and_local(
        tmp_path, ["run.steps=4", "scheduler.stages=2"],
        ["compression.replica_robust=centered_clip", "compression.replica_clip_rms=10"], 120,
    )
    assert all(len(stage.node_ids) == 2 for stage in plan.stages)
    assert summary.steps == 4 and diff <= 1e-4


# -- region by region -------------------------------------------------------------------------------------------

_PEERS = 6


@pytest.fixture(scope="module")
def averagers():
    """Six ReplicaAveragers on their own hivemind DHTs in this process (each DHT runs its p2p daemon); always shut
    down. Constructing them returns once their DHT and handlers are up, so they are ready when yielded."""
    from hivemind import DHT

    from geotrain.node.averaging import ReplicaAverager, dht_maddrs

    dhts, started = [], []
    (fixed,) = free_ports(1)
    try:
        for i in range(_PEERS):
            initial = [str(a) for d in dhts for a in d.get_visible_maddrs()]
            # The last as a node advertised at a host with --dht-port: it listens on every interface and announces
            # the advertised host alone; the others reach it there (the 6-replica all-reduces).
            advertised = i == _PEERS - 1
            listen, announce = dht_maddrs("127.0.0.1", advertised, fixed if advertised else 0)
            dhts.append(DHT(initial_peers=initial, host_maddrs=listen, announce_maddrs=announce, start=True))
            started.append(ReplicaAverager(dhts[-1], timeout_s=10.0))
        visible = [str(a) for a in dhts[-1].get_visible_maddrs()]
        assert visible == [f"/ip4/127.0.0.1/tcp/{fixed}/p2p/{dhts[-1].peer_id}"], visible
        yield started
    finally:
        for averager in started:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def _together(calls: list[Callable[[], None]]) -> None:
    """Run the calls on threads at once (one per replica); re-raise the first error."""
    errors: list[BaseException] = []

    def run(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as e:  # handed to the test below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads), "an all-reduce did not finish"
    if errors:
        raise errors[0]


def _all_reduces(averagers, regions, weights, name, hierarchical=True):
    from geotrain.node.allreduce import replica_all_reduce
    from geotrain.node.averaging import group_id

    peers = [a.peer_id for a in averagers[: len(regions)]]
    return [
        replica_all_reduce(
            a, peers, regions, w, lambda r, part: group_id(name, 0, 0, 1, r, part), hierarchical=hierarchical
        )
        for a, w in zip(averagers, weights)
    ]


@pytest.mark.cluster
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("regions", "weights"),
    [
        (["eu", "eu", "us", "us"], [1.0, 2.0, 3.0, 4.0]),
        (["eu", "us", "eu", "us"], [3.0, 0.0, 1.0, 0.0]),  # a site without microbatches counts for nothing
        (["a", "b", "c", "a", "c", "c"], [3.0, 1.0, 2.0, 5.0, 1.0, 4.0]),  # sites of 2, 1 and 3 replicas
    ],
    ids=["2+2", "2+2-idle-site", "2+1+3"],
)
def test_hierarchical_all_reduce_gives_every_replica_the_same_weighted_mean(averagers, regions, weights, request):
    from geotrain.node.allreduce import HierarchicalAllReduce

    g = torch.Generator().manual_seed(len(regions))
    # 49 values in 3 tensors: shards of unequal length, and shard boundaries inside tensors.
    tensors = [[torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(13, generator=g, dtype=torch.float64),
                torch.randn(1, generator=g, dtype=torch.float64)] for _ in regions]
    expected = [sum(w * t[k] for t, w in zip(tensors, weights)) / sum(weights) for k in range(3)]
    reduces = _all_reduces(averagers, regions, weights, request.node.name)
    assert all(isinstance(r, HierarchicalAllReduce) for r in reduces)
    _together([lambda r=r, t=t: r(0, t) for r, t in zip(reduces, tensors)])
    for replica in tensors[1:]:
        assert all(torch.equal(a, b) for a, b in zip(replica, tensors[0]))
    for got, want in zip(tensors[0], expected):
        assert torch.equal(got, got.float().double())  # float32 values, as the flat all-reduce leaves them
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_weight_one_sender_among_weight_zero_zeros_is_reproduced_exactly(averagers):
    # Phase C of the hierarchical all-reduce: one member sends its values with weight 1, the others zeros with
    # weight 0; hivemind's reducer computes (1 * v + 0 * 0) / (1 + 0) in float32.
    from geotrain.node.averaging import group_id

    g = torch.Generator().manual_seed(7)
    representable = torch.randn(3000, generator=g).double()  # float32 values, as phase B leaves them
    wide = torch.randn(3000, generator=g, dtype=torch.float64)
    peers = [a.peer_id for a in averagers[:3]]
    for i, values in enumerate((representable, wide)):
        tensors = [values.clone(), torch.zeros_like(values), torch.zeros_like(values)]
        gid = group_id("phase-c", 0, 0, 1, i)
        _together([lambda a=a, t=t, w=w: a.average(gid, peers, [t], w)
                   for a, t, w in zip(averagers, tensors, (1.0, 0.0, 0.0))])
        for t in tensors:  # every peer, the sender included, ends with the float32 rounding of its values
            assert torch.equal(t, values.float().double())
    assert torch.equal(representable.float().double(), representable)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_powersgd_over_the_hierarchical_all_reduce_stays_bit_identical(averagers, request):
    codec = get_codec("powersgd:rank=2")
    g = torch.Generator().manual_seed(3)
    regions, weights = ["eu", "eu", "us"], [2.0, 1.0, 3.0]
    grads = [[torch.randn(40, 24, generator=g), torch.randn(24, generator=g)] for _ in regions]
    reduces = _all_reduces(averagers, regions, weights, request.node.name)
    low_rank = [LowRankAveraging(codec) for _ in regions]
    _together([lambda lr=lr, gr=gr, r=r: lr.average(1, gr, r) for lr, gr, r in zip(low_rank, grads, reduces)])
    for replica in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(replica, grads[0]))


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_the_flat_all_reduce_leaves_the_same_float64_bits_on_every_replica(averagers, request):
    # Each replica's own value plus the reducer's delta differs in the last float64 bits for about a tenth of these
    # values, differently on each replica; PowerSGD computes on from them.
    g = torch.Generator().manual_seed(11)
    tensors = [[torch.randn(5000, generator=g, dtype=torch.float64)] for _ in range(2)]
    expected = (tensors[0][0] + 3 * tensors[1][0]) / 4
    reduces = _all_reduces(averagers, ["eu", "us"], [1.0, 3.0], request.node.name, hierarchical=False)
    _together([lambda r=r, t=t: r(0, t) for r, t in zip(reduces, tensors)])
    assert torch.equal(tensors[0][0], tensors[1][0])
    assert torch.allclose(tensors[0][0], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_diloco_sync_adds_integers_on_a_shared_grid_the_same_on_every_replica(averagers, request):
    # Three replicas of unequal scale, and a tensor none of them moved. The largest values' mean comes from an
    # all-reduce in the run; here every replica computes the same one.
    from geotrain.node.averaging import Job, group_id
    from geotrain.node.diloco import WIRE_DTYPE, from_grid, grid_steps, largest_values, to_grid

    g = torch.Generator().manual_seed(12)
    pseudo = [[torch.randn(3000, generator=g, dtype=torch.float64) * 1e-3 * (r + 1), torch.zeros(7, dtype=torch.float64)]
              for r in range(3)]
    steps = grid_steps(torch.stack([largest_values(p) for p in pseudo]).mean(0), 3)
    sums = [to_grid(p, steps, 3) for p in pseudo]
    peers = [a.peer_id for a in averagers[:3]]
    sent_before = sum(a.bytes_sent for a in averagers[:3])
    job = functools.partial(Job, group_id(request.node.name, 0, 0, 1, 1, ""), peers, weight=1.0, presummed="sum")
    _together([lambda a=a, s=s: a.average_all([job(tensors=s)]) for a, s in zip(averagers, sums)])
    sent = sum(a.bytes_sent for a in averagers[:3]) - sent_before
    assert all(t.dtype == WIRE_DTYPE for s in sums for t in s)
    means = [from_grid(s, steps, 3) for s in sums]
    assert all(torch.equal(x, y) for m in means[1:] for x, y in zip(means[0], m))
    exact = sum(p[0] for p in pseudo) / 3
    assert (means[0][0] - exact).abs().max() <= steps[0] / 2 * (1 + 1e-9)
    assert not means[0][1].any()
    # Each replica sends 2/3 of its values and, as a reducer, their sum back to the 2 others: 2 bytes a value.
    values = 3007
    assert 3 * 2 * (2 / 3) * values * 2 <= sent < 1.2 * 3 * 2 * (2 / 3) * values * 2


class _Recorder:
    """An averager that only records the groups it is asked to all-reduce in."""

    peer_id = "p0"

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, list[str]]] = []

    def average(self, gid, peers, tensors, weight) -> None:
        self.calls.append((gid, list(peers)))


@pytest.mark.parametrize(
    ("regions", "hierarchical"),
    [(["eu", "eu", "eu"], True), (["eu", "us", "asia"], True), (["eu", "eu", "us"], False)],
    ids=["one-site", "one-replica-per-site", "not-asked"],
)
def test_degenerate_sites_average_in_one_flat_group(regions, hierarchical):
    from geotrain.node.allreduce import replica_all_reduce

    averager = _Recorder()
    peers = ["p0", "p1", "p2"]
    all_reduce = replica_all_reduce(averager, peers, regions, 1.0, lambda r, part: f"{r}/{part}".encode(), hierarchical)
    all_reduce(1, [torch.zeros(4, dtype=torch.float64)])
    assert averager.calls == [(b"1/", peers)]


def test_sites_keep_first_appearance_and_member_order():
    from geotrain.node.allreduce import sites_of

    assert sites_of(["a", "b", "c", "d", "e"], ["us", "eu", "us", "asia", "eu"]) == [["a", "c"], ["b", "e"], ["d"]]


PEER = "12D3KooWCPoqTfMQcUAfAoXoh6ZY5cNiJN63mYHx38Y1E6nKyRhX"


def test_the_dhts_follow_their_advertised_hosts():
    # Behind the namespace WAN's relay the coordinator listens on 127.0.0.1: its DHT, which the relay does not
    # forward, listens on every interface and is handed out at the advertised host, once per port.
    from geotrain.node.averaging import dht_maddrs
    from geotrain.scheduler.service import announced_maddrs, dht_listen_maddr

    assert dht_listen_maddr("127.0.0.1", "", 0) == "/ip4/127.0.0.1/tcp/0"
    assert dht_listen_maddr("::1", "", 0) == "/ip6/::1/tcp/0"
    assert dht_listen_maddr("127.0.0.1", "10.1.0.2", 0) == "/ip4/0.0.0.0/tcp/0"
    assert dht_listen_maddr("127.0.0.1", "10.1.0.2", 7001) == "/ip4/0.0.0.0/tcp/7001"  # --dht-port
    # A node's: on its address's host, unless advertised at a host with a fixed port, which it announces.
    assert dht_maddrs("127.0.0.1", False, 0) == (["/ip4/127.0.0.1/tcp/0"], None)
    assert dht_maddrs("10.1.0.2", True, 0) == (["/ip4/10.1.0.2/tcp/0"], None)  # no port to announce
    assert dht_maddrs("198.51.100.23", True, 7102) == (["/ip4/0.0.0.0/tcp/7102"], ["/ip4/198.51.100.23/tcp/7102"])
    assert dht_maddrs("home.example.org", True, 7102) == (["/ip4/0.0.0.0/tcp/7102"], ["/dns/home.example.org/tcp/7102"])
    assert dht_maddrs("fd00::5", False, 7102) == (["/ip6/fd00::5/tcp/7102"], None)
    visible = [f"/ip4/127.0.0.1/tcp/34833/p2p/{PEER}", f"/ip4/192.0.2.2/tcp/34833/p2p/{PEER}"]
    assert announced_maddrs(visible, "") == visible
    assert announced_maddrs(visible, "10.1.0.2") == [f"/ip4/10.1.0.2/tcp/34833/p2p/{PEER}"]
    assert announced_maddrs(visible, "coord.example.org") == [f"/dns/coord.example.org/tcp/34833/p2p/{PEER}"]
    with pytest.raises(ValueError, match="not a /tcp/PORT/p2p/PEER"):
        announced_maddrs([f"/ip4/10.1.0.2/udp/1/quic/p2p/{PEER}"], "10.1.0.2")


@pytest.mark.parametrize(("advertise", "ok"), [("10.1.0.2", True), ("::1", True), ("coord.example.org", True),
                                               ("10.1.0.2:7000", False), ("[::1]:7000", False)])
def test_the_coordinators_advertise_takes_a_host_without_a_port(advertise, ok):
    from geotrain.commands.common import UsageError
    from geotrain.commands.coordinator import advertised_host

    if ok:
        assert advertised_host(advertise) == advertise
    else:
        with pytest.raises(UsageError, match="--advertise takes a HOST without a port"):
            advertised_host(advertise)


@pytest.mark.parametrize(
    ("mode", "placement", "planned", "regions", "expected"),
    [
        ("hierarchical", "uniform", False, ["eu", "eu", "us"], True),
        ("hierarchical", "uniform", False, ["eu", "us"], False),  # one replica per region: nothing to gain
        ("flat", "measured", True, ["eu", "eu", "us"], False),
        ("auto", "measured", True, ["eu", "eu", "us"], True),
        ("auto", "measured", False, ["eu", "eu", "us"], False),
        ("auto", "uniform", True, ["eu", "eu", "us"], True),  # the estimate prices uniform plans too
        ("auto", "uniform", None, ["eu", "eu", "us"], False),  # no estimate before the profiles are in
    ],
)
def test_coordinator_chooses_the_all_reduce_by_scheduler_allreduce(mode, placement, planned, regions, expected):
    cfg = load_config(None, [f"scheduler.allreduce={mode}", f"scheduler.placement={placement}"])
    estimate = SimpleNamespace(stages=[SimpleNamespace(hierarchical_allreduce=planned)]) if planned is not None else None
    group = [Member(node_id=f"n{i}", address="x:1", region=r, joined_at=0.0, last_seen=0.0) for i, r in enumerate(regions)]
    assert hierarchical_allreduce(cfg.scheduler.allreduce, estimate, 0, group) is expected


def test_a_plan_made_before_the_profiles_switches_its_averaging_when_they_price_it():
    coordinator = Coordinator(load_config(None, ["scheduler.placement=uniform"]))
    regions = ["eu", "eu", "us"]
    for i, region in enumerate(regions):
        coordinator.members[f"n{i}"] = Member(f"n{i}", "x:1", region, 0.0, 0.0)
    planning = coordinator.planning
    planning.plan = pb.Plan(epoch=1, stages=[pb.StageAssignment(node_ids=["n0", "n1", "n2"], regions=regions)])
    assert not planning.averaging_changed()  # no estimate yet: flat, as planned
    planning.estimate = SimpleNamespace(stages=[SimpleNamespace(hierarchical_allreduce=True)])
    assert planning.averaging_changed()
    planning.plan.stages[0].hierarchical_allreduce = True
    assert not planning.averaging_changed()
    coordinator.store.close()


@pytest.mark.cluster
@pytest.mark.timeout(90)
def test_four_replicas_in_two_regions_average_region_by_region_and_equal_train_local(tmp_path):
    regions = {"node-1": "eu", "node-2": "us", "node-3": "eu", "node-4": "us"}
    plan, _, diff, summary = _live_and_local(
        tmp_path, ["run.steps=4", "scheduler.stages=1"], ["scheduler.allreduce=hierarchical"], 75,
        node_args={n: ["--region", r] for n, r in regions.items()},
    )
    (stage,) = plan.stages
    assert summary.steps == 4 and len(stage.node_ids) == 4 and stage.hierarchical_allreduce
    assert sorted(stage.regions) == ["eu", "eu", "us", "us"]
    assert all("averaging region by region" in (tmp_path / f"{n}.log").read_text() for n in regions)
    assert diff <= 1e-4


# -- robust averaging: CenteredClip, and outsiders ---------------------------------------------------------------


def test_centered_clip_moves_at_most_the_outliers_share_of_the_radius():
    from geotrain.node.reducers import centered_clip

    g = torch.Generator().manual_seed(5)
    honest = torch.randn(1000, generator=g, dtype=torch.float64)
    values = [honest + 1e-3 * torch.randn(1000, generator=g, dtype=torch.float64) for _ in range(3)]
    values.append(100 * honest)
    radius = 0.1 * 1000**0.5
    estimate, clipped = centered_clip(values, radius)
    assert clipped == [3]
    honest_mean = sum(values[:3]) / 3
    # At its fixed point the honest pull, 3 |v - m|, balances the outlier's, at most the radius.
    assert (estimate - honest_mean).norm() <= radius / 3 + 1e-6
    assert (sum(values) / 4 - honest_mean).norm() > 100 * radius  # the mean would follow the outlier
    same, none_clipped = centered_clip(values[:3], radius)
    assert none_clipped == [] and torch.allclose(same, honest_mean, atol=1e-9)


def test_a_replica_claiming_a_huge_weight_pulls_no_harder_than_the_others():
    from geotrain.node.reducers import ClipAccumulator

    g = torch.Generator().manual_seed(7)
    n, clip_rms = 1000, 1e-3
    radius = clip_rms * n**0.5
    true = torch.randn(n, generator=g, dtype=torch.float64) * 0.01
    honest = [(true + 1e-5 * torch.randn(n, generator=g, dtype=torch.float64), w) for w in (1.0, 3.0)]
    honest_mean = sum(m * w for m, w in honest) / 4

    def reduce(parts: list[tuple[torch.Tensor, float]]) -> tuple[torch.Tensor, set[int]]:
        clipped: set[int] = set()
        accumulator = ClipAccumulator(torch.Size([n]), clip_rms, clipped)
        for sender, (mean, weight) in enumerate(parts):
            accumulator.add_((sender, mean * weight), weight)  # a part is weight x mean
        return accumulator.div_(0.0), clipped

    # Honest replicas with 1 and 3 microbatches: nobody is clipped, and the result is their weighted mean.
    exact, clipped = reduce(honest)
    assert not clipped and torch.equal(exact, honest_mean.float().double())
    # A third replica sends 100x the gradient and claims a billion microbatches: it counts as one replica of three,
    # is clipped, and moves the result by at most its third of the radius (and float32 rounding).
    result, clipped = reduce([*honest, (100 * true, 1e9)])
    assert clipped == {2}
    assert (result - sum(m for m, _ in honest) / 2).norm() <= radius / 2 + 1e-6
    # Claiming an infinite weight, or a NaN part, leaves it out altogether.
    for liar in ((true, math.inf), (true * math.nan, 1.0)):
        result, clipped = reduce([*honest, liar])
        assert clipped == {2} and (result - honest_mean).norm() <= radius


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_replica_sending_a_100x_gradient_is_clipped_and_flagged(averagers, request):
    from geotrain.node.allreduce import replica_all_reduce
    from geotrain.node.averaging import group_id

    clip_rms = 1e-3  # a tenth of the gradients' own scale; the honest replicas differ by far less
    g = torch.Generator().manual_seed(13)
    # 1.6 MB of float64: hivemind cuts parts of 512 KiB, so each replica reduces some of them.
    n = 200_000
    true_grads = [torch.randn(n, generator=g, dtype=torch.float64) * 0.01]
    honest = [[true_grads[0] + 1e-4 * torch.randn(n, generator=g, dtype=torch.float64)] for _ in range(2)]
    attacker = [100 * true_grads[0].clone()]  # a valid member of the group, weight 1 like the others
    honest_mean = (honest[0][0] + honest[1][0]) / 2
    plain_mean = (honest[0][0] + honest[1][0] + attacker[0]) / 3
    tensors = [*honest, attacker]  # all-reduced in place
    peers = [a.peer_id for a in averagers[:3]]
    reduces = [
        replica_all_reduce(a, peers, ["eu"] * 3, 1.0, lambda r, part: group_id(request.node.name, 0, 0, 1, r, part),
                           hierarchical=True, presummed=True, clip_rms=clip_rms)
        for a in averagers[:3]
    ]
    for a in averagers[:3]:
        a.take_clipped()  # whatever earlier tests left
    _together([lambda r=r, t=t: r(0, t) for r, t in zip(reduces, tensors)])
    result = tensors[0][0]
    assert all(torch.equal(t[0], result) for t in tensors)  # every replica, the attacker's too, ends alike
    rms = lambda x: float(x.pow(2).mean().sqrt())  # noqa: E731
    # The option's bound: the clipped attacker's pull (weight 1 of 3) against the two honest replicas' at most
    # clip_rms / 2 (tight: its difference is clipped to exactly the radius), and float32 rounding.
    assert rms(result - honest_mean) <= clip_rms / 2 + 1e-8
    assert rms(plain_mean - honest_mean) > 100 * clip_rms * rms(true_grads[0])
    # Each replica reduces parts of the vector; every one of them clipped the attacker there, and no one else.
    assert [a.take_clipped() for a in averagers[:3]] == [[peers[2]]] * 3


@pytest.mark.cluster
@pytest.mark.timeout(90)
def test_an_outsider_cannot_join_a_stages_averaging(averagers, request):
    from geotrain.node.averaging import Job, group_id

    g = torch.Generator().manual_seed(17)
    members = [[torch.randn(2000, generator=g, dtype=torch.float64)] for _ in range(2)]
    expected = ((members[0][0] + members[1][0]) / 2).float().double()
    peers = [a.peer_id for a in averagers[:2]]
    gid = group_id(request.node.name, 0, 0, 1)
    outsider = averagers[3]
    # It knows the group id (a member's run id leaked) and names itself a member: the members' reducers refuse its
    # parts, since the coordinator's list of peers does not name it.
    poison = [torch.full((2000,), 1e6, dtype=torch.float64)]
    outcome: dict[str, BaseException] = {}

    def intrude() -> None:
        try:
            outsider.average(gid, [*peers, outsider.peer_id], poison, 1.0)
        except BaseException as e:  # noqa: BLE001 - what it failed with is checked below
            outcome["error"] = e

    _together([
        *[lambda a=a, t=t: a.average_all([Job(gid, peers, t, 1.0, presummed="mean")])
          for a, t in zip(averagers[:2], members)],
        intrude,
    ])
    for t in members:
        assert torch.equal(t[0].float().double(), expected)
    assert "error" in outcome, "the outsider's all-reduce completed"


@pytest.mark.cluster
@pytest.mark.timeout(90)
def test_a_sync_every_32_steps_averages_over_30x_fewer_bytes_per_step_than_every_step(averagers):
    # The same stage on two real hivemind peers, averaged as node.commit does: a step's float64 gradient sums
    # (every_step), then a sync's pseudo-gradients (diloco), each counted by the averagers' own byte counters.
    from geotrain.node.allreduce import replica_all_reduce
    from geotrain.node.averaging import group_id

    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16",
                             "compression.replica_sync=diloco", "compression.replica_sync_every=32"])
    pair = averagers[:2]
    runtimes = [StageRuntime(cfg, 0, cfg.model.total_layers) for _ in pair]
    for i, runtime in enumerate(runtimes):
        x = torch.randint(0, 256, (cfg.train.microbatch_size, cfg.model.seq_len), generator=torch.Generator().manual_seed(i))
        runtime.forward((0, i), x)
        runtime.loss_backward((0, i), x)
        with torch.no_grad():
            runtime.parameters()[0].add_(0.01 * (i + 1))  # apart from the anchor, as after inner steps

    def all_reduces(name: str):
        peers = [a.peer_id for a in pair]
        return [replica_all_reduce(a, peers, ["r", "r"], 1.0, lambda r, part: group_id(name, 0, 0, 1, r, part),
                                   hierarchical=False, presummed=True) for a in pair]

    def sent(calls) -> int:
        before = sum(a.bytes_sent for a in pair)
        _together(calls)
        return sum(a.bytes_sent for a in pair) - before

    step = sent([lambda r=r, f=f: r.mean_gradients(0, lambda sums: f(0, sums))
                 for r, f in zip(runtimes, all_reduces("every-step"))])
    pseudo = [r.sync.pseudo_gradient(r.parameters()) for r in runtimes]
    sync = sent([lambda p=p, f=f: f(0, p) for p, f in zip(pseudo, all_reduces("diloco"))])
    assert torch.equal(pseudo[0][0], pseudo[1][0])  # the all-reduce ran: both hold the mean
    h = cfg.compression.replica_sync_every
    print(json.dumps({"every_step_averaging_bytes_per_step": step, "diloco_averaging_bytes_per_step": sync / h,
                      "replica_sync_every": h, "ratio": step / (sync / h)}))
    assert step > 0 and sync > 0 and step / (sync / h) >= 30
