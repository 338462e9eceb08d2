"""Placement as pure functions of members and plans: the next plan (next_plan: its layout, what it moves, its
estimate, averaging, window and relays), layer ranges, who serves which stage, drift and where a node's state comes
from. No waits, no orders, no SQLite here (petals keeps block selection pure the same way); scheduler.replan waits
for the nodes these need and installs what they decide.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from geotrain.config import AUTO_INFLIGHT, RunConfig
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import costmodel
from geotrain.scheduler.calibration import Corrections
from geotrain.scheduler.membership import Member
from geotrain.scheduler.planner import PlannerConfig
from geotrain.scheduler.planner import plan as plan_stages
from geotrain.scheduler.profiles import planner_inputs

Ranges = list[tuple[int, int]]
Groups = list[list[Member]]

# An auto window this far below its need is raised (window_changed): every microbatch it lacks idles the links.
_WINDOW_SHORT = 0.05
# A re-plan keeps the current layers unless moving them is estimated this much faster: profiles measured at
# different times differ by several percent, and a smaller margin moves layers back and forth on that noise.
_REPLAN_TOLERANCE = 0.1


def split_layers(total_layers: int, n_stages: int) -> Ranges:
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


def plan_nodes(plan: pb.Plan | None) -> list[str]:
    """Every node of a plan, stage by stage."""
    return [n for s in plan.stages for n in s.node_ids] if plan else []


def plan_ranges(plan: pb.Plan | None) -> Ranges:
    """A plan's layer ranges, stage by stage."""
    return [(s.layer_start, s.layer_end) for s in plan.stages] if plan else []


def stage_ranges(plan: pb.Plan | None, cfg: RunConfig, n_alive: int) -> Ranges:
    """The plan's layer ranges (state stays where it is); without a plan, the layers split evenly."""
    if plan is not None:
        return plan_ranges(plan)
    total = cfg.model.total_layers
    return split_layers(total, min(total, cfg.scheduler.stages or n_alive))


def assign_groups(ranges: Ranges, alive: list[Member], plan: pb.Plan | None, excluded: set[str], cap: int) -> Groups:
    """Nodes per stage: nodes keep their stage, returning nodes take the stage they hold, empty stages take
    spares (oldest first), then the rest become replicas up to `cap` per stage (excluded nodes stay spares)."""
    previous = {n: s.index for s in plan.stages for n in s.node_ids} if plan else {}
    groups: Groups = [[] for _ in ranges]
    unplaced = []
    for m in sorted(alive, key=lambda m: m.joined_at):
        if m.node_id in previous and previous[m.node_id] < len(ranges):
            groups[previous[m.node_id]].append(m)
        elif m.held in ranges:
            groups[ranges.index(m.held)].append(m)
        else:
            unplaced.append(m)
    for group in groups:
        if not group and unplaced:
            group.append(unplaced.pop(0))
    for m in unplaced:
        if m.node_id in excluded:
            continue
        smallest = min(groups, key=len)
        if len(smallest) < cap:
            smallest.append(m)
    return groups


def can_grow(plan: pb.Plan | None, alive: list[Member], excluded: set[str], measured: bool, cap: int) -> bool:
    """Some live node serves no stage (and, for the planner, has reported its profile) and could serve one: the
    planner decides where it helps (measured), else a stage has room for another replica."""
    if plan is None:
        return False
    placed = set(plan_nodes(plan)) | excluded
    spare = any(m.node_id not in placed and (m.profile is not None or not measured) for m in alive)
    return spare and (measured or any(len(s.node_ids) < cap for s in plan.stages))


def step_shape(cfg: RunConfig, model: costmodel.ModelProfile, corrections: Corrections) -> costmodel.StepShape:
    """A step as the planner and the cost model see it, with the fixed costs the run measured; PowerSGD's rank only
    where the nodes reported the parameter shapes that size its factors."""
    return costmodel.StepShape.from_config(
        cfg, param_shapes_known=model.layer_param_shapes is not None,
        averaging_round_s=corrections.averaging_round_s, commit_s=corrections.commit_s,
        crossing_s=corrections.crossing_s,
    )


