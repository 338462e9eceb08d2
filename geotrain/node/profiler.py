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

import dataclasses
import fcntl
import json
import logging
import math
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
import psutil
import torch

from geotrain.memory import FP32_BYTES, stage_bytes
from geotrain.config import RunConfig
from geotrain.node.dataplane import DataPlane, ProbeTarget
from geotrain.node.device import (
    COMPUTE_DTYPES, HostCopies, autocast, describe, device_name, out_of_memory, release_cached, synchronize,
    torch_build,
)
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

    def pack(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        # Nothing kept: this graph is never run backward, and a graph node holding its own output (what a pack
        # returning t keeps) is a cycle through C++ that Python's collector never frees: every profiled layer's
        # weights and gradients stayed allocated (1.1 GiB of 1.4 for a 374M-parameter llama).

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("the graph that counts saved activations is never run backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        run()
    return sum(storages.values())


class LayerUnfit(Exception):
    """The device ran out of memory building or running one layer: the node can hold no stage with it."""

    def __init__(self, index: int, error: BaseException, measured: LayerProfile) -> None:
        first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        super().__init__(f"out of memory profiling layer {index} ({first})")
        self.index = index
        self.measured = measured  # the layers before it


def profile_layers(
    cfg: RunConfig, slowdown: float, repeats: int = 5, device: str | torch.device = "cpu", precision: str = "fp32"
) -> LayerProfile:
    """Measure every layer of the run's model on a microbatch of the run's shape, on `device` in `precision`;
    LayerUnfit when one does not fit on the device."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    dev = torch.device(device)
    boundary_dtype = COMPUTE_DTYPES[precision]
    m = cfg.model
    b, t = cfg.train.microbatch_size, m.seq_len
    gen = torch.Generator().manual_seed(cfg.run.seed)
    tokens = torch.randint(0, VOCAB, (b, t), generator=gen).to(dev)
    family = family_of(m)
    hidden = torch.randn(family.boundary_shape(m, b), generator=gen).to(dev, boundary_dtype)
    fixed = family.fixed_embedding(m)
    rest = None if fixed is None else fixed.to(dev)(tokens)  # model.boundary_rank's fixed coordinates
    profile = LayerProfile([], [], [], [], [])
    for index in range(m.total_layers):
        try:
            _profile_layer(profile, cfg, index, slowdown, repeats, dev, precision, tokens, hidden, rest, gen)
        except RuntimeError as e:
            if not out_of_memory(e):
                raise
            raise LayerUnfit(index, e, profile) from None
    return profile


def _profile_layer(
    profile: LayerProfile, cfg: RunConfig, index: int, slowdown: float, repeats: int, dev: torch.device,
    precision: str, tokens: torch.Tensor, hidden: torch.Tensor, rest: torch.Tensor | None, gen: torch.Generator,
) -> None:
    """Time layer `index` and append its figures to `profile` (profile_layers' loop body)."""
    m = cfg.model
    last = m.total_layers - 1
    boundary_dtype = COMPUTE_DTYPES[precision]
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


def fill_unmeasured(measured: LayerProfile, cfg: RunConfig, precision: str) -> LayerProfile:
    """A whole-model profile from the layers measured before one did not fit: the rest get their parameter and
    boundary sizes from the model's shapes (on the meta device) and the slowest measured layer's time. Such a profile
    goes out with no memory and its reason, so the planner never places by those times."""
    m = cfg.model
    family = family_of(m)
    out = LayerProfile(*(list(getattr(measured, f)) for f in LayerProfile.__dataclass_fields__))
    seconds = max(out.layer_seconds, default=1.0)
    boundary = math.prod(family.boundary_shape(m, cfg.train.microbatch_size)) * COMPUTE_DTYPES[precision].itemsize
    for index in range(len(out.layer_seconds), m.total_layers):
        shapes = [shape for _, shape in family.layer_params(m, index)]
        out.layer_seconds.append(seconds)
        out.boundary_bytes.append(0 if index == m.total_layers - 1 else boundary)
        out.param_bytes.append(sum(math.prod(shape) for shape in shapes) * FP32_BYTES)
        out.param_shapes.append(shapes)
        out.activation_bytes.append(0)
    return out


def no_room(cfg: RunConfig, layers: LayerProfile, memory_bytes: int, baseline: int) -> str:
    """Why this node can hold no stage at all by the planner's memory model (geotrain/memory.py), in one line, or ""
    when the smallest one-layer stage with one microbatch in flight fits."""
    def need(i: int) -> float:
        acts = layers.activation_bytes[i]
        if cfg.train.recompute:  # its input kept, one layer's activations in backward: a one-layer stage keeps both
            acts += layers.boundary_bytes[i - 1] if i else 0
        largest = max((math.prod(shape) for shape in layers.param_shapes[i]), default=0) * FP32_BYTES
        return float(stage_bytes(layers.param_bytes[i] / FP32_BYTES, acts, largest,
                                        diloco=cfg.compression.diloco))

    smallest = min(range(len(layers.param_bytes)), key=need)
    if baseline + need(smallest) <= memory_bytes:
        return ""
    return (f"the smallest stage (layer {smallest}, one microbatch) needs {need(smallest) / 2**30:.2f} GiB beyond this "
            f"process's {baseline / 2**30:.2f} GiB, and it may hold {memory_bytes / 2**30:.2f} GiB in all (free "
            "memory, cgroup limit and --max-memory, less profile.memory_headroom_mib)")


def cache_key(cfg: RunConfig, device: torch.device, precision: str, slowdown: float) -> dict:
    """What a cached layer profile is valid for: this device and torch build, the model's layers and the
    microbatch's shape in this precision, the emulated slowdown."""
    return {
        "device": str(device), "device_name": device_name(device), "torch": torch.__version__,
        "precision": precision, "slowdown": slowdown, "microbatch_size": cfg.train.microbatch_size,
        "model": dataclasses.asdict(cfg.model),
    }


class ProfileCache:
    """The layer profile a node measured, kept in its state dir (profile.json) with what it is valid for: a node that
    returns with the same device and state dir serves again without timing every layer (the coordinator's in-run
    calibration corrects its times by what its first steps measure)."""

    NAME = "profile.json"

    def __init__(self, state_dir: str, key: dict) -> None:
        self.path = Path(state_dir) / self.NAME
        self.key = key

    def load(self) -> LayerProfile | None:
        """The cached profile, or None when there is none, it is unreadable or it was measured for another key."""
        try:
            data = json.loads(self.path.read_text())
            if data.get("key") != self.key:
                log.info("the cached layer profile is of another device, torch build or model: measuring again")
                return None
            layers = LayerProfile(**data["layers"])
            layers.param_shapes = [[tuple(shape) for shape in layer] for layer in layers.param_shapes]
            return layers
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("ignoring an unreadable layer profile in %s: %s", self.path, e)
            return None

    def save(self, layers: LayerProfile) -> None:
        """Keep the profile, written under a temporary name and renamed when whole; a failure costs a re-profile."""
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"key": self.key, "layers": dataclasses.asdict(layers)}))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("cannot keep the layer profile in %s: %s", self.path, e)


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


