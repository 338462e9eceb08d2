"""Membership: who registered, where each member is in its lifecycle, and who is dead.

Liveness runs on its own timer, so a silent node is declared dead whatever the step driver is doing (downloading
a checkpoint, waiting for a plan). Every change wakes whoever waits on the shared condition.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from geotrain.config import SchedulerSection
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.errors import ReportRefused, RunAborted, StepFailed, Unauthorized
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.reachability import UNREACHABLE, DialedBack
from geotrain.scheduler.state import RunStore

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict], None]


@dataclass(frozen=True)
class Scope:
    """What a wait inside a plan epoch depends on: losing one of these nodes, or one reporting that it cannot take
    part in the epoch, fails the step at once."""

    epoch: int
    nodes: tuple[str, ...]


class Rejected(Exception):
    """A registration the coordinator turns down, with the reason the node is told."""

    def __init__(self, reason: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# Spares (members that serve no stage) heartbeat this often per second all together at most: a thousand idle
# volunteers would otherwise cost the coordinator a thousand calls a second, on the cores the run needs. Only the
# plan's nodes need the run's interval: a spare found dead a little later costs nothing until it is planned in.
_SPARE_HEARTBEATS_PER_S = 20.0
# libp2p peer ids are about 52 characters; a node reports counters for the links it sends on, a few per neighbour.
_PEER_ID_CHARS = 128
_LINKS = 1024
# Ids, regions and addresses end up in plans, logs and the status page: short, printable, no spaces.
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


# Data heads get microbatch ids in proportion to their speeds; past this no node computes, and a sum of such speeds
# stays finite.
_MAX_MICROBATCHES_PER_S = 1e6


def _check_registration(request: pb.RegisterRequest) -> None:
    """Rejected(BAD_REQUEST) unless the id (if any), region (if any) and address are well-formed."""
    for what, value in (("node id", request.node_id), ("region", request.region)):
        if value and not _NAME.fullmatch(value):
            raise Rejected(pb.REJECT_REASON_BAD_REQUEST, f"{what} must be 1-64 of A-Z a-z 0-9 . _ : -")
    host, _, port = request.address.rpartition(":")
    if not (_HOST.fullmatch(host) and port.isdigit() and 0 < int(port) < 65536):
        raise Rejected(pb.REJECT_REASON_BAD_REQUEST, f"address must be HOST:PORT, got {request.address[:80]!r}")


class Lifecycle(enum.Enum):
    """Where a member stands."""

    JOINED = "joined"  # registered; measuring itself
    PROFILED = "profiled"  # its profile is in; serves no stage
    LOADING = "loading"  # the plan gives it a stage; it is taking up the plan and its stage's state
    SERVING = "serving"  # runs the current plan with the committed state
    RESTARTED = "restarted"  # a new incarnation of a node the plan counts on: its old one's work is lost
    DEAD = "dead"


_SPARE = (Lifecycle.JOINED, Lifecycle.PROFILED)


@dataclass
class Member:
    """A node that registered."""

    node_id: str
    address: str
    region: str
    joined_at: float
    last_seen: float
    lifecycle: Lifecycle = Lifecycle.JOINED
    plan_epoch: int = 0
    state_epoch: int = 0
    held: tuple[int, int] = (0, 0)  # layer range the node holds (0, 0: none)
    applied_steps: int = 0
    peer_id: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    links: list[pb.LinkCounter] = field(default_factory=list)
    microbatches_per_s: float = 0.0
    peak_memory_bytes: int = 0
    relayed_bytes: int = 0  # payload bytes it forwarded as a relay
    averaging_bytes_sent: int = 0  # replica averaging messages it sent, as its last heartbeat said
    profile: pb.NodeProfileReport | None = None  # the latest the node measured (scheduler.profiles reads it)
    beat_every: float = 0.0  # the heartbeat interval it was last told (0: the run's, from registration)
    failed_epoch: int = 0  # the plan epoch the node reported it cannot take part in (0: none)
    failure: str = ""  # why, as it reported
    public_key: bytes = b""  # the Ed25519 key its id belongs to; every call about it must be signed with it
    offences: int = 0  # its refused reports; scheduler.max_offences of them evict it
    reachability: str = ""  # the dial-back at registration: reachability.DIRECT or UNREACHABLE ("": not checked)
    relay_failures: int = 0  # relayed tensors it was reported not to deliver: plans relay through others first

    @property
    def unreachable(self) -> bool:
        """Nobody can dial it: its neighbours send to it over streams it opens."""
        return self.reachability == UNREACHABLE

    @property
    def alive(self) -> bool:
        """Not declared dead."""
        return self.lifecycle is not Lifecycle.DEAD

    @property
    def restarted(self) -> bool:
        """A new incarnation the current plan has not taken up yet."""
        return self.lifecycle is Lifecycle.RESTARTED


class Membership:
    """The members of one run, their liveness, and the condition every waiter of the coordinator waits on."""

    def __init__(self, cfg: SchedulerSection, store: RunStore, orders: OrderQueues, on_event: EventSink) -> None:
        self.cfg = cfg
        self.store = store
        self.orders = orders
        self._on_event = on_event
        self.cond = threading.Condition()
        self.members: dict[str, Member] = {}
        self.stop_requested = threading.Event()
        self._suspects: set[str] = set()
        self._next_id = 1
        self._spare_interval_s = cfg.heartbeat_interval_s  # what spares are told; set by the liveness timer

    # -- changes from RPC threads ---------------------------------------------------------------------------------

    def admit(
        self, request: pb.RegisterRequest, plan_nodes: set[str], dial_back: Callable[[], DialedBack] | None = None
    ) -> Member:
        """Admit a registration (a new node, or a known id returning) with what dial_back finds once the request is
        well-formed and its key not evicted (None: not dialled); Rejected with the reason otherwise."""
        _check_registration(request)
        key = request.public_key
        if key and self.store.evicted(key):
            raise Rejected(pb.REJECT_REASON_EVICTED, "this node's key was evicted from the run for refused reports")
        dialed = dial_back() if dial_back is not None else None  # outside the condition: it takes seconds
        with self.cond:
            node_id = request.node_id
            existing = self.members.get(node_id) if node_id else None
            # Under the condition, so that of two first registrations of one id only the first key gets it.
            owner = existing.public_key if existing is not None else self.store.member_key(node_id) if node_id else None
            if owner is not None and owner != key:
                raise Rejected(
                    pb.REJECT_REASON_IDENTITY,
                    f"node id {node_id} belongs to another key (the node that first registered it); a node keeps "
                    "its key in its --state-dir: join with that directory, or under another --node-id",
                )
            # The same id from a new address is that node restarted (its old process is gone); from the same
            # address while the old one still heartbeats, it is a second node claiming a live identity.
            if existing is not None and existing.alive and existing.address == request.address and not self._silent(existing):
                raise Rejected(pb.REJECT_REASON_DUPLICATE_NODE, f"node {node_id} is already live")
            if existing is None and len(self.members) >= self.cfg.max_members:
                raise Rejected(pb.REJECT_REASON_FULL, f"the run admits {self.cfg.max_members} nodes and has them")
            if not node_id:
                # Ids of an earlier coordinator incarnation belong to their keys too.
                while (n := f"node-{self._next_id}") in self.members or self.store.member_key(n) is not None:
                    self._next_id += 1
                node_id = f"node-{self._next_id}"
            now = time.monotonic()
            member = Member(node_id, request.address, request.region or "local", now, now, public_key=key)
            if dialed is not None:
                # The address that answered is the one peers dial, which may be where the call came from.
                member.reachability, member.address = dialed.state, dialed.reached or request.address
            if request.layer_end:
                member.held = (request.layer_start, request.layer_end)
                member.applied_steps = request.applied_steps
            if existing is not None and node_id in plan_nodes and not request.layer_end:
                member.lifecycle = Lifecycle.RESTARTED
            if existing is not None and existing.region == member.region:
                # The node measures itself again, which takes a while; until its report arrives, what it measured
                # before lets the re-plan on its return count it in.
                member.profile = existing.profile
                if member.lifecycle is Lifecycle.JOINED and member.profile is not None:
                    member.lifecycle = Lifecycle.PROFILED
            self.members[node_id] = member
            self.orders.open(node_id)
            self.cond.notify_all()
        kind = "rejoin" if existing is not None else "join"
        if dialed is not None:
            detail = (f"reachable at {dialed.reached}" if dialed.reached
                      else f"not reachable at {request.address} from outside")
            log.info("%s is %s", node_id, detail)
            self.store.event("reachability", node_id, detail)
        self.store.upsert_member(node_id, member.address, member.region, "alive", key)  # the address that answered
        self.store.event(kind, node_id, request.address)
        self._on_event(kind, {"node_id": node_id, "address": request.address, "region": member.region})
        return member

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
            member.lifecycle = Lifecycle.DEAD
            self._suspects.discard(node_id)
            self.orders.close(node_id)
            self.cond.notify_all()
        detail = f"{member.offences} refused reports; the last: {why}"
        log.warning("node %s evicted: %s", node_id, detail)
        self.store.upsert_member(node_id, member.address, member.region, "evicted", member.public_key)
        self.store.event("evicted", node_id, detail)
        self._on_event("evicted", {"node_id": node_id, "why": detail})
        return True

    def _silent(self, member: Member) -> bool:
        """The member has missed more than two heartbeats (a restarted node may take its id back)."""
        return time.monotonic() - member.last_seen > 2 * self.cfg.heartbeat_interval_s

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

    def report_failure(self, request: pb.FailureReport) -> None:
        """A node's calls to a peer fail (the peer is dead if it is also late with its heartbeat), or a node reports
        that it cannot take part in a plan epoch (its step fails at once instead of at the step timeout)."""
        own = request.peer == request.node_id and request.reason != pb.FAILURE_REASON_UNSPECIFIED
        with self.cond:
            peer = self.members.get(request.peer)
            if peer is None or not peer.alive:
                return
            if own:
                peer.failed_epoch, peer.failure = request.plan_epoch, request.detail
            else:
                log.debug("%s reports %s failing: %s", request.node_id, request.peer, request.detail)
                self._suspects.add(request.peer)
            self.cond.notify_all()
        if own:
            why = f"{pb.FailureReason.Name(request.reason)} in plan epoch {request.plan_epoch}: {request.detail}"
            log.warning("node %s cannot take part: %s", request.node_id, why)
            self.store.event("node_failure", request.node_id, why)

    def relay_failed(self, request: pb.FailureReport) -> None:
        """Relay request.peer did not deliver request.node_id's tensor to request.relayed_to in request.plan_epoch
        (a route of the plan of that epoch, checked by the caller): that epoch's step fails at once, the relay is
        suspected (dead at once if it is also late with its heartbeat) and later plans relay through others first;
        the receiver is not blamed."""
        why = f"it did not relay {request.node_id}'s tensor to {request.relayed_to}: {request.detail[:200]}"
        with self.cond:
            relay = self.members.get(request.peer)
            if relay is None or not relay.alive:
                return
            relay.failed_epoch, relay.failure = request.plan_epoch, why
            relay.relay_failures += 1
            self._suspects.add(relay.node_id)
            self.cond.notify_all()
        log.warning("relay %s failed: %s", request.peer, why)
        self.store.event("relay_failure", request.peer, why)

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
                    m.lifecycle = Lifecycle.LOADING
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

    def check_liveness(self) -> None:
        """Declare dead the members that are silent past the timeout (or late and reported failing by peers)."""
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
                suspect_late = member.node_id in self._suspects and late > 1.5 * base * stretch
                if member.alive and (late > self.cfg.heartbeat_timeout_s * stretch or suspect_late):
                    member.lifecycle = Lifecycle.DEAD
                    self._suspects.discard(member.node_id)
                    self.orders.close(member.node_id)
                    died.append((member, "peers report it failing" if suspect_late else f"no heartbeat for {late:.1f}s"))
            if died:
                self.cond.notify_all()
            self._spare_interval_s = max(base, spares / _SPARE_HEARTBEATS_PER_S)
        for member, why in died:
            log.warning("node %s is dead: %s", member.node_id, why)
            self.store.upsert_member(member.node_id, member.address, member.region, "dead", member.public_key)
            self.store.event("dead", member.node_id, why)
            self._on_event("dead", {"node_id": member.node_id})

    def run_liveness(self, until: threading.Event) -> threading.Thread:
        """Check liveness on a timer in a thread of its own until `until` is set."""
        period = min(self.cfg.heartbeat_interval_s / 2, 0.5)

        def loop() -> None:
            while not until.wait(period):
                self.check_liveness()

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
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    error = StepFailed if scope is not None else RunAborted
                    raise error(f"timed out after {timeout_s:.0f}s waiting for {what}")
                self.cond.wait(min(remaining, 0.1))

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