def estimate(
    cfg: RunConfig, ranges: Ranges, groups: Groups, corrections: Corrections, window: int | None = None
) -> costmodel.Plan | None:
    """The cost model's estimate of a layout with the run's corrections, once every node in it has reported a
    profile: at the data heads' window `window` where the layout runs with one already (a plan's), else at the one
    train.inflight gives it."""
    members = [m for g in groups for m in g]
    if any(m.profile is None for m in members):
        return None
    nodes, model, network = planner_inputs(members, cfg, corrections.scale)
    index = {n.node_id: i for i, n in enumerate(nodes)}
    shape = step_shape(cfg, model, corrections)
    cm = costmodel.CostModel(nodes=nodes, model=model, network=network, shape=shape)
    stages = [(start, end, [index[m.node_id] for m in g]) for (start, end), g in zip(ranges, groups)]
    return cm.plan(stages, {}, window) if cm.feasible(stages) else None


def inflight(cfg: RunConfig, estimate: costmodel.Plan | None, n_stages: int) -> int:
    """The data heads' window a plan runs with: train.inflight, or under "auto" the estimate's (the round trip over
    the pace, shared among the stage-0 replicas), and one microbatch per stage until profiles price the plan."""
    if cfg.train.inflight != AUTO_INFLIGHT:
        return cfg.train.inflight
    return estimate.chosen_inflight if estimate is not None and estimate.chosen_inflight else n_stages


def window_changed(cfg: RunConfig, plan: pb.Plan, estimate: costmodel.Plan | None) -> bool:
    """Under train.inflight = "auto", whether the plan's window should become the estimate's: links measured since
    the plan was made, or in-run times, can put the round trip over the pace above it, and too small a window idles
    the links. Only raised (more than _WINDOW_SHORT short of the need), unless memory lowered the estimate's: a
    window moved both ways would flip between plans as each step's measurements move its need (bench/window.py)."""
    if cfg.train.inflight != AUTO_INFLIGHT or estimate is None or not estimate.chosen_inflight or not plan.inflight:
        return False
    chosen, need = estimate.chosen_inflight, estimate.window_need
    if need is None:  # priced at a fixed window: no need to compare with
        return False
    if chosen < math.ceil(need - 1e-9) and plan.inflight > chosen:
        return True  # memory holds no more than the estimate's window
    return plan.inflight * (1 + _WINDOW_SHORT) < need and plan.inflight < chosen


@dataclass(frozen=True)
class Move:
    """Layers [start, end) that nodes take on under a new layout: who held them under the plan before, who gains them."""

    start: int
    end: int
    holders: tuple[str, ...]
    to: tuple[str, ...]

    def __str__(self) -> str:
        layers = f"layer {self.start}" if self.end - self.start == 1 else f"layers {self.start}-{self.end - 1}"
        return f"{layers} from {', '.join(self.holders) or 'no node'} to {', '.join(self.to)}"


def moves(plan: pb.Plan | None, ranges: Ranges, groups: Groups) -> list[Move]:
    """What the layout (ranges, groups) moves from `plan`: for each run of layers with the same holders before and
    the same nodes gaining them, one Move. A node that keeps a layer moves nothing; a new replica gains its stage."""
    if plan is None:
        return []
    held: dict[int, tuple[str, ...]] = {}
    for s in plan.stages:
        for layer in range(s.layer_start, s.layer_end):
            held[layer] = tuple(sorted(s.node_ids))
    found: list[Move] = []
    for (start, end), group in zip(ranges, groups):
        for layer in range(start, end):
            holders = held.get(layer, ())
            gaining = tuple(sorted(m.node_id for m in group if m.node_id not in holders))
            if not gaining:
                continue
            if found and (found[-1].end, found[-1].holders, found[-1].to) == (layer, holders, gaining):
                found[-1] = Move(found[-1].start, layer + 1, holders, gaining)
            else:
                found.append(Move(layer, layer + 1, holders, gaining))
    return found


def slowdown(estimate_s: float, planned_s: float) -> float:
    """How much slower re-measured profiles put a plan than its estimate when it was made (0.25 = 25%)."""
    return estimate_s / planned_s - 1


