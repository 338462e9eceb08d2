"""The device paths (issue 29) on the CPU, and the few checks that need a CUDA GPU (skipped without one): the
deterministic settings a CUDA device gets, capability asked of the chosen GPU, the sender's turns that keep a
link's encodes in the worker's order off the worker thread, a checksum taken when asked, a stage's step on a
stand-in device, the GPU smoke check's verdict, task timing by device events, pinned decoding, a GPU's SM count in
its class, pools whose threads use the node's GPU, usable memory read after empty_cache, and peak memory's units."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import threading
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from geotrain.compression import base as compression_base
from geotrain.compression import codecs as compression_codecs
from geotrain.compression import get_codec
from geotrain.compression.policy import StageTimer
from geotrain.config import load_config
from geotrain.node import device as device_module
from geotrain.node.dataplane import DataPlane
from geotrain.node import profiler
from geotrain.node.device import HostCopies, TaskClock, TaskSpan, make_exact, supports
from geotrain.node.stage import StageRuntime
from geotrain.node.worker import Worker
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.profiles import device_class as profile_class
from tests.conftest import REPO
from tests.fakedevice import FakeDevice

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_SETTINGS = """
import json, os, sys, torch
from geotrain.node.device import make_exact
def settings():
    return {
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    "cudnn_deterministic": torch.backends.cudnn.deterministic, "cudnn_benchmark": torch.backends.cudnn.benchmark,
    "tf32": torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32,
    "flash": torch.backends.cuda.flash_sdp_enabled(), "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
    "math": torch.backends.cuda.math_sdp_enabled(),
    }
make_exact(torch.device("cpu"))
cpu = settings()
make_exact(torch.device("cuda", 1))
print(json.dumps({"cpu": cpu, "cuda": settings()}))
"""


@pytest.mark.timeout(60)
def test_a_cuda_device_gets_the_deterministic_settings_and_the_cpu_none():
    """In a fresh process (the settings are global): a CUDA device turns on deterministic algorithms (warning where
    torch has none), cuBLAS's fixed workspace, deterministic cuDNN without autotuning or TF32, and the math SDPA
    backend alone; the CPU changes nothing. Setting them needs no GPU, so this runs anywhere."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # no CUBLAS_WORKSPACE_CONFIG of the caller's
    out = subprocess.run([sys.executable, "-c", _SETTINGS], capture_output=True, text=True, env=env, timeout=60,
                         check=True)
    after = json.loads(out.stdout)
    assert after["cuda"] == {
        "deterministic": True, "warn_only": True, "cublas": ":4096:8", "cudnn_deterministic": True,
        "cudnn_benchmark": False, "tf32": False, "flash": False, "mem_efficient": False, "math": True,
    }
    cpu = after["cpu"]
    assert not cpu["deterministic"] and cpu["cublas"] is None and cpu["flash"] and not cpu["cudnn_deterministic"]


