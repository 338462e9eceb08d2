"""The device a node computes on and the precision it computes in: choosing them, describing them, and moving
tensors between host and device.

CPU, CUDA and MPS share every code path: on the CPU the copies below are plain no-ops, so train-local, the tests
(which run on CPUs) and a GPU node run the same lines.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
from concurrent import futures

import psutil
import torch

from geotrain.config import TrainSection

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


class DeviceError(ValueError):
    """The asked-for device is not there, or cannot compute in the run's precision; the message says which."""


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(spec: str) -> torch.device:
    """The torch device `--device spec` names: auto picks CUDA, then MPS, then the CPU; DeviceError if absent. A
    CUDA device gets the deterministic settings (make_exact) here, before anything computes on it."""
    device = _named_device(spec)
    make_exact(device)
    return device


def make_exact(device: torch.device) -> None:
    """On CUDA, the settings under which the same program computes the same bits on the same GPU model, torch build
    and driver (what a pipeline's replicas and train-local must agree on): cuBLAS's fixed workspace (read when its
    first handle is made, so set before any matmul), deterministic algorithms where torch has them (warn_only: an op
    with none warns rather than stops a run; its bits may then differ), no cuDNN autotuning, no TF32, and the math
    backend of scaled_dot_product_attention (flash and memory-efficient backwards add with atomics). A no-op on the
    CPU (deterministic already) and on MPS (torch has no such switches for it)."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)


# How torch says a device ran out of memory, beside torch.OutOfMemoryError (CUDA's): MPS raises a plain RuntimeError
# ("MPS backend out of memory (MPS allocated: ..."), and so does the CPU's allocator ("DefaultCPUAllocator: can't
# allocate memory: ...").
_OUT_OF_MEMORY = ("MPS backend out of memory", "can't allocate memory")


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is torch's report that the device (CUDA, MPS or the CPU) had no memory for an allocation."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _OUT_OF_MEMORY)


def use_in_this_thread(device: torch.device) -> None:
    """Make `device` the current CUDA device of the calling thread (CUDA's current device is per thread, and is
    GPU 0 until set): every thread that computes or copies calls it first. A no-op elsewhere."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_pool(device: torch.device, workers: int, name: str) -> futures.ThreadPoolExecutor:
    """A thread pool whose threads compute or copy on `device` (use_in_this_thread in each before its first task)."""
    return futures.ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix=name, initializer=use_in_this_thread, initargs=(device,)
    )