def hierarchical_allreduce(mode: str, estimate: costmodel.Plan | None, index: int, group: list[Member]) -> bool:
    """Whether stage `index`'s replicas average region by region (scheduler.allreduce): under auto where the cost
    model's estimate of the plan (any placement) prices it faster, which needs the nodes' profiles; under
    hierarchical wherever it differs from a flat all-reduce."""
    if mode == "hierarchical":
        per_region = Counter(m.region for m in group)
        return len(per_region) > 1 and max(per_region.values()) > 1
    if mode == "auto" and estimate is not None:
        return estimate.stages[index].hierarchical_allreduce
    return False


def averaging_changed(
    plan: pb.Plan, members: dict[str, Member], mode: str, estimate: costmodel.Plan | None
) -> bool:
    """Whether a stage's replicas now ought to average the other way than the plan has them (the profiles that
    price it came in after the plan was made)."""
    return any(
        stage.hierarchical_allreduce != hierarchical_allreduce(mode, estimate, i, [members[n] for n in stage.node_ids])
        for i, stage in enumerate(plan.stages)
    )


def holders(alive: list[Member], rng: tuple[int, int], steps_done: int) -> list[Member]:
    """Live nodes holding exactly this layer range at the committed step, those that can be dialled first (a state
    download dials its source)."""
    return sorted((m for m in alive if m.held == rng and m.applied_steps == steps_done), key=lambda m: m.unreachable)


@dataclass(frozen=True)
class StateSources:
    """Where each node that lacks its stage's committed state gets it."""

    # node id -> (a live holder's address, or '' for the coordinator, which relays a holder nobody can dial; expected
    # checksum or '')
    from_peers: dict[str, tuple[str, str]]
    reshaped: list[int]  # stages whose range no live node holds whole: they load from a checkpoint


def state_sources(
    ranges: Ranges, groups: Groups, current: Ranges, alive: list[Member], steps_done: int, recorded: dict[int, str]
) -> StateSources:
    """For the layout (ranges, groups) at steps_done: the nodes that load from a live holder of their range, and
    the stages that no live node holds whole (the plan moved layers, or a stage lost every copy). `current` is the
    current plan's ranges, `recorded` its stages' checksums at the committed step."""
    from_peers: dict[str, tuple[str, str]] = {}
    reshaped = []
    for i, (rng, group) in enumerate(zip(ranges, groups)):
        have = holders(alive, rng, steps_done)
        if not have:
            reshaped.append(i)
            continue
        checksum = recorded.get(current.index(rng), "") if rng in current else ""
        source = "" if have[0].unreachable else have[0].address  # holders that can be dialled come first
        for m in group:
            if m not in have:
                from_peers[m.node_id] = (source, checksum)
    return StateSources(from_peers, reshaped)


def region_probes(alive: list[Member]) -> dict[str, list[Member]]:
    """Who measures its link to whom so that every pair of regions has one measured link: one node of each region
    (one that can be dialled, where the region has one) probes one node of every other region it can dial."""
    first: dict[str, Member] = {}
    for m in sorted(alive, key=lambda m: (m.unreachable, m.node_id)):
        first.setdefault(m.region, m)
    asked: dict[str, list[Member]] = {}
    regions = sorted(first)
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            prober, target = first[a], first[b]
            if target.unreachable:
                prober, target = target, prober  # the probe dials its target
            if not target.unreachable:
                asked.setdefault(prober.node_id, []).append(target)
    return asked


def relay_routes(groups: Groups) -> tuple[list[pb.RelayRoute], list[str]]:
    """A relay for each link between neighbouring stages whose two ends nobody can dial: a node of the layout that
    can be dialled (so the plan's take-up waits for it and its death re-plans), each time the one reported failing
    to relay the fewest times, then relaying the fewest links so far; and the pairs no node can relay."""
    relays = sorted((m for g in groups for m in g if not m.unreachable), key=lambda m: m.node_id)
    load = Counter[str]()
    routes, stranded = [], []
    for before, after in zip(groups, groups[1:]):
        for a, b in ((a, b) for a in before for b in after if a.unreachable and b.unreachable):
            if not relays:
                stranded.append(f"{a.node_id}-{b.node_id}")
                continue
            relay = min(relays, key=lambda m: (m.relay_failures, load[m.node_id]))  # the first of those
            load[relay.node_id] += 1
            routes.append(pb.RelayRoute(a=a.node_id, b=b.node_id, relay_id=relay.node_id,
                                        relay_address=relay.address, relay_key=relay.public_key))
    return routes, stranded


