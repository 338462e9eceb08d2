"""What a node may hold and what it will hold: the memory model's terms against a real stage's tensors, the memory a
node reads (psutil, cgroups v1 and v2, --max-memory), a node with no room (0 memory, or out of memory profiling a
layer) reaching the planner and saying why, and the cached layer profile a returning node serves from."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from geotrain.commands.common import parse_size
from geotrain.config import load_config
from geotrain.memory import serving_bytes_per_param, snapshot_bytes_per_param, training_bytes_per_param
from geotrain.node import profiler
from geotrain.node.profiler import NodeProfiler, ProfileCache, available_memory_bytes
from geotrain.node.stage import StageRuntime
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.costmodel import CostModel
from geotrain.scheduler.planner import plan
from geotrain.scheduler.placement import step_shape
from geotrain.scheduler.calibration import Corrections
from geotrain.scheduler.profiles import check_report, planner_inputs

SETTINGS = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "train.microbatch_size=2",
            "train.microbatches=2", "profile.layer_repeats=1", "profile.memory_headroom_mib=0"]
CFG = load_config(None, SETTINGS)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("diloco", [False, True])
def test_the_model_counts_what_a_real_stage_holds(diloco):
    cfg = load_config(None, [*SETTINGS, "compression.replica_sync=diloco"]) if diloco else CFG
    stage = StageRuntime(cfg, 1, cfg.model.total_layers)  # the blocks and the head
    params = stage.parameters()
    count = sum(p.numel() for p in params)
    stage.forward((0, 0), torch.randn(2, 16, 32))
    stage.loss_backward((0, 0), torch.randint(0, 256, (2, 16)))
    sums = stage.grads.sums
    assert {s.dtype for s in sums} == {torch.float64}
    stage.mean_gradients(0)  # each parameter's gradient: the size a microbatch's gradient has in backward
    gradients = stage.gradients()
    stage.apply(0, 1.0, CFG.train.lr)  # AdamW's moments, made at the first step
    moments = [v for state in stage.optimizer.state.values() for v in state.values() if v.dim()]
    # DiLoCo's anchor and outer velocity, fp32 beside the parameters, all run long.
    sync = stage.sync.anchor + stage.sync.velocity if diloco else []
    # While microbatches run: fp32 weights, a microbatch's gradient, the float64 sums and AdamW's moments.
    held = _bytes(params) + _bytes(gradients) + _bytes(sums) + _bytes(moments) + _bytes(sync)
    assert held == training_bytes_per_param(diloco) * count
    # A snapshot is the weights and the moments (full_state less AdamW's step counts), and DiLoCo's state.
    snapshot = [t for _, t in stage.full_state() if t.dim()]
    assert _bytes(snapshot) == snapshot_bytes_per_param(diloco) * count
    after_commit = _bytes(params) + _bytes(gradients) + _bytes(moments) + _bytes(sync)
    assert after_commit + _bytes(snapshot) == serving_bytes_per_param(diloco) * count


class _Coordinator:
    """What NodeProfiler.report sends, kept."""

    def __init__(self) -> None:
        self.reports: list[pb.NodeProfileReport] = []

    def ReportProfile(self, request: pb.NodeProfileReport, timeout: float) -> pb.Ack:  # noqa: N802
        self.reports.append(request)
        return pb.Ack()


def _profiled(cfg=CFG, **kwargs) -> pb.NodeProfileReport:
    coordinator = _Coordinator()
    node = NodeProfiler(coordinator, None, lambda: "n1", 1.0, torch.device("cpu"), **kwargs)
    node.measure_layers(cfg, cfg.train.precision)
    node.report()
    (report,) = coordinator.reports
    check_report(report, cfg.model.total_layers)  # what the coordinator checks: a node with no room is no bad report
    return report


class _Member:
    def __init__(self, node_id: str, report: pb.NodeProfileReport) -> None:
        self.node_id, self.region, self.profile, self.unreachable = node_id, "r", report, False


def _plan(reports: dict[str, pb.NodeProfileReport]):
    nodes, model, network = planner_inputs([_Member(n, r) for n, r in reports.items()], CFG)
    return plan(nodes=nodes, model=model, network=network, shape=step_shape(CFG, model, Corrections()))


@pytest.mark.timeout(30)
def test_a_node_without_room_reaches_the_planner_and_says_why(caplog):
    caplog.set_level(logging.WARNING, logger="geotrain.node.profiler")
    roomy = _profiled()
    assert roomy.baseline_bytes > 0 and roomy.memory_bytes > roomy.baseline_bytes and not roomy.unfit
    assert not caplog.records
    capped = _profiled(max_memory_bytes=roomy.baseline_bytes // 2)  # --max-memory below what the process holds
    assert capped.memory_bytes == roomy.baseline_bytes // 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("this node can hold no stage of this run: the smallest stage (layer ")
    assert "\n" not in line and "--max-memory" in line
    zero = pb.NodeProfileReport()
    zero.CopyFrom(roomy)
    zero.memory_bytes = 0
    check_report(zero, CFG.model.total_layers)
    with pytest.raises(ValueError, match="no node has memory for even a one-layer stage: the smallest"):
        _plan({"a": zero, "b": capped})
    planned = _plan({"a": zero, "b": roomy})
    assert planned.excluded["a"].startswith("memory: has 0.00 GiB beyond its baseline, the smallest stage needs")
    # The plan's estimate for the node that serves: its baseline and its stage.
    assert planned.node_memory_bytes["b"] > roomy.baseline_bytes


@pytest.mark.timeout(30)
@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB\nmore detail"),
    RuntimeError("MPS backend out of memory (MPS allocated: 7.2 GiB, other allocations: 0.4 GiB, max allowed: 9.07 "
                 "GiB). Tried to allocate 3.91 GiB on private pool.\nmore detail"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried"
                 " to allocate 4198498304 bytes (Tried to allocate 3.91 GiB).\nmore detail"),
], ids=["cuda", "mps", "cpu"])
def test_a_layer_out_of_memory_while_profiling_reaches_the_planner_as_that_layer(monkeypatch, caplog, error):
    """CUDA raises torch.OutOfMemoryError; MPS and the CPU's allocator raise a RuntimeError that says so."""
    caplog.set_level(logging.WARNING, logger="geotrain.node.profiler")
    measure = profiler._profile_layer

    def small_device(profile, cfg, index, *args):
        if index == 2:  # the head: its logits are the usual culprit
            raise error
        measure(profile, cfg, index, *args)

    monkeypatch.setattr(profiler, "_profile_layer", small_device)
    report = _profiled()
    assert report.memory_bytes == 0 and report.unfit.startswith("cannot hold layer 2: out of memory profiling layer 2")
    assert "Tried to allocate 3.91 GiB" in report.unfit and "more detail" not in report.unfit
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == f"this node can hold no stage of this run: {report.unfit}"
    # The layers it could not time carry the model's sizes, so its profile describes the model.
    layer = profiler.build_layer(CFG.model, 2, 0)
    assert report.param_bytes[2] == sum(p.numel() * 4 for p in layer.parameters())
    with pytest.raises(ValueError, match="roomiest node .*cannot hold layer 2"):
        _plan({"small": report})
    monkeypatch.undo()
    assert _plan({"small": report, "roomy": _profiled()}).excluded == {"small": report.unfit}  # what `plan` prints


