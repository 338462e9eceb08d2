"""The node's link to the coordinator: register (again after a coordinator restart), the heartbeat loop, the order
stream and its dispatch to the worker, and reports sent off the worker thread with retries."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
import torch

from geotrain import __version__
from geotrain.compression import PowerSgdCodec, get_codec
from geotrain.compression.policy import CodecPolicy
from geotrain.config import from_proto
from geotrain.node.device import DeviceError, describe, node_precision, peak_memory_bytes
from geotrain.node.lowrank import LowRankAveraging
from geotrain.node.verifier import Evidence
from geotrain.node.worker import CONTROL
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.limits import PeerLimits
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.tls import tls_mismatch
from geotrain.protocol.transport import call_with_retry
from geotrain.protocol.version import PROTOCOL_VERSION

log = logging.getLogger(__name__)

RPC_DEADLINE_S = 30.0
# The longest wait between attempts to reach a coordinator that is away: a resumed run finds its nodes within it.
_MAX_BACKOFF_S = 2.0
# An absence is said once it lasts this long: a blip of the network is no news.
_AWAY_NOTICE_S = 3.0
# Kinds of traffic the data plane carries, by the [compression] key of their codec.
_TRAFFIC = ("activations", "activation_grads")


class NodeError(RuntimeError):
    """The node cannot take part in the run (rejected, incompatible corpus, coordinator gone)."""


class CoordinatorLink:
    """The Agent's side of the coordinator protocol (a part of Agent: orders are handled by its other parts)."""

    coordinator: rpc.CoordinatorStub
    heartbeat_interval_s: float
    device: torch.device  # where the stage computes (NodeOptions.device, resolved)
    precision: str  # what it computes in: the run's train.precision, or fp32 as its precision_fallback allows
    _next_beat_at: float = 0.0  # time.monotonic() from which the heartbeat loop sends the next heartbeat
    run_id: str
    _orders: grpc.Future | None  # the open order stream, cancelled by stop()
    key: NodeKey  # the node's identity: its id belongs to this key, which signs every call
    _must_register: threading.Event
    _away_since: float | None = None  # time.monotonic() since which the coordinator has not answered; None: it does
    _away_said: bool = False  # the node's owner was told of this absence
    limits: PeerLimits  # what peers may hold of the node's server: the run's [limits] once registered
    on_reachability: Callable[[str], None]  # hears that outcome as one line for the node's owner
    behind_nat: bool = False  # the coordinator's dial-back reached this node nowhere
    listen_for_tensor_streams: Callable[[], None]  # the Agent's: take tensors over raw streams from now on

    def _register(self) -> None:
        """Register (again, after a coordinator restart, with the stage this node holds)."""
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
            public_key=self.key.public,
        )
        reply = self._retry_until_reachable(lambda: self.coordinator.Register(request, timeout=RPC_DEADLINE_S))
        if not reply.accepted:
            raise NodeError(f"coordinator rejected this node ({pb.RejectReason.Name(reply.reason)}): {reply.message}")
        self.node_id = reply.node_id
        self.heartbeat_interval_s = reply.heartbeat_interval_s
        self.cfg = from_proto(reply.config)
        self.evidence = Evidence(self.cfg.verify.keep_steps, self.device) if self.cfg.verifying else None
        self.limits.configure(self.cfg.limits.values())
        if self.cfg.transport.tensor_stream == "tcp":
            self.listen_for_tensor_streams()
        self.dataplane.use_tensor_streams(self.cfg.transport.tensor_stream == "tcp")
        try:
            self.precision = node_precision(self.device, self.cfg.train)
        except DeviceError as e:
            raise NodeError(str(e)) from None
        if self.precision != self.cfg.train.precision:
            log.warning(
                "%s cannot compute in %s: this node computes in %s, as train.precision_fallback allows",
                describe(self.device), self.cfg.train.precision, self.precision,
            )
        self._policies = {kind: CodecPolicy(kind, getattr(self.cfg.compression, kind)) for kind in _TRAFFIC}
        replica_codec = get_codec(self.cfg.compression.replica_grads)
        self._low_rank = LowRankAveraging(replica_codec) if isinstance(replica_codec, PowerSgdCodec) else None
        self.run_id = reply.run_id
        self._must_register.clear()
        self._sender.submit(self.profiler.report)  # a restarted coordinator has lost it (before timing: no-op)
        log.info("registered as %s, serving on %s", self.node_id, self.address)
        self.behind_nat = reply.reachability == pb.REACHABILITY_UNREACHABLE
        if reply.reachability != pb.REACHABILITY_UNSPECIFIED:
            self.on_reachability(
                f"reachable at {reply.reachable_at}" if reply.reachability == pb.REACHABILITY_DIRECT
                else "not reachable from outside: neighbours will use connections this node opens"
            )
        if not self.options.state_dir:
            log.info("no --state-dir: this node's key lives in memory only, so once restarted it joins as a new node")

    def _retry_until_reachable(self, call: Callable[[], object]):
        """Call the coordinator, retrying with backoff while it is away (_coordinator_away says when to give up)."""
        backoff = 0.2
        while True:
            try:
                reply = call()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise NodeError(f"the coordinator refused the run token ({e.details()})") from None
                self._check_is_coordinator(e)
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                self._check_tls_matches()
                self._coordinator_away(e.details())
                if self.stopped.is_set():
                    raise NodeError("stopped while waiting for the coordinator") from None
                log.debug("coordinator unreachable, retrying in %.1fs", backoff)
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
            else:
                self._coordinator_back()
                return reply

    def _coordinator_away(self, detail: str) -> None:
        """Note that the coordinator cannot be reached, said once per absence: a coordinator that stops (a restart,
        an upgrade, a crash) pauses the run, and this node keeps its state for when it is back. NodeError once it has
        been away longer than give_up_after_s."""
        now = time.monotonic()
        bound = self.options.give_up_after_s
        if self._away_since is None:
            self._away_since, self._away_said = now, False
        if not self._away_said and now - self._away_since >= _AWAY_NOTICE_S:
            self._away_said = True
            log.warning(
                "the coordinator at %s is away (%s): keeping this node's state and waiting up to %s for it",
                self.options.coordinator, detail, _duration(bound),
            )
        if now - self._away_since > bound:
            raise NodeError(
                f"coordinator {self.options.coordinator} unreachable for {_duration(bound)} (--give-up-after): {detail}"
            )

    def _coordinator_back(self) -> None:
        """The coordinator answers again: say so once, after an absence."""
        if self._away_since is not None and self._away_said:
            log.warning("the coordinator at %s is back after %.0fs", self.options.coordinator,
                        time.monotonic() - self._away_since)
        self._away_since = None

    def _check_is_coordinator(self, e: grpc.RpcError) -> None:
        """NodeError when what answers at --coordinator is no geotrain coordinator (another HTTP server, a node's
        Stage port): gRPC reports the first as a frame it failed to parse, which retrying cannot fix."""
        details = e.details() or ""
        if e.code() == grpc.StatusCode.UNIMPLEMENTED or "Failed parsing HTTP/2" in details or (
            e.code() == grpc.StatusCode.UNKNOWN and "content-type" in details.lower()
        ):
            raise NodeError(f"something answers at {self.options.coordinator}, but that is not a geotrain coordinator")

    def _check_tls_matches(self) -> None:
        """Raise NodeError when the coordinator answers but not in this node's TLS (or plaintext): gRPC reports that
        as the coordinator being unavailable, and retrying cannot help."""
        problem = tls_mismatch(self.options.coordinator, self.options.tls)
        if problem is not None:
            raise NodeError(f"the coordinator {problem}")

    def _orders_loop(self) -> None:
        backoff = 0.2
        while not self.stopped.is_set():
            if self._must_register.is_set():
                self._register()
            # Opening a stream raises nothing: its first read says whether the coordinator answers.
            self._orders = self.coordinator.Orders(pb.OrdersRequest(node_id=self.node_id))
            try:
                for order in self._orders:
                    self._coordinator_back()
                    backoff = 0.2
                    if self._on_order(order):
                        return
            except grpc.RpcError as e:
                if self.stopped.is_set():
                    return
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._must_register.set()  # a restarted coordinator does not know us yet
                    log.debug("the coordinator does not know this node (restarted): registering again")
                    continue
                if e.code() == grpc.StatusCode.CANCELLED and self._must_register.is_set():
                    continue  # the heartbeat cancelled it to register again
                self._check_is_coordinator(e)
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise
                self._coordinator_away(e.details())
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)

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
        if kind == "join_averaging":
            self._join_averaging(list(order.join_averaging.initial_peers))
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
            "upload_state": lambda: self._upload_state(order.upload_state),
            "verify": lambda: self._verify(order.verify),
        }
        self._submit(CONTROL, handlers[kind])
        return False

    def _heartbeat_loop(self) -> None:
        # Ticks at the run's interval; beats when the coordinator's last reply said (a spare of a large run is told to
        # beat less often; a new plan's own heartbeat brings the run's interval back at once).
        while not self.stopped.wait(self.heartbeat_interval_s):
            if time.monotonic() >= self._next_beat_at:
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
            peak_memory_bytes=peak_memory_bytes(self.device),
            relayed_bytes=self.dataplane.reverse.relayed_bytes if self.dataplane.reverse is not None else 0,
            averaging_bytes_sent=self.averager.bytes_sent if self.averager is not None else 0,
        )
        try:
            reply = self.coordinator.Heartbeat(request, timeout=max(1.0, 2 * self.heartbeat_interval_s))
        except grpc.RpcError as e:
            log.debug("heartbeat failed: %s", e.details())
            return
        except ValueError:  # the channel closed under us while shutting down
            return
        # Told when to beat next, counted from now; 0 (an older coordinator) leaves the run's interval.
        self._next_beat_at = time.monotonic() + reply.next_heartbeat_s - self.heartbeat_interval_s
        if not reply.known and not self._must_register.is_set():
            log.warning("the coordinator does not know this node (restarted, or declared it dead): registering again")
            self._must_register.set()
            if self._orders is not None:
                self._orders.cancel()

    def _send(self, fn: Callable[[], None], what: str, peer: str = "", epoch: int = 0) -> None:
        """Run fn off the worker thread; when it sends a tensor of plan epoch `epoch` to `peer` and fails, report
        the node to blame: peer when it let the call's deadline pass, the relay whatever the failure when the link
        runs through one."""
        def run() -> None:
            try:
                fn()
            except grpc.RpcError as e:
                log.warning("%s failed: %s %s", what, e.code().name, e.details())
                relay = self.dataplane.relay_of(peer) if peer else None
                if relay is not None:
                    self._send_failure_report(pb.FailureReport(
                        node_id=self.node_id, peer=relay, relayed_to=peer, plan_epoch=epoch,
                        detail=f"{what} through relay {relay}: {e.code().name} {e.details()}"[:500],
                    ))
                elif peer and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._report_failure(peer, f"{what}: {e.code().name}", epoch)

        if self._held_sends is not None:  # a stretched task sends it (only worker tasks send, on the worker thread)
            self._held_sends.append(run)
        else:
            self._sender.submit(run)

    def _report(self, method: Callable, request: object) -> None:
        """Send a report to the coordinator off the worker thread, retrying while it is unavailable."""
        self._send(lambda: call_with_retry(lambda: method(request, timeout=RPC_DEADLINE_S)), type(request).__name__)

    def _report_failure(self, peer: str, detail: str, epoch: int = 0) -> None:
        """Tell the coordinator that calls to peer fail in plan epoch `epoch` (0: the current one), so it can declare
        the peer dead before its heartbeat lapses, or judge it by that epoch's step."""
        self._send_failure_report(pb.FailureReport(node_id=self.node_id, peer=peer, detail=detail, plan_epoch=epoch))

    def _send_failure_report(self, request: pb.FailureReport) -> None:
        try:
            self.coordinator.ReportFailure(request, timeout=5.0)
        except grpc.RpcError as e:
            log.debug("failure report lost: %s", e.details())


def _duration(seconds: float) -> str:
    """Seconds as a person reads them: 45s, 30 min, 1.5 h."""
    if seconds < 120:
        return f"{seconds:g}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
