"""Admission of registrations (a part of Membership): well-formed, not evicted, an id bound to its key, room in the
run, and new ids from one place paced and capped, so that a flood from one host or network leaves room for
volunteers from others."""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable

from geotrain.config import SchedulerSection
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.limits import TokenBuckets
from geotrain.scheduler.members import EventSink, Lifecycle, Member, Rejected
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.reachability import DialedBack
from geotrain.scheduler.state import RunStore

log = logging.getLogger(__name__)

# Ids, regions and addresses end up in plans, logs and the status page: short, printable, no spaces.
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
# A host's subnet of new ids (admission pace, spares cap): volunteers of one ISP customer or one cloud network.
_SUBNET_BITS = {4: 24, 6: 64}


def subnet(host: str) -> str:
    """The /24 (IPv4) or /64 (IPv6) of an IP host, or the host itself when it is no IP address ("": unknown)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    return str(ipaddress.ip_network(f"{ip}/{_SUBNET_BITS[ip.version]}", strict=False))


def _check_registration(request: pb.RegisterRequest) -> None:
    """Rejected(BAD_REQUEST) unless the id (if any), region (if any) and address are well-formed."""
    for what, value in (("node id", request.node_id), ("region", request.region)):
        if value and not _NAME.fullmatch(value):
            raise Rejected(pb.REJECT_REASON_BAD_REQUEST, f"{what} must be 1-64 of A-Z a-z 0-9 . _ : -")
    host, _, port = request.address.rpartition(":")
    if not (_HOST.fullmatch(host) and port.isdigit() and 0 < int(port) < 65536):
        raise Rejected(pb.REJECT_REASON_BAD_REQUEST, f"address must be HOST:PORT, got {request.address[:80]!r}")


class Admission:
    """Who may register, and as which id (a part of Membership; every method but screen and admit runs under the
    condition)."""

    cfg: SchedulerSection
    store: RunStore
    orders: OrderQueues
    cond: threading.Condition
    members: dict[str, Member]
    _on_event: EventSink
    _next_id: int
    _new_ids: dict[str, TokenBuckets]  # "host" / "subnet" -> their buckets of new ids
    _stalls: dict[tuple[str, object], tuple[int, float]]  # see Accusations
    _stalled_keys: dict[str, set[bytes]]
    _accusations: dict[str, dict]
    _suspects: set[str]

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
            existing = self._claim(request, host)
            member = self._new_member(request, existing, dialed, host, request.node_id in plan_nodes)
            self.members[member.node_id] = member
            self._accusations.pop(member.node_id, None)  # about its old incarnation
            self._suspects.discard(member.node_id)
            self.orders.open(member.node_id)
            self.cond.notify_all()
        kind = "rejoin" if existing is not None else "join"
        if dialed is not None:
            detail = (f"reachable at {dialed.reached}" if dialed.reached
                      else f"not reachable at {request.address} from outside")
            log.info("%s is %s", member.node_id, detail)
            self.store.event("reachability", member.node_id, detail)
        # The address that answered, in the store.
        self.store.upsert_member(member.node_id, member.address, member.region, "alive", key)
        self.store.event(kind, member.node_id, request.address)
        self._on_event(kind, {"node_id": member.node_id, "address": request.address, "region": member.region})
        return member

    def _claim(self, request: pb.RegisterRequest, host: str) -> Member | None:
        """The member whose id the registration claims (None: a new id), once the id is the key's and not held by a
        live node at the same address, and there is room; Rejected otherwise."""
        node_id = request.node_id
        existing = self.members.get(node_id) if node_id else None
        # Under the condition, so that of two first registrations of one id only the first key gets it.
        owner = existing.public_key if existing is not None else self.store.member_key(node_id) if node_id else None
        if owner is not None and owner != request.public_key:
            raise Rejected(
                pb.REJECT_REASON_IDENTITY,
                f"node id {node_id} belongs to another key (the node that first registered it); a node keeps "
                "its key in its --state-dir: join with that directory, or under another --node-id",
            )
        # The same id from a new address is that node restarted (its old process is gone); from the same
        # address while the old one still heartbeats, it is a second node claiming a live identity.
        if existing is not None and existing.alive and existing.address == request.address and not (
                self._silent(existing)):
            raise Rejected(pb.REJECT_REASON_DUPLICATE_NODE, f"node {node_id} is already live")
        self._check_room(host, existing)
        return existing

    def _new_member(
        self, request: pb.RegisterRequest, existing: Member | None, dialed: DialedBack | None, host: str, planned: bool
    ) -> Member:
        """The record of an admitted registration (`planned`: its id is one the current plan counts on)."""
        node_id = request.node_id
        if not node_id:
            # Ids of an earlier coordinator incarnation belong to their keys too.
            while (n := f"node-{self._next_id}") in self.members or self.store.member_key(n) is not None:
                self._next_id += 1
            node_id = f"node-{self._next_id}"
        now = time.monotonic()
        member = Member(node_id, request.address, request.region or "local", now, now, public_key=request.public_key,
                        host=host)
        member.planned = existing is not None and existing.planned
        if dialed is not None:
            # The address that answered is the one peers dial, which may be where the call came from.
            member.reachability, member.address = dialed.state, dialed.reached or request.address
        if request.layer_end:
            member.held = (request.layer_start, request.layer_end)
            member.applied_steps = request.applied_steps
        if existing is not None and planned and not request.layer_end:
            member.lifecycle = Lifecycle.RESTARTED
        if existing is not None and existing.region == member.region:
            # The node measures itself again, which takes a while; until its report arrives, what it measured
            # before lets the re-plan on its return count it in.
            member.profile = existing.profile
            if member.lifecycle is Lifecycle.JOINED and member.profile is not None:
                member.lifecycle = Lifecycle.PROFILED
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
            raise Rejected(pb.REJECT_REASON_FULL, f"host {host} registers no new node ids for "
                           f"{until - time.monotonic():.0f}s more: {len(self._stalled_keys[host])} of its keys took "
                           "stages and stalled steps")
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

    def _silent(self, member: Member) -> bool:
        """The member has missed more than two heartbeats (a restarted node may take its id back)."""
        return time.monotonic() - member.last_seen > 2 * self.cfg.heartbeat_interval_s
