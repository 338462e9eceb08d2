"""The volunteer's agent: register, heartbeat, follow the coordinator's orders, run a pipeline stage.

Threads: gRPC serves the Stage service; the orders thread reads the coordinator's order stream (and registers
again when the coordinator has forgotten this node, e.g. after its restart); the heartbeat thread keeps the node
alive; one worker thread does all compute and state changes, taking tasks from a priority queue (control first,
then backward, then forward, as 1F1B prefers draining); a small pool sends tensors and reports so compute never
waits on the network. Every data task carries its plan epoch: a new epoch drops what the old one left in flight.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from geotrain import __version__
from geotrain.compression import PowerSgdCodec, get_codec
from geotrain.compression.policy import CodecPolicy, StageTimer
from geotrain.config import RunConfig, from_proto
from geotrain.lifetime import tie_children_to_this_process
from geotrain.node.data import Corpus
from geotrain.node.dataplane import DataPlane, Encoded, LinkEmulator, LinkShape
from geotrain.node.failures import StageFailure, self_report
from geotrain.node.handover import HeldStates
from geotrain.node.lowrank import LowRankAveraging
from geotrain.node.model import loss_fn
from geotrain.node.profiler import NodeProfiler, stretch
from geotrain.node.routing import ReplicaRouter
from geotrain.node.servicer import StageServicer, check_activation_header
from geotrain.node.stage import StageRuntime
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.framing import FrameError
from geotrain.protocol.tls import tls_mismatch
from geotrain.protocol.transport import TlsFiles, call_with_retry, make_channel, make_server
from geotrain.protocol.version import PROTOCOL_VERSION

log = logging.getLogger(__name__)

# Task priorities: lower runs first.
_CONTROL, _BACKWARD, _FORWARD = 0, 1, 2
_RPC_DEADLINE_S = 30.0
# Kinds of traffic the data plane carries, by the [compression] key of their codec.
_TRAFFIC = ("activations", "activation_grads")
_TIMED = {_FORWARD: "forward", _BACKWARD: "backward"}
_STATE_DEADLINE_S = 300.0


class NodeError(RuntimeError):
    """The node cannot take part in the run (rejected, incompatible corpus, coordinator gone)."""


@dataclass(kw_only=True)
class NodeOptions:
    """How a node joins and serves."""

    coordinator: str
    """host:port of the coordinator."""
    token: str
    listen: str = "127.0.0.1:0"
    """host:port the Stage service binds; port 0 picks a free one."""
    advertise: str = ""
    """host:port peers should dial; empty = the listen host (or the interface that reaches the coordinator)."""
    node_id: str = ""
    """Stable identity; empty lets the coordinator assign one. A node restarted with the same id rejoins as itself."""
    region: str = "local"
    tls: TlsFiles | None = None
    max_tensor_bytes: int = framing.MAX_TENSOR_BYTES
    check_finite: bool = True
    """Reject incoming tensors with NaN or Inf before any compute."""
    give_up_after_s: float = 60.0
    """Stop when the coordinator has been unreachable this long."""
    slowdown: float = 1.0
    """Emulate a slower machine: every compute task takes this many times as long."""
    bandwidth_mbps: float = 0.0
    """Emulate this egress bandwidth to every peer (0 = use the run config's [emulation] links, if any)."""
    latency_ms: float = 0.0
    """Emulate this one-way latency to every peer (with bandwidth_mbps)."""

    def __post_init__(self) -> None:
        if ":" not in self.coordinator:
            raise ValueError(f"--coordinator must be HOST:PORT, got {self.coordinator!r}")
        if self.give_up_after_s <= 0:
            raise ValueError("give_up_after_s must be positive")
        if self.slowdown < 1.0:
            raise ValueError(f"--slowdown must be at least 1, got {self.slowdown}")
        if self.bandwidth_mbps < 0 or self.latency_ms < 0:
            raise ValueError("--bandwidth-mbps and --latency-ms must not be negative")


@dataclass
class _HeadState:
    """A data head's share of the current step."""

    epoch: int
    step: int
    waiting: deque[int]
    in_flight: set[int] = field(default_factory=set)


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


class Agent:
    """One node of a geotrain run."""

    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self.node_id = options.node_id
        self.stopped = threading.Event()
        self.cfg: RunConfig | None = None
        self.corpus: Corpus | None = None
        self.plan: pb.Plan | None = None
        self.stage_index = -1
        self.runtime: StageRuntime | None = None
        self.state_epoch = 0  # plan epoch whose LoadState this node completed
        self.held = HeldStates()  # layers a new plan moved this node away from, served until taken over
        self._newest_epoch = 0  # newest plan epoch ordered (the worker may not have applied it yet)
        self._reported_epoch = 0  # plan epoch this node last reported itself failing in: one report fails it
        self.run_id = ""
        self._state_lock = threading.Lock()  # parameters change only under it (apply, load) and are read under it
        self._tasks: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._head: _HeadState | None = None
        self._sender = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="send")
        self.router = ReplicaRouter()
        self.dataplane = DataPlane(
            options.token, lambda: self.node_id, options.tls, LinkEmulator(self._link_shape), self._report_failure
        )
        self._channel = make_channel(options.coordinator, options.token, lambda: self.node_id, options.tls)
        self.coordinator = rpc.CoordinatorStub(self._channel)
        self.profiler = NodeProfiler(self.coordinator, self.dataplane, lambda: self.node_id, options.slowdown)
        self._server, self.port = make_server(options.token, options.listen, tls=options.tls)
        servicer = StageServicer(self, options.max_tensor_bytes, options.check_finite)
        rpc.add_StageServicer_to_server(servicer, self._server)
        self.address = ""
        self.heartbeat_interval_s = 1.0
        self.throughput = RateMeter()
        self.compute = StageTimer()
        self._policies: dict[str, CodecPolicy] = {}  # traffic kind -> its codec policy, from the run config
        self._low_rank: LowRankAveraging | None = None  # replicas average PowerSGD factors (replica_grads)
        self._orders: grpc.Future | None = None  # the open order stream, cancelled by stop()
        self._peer_regions: dict[str, str] = {}  # from plans and probe orders: what the link emulator shapes by
        self._must_register = threading.Event()
        self._dht = None
        self.averager = None  # ReplicaAverager once the DHT is up
        self._averaging_ready = threading.Event()

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until the coordinator says the run is over, stop() is called, or the coordinator is gone."""
        self._server.start()
        self.address = _advertise_address(self.options, self.port)
        try:
            dht_peers = self._register()
            # Heartbeats start before the slow corpus read, so the coordinator never mistakes a loading node for dead.
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
            threading.Thread(target=self._start_averaging, args=(dht_peers,), name="dht", daemon=True).start()
            self._load_corpus()
            # The worker's first task: no training compute competes with the timing, and the node enters profiled.
            self._submit(_CONTROL, lambda: self.profiler.measure_layers(self.cfg))
            threading.Thread(target=self._work_loop, name="worker", daemon=True).start()
            threading.Thread(target=self.profiler.run, args=(self.cfg, self.stopped), name="profiler", daemon=True).start()
            self._orders_loop()
        finally:
            self.close()

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
        self._sender.shutdown(wait=False, cancel_futures=True)
        self.dataplane.close()
        self._channel.close()
        if self.averager is not None:
            self.averager.shutdown()
        if self._dht is not None:
            self._dht.shutdown()

    def _register(self) -> list[str]:
        """Register (again, after a coordinator restart, with the stage this node holds); returns DHT peers."""
        runtime = self.runtime
        request = pb.RegisterRequest(
            protocol_version=PROTOCOL_VERSION,
            node_id=self.node_id,
            address=self.address,
            region=self.options.region,
            software_version=__version__,
            layer_start=runtime.start if runtime else 0,
            layer_end=runtime.end if runtime else 0,
            applied_steps=runtime.applied_step + 1 if runtime else 0,
        )
        reply = self._retry_until_reachable(lambda: self.coordinator.Register(request, timeout=_RPC_DEADLINE_S))
        if not reply.accepted:
            raise NodeError(f"coordinator rejected this node ({pb.RejectReason.Name(reply.reason)}): {reply.message}")
        self.node_id = reply.node_id
        self.heartbeat_interval_s = reply.heartbeat_interval_s
        self.cfg = from_proto(reply.config)
        self._policies = {kind: CodecPolicy(kind, getattr(self.cfg.compression, kind)) for kind in _TRAFFIC}
        replica_codec = get_codec(self.cfg.compression.replica_grads)
        self._low_rank = LowRankAveraging(replica_codec) if isinstance(replica_codec, PowerSgdCodec) else None
        self.run_id = reply.run_id
        self._must_register.clear()
        self._sender.submit(self.profiler.report)  # a restarted coordinator has lost it (before timing: no-op)
        log.info("registered as %s, serving on %s", self.node_id, self.address)
        return list(reply.dht_initial_peers)

    def _start_averaging(self, initial_peers: list[str]) -> None:
        """Join the run's hivemind DHT, through which replicas of a stage average their gradients."""
        from hivemind import DHT

        from geotrain.node.averaging import ReplicaAverager

        host = self.address.rsplit(":", 1)[0]
        tie_children_to_this_process()  # the DHT process and its p2pd must not outlive a killed node
        try:
            self._dht = DHT(initial_peers=initial_peers, host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)
            self.averager = ReplicaAverager(self._dht)
        except Exception:
            log.exception("cannot start hivemind: this node cannot serve as a stage replica")
            self._averaging_ready.set()  # settled: a commit that needs averaging fails at once, not after a wait
            return
        self._averaging_ready.set()
        self._heartbeat()

    def _load_corpus(self) -> None:
        assert self.cfg is not None
        corpus = Corpus.load(self.cfg.data)
        if self.cfg.data.fingerprint and corpus.fingerprint != self.cfg.data.fingerprint:
            raise NodeError(
                "this node's corpus differs from the coordinator's (another Python version's stdlib?): "
                "set data.paths in the run config to files every node has"
            )
        self.corpus = corpus

    def _retry_until_reachable(self, call: Callable[[], object]):
        """Call the coordinator, retrying with backoff while it is unreachable, up to give_up_after_s."""
        deadline = time.monotonic() + self.options.give_up_after_s
        backoff = 0.2
        while True:
            try:
                return call()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise NodeError(f"the coordinator refused the run token ({e.details()})") from None
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                self._check_tls_matches()
                if time.monotonic() > deadline or self.stopped.is_set():
                    raise NodeError(f"coordinator {self.options.coordinator} unreachable: {e.details()}") from None
                log.debug("coordinator unreachable, retrying in %.1fs", backoff)
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def _check_tls_matches(self) -> None:
        """Raise NodeError when the coordinator answers but not in this node's TLS (or plaintext): gRPC reports that
        as the coordinator being unavailable, and retrying cannot help."""
        problem = tls_mismatch(self.options.coordinator, self.options.tls)
        if problem is not None:
            raise NodeError(f"the coordinator {problem}")

    def _orders_loop(self) -> None:
        while not self.stopped.is_set():
            if self._must_register.is_set():
                self._register()
            self._orders = self._retry_until_reachable(
                lambda: self.coordinator.Orders(pb.OrdersRequest(node_id=self.node_id))
            )
            try:
                for order in self._orders:
                    if self._on_order(order):
                        return
            except grpc.RpcError as e:
                if self.stopped.is_set():
                    return
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._must_register.set()  # a restarted coordinator does not know us yet
                elif e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise
                log.warning("order stream broke (%s); reconnecting", e.details())
                self.stopped.wait(0.2)

    def _on_order(self, order: pb.Order) -> bool:
        """Queue one order; True when it ends the node's work."""
        kind = order.WhichOneof("kind")
        if kind == "shutdown":
            log.info("coordinator ends the run: %s", order.shutdown.reason)
            self.stopped.set()
            if order.shutdown.aborted:
                # A failed run is not this node's success: exit non-zero, so a service manager restarts it.
                raise NodeError(f"the coordinator ended the run: {order.shutdown.reason}")
            return True
        if kind == "probe_peers":
            probe = order.probe_peers
            self._peer_regions.update(zip(probe.node_ids, probe.regions))
            self.profiler.neighbours(dict(zip(probe.node_ids, probe.addresses)))
            return False
        if kind == "plan":
            self._newest_epoch = max(self._newest_epoch, order.plan.epoch)
            if self.averager is not None:
                self.averager.cancel_all()  # an all-reduce of the abandoned epoch must not hold up the new plan
        handlers: dict[str, Callable[[], None]] = {
            "plan": lambda: self._apply_plan(order.plan),
            "load_state": lambda: self._load_state(order.load_state),
            "start_step": lambda: self._start_step(order.start_step),
            "evaluate": lambda: self._evaluate(order.evaluate),
            "commit": lambda: self._commit(order.commit),
            "apply": lambda: self._apply(order.apply),
        }
        self._submit(_CONTROL, handlers[kind])
        return False

    def _heartbeat_loop(self) -> None:
        while not self.stopped.wait(self.heartbeat_interval_s):
            self._heartbeat()

    def _heartbeat(self) -> None:
        sent, received = self.dataplane.totals()
        runtime = self.runtime
        request = pb.HeartbeatRequest(
            node_id=self.node_id,
            plan_epoch=self.plan.epoch if self.plan else 0,
            bytes_sent=sent,
            bytes_received=received,
            links=self.dataplane.link_counters(),
            microbatches_per_s=self.throughput.rate(),
            applied_step=runtime.applied_step + 1 if runtime else 0,
            dht_peer_id=self.averager.peer_id if self.averager is not None else "",
            state_epoch=self.state_epoch,
        )
        try:
            reply = self.coordinator.Heartbeat(request, timeout=max(1.0, 2 * self.heartbeat_interval_s))
        except grpc.RpcError as e:
            log.debug("heartbeat failed: %s", e.details())
            return
        except ValueError:  # the channel closed under us while shutting down
            return
        if not reply.known and not self._must_register.is_set():
            log.warning("the coordinator does not know this node (restarted, or declared it dead): registering again")
            self._must_register.set()
            if self._orders is not None:
                self._orders.cancel()

    # -- the worker ---------------------------------------------------------------------------------------------

    def _submit(self, priority: int, task: Callable[[], None], epoch: int | None = None) -> None:
        """Queue a task; one tagged with a plan epoch is dropped if the epoch has changed by the time it runs."""
        self._tasks.put((priority, next(self._seq), task, epoch))

    def _work_loop(self) -> None:
        while not self.stopped.is_set():
            priority, _, task, epoch = self._tasks.get()
            if task is None:
                return
            if epoch is not None and (self.plan is None or self.plan.epoch != epoch):
                continue
            started = time.monotonic()
            try:
                task()
            except Exception as e:
                self._task_failed(e)
            if epoch is not None:  # emulated slower hardware stretches every compute task, not the control ones
                stretch(started, self.options.slowdown)
            if priority in _TIMED:
                self.compute.observe(_TIMED[priority], time.monotonic() - started)

    def _task_failed(self, error: Exception) -> None:
        """Tell the coordinator at once that this node cannot take part in the current epoch (rather than let the
        step time out), unless a newer plan has already abandoned the epoch the task belonged to."""
        plan, runtime = self.plan, self.runtime
        if plan is None:  # nothing to fail yet (e.g. timing the layers): the coordinator sees no profile
            log.error("task failed", exc_info=error)
            return
        if plan.epoch != self._newest_epoch or plan.epoch == self._reported_epoch:
            log.debug("task failed in plan epoch %d, abandoned or reported already: %r", plan.epoch, error)
            return
        self._reported_epoch = plan.epoch
        report = self_report(self.node_id, error, plan.epoch, runtime.applied_step + 1 if runtime else 0)
        why = pb.FailureReason.Name(report.reason)
        log.warning(
            "cannot take part in plan epoch %d (%s): %s", plan.epoch, why, report.detail,
            exc_info=not isinstance(error, StageFailure),
        )
        self._sender.submit(self._send_failure_report, report)

    def _send(self, fn: Callable[[], None], what: str, peer: str = "") -> None:
        def run() -> None:
            try:
                fn()
            except grpc.RpcError as e:
                log.warning("%s failed: %s %s", what, e.code().name, e.details())
                if peer and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._report_failure(peer, f"{what}: {e.code().name}")

        self._sender.submit(run)

    def _report(self, method: Callable, request: object) -> None:
        """Send a report to the coordinator off the worker thread, retrying while it is unavailable."""
        self._send(lambda: call_with_retry(lambda: method(request, timeout=_RPC_DEADLINE_S)), type(request).__name__)

    def _report_failure(self, peer: str, detail: str) -> None:
        """Tell the coordinator that calls to peer fail, so it can declare the peer dead before its heartbeat lapses."""
        self._send_failure_report(pb.FailureReport(node_id=self.node_id, peer=peer, detail=detail))

    def _send_failure_report(self, request: pb.FailureReport) -> None:
        try:
            self.coordinator.ReportFailure(request, timeout=5.0)
        except grpc.RpcError as e:
            log.debug("failure report lost: %s", e.details())

    # -- plan and state -----------------------------------------------------------------------------------------

    def _apply_plan(self, plan: pb.Plan) -> None:
        assert self.cfg is not None
        index = next((s.index for s in plan.stages if self.node_id in s.node_ids), -1)
        stage = plan.stages[index] if index >= 0 else None
        with self._state_lock:
            self.held.release_except(plan.steps_done)  # copies of another step can help no one take over
            layers = (stage.layer_start, stage.layer_end) if stage is not None else None
            if self.runtime is not None and (self.runtime.start, self.runtime.end) == layers:
                self.runtime.reset_step()  # the new epoch redoes the uncommitted step from scratch
            else:
                if self.runtime is not None:
                    # Whoever takes these layers over may still fetch them from here.
                    self.held.keep(self.runtime, plan.steps_done)
                # Step 0 is each layer's initialisation from the seed; later steps come with a LoadState order,
                # unless this node still holds the layers at the committed step from an earlier plan.
                self.runtime = None if layers is None else (
                    self.held.take(layers, plan.steps_done) or StageRuntime(self.cfg, *layers)
                )
            self.plan, self.stage_index = plan, index
            for s in plan.stages:
                self._peer_regions.update(zip(s.node_ids, s.regions))
            self._head = None
            self.router.reset()
        peers = {n for s in plan.stages if abs(s.index - index) == 1 for n in s.node_ids}
        self.dataplane.reset_links(peers)
        if stage is not None and index + 1 < len(plan.stages):
            # Each pair is probed by its upstream end only: two probes at once, one each way, skew each other.
            after = plan.stages[index + 1]
            self.profiler.neighbours(dict(zip(after.node_ids, after.addresses)))
        where = f"stage {index} layers [{stage.layer_start}, {stage.layer_end})" if stage else "spare"
        if stage is not None and stage.hierarchical_allreduce:
            where += ", replicas averaging region by region"
        log.info("plan epoch %d: %s", plan.epoch, where)
        self._heartbeat()  # tells the coordinator this epoch is in place

    def _load_state(self, order: pb.LoadState) -> None:
        """Take over the stage's committed state from a live replica or the coordinator's checkpoint."""
        runtime = self.runtime
        assert runtime is not None and self.cfg is not None
        started = time.monotonic()
        if order.steps_done == 0:
            # A rollback to the very start: the state is each layer's initialisation from the seed.
            with self._state_lock:
                self.runtime = StageRuntime(self.cfg, runtime.start, runtime.end)
            self.state_epoch = order.plan_epoch
            self._heartbeat()
            return
        source = order.source_address or "the coordinator's checkpoint"
        try:
            state = self._fetch_state(order, runtime.start, runtime.end)
            with self._state_lock:
                runtime.load_full_state(state, order.steps_done)
                checksum = runtime.checksum()
        except (grpc.RpcError, FrameError, ValueError) as e:
            detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
            raise StageFailure(
                pb.FAILURE_REASON_STATE, f"cannot load the state after {order.steps_done} steps from {source}: {detail}"
            ) from e
        if order.expected_checksum and checksum != order.expected_checksum:
            raise StageFailure(
                pb.FAILURE_REASON_STATE, f"state loaded for step {order.steps_done} from {source} fails its checksum"
            )
        self.state_epoch = order.plan_epoch
        log.info(
            "loaded state after %d steps from %s in %.2fs",
            order.steps_done, order.source_address or "the coordinator's checkpoint", time.monotonic() - started,
        )
        self._heartbeat()

    def _fetch_state(self, order: pb.LoadState, start: int, end: int) -> dict[str, torch.Tensor]:
        """Layers [start, end) after order.steps_done steps, from the order's source node or the checkpoint."""
        if order.source_address:
            channel = make_channel(order.source_address, self.options.token, lambda: self.node_id, self.options.tls)
            try:
                request = pb.FetchStateRequest(steps_done=order.steps_done, layer_start=start, layer_end=end)
                stream = rpc.StageStub(channel).FetchState(request, timeout=_STATE_DEADLINE_S)
                return framing.read_state(stream, self.options.max_tensor_bytes)
            finally:
                channel.close()
        request = pb.FetchCheckpointRequest(layer_start=start, layer_end=end, steps_done=order.steps_done)
        return framing.read_state(
            self.coordinator.FetchCheckpoint(request, timeout=_STATE_DEADLINE_S), self.options.max_tensor_bytes
        )

    def _peer(self, stage_index: int) -> tuple[str, str]:
        """(node id, address) of the replica of `stage_index` expected to finish a microbatch first."""
        assert self.plan is not None
        stage = self.plan.stages[stage_index]
        node_id = self.router.pick(list(stage.node_ids))
        return node_id, stage.addresses[list(stage.node_ids).index(node_id)]

    def _address_of(self, node_id: str) -> str:
        """Address of a node of the plan."""
        assert self.plan is not None
        for stage in self.plan.stages:
            if node_id in stage.node_ids:
                return stage.addresses[list(stage.node_ids).index(node_id)]
        raise KeyError(node_id)

    def _link_shape(self, peer: str) -> tuple[str, LinkShape] | None:
        """The emulated link to peer: the node's own flags, else the run config's region matrix."""
        if self.options.bandwidth_mbps or self.options.latency_ms:
            return "egress", LinkShape(self.options.bandwidth_mbps * 1e6, self.options.latency_ms / 1e3)
        if self.cfg is None or not self.cfg.emulation.links:
            return None
        region = self._peer_regions.get(peer)
        if region is None:  # not a peer of a plan or a probe (the coordinator): its region is unknown, unshaped
            return None
        shape = self.cfg.emulation.link(self.options.region, region)
        return (region, LinkShape(shape[0] * 1e6, shape[1] / 1e3)) if shape else None

    # -- steps --------------------------------------------------------------------------------------------------

    def _start_step(self, start: pb.StartStep) -> None:
        assert self.cfg is not None and self.plan is not None
        self._head = _HeadState(epoch=self.plan.epoch, step=start.step, waiting=deque(start.microbatches))
        for _ in range(min(self.cfg.train.inflight, len(start.microbatches))):
            self._launch_next()

    def _launch_next(self) -> None:
        head = self._head
        if head is None or not head.waiting:
            return
        microbatch = head.waiting.popleft()
        head.in_flight.add(microbatch)
        self._submit(_FORWARD, lambda: self._head_forward(head.step, microbatch), head.epoch)

    def _batch(self, step: int, microbatch: int, validation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.cfg is not None and self.corpus is not None
        return self.corpus.batch(
            seed=self.cfg.run.seed,
            step=step,
            microbatch=microbatch,
            size=self.cfg.train.microbatch_size,
            seq_len=self.cfg.model.seq_len,
            validation=validation,
        )

    def _ref(self, step: int, microbatch: int, path: list[str], **extra) -> pb.MicrobatchRef:
        assert self.plan is not None
        return pb.MicrobatchRef(plan_epoch=self.plan.epoch, step=step, microbatch=microbatch, path=path, **extra)

    def _forward_to_next(self, ref: pb.MicrobatchRef, outputs: torch.Tensor) -> None:
        assert self.cfg is not None
        peer, address = self._peer(self.stage_index + 1)
        if not ref.eval:
            self.router.sent(peer, ref.step, ref.microbatch)
        encoded = self._encode("activations", peer, address, "forward", outputs)
        send = lambda: self.dataplane.send(peer, address, "forward", ref, encoded)  # noqa: E731
        self._send(send, f"forward to {peer}", peer)

    def _backward_to_previous(self, ref: pb.MicrobatchRef, grad: torch.Tensor) -> None:
        assert self.cfg is not None
        peer = ref.path[self.stage_index - 1]
        address = self._address_of(peer)
        encoded = self._encode("activation_grads", peer, address, "backward", grad)
        send = lambda: self.dataplane.send(peer, address, "backward", ref, encoded)  # noqa: E731
        self._send(send, f"backward to {peer}", peer)

    def _encode(self, kind: str, peer: str, address: str, direction: str, tensor: torch.Tensor) -> Encoded:
        """Encode a tensor of `kind` for peer with the configured codec, or auto's pick from what was measured.

        On the worker thread, not the senders': a link's codec state (PowerSGD's warm start) then sees its tensors
        in the order the worker produced them, whatever order the sender threads run in."""
        estimate, compute_s = self.dataplane.estimate(peer), self.compute.per_microbatch()
        codec = self._policies[kind].codec(peer, tensor.shape, tensor.dtype, estimate, compute_s)
        return self.dataplane.encode(peer, address, direction, codec, tensor)

    def _head_forward(self, step: int, microbatch: int) -> None:
        runtime = self.runtime
        assert runtime is not None
        x, y = self._batch(step, microbatch)
        outputs = runtime.forward((step, microbatch), x)
        path = [self.node_id]
        if runtime.is_last:
            loss, _ = runtime.loss_backward((step, microbatch), y)
            self.throughput.tick()
            self._microbatch_done(step, microbatch, path, loss)
        else:
            self._forward_to_next(self._ref(step, microbatch, path), outputs)

    def _microbatch_done(self, step: int, microbatch: int, path: list[str], loss: float) -> None:
        assert self.cfg is not None and self.plan is not None
        request = pb.MicrobatchDoneRequest(
            node_id=self.node_id,
            step=step,
            microbatch=microbatch,
            path=path,
            loss=loss,
            tokens=self.cfg.train.microbatch_size * self.cfg.model.seq_len,
            plan_epoch=self.plan.epoch,
        )
        self._report(self.coordinator.MicrobatchDone, request)
        if self._head is not None and self._head.step == step:
            self._head.in_flight.discard(microbatch)
            self._launch_next()

    # -- incoming tensors ---------------------------------------------------------------------------------------

    def check_incoming(self, direction: str, ref: pb.MicrobatchRef, header: pb.TensorHeader) -> None:
        """Raise FrameError unless this node's current plan expects this tensor."""
        plan, runtime, cfg = self.plan, self.runtime, self.cfg
        if plan is None or runtime is None or cfg is None:
            raise FrameError(grpc.StatusCode.UNAVAILABLE, "this node has no stage yet")
        if ref.plan_epoch != plan.epoch:
            raise FrameError(
                grpc.StatusCode.FAILED_PRECONDITION, f"plan epoch {ref.plan_epoch}, this node runs epoch {plan.epoch}"
            )
        if direction == "forward":
            if runtime.is_first:
                raise FrameError(grpc.StatusCode.FAILED_PRECONDITION, "the first stage takes no activations")
            if len(ref.path) != self.stage_index or ref.path[-1] not in plan.stages[self.stage_index - 1].node_ids:
                raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "activation path does not lead to this stage")
            kind = "activations"
        else:
            if runtime.is_last:
                raise FrameError(grpc.StatusCode.FAILED_PRECONDITION, "the last stage takes no gradients")
            if len(ref.path) != len(plan.stages) or ref.path[self.stage_index] != self.node_id:
                raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "gradient path does not pass through this node")
            kind = "activation_grads"
        shape = [cfg.train.microbatch_size, cfg.model.seq_len, cfg.model.d_model]
        check_activation_header(header, shape, self._policies[kind].accepted_ids, self.options.max_tensor_bytes)

    def accept(self, direction: str, ref: pb.MicrobatchRef, tensor: torch.Tensor, wire_bytes: int) -> None:
        """Queue the compute for a validated incoming tensor."""
        sender = ref.path[-1] if direction == "forward" else ref.path[self.stage_index + 1]
        self.dataplane.count_received(sender, tensor.numel() * tensor.element_size(), wire_bytes)
        if direction == "forward":
            self._submit(_FORWARD, lambda: self._on_forward(ref, tensor), ref.plan_epoch)
        else:
            self.router.returned(sender, ref.step, ref.microbatch)
            self._submit(_BACKWARD, lambda: self._on_backward(ref, tensor), ref.plan_epoch)

    def _on_forward(self, ref: pb.MicrobatchRef, x: torch.Tensor) -> None:
        runtime = self.runtime
        assert runtime is not None
        key = (ref.step, ref.microbatch)
        path = [*ref.path, self.node_id]
        if ref.eval:
            outputs = runtime.evaluate(x)
            if runtime.is_last:
                self._eval_done(ref.step, ref.microbatch, outputs)
            else:
                self._forward_to_next(self._ref(ref.step, ref.microbatch, path, eval=True), outputs)
            return
        if runtime.is_last:
            runtime.forward(key, x)
            _, y = self._batch(ref.step, ref.microbatch)
            loss, grad = runtime.loss_backward(key, y)
            self.throughput.tick()
            self._backward_to_previous(self._ref(ref.step, ref.microbatch, path, loss=loss), grad)
        else:
            self._forward_to_next(self._ref(ref.step, ref.microbatch, path), runtime.forward(key, x))

    def _on_backward(self, ref: pb.MicrobatchRef, grad: torch.Tensor) -> None:
        runtime = self.runtime
        assert runtime is not None
        grad_in = runtime.backward((ref.step, ref.microbatch), grad)
        self.throughput.tick()
        if runtime.is_first:
            self._microbatch_done(ref.step, ref.microbatch, list(ref.path), ref.loss)
        else:
            self._backward_to_previous(ref, grad_in)

    # -- evaluation ---------------------------------------------------------------------------------------------

    def _evaluate(self, order: pb.Evaluate) -> None:
        runtime = self.runtime
        assert runtime is not None
        for microbatch in order.microbatches:
            x, _ = self._batch(order.step, microbatch, validation=True)
            outputs = runtime.evaluate(x)
            if runtime.is_last:
                self._eval_done(order.step, microbatch, outputs)
            else:
                self._forward_to_next(self._ref(order.step, microbatch, [self.node_id], eval=True), outputs)

    def _eval_done(self, step: int, microbatch: int, logits: torch.Tensor) -> None:
        assert self.plan is not None
        _, y = self._batch(step, microbatch, validation=True)
        loss = loss_fn(logits, y).item()
        request = pb.EvalDoneRequest(
            node_id=self.node_id, step=step, microbatch=microbatch, loss=loss, plan_epoch=self.plan.epoch
        )
        self._report(self.coordinator.EvalDone, request)

    # -- commit -------------------------------------------------------------------------------------------------

    def _commit(self, order: pb.CommitStep) -> None:
        """Average the step's gradients with the stage's other replicas, then report their squared norm."""
        runtime, plan = self.runtime, self.plan
        assert runtime is not None and plan is not None
        if order.plan_epoch != plan.epoch:
            return
        stage = plan.stages[self.stage_index]
        if len(stage.node_ids) == 1:
            runtime.mean_gradients(order.step)
        else:
            if not self._averaging_ready.wait(_RPC_DEADLINE_S) or self.averager is None:
                raise StageFailure(pb.FAILURE_REASON_AVERAGING, "replica averaging is not available on this node")
            try:
                self._average_with_replicas(runtime, plan, stage, order.step)
            except Exception as e:
                why = f"averaging with the stage's replicas failed: {e!r}"
                raise StageFailure(pb.FAILURE_REASON_AVERAGING, why) from e
        parts = runtime.grad_sq_norm_parts()
        request = pb.GradNormRequest(
            node_id=self.node_id, step=order.step, sq_norm=math.fsum(parts), sq_norm_parts=parts, plan_epoch=plan.epoch
        )
        self._report(self.coordinator.GradNorm, request)

    def _average_with_replicas(
        self, runtime: StageRuntime, plan: pb.Plan, stage: pb.StageAssignment, step: int
    ) -> None:
        """Replace the step's gradients by their weighted mean over the stage's replicas."""
        from geotrain.node.averaging import group_id, replica_all_reduce

        assert self.averager is not None
        all_reduce = replica_all_reduce(
            self.averager,
            list(stage.peer_ids),
            list(stage.regions),
            float(runtime.counted(step)),
            lambda round_, part: group_id(self.run_id, stage.index, step, plan.epoch, round_, part),
            hierarchical=stage.hierarchical_allreduce,
            presummed=self._low_rank is None,
        )
        if self._low_rank is not None:
            runtime.mean_gradients(step)
            self._low_rank.average(plan.epoch, runtime.gradients(), all_reduce)
            return
        # The replicas' float64 sums, added exactly by the all-reduce: the mean train-local computes. hivemind
        # returns deltas; x64 + delta lies close enough to the reducer's float32 mean that all_reduce rounds it back
        # to exactly that on every replica, so replicas stay bit-identical.
        runtime.mean_gradients(step, lambda sums: all_reduce(0, sums))

    def _apply(self, order: pb.ApplyStep) -> None:
        runtime = self.runtime
        assert runtime is not None
        with self._state_lock:
            runtime.apply(order.step, order.clip_coef, order.lr)
            checksum = runtime.checksum()
            self.held.release_except(order.step + 1)  # the run committed past every copy kept from older plans
        self._head = None
        request = pb.StepAppliedRequest(node_id=self.node_id, step=order.step, checksum=checksum)
        self._report(self.coordinator.StepApplied, request)

    def state_snapshot(
        self, steps_done: int, layers: tuple[int, int] | None = None
    ) -> list[tuple[str, torch.Tensor]] | None:
        """Copies of the parameters and optimizer state of `layers` (None: the current stage's) after steps_done
        steps, from the current stage or one a newer plan moved this node away from; None if not held."""
        with self._state_lock:
            runtime = self.runtime
            if layers is not None and (runtime is None or (runtime.start, runtime.end) != layers):
                runtime = self.held.get(layers, steps_done)
            if runtime is None or runtime.applied_step + 1 != steps_done:
                return None
            return [(name, t.detach().clone()) for name, t in runtime.full_state()]