_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned int64


def _cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the memory cgroups this process runs in may still take (the tightest of its cgroup and those above it,
    v2 or v1), or None without a limit. What a cgroup holds is its usage less its inactive page cache, which the
    kernel reclaims before it kills anyone (the working set, as container runtimes count it)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    levels: list[tuple[Path, str, str, str]] = []  # (directory, limit file, usage file, inactive-file key)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            levels = [(root / path.lstrip("/"), "memory.max", "memory.current", "inactive_file")]
        elif "memory" in controllers.split(","):  # v1's memory controller
            levels = [(root / "memory" / path.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes",
                       "total_inactive_file")]
            break
    if not levels:  # a cgroup namespace shows the process its own cgroup as the root
        levels = [(root, "memory.max", "memory.current", "inactive_file"),
                  (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")]
    room = None
    for start, limit_file, usage_file, inactive in levels:
        for directory in (start, *start.parents):
            if not str(directory).startswith(str(root)):
                break
            try:
                limit = (directory / limit_file).read_text().strip()
                usage = int((directory / usage_file).read_text())
            except (OSError, ValueError):
                continue
            if limit == "max" or int(limit) >= _UNLIMITED:
                continue
            stat = _memory_stat(directory / "memory.stat")
            free = max(0, int(limit) - (usage - stat.get(inactive, 0)))
            room = free if room is None else min(room, free)
    return room


def _memory_stat(path: Path) -> dict[str, int]:
    """A cgroup's memory.stat as numbers ({} when it cannot be read)."""
    try:
        return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def process_bytes() -> int:
    """This process's resident memory now (psutil: Linux, macOS and Windows alike)."""
    return psutil.Process().memory_info().rss


def host_available_bytes() -> int | None:
    """Host memory available to a new allocation without swapping (psutil), or None when it cannot be read."""
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, psutil.Error, AttributeError, ValueError) as e:  # an unsupported or locked-down platform
        log.warning("cannot read this host's available memory: %s", e)
        return None


def baseline_bytes(device: str | torch.device = "cpu") -> int:
    """What the process holds on its stage's memory before a stage is built: its resident memory on the host (and
    on MPS, which shares it); what torch has allocated on a CUDA device (the context lies outside free memory)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.memory_allocated(dev)
    return process_bytes()


def available_memory_bytes(device: str | torch.device = "cpu", headroom_bytes: int = 0, cap_bytes: int = 0) -> int:
    """Memory the node's process may hold in all on its stage's device, less headroom_bytes: what it holds there now
    plus free accelerator memory (after the caching allocator's reserve is given back), or plus available host memory
    within its cgroups' limits for the CPU and for MPS, which shares it; at most cap_bytes (--max-memory) where set.
    0 when it cannot be read and no cap is given."""
    dev = torch.device(device)
    release_cached(dev)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        total = int(free) + torch.cuda.memory_allocated(dev)
    else:
        host, cgroup = host_available_bytes(), _cgroup_room()
        free = cgroup if host is None else host if cgroup is None else min(host, cgroup)
        total = cap_bytes if free is None else process_bytes() + free
    if cap_bytes:
        total = min(total, cap_bytes)
    return max(0, total - headroom_bytes)


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
        state_dir: str = "",
        max_memory_bytes: int = 0,
    ) -> None:
        self._coordinator = coordinator
        self._state_dir = state_dir
        self._max_memory = max_memory_bytes
        self._dataplane = dataplane
        self._node_id = node_id
        self._slowdown = slowdown
        self._device = device
        self._precision = ""
        self._layers: LayerProfile | None = None
        self._memory = 0
        self._baseline = 0
        self._unfit = ""
        self._copy_bytes_per_s = 0.0
        self._links: dict[str, pb.LinkProbe] = {}
        self._addresses: dict[str, str] = {}  # peer -> address ("" for the coordinator) of every link measured
        self._peers: queue.Queue[dict[str, str] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._layers_done = threading.Event()  # set even when timing failed, so the profiler thread never hangs

    def measure_layers(self, cfg: RunConfig, precision: str) -> None:
        """Time the model's layers in `precision` (or take them from the state dir's cache of this device and model),
        then read the process's baseline, its usable memory and copy speed (run it where nothing else computes: the
        worker); log one line when this node can hold no stage."""
        try:
            started = time.monotonic()
            cache = ProfileCache(self._state_dir, cache_key(cfg, self._device, precision, self._slowdown)) \
                if self._state_dir else None
            layers, unfit, source = cache.load() if cache else None, "", "from the state dir's cache"
            if layers is None:
                source = "measured"
                with host_turn():
                    try:
                        layers = profile_layers(cfg, self._slowdown, cfg.profile.layer_repeats, self._device, precision)
                    except LayerUnfit as e:
                        layers, unfit = fill_unmeasured(e.measured, cfg, precision), f"cannot hold layer {e.index}: {e}"
                if cache is not None and not unfit:
                    cache.save(layers)
            copy_speed = HostCopies(self._device).copy_speed()
            # Once the layers are timed: what timing them left allocated (freed, yet kept by the C allocator) stays.
            baseline = baseline_bytes(self._device)
            memory = 0 if unfit else available_memory_bytes(
                self._device, cfg.profile.memory_headroom_mib << 20, self._max_memory
            )
            with self._lock:
                self._layers, self._memory, self._precision = layers, memory, precision
                self._baseline, self._unfit, self._copy_bytes_per_s = baseline, unfit, copy_speed
        finally:
            self._layers_done.set()
        log.info("profiled %d layers on %s in %s (%s) in %.2fs: %.4fs per microbatch, %.2f GiB usable, %.2f GiB baseline",
                 len(layers.layer_seconds), describe(self._device), precision, source, time.monotonic() - started,
                 sum(layers.layer_seconds), memory / 2**30, baseline / 2**30)
        short = unfit or no_room(cfg, layers, memory, baseline)
        if short:
            log.warning("this node can hold no stage of this run: %s", short)

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
                baseline_bytes=self._baseline,
                unfit=self._unfit,
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
