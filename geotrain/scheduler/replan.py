"""Plan epochs: when the plan no longer fits the members, make the next one and install it.

With scheduler.placement = measured, the planner makes the first plan from the nodes' profiles and every later one
(after a death, a return, or a node joining) from the current plan, moving as few layers as it can; layers that
move travel through a checkpoint of the committed step. Otherwise the first plan splits layers evenly and later
ones keep the ranges and only reassign nodes. Installing a plan bumps the epoch, which drops every uncommitted
gradient on every node, gives each node that lacks its stage's state a source, and waits until every node of the
plan runs it with the committed state.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace

from geotrain.config import RunConfig
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import costmodel, placement
from geotrain.scheduler.calibration import Calibration, StepTimings
from geotrain.scheduler.errors import RunAborted, StepFailed
from geotrain.scheduler.membership import EventSink, Member, Membership, Scope
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.planner import PlannerConfig
from geotrain.scheduler.planner import plan as plan_stages
from geotrain.scheduler.profiles import planner_inputs
from geotrain.scheduler.recovery import Recovery, stage_bound
from geotrain.scheduler.state import RunStore
from geotrain.scheduler.stepdriver import call_deadline_s, current_loss_scale

log = logging.getLogger(__name__)

# A re-plan keeps the current layers unless moving them is estimated this much faster: profiles measured at
# different times differ by several percent, and a smaller margin moves layers back and forth on that noise.
_REPLAN_TOLERANCE = 0.1
# Re-measured links that make the current plan's estimate this much slower than when it was made start a re-plan.
_DRIFT_REPLAN = 0.25
# A plan's prediction is its estimate once this many of its steps committed: its first step pays for starting the
# plan (connections, probes, a replica's first all-reduce: 18-55% slower than the next ones in bench/plan_vs_real.py's
# runs), so the prediction takes in one steady step too.
PREDICT_AFTER_STEPS = 2
# A replica whose hivemind misses this many plans of one incarnation (a step timeout each) is left out of the layout.
_JOIN_ROUNDS = 2
_SHUT_OUT = (
    f"did not join the replicas' averaging (hivemind) in {_JOIN_ROUNDS} plans: "
    "serves no stage until it joins or registers again"
)



def _beyond_reach(groups: list[list[Member]], stranded: list[str]) -> list[str]:
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


def _seconds(estimate: costmodel.Plan | None) -> str:
    """An estimate's step time for the event log; "n/a" for a layout without one (a node lost, or not profiled)."""
    return f"{estimate.step_seconds:.3g} s" if estimate is not None else "n/a"