@pytest.mark.timeout(10)
def test_bf16_support_is_asked_of_the_chosen_gpu(monkeypatch):
    """is_bf16_supported answers for the current GPU (cuda:0 in a thread that set none): supports() asks the
    capability of the GPU it is given."""
    asked = []

    def capability(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return (7, 5) if torch.device(device).index == 1 else (9, 0)

    monkeypatch.setattr(device_module.torch.cuda, "get_device_capability", capability)
    assert supports(torch.device("cuda", 0), "bf16") and not supports(torch.device("cuda", 1), "bf16")
    assert supports(torch.device("cuda", 1), "fp16") and asked == [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.timeout(20)
def test_encodes_off_the_worker_run_in_the_order_the_worker_took_their_turns():
    """Senders that start in the reverse order still encode a link's tensors in the order the worker made them,
    one that fails passes its turn on, and another link's turns are its own."""
    plane = DataPlane("token", lambda: "n")
    try:
        turns = [plane.take_turn("p", "addr", "forward") for _ in range(5)]
        other = plane.take_turn("q", "addr", "forward")
        assert other.number == 0
        order: list[int] = []

        def encode(turn) -> None:  # noqa: ANN001
            try:
                with plane.in_turn(turn):
                    order.append(turn.number)
                    if turn.number == 2:
                        raise RuntimeError("encoding failed")
            except RuntimeError:
                pass

        threads = [threading.Thread(target=encode, args=(t,)) for t in reversed(turns)]
        for t in threads:
            t.start()
        with plane.in_turn(other):  # not behind p's turns
            pass
        for t in threads:
            t.join(10)
        assert order == [0, 1, 2, 3, 4]
    finally:
        plane.close()


@pytest.mark.timeout(30)
def test_a_checksum_taken_later_is_the_parameters_before_the_next_write_and_sees_one_bit():
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers)
    before = runtime.checksum()
    later = runtime.checksum_later()
    state = {name: p.detach().clone() for name, p in runtime.named_state()}
    bits = state[runtime.named_state()[1][0]].view(-1)[:1].view(torch.int32)
    bits ^= 1  # the last bit of one value
    runtime.load_parameters(state)  # the stage's next write, which the checksum taken before it is not of
    assert later() == before != runtime.checksum()
    # The same definition as a checkpoint's (name order, raw bytes), over the host copies the node hashes.
    assert runtime.checksum() == framing.parameters_checksum(
        (name, t.clone()) for name, t in reversed(runtime.named_state())
    )


@pytest.mark.timeout(10)
def test_a_cpu_task_is_timed_by_its_host_time():
    clock = TaskClock(torch.device("cpu"))
    span = clock.start()
    torch.ones(64, 64) @ torch.ones(64, 64)
    clock.end(span)
    assert span.seconds(wait=False) == span.host_s > 0


@needs_cuda
@pytest.mark.timeout(60)
def test_a_cuda_task_is_timed_by_its_gpu_work_not_its_launches():
    device = torch.device("cuda", 0)
    make_exact(device)
    a = torch.randn(4096, 4096, device=device)
    clock = TaskClock(device)
    span = clock.start()
    for _ in range(20):
        a = a @ a / 4096
    clock.end(span)
    seconds = span.seconds(wait=True)
    assert seconds is not None and seconds >= span.host_s


@needs_cuda
@pytest.mark.timeout(60)
def test_decoded_tensors_land_in_pinned_memory_and_copies_overlap():
    shape = (4, 16, 64)
    values = torch.randn(shape)
    for spec in ("none", "bf16", "int8"):
        codec = get_codec(spec)
        payload = codec.encode(values)
        pinned, plain = codec.decode(payload, shape, torch.float32, pin=True), codec.decode(payload, shape, torch.float32)
        assert pinned.is_pinned() and not plain.is_pinned() and torch.equal(pinned, plain)
    copies = HostCopies(torch.device("cuda", 0))
    on_device = copies.to_device(values)
    host = copies.to_host_async(on_device * 2)
    assert torch.equal(host.wait(), values * 2)
    params = torch.ones(1 << 22, device="cuda:0")
    snapshot = copies.to_host_async(params)
    snapshot.before_writes()  # what StageRuntime.apply does after checksum_later
    params.add_(1.0)
    assert torch.equal(snapshot.wait(), torch.ones(1 << 22))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.timeout(60)
def test_a_thread_computes_on_the_gpu_it_was_given():
    seen = []

    def work() -> None:
        device_module.use_in_this_thread(torch.device("cuda", 1))
        seen.append((torch.cuda.current_device(), torch.ones(2, device="cuda").device.index))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(30)
    assert seen == [(1, 1)]


@pytest.mark.timeout(30)
def test_the_gpu_smoke_check_fails_on_one_bit_or_a_loss_beyond_summation_order_and_skips_without_cuda():
    """bench/gpu_smoke.py's verdict, on made-up runs: one flipped bit of one parameter, or a step loss further off
    than the order of a float64 mean, fails it; equal runs pass. Without CUDA it skips with exit code 3."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "bench" / "gpu_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = smoke  # dataclasses look their module up there
    spec.loader.exec_module(smoke)
    params = {"layers.0.w": torch.randn(3, 4), "layers.1.b": torch.randn(4)}
    reference = smoke.Trained([2.5, 2.25], params, 1.0)
    same = smoke.Trained([2.5, 2.25 * (1 + 1e-15)], {k: v.clone() for k, v in params.items()}, 1.0)
    assert smoke.compare(reference, same)["ok"]
    flipped = {k: v.clone() for k, v in params.items()}
    flipped["layers.1.b"].view(torch.int32)[2] ^= 1
    verdict = smoke.compare(reference, smoke.Trained(same.losses, flipped, 1.0))
    assert not verdict["ok"] and not verdict["bit_equal"] and 0 < verdict["max_abs_diff"] < 1e-6
    assert not smoke.compare(reference, smoke.Trained([2.5, 2.25 * (1 + 1e-9)], params, 1.0))["ok"]
    assert not smoke.compare(reference, smoke.Trained([2.5], params, 1.0))["ok"]  # a step missing
    if not torch.cuda.is_available():
        out = subprocess.run([str(REPO / "bench" / "gpu_smoke.sh")], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
        assert out.returncode == smoke.EXIT_SKIPPED and "no CUDA device" in out.stderr


@pytest.mark.timeout(30)
def test_a_stage_steps_on_a_device_and_reads_no_value_back_before_its_backward_is_queued():
    """A whole stage's step on an accelerator (tests.fakedevice's stand-in): forward, loss, backward, the mean, the
    norms, the optimizer step and the checksum run without mixing devices; no value is read back from the device
    (Tensor.item(), which waits for the device) before the backward is queued; the loss and the norms come to the
    host close to the CPU's (the stand-in's attention decomposes otherwise than the CPU's kernel, so not bit for bit),
    and the checksum is the one of the parameters' values."""
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.seq_len=8",
                             "train.microbatch_size=2"])
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 8), generator=g) for _ in range(2))

    def step(device: torch.device | None) -> tuple[float, list[float], StageRuntime, str]:
        runtime = StageRuntime(cfg, 0, cfg.model.total_layers, device)
        runtime.forward((0, 0), x)
        loss, _ = runtime.loss_backward((0, 0), y)
        runtime.mean_gradients(0)
        parts = runtime.grad_sq_norm_parts()
        runtime.apply(0, 1.0, 1e-3)
        return loss.item(), parts, runtime, runtime.checksum_later()()

    loss, parts, _, _ = step(None)
    fake = FakeDevice()
    with fake:
        on_device, device_parts, runtime, checksum = step(torch.device("meta"))
    names = [op.name for op in fake.ops]
    last_backward = max(i for i, name in enumerate(names) if "backward" in name)
    reads = [i for i, op in enumerate(fake.ops) if op.name == "aten._local_scalar_dense.default"
             and op.tensors[0][0] == "meta"]
    assert reads == [] or reads[0] > last_backward
    assert on_device == pytest.approx(loss, rel=1e-5) and device_parts == pytest.approx(parts, rel=1e-4)
    assert checksum == framing.parameters_checksum((n, fake.value(p)) for n, p in runtime.named_state())


