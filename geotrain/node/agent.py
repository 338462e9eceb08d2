"""The volunteer's agent: a facade over its parts (link.py, worker.py, holder.py, stepflow.py, incoming.py,
evaluation.py, commit.py, verifier.py) that runs them.

Threads: gRPC serves the Stage service; the orders thread reads the coordinator's order stream (and registers
again when the coordinator has forgotten this node, e.g. after its restart); the heartbeat thread keeps the node
alive; one worker thread does all compute and state changes, taking tasks from a priority queue (control first,
then backward, then forward, as 1F1B prefers draining; a verifier's recomputes last); a small pool sends tensors and
reports so compute never waits on the network. Every data task carries its plan epoch: a new epoch drops what the
old one left in flight.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from geotrain.compression.policy import StageTimer
from geotrain.node.commit import StepCommit
from geotrain.node.dataplane import DataPlane, LinkEmulator
from geotrain.node.device import device_pool, resolve_device
from geotrain.node.evaluation import Evaluation
from geotrain.node.holder import StageHolder
from geotrain.node.incoming import IncomingChecks
from geotrain.node.link import CoordinatorLink, NodeError
from geotrain.node.profiler import NodeProfiler
from geotrain.node.reverse import ReverseReceiver
from geotrain.node.servicer import StageServicer, add_stage_service
from geotrain.node.stepflow import StepFlow
from geotrain.node.verifier import VerifierPart
from geotrain.node.worker import CONTROL, Worker
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.limits import PeerLimits
from geotrain.protocol.tensorstream import TensorStreamServer
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import TlsFiles, make_channel, make_server

__all__ = ["Agent", "NodeError", "NodeOptions", "RateMeter"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class NodeOptions:
    """How a node joins and serves."""

    coordinator: str
    """host:port of the coordinator."""
    token: str
    listen: str = "127.0.0.1:0"
    """host:port the Stage service binds; port 0 picks a free one."""
    tensor_port: int = 0
    """Port of the raw tensor stream (transport.tensor_stream = "tcp") on the listen host; 0 picks a free one."""
    dht_port: int = 0
    """Port of the hivemind DHT a stage replica averages through (averaging.dht_maddrs: on the advertised host, or,
    advertised with this port fixed, on every interface); 0 picks a free one."""
    advertise: str = ""
    """host:port peers should dial; empty = the listen host (or the interface that reaches the coordinator)."""
    node_id: str = ""
    """Stable identity; empty lets the coordinator assign one. A node restarted with the same id rejoins as itself."""
    region: str = "local"
    tls: TlsFiles | None = None
    max_tensor_bytes: int = framing.MAX_TENSOR_BYTES
    check_finite: bool = True
    """Reject incoming tensors with NaN or Inf before any compute."""
    give_up_after_s: float = 1800.0
    """Stop when the coordinator has been unreachable this long: until then its absence pauses the run, and the node
    keeps its state for the resumed coordinator."""
    slowdown: float = 1.0
    """Emulate a slower machine: every compute task takes this many times as long."""
    bandwidth_mbps: float = 0.0
    """Emulate this egress bandwidth to every peer (0 = use the run config's [emulation] links, if any)."""
    latency_ms: float = 0.0
    """Emulate this one-way latency to every peer (with bandwidth_mbps)."""
    device: str = "auto"
    """Where the stage computes: auto (CUDA, then MPS, then the CPU), cpu, cuda, cuda:N or mps."""
    state_dir: str = ""
    """Where the node keeps its key (node.key, created on first join), so that a restarted node keeps its identity,
    and its layer profile (profile.json), so that it rejoins without timing its layers again; empty: a key in memory
    for this process's lifetime only."""
    max_memory_bytes: int = 0
    """The most memory this node's process may hold in all (`--max-memory`), beside free memory and a cgroup limit;
    0: no cap of its own."""

    def __post_init__(self) -> None:
        if ":" not in self.coordinator:
            raise ValueError(f"--coordinator must be HOST:PORT, got {self.coordinator!r}")
        if self.give_up_after_s <= 0:
            raise ValueError("give_up_after_s must be positive")
        if self.max_memory_bytes < 0:
            raise ValueError(f"--max-memory must not be negative, got {self.max_memory_bytes}")
        if self.slowdown < 1.0:
            raise ValueError(f"--slowdown must be at least 1, got {self.slowdown}")
        if self.bandwidth_mbps < 0 or self.latency_ms < 0:
            raise ValueError("--bandwidth-mbps and --latency-ms must not be negative")
        for flag, port in (("--tensor-port", self.tensor_port), ("--dht-port", self.dht_port)):
            if not 0 <= port < 65536:
                raise ValueError(f"{flag} must be in 0..65535, got {port}")


class RateMeter:
    """Events per second over the last `window` events."""

    def __init__(self, window: int = 32) -> None:
        self._times: deque[float] = deque(maxlen=window)

    def tick(self) -> None:
        """Count one event now."""
        self._times.append(time.monotonic())

    def rate(self) -> float:
        """Recent events per second (0 until two events were seen)."""
        if len(self._times) < 2:
            return 0.0
        span = self._times[-1] - self._times[0]
        return (len(self._times) - 1) / span if span > 0 else 0.0


def _advertise_address(options: NodeOptions, port: int) -> str:
    if options.advertise:
        return options.advertise
    host = options.listen.rsplit(":", 1)[0]
    if host in ("0.0.0.0", "[::]", ""):
        # The address of the interface that routes to the coordinator (UDP connect sends nothing).
        coord_host, coord_port = options.coordinator.rsplit(":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((coord_host, int(coord_port)))
            host = s.getsockname()[0]
    return f"{host}:{port}"


def _node_key(state_dir: str) -> NodeKey:
    """The node's key from its state directory (created there on first join), else one for this process only;
    IdentityError for a key file that holds no key, OSError for a directory it cannot write."""
    if not state_dir:
        return NodeKey.generate()  # said at registration (CoordinatorLink._register), as the node's first log line
    key, created = NodeKey.load_or_create(state_dir)
    log.debug("%s this node's key in %s", "created" if created else "loaded", state_dir)
    return key


class Agent(CoordinatorLink, Worker, StageHolder, StepFlow, IncomingChecks, Evaluation, StepCommit, VerifierPart):
    """One node of a geotrain run: a facade that wires its parts together and runs their threads."""

    def __init__(self, options: NodeOptions) -> None:
        # Every part's state, set up here because the parts are wired to each other; each part's class says what its
        # attributes mean.
        self.options = options
        self.node_id = options.node_id
        self.key = _node_key(options.state_dir)
        self.device = resolve_device(options.device)
        self.precision = "fp32"
        self.stopped = threading.Event()
        self._init_holder(options.state_dir)
        self._newest_epoch = 0
        self._reported_epoch = 0
        self._timed = (0, {})
        self._held_sends = None
        self.run_id = ""
        self._tasks = queue.PriorityQueue()
        self._seq = itertools.count()
        self._sender = device_pool(self.device, 8, "send")  # they wait for copies off the node's GPU, and encode them
        self._init_stepflow()
        self._init_commit()
        self._init_verifier(self.device)
        self.dataplane = DataPlane(
            options.token, lambda: self.node_id, options.tls, LinkEmulator(self._link_shape), self._report_failure,
            self.key,
        )
        self._channel = make_channel(options.coordinator, options.token, lambda: self.node_id, options.tls, self.key)
        self.coordinator = rpc.CoordinatorStub(self._channel)
        self.profiler = NodeProfiler(
            self.coordinator, self.dataplane, lambda: self.node_id, options.slowdown, self.device, options.state_dir,
            options.max_memory_bytes,
        )
        self.limits = PeerLimits()  # the defaults until the run's [limits] arrive with registration
        self._server, self.port = make_server(options.token, options.listen, self.limits, tls=options.tls)
        # Opened at registration, where the run says whether tensors come over raw streams (listen_for_tensor_streams).
        self.tensor_streams: TensorStreamServer | None = None
        servicer = StageServicer(
            self, options.max_tensor_bytes, options.check_finite, self.limits.refusals, self.dataplane.reverse,
            pin_decoded=self.device.type == "cuda",
        )
        add_stage_service(servicer, self._server)
        self._servicer = servicer
        self.reverse_links = ReverseReceiver(
            options.token, lambda: self.node_id, options.tls, self.key, servicer.receive, self._keepalive_s
        )
        self.on_reachability: Callable[[str], None] = log.info  # hears the dial-back's outcome, one line
        self.address = ""
        self.heartbeat_interval_s = 1.0
        self.throughput = RateMeter()
        self.compute = StageTimer()
        self._orders = None
        self._must_register = threading.Event()

    def run(self) -> None:
        """Serve until the coordinator says the run is over, stop() is called, or the coordinator is gone."""
        self._server.start()
        self.address = _advertise_address(self.options, self.port)
        # What building a stage's optimizer imports the first time (torch._dynamo, ~1 s of CPU) is imported while the
        # node registers and reads its corpus, not once a plan waits for the stage (a returning node's rejoin).
        threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="imports", daemon=True).start()
        try:
            self._register()
            # Heartbeats start before the slow corpus read, so the coordinator never mistakes a loading node for dead.
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
            self._load_corpus()
            # The worker's first task: no training compute competes with the timing, and the node enters profiled.
            self._submit(CONTROL, lambda: self.profiler.measure_layers(self.cfg, self.precision))
            threading.Thread(target=self._work_loop, name="worker", daemon=True).start()
            threading.Thread(target=self.profiler.run, args=(self.cfg, self.stopped), name="profiler", daemon=True).start()
            self._orders_loop()
        finally:
            self.close()

    def listen_for_tensor_streams(self) -> None:
        """Take tensors over raw tensor streams too, from now on (the run's transport.tensor_stream is "tcp"): listen
        on --tensor-port, once. NodeError when that port cannot be had."""
        if self.tensor_streams is not None:
            return
        try:
            streams = TensorStreamServer(
                self.options.listen.rpartition(":")[0], self.options.tensor_port, self.options.tls, self.limits,
                self.options.max_tensor_bytes,
            )
        except OSError as e:
            raise NodeError(f"cannot listen for tensor streams on --tensor-port {self.options.tensor_port}: "
                            f"{e.strerror}") from None
        streams.start(self._servicer)
        self.tensor_streams = self._servicer.tensor_streams = streams

    def _keepalive_s(self) -> float:
        """Seconds between keepalives on this node's reverse streams: well within the run's idle-stream cut."""
        return min(10.0, self.cfg.limits.idle_stream_s / 3) if self.cfg is not None else 10.0

    def stop(self) -> None:
        """Ask the node to stop (from a signal handler or another thread)."""
        self.stopped.set()
        if self._orders is not None:
            self._orders.cancel()

    def close(self) -> None:
        """Release the server, channels, threads and the DHT (its p2p daemon included)."""
        self.stopped.set()
        self._tasks.put((-1, -1, None, None))
        self.profiler.close()
        self._server.stop(grace=1.0).wait(2.0)
        if self.tensor_streams is not None:
            self.tensor_streams.close()
        self._sender.shutdown(wait=False, cancel_futures=True)
        self._verify_pool.shutdown(wait=False, cancel_futures=True)
        self.reverse_links.close()
        self.dataplane.close()
        self._channel.close()
        if self.averager is not None:
            self.averager.shutdown()
        if self._dht is not None:
            self._dht.shutdown()