class Planning:
    """The current plan, the cost model's view of it, and the making of the next one."""

    def __init__(
        self,
        cfg: RunConfig,
        membership: Membership,
        orders: OrderQueues,
        store: RunStore,
        recovery: Recovery,
        on_event: EventSink,
        dht_peers: Callable[[], list[str]],
        coordinator_key: bytes,
    ) -> None:
        self.cfg = cfg
        self.coordinator_key = coordinator_key  # in every plan: nodes serve their state to it
        # The addresses of the coordinator's DHT, which a node joins when it first becomes a replica; the DHT starts
        # with the first call.
        self.dht_peers = dht_peers
        self.membership = membership
        self.orders = orders
        self.store = store
        self.recovery = recovery
        self._on_event = on_event
        plan_hex = store.get("plan")
        self.plan: pb.Plan | None = pb.Plan.FromString(bytes.fromhex(plan_hex)) if plan_hex else None
        self.dirty = True  # a failed step or drift: the next step needs a new epoch
        self.estimate: costmodel.Plan | None = None  # the cost model's view of the current plan
        self._planned_step_s: float | None = None  # its estimated step time when the plan was made
        self._baseline_measured = False  # _planned_step_s was taken with every link of the plan measured
        self.excluded: dict[str, str] = {}  # nodes the planner left out, and why: they stay spares
        self._join_misses: dict[str, tuple[float, int]] = {}  # node -> (its incarnation's joined_at, plans it missed)
        self._estimated_from: dict[str, pb.NodeProfileReport | None] = {}  # the profiles behind self.estimate
        self.calibration = Calibration(averages_each_step=not cfg.compression.diloco)
        self._committed_epoch = 0  # the plan epoch of the last committed step
        self._plan_steps = 0  # steps committed under that epoch

    # -- is the plan still right? ---------------------------------------------------------------------------------

    def _replans_measured(self) -> bool:
        """Whether every plan comes from the planner over measured profiles. A plan after the first may move
        layers, and a moved layer's state travels through a checkpoint, so without a checkpoint store only the
        first plan is the planner's and later ones keep its layer ranges."""
        return self.cfg.scheduler.placement == "measured" and self.recovery.checkpoints is not None

    def _replica_cap(self, n: int) -> int:
        return self.cfg.scheduler.replicas or n

    def is_current(self) -> bool:
        """The plan's nodes are all alive in the incarnation it counts on, no spare could join it, and its window is
        not one the profiles that came in since it was made would change."""
        alive = self.membership.alive()
        nodes = set(placement.plan_nodes(self.plan))
        return (
            not self.dirty
            and not self._priced_late()
            and nodes <= {m.node_id for m in alive}
            and not nodes & self.membership.lost()
            and not nodes & set(self.membership.benched())
            and not placement.can_grow(
                self.plan,
                alive,
                set(self.left_out()),
                self._replans_measured(),
                self._replica_cap(len(self.membership.members)),
            )
        )

    def _priced_late(self) -> bool:
        """Whether the plan was made before its nodes' profiles could price it, they have all come in since, and the
        plan's window is short of what they give (window_changed): under train.inflight = "auto" a plan without an
        estimate runs one microbatch per stage (bench/window.py: a first step at 3 took 11.6 s where one at 16 took
        6.5 s). Checked before each step, not only once one committed (after_commit), so that no step runs at it."""
        if self.plan is None or self.estimate is not None:
            return False
        profiles = self._plan_profiles()
        if any(p is None for p in profiles.values()) or not self._profiles_newer(profiles):
            return False  # not all in yet, or none newer than the last estimate's (which found the plan infeasible)
        self._estimate_plan()
        return self.window_changed()

    def _plan_profiles(self) -> dict[str, pb.NodeProfileReport | None]:
        """The current plan's nodes' latest profiles (None: not in yet)."""
        assert self.plan is not None
        members = self.membership.members
        return {n: members[n].profile for n in placement.plan_nodes(self.plan)}

    def _profiles_newer(self, profiles: dict[str, pb.NodeProfileReport | None]) -> bool:
        """Whether any of these came in after the current estimate was made."""
        return any(profile is not self._estimated_from.get(n) for n, profile in profiles.items())

    def _estimate_plan(self) -> None:
        """update_estimate for the current plan's layout at its window."""
        assert self.plan is not None
        members = self.membership.members
        groups = [[members[n] for n in s.node_ids] for s in self.plan.stages]
        self.update_estimate(placement.plan_ranges(self.plan), groups, self.plan.inflight or None)

    def after_commit(self, timings: StepTimings) -> None:
        """Correct the cost model with what the committed step measured and re-estimate the plan with that (and
        with its nodes' latest profiles); a drifted estimate, or averaging or a window that ought to change, makes
        the next step re-plan. The estimate after a plan's PREDICT_AFTER_STEPS-th step is kept as its prediction
        ("predicted_step_s": the plan's later steps are measured against it, and it knows nothing of them)."""
        if self.plan is None:
            return
        profiles = self._plan_profiles()
        # The step as priced before its timings, which the averaging's fixed cost is measured beyond: the estimate
        # made after the last step, unless newer profiles came in since.
        if self._profiles_newer(profiles):
            self._estimate_plan()
        if self._committed_epoch != self.plan.epoch:
            self._committed_epoch, self._plan_steps = self.plan.epoch, 0
        self._plan_steps += 1
        self.calibration.observe(timings, self.plan, profiles, self.estimate, first_of_plan=self._plan_steps == 1)
        log.debug("step timings %s; corrections now %s", timings, self.calibration.corrections)
        self._estimate_plan()
        if self._plan_steps == PREDICT_AFTER_STEPS and self.estimate is not None:
            corrections = self.calibration.corrections
            prediction = {
                "plan_epoch": self.plan.epoch, "step_s": self.estimate.step_seconds,
                "commit_s": corrections.commit_s, "averaging_round_s": corrections.averaging_round_s,
                "crossing_s": corrections.crossing_s,
                "scales": dict(corrections.scales), "run_scale": corrections.run_scale,
            }
            self.store.put("predicted_step_s", json.dumps(prediction))
        self.dirty |= self.drifted() or self.averaging_changed() or self.window_changed()

    def update_estimate(self, ranges: placement.Ranges, groups: placement.Groups, window: int | None = None) -> None:
        """Price a layout with the cost model (None until every node of it has reported a profile), at the window
        it runs with where it has one, corrected by what the run has measured so far."""
        self._estimated_from = {m.node_id: m.profile for g in groups for m in g}
        self.estimate = placement.estimate(self.cfg, ranges, groups, self.calibration.corrections, window)
        if self.estimate is not None:
            self.store.put("estimated_step_s", repr(self.estimate.step_seconds))

    def drifted(self) -> bool:
        """Whether re-measured profiles or in-run times put the current plan's estimate so far above what it was when
        the plan was made that the planner should look again (it moves layers only where that pays:
        _REPLAN_TOLERANCE), and it does not keep the plan's layout: then the plan stands, priced anew (a new epoch
        would only drop the step in between; in-run times move most estimates that far after a plan's first step)."""
        if not self._replans_measured() or self.estimate is None:
            return False
        if self._planned_step_s is None or not self._baseline_measured:
            # The plan's profiles were not all in (they came in after it was made, or its links were still being
            # probed): each report moves the estimate, which is no drift; the estimate once they are in is the
            # plan's own.
            self._planned_step_s = self.estimate.step_seconds
            self._baseline_measured = self._links_measured()
            return False
        slower = placement.slowdown(self.estimate.step_seconds, self._planned_step_s)
        if slower <= _DRIFT_REPLAN:
            return False
        why = f"re-measured profiles and in-run times put the plan {100 * slower:.0f}% slower than estimated when made"
        if self._planner_keeps_layout():
            self._planned_step_s = self.estimate.step_seconds
            log.info("%s; the planner keeps its layout", why)
            self.store.event("drift", detail=f"{why}; the planner keeps its layout")
            return False
        log.info("re-planning: %s", why)
        self.store.event("drift", detail=why)
        return True

    def _links_measured(self) -> bool:
        """Whether every node of the plan has reported its link to each node of the next stage it can dial: a node
        probes them once it takes the plan up (node/holder.py), so its first profile prices them with defaults."""
        members = self.membership.members
        stages = self.plan.stages if self.plan is not None else []
        for stage, after in zip(stages, stages[1:]):
            targets = {n for i, n in enumerate(after.node_ids) if not (i < len(after.unreachable) and after.unreachable[i])}
            for node_id in stage.node_ids:
                profile = members[node_id].profile if node_id in members else None
                if profile is None or not targets <= {link.peer for link in profile.links}:
                    return False
        return True

    def _planner_keeps_layout(self) -> bool:
        """Whether the planner, asked now, lays the layers out as the running plan does (ranges and nodes)."""
        if self.plan is None:
            return False
        ranges, groups = self._planned_layout()
        return ranges == placement.plan_ranges(self.plan) and all(
            {m.node_id for m in group} == set(stage.node_ids) for group, stage in zip(groups, self.plan.stages)
        )

    def window_changed(self) -> bool:
        """Whether the plan's data-head window is far from the one its latest estimate gives (train.inflight =
        "auto"): the next plan carries the estimate's."""
        assert self.plan is not None
        if not placement.window_changed(self.cfg, self.plan, self.estimate):
            return False
        assert self.estimate is not None
        why = f"the estimate's window is {self.estimate.chosen_inflight} microbatches, the plan's {self.plan.inflight}"
        log.info("re-planning: %s", why)
        self.store.event("window", detail=why)
        return True

    def averaging_changed(self) -> bool:
        """Whether a stage's replicas now ought to average the other way than the plan has them."""
        assert self.plan is not None
        return placement.averaging_changed(
            self.plan, self.membership.members, self.cfg.scheduler.allreduce, self.estimate
        )

    # -- making the next plan --------------------------------------------------------------------------------------

    def _assign(self, ranges: placement.Ranges) -> placement.Groups:
        alive = self._placeable()
        return placement.assign_groups(ranges, alive, self.plan, set(self.left_out()), self._replica_cap(len(alive)))

    def _load_deadline_s(self, plan: pb.Plan, loads: dict[str, tuple[str, str]]) -> float:
        """How long the bytes of the slowest state load of `loads` take, as the loading node times them
        (node.holder): its stage's state bytes (the plan's bound, from the node's profile) over
        scheduler.state_link_mbps; the time a plan's take-up has on top of a step's."""
        sched, members, slowest = self.cfg.scheduler, self.membership.members, 0.0
        for s in plan.stages:
            for node_id in (n for n in s.node_ids if n in loads and n in members):
                bound = stage_bound(members[node_id], (s.layer_start, s.layer_end), self.cfg.compression.diloco)
                nbytes = bound.total_bytes if bound is not None else 0
                slowest = max(slowest, framing.state_deadline_s(nbytes, sched.state_link_mbps * 1e6 / 8, 0.0))
        return slowest

    def _layout(self) -> tuple[placement.Ranges, placement.Groups]:
        """Layer ranges and their nodes: the planner's over measured profiles (see the module docstring), else the
        current ranges (an even split at first) with nodes reassigned."""
        if self.cfg.scheduler.placement == "measured" and (self.plan is None or self._replans_measured()):
            if self.plan is None:
                self.membership.wait(
                    lambda: all(m.profile is not None for m in self.membership.alive()),
                    "node profiles",
                    self.cfg.scheduler.step_timeout_s,
                )
                self._probe_regions()
            return self._planned_layout()
        ranges = placement.stage_ranges(self.plan, self.cfg, len(self.membership.alive()))
        return ranges, self._assign(ranges)

    def _planned_layout(self) -> tuple[placement.Ranges, placement.Groups]:
        """The planner's layout over the live nodes that reported a profile (a node still measuring waits for
        the next plan), starting from the current plan's estimate when there is one."""
        previous = None
        if self.plan is not None and self.estimate is not None:
            previous = replace(self.estimate, excluded={n: "left out before" for n in self.excluded})
        while True:
            candidates = [m for m in self._placeable() if m.profile is not None]
            try:
                corrections = self.calibration.corrections
                nodes, model, network = planner_inputs(candidates, self.cfg, corrections.scale)
                planned = plan_stages(
                    nodes=nodes,
                    model=model,
                    network=network,
                    shape=placement.step_shape(self.cfg, model, corrections),
                    config=PlannerConfig(stages=self.cfg.scheduler.stages or None, replan_tolerance=_REPLAN_TOLERANCE),
                    previous=previous,
                )
                break
            except ValueError as e:  # too few nodes, or too little memory among them
                timeout = self.cfg.scheduler.rejoin_timeout_s
                log.warning("no plan from %d node(s): %s; waiting up to %.0fs for others", len(candidates), e, timeout)
                ids = {m.node_id for m in candidates}
                profiled = lambda: {m.node_id for m in self._placeable() if m.profile is not None}  # noqa: E731
                self.membership.wait(lambda: profiled() != ids, "a node to plan with", timeout)
        for node_id, why in planned.excluded.items():
            if node_id not in self.excluded:
                log.info("%s serves no stage: %s", node_id, why)
                self.store.event("excluded", node_id, why)
        self.excluded = dict(planned.excluded)
        members = self.membership.members
        return [(s.start, s.end) for s in planned.stages], [[members[n] for n in s.node_ids] for s in planned.stages]

    def _await_averaging_peers(self, multi: list[str]) -> None:
        """Wait until every live replica of the layout has joined the run's hivemind DHT. StepFailed on timeout,
        and a replica that misses it _JOIN_ROUNDS times in one incarnation serves no stage until its DHT joins after
        all or it registers again (its hivemind cannot reach or be reached by the others: a firewall, a broken
        install)."""
        members = self.membership.members
        missing = lambda: [n for n in multi if members[n].alive and not members[n].peer_id]  # noqa: E731
        timeout = self.cfg.scheduler.step_timeout_s
        try:
            self.membership.wait(lambda: not missing(), "replicas' averaging peers", timeout)
            return
        except RunAborted:
            if self.membership.stop_requested.is_set():
                raise
        for node_id in missing():
            incarnation, rounds = self._join_misses.get(node_id, (None, 0))
            rounds = rounds + 1 if incarnation == members[node_id].joined_at else 1
            self._join_misses[node_id] = (members[node_id].joined_at, rounds)
            log.warning("%s did not join the replicas' averaging within %.0fs (%d of %d)", node_id, timeout, rounds,
                        _JOIN_ROUNDS)
            if rounds == _JOIN_ROUNDS:
                self.store.event("excluded", node_id, _SHUT_OUT)
        raise StepFailed(f"replicas {', '.join(missing())} did not join the averaging in {timeout:.0f}s")

    def _shut_out(self) -> dict[str, str]:
        """Live nodes left out of every stage because their hivemind has not joined, and why."""
        members = self.membership.members
        return {
            n: _SHUT_OUT for n, (incarnation, rounds) in self._join_misses.items()
            if rounds >= _JOIN_ROUNDS and n in members and members[n].alive and members[n].joined_at == incarnation
            and not members[n].peer_id  # it joined late after all
        }

    def left_out(self) -> dict[str, str]:
        """Live nodes that serve no stage and why: the planner's choice, or a hivemind that never joined."""
        return self.excluded | self._shut_out() | self.membership.benched()

    def _placeable(self) -> list[Member]:
        """Live nodes the layout may use."""
        shut_out = self._shut_out() | self.membership.benched()
        return [m for m in self.membership.alive() if m.node_id not in shut_out]

    def _probe_regions(self) -> None:
        """Have one node of each region measure its link to one node of every other region, so the planner sees
        measured links between regions rather than defaults; waits for the reports (a missing one keeps defaults)."""
        first: dict[str, Member] = {}
        for m in sorted(self.membership.alive(), key=lambda m: (m.unreachable, m.node_id)):
            first.setdefault(m.region, m)  # a node that can be dialled, where the region has one
        asked: dict[str, list[Member]] = {}
        regions = sorted(first)
        for i, a in enumerate(regions):
            for b in regions[i + 1 :]:
                prober, target = first[a], first[b]
                if target.unreachable:
                    prober, target = target, prober  # the probe dials its target
                if not target.unreachable:
                    asked.setdefault(prober.node_id, []).append(target)
        for node_id, peers in asked.items():
            order = pb.ProbePeers(
                node_ids=[p.node_id for p in peers],
                addresses=[p.address for p in peers],
                regions=[p.region for p in peers],
            )
            self.orders.send([node_id], pb.Order(probe_peers=order))

        def measured() -> bool:
            for node_id, peers in asked.items():
                member = self.membership.members[node_id]
                links = {link.peer for link in member.profile.links} if member.profile else set()
                if member.alive and not {p.node_id for p in peers} <= links:
                    return False
            return True

        try:
            self.membership.wait(measured, "links between regions", self.cfg.scheduler.step_timeout_s / 4)
        except RunAborted as e:
            if self.membership.stop_requested.is_set():
                raise
            log.warning("planning with default links between regions: %s", e)

    def replan(self, steps_done: int) -> int:
        """Install the next plan epoch at steps_done; returns the step the run continues from (earlier after a
        rollback). StepFailed when a node of the new plan is lost before it takes the plan up."""
        ranges, groups = self._layout()
        if any(not g for g in groups):
            log.warning("a stage has no node; waiting up to %.0fs for one", self.cfg.scheduler.rejoin_timeout_s)
            self.membership.wait(
                lambda: all(self._assign(ranges)), "a node for every stage", self.cfg.scheduler.rejoin_timeout_s
            )
            groups = self._assign(ranges)
        moved = placement.moves(self.plan, ranges, groups)
        before = self._estimate_while_whole() if moved else None
        self.update_estimate(ranges, groups)
        self._planned_step_s = self.estimate.step_seconds if self.estimate is not None else None
        self._baseline_measured = False  # drifted() takes its baseline again once the plan's links are measured
        loads, steps_done = self.recovery.sources(ranges, groups, self.plan, self.membership.alive(), steps_done)
        epoch = max(self.plan.epoch if self.plan else 0, int(self.store.get("plan_epoch", "0"))) + 1
        members = self.membership.members
        multi = [m.node_id for g in groups if len(g) > 1 for m in g]
        joining = [n for n in multi if not members[n].peer_id]
        if joining:
            self.orders.send(joining, pb.Order(join_averaging=pb.JoinAveraging(initial_peers=self.dht_peers())))
        self._await_averaging_peers(multi)
        if any(not members[n].alive for n in multi):
            raise StepFailed("a node died while the plan was being made")
        mode = self.cfg.scheduler.allreduce
        plan = pb.Plan(
            epoch=epoch,
            total_layers=self.cfg.model.total_layers,
            steps_done=steps_done,
            loss_scale=current_loss_scale(self.cfg, self.store).scale,
            excluded=self.left_out(),
            coordinator_key=self.coordinator_key,
            inflight=placement.inflight(self.cfg, self.estimate, len(ranges)),
            call_deadline_s=call_deadline_s(self.cfg.scheduler, self.estimate.step_seconds if self.estimate else None),
        )
        routes, stranded = placement.relay_routes(groups)
        plan.relays.extend(routes)
        for i, ((start, end), group) in enumerate(zip(ranges, groups)):
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
                hierarchical_allreduce=placement.hierarchical_allreduce(mode, self.estimate, i, group),
            )
        for route in routes:
            log.info("plan epoch %d: %s and %s cannot be dialled: their link goes through relay %s", epoch, route.a,
                     route.b, route.relay_id)
        for why in _beyond_reach(groups, stranded):
            log.warning("plan epoch %d: %s, which this version does not support", epoch, why)
            self.store.event("unreachable", detail=why)
        self.plan = plan
        self.membership.take_up(plan)
        self.store.put("plan", plan.SerializeToString().hex())
        self.store.put("plan_epoch", str(epoch))
        self.orders.send([m.node_id for m in self.membership.alive()], pb.Order(plan=plan))
        # A node serves its state only to keys of the plan it runs: a source must run this one before a node new
        # to it asks.
        addresses = {address for address, _ in loads.values()}
        sources = tuple(sorted(m.node_id for m in self.membership.alive() if m.address in addresses))
        self.membership.wait(
            lambda: all(members[n].plan_epoch == epoch for n in sources),
            "state sources to take up the plan",
            self.cfg.scheduler.step_timeout_s,
            Scope(epoch, sources),
        )
        for node_id, (address, checksum) in loads.items():
            load = pb.LoadState(plan_epoch=epoch, steps_done=steps_done, source_address=address, expected_checksum=checksum)
            self.orders.send([node_id], pb.Order(load_state=load))
        nodes = placement.plan_nodes(plan)
        self.membership.wait(
            lambda: all(
                members[n].plan_epoch == epoch
                and members[n].applied_steps == steps_done
                and (n not in loads or members[n].state_epoch == epoch)
                for n in nodes
            ),
            "nodes to take up the plan",
            self.cfg.scheduler.step_timeout_s + self._load_deadline_s(plan, loads),
            Scope(epoch, tuple(nodes)),
        )
        self.membership.serving(plan)
        self.dirty = False
        detail = "; ".join(
            f"stage {s.index} layers {s.layer_start}-{s.layer_end - 1}: {', '.join(s.node_ids)}"
            + (" (averaging region by region)" if s.hierarchical_allreduce else "")
            for s in plan.stages
        )
        window = f"{plan.inflight} microbatches in flight per data head"
        self.store.event("plan", detail=f"epoch {epoch}: {detail}; {window}")
        if moved:
            what = (f"epoch {epoch}: {'; '.join(map(str, moved))}; estimated step {_seconds(before)} before, "
                    f"{_seconds(self.estimate)} after")
            log.info("layers moved: %s", what)
            self.store.event("moved", detail=what)
        self._on_event("plan", {"plan": plan})
        return steps_done

    def _estimate_while_whole(self) -> costmodel.Plan | None:
        """The current plan's estimate from its nodes' latest profiles at its window, while every node of it lives
        (a plan that lost one has no step time to compare)."""
        assert self.plan is not None
        members = self.membership.members
        groups = [[members.get(n) for n in s.node_ids] for s in self.plan.stages]
        if any(m is None or not m.alive for g in groups for m in g):
            return None
        ranges = placement.plan_ranges(self.plan)
        return placement.estimate(self.cfg, ranges, groups, self.calibration.corrections, self.plan.inflight or None)