@pytest.mark.timeout(10)
def test_a_gpus_name_carries_its_sm_count_so_a_cut_down_part_is_another_class(monkeypatch):
    """cuBLAS picks kernels by the multiprocessor count, so a MIG slice or a cut-down part that keeps the model's
    name is another device class (the planner's and the verifiers')."""
    sms = {0: 132, 1: 60}
    monkeypatch.setattr(device_module.torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=sms[d.index]))
    names = [device_module.device_name(torch.device("cuda", i)) for i in (0, 1)]
    assert names == ["NVIDIA H100 80GB HBM3, 132 SMs", "NVIDIA H100 80GB HBM3, 60 SMs"]
    reports = [pb.NodeProfileReport(device=f"cuda:{i}", device_name=n, torch_build="2.5.1+cu124 cuda 12.4",
                                    precision="bf16") for i, n in enumerate(names)]
    assert profile_class(reports[0]) != profile_class(reports[1])


@pytest.mark.timeout(20)
def test_a_device_pools_threads_compute_on_the_nodes_gpu(monkeypatch):
    """CUDA's current device is per thread and GPU 0 until set: every thread of a node's pools (senders, verifier)
    sets the node's GPU before its first task."""
    chosen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(device_module.torch.cuda, "set_device",
                        lambda d: chosen.append((threading.current_thread().name, d)))
    pool = device_module.device_pool(torch.device("cuda", 1), 2, "verify")
    try:
        assert pool.submit(lambda: threading.current_thread().name).result(10).startswith("verify")
    finally:
        pool.shutdown(wait=True)
    assert chosen and all(name.startswith("verify") and d == torch.device("cuda", 1) for name, d in chosen)
    before = list(chosen)
    device_module.use_in_this_thread(torch.device("cpu"))  # nothing to set on the CPU
    assert chosen == before