@pytest.mark.timeout(30)
def test_autocasts_weight_copies_count_once_with_each_microbatchs_activations():
    """Under bf16 autocast a layer's matmuls save a 16-bit copy of each weight for backward, one per microbatch
    (autocast's cache): the profiler's activation bytes hold each copy once, and the planner prices those measured
    bytes with no term of its own for the copies (it once added one)."""
    cfg = load_config(None, [*SETTINGS, "train.precision=bf16"])
    layer = profiler.build_layer(cfg.model, 1, 0)
    matrices = [p for p in layer.parameters() if p.dim() == 2]
    saved: dict[int, torch.Tensor] = {}  # storage -> a bf16 tensor saved from it

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16:
            saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        profiler.call_layer(layer, torch.randn(2, 16, 32), None)

    def copies_of(w: torch.Tensor) -> list[torch.Tensor]:
        copy = w.detach().bfloat16()
        return [t for t in saved.values() if any(t.shape == c.shape and torch.equal(t, c) for c in (copy, copy.T))]

    copies = [copies_of(w) for w in matrices]
    assert [len(c) for c in copies] == [1] * len(matrices)  # one copy of each weight matrix
    report = _profiled(cfg)
    assert report.activation_bytes[1] >= sum(c.untyped_storage().nbytes() for (c,) in copies)

    def need(run_cfg) -> float:
        nodes, model, network = planner_inputs([_Member("a", report)], run_cfg)
        cm = CostModel(nodes=nodes, model=model, network=network, shape=step_shape(run_cfg, model, Corrections()))
        return cm.stage_memory_bytes(1, 2, 1, 1)

    assert need(cfg) == need(CFG)  # the measured bytes alone: precision adds nothing on top


