"""scheduler/profiles: reports are checked, and stored reports become the planner's nodes, model and network."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from geotrain.config import load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler import placement
from geotrain.scheduler.calibration import Corrections, StepTimings
from geotrain.scheduler.checkpoint import CheckpointStore
from geotrain.scheduler.coordinator import Coordinator, Member
from geotrain.scheduler.costmodel import StepShape
from geotrain.scheduler.planner import plan
from geotrain.scheduler.profiles import DEFAULT_INTRA_REGION, check_report, device_class, planner_inputs

CFG = load_config(None, ["model.n_layers=2"])
LAYERS = CFG.model.total_layers
HIDDEN = CFG.train.microbatch_size * CFG.model.seq_len * CFG.model.d_model * 4


def _report(node_id: str, seconds: float = 0.01, links: dict[str, tuple[float, float]] | None = None):
    """A well-formed report; links maps peer -> (Mbit/s, round trip ms)."""
    return pb.NodeProfileReport(
        node_id=node_id,
        layer_seconds=[seconds] * LAYERS,
        boundary_bytes=[HIDDEN] * (LAYERS - 1) + [0],
        param_bytes=[1000 * (i + 1) for i in range(LAYERS)],
        activation_bytes=[5 * HIDDEN] * LAYERS,
        memory_bytes=8 << 30,
        device="cpu",
        precision="fp32",
        param_shapes=[pb.LayerShapes(tensors=[pb.TensorShape(dims=[10, 25 * (i + 1)])]) for i in range(LAYERS)],
        links=[pb.LinkProbe(peer=p, bandwidth_bps=mbps * 1e6, rtt_s=ms / 1e3) for p, (mbps, ms) in (links or {}).items()],
    )


def _member(node_id: str, region: str, report: pb.NodeProfileReport | None) -> Member:
    member = Member(node_id, "127.0.0.1:1", region, 0.0, 0.0)
    member.profile = report
    return member


def test_reports_become_planner_inputs():
    members = [
        _member("a", "eu", _report("a", 0.01, {"b": (100, 20), "c": (10, 100), "coordinator": (1000, 1)})),
        _member("b", "eu", _report("b", 0.02, {"a": (50, 40)})),
        _member("c", "us", _report("c", 0.01, {"a": (30, 100)})),
        _member("d", "us", None),  # joined, not profiled yet
    ]
    nodes, model, network = planner_inputs(members, CFG)
    assert [n.node_id for n in nodes] == ["a", "b", "c"]
    assert nodes[1].layer_seconds == [0.02] * LAYERS and nodes[1].region == "eu" and nodes[1].memory_bytes == 8 << 30
    assert model.boundary_bytes == [HIDDEN] * (LAYERS - 1) + [0]
    assert model.layer_param_bytes == [1000 * (i + 1) for i in range(LAYERS)]
    assert model.layer_param_shapes == [[(10, 25 * (i + 1))] for i in range(LAYERS)]
    assert model.layer_activation_bytes == [5 * HIDDEN] * LAYERS
    # Both directions fold into one link: a step pays 1/bw of each way; the latency is half the mean round trip.
    ab = network.pair_overrides[("a", "b")]
    assert ab.bandwidth_bps == pytest.approx(2 / (1 / 100e6 + 1 / 50e6))
    assert ab.latency_s == pytest.approx(0.015)
    assert network.pair_overrides[("a", "c")].bandwidth_bps == pytest.approx(2 / (1 / 10e6 + 1 / 30e6))
    assert ("a", "coordinator") not in network.pair_overrides
    # A node's probe of the coordinator is its round trip there; not probed yet, it counts none.
    assert [n.coordinator_rtt_s for n in nodes] == [0.001, 0.0, 0.0]
    # Region links for pairs nobody measured: the median of what was measured between (or inside) those regions.
    assert network.region_link("eu", "us").bandwidth_bps == pytest.approx(15e6)
    assert network.region_link("eu", "eu").bandwidth_bps == pytest.approx(ab.bandwidth_bps)
    assert network.region_link("us", "us") == network.region_link("eu", "eu")
    assert network.region_link("us", "asia") == network.region_link("eu", "us")
    # The planner takes them as they are.
    shape = StepShape(microbatches=4, microbatch_size=CFG.train.microbatch_size)
    result = plan(nodes=nodes, model=model, network=network, shape=shape)
    assert math.isfinite(result.step_seconds) and result.stages


def test_a_nodes_device_class_is_its_device_kind_model_torch_build_and_precision():
    def on(device: str, name: str = "NVIDIA H100 80GB HBM3", build: str = "2.5.1+cu124 cuda 12.4", precision="fp32"):
        report = _report("a")
        report.device, report.device_name, report.torch_build, report.precision = device, name, build, precision
        return device_class(report)

    assert on("cuda:0") == on("cuda:3")  # which GPU of a machine it is does not change its bits
    others = {on("cpu"), on("cuda:0", name="NVIDIA A100-SXM4-80GB"), on("cuda:0", build="2.4.0+cu121 cuda 12.1"),
              on("cuda:0", precision="bf16")}
    assert len(others) == 4 and on("cuda:0") not in others
    nodes, _, _ = planner_inputs([_member("a", "r", _report("a"))], CFG)
    assert nodes[0].device_class == device_class(_report("a"))


def test_without_measured_pairs_the_defaults_apply():
    nodes, _, network = planner_inputs([_member("a", "eu", _report("a"))], CFG)
    assert len(nodes) == 1 and not network.pair_overrides
    assert network.intra_region == DEFAULT_INTRA_REGION
    assert network.default_inter_region is not None


def test_no_profile_yet_is_an_error():
    with pytest.raises(ValueError, match="no node"):
        planner_inputs([_member("a", "eu", None)], CFG)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.layer_seconds.pop(), "layer_seconds has"),
        (lambda r: r.boundary_bytes.append(1), "boundary_bytes has"),
        (lambda r: r.layer_seconds.__setitem__(0, 0.0), r"layer_seconds\[0\] must be in"),
        (lambda r: r.layer_seconds.__setitem__(0, math.nan), r"layer_seconds\[0\] must be in"),
        (lambda r: setattr(r, "unfit", "x\x1b[2J"), "unfit must be printable"),
        (lambda r: r.links.add(peer="b", bandwidth_bps=math.inf, rtt_s=0.1), "bandwidth to b"),
        (lambda r: r.links.add(peer="b", bandwidth_bps=1e6, rtt_s=-1), "round trip to b"),
        (lambda r: r.links.add(peer="", bandwidth_bps=1e6, rtt_s=0.1), "peer must be"),
        (lambda r: setattr(r, "node_id", ""), "node_id"),
        (lambda r: r.param_shapes.add(tensors=[pb.TensorShape(dims=[2, 3])]), "param_shapes has"),
        (lambda r: r.param_shapes[0].tensors.add(dims=[4, 0]), "layer 0 has a parameter shape"),
        (lambda r: setattr(r, "device", "tpu:0"), "device must be"),
        (lambda r: setattr(r, "device", ""), "device must be"),
        (lambda r: setattr(r, "device_name", "x\x1b[2J"), "device_name must be printable"),
        (lambda r: setattr(r, "precision", "fp8"), "precision must be"),
        (lambda r: setattr(r, "torch_build", "2.5\n"), "torch_build must be printable"),
        (lambda r: setattr(r, "torch_build", "2" * 101), "torch_build must be printable and at most 100"),
        (lambda r: setattr(r, "copy_bytes_per_s", -1.0), "copy_bytes_per_s"),
    ],
)
def test_malformed_reports_are_rejected(change, message):
    report = _report("a")
    check_report(report, LAYERS)
    change(report)
    with pytest.raises(ValueError, match=message):
        check_report(report, LAYERS)


EXTREMES = [0.0, 5e-324, 1e308, math.nan, math.inf, -math.inf]


def _set_number(report: pb.NodeProfileReport, field: str, value: float) -> None:
    """Put `value` in one numeric field of a report: a per-layer list's first entry, a link's, or a scalar."""
    if field in ("bandwidth_bps", "rtt_s"):
        link = {"bandwidth_bps": 1e6, "rtt_s": 0.1, field: value}
        report.links.add(peer="b", **link)
    elif field == "layer_seconds":
        report.layer_seconds[0] = value
    else:
        setattr(report, field, value)


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize(
    "field, refused",
    [("layer_seconds", EXTREMES), ("bandwidth_bps", EXTREMES), ("rtt_s", EXTREMES[2:]),
     ("copy_bytes_per_s", EXTREMES[2:])],
)
def test_extreme_numbers_are_refused_with_one_reason(field, refused, value):
    """0, the smallest subnormal, 1e308, NaN and infinities in a time or a link are refused, naming the field; a zero
    round trip or copy speed (a node without a device copy) is a measurement."""
    report = _report("a")
    _set_number(report, field, value)
    if value not in refused and not math.isnan(value):
        check_report(report, LAYERS)
        return
    with pytest.raises(ValueError, match=r"must be in \[") as err:
        check_report(report, LAYERS)
    assert str(err.value).count("must be") == 1


@pytest.mark.parametrize("field", ["memory_bytes", "boundary_bytes", "param_bytes", "activation_bytes"])
def test_byte_counts_past_any_hardware_are_refused(field):
    report = _report("a")
    if field == "memory_bytes":
        report.memory_bytes = 2**64 - 1
    else:
        getattr(report, field)[0] = 2**64 - 1
    with pytest.raises(ValueError, match=f"{field}.* must be in"):
        check_report(report, LAYERS)


def test_coordinator_keeps_the_latest_profile_and_shows_measured_links():
    coordinator = Coordinator(CFG)
    for node_id in ("a", "b"):
        coordinator.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address="x:1"))
    coordinator.heartbeat(pb.HeartbeatRequest(node_id="a", links=[pb.LinkCounter(peer="b", raw_bytes=8, wire_bytes=4)]))
    with pytest.raises(KeyError):
        coordinator.report_profile(_report("nobody"))
    with pytest.raises(ValueError):
        coordinator.report_profile(pb.NodeProfileReport(node_id="a"))
    coordinator.report_profile(_report("a", links={"coordinator": (500, 2)}))
    coordinator.report_profile(_report("a", links={"coordinator": (500, 2), "b": (20, 60)}))
    assert [p.peer for p in coordinator.members["a"].profile.links] == ["coordinator", "b"]
    status = coordinator.status()
    links = {(link.src, link.dst): link for link in status.links}
    assert links[("a", "b")].bandwidth_mbps == pytest.approx(20) and links[("a", "b")].latency_ms == pytest.approx(30)
    assert links[("a", "b")].wire_bytes == 4  # the traffic counters stay on the same entry
    assert links[("a", "coordinator")].bandwidth_mbps == pytest.approx(500)
    nodes = {n.node_id: n for n in status.nodes}
    assert nodes["a"].profiled_microbatch_s == pytest.approx(0.01 * LAYERS) and nodes["a"].memory_bytes == 8 << 30
    assert nodes["b"].profiled_microbatch_s == 0
    # Restarted (a new address) in the same region, a node is planned with its last profile until it sends a new
    # one; in another region, it is a different machine.
    coordinator.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id="a", address="x:2"))
    assert coordinator.members["a"].profile.links[-1].peer == "b"
    coordinator.register(
        pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id="a", address="x:3", region="elsewhere")
    )
    assert coordinator.members["a"].profile is None
    coordinator.store.close()


def test_links_measured_again_slower_make_the_coordinator_replan(tmp_path):
    coordinator = Coordinator(CFG, checkpoints=CheckpointStore(tmp_path, keep=1))  # measured placement re-plans
    for node_id, region in (("a", "eu"), ("b", "us")):
        coordinator.register(
            pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=f"{node_id}:1", region=region)
        )
        coordinator.report_profile(_report(node_id, links={"b" if node_id == "a" else "a": (100, 20)}))
    groups = [[coordinator.members["a"]], [coordinator.members["b"]]]
    ranges = [(0, LAYERS // 2), (LAYERS // 2, LAYERS)]
    coordinator.planning.update_estimate(ranges, groups)
    assert not coordinator.planning.drifted()  # the estimate when the plan was made
    coordinator.report_profile(_report("a", links={"b": (90, 22)}))
    coordinator.planning.update_estimate(ranges, groups)
    assert not coordinator.planning.drifted(), "a few percent of measurement noise does not move layers"
    coordinator.report_profile(_report("a", links={"b": (0.5, 300)}))
    coordinator.report_profile(_report("b", links={"a": (0.5, 300)}))
    coordinator.planning.update_estimate(ranges, groups)
    assert coordinator.planning.drifted()
    assert any(kind == "drift" for _, kind, _, _ in coordinator.store.events())
    coordinator.store.close()


def test_in_run_times_move_the_estimate_and_a_plans_second_step_fixes_its_prediction(tmp_path):
    coordinator = Coordinator(CFG, checkpoints=CheckpointStore(tmp_path, keep=1))  # measured placement re-plans
    for node_id, peer in (("a", "b"), ("b", "a")):
        coordinator.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=f"{node_id}:1"))
        coordinator.report_profile(_report(node_id, seconds=0.01, links={peer: (100, 20)}))
    planning = coordinator.planning
    ranges, groups = planning._planned_layout()  # the planner's, as replan() installs it
    planning.update_estimate(ranges, groups)
    window = planning.estimate.chosen_inflight
    planning.plan = pb.Plan(epoch=1, inflight=window, stages=[
        pb.StageAssignment(index=i, layer_start=start, layer_end=end, node_ids=[m.node_id for m in group])
        for i, ((start, end), group) in enumerate(zip(ranges, groups))
    ])
    assert not planning.drifted()  # the estimate when the plan was made
    profiled = planning.estimate.step_seconds

    def timings(factor: float) -> StepTimings:
        """Every node's stage at `factor` times its profile's layer times, and a commit of 0.05 s."""
        compute = {m.node_id: factor * 0.01 * (end - start) for (start, end), group in zip(ranges, groups) for m in group}
        return StepTimings(plan_epoch=1, commit_s=0.05, compute_s=compute, averaging_s={})

    planning.after_commit(timings(5.0))  # the plan's first step, which pays for starting it
    assert coordinator.store.get("predicted_step_s") is None
    planning.after_commit(timings(3.0))  # the first steady one: the first step's timings no longer count
    measured = Corrections(scales={m.node_id: 3.0 for group in groups for m in group}, run_scale=3.0, commit_s=0.05)
    expected = placement.estimate(CFG, ranges, groups, measured, window).step_seconds
    assert planning.estimate.step_seconds == pytest.approx(expected) and expected > 2 * profiled
    prediction = json.loads(coordinator.store.get("predicted_step_s"))
    assert prediction["plan_epoch"] == 1 and prediction["step_s"] == pytest.approx(expected)
    # Far slower than when the plan was made, but every node is as much slower: the planner keeps the layout, and the
    # plan stands (no new epoch), its new estimate the one drift is measured from.
    drift = [detail for _, kind, _, detail in coordinator.store.events() if kind == "drift"]
    assert len(drift) == 1 and drift[0].endswith("slower than estimated when made; the planner keeps its layout")
    assert not planning.drifted()
    # Later steps move the estimate on, never the plan's prediction: the steps it is measured against come after it.
    planning.after_commit(timings(1.0))
    assert planning.estimate.step_seconds < expected
    assert json.loads(coordinator.store.get("predicted_step_s"))["step_s"] == pytest.approx(expected)
    coordinator.store.close()


def test_no_drift_is_judged_before_the_plans_links_are_measured(tmp_path):
    # A plan is made from profiles that price its links with defaults: its nodes probe their next stage once they
    # take it up. Those reports move the estimate a lot, and are no drift; drift is judged from the estimate once
    # every link is in.
    coordinator = Coordinator(CFG, checkpoints=CheckpointStore(tmp_path, keep=1))  # measured placement re-plans
    for node_id in ("a", "b"):
        coordinator.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=f"{node_id}:1"))
        coordinator.report_profile(_report(node_id, links={"coordinator": (500, 2)}))
    planning = coordinator.planning
    ranges = [(0, LAYERS // 2), (LAYERS // 2, LAYERS)]
    planning.plan = pb.Plan(epoch=1, stages=[
        pb.StageAssignment(index=i, layer_start=start, layer_end=end, node_ids=[node_id])
        for i, ((start, end), node_id) in enumerate(zip(ranges, ("a", "b")))
    ])
    groups = [[coordinator.members["a"]], [coordinator.members["b"]]]
    planning.update_estimate(ranges, groups)
    assert not planning.drifted()
    made = planning.estimate.step_seconds
    coordinator.report_profile(_report("a", links={"coordinator": (500, 2), "b": (1, 300)}))  # a's probe of b
    planning.update_estimate(ranges, groups)
    assert planning.estimate.step_seconds > 2 * made  # what a drift of the plan would be
    assert not planning.drifted()
    assert [kind for _, kind, _, _ in coordinator.store.events() if kind == "drift"] == []
    # From then on, the estimate with every link in is the plan's own, and a link slower again is drift.
    coordinator.report_profile(_report("a", links={"coordinator": (500, 2), "b": (0.05, 600)}))
    planning.update_estimate(ranges, groups)
    assert planning.drifted() or any(kind == "drift" for _, kind, _, _ in coordinator.store.events())
    coordinator.store.close()


def test_a_plan_made_before_its_profiles_takes_their_window_before_a_step_runs():
    # Uniform placement plans once the nodes joined, before they profiled: under train.inflight = "auto" the plan
    # runs one microbatch per stage until profiles price it.
    cfg = load_config(None, ["model.n_layers=2", "scheduler.placement=uniform"])
    coordinator = Coordinator(cfg)
    for node_id, region in (("a", "eu"), ("b", "us")):
        coordinator.register(
            pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=f"{node_id}:1", region=region)
        )
    planning = coordinator.planning
    ranges = [(0, LAYERS // 2), (LAYERS // 2, LAYERS)]
    planning.update_estimate(ranges, [[coordinator.members["a"]], [coordinator.members["b"]]])
    assert planning.estimate is None
    planning.plan = pb.Plan(epoch=1, inflight=placement.inflight(cfg, None, 2), stages=[
        pb.StageAssignment(index=i, layer_start=start, layer_end=end, node_ids=[node_id])
        for i, ((start, end), node_id) in enumerate(zip(ranges, "ab"))
    ])
    planning.dirty = False
    assert planning.plan.inflight == 2 and planning.is_current()
    # A slow, distant link between the stages: a round trip holds many microbatches at its pace.
    coordinator.report_profile(_report("a", links={"b": (1, 300)}))
    assert planning.is_current(), "b has not profiled yet"
    coordinator.report_profile(_report("b", links={"a": (1, 300)}))
    assert not planning.is_current()
    assert planning.estimate.chosen_inflight > 2
    assert [detail for _, kind, _, detail in coordinator.store.events() if kind == "window"] == [
        f"the estimate's window is {planning.estimate.chosen_inflight} microbatches, the plan's 2"
    ]
    coordinator.store.close()
