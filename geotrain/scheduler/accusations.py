"""Failure reports and stalls (a part of Membership): a report about a peer counts only from its neighbour under the
current plan; two independent neighbours, or the coordinator's probe, make the peer a suspect; a report is judged
by the step it was about (the accused stalled it, or the reporter lied); a key whose stages stall is refused stages
for a growing time, and a host of several such keys registers no new ids for as long."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from geotrain.config import SchedulerSection
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.errors import ReportRefused
from geotrain.scheduler.members import EventSink, Member, Scope
from geotrain.scheduler.state import RunStore

log = logging.getLogger(__name__)

# A key that took a stage and stalled a step is refused stages for scheduler.stall_refusal_s, doubling each time
# after, up to a day. Once this many keys of one host stalled, the host registers no new ids for as long (doubling
# likewise): its keys that never stalled keep their stages (local nodes, or volunteers behind one NAT, share a host).
_STALL_MAX_S = 86400.0
_HOST_STALLED_KEYS = 3


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


def _key(member: Member) -> tuple[str, object]:
    """What a member's stalls follow: its key (in process, where members may have none, its id)."""
    return "key", member.public_key or member.node_id


class Accusations:
    """Who reported whom, who is suspect, and whose key is refused stages (a part of Membership)."""

    cfg: SchedulerSection
    store: RunStore
    cond: threading.Condition
    members: dict[str, Member]
    _on_event: EventSink
    offence: Callable[[str, str], bool]
    # node -> reporter -> its report that the node's calls fail, and the suspects those reports (two independent
    # neighbours) or the coordinator's probe confirmed: only these are declared dead before heartbeat_timeout_s.
    _accusations: dict[str, dict[str, _Accusation]]
    _suspects: set[str]
    # ("key", public key) or ("host", host) -> (stalls so far, refused until): see _bench.
    _stalls: dict[tuple[str, object], tuple[int, float]]
    _stalled_keys: dict[str, set[bytes]]  # host -> its keys that stalled

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
