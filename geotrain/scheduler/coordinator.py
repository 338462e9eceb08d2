"""The coordinator: admits nodes, plans stages, drives synchronous training steps, and recovers from failures.

A step (DESIGN.md "One training step"): microbatch ids go to the data heads (stage-0 replicas) in proportion to
their measured speed; each head reports every microbatch done once its backward has passed through every stage;
then the coordinator commits the step in two rounds: every replica averages its stage's gradients with its
groupmates (hivemind) and reports their squared norm, so clipping equals single-process clipping; the coordinator
records its decision (clip factor, learning rate) in SQLite, then every replica applies the same optimizer step and
reports a checksum of its parameters, which replicas of a stage must agree on.

Failures: a node missing heartbeats, or reported by peers whose calls to it fail, is dead. The coordinator bumps
the plan epoch, which drops every uncommitted gradient on every node, fills stages that lost every replica from
spare or returning nodes (state from a live replica, else from a checkpoint, rolling the whole run back when only
an older checkpoint exists), and runs the step again: each (stage, microbatch) is counted exactly once.

Placement: with scheduler.placement = measured, the planner makes the first plan from the nodes' profiles and
every later one (after a death, a return, or a node joining) from the current plan, moving as few layers as it
can; layers that move travel through a checkpoint of the committed step.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from geotrain import __version__
from geotrain.config import RunConfig, to_proto
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler import costmodel
from geotrain.scheduler.checkpoint import CheckpointStore, Manifest, StageState
from geotrain.scheduler.planner import PlannerConfig
from geotrain.scheduler.planner import plan as plan_stages
from geotrain.scheduler.profiles import check_report, measured_link, planner_inputs
from geotrain.scheduler.state import RunStore, StepRecord

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict[str, Any]], None]
# A re-plan keeps the current layers unless moving them is estimated this much faster: profiles measured at
# different times differ by several percent, and a smaller margin moves layers back and forth on that noise.
_REPLAN_TOLERANCE = 0.1
# Re-measured links that make the current plan's estimate this much slower than when it was made start a re-plan.
_DRIFT_REPLAN = 0.25
StateFetcher = Callable[[str, int], dict[str, Any]]


class RunAborted(RuntimeError):
    """The run cannot go on (stopped, no node for a stage, a step timed out)."""


class StepFailed(RuntimeError):
    """The step in progress cannot complete under the current plan (a node died, replicas disagree)."""


@dataclass
class Member:
    """A node that registered."""

    node_id: str
    address: str
    region: str
    joined_at: float
    last_seen: float
    orders: queue.Queue = field(default_factory=queue.Queue)
    plan_epoch: int = 0
    state_epoch: int = 0
    alive: bool = True
    held: tuple[int, int] = (0, 0)  # layer range the node holds (0, 0: none)
    applied_steps: int = 0
    peer_id: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    links: list[pb.LinkCounter] = field(default_factory=list)
    microbatches_per_s: float = 0.0
    restarted: bool = False  # a new incarnation of a node the plan counts on: its old one's work is lost
    profile: pb.NodeProfileReport | None = None  # the latest the node measured (scheduler.profiles reads it)


@dataclass
class RunSummary:
    """What a finished run reports (the --json line)."""

    steps: int
    loss_first: float
    loss_last: float
    val_loss: float | None
    tokens_per_s: float
    wall_s: float
    nodes: int
    stages: int

    def as_dict(self) -> dict[str, Any]:
        """The summary as a JSON-ready dict."""
        return asdict(self)


def split_layers(total_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of near-equal size, larger ones first."""
    if not 1 <= n_stages <= total_layers:
        raise ValueError(f"cannot split {total_layers} layers into {n_stages} stages")
    base, extra = divmod(total_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def assign_microbatches(speeds: dict[str, float], microbatches: int) -> dict[str, list[int]]:
    """Share microbatch ids 0..M-1 among data heads in proportion to speed (largest remainder; equal if unknown)."""
    heads = list(speeds)
    if any(v <= 0 for v in speeds.values()):
        speeds = {h: 1.0 for h in heads}
    total = sum(speeds.values())
    exact = {h: microbatches * speeds[h] / total for h in heads}
    counts = {h: int(exact[h]) for h in heads}
    for h in sorted(heads, key=lambda h: (counts[h] - exact[h], heads.index(h)))[: microbatches - sum(counts.values())]:
        counts[h] += 1
    shares, next_id = {}, 0
    for h in heads:
        shares[h] = list(range(next_id, next_id + counts[h]))
        next_id += counts[h]
    return shares


@dataclass
class _StepProgress:
    """What the coordinator has heard about the step in progress."""

    step: int
    done: dict[int, tuple[float, list[str]]] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)


