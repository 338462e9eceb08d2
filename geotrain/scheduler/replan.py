"""Plan epochs: when the plan no longer fits the members, have placement.next_plan decide the next one and install it.

Installing waits for the nodes a decision needs (profiles, a node for every stage, the replicas' averaging peers),
bumps the epoch, which drops every uncommitted gradient on every node, gives each node that lacks its stage's state
a source, and waits until every node of the plan runs it with the committed state.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from geotrain.config import RunConfig
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import costmodel, placement
from geotrain.scheduler.calibration import Calibration, StepTimings
from geotrain.scheduler.errors import RunAborted, StepFailed
from geotrain.scheduler.membership import EventSink, Membership, Scope
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.recovery import Recovery, stage_bound
from geotrain.scheduler.state import RunStore
from geotrain.scheduler.stepdriver import call_deadline_s, current_loss_scale

log = logging.getLogger(__name__)

# Re-measured links that make the current plan's estimate this much slower than when it was made start a re-plan.
_DRIFT_REPLAN = 0.25
# A plan's prediction is its estimate once this many of its steps committed: its first step pays for starting the
# plan (connections, probes, a replica's first all-reduce; bench/plan_vs_real.py), so the prediction takes in one
# steady step too.
PREDICT_AFTER_STEPS = 2
# A replica whose hivemind misses this many plans of one incarnation (a step timeout each) is left out of the layout.
_JOIN_ROUNDS = 2
_SHUT_OUT = (
    f"did not join the replicas' averaging (hivemind) in {_JOIN_ROUNDS} plans: "
    "serves no stage until it joins or registers again"
)


def _seconds(estimate: costmodel.Plan | None) -> str:
    """An estimate's step time for the event log; "n/a" for a layout without one (a node lost, or not profiled)."""
    return f"{estimate.step_seconds:.3g} s" if estimate is not None else "n/a"


