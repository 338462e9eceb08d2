"""The node profiler: what this node measures for the run's model and its links, for the coordinator's planner.

Per layer: forward + backward seconds of one microbatch of the run's shape on the node's device in the node's
precision (warm-up, then the median of several runs, the device synchronised around each), the bytes leaving it in
that precision, its parameter bytes, and the bytes it keeps for backward. Per node: its device, the memory it can
give a stage (free device memory, or available host memory, less profile.memory_headroom_mib) and its host-device
copy speed. Per link: the round trip of
an empty probe and the bandwidth of a probe of a few MiB, sent through the data plane's link emulator as tensors
are, so an emulated node is measured exactly as a real one. Slowdown emulation lives here too (`stretch`), and the
agent's worker uses the same function, so a node started with --slowdown F measures F-times-slower layers.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from geotrain.config import RunConfig
from geotrain.node.dataplane import DataPlane, ProbeTarget
from geotrain.node.device import COMPUTE_DTYPES, HostCopies, autocast, describe, device_name, synchronize, torch_build
from geotrain.node.family import call_layer
from geotrain.node.model import VOCAB, build_layer, family_of, loss_fn
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.probe import COORDINATOR_PEER

log = logging.getLogger(__name__)

_WARMUP_RUNS = 1  # the first run pays for allocation and lazy initialisation
_RTT_PROBES = 3
# Below this the big probe's transfer time is noise (an unshaped loopback): report the rate it bounds instead.
_MIN_TRANSFER_S = 1e-4
_REPORT_DEADLINE_S = 30.0


@dataclass
class LayerProfile:
    """Per-layer measurements of the run's model for one microbatch."""

    layer_seconds: list[float]
    """Forward + backward seconds of each layer."""
    boundary_bytes: list[int]
    """Activation bytes leaving each layer (0 for the last: its output never leaves the node)."""
    param_bytes: list[int]
    """Parameter bytes of each layer."""
    activation_bytes: list[int]
    """Bytes each layer keeps for its backward (its saved tensors, parameters excluded)."""
    param_shapes: list[list[tuple[int, ...]]]
    """Shapes of each layer's parameter tensors."""


def stretch(started: float, slowdown: float) -> None:
    """Emulate a machine `slowdown` times slower: sleep until work begun at `started` (monotonic) took that long."""
    if slowdown > 1.0:
        time.sleep((slowdown - 1.0) * (time.monotonic() - started))