def _named_device(spec: str) -> torch.device:
    name = spec.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not _mps_available():
            raise DeviceError("--device mps: this machine has no usable MPS device (Apple silicon, macOS 12.3+)")
        return torch.device("mps")
    kind, _, index = name.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise DeviceError(f"--device {spec!r} is not a device; use {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise DeviceError(f"--device {spec}: no CUDA device is available (torch {torch.__version__}, {build})")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise DeviceError(f"--device {spec}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", int(index) if index else torch.cuda.current_device())


def supports(device: torch.device, precision: str) -> bool:
    """Whether `device` computes in `precision` (fp32 everywhere; bf16/fp16 where autocast and the hardware can)."""
    if precision == "fp32" or device.type == "cpu":
        return True  # CPU autocast runs bf16 and fp16 (slowly without AVX512-BF16/AMX, but correctly)
    if device.type == "cuda":
        # Native bf16 from compute capability 8.0 (Ampere), asked of this GPU: is_bf16_supported asks the current one.
        return precision == "fp16" or torch.cuda.get_device_capability(device)[0] >= 8
    try:  # MPS: bf16 needs macOS 14; ask the device rather than the version
        with torch.autocast(device.type, dtype=COMPUTE_DTYPES[precision]):
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        return True
    except (RuntimeError, TypeError):
        return False


def node_precision(device: torch.device, train: TrainSection) -> str:
    """The precision this node computes in: the run's, or fp32 when the device lacks it and the run allows that;
    DeviceError when it refuses."""
    if supports(device, train.precision):
        return train.precision
    if train.precision_fallback == "fp32":
        return "fp32"
    raise DeviceError(
        f"{describe(device)} cannot compute in train.precision = {train.precision!r} and the run's "
        "train.precision_fallback is 'refuse'"
    )


def device_name(device: torch.device) -> str:
    """What the device is, e.g. 'NVIDIA A100-SXM4-80GB, 108 SMs' or a CPU's model name (part of a node's device
    class). A GPU's multiprocessor count is part of it: cuBLAS picks kernels (split-K among them) by it, so its bits
    are promised only on one model with one SM count, and a MIG slice or a cut-down part may keep the model's name."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.multi_processor_count} SMs"
    if device.type == "mps":
        return "Apple GPU"
    return _cpu_model() or platform.processor() or platform.machine() or "CPU"


def _cpu_model() -> str:
    """Linux's name for the CPU model ('' elsewhere): platform.processor() says only 'x86_64' there."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def torch_build() -> str:
    """torch's version and the accelerator toolkit it was built with, e.g. '2.5.1+cu124 cuda 12.4' (part of a node's
    device class: another build may pick other kernels)."""
    parts = [torch.__version__]
    if torch.version.cuda:
        parts.append(f"cuda {torch.version.cuda}")
    if getattr(torch.version, "hip", None):
        parts.append(f"hip {torch.version.hip}")
    return " ".join(parts)


def describe(device: torch.device) -> str:
    """The device and what it is, e.g. 'cuda:0 (NVIDIA A100-SXM4-80GB)'."""
    return f"{device} ({device_name(device)})"


def matmul_flops(device: torch.device, precision: str = "fp32", repeats: int = 3) -> float:
    """Measured floating-point operations per second of a square matmul on the device in `precision` (the best of a
    few, after a warm-up): a first figure of the device's speed, before the run's layers are timed. 512 wide on a
    CPU, where that already takes milliseconds (a node's start pays for it), 1024 on an accelerator."""
    size = 512 if device.type == "cpu" else 1024
    dtype = COMPUTE_DTYPES[precision]
    a = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for run in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        a @ a
        synchronize(device)
        if run:  # the first pays for lazy initialisation
            best = min(best, time.perf_counter() - started)
    return 2 * size**3 / max(best, 1e-9)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer measures it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast to the precision's dtype; fp32 enters nothing, so the exactness reference runs untouched."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[precision])


def release_cached(device: torch.device) -> None:
    """Give the caching allocator's unused reserve back to the device, so free memory reads true (a no-op on the
    CPU)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def peak_memory_bytes(device: torch.device) -> int:
    """Most memory the process has held: allocated device memory on CUDA, resident host memory otherwise (its
    resident memory now where the platform keeps no peak)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import resource
    except ImportError:  # Windows
        return psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


class TaskSpan:
    """One timed task: its host start and end, and on CUDA the events its stream passed at both."""

    def __init__(self, events: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> None:
        self.started = time.monotonic()
        self.host_s = 0.0
        self._events = events
        if events is not None:
            events[0].record()

    def end(self) -> None:
        """The task has queued all its work."""
        self.host_s = time.monotonic() - self.started
        if self._events is not None:
            self._events[1].record()

    def seconds(self, wait: bool) -> float | None:
        """The task's seconds, the longer of its host time and its device work (its stream from the start event to
        the end one); None while the device is still on it, unless `wait`."""
        if self._events is None:
            return self.host_s
        start, end = self._events
        if not wait and not end.query():
            return None
        end.synchronize()
        return max(self.host_s, start.elapsed_time(end) / 1e3)


class TaskClock:
    """Times compute tasks by what they cost the device, without waiting for it: a task's launches return before
    its GPU work is done, so host time alone would give one task's GPU time to whichever later one waits. CUDA
    records an event on the compute stream at a task's start and end and reads them later; MPS, without timing
    events, waits for its queue at the task's end; the CPU's host time is its compute."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> TaskSpan:
        """Start timing a task on the calling thread's current stream."""
        if self.device.type == "cuda":
            return TaskSpan((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        return TaskSpan(None)

    def end(self, span: TaskSpan) -> None:
        """The task has queued all its work."""
        if self.device.type == "mps":
            synchronize(self.device)
        span.end()


class HostTensor:
    """A tensor on its way to host memory: `wait()` gives it once its copy is done, waiting for that copy alone
    (its event), not for the rest of the device's queue."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None = None) -> None:
        self._host, self._done = host, done
        self._fence = done  # kept after wait(): the device may still have to order writes after the copy

    def wait(self) -> torch.Tensor:
        """The host tensor, complete."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host

    def item(self) -> float:
        """The value of a one-element tensor, as Tensor.item()."""
        return self.wait().item()

    def before_writes(self) -> None:
        """Have the device's work queued from now on wait for this copy (without the host waiting): the source may
        then be written in place (a snapshot of parameters before the next optimizer step)."""
        if self._fence is not None:
            torch.cuda.current_stream(self._fence.device).wait_event(self._fence)


class HostCopies:
    """Moves tensors between host and device without stalling compute: device-to-host copies run on a side stream
    into pinned host memory, each after an event its producer recorded (so the copy waits for that tensor, not for
    work queued after it), and whoever needs the host tensor waits for that copy's own event, on its own thread;
    host-to-device copies from pinned memory are non-blocking, so the next microbatch's compute is queued while the
    previous one's activations travel. On the CPU both are the tensor itself; on MPS, plain copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor on the device (non-blocking from pinned memory under CUDA; a tensor decoded into pinned memory
        is not copied to pin it)."""
        if tensor.device == self.device:
            return tensor
        if self._side is None:
            return tensor.to(self.device)
        with torch.cuda.device(self.device):
            source = tensor if tensor.is_pinned() else tensor.pin_memory()
            return source.to(self.device, non_blocking=True)

    def to_host_async(self, tensor: torch.Tensor) -> HostTensor:
        """Start copying the tensor to host memory, after the work queued so far that produces it; returns at once."""
        if tensor.device.type == "cpu":
            return HostTensor(tensor)
        if self._side is None:
            return HostTensor(tensor.cpu())
        with torch.cuda.device(self.device):
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            done = torch.cuda.Event()
            with torch.cuda.stream(self._side):
                self._side.wait_event(produced)
                tensor.record_stream(self._side)  # its memory is not reused before the copy has read it
                host.copy_(tensor, non_blocking=True)
                done.record(self._side)
        return HostTensor(host, done)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor in host memory, complete when returned (waiting for its copy only)."""
        return self.to_host_async(tensor).wait()

    def copy_speed(self, nbytes: int = 64 << 20) -> float:
        """Host-to-device bytes per second of a pinned copy of nbytes (0 on the CPU: nothing is copied)."""
        if self.device.type == "cpu":
            return 0.0
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._side is not None)
        self.to_device(host)  # warm-up: allocation and lazy initialisation
        synchronize(self.device)
        started = time.perf_counter()
        self.to_device(host)
        synchronize(self.device)
        return nbytes / max(time.perf_counter() - started, 1e-9)
