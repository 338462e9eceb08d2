"""The device a node computes on and the precision it computes in: choosing them, describing them, and moving
tensors between host and device.

CPU, CUDA and MPS share every code path: on the CPU the copies below are plain no-ops, so train-local, the tests
(which run on CPUs) and a GPU node run the same lines.
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Iterator

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
    """The torch device `--device spec` names: auto picks CUDA, then MPS, then the CPU; DeviceError if absent."""
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
        return precision == "fp16" or torch.cuda.is_bf16_supported(including_emulation=False)
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
    """What the device is, e.g. 'NVIDIA A100-SXM4-80GB'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple GPU"
    return platform.processor() or platform.machine() or "CPU"


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
    """Most memory the process has held: allocated device memory on CUDA, resident host memory otherwise."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class HostCopies:
    """Moves tensors between host and device without stalling compute: device-to-host copies run on a side stream
    into pinned host memory and host-to-device copies from pinned memory are non-blocking, so the next
    microbatch's compute is queued while the previous one's activations travel. On the CPU both are the tensor
    itself."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        assert self._side is not None
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            yield

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor on the device (pinned and non-blocking from the host under CUDA)."""
        if tensor.device == self.device:
            return tensor
        if self._side is None:
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor in host memory, complete when returned (the side stream's copy waits only for its producer)."""
        if tensor.device.type == "cpu":
            return tensor
        if self._side is None:
            return tensor.cpu()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with self._on_side_stream():
            tensor.record_stream(self._side)
            host.copy_(tensor, non_blocking=True)
        self._side.synchronize()
        return host

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