class ReplicaJoins:
    """The replicas' hivemind: ordering a plan's replicas to join the run's DHT, waiting until they have, and leaving
    out those that never do."""

    def __init__(
        self, cfg: RunConfig, membership: Membership, orders: OrderQueues, store: RunStore,
        dht_peers: Callable[[], list[str]],
    ) -> None:
        self.cfg = cfg
        self.membership = membership
        self.orders = orders
        self.store = store
        self.dht_peers = dht_peers
        self._misses: dict[str, tuple[float, int]] = {}  # node -> (its incarnation's joined_at, plans it missed)

    def gather(self, groups: placement.Groups) -> None:
        """Have every replica of the layout join the run's hivemind DHT, and wait until it has."""
        members = self.membership.members
        multi = [m.node_id for g in groups if len(g) > 1 for m in g]
        joining = [n for n in multi if not members[n].peer_id]
        if joining:
            self.orders.send(joining, pb.Order(join_averaging=pb.JoinAveraging(initial_peers=self.dht_peers())))
        self._await_peers(multi)
        if any(not members[n].alive for n in multi):
            raise StepFailed("a node died while the plan was being made")

    def _await_peers(self, multi: list[str]) -> None:
        """Wait until every live replica of the layout has joined the run's hivemind DHT; StepFailed on timeout. A
        replica that misses it _JOIN_ROUNDS times in one incarnation (a firewall, a broken install) serves no stage
        until its DHT joins after all or it registers again."""
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
            incarnation, rounds = self._misses.get(node_id, (None, 0))
            rounds = rounds + 1 if incarnation == members[node_id].joined_at else 1
            self._misses[node_id] = (members[node_id].joined_at, rounds)
            log.warning("%s did not join the replicas' averaging within %.0fs (%d of %d)", node_id, timeout, rounds,
                        _JOIN_ROUNDS)
            if rounds == _JOIN_ROUNDS:
                self.store.event("excluded", node_id, _SHUT_OUT)
        raise StepFailed(f"replicas {', '.join(missing())} did not join the averaging in {timeout:.0f}s")

    def shut_out(self) -> dict[str, str]:
        """Live nodes left out of every stage because their hivemind has not joined, and why."""
        members = self.membership.members
        return {
            n: _SHUT_OUT for n, (incarnation, rounds) in self._misses.items()
            if rounds >= _JOIN_ROUNDS and n in members and members[n].alive and members[n].joined_at == incarnation
            and not members[n].peer_id  # it joined late after all
        }


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
        self.joins = ReplicaJoins(cfg, membership, orders, store, dht_peers)
        plan_hex = store.get("plan")
        self.plan: pb.Plan | None = pb.Plan.FromString(bytes.fromhex(plan_hex)) if plan_hex else None
        self.dirty = True  # a failed step or drift: the next step needs a new epoch
        self.estimate: costmodel.Plan | None = None  # the cost model's view of the current plan
        self._planned_step_s: float | None = None  # its estimated step time when the plan was made
        self._baseline_measured = False  # _planned_step_s was taken with every link of the plan measured
        self.excluded: dict[str, str] = {}  # nodes the planner left out, and why: they stay spares
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
        plan's window is short of what they give (window_changed): checked before each step, since under
        train.inflight = "auto" a plan without an estimate runs one microbatch per stage (bench/window.py)."""
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
        """Correct the cost model with what the committed step measured and re-estimate the plan with that; a
        drifted estimate, or averaging or a window that ought to change, makes the next step re-plan. The estimate
        after a plan's PREDICT_AFTER_STEPS-th step is kept as its prediction ("predicted_step_s")."""
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
        self._keep_estimate(placement.estimate(self.cfg, ranges, groups, self.calibration.corrections, window), groups)

    def _keep_estimate(self, estimate: costmodel.Plan | None, groups: placement.Groups) -> None:
        """Make `estimate`, priced from the profiles of the nodes in `groups`, the current one."""
        self._estimated_from = {m.node_id: m.profile for g in groups for m in g}
        self.estimate = estimate
        if self.estimate is not None:
            self.store.put("estimated_step_s", repr(self.estimate.step_seconds))

    def drifted(self) -> bool:
        """Whether re-measured profiles or in-run times put the current plan's estimate over _DRIFT_REPLAN above what
        it was when the plan was made, and the planner asked now lays the layers out otherwise (if it keeps them, the
        plan stands, priced anew: a new epoch would only drop the step in between)."""
        if not self._replans_measured() or self.estimate is None:
            return False
        if self._planned_step_s is None or not self._baseline_measured:
            # The plan's profiles were not all in (they came in after it was made, or its links were still being
            # probed): each report moves the estimate, which is no drift; the estimate once they are in is the
            # plan's own.
            self._planned_step_s = self.estimate.step_seconds
            self._baseline_measured = placement.links_measured(self.plan, self.membership.members)
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

    def _load_deadline_s(self, plan: pb.Plan, loads: dict[str, tuple[str, str]]) -> float:
        """How long the slowest state load of `loads` takes, as the loading node times it (node.holder): its stage's
        state bytes over scheduler.state_link_mbps; the time a plan's take-up has on top of a step's."""
        sched, members, slowest = self.cfg.scheduler, self.membership.members, 0.0
        for s in plan.stages:
            for node_id in (n for n in s.node_ids if n in loads and n in members):
                bound = stage_bound(members[node_id], (s.layer_start, s.layer_end), self.cfg.compression.diloco)
                nbytes = bound.total_bytes if bound is not None else 0
                slowest = max(slowest, framing.state_deadline_s(nbytes, sched.state_link_mbps * 1e6 / 8, 0.0))
        return slowest

    def left_out(self) -> dict[str, str]:
        """Live nodes that serve no stage and why: the planner's choice, or a hivemind that never joined."""
        return self.excluded | self.joins.shut_out() | self.membership.benched()

    def _probe_regions(self) -> None:
        """Have one node of each region measure its link to one node of every other region, so the planner sees
        measured links between regions rather than defaults; waits for the reports (a missing one keeps defaults)."""
        asked = placement.region_probes(self.membership.alive())
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


    def _inputs(self) -> placement.PlanInputs:
        """What placement.next_plan decides from, as the run stands now."""
        return placement.PlanInputs(
            cfg=self.cfg,
            members=self.membership.members,
            refused=self.joins.shut_out() | self.membership.benched(),
            plan=self.plan,
            estimate=self.estimate,
            excluded=self.excluded,
            corrections=self.calibration.corrections,
            layers_may_move=self.recovery.checkpoints is not None,
        )

    def _decide(self) -> placement.NextPlan:
        """placement.next_plan over the members as they are, waiting up to scheduler.rejoin_timeout_s each time
        too few nodes can serve one (a node still measuring waits for the next plan); records whom the planner
        left out."""
        timeout = self.cfg.scheduler.rejoin_timeout_s
        while True:
            inputs = self._inputs()
            try:
                decided = placement.next_plan(inputs)
                break
            except placement.StageWithoutNode as e:
                log.warning("a stage has no node; waiting up to %.0fs for one", timeout)
                filled = lambda ranges=e.ranges: all(placement.assign(self._inputs(), ranges))  # noqa: E731
                self.membership.wait(filled, "a node for every stage", timeout)
            except placement.NoPlan as e:
                ids = {m.node_id for m in inputs.candidates}
                log.warning("no plan from %d node(s): %s; waiting up to %.0fs for others", len(ids), e, timeout)
                other = lambda ids=ids: {m.node_id for m in self._inputs().candidates} != ids  # noqa: E731
                self.membership.wait(other, "a node to plan with", timeout)
        for node_id, why in decided.excluded.items():
            if node_id not in self.excluded:
                log.info("%s serves no stage: %s", node_id, why)
                self.store.event("excluded", node_id, why)
        self.excluded = dict(decided.excluded)
        return decided

    def _planned_layout(self) -> tuple[placement.Ranges, placement.Groups]:
        """The layout a re-plan would install now."""
        decided = self._decide()
        return decided.ranges, decided.groups

    def replan(self, steps_done: int) -> int:
        """Install the next plan epoch at steps_done; returns the step the run continues from (earlier after a
        rollback). StepFailed when a node of the new plan is lost before it takes the plan up."""
        if self.plan is None and self.cfg.scheduler.placement == "measured":
            self.membership.wait(
                lambda: all(m.profile is not None for m in self.membership.alive()),
                "node profiles",
                self.cfg.scheduler.step_timeout_s,
            )
            self._probe_regions()
        decided = self._decide()
        self._keep_estimate(decided.estimate, decided.groups)
        self._planned_step_s = self.estimate.step_seconds if self.estimate is not None else None
        self._baseline_measured = False  # drifted() takes its baseline again once the plan's links are measured
        alive = self.membership.alive()
        loads, steps_done = self.recovery.sources(decided.ranges, decided.groups, self.plan, alive, steps_done)
        epoch = max(self.plan.epoch if self.plan else 0, int(self.store.get("plan_epoch", "0"))) + 1
        self.joins.gather(decided.groups)
        plan = decided.message(
            epoch=epoch,
            total_layers=self.cfg.model.total_layers,
            steps_done=steps_done,
            loss_scale=current_loss_scale(self.cfg, self.store).scale,
            excluded=self.left_out(),
            coordinator_key=self.coordinator_key,
            call_deadline_s=call_deadline_s(self.cfg.scheduler, self.estimate.step_seconds if self.estimate else None),
        )
        for route in plan.relays:
            log.info("plan epoch %d: %s and %s cannot be dialled: their link goes through relay %s", epoch, route.a,
                     route.b, route.relay_id)
        for why in decided.beyond_reach:
            log.warning("plan epoch %d: %s, which this version does not support", epoch, why)
            self.store.event("unreachable", detail=why)
        self._take_up(plan, loads)
        self._announce(plan, decided)
        return steps_done

    def _take_up(self, plan: pb.Plan, loads: dict[str, tuple[str, str]]) -> None:
        """Make `plan` current, send it to every live node and each node of `loads` its state's source, and wait
        until every node of the plan runs it with the committed state."""
        epoch, steps_done, members = plan.epoch, plan.steps_done, self.membership.members
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
            load = pb.LoadState(
                plan_epoch=epoch, steps_done=steps_done, source_address=address, expected_checksum=checksum
            )
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

    def _announce(self, plan: pb.Plan, decided: placement.NextPlan) -> None:
        """Record the plan taken up, and what it moved with the estimates before and after, in the event log."""
        detail = "; ".join(
            f"stage {s.index} layers {s.layer_start}-{s.layer_end - 1}: {', '.join(s.node_ids)}"
            + (" (averaging region by region)" if s.hierarchical_allreduce else "")
            for s in plan.stages
        )
        window = f"{plan.inflight} microbatches in flight per data head"
        self.store.event("plan", detail=f"epoch {plan.epoch}: {detail}; {window}")
        if decided.moved:
            what = (f"epoch {plan.epoch}: {'; '.join(map(str, decided.moved))}; estimated step "
                    f"{_seconds(decided.before)} before, {_seconds(decided.estimate)} after")
            log.info("layers moved: %s", what)
            self.store.event("moved", detail=what)
        self._on_event("plan", {"plan": plan})
