"""Membership: who registered, where each member is in its lifecycle, and who is dead.

Liveness runs on its own timer, so a silent node is declared dead whatever the step driver is doing (downloading
a checkpoint, waiting for a plan). Every change wakes whoever waits on the shared condition.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from geotrain.config import SchedulerSection
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.limits import TokenBuckets
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
    # After this (monotonic; 0: never) the step is past what its plan allows: a node of it that a neighbour reports
    # failing in the epoch stalled it (judged then, not at the step timeout).
    stall_after: float = 0.0


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


# A suspect is declared dead once this many heartbeat intervals late: well inside heartbeat_timeout_s, so a node that
# died is replaced fast; a report needs a second independent neighbour or the coordinator's own probe first.
_SUSPECT_LATE_INTERVALS = 1.5
# A key that took a stage and stalled a step is refused stages for scheduler.stall_refusal_s, doubling each time
# after, up to a day. Once this many keys of one host stalled, the host registers no new ids for as long (doubling
# likewise): its keys that never stalled keep their stages (local nodes, or volunteers behind one NAT, share a host).
_STALL_MAX_S = 86400.0
_HOST_STALLED_KEYS = 3
# A host's subnet of new ids (admission pace, spares cap): volunteers of one ISP customer or one cloud network.
_SUBNET_BITS = {4: 24, 6: 64}


def subnet(host: str) -> str:
    """The /24 (IPv4) or /64 (IPv6) of an IP host, or the host itself when it is no IP address ("": unknown)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    return str(ipaddress.ip_network(f"{ip}/{_SUBNET_BITS[ip.version]}", strict=False))


def neighbours(plan: pb.Plan | None, node_id: str) -> set[str]:
    """The nodes `node_id` exchanges tensors with under `plan`: every node of the stages before and after its own,
    and for a link through a relay, the relay and the link's two ends."""
    if plan is None:
        return set()
    stages = [list(s.node_ids) for s in plan.stages]
    found: set[str] = set()
    for i, nodes in enumerate(stages):
        if node_id in nodes:
            for j in (i - 1, i + 1):
                if 0 <= j < len(stages):
                    found.update(stages[j])
    for route in plan.relays:
        ends = {route.a, route.b, route.relay_id}
        if node_id in ends:
            found.update(ends)
    found.discard(node_id)
    return found


@dataclass
class _Accusation:
    """One neighbour's report that a peer's calls fail: who, from which key and host, and what the peer had applied
    then (a peer that applies a step later answered it: judge_reports weighs it by that step's time)."""

    key: bytes
    host: str
    applied_steps: int
    at: float
    epoch: int  # the plan epoch it is about


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
    host: str = ""  # the host its registration came from (the gRPC peer; "": in process)
    planned: bool = False  # some plan gave it a stage
    died_at: float = 0.0  # when it was declared dead (forgotten scheduler.forget_after_s later)

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