def beyond_reach(groups: Groups, stranded: list[str]) -> list[str]:
    """What a layout asks of nodes nobody can dial that this version cannot do: links with both ends behind NAT
    and no node to relay them (`stranded`), and replicas averaging where none of them can be dialled."""
    found = []
    if stranded:
        found.append(f"nobody can dial either end of {', '.join(stranded)}, nor any node to relay them")
    for group in groups:
        behind = [m.node_id for m in group if m.unreachable]
        if len(group) > 1 and len(behind) == len(group):
            found.append(f"replicas {', '.join(behind)} would average with no replica anyone can dial")
    return found


def links_measured(plan: pb.Plan | None, members: Mapping[str, Member]) -> bool:
    """Whether every node of the plan has reported its link to each node of the next stage it can dial: a node
    probes them once it takes the plan up (node/holder.py), so its first profile prices them with defaults."""
    stages = plan.stages if plan is not None else []
    for stage, after in zip(stages, stages[1:]):
        targets = {n for i, n in enumerate(after.node_ids) if not (i < len(after.unreachable) and after.unreachable[i])}
        for node_id in stage.node_ids:
            profile = members[node_id].profile if node_id in members else None
            if profile is None or not targets <= {link.peer for link in profile.links}:
                return False
    return True


@dataclass(frozen=True)
class PlanInputs:
    """What the next plan is decided from: the run's config and corrections, the members, the current plan."""

    cfg: RunConfig
    members: Mapping[str, Member]  # every member, dead ones too
    refused: Mapping[str, str] = field(default_factory=dict)  # live members that may serve no stage, and why
    plan: pb.Plan | None = None  # the current plan
    estimate: costmodel.Plan | None = None  # the cost model's view of the current plan
    excluded: Mapping[str, str] = field(default_factory=dict)  # nodes the planner left out of it, and why
    corrections: Corrections = field(default_factory=Corrections)
    # A checkpoint store carries the state of layers that move: only then may a plan after the first move layers.
    layers_may_move: bool = False

    @property
    def placeable(self) -> list[Member]:
        """Live members a layout may use."""
        return [m for m in self.members.values() if m.alive and m.node_id not in self.refused]

    @property
    def candidates(self) -> list[Member]:
        """The placeable members the planner plans with: those that reported a profile."""
        return [m for m in self.placeable if m.profile is not None]

    @property
    def planned(self) -> bool:
        """Whether the planner lays the next plan out over measured profiles, rather than the current ranges (an
        even split at first) keeping their nodes."""
        return self.cfg.scheduler.placement == "measured" and (self.plan is None or self.layers_may_move)


class NoPlan(ValueError):
    """The planner finds no plan among the candidates: too few, or too little memory among them."""


class StageWithoutNode(Exception):
    """The layout keeps these ranges and a stage of them has no node: the next plan waits for one."""

    def __init__(self, ranges: Ranges) -> None:
        super().__init__(f"a stage of {ranges} has no node")
        self.ranges = ranges


@dataclass(frozen=True)
class NextPlan:
    """The next plan as decided: its layout and what follows from it; `message` makes it a plan to send."""

    ranges: Ranges
    groups: Groups
    excluded: dict[str, str]  # the nodes the planner leaves out, and why
    moved: list[Move]
    before: costmodel.Plan | None  # the current plan's estimate, where layers move and all its nodes live
    estimate: costmodel.Plan | None  # None until every node of the layout has reported a profile
    inflight: int
    hierarchical: list[bool]  # per stage: its replicas average region by region
    relays: list[pb.RelayRoute]
    beyond_reach: list[str]  # what the layout asks that this version cannot do (beyond_reach)

    def message(
        self, *, epoch: int, total_layers: int, steps_done: int, loss_scale: float, excluded: Mapping[str, str],
        coordinator_key: bytes, call_deadline_s: float,
    ) -> pb.Plan:
        """The plan as sent, with its nodes' addresses, keys and averaging peers as the members have them now."""
        plan = pb.Plan(
            epoch=epoch, total_layers=total_layers, steps_done=steps_done, loss_scale=loss_scale, excluded=excluded,
            coordinator_key=coordinator_key, inflight=self.inflight, relays=self.relays, call_deadline_s=call_deadline_s,
        )
        for i, ((start, end), group) in enumerate(zip(self.ranges, self.groups)):
            plan.stages.add(
                index=i,
                layer_start=start,
                layer_end=end,
                node_ids=[m.node_id for m in group],
                addresses=[m.address for m in group],
                regions=[m.region for m in group],
                peer_ids=[m.peer_id for m in group] if len(group) > 1 else [],
                public_keys=[m.public_key for m in group],
                unreachable=[m.unreachable for m in group],
                hierarchical_allreduce=self.hierarchical[i],
            )
        return plan