@pytest.mark.timeout(10)
def test_usable_gpu_memory_is_read_after_the_caching_allocator_gives_its_reserve_back(monkeypatch):
    calls: list[str] = []
    cuda = device_module.torch.cuda
    monkeypatch.setattr(cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(cuda, "mem_get_info", lambda d: calls.append("mem_get_info") or (6 << 30, 80 << 30))
    monkeypatch.setattr(cuda, "memory_allocated", lambda d: 2 << 30)
    usable = profiler.available_memory_bytes(torch.device("cuda", 1), headroom_bytes=1 << 30)
    assert calls == ["empty_cache", "mem_get_info"]
    assert usable == (6 << 30) + (2 << 30) - (1 << 30)  # free, and what the process holds there already


@pytest.mark.timeout(10)
def test_peak_host_memory_is_in_bytes_on_macos_and_linux(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=3000))
    monkeypatch.setattr(sys, "platform", "darwin")  # macOS reports bytes
    assert device_module.peak_memory_bytes(torch.device("mps")) == 3000
    monkeypatch.setattr(sys, "platform", "linux")  # Linux KiB
    assert device_module.peak_memory_bytes(torch.device("cpu")) == 3000 * 1024


class _Event:
    """A CUDA event's part TaskSpan uses: done when the test says, `at` seconds into the stream."""

    def __init__(self, at: float) -> None:
        self.at, self.done = at, False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1e3


@pytest.mark.timeout(10)
def test_a_task_counts_its_own_device_time_in_order_even_when_a_later_one_finishes_first():
    """A task's launches return before its GPU work is done: it is timed by its stream's events, counted once they
    have passed (waiting only where asked), in the order the tasks ran, each with its own device seconds."""
    worker = Worker.__new__(Worker)  # the worker's timing part alone
    worker.compute, worker._spans, worker._timed = StageTimer(), deque(), (0, {})
    slow = TaskSpan((_Event(0.0), _Event(0.5)))  # a forward that keeps the GPU busy half a second
    quick = TaskSpan((_Event(0.5), _Event(0.6)))  # a backward queued after it
    for span in (slow, quick):
        span.end()
    quick._events[1].done = True
    worker._spans.extend([("forward", 3, slow), ("backward", 3, quick)])
    worker._settle_spans(wait=False)
    assert slow.seconds(wait=False) is None and len(worker._spans) == 2  # the first is still on the device
    # Waits, then each task counts its own time, by its kind.
    assert worker.take_task_s(3) == {"forward": pytest.approx(0.5), "backward": pytest.approx(0.1)}
    assert worker.compute.per_microbatch() == pytest.approx(0.6) and not worker._spans


@pytest.mark.timeout(20)
def test_a_decoder_writes_into_the_one_pinned_tensor_it_returns(monkeypatch):
    """For a CUDA node every decoder fills the pinned tensor it returns (allocated once, by compression.base's
    new_tensor) rather than decoding into plain memory that would be copied again to pin it. Pinning itself needs a
    CUDA device, so here the allocations are recorded instead."""
    made: list[tuple[torch.Tensor, bool]] = []

    def recorded(shape, dtype, pin):  # noqa: ANN001, ANN202
        out = torch.empty(tuple(shape), dtype=dtype)
        made.append((out, pin))
        return out

    monkeypatch.setattr(compression_base, "new_tensor", recorded)
    monkeypatch.setattr(compression_codecs, "new_tensor", recorded)
    shape = (4, 16, 64)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    for spec in ("none", "fp16", "bf16", "int8", "int4", "topk:0.1"):
        codec = get_codec(spec)
        payload = codec.encode(values)
        made.clear()
        pinned = codec.decode(payload, shape, torch.float32, pin=True)
        assert [(t.data_ptr(), pin) for t, pin in made] == [(pinned.data_ptr(), True)], spec
        assert torch.equal(pinned, codec.decode(payload, shape, torch.float32)), spec