@pytest.mark.timeout(10)
def test_another_error_while_profiling_is_no_verdict_on_memory(monkeypatch):
    def broken(*args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(profiler, "_profile_layer", broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        profiler.profile_layers(CFG, 1.0, 1)


@pytest.mark.timeout(30)
def test_a_returning_node_serves_from_its_cached_profile(tmp_path, monkeypatch, caplog):
    first = _profiled(state_dir=str(tmp_path))
    assert (tmp_path / ProfileCache.NAME).exists()

    def no_timing(*args, **kwargs):
        raise AssertionError("a node with a cached profile timed its layers")

    monkeypatch.setattr(profiler, "profile_layers", no_timing)
    again = _profiled(state_dir=str(tmp_path))
    assert list(again.layer_seconds) == list(first.layer_seconds) and again.param_shapes == first.param_shapes
    # Another model (or device, torch build, precision) is another key: the node measures again.
    monkeypatch.undo()
    wider = load_config(None, [*SETTINGS, "model.d_model=64"])
    cache = ProfileCache(str(tmp_path), profiler.cache_key(wider, torch.device("cpu"), "fp32", 1.0))
    assert cache.load() is None
    other = _profiled(wider, state_dir=str(tmp_path))
    assert other.param_bytes[1] > first.param_bytes[1]
    assert ProfileCache(str(tmp_path), cache.key).load() is not None  # the new one is kept


def _cgroup(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_limits_v1_and_v2_count_the_working_set(tmp_path):
    gib = 2**30
    # v1: the node's cgroup and a tighter parent; inactive page cache does not count as held.
    _cgroup(tmp_path, {
        "proc": "12:memory:/bench/node0\n3:cpu:/\n",
        "memory/bench/node0/memory.limit_in_bytes": str(4 * gib),
        "memory/bench/node0/memory.usage_in_bytes": str(2 * gib),
        "memory/bench/node0/memory.stat": f"total_inactive_file {gib}\ntotal_rss {gib}\n",
        "memory/bench/memory.limit_in_bytes": str(9223372036854771712),  # v1's "unlimited"
        "memory/bench/memory.usage_in_bytes": str(2 * gib),
    })
    assert profiler._cgroup_room(str(tmp_path / "proc"), tmp_path) == 3 * gib
    v2 = tmp_path / "v2"
    _cgroup(v2, {
        "proc": "0::/user/job\n",
        "user/job/memory.max": "max",
        "user/job/memory.current": str(gib),
        "user/memory.max": str(3 * gib),
        "user/memory.current": str(2 * gib),
        "user/memory.stat": "inactive_file 0\n",
    })
    assert profiler._cgroup_room(str(v2 / "proc"), v2) == gib
    assert profiler._cgroup_room(str(tmp_path / "none"), tmp_path / "empty") is None


def test_memory_reads_portably_and_a_cap_bounds_it(monkeypatch):
    import psutil

    usable = available_memory_bytes()
    assert 0 < usable <= profiler.process_bytes() + psutil.virtual_memory().total
    assert available_memory_bytes(cap_bytes=1 << 20) == 1 << 20
    assert available_memory_bytes(headroom_bytes=1 << 62) == 0

    def unreadable():
        raise psutil.Error("no such platform")

    monkeypatch.setattr(psutil, "virtual_memory", unreadable)
    monkeypatch.setattr(profiler, "_cgroup_room", lambda: None)
    assert profiler.host_available_bytes() is None
    assert available_memory_bytes() == 0  # unknown: no room claimed, the planner says so
    assert available_memory_bytes(cap_bytes=5 << 30) == 5 << 30  # the volunteer's cap stands for it


def test_max_memory_sizes():
    assert [parse_size(s) for s in ("12GiB", "800MiB", "16GB", "12G", "1.5GiB", "4096")] == [
        12 << 30, 800 << 20, 16 * 10**9, 12 << 30, 3 << 29, 4096]
    for bad in ("12Gx", "", "-1G", "0", "GiB", "1e9"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a size such as 12GiB"):
            parse_size(bad)
