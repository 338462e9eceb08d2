"""Membership: who registered, where each member is in its lifecycle, and who is dead; admission (scheduler.admission)
and failure reports and stalls (scheduler.accusations) are its parts.

Liveness runs on its own timer, so a silent node is declared dead whatever the step driver is doing (downloading
a checkpoint, waiting for a plan). Every change wakes whoever waits on the shared condition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from geotrain.config import SchedulerSection
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.limits import TokenBuckets
from geotrain.scheduler.accusations import Accusations, neighbours
from geotrain.scheduler.admission import Admission, subnet
from geotrain.scheduler.errors import ReportRefused, RunAborted, StepFailed, Unauthorized
from geotrain.scheduler.members import EventSink, Lifecycle, Member, Rejected, Scope
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.state import RunStore

# Re-exported: the coordinator's parts and the tests name them as membership's.
__all__ = ["EventSink", "Lifecycle", "Member", "Membership", "Rejected", "Scope", "neighbours", "subnet"]

log = logging.getLogger(__name__)

# Spares (members that serve no stage) heartbeat this often per second all together at most: a thousand idle
# volunteers would otherwise cost the coordinator a thousand calls a second, on the cores the run needs. Only the
# plan's nodes need the run's interval: a spare found dead a little later costs nothing until it is planned in.
_SPARE_HEARTBEATS_PER_S = 20.0
# libp2p peer ids are about 52 characters; a node reports counters for the links it sends on, a few per neighbour.
_PEER_ID_CHARS = 128
_LINKS = 1024

# A suspect is declared dead once this many heartbeat intervals late: well inside heartbeat_timeout_s, so a node that
# died is replaced fast; a report needs a second independent neighbour or the coordinator's own probe first.
_SUSPECT_LATE_INTERVALS = 1.5
# Data heads get microbatch ids in proportion to their speeds; past this no node computes, and a sum of such speeds
# stays finite.
_MAX_MICROBATCHES_PER_S = 1e6

_SPARE = (Lifecycle.JOINED, Lifecycle.PROFILED)


class Membership(Admission, Accusations):
    """The members of one run, their liveness, and the condition every waiter of the coordinator waits on."""

    def __init__(self, cfg: SchedulerSection, store: RunStore, orders: OrderQueues, on_event: EventSink) -> None:
        self.cfg = cfg
        self.store = store
        self.orders = orders
        self._on_event = on_event
        self.cond = threading.Condition()
        self.members: dict[str, Member] = {}
        self.stop_requested = threading.Event()
        self._accusations = {}
        self._suspects = set()
        self._stalls = {}
        self._stalled_keys = {}
        self._next_id = 1
        limits = cfg.new_ids_per_s, cfg.new_id_burst
        self._new_ids = {"host": TokenBuckets(*limits), "subnet": TokenBuckets(limits[0] * 8, limits[1] * 8)}
        self._spare_interval_s = cfg.heartbeat_interval_s  # what spares are told; set by the liveness timer

    # -- changes from RPC threads ---------------------------------------------------------------------------------

    def authorize(self, node_id: str, signer: bytes | None) -> None:
        """Unauthorized unless the call about member `node_id` was signed by the key its id belongs to. An id this
        coordinator does not know passes: every call about it is answered as about no member (register again)."""
        with self.cond:
            member = self.members.get(node_id)
            if signer is None or (member is not None and member.public_key != signer):
                raise Unauthorized(f"a call about node {node_id!r} must be signed by that node's key")

    def owner(self, signer: bytes | None) -> str | None:
        """The live member whose id belongs to this key, if any (the first, when a key registered several)."""
        with self.cond:
            return next((m.node_id for m in self.members.values() if m.alive and m.public_key == signer), None)

    def load_ordered(self, key: bytes | None, plan: pb.Plan | None, layers: tuple[int, int], steps_done: int) -> bool:
        """Whether a live member of `key` was ordered in `plan`'s epoch to load the state of its stage there,
        `layers`, after steps_done steps from the coordinator (what FetchCheckpoint may give that key)."""
        if key is None or plan is None:
            return False
        with self.cond:
            mine = [m.node_id for m in self.members.values() if m.alive and m.public_key == key]
        for stage in plan.stages:
            if (stage.layer_start, stage.layer_end) == layers:
                for node_id in set(stage.node_ids) & set(mine):
                    load = self.orders.load_from_coordinator(node_id)
                    if load is not None and (load.plan_epoch, load.steps_done) == (plan.epoch, steps_done):
                        return True
        return False

    def offence(self, node_id: str, why: str) -> bool:
        """Count a refused report against a live member; at scheduler.max_offences evict it (dead, its key refused
        from then on, a reason in the event log). True when it was evicted now."""
        with self.cond:
            member = self.members.get(node_id)
            if member is None or not member.alive:
                return False
            member.offences += 1
            if member.offences < self.cfg.max_offences:
                log.debug("offence %d of %s: %s", member.offences, node_id, why)
                return False
            member.lifecycle, member.died_at = Lifecycle.DEAD, time.monotonic()
            self._suspects.discard(node_id)
            self._accusations.pop(node_id, None)
            self.orders.close(node_id)
            self.cond.notify_all()
        detail = f"{member.offences} refused reports; the last: {why}"
        log.warning("node %s evicted: %s", node_id, detail)
        self.store.upsert_member(node_id, member.address, member.region, "evicted", member.public_key)
        self.store.event("evicted", node_id, detail)
        self._on_event("evicted", {"node_id": node_id, "why": detail})
        return True

    def heartbeat(self, request: pb.HeartbeatRequest) -> float | None:
        """Note that a node is alive, which plan and state it runs, and what it measured; returns the seconds until
        its next heartbeat, None if it is unknown or dead."""
        if not 0 <= request.microbatches_per_s <= _MAX_MICROBATCHES_PER_S:
            raise ReportRefused(
                f"heartbeat from {request.node_id} refused: its speed must be in [0, {_MAX_MICROBATCHES_PER_S:g}]"
            )
        if len(request.dht_peer_id) > _PEER_ID_CHARS or len(request.links) > _LINKS:
            raise ReportRefused(f"heartbeat from {request.node_id} refused: oversized peer id or link list")
        with self.cond:
            member = self.members.get(request.node_id)
            if member is None or not member.alive:
                return None
            member.last_seen = time.monotonic()
            self._suspects.discard(member.node_id)  # it is not silent: only lateness after now counts again
            member.beat_every = self._spare_interval_s if member.lifecycle in _SPARE else self.cfg.heartbeat_interval_s
            # Waiters watch these (and the peer id); a heartbeat that changes none of them wakes nobody, so a
            # thousand idle members cost the step driver nothing.
            changed = (request.plan_epoch, request.applied_step, request.state_epoch, request.dht_peer_id) != (
                member.plan_epoch, member.applied_steps, member.state_epoch, member.peer_id
            )
            member.plan_epoch = request.plan_epoch
            # A heartbeat built before a StepApplied report may arrive after it; only a state load (a new
            # state_epoch) moves a node's applied steps back.
            if request.applied_step >= member.applied_steps or request.state_epoch != member.state_epoch:
                member.applied_steps = request.applied_step
            member.state_epoch = request.state_epoch
            member.peer_id = request.dht_peer_id
            member.bytes_sent, member.bytes_received = request.bytes_sent, request.bytes_received
            member.relayed_bytes = request.relayed_bytes
            member.links = list(request.links)
            member.microbatches_per_s = request.microbatches_per_s
            member.peak_memory_bytes = request.peak_memory_bytes
            member.averaging_bytes_sent = request.averaging_bytes_sent
            if changed:
                self.cond.notify_all()
            return member.beat_every

    def set_profile(self, request: pb.NodeProfileReport) -> None:
        """Keep a node's latest (already checked) profile; KeyError for an unknown node."""
        with self.cond:
            member = self.members.get(request.node_id)
            if member is None:
                raise KeyError(request.node_id)
            member.profile = request
            if member.lifecycle is Lifecycle.JOINED:
                member.lifecycle = Lifecycle.PROFILED
            self.cond.notify_all()
    def note_applied(self, node_id: str, steps: int) -> None:
        """A member reported applying a step (fresher than its next heartbeat)."""
        member = self.members.get(node_id)
        if member is not None:
            member.applied_steps = steps

    # -- lifecycle set by the plan ----------------------------------------------------------------------------------

    def take_up(self, plan: pb.Plan) -> None:
        """A new plan was sent: its nodes load it (and their stage's state where they lack it); nodes outside it
        serve no stage."""
        in_plan = {n for s in plan.stages for n in s.node_ids}
        with self.cond:
            for m in self.alive():
                if m.node_id in in_plan:
                    m.lifecycle, m.planned = Lifecycle.LOADING, True
                elif m.lifecycle in (Lifecycle.LOADING, Lifecycle.SERVING):
                    m.lifecycle = Lifecycle.PROFILED if m.profile is not None else Lifecycle.JOINED

    def serving(self, plan: pb.Plan) -> None:
        """Every node of the plan runs it with the committed state."""
        with self.cond:
            for stage in plan.stages:
                for n in stage.node_ids:
                    member = self.members[n]
                    member.held = (stage.layer_start, stage.layer_end)
                    if member.alive:
                        member.lifecycle = Lifecycle.SERVING

    # -- liveness -------------------------------------------------------------------------------------------------

    def alive(self) -> list[Member]:
        """Members not declared dead."""
        return [m for m in self.members.values() if m.alive]

    def check_liveness(self, plan_nodes: set[str] | None = None) -> None:
        """Declare dead the members that are silent past the timeout (or late and confirmed failing: see
        report_failure), and forget those outside `plan_nodes` (the current plan's) that have been dead, or never
        profiled while never planned, for scheduler.forget_after_s (their ids stay bound to their keys)."""
        now = time.monotonic()
        died = []
        base = self.cfg.heartbeat_interval_s
        with self.cond:
            spares = 0
            for member in self.members.values():
                spares += member.lifecycle in _SPARE
                # A member told to beat less often than the run's interval is given as many of its intervals.
                stretch = max(1.0, member.beat_every / base)
                late = now - member.last_seen
                suspect_late = member.node_id in self._suspects and late > _SUSPECT_LATE_INTERVALS * base * stretch
                if member.alive and (late > self.cfg.heartbeat_timeout_s * stretch or suspect_late):
                    member.lifecycle, member.died_at = Lifecycle.DEAD, now
                    self._suspects.discard(member.node_id)
                    self._accusations.pop(member.node_id, None)
                    self.orders.close(member.node_id)
                    died.append((member, "peers report it failing" if suspect_late else f"no heartbeat for {late:.1f}s"))
            if died:
                self.cond.notify_all()
            self._spare_interval_s = max(base, spares / _SPARE_HEARTBEATS_PER_S)
            self._forget(now, plan_nodes or set())
        for member, why in died:
            log.warning("node %s is dead: %s", member.node_id, why)
            self.store.upsert_member(member.node_id, member.address, member.region, "dead", member.public_key)
            self.store.event("dead", member.node_id, why)
            self._on_event("dead", {"node_id": member.node_id})

    def _forget(self, now: float, plan_nodes: set[str]) -> None:
        """check_liveness's forgetting, under the condition."""
        bound = self.cfg.forget_after_s
        gone = [
            m.node_id for m in self.members.values()
            if m.node_id not in plan_nodes and (
                (not m.alive and now - m.died_at > bound)
                or (m.lifecycle is Lifecycle.JOINED and not m.planned and now - m.joined_at > bound))
        ]
        for node_id in gone:
            del self.members[node_id]
            self._accusations.pop(node_id, None)
            self._suspects.discard(node_id)
            self.orders.close(node_id)
        if gone:
            log.info("forgot %d member(s) dead or never profiled for %.0fs", len(gone), bound)

    def run_liveness(self, until: threading.Event, plan_nodes: Callable[[], set[str]] = set) -> threading.Thread:
        """Check liveness on a timer in a thread of its own until `until` is set; plan_nodes: the current plan's."""
        period = min(self.cfg.heartbeat_interval_s / 2, 0.5)

        def loop() -> None:
            while not until.wait(period):
                self.check_liveness(plan_nodes())

        thread = threading.Thread(target=loop, name="liveness", daemon=True)
        thread.start()
        return thread

    def lost(self) -> set[str]:
        """Members whose state of the step in progress is gone: dead, or restarted as a new incarnation."""
        return {m.node_id for m in self.members.values() if m.lifecycle in (Lifecycle.DEAD, Lifecycle.RESTARTED)}

    def wait(self, predicate: Callable[[], bool], what: str, timeout_s: float, scope: Scope | None = None) -> None:
        """Block until predicate() holds (evaluated under the condition); RunAborted on stop or timeout. Inside a
        plan epoch (scope), StepFailed when a node of it is lost or reports failing in that epoch, or on timeout."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            # A node that said it cannot take part fails the epoch even if the others got as far as predicate: what
            # it would have done (apply the step, average with its replicas) did not happen.
            if scope is not None:
                self._check_failure_reports(scope)
            while not predicate():
                if self.stop_requested.is_set():
                    raise RunAborted("stopped")
                if scope is not None:
                    self._check_scope(scope)
                    if scope.stall_after and time.monotonic() > scope.stall_after:
                        benched, why = self._stalled(scope), f"{what} stalled past what plan epoch {scope.epoch} allows"
                        if benched:
                            break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if scope is None:
                        raise RunAborted(f"timed out after {timeout_s:.0f}s waiting for {what}")
                    benched, why = self._stalled(scope), f"timed out after {timeout_s:.0f}s waiting for {what}"
                    break
                self.cond.wait(min(remaining, 0.1))
            else:
                return
        self._announce(benched, f"stalled plan epoch {scope.epoch}")
        raise StepFailed(why)

    def _check_scope(self, scope: Scope) -> None:
        lost = self.lost() & set(scope.nodes)
        if lost:
            raise StepFailed(f"node(s) {', '.join(sorted(lost))} lost")
        self._check_failure_reports(scope)

    def _check_failure_reports(self, scope: Scope) -> None:
        for n in scope.nodes:
            member = self.members.get(n)
            if member is not None and member.failed_epoch == scope.epoch:
                raise StepFailed(f"node {n} cannot take part: {member.failure}")