def _saved_bytes(run: Callable[[], torch.Tensor], exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves while `run` builds its graph, those in `exclude` left out."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def profile_layers(
    cfg: RunConfig, slowdown: float, repeats: int = 5, device: str | torch.device = "cpu", precision: str = "fp32"
) -> LayerProfile:
    """Measure every layer of the run's model on a microbatch of the run's shape, on `device` in `precision`."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    dev = torch.device(device)
    boundary_dtype = COMPUTE_DTYPES[precision]
    m = cfg.model
    b, t, last = cfg.train.microbatch_size, m.seq_len, m.total_layers - 1
    gen = torch.Generator().manual_seed(cfg.run.seed)
    tokens = torch.randint(0, VOCAB, (b, t), generator=gen).to(dev)
    family = family_of(m)
    hidden = torch.randn(family.boundary_shape(m, b), generator=gen).to(dev, boundary_dtype)
    fixed = family.fixed_embedding(m)
    rest = None if fixed is None else fixed.to(dev)(tokens)  # model.boundary_rank's fixed coordinates
    profile = LayerProfile([], [], [], [], [])
    for index in range(m.total_layers):
        layer = build_layer(m, index, cfg.run.seed).to(dev)
        x = tokens if index == 0 else hidden.clone().requires_grad_(True)

        def run_layer() -> torch.Tensor:
            # As StageRuntime runs it: autocast, and the output rounded to the boundary dtype (logits in float32).
            with autocast(dev, precision):
                y = call_layer(layer, x, None if index == 0 else rest)
            return y.float() if index == last else y.to(boundary_dtype)

        out = run_layer().detach()
        grad_out = torch.randn(out.shape, generator=gen).to(dev, out.dtype) if index < last else None

        def fwd_bwd() -> None:
            y = run_layer()
            if grad_out is None:
                loss_fn(y, tokens).backward()
            else:
                y.backward(grad_out)

        times = []
        for run in range(_WARMUP_RUNS + repeats):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            synchronize(dev)
            started = time.monotonic()
            fwd_bwd()
            synchronize(dev)
            stretch(started, slowdown)
            if run >= _WARMUP_RUNS:
                times.append(time.monotonic() - started)
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        profile.layer_seconds.append(statistics.median(times))
        profile.boundary_bytes.append(0 if index == last else out.numel() * out.element_size())
        profile.param_bytes.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
        profile.param_shapes.append([tuple(p.shape) for p in layer.parameters()])
        profile.activation_bytes.append(_saved_bytes(run_layer, params))
    return profile


HOST_LOCK = Path(tempfile.gettempdir()) / "geotrain-profile.lock"


@contextmanager
def host_turn(lock_path: Path = HOST_LOCK) -> Iterator[None]:
    """Take this host's turn at timing layers: nodes that share a machine (a demo, a multi-GPU box) and time their
    layers at once measure each other's load instead of their own speed.

    A POSIX record lock (lockf), not flock: a process forked while the lock is held (hivemind's DHT) would share an
    flock and keep it after its parent dies, while a record lock belongs to this process alone and ends with it.
    So two threads of one process do not exclude each other; a node is one process. Best effort: without write
    access to the lock file (another user's), no turn is taken."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        log.debug("timing layers without taking turns: %s", e)
        yield
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _cgroup_headroom() -> int | None:
    """Bytes the cgroup (v2) this process runs in may still take, or None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_memory_bytes(device: str | torch.device = "cpu", headroom_bytes: int = 0) -> int:
    """Memory the stage could use now, less headroom_bytes: free accelerator memory, or available host memory (within
    a cgroup limit) for the CPU and for MPS, which shares it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return max(0, int(free) - headroom_bytes)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        host = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = _cgroup_headroom()
    return max(0, (host if cgroup is None else min(host, cgroup)) - headroom_bytes)


def probe_link(
    dataplane: DataPlane, peer: str, target: ProbeTarget, nbytes: int = 2 << 20, timeout_s: float = 60.0
) -> pb.LinkProbe:
    """Round trip (best of a few empty probes) and bandwidth (one probe of nbytes) of the link to peer."""
    rtt = min(dataplane.probe(peer, target, 0, timeout_s) for _ in range(_RTT_PROBES))
    seconds = dataplane.probe(peer, target, nbytes, timeout_s)
    return pb.LinkProbe(peer=peer, bandwidth_bps=nbytes * 8 / max(seconds - rtt, _MIN_TRANSFER_S), rtt_s=rtt)


class NodeProfiler:
    """Profiles a node for its run and reports to the coordinator: its layers and coordinator link once, then
    each new peer it is given once, and every link it measured again every profile.reprobe_s (WAN links change
    over a run), re-sending the whole profile each time (the coordinator keeps the latest)."""

    def __init__(
        self,
        coordinator: rpc.CoordinatorStub,
        dataplane: DataPlane,
        node_id: Callable[[], str],
        slowdown: float,
        device: torch.device,
    ) -> None:
        self._coordinator = coordinator
        self._dataplane = dataplane
        self._node_id = node_id
        self._slowdown = slowdown
        self._device = device
        self._precision = ""
        self._layers: LayerProfile | None = None
        self._memory = 0
        self._copy_bytes_per_s = 0.0
        self._links: dict[str, pb.LinkProbe] = {}
        self._addresses: dict[str, str] = {}  # peer -> address ("" for the coordinator) of every link measured
        self._peers: queue.Queue[dict[str, str] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._layers_done = threading.Event()  # set even when timing failed, so the profiler thread never hangs

    def measure_layers(self, cfg: RunConfig, precision: str) -> None:
        """Time the model's layers in `precision`, read free memory and copy speed (run it where nothing else
        computes: the worker)."""
        try:
            with host_turn():
                started = time.monotonic()
                layers = profile_layers(cfg, self._slowdown, cfg.profile.layer_repeats, self._device, precision)
                copy_speed = HostCopies(self._device).copy_speed()
            memory = available_memory_bytes(self._device, cfg.profile.memory_headroom_mib << 20)
            with self._lock:
                self._layers, self._memory, self._precision = layers, memory, precision
                self._copy_bytes_per_s = copy_speed
        finally:
            self._layers_done.set()
        log.info("profiled %d layers on %s in %s in %.2fs: %.4fs per microbatch, %.1f GiB usable",
                 len(layers.layer_seconds), describe(self._device), precision, time.monotonic() - started,
                 sum(layers.layer_seconds), memory / 2**30)

    def run(self, cfg: RunConfig, stopped: threading.Event) -> None:
        """The profiler thread: probe the coordinator, report once the layers are timed, then probe new peers."""
        self._probe({COORDINATOR_PEER: ""}, cfg.profile.probe_bytes)
        while not self._layers_done.wait(0.2):
            if stopped.is_set():
                return
        self.report()
        interval = cfg.profile.reprobe_s or None
        while not stopped.is_set():
            try:
                peers = self._peers.get(timeout=interval)
            except queue.Empty:  # time to measure every link again
                with self._lock:
                    again = dict(self._addresses)
                if self._probe(again, cfg.profile.probe_bytes, again=True):
                    self.report()
                continue
            if peers is None:
                return
            while not self._peers.empty():  # only the latest plan's neighbours matter
                peers = self._peers.get()
                if peers is None:
                    return
            if self._probe(peers, cfg.profile.probe_bytes):
                self.report()

    def neighbours(self, peers: dict[str, str]) -> None:
        """Probe these peers (node id -> address) unless measured already; the agent calls it on every new plan."""
        with self._lock:
            new = {p: a for p, a in peers.items() if p not in self._links}
        if new:
            self._peers.put(new)

    def close(self) -> None:
        """End the profiler thread."""
        self._peers.put(None)

    def _probe(self, peers: dict[str, str], nbytes: int, again: bool = False) -> bool:
        """Measure the links to peers ("" address: the coordinator), those measured before only when again;
        True if any was measured."""
        measured = False
        for peer, address in peers.items():
            if peer in self._links and not again:
                continue
            target = self._coordinator if peer == COORDINATOR_PEER else self._dataplane.stub(address)
            try:
                probe = probe_link(self._dataplane, peer, target, nbytes)
            except grpc.RpcError as e:
                log.warning("cannot probe the link to %s: %s %s", peer, e.code().name, e.details())
                continue
            except ValueError:  # grpc: "Cannot invoke RPC on closed channel": the node is shutting down
                return measured
            log.info("link to %s: %.1f Mbit/s, %.1f ms round trip", peer, probe.bandwidth_bps / 1e6, probe.rtt_s * 1e3)
            with self._lock:
                self._links[peer] = probe
                self._addresses[peer] = address
            measured = True
        return measured

    def report(self) -> None:
        """Send the latest profile to the coordinator (again after it restarted); nothing before the layers are."""
        with self._lock:
            layers = self._layers
            if layers is None:
                return
            request = pb.NodeProfileReport(
                node_id=self._node_id(),
                layer_seconds=layers.layer_seconds,
                boundary_bytes=layers.boundary_bytes,
                param_bytes=layers.param_bytes,
                activation_bytes=layers.activation_bytes,
                param_shapes=[
                    pb.LayerShapes(tensors=[pb.TensorShape(dims=shape) for shape in layer])
                    for layer in layers.param_shapes
                ],
                memory_bytes=self._memory,
                links=list(self._links.values()),
                device=str(self._device),
                device_name=device_name(self._device),
                copy_bytes_per_s=self._copy_bytes_per_s,
                precision=self._precision,
                torch_build=torch_build(),
            )
        try:
            self._coordinator.ReportProfile(request, timeout=_REPORT_DEADLINE_S)
        except grpc.RpcError as e:
            log.warning("profile report lost: %s %s", e.code().name, e.details())