def _key(member: Member) -> tuple[str, object]:
    """What a member's stalls follow: its key (in process, where members may have none, its id)."""
    return "key", member.public_key or member.node_id


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
        # node -> reporter -> its report that the node's calls fail, and the suspects those reports (two independent
        # neighbours) or the coordinator's probe confirmed: only these are declared dead before heartbeat_timeout_s.
        self._accusations: dict[str, dict[str, _Accusation]] = {}
        self._suspects: set[str] = set()
        # ("key", public key) or ("host", host) -> (stalls so far, refused until): see _bench.
        self._stalls: dict[tuple[str, object], tuple[int, float]] = {}
        self._stalled_keys: dict[str, set[bytes]] = {}  # host -> its keys that stalled
        self._next_id = 1
        limits = cfg.new_ids_per_s, cfg.new_id_burst
        self._new_ids = {"host": TokenBuckets(*limits), "subnet": TokenBuckets(limits[0] * 8, limits[1] * 8)}
        self._spare_interval_s = cfg.heartbeat_interval_s  # what spares are told; set by the liveness timer

    # -- changes from RPC threads ---------------------------------------------------------------------------------

    def screen(self, request: pb.RegisterRequest, host: str) -> None:
        """The checks of a registration before the coordinator dials it: well-formed, its key not evicted, room for
        a new id (admit's _check_room) and, from `host`, within its pace of new ids; Rejected otherwise. A token
        holder cannot make the coordinator dial for a registration these refuse."""
        _check_registration(request)
        if request.public_key and self.store.evicted(request.public_key):
            raise Rejected(pb.REJECT_REASON_EVICTED, "this node's key was evicted from the run for refused reports")
        with self.cond:
            known = bool(request.node_id) and (
                request.node_id in self.members or self.store.member_key(request.node_id) is not None)
            if not known:
                self._check_room(host, None)
        if not known and host:
            self._pace_new_id(host)

    def admit(
        self, request: pb.RegisterRequest, plan_nodes: set[str], dial_back: Callable[[], DialedBack] | None = None,
        host: str = "",
    ) -> Member:
        """Admit a registration (a new node, or a known id returning) from `host` (the caller's IP, which screen()
        passed; "": in process, where no host limit applies) with what dial_back finds once the request is
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
            self._check_room(host, existing)
            if not node_id:
                # Ids of an earlier coordinator incarnation belong to their keys too.
                while (n := f"node-{self._next_id}") in self.members or self.store.member_key(n) is not None:
                    self._next_id += 1
                node_id = f"node-{self._next_id}"
            now = time.monotonic()
            member = Member(node_id, request.address, request.region or "local", now, now, public_key=key, host=host)
            member.planned = existing is not None and existing.planned
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
            self._accusations.pop(node_id, None)  # about its old incarnation
            self._suspects.discard(node_id)
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

    def _check_room(self, host: str, existing: Member | None) -> None:
        """Rejected(FULL) when the run has scheduler.max_members live members, or `host` (or its subnet) as many
        live members that no plan ever gave a stage as scheduler.spares_per_host (spares_per_subnet) allows; a
        returning member (`existing`) counts as itself. Under the condition."""
        others = [m for m in self.members.values() if m.alive and m is not existing]
        if existing is None and len(others) >= self.cfg.max_members:
            raise Rejected(pb.REJECT_REASON_FULL, f"the run admits {self.cfg.max_members} nodes and has them")
        if not host or (existing is not None and existing.planned):
            return
        until = self._stalls.get(("host", host), (0, 0.0))[1]
        if existing is None and until > time.monotonic():
            raise Rejected(pb.REJECT_REASON_FULL, f"host {host} registers no new node ids for {until - time.monotonic():.0f}s "
                           f"more: {len(self._stalled_keys[host])} of its keys took stages and stalled steps")
        spares = [m for m in others if not m.planned]
        where = subnet(host)
        for cap, count, what in (
            (self.cfg.spares_per_host, sum(m.host == host for m in spares), f"host {host}"),
            (self.cfg.spares_per_subnet, sum(subnet(m.host) == where for m in spares), f"network {where}"),
        ):
            if count >= cap:
                raise Rejected(pb.REJECT_REASON_FULL, f"{what} has {count} members that serve no stage, as many as "
                               "the run admits from one place (scheduler.spares_per_host, spares_per_subnet)")

    def _pace_new_id(self, host: str) -> None:
        """Rejected(FULL) when `host`, or its subnet, registers new node ids faster than scheduler.new_ids_per_s
        (8 times that a subnet): a flood from one place cannot take the run's room from volunteers elsewhere."""
        for what, place in (("host", host), ("subnet", subnet(host))):
            buckets = self._new_ids[what]
            if not buckets.take(place):
                raise Rejected(pb.REJECT_REASON_FULL, f"this {what} registers new node ids at most {buckets.rate:g} "
                               f"a second (burst {buckets.burst}): try again later")

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

    def judge_reports(self, epoch: int, slow: bool | None) -> None:
        """A step of plan epoch `epoch` committed, slow (True: past what its plan allows), fast (False: quicker than
        any honest call's deadline) or neither (None). Each report of that epoch whose accused has applied a step
        since is judged: on a slow step the accused stalled it (benched, unless it reported someone itself), on a
        fast one the report was false (the reporter's offence), else it is dropped. Older epochs' are dropped."""
        with self.cond:
            answered = []
            for node_id, reports in list(self._accusations.items()):
                applied = self.members[node_id].applied_steps if node_id in self.members else -1
                for reporter, a in list(reports.items()):
                    if a.epoch != epoch or applied > a.applied_steps:
                        del reports[reporter]
                        answered += [(node_id, reporter)] if a.epoch == epoch else []
                if not reports:
                    del self._accusations[node_id]
            reporters = {r for _, r in answered}
            benched = self._bench({n for n, _ in answered} - reporters) if slow else []
        for node_id, reporter in answered if slow is False else []:
            self.offence(reporter, f"reported {node_id} failing in plan epoch {epoch}, whose step was fast")
        self._announce(benched, f"stalled a step of plan epoch {epoch}")

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

    def report_failure(self, request: pb.FailureReport, plan: pb.Plan | None) -> Member | None:
        """A node's calls to a peer fail (the peer is dead if it is also late with its heartbeat), or a node reports
        that it cannot take part in a plan epoch (its step fails at once instead of at the step timeout).

        A report about a peer counts only from one of its neighbours under `plan`, the current plan, about that
        plan's epoch (0: the current one, as nodes send it), when a call between them was due; one a member never
        planned makes is refused (ReportRefused, an offence). Returns the peer for the coordinator to probe when
        this is the first report against it: only that probe failing, or a second neighbour of another key and
        host, makes it a suspect (declared dead when _SUSPECT_LATE_INTERVALS late)."""
        own = request.peer == request.node_id and request.reason != pb.FAILURE_REASON_UNSPECIFIED
        with self.cond:
            peer = self.members.get(request.peer)
            if peer is None or not peer.alive:
                return None
            if own:
                peer.failed_epoch, peer.failure = request.plan_epoch, request.detail
                self.cond.notify_all()
            else:
                reporter = self.members.get(request.node_id)
                if reporter is None or not reporter.planned:
                    raise ReportRefused(f"{request.node_id} serves no stage: it calls no peer, {request.peer} included")
                epoch = plan.epoch if plan is not None else 0
                if request.plan_epoch not in (0, epoch) or request.peer not in neighbours(plan, request.node_id):
                    log.debug("%s's report about %s ignored: no neighbour in plan epoch %d", request.node_id,
                              request.peer, epoch)
                    return None
                log.debug("%s reports %s failing: %s", request.node_id, request.peer, request.detail)
                return self._accuse(peer, reporter, epoch)
        why = f"{pb.FailureReason.Name(request.reason)} in plan epoch {request.plan_epoch}: {request.detail}"
        log.warning("node %s cannot take part: %s", request.node_id, why)
        self.store.event("node_failure", request.node_id, why)
        return None

    def _accuse(self, peer: Member, reporter: Member, epoch: int) -> Member | None:
        """Note reporter's report against peer in plan epoch `epoch` (under the condition); the peer to probe if it
        is the first."""
        reports = self._accusations.setdefault(peer.node_id, {})
        first = not reports
        reports[reporter.node_id] = _Accusation(reporter.public_key, reporter.host, peer.applied_steps,
                                                time.monotonic(), epoch)
        keys = {a.key for a in reports.values()}
        hosts = {a.host for a in reports.values()}
        if len(keys) >= 2 and (len(hosts) >= 2 or "" in hosts):  # in process ("" host), keys tell nodes apart
            self._suspect(peer.node_id)
        return peer if first else None

    def _suspect(self, node_id: str) -> None:
        if node_id not in self._suspects:
            self._suspects.add(node_id)
            self.cond.notify_all()

    def probed(self, node_id: str, answered: bool) -> None:
        """The coordinator's probe of a reported peer: silent, it is a suspect; answering, it is not (yet)."""
        with self.cond:
            if not answered and node_id in self._accusations:
                self._suspect(node_id)

    def relay_failed(self, request: pb.FailureReport) -> Member | None:
        """Relay request.peer did not deliver request.node_id's tensor to request.relayed_to in request.plan_epoch
        (a route of the plan of that epoch, checked by the caller): that epoch's step fails at once, the relay is
        reported as report_failure's peers are (the probe to make, if any, is returned) and later plans relay
        through others first; the receiver is not blamed."""
        why = f"it did not relay {request.node_id}'s tensor to {request.relayed_to}: {request.detail[:200]}"
        with self.cond:
            relay, reporter = self.members.get(request.peer), self.members.get(request.node_id)
            if relay is None or not relay.alive or reporter is None:
                return None
            relay.failed_epoch, relay.failure = request.plan_epoch, why
            relay.relay_failures += 1
            probe = self._accuse(relay, reporter, request.plan_epoch)
            self.cond.notify_all()
        log.warning("relay %s failed: %s", request.peer, why)
        self.store.event("relay_failure", request.peer, why)
        return probe

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

    def _stalled(self, scope: Scope) -> list[tuple[str, float]]:
        """A step of `scope` stalled (under the condition): each node of it that a neighbour reported failing in
        that epoch, and that reported none itself (two nodes that blame each other are not told apart), is benched
        (_bench). Returns (node, seconds benched)."""
        reports = {(n, r) for n, by in self._accusations.items() for r, a in by.items() if a.epoch == scope.epoch}
        accusers = {r for _, r in reports}
        return self._bench({n for n, _ in reports if n in scope.nodes and n not in accusers})

    def _bench(self, node_ids: set[str]) -> list[tuple[str, float]]:
        """Refuse stages to the keys of the live `node_ids`, which took a stage and stalled, for
        scheduler.stall_refusal_s, doubling with each time after; a host of _HOST_STALLED_KEYS such keys registers
        no new ids for as long (under the condition). Returns (node, seconds benched)."""
        now = time.monotonic()
        benched = []
        for node_id in sorted(node_ids):
            member = self.members.get(node_id)
            if member is None or not member.alive:
                continue
            places: list[tuple[str, object]] = [_key(member)]
            if member.host:
                keys = self._stalled_keys.setdefault(member.host, set())
                keys.add(member.public_key)
                places += [("host", member.host)] if len(keys) >= _HOST_STALLED_KEYS else []
            for place in places:
                count, _ = self._stalls.get(place, (0, 0.0))
                self._stalls[place] = (count + 1, now + min(_STALL_MAX_S, self.cfg.stall_refusal_s * 2**count))
            benched.append((node_id, self._stalls[places[0]][1] - now))
        return benched

    def _announce(self, benched: list[tuple[str, float]], why: str) -> None:
        for node_id, seconds in benched:
            detail = f"{why}: its key is refused stages for {seconds:.0f}s"
            log.warning("node %s %s (a neighbour reports its calls failing, it answers the coordinator's probe)",
                        node_id, detail)
            self.store.event("benched", node_id, detail)
            self._on_event("benched", {"node_id": node_id, "seconds": seconds})

    def benched(self) -> dict[str, str]:
        """Live members refused stages because their key took stages and stalled: id -> why."""
        now = time.monotonic()
        with self.cond:
            out = {}
            for m in self.alive():
                until = self._stalls.get(_key(m), (0, 0.0))[1]
                if until > now:
                    out[m.node_id] = f"refused stages for {until - now:.0f}s more: its key stalled steps"
            return out

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