def next_plan(inputs: PlanInputs) -> NextPlan:
    """The next plan for the members as they are. NoPlan when the planner finds none, StageWithoutNode when kept
    ranges lack a node for a stage: then the next plan waits for nodes."""
    ranges, groups, excluded = _layout(inputs)
    if not all(groups):
        raise StageWithoutNode(ranges)
    cfg = inputs.cfg
    moved = moves(inputs.plan, ranges, groups)
    priced = estimate(cfg, ranges, groups, inputs.corrections)
    routes, stranded = relay_routes(groups)
    return NextPlan(
        ranges=ranges,
        groups=groups,
        excluded=excluded,
        moved=moved,
        before=_estimate_while_whole(inputs) if moved else None,
        estimate=priced,
        inflight=inflight(cfg, priced, len(ranges)),
        hierarchical=[hierarchical_allreduce(cfg.scheduler.allreduce, priced, i, g) for i, g in enumerate(groups)],
        relays=routes,
        beyond_reach=beyond_reach(groups, stranded),
    )


def assign(inputs: PlanInputs, ranges: Ranges) -> Groups:
    """assign_groups over the placeable members, nodes left out staying spares, up to scheduler.replicas each."""
    placeable = inputs.placeable
    left_out = set(inputs.excluded) | set(inputs.refused)
    return assign_groups(ranges, placeable, inputs.plan, left_out, inputs.cfg.scheduler.replicas or len(placeable))


def _layout(inputs: PlanInputs) -> tuple[Ranges, Groups, dict[str, str]]:
    """Layer ranges, their nodes and the nodes the planner leaves out: the planner's (PlanInputs.planned), else the
    current ranges (an even split at first) with nodes reassigned."""
    if inputs.planned:
        return _planned_layout(inputs)
    n_alive = sum(m.alive for m in inputs.members.values())
    ranges = stage_ranges(inputs.plan, inputs.cfg, n_alive)
    return ranges, assign(inputs, ranges), dict(inputs.excluded)


def _planned_layout(inputs: PlanInputs) -> tuple[Ranges, Groups, dict[str, str]]:
    """The planner's layout over the candidates, starting from the current plan's estimate when there is one."""
    previous = None
    if inputs.plan is not None and inputs.estimate is not None:
        previous = replace(inputs.estimate, excluded={n: "left out before" for n in inputs.excluded})
    cfg, corrections = inputs.cfg, inputs.corrections
    try:
        nodes, model, network = planner_inputs(inputs.candidates, cfg, corrections.scale)
        planned = plan_stages(
            nodes=nodes,
            model=model,
            network=network,
            shape=step_shape(cfg, model, corrections),
            config=PlannerConfig(stages=cfg.scheduler.stages or None, replan_tolerance=_REPLAN_TOLERANCE),
            previous=previous,
        )
    except ValueError as e:
        raise NoPlan(str(e)) from e
    groups = [[inputs.members[n] for n in s.node_ids] for s in planned.stages]
    return [(s.start, s.end) for s in planned.stages], groups, dict(planned.excluded)


def _estimate_while_whole(inputs: PlanInputs) -> costmodel.Plan | None:
    """The current plan's estimate from its nodes' latest profiles at its window, while every node of it lives
    (a plan that lost one has no step time to compare)."""
    plan = inputs.plan
    assert plan is not None
    groups = [[inputs.members.get(n) for n in s.node_ids] for s in plan.stages]
    if any(m is None or not m.alive for g in groups for m in g):
        return None
    return estimate(inputs.cfg, plan_ranges(plan), groups, inputs.corrections, plan.inflight or None)