class Coordinator:
    """Membership, planning, the step clock and recovery of one run."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        store: RunStore | None = None,
        checkpoints: CheckpointStore | None = None,
        fetch_state: StateFetcher | None = None,
        dht_peers: list[str] | None = None,
        run_id: str = "run",
        on_event: EventSink | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store or RunStore()
        self.checkpoints = checkpoints
        self._fetch_state = fetch_state  # (address, steps_done) -> a stage's state tensors, for checkpoints
        self.dht_peers = dht_peers or []
        self.run_id = run_id
        self._on_event = on_event or (lambda kind, data: None)
        self._cond = threading.Condition()
        self.members: dict[str, Member] = {}
        self.plan: pb.Plan | None = None
        plan_hex = self.store.get("plan")
        if plan_hex:
            self.plan = pb.Plan.FromString(bytes.fromhex(plan_hex))
        self.step = self.store.committed_steps()
        self.finished = False
        self.stop_requested = threading.Event()
        self._progress = _StepProgress(step=-1)
        self._next_id = 1
        self.state = "waiting"
        self.failures = 0
        self.recoveries: list[float] = []
        self._failed_at: float | None = None
        self._suspects: set[str] = set()
        self._plan_dirty = True
        self.estimate: costmodel.Plan | None = None  # the cost model's view of the current plan
        self._planned_step_s: float | None = None  # its estimated step time when the plan was made
        self._excluded: set[str] = set()  # nodes the planner left out: they stay spares
        self._estimated_from: dict[str, pb.NodeProfileReport | None] = {}  # the profiles behind self.estimate

    # -- membership (called from RPC threads) -------------------------------------------------------------------

    def register(self, request: pb.RegisterRequest) -> pb.RegisterReply:
        """Admit a node (new, or returning with the stage it holds), or say why not."""
        if request.protocol_version != PROTOCOL_VERSION:
            return pb.RegisterReply(
                accepted=False,
                reason=pb.REJECT_REASON_PROTOCOL_VERSION,
                message=f"coordinator speaks protocol {PROTOCOL_VERSION} (geotrain {__version__}), "
                f"node speaks {request.protocol_version}",
            )
        with self._cond:
            if self.finished:
                return pb.RegisterReply(accepted=False, reason=pb.REJECT_REASON_RUN_FINISHED, message="the run is over")
            node_id = request.node_id
            existing = self.members.get(node_id) if node_id else None
            # The same id from a new address is that node restarted (its old process is gone); from the same
            # address while the old one still heartbeats, it is a second node claiming a live identity.
            if existing is not None and existing.alive and existing.address == request.address and not self._silent(existing):
                return pb.RegisterReply(
                    accepted=False, reason=pb.REJECT_REASON_DUPLICATE_NODE, message=f"node {node_id} is already live"
                )
            if not node_id:
                while f"node-{self._next_id}" in self.members:
                    self._next_id += 1
                node_id = f"node-{self._next_id}"
            now = time.monotonic()
            member = Member(node_id, request.address, request.region or "local", now, now)
            if request.layer_end:
                member.held = (request.layer_start, request.layer_end)
                member.applied_steps = request.applied_steps
            member.restarted = existing is not None and node_id in self._plan_nodes() and not request.layer_end
            if existing is not None and existing.region == member.region:
                # The node measures itself again, which takes a while; until its report arrives, what it measured
                # before lets the re-plan on its return count it in.
                member.profile = existing.profile
            self.members[node_id] = member
            self._cond.notify_all()
        kind = "rejoin" if existing is not None else "join"
        self.store.upsert_member(node_id, request.address, member.region, "alive")
        self.store.event(kind, node_id, request.address)
        self._on_event(kind, {"node_id": node_id, "address": request.address, "region": member.region})
        return pb.RegisterReply(
            accepted=True,
            node_id=node_id,
            config=to_proto(self.cfg),
            heartbeat_interval_s=self.cfg.scheduler.heartbeat_interval_s,
            dht_initial_peers=self.dht_peers,
            run_id=self.run_id,
        )

    def _silent(self, member: Member) -> bool:
        """The member has missed more than two heartbeats (a restarted node may take its id back)."""
        return time.monotonic() - member.last_seen > 2 * self.cfg.scheduler.heartbeat_interval_s

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Note that a node is alive, which plan and state it runs, and what it measured."""
        with self._cond:
            member = self.members.get(request.node_id)
            if member is None or not member.alive:
                return pb.HeartbeatReply(known=False)
            member.last_seen = time.monotonic()
            member.plan_epoch = request.plan_epoch
            # A heartbeat built before a StepApplied report may arrive after it; only a state load (a new
            # state_epoch) moves a node's applied steps back.
            if request.applied_step >= member.applied_steps or request.state_epoch != member.state_epoch:
                member.applied_steps = request.applied_step
            member.state_epoch = request.state_epoch
            member.peer_id = request.dht_peer_id
            member.bytes_sent, member.bytes_received = request.bytes_sent, request.bytes_received
            member.links = list(request.links)
            member.microbatches_per_s = request.microbatches_per_s
            self._cond.notify_all()
        return pb.HeartbeatReply(known=True)

    def report_profile(self, request: pb.NodeProfileReport) -> None:
        """Keep a node's latest profile; KeyError for an unknown node, ValueError for a malformed report."""
        check_report(request, self.cfg.model.total_layers)
        with self._cond:
            member = self.members.get(request.node_id)
            if member is None:
                raise KeyError(request.node_id)
            member.profile = request
        log.debug("profile of %s: %d link(s)", request.node_id, len(request.links))

    def report_failure(self, request: pb.FailureReport) -> None:
        """A node's calls to a peer fail: the peer is dead if it is also late with its heartbeat."""
        with self._cond:
            peer = self.members.get(request.peer)
            if peer is None or not peer.alive:
                return
            log.debug("%s reports %s failing: %s", request.node_id, request.peer, request.detail)
            self._suspects.add(request.peer)
            self._cond.notify_all()

    def order_stream(self, node_id: str, is_active: Callable[[], bool]) -> Iterator[pb.Order]:
        """The orders for one node, as long as its stream is open."""
        with self._cond:
            member = self.members.get(node_id)
        if member is None:
            raise KeyError(node_id)
        while is_active() and member.alive:
            try:
                order = member.orders.get(timeout=0.25)
            except queue.Empty:
                continue
            yield order
            if order.WhichOneof("kind") == "shutdown":
                return

    def _send(self, node_ids: list[str], order: pb.Order) -> None:
        for node_id in node_ids:
            self.members[node_id].orders.put(order)

    # -- reports (called from RPC threads) ----------------------------------------------------------------------

    def microbatch_done(self, request: pb.MicrobatchDoneRequest) -> None:
        """A data head finished a microbatch's backward."""
        with self._cond:
            if request.step == self._progress.step and self._current(request.plan_epoch):
                self._progress.done.setdefault(request.microbatch, (request.loss, list(request.path)))
                self._cond.notify_all()

    def _current(self, epoch: int) -> bool:
        """A report belongs to the current plan epoch (reports from an abandoned epoch are ignored)."""
        return self.plan is not None and epoch == self.plan.epoch

    def eval_done(self, request: pb.EvalDoneRequest) -> None:
        """A last stage computed a validation loss."""
        with self._cond:
            if request.step == self._progress.step and self._current(request.plan_epoch):
                self._progress.eval_losses[request.microbatch] = request.loss
                self._cond.notify_all()

    def grad_norm(self, request: pb.GradNormRequest) -> None:
        """A stage replica's squared gradient norm for the step being committed."""
        with self._cond:
            if request.step == self._progress.step and self._current(request.plan_epoch):
                self._progress.norms[request.node_id] = request.sq_norm
                self._cond.notify_all()

    def step_applied(self, request: pb.StepAppliedRequest) -> None:
        """A stage replica applied the step."""
        with self._cond:
            if request.step == self._progress.step:
                self._progress.checksums[request.node_id] = request.checksum
                member = self.members.get(request.node_id)
                if member is not None:
                    member.applied_steps = request.step + 1  # fresher than the next heartbeat
                self._cond.notify_all()

    # -- waiting and liveness -----------------------------------------------------------------------------------

    def _alive(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive]

    def _plan_nodes(self) -> list[str]:
        return [n for s in self.plan.stages for n in s.node_ids] if self.plan else []

    def _wait(self, predicate: Callable[[], bool], what: str, timeout_s: float, during_step: bool = False) -> None:
        """Block until predicate() holds (under the lock); raises RunAborted on stop or timeout, and StepFailed
        when a node of the plan dies while `during_step`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate():
                if self.stop_requested.is_set():
                    raise RunAborted("stopped")
                lost = self._lost() & set(self._plan_nodes())
                if during_step and lost:
                    raise StepFailed(f"node(s) {', '.join(sorted(lost))} lost")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if during_step:
                        raise StepFailed(f"timed out after {timeout_s:.0f}s waiting for {what}")
                    raise RunAborted(f"timed out after {timeout_s:.0f}s waiting for {what}")
                self._cond.wait(min(remaining, 0.1))

    def _lost(self) -> set[str]:
        """Nodes whose state of the step in progress is gone: dead, or restarted as a new incarnation."""
        return self._check_liveness() | self._restarted()

    def _restarted(self) -> set[str]:
        return {m.node_id for m in self.members.values() if m.restarted}

    def _check_liveness(self) -> set[str]:
        """Mark silent nodes dead (and suspects that are late too); returns every dead member's id."""
        now = time.monotonic()
        sched = self.cfg.scheduler
        for member in self.members.values():
            late = now - member.last_seen
            suspect_late = member.node_id in self._suspects and late > 1.5 * sched.heartbeat_interval_s
            if member.alive and (late > sched.heartbeat_timeout_s or suspect_late):
                member.alive = False
                self._suspects.discard(member.node_id)
                why = "peers report it failing" if suspect_late else f"no heartbeat for {late:.1f}s"
                log.warning("node %s is dead: %s", member.node_id, why)
                self.store.upsert_member(member.node_id, member.address, member.region, "dead")
                self.store.event("dead", member.node_id, why)
                self._on_event("dead", {"node_id": member.node_id})
        return {m.node_id for m in self.members.values() if not m.alive}

    # -- planning -----------------------------------------------------------------------------------------------

    def _stage_ranges(self) -> list[tuple[int, int]]:
        """The current plan's layer ranges (state stays where it is); a first plan splits the layers evenly."""
        if self.plan is not None:
            return [(s.layer_start, s.layer_end) for s in self.plan.stages]
        total = self.cfg.model.total_layers
        return split_layers(total, min(total, self.cfg.scheduler.stages or len(self._alive())))

    def _assign(self, ranges: list[tuple[int, int]]) -> list[list[Member]]:
        """Nodes per stage: nodes keep their stage, returning nodes take the stage they hold, empty stages take
        spares, then the rest become replicas up to scheduler.replicas per stage."""
        alive = sorted(self._alive(), key=lambda m: m.joined_at)
        previous = {n: s.index for s in self.plan.stages for n in s.node_ids} if self.plan else {}
        groups: list[list[Member]] = [[] for _ in ranges]
        unplaced = []
        for m in alive:
            if m.node_id in previous and previous[m.node_id] < len(ranges):
                groups[previous[m.node_id]].append(m)
            elif m.held in ranges:
                groups[ranges.index(m.held)].append(m)
            else:
                unplaced.append(m)
        for group in groups:
            if not group and unplaced:
                group.append(unplaced.pop(0))
        cap = self.cfg.scheduler.replicas or len(alive)
        for m in unplaced:
            if m.node_id in self._excluded:
                continue
            smallest = min(groups, key=len)
            if len(smallest) < cap:
                smallest.append(m)
        return groups

    def _replans_measured(self) -> bool:
        """Whether every plan comes from the planner over measured profiles. A plan after the first may move
        layers, and a moved layer's state travels through a checkpoint, so without a checkpoint store only the
        first plan is the planner's and later ones keep its layer ranges."""
        return self.cfg.scheduler.placement == "measured" and self.checkpoints is not None

    def _can_grow(self) -> bool:
        """Some live node serves no stage (and, for the planner, has reported its profile) and could serve one:
        the planner decides where it helps, else a stage has room for another replica."""
        if self.plan is None:
            return False
        placed = set(self._plan_nodes()) | self._excluded
        measured = self._replans_measured()
        spare = any(m.node_id not in placed and (m.profile is not None or not measured) for m in self._alive())
        cap = self.cfg.scheduler.replicas or len(self.members)
        return spare and (measured or any(len(s.node_ids) < cap for s in self.plan.stages))

    def _plan_is_current(self) -> bool:
        alive = {m.node_id for m in self._alive()}
        return (
            not self._plan_dirty
            and set(self._plan_nodes()) <= alive
            and not self._restarted() & set(self._plan_nodes())
            and not self._can_grow()
        )

    def _layout(self) -> tuple[list[tuple[int, int]], list[list[Member]]]:
        """Layer ranges and their nodes. With measured placement the planner makes every plan from the nodes'
        profiles, a later one from the current plan so that it moves as few layers as it can; otherwise, and
        for later plans without checkpoints, a first plan splits layers evenly and later ones keep their ranges
        (state stays where it is, nodes keep their layers) and only reassign nodes."""
        if self.cfg.scheduler.placement == "measured" and (self.plan is None or self._replans_measured()):
            if self.plan is None:
                self._wait(
                    lambda: all(m.profile is not None for m in self._alive()),
                    "node profiles",
                    self.cfg.scheduler.step_timeout_s,
                )
                self._probe_regions()
            return self._planned_layout()
        ranges = self._stage_ranges()
        return ranges, self._assign(ranges)

    def _planned_layout(self) -> tuple[list[tuple[int, int]], list[list[Member]]]:
        """The planner's layout over the live nodes that reported a profile (a node still measuring waits for
        the next plan), starting from the current plan's estimate when there is one."""
        previous = None
        if self.plan is not None and self.estimate is not None:
            previous = replace(self.estimate, excluded={n: "left out before" for n in self._excluded})
        while True:
            candidates = [m for m in self._alive() if m.profile is not None]
            try:
                nodes, model, network = planner_inputs(candidates, self.cfg)
                planned = plan_stages(
                    nodes=nodes,
                    model=model,
                    network=network,
                    **self._step_shape(model),
                    config=PlannerConfig(stages=self.cfg.scheduler.stages or None, replan_tolerance=_REPLAN_TOLERANCE),
                    previous=previous,
                )
                break
            except ValueError as e:  # too few nodes, or too little memory among them
                timeout = self.cfg.scheduler.rejoin_timeout_s
                log.warning("no plan from %d node(s): %s; waiting up to %.0fs for others", len(candidates), e, timeout)
                ids = {m.node_id for m in candidates}
                profiled = lambda: {m.node_id for m in self._alive() if m.profile is not None}  # noqa: E731
                self._wait(lambda: profiled() != ids, "a node to plan with", timeout)
        for node_id, why in planned.excluded.items():
            if node_id not in self._excluded:
                log.info("%s serves no stage: %s", node_id, why)
                self.store.event("excluded", node_id, why)
        self._excluded = set(planned.excluded)
        return [(s.start, s.end) for s in planned.stages], [[self.members[n] for n in s.node_ids] for s in planned.stages]

    def _probe_regions(self) -> None:
        """Have one node of each region measure its link to one node of every other region, so the planner sees
        measured links between regions rather than defaults; waits for the reports (a missing one keeps defaults)."""
        alive = sorted(self._alive(), key=lambda m: m.node_id)
        first = {}
        for m in alive:
            first.setdefault(m.region, m)
        asked: dict[str, list[Member]] = {}
        regions = sorted(first)
        for i, a in enumerate(regions):
            for b in regions[i + 1 :]:
                asked.setdefault(first[a].node_id, []).append(first[b])
        for node_id, peers in asked.items():
            order = pb.ProbePeers(
                node_ids=[p.node_id for p in peers],
                addresses=[p.address for p in peers],
                regions=[p.region for p in peers],
            )
            self._send([node_id], pb.Order(probe_peers=order))

        def measured() -> bool:
            for node_id, peers in asked.items():
                member = self.members[node_id]
                links = {link.peer for link in member.profile.links} if member.profile else set()
                if member.alive and not {p.node_id for p in peers} <= links:
                    return False
            return True

        try:
            self._wait(measured, "links between regions", self.cfg.scheduler.step_timeout_s / 4)
        except RunAborted as e:
            if self.stop_requested.is_set():
                raise
            log.warning("planning with default links between regions: %s", e)

    def _estimate(self, ranges: list[tuple[int, int]], groups: list[list[Member]]) -> costmodel.Plan | None:
        """The cost model's estimate of a layout, once every node in it has reported a profile."""
        members = [m for g in groups for m in g]
        if any(m.profile is None for m in members):
            return None
        nodes, model, network = planner_inputs(members, self.cfg)
        index = {n.node_id: i for i, n in enumerate(nodes)}
        cm = costmodel.CostModel(nodes=nodes, model=model, network=network, **self._step_shape(model))
        stages = [(start, end, [index[m.node_id] for m in g]) for (start, end), g in zip(ranges, groups)]
        return cm.plan(stages, {}) if cm.feasible(stages) else None

    def _step_shape(self, model: costmodel.ModelProfile) -> dict[str, Any]:
        """A step as the planner and the cost model see it: microbatches, their size, the data heads' window, and
        how replicas may average (scheduler.allreduce, and PowerSGD's rank where the nodes reported the parameter
        shapes that size its factors)."""
        train = self.cfg.train
        low_rank = model.layer_param_shapes is not None
        return {
            "microbatches": train.microbatches,
            "microbatch_size": train.microbatch_size,
            "inflight": train.inflight,
            "allreduce": self.cfg.scheduler.allreduce,
            "replica_rank": self.cfg.compression.replica_rank if low_rank else None,
        }

    def _drifted(self) -> bool:
        """Whether re-measured profiles put the current plan's estimate so far above what it was when the plan was
        made that the planner should look again (it moves layers only where that pays: _REPLAN_TOLERANCE)."""
        if not self._replans_measured() or self.estimate is None:
            return False
        if self._planned_step_s is None:  # the plan's profiles came in after it was made
            self._planned_step_s = self.estimate.step_seconds
            return False
        slower = self.estimate.step_seconds / self._planned_step_s - 1
        if slower <= _DRIFT_REPLAN:
            return False
        why = f"re-measured profiles put the plan {100 * slower:.0f}% slower than estimated when it was made"
        log.info("re-planning: %s", why)
        self.store.event("drift", detail=why)
        return True

    def _averaging_changed(self) -> bool:
        """Whether a stage's replicas now ought to average the other way than the plan has them (the profiles that
        price it came in after the plan was made): the next plan epoch switches them."""
        assert self.plan is not None
        return any(
            stage.hierarchical_allreduce != self._hierarchical_allreduce(i, [self.members[n] for n in stage.node_ids])
            for i, stage in enumerate(self.plan.stages)
        )

    def _profiles_changed(self) -> bool:
        """A node of the plan reported a newer profile (e.g. a link it measured) than the estimate used."""
        return any(self.members[n].profile is not self._estimated_from.get(n) for n in self._plan_nodes())

    def _update_estimate(self, ranges: list[tuple[int, int]], groups: list[list[Member]]) -> None:
        self._estimated_from = {m.node_id: m.profile for g in groups for m in g}
        self.estimate = self._estimate(ranges, groups)
        if self.estimate is not None:
            self.store.put("estimated_step_s", repr(self.estimate.step_seconds))

    def _replan(self) -> None:
        """Bump the plan epoch: assign nodes, give every node that lacks its stage's state a source, and wait
        until every node runs the new plan with the committed state."""
        ranges, groups = self._layout()
        if any(not g for g in groups):
            log.warning("a stage has no node; waiting up to %.0fs for one", self.cfg.scheduler.rejoin_timeout_s)
            self._wait(lambda: all(self._assign(ranges)), "a node for every stage", self.cfg.scheduler.rejoin_timeout_s)
            groups = self._assign(ranges)
        self._update_estimate(ranges, groups)
        self._planned_step_s = self.estimate.step_seconds if self.estimate is not None else None
        loads = self._state_sources(ranges, groups)
        epoch = max(self.plan.epoch if self.plan else 0, int(self.store.get("plan_epoch", "0"))) + 1
        multi = [m.node_id for g in groups if len(g) > 1 for m in g]
        self._wait(
            lambda: all(self.members[n].peer_id or not self.members[n].alive for n in multi),
            "replicas' averaging peers",
            self.cfg.scheduler.step_timeout_s,
        )
        if any(not self.members[n].alive for n in multi):
            raise StepFailed("a node died while the plan was being made")
        plan = pb.Plan(epoch=epoch, total_layers=self.cfg.model.total_layers, steps_done=self.step)
        for i, ((start, end), group) in enumerate(zip(ranges, groups)):
            plan.stages.add(
                index=i,
                layer_start=start,
                layer_end=end,
                node_ids=[m.node_id for m in group],
                addresses=[m.address for m in group],
                regions=[m.region for m in group],
                peer_ids=[m.peer_id for m in group] if len(group) > 1 else [],
                hierarchical_allreduce=self._hierarchical_allreduce(i, group),
            )
        with self._cond:
            self.plan = plan
            for group in groups:
                for m in group:
                    m.restarted = False  # the new plan counts on this incarnation
        self.store.put("plan", plan.SerializeToString().hex())
        self.store.put("plan_epoch", str(epoch))
        self._send([m.node_id for m in self._alive()], pb.Order(plan=plan))
        for node_id, (address, checksum) in loads.items():
            load = pb.LoadState(plan_epoch=epoch, steps_done=self.step, source_address=address, expected_checksum=checksum)
            self._send([node_id], pb.Order(load_state=load))
        self._wait(
            lambda: all(
                self.members[n].plan_epoch == epoch
                and self.members[n].applied_steps == self.step
                and (n not in loads or self.members[n].state_epoch == epoch)
                for n in self._plan_nodes()
            ),
            "nodes to take up the plan",
            self.cfg.scheduler.step_timeout_s,
            during_step=True,
        )
        for stage in plan.stages:
            for n in stage.node_ids:
                self.members[n].held = (stage.layer_start, stage.layer_end)
        self._plan_dirty = False
        detail = "; ".join(
            f"stage {s.index} layers {s.layer_start}-{s.layer_end - 1}: {', '.join(s.node_ids)}"
            + (" (averaging region by region)" if s.hierarchical_allreduce else "")
            for s in plan.stages
        )
        self.store.event("plan", detail=f"epoch {epoch}: {detail}")
        self._on_event("plan", {"plan": plan})

    def _hierarchical_allreduce(self, index: int, group: list[Member]) -> bool:
        """Whether stage `index`'s replicas average region by region (scheduler.allreduce): under auto where the
        cost model's estimate of the plan (any placement) prices it faster, which it needs the nodes' profiles for;
        under hierarchical wherever it differs from a flat all-reduce."""
        mode = self.cfg.scheduler.allreduce
        if mode == "hierarchical":
            per_region = Counter(m.region for m in group)
            return len(per_region) > 1 and max(per_region.values()) > 1
        if mode == "auto" and self.estimate is not None:
            return self.estimate.stages[index].hierarchical_allreduce
        return False

    def _state_sources(
        self, ranges: list[tuple[int, int]], groups: list[list[Member]]
    ) -> dict[str, tuple[str, str]]:
        """For each node that lacks its stage's committed state: (source address or '' for the checkpoint,
        expected checksum). A stage whose range no live node holds whole (the plan moved layers) loads from a
        checkpoint of the committed step, written now from the current plan's live holders if there is none.
        When a stage of the current plan lost every copy, the run rolls back to the newest checkpoint."""
        if self.step == 0:
            return {}  # step 0 is each layer's initialisation from the seed: every node builds it itself
        sources: dict[str, tuple[str, str]] = {}
        recorded = self.store.checksums(self.step - 1)
        current = self._stage_ranges()
        reshaped = []
        for i, (rng, group) in enumerate(zip(ranges, groups)):
            holders = self._holders(rng)
            if not holders:
                reshaped.append(i)
                continue
            checksum = recorded.get(current.index(rng), "") if rng in current else ""
            for m in group:
                if m not in holders:
                    sources[m.node_id] = (holders[0].address, checksum)
        if not reshaped:
            return sources
        manifest = self._snapshot()
        if manifest is None:
            manifest = self.checkpoints.latest(at_most=self.step) if self.checkpoints else None
            steps_done = manifest.steps_done if manifest else 0
            log.warning("a stage lost every copy of step %d: rolling back to step %d", self.step, steps_done)
            self.store.event("rollback", detail=f"from step {self.step} to step {steps_done}")
            self.store.rollback_to(steps_done)
            self.step = steps_done
            reshaped = list(range(len(ranges)))
            sources = {}
        for i in reshaped:
            checksum = self.checkpoints.checksum(manifest, *ranges[i]) if manifest else ""
            for m in groups[i]:
                sources[m.node_id] = ("", checksum)
        return sources

    def _holders(self, rng: tuple[int, int]) -> list[Member]:
        """Live nodes holding exactly this layer range at the committed step."""
        return [m for m in self._alive() if m.held == rng and m.applied_steps == self.step]

    def _snapshot(self) -> Manifest | None:
        """A checkpoint of the committed step: the newest one if it is of this step, else one written now from
        live holders of the current plan's stages; None when there is no checkpoint store or a stage of the
        current plan has no live copy of this step."""
        if self.checkpoints is None:
            return None
        latest = self.checkpoints.latest(at_most=self.step)
        if latest is not None and latest.steps_done == self.step:
            return latest
        if not all(self._holders(rng) for rng in self._stage_ranges()):
            return None
        return self._checkpoint()

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Wait for min_nodes, plan, then train every step, recovering from failures; returns the summary."""
        try:
            return self._train()
        except RunAborted as e:
            self.state = "aborted"
            self.store.event("aborted", detail=str(e))
            raise

    def _train(self) -> RunSummary:
        started = time.monotonic()
        need = self.cfg.scheduler.min_nodes
        log.info("waiting for %d node(s)", need)
        self._wait(lambda: len(self._alive()) >= need, f"{need} nodes to join", float("inf"))
        self.state = "training"
        self._finish_decided_step()
        first_step = self.step
        while self.step < self.cfg.run.steps:
            try:
                if not self._plan_is_current():
                    self._replan()
                record = self._run_step(self.step)
            except StepFailed as e:
                self._note_failure(str(e))
                continue
            if self._failed_at is not None:
                self.recoveries.append(time.monotonic() - self._failed_at)
                self._failed_at = None
            self.step += 1
            record = self._after_commit(record)
            self._on_event("step", {"record": record, "of": self.cfg.run.steps})
        if self.checkpoints is not None and (not self.checkpoints.latest() or self.checkpoints.latest().steps_done != self.step):
            self._checkpoint()
        self.state = "done"
        history = self.store.steps()
        train_s = sum(r.seconds for r in history if r.step >= first_step)
        vals = [r.val_loss for r in history if r.val_loss is not None]
        return RunSummary(
            steps=len(history),
            loss_first=history[0].loss,
            loss_last=history[-1].loss,
            val_loss=vals[-1] if vals else None,
            tokens_per_s=self.cfg.tokens_per_step * (self.step - first_step) / train_s if train_s else 0.0,
            wall_s=time.monotonic() - started,
            nodes=len(self._alive()),
            stages=len(self.plan.stages) if self.plan else 0,
        )

    def _note_failure(self, why: str) -> None:
        self._plan_dirty = True  # a new epoch drops whatever the failed step left half-done
        self.failures += 1
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        log.warning("step %d failed (%s); re-planning", self.step, why)
        self.store.event("failure", detail=f"step {self.step}: {why}")
        self._on_event("failure", {"step": self.step, "why": why})

    def _after_commit(self, record: StepRecord) -> StepRecord:
        """Validation and checkpoints due after a committed step; the plan's estimate once its profiles are in."""
        if self.plan is not None and self._profiles_changed():
            self._update_estimate(
                self._stage_ranges(), [[self.members[n] for n in s.node_ids] for s in self.plan.stages]
            )
            self._plan_dirty |= self._drifted() or self._averaging_changed()
        step = record.step
        last = self.step == self.cfg.run.steps
        every = self.cfg.run.eval_every
        if last or (every and self.step % every == 0):
            try:
                val_loss = self._evaluate(step)
            except StepFailed as e:
                log.warning("validation after step %d skipped: %s", step, e)
            else:
                self.store.set_val_loss(step, val_loss)
                record = StepRecord(**{**asdict(record), "val_loss": val_loss})
        every = self.cfg.scheduler.checkpoint_every
        if self.checkpoints is not None and every and self.step % every == 0:
            self._checkpoint()
        return record

    def _run_step(self, step: int) -> StepRecord:
        assert self.plan is not None
        t0 = time.monotonic()
        total = self.cfg.train.microbatches
        timeout = self.cfg.scheduler.step_timeout_s
        epoch = self.plan.epoch
        with self._cond:
            self._progress = _StepProgress(step=step)
        heads = {h: self.members[h].microbatches_per_s for h in self.plan.stages[0].node_ids}
        for head, ids in assign_microbatches(heads, total).items():
            if ids:
                start = pb.StartStep(step=step, microbatches=ids, total_microbatches=total)
                self._send([head], pb.Order(start_step=start))
        self._wait(lambda: len(self._progress.done) == total, f"step {step}'s microbatches", timeout, during_step=True)

        nodes = self._plan_nodes()
        self._send(nodes, pb.Order(commit=pb.CommitStep(step=step, plan_epoch=epoch)))
        self._wait(
            lambda: all(n in self._progress.norms for n in nodes), f"step {step}'s gradient norms", timeout, True
        )
        for stage in self.plan.stages:
            if len({self._progress.norms[n] for n in stage.node_ids}) != 1:
                raise StepFailed(f"replicas of stage {stage.index} disagree on their averaged gradients")
        total_sq = sum(self._progress.norms[s.node_ids[0]] for s in self.plan.stages)
        clip = self.cfg.train.clip_coefficient(total_sq)
        lr = self.cfg.train.lr_at(step, self.cfg.run.steps)
        losses = [loss for loss, _ in self._progress.done.values()]
        seconds = time.monotonic() - t0
        record = StepRecord(
            step=step,
            loss=sum(losses) / len(losses),
            val_loss=None,
            tokens_per_s=self.cfg.tokens_per_step / seconds,
            seconds=seconds,
            plan_epoch=epoch,
        )
        # Decided before any node applies it: a restarted coordinator completes this step instead of redoing it.
        self.store.put("decided", json.dumps({"record": asdict(record), "clip": clip, "lr": lr}))
        self._send(nodes, pb.Order(apply=pb.ApplyStep(step=step, clip_coef=clip, lr=lr)))
        # The step is decided: a node lost now (dead, or restarted and so without its state) does not undo it; it
        # takes up the committed state with the next plan.
        self._wait(
            lambda: all(n in self._progress.checksums or n in self._lost() for n in nodes),
            f"step {step}'s checksums",
            timeout,
        )
        self.store.commit_step(record, self._stage_checksums())
        return record

    def _finish_decided_step(self) -> None:
        """After a coordinator restart: complete a step whose decision was recorded but not its commit."""
        decided = self.store.get("decided")
        if decided is None or self.plan is None:
            return
        data = json.loads(decided)
        record = StepRecord(**data["record"])
        step = record.step
        ranges = self._stage_ranges()
        log.info("completing step %d, decided before the restart", step)

        def holders_at(steps: int) -> dict[int, list[Member]]:
            return {i: [m for m in self._alive() if m.held == r and m.applied_steps == steps] for i, r in enumerate(ranges)}

        self._wait(
            lambda: all(holders_at(step)[i] or holders_at(step + 1)[i] for i in range(len(ranges))),
            "the nodes of the decided step to return",
            self.cfg.scheduler.rejoin_timeout_s,
        )
        with self._cond:
            self._progress = _StepProgress(step=step)
        behind = [m.node_id for ms in holders_at(step).values() for m in ms]
        self._send(behind, pb.Order(apply=pb.ApplyStep(step=step, clip_coef=data["clip"], lr=data["lr"])))
        self._wait(lambda: all(n in self._progress.checksums for n in behind), "the decided step's apply",
                   self.cfg.scheduler.step_timeout_s)
        for n in behind:
            self.members[n].applied_steps = step + 1
        self.store.commit_step(record, {})
        self.step = step + 1

    def _stage_checksums(self) -> dict[int, str]:
        """Each stage's parameter checksum; replicas of a stage must agree."""
        assert self.plan is not None
        result: dict[int, str] = {}
        for stage in self.plan.stages:
            sums = {self._progress.checksums[n] for n in stage.node_ids if n in self._progress.checksums}
            if len(sums) > 1:
                raise RunAborted(f"replicas of stage {stage.index} disagree on their parameters")
            if sums:
                result[stage.index] = sums.pop()
        return result

    def _evaluate(self, step: int) -> float:
        assert self.plan is not None
        n = self.cfg.run.eval_microbatches
        with self._cond:
            self._progress.eval_losses = {}
        heads = {h: self.members[h].microbatches_per_s for h in self.plan.stages[0].node_ids}
        for head, ids in assign_microbatches(heads, n).items():
            if ids:
                self._send([head], pb.Order(evaluate=pb.Evaluate(step=step, microbatches=ids)))
        self._wait(lambda: len(self._progress.eval_losses) == n, "validation", self.cfg.scheduler.step_timeout_s, True)
        return sum(self._progress.eval_losses.values()) / n

    def checkpoint_state(self, layer_start: int, layer_end: int, steps_done: int) -> dict[str, Any] | None:
        """Parameters and optimizer state of a layer range from the checkpoint at steps_done, if there is one."""
        manifest = self.checkpoints.latest(at_most=steps_done) if self.checkpoints else None
        if manifest is None or manifest.steps_done != steps_done:
            return None
        return self.checkpoints.load_layers(manifest, layer_start, layer_end)

    def _checkpoint(self) -> Manifest | None:
        """Write a checkpoint of the committed state, fetched from a live holder of each stage; None (and no
        checkpoint) when a stage has none or a download fails."""
        assert self.checkpoints is not None and self._fetch_state is not None and self.plan is not None
        checksums = self.store.checksums(self.step - 1)
        stages = []
        try:
            for s in self.plan.stages:
                holders = self._holders((s.layer_start, s.layer_end))
                if not holders:
                    raise LookupError(f"no live node holds stage {s.index}")
                state = self._fetch_state(holders[0].address, self.step)
                stages.append(StageState(s.layer_start, s.layer_end, checksums.get(s.index, ""), state))
        except Exception as e:  # a node lost mid-download: the next checkpoint will do
            log.warning("checkpoint of step %d skipped: %s", self.step, e)
            return None
        manifest = self.checkpoints.write(self.step, self.plan.epoch, stages)
        self.store.put("checkpoint", str(manifest.path))
        self.store.event("checkpoint", detail=f"step {self.step}")
        self._on_event("checkpoint", {"steps_done": self.step, "path": str(manifest.path)})
        return manifest

    # -- status ---------------------------------------------------------------------------------------------------

    def status(self) -> pb.StatusReply:
        """A snapshot of the run for `geotrain status`, the status page and /metrics."""
        history = self.store.steps()
        reply = pb.StatusReply(
            state=self.state, step=len(history), steps=self.cfg.run.steps, failures=self.failures,
            recovery_s=self.recoveries,
        )
        if history:
            last = history[-1]
            recent = history[-10:]
            mean_s = sum(r.seconds for r in recent) / len(recent)
            reply.loss, reply.tokens_per_s = last.loss, last.tokens_per_s
            reply.eta_s = mean_s * max(0, self.cfg.run.steps - len(history))
            vals = [r.val_loss for r in history if r.val_loss is not None]
            if vals:
                reply.val_loss = vals[-1]
        for r in history:
            point = reply.history.add(
                step=r.step, loss=r.loss, tokens_per_s=r.tokens_per_s, seconds=r.seconds, at=r.committed_at
            )
            if r.val_loss is not None:
                point.has_val_loss, point.val_loss = True, r.val_loss
        now = time.monotonic()
        plan = self.plan
        stage_of = {n: st for st in plan.stages for n in st.node_ids} if plan else {}
        with self._cond:
            members = list(self.members.values())
        for m in members:
            st = stage_of.get(m.node_id)
            sent_raw = sum(link.raw_bytes for link in m.links)
            sent_wire = sum(link.wire_bytes for link in m.links)
            probes = {p.peer: p for p in m.profile.links} if m.profile else {}
            reply.nodes.add(
                node_id=m.node_id,
                region=m.region,
                address=m.address,
                stage=st.index if st else -1,
                layer_start=st.layer_start if st else 0,
                layer_end=st.layer_end if st else 0,
                role=("stage" if st.node_ids[0] == m.node_id else "replica") if st else "spare",
                microbatches_per_s=m.microbatches_per_s,
                last_heartbeat_s=now - m.last_seen,
                bytes_sent=m.bytes_sent,
                bytes_received=m.bytes_received,
                compression_ratio=sent_raw / sent_wire if sent_wire else 1.0,
                alive=m.alive,
                profiled_microbatch_s=sum(m.profile.layer_seconds) if m.profile else 0.0,
                memory_bytes=m.profile.memory_bytes if m.profile else 0,
            )
            for link in m.links:
                reply.links.add(
                    src=m.node_id,
                    dst=link.peer,
                    codec=link.codec,
                    compression_ratio=link.raw_bytes / link.wire_bytes if link.wire_bytes else 1.0,
                    raw_bytes=link.raw_bytes,
                    wire_bytes=link.wire_bytes,
                    **measured_link(probes.pop(link.peer, None)),
                )
            for probe in probes.values():  # measured, no training traffic yet (or never: the coordinator's link)
                reply.links.add(src=m.node_id, dst=probe.peer, compression_ratio=1.0, **measured_link(probe))
        estimate = self.estimate
        if estimate is not None:
            reply.estimated_step_s, reply.bottleneck = estimate.step_seconds, estimate.bottleneck
        if plan:
            reply.plan_epoch = plan.epoch
            for st in plan.stages:
                stage = reply.stages.add(
                    index=st.index, layer_start=st.layer_start, layer_end=st.layer_end, node_ids=list(st.node_ids)
                )
                if estimate is not None and st.index < len(estimate.stages):
                    est = estimate.stages[st.index]
                    stage.est_compute_s, stage.est_transfer_s = est.compute_s, est.transfer_s
                    stage.utilisation = min(1.0, est.compute_s / estimate.step_seconds) if estimate.step_seconds else 0.0
        for at, kind, node_id, detail in self.store.events():
            reply.events.add(at=at, kind=kind, node_id=node_id, detail=detail)
        return reply

    def shutdown_nodes(self, reason: str, grace_s: float = 3.0) -> None:
        """Tell every live node the run is over and give their order streams a moment to deliver it."""
        with self._cond:
            self.finished = True
            alive = [m.node_id for m in self._alive()]
        self._send(alive, pb.Order(shutdown=pb.Shutdown(reason=reason)))
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(not self.members[n].orders.empty() for n in alive):
            time.sleep(0.05)
