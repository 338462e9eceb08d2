"""scheduler/placement.next_plan: the next plan decided from members, their profiles and the current plan, in process
with no cluster: no waits, no orders, no run state."""

from __future__ import annotations

import pytest

from geotrain.config import load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import placement
from geotrain.scheduler.membership import Lifecycle, Member
from geotrain.scheduler.placement import Move, PlanInputs, next_plan
from tests.test_profiles import CFG, LAYERS, _report

UNIFORM = load_config(None, ["model.n_layers=2", "scheduler.placement=uniform"])


def _member(node_id: str, joined_at: float, peers: str = "") -> Member:
    """A live member that joined at `joined_at`, with a profile measuring its links to `peers` (none: not profiled)."""
    member = Member(node_id, f"127.0.0.1:{7001 + int(joined_at)}", "eu", joined_at, 0.0, peer_id=f"peer-of-{node_id}")
    if peers:
        member.profile = _report(node_id, links={p: (100, 20) for p in peers if p != node_id})
    return member


def _members(ids: str, profiled: bool = False) -> dict[str, Member]:
    return {n: _member(n, i, ids if profiled else "") for i, n in enumerate(ids)}


def _message(decided: placement.NextPlan, epoch: int = 1) -> pb.Plan:
    return decided.message(epoch=epoch, total_layers=LAYERS, steps_done=0, loss_scale=1.0, excluded={},
                           coordinator_key=b"k", call_deadline_s=0.0)


def _layout(decided: placement.NextPlan) -> list[list[str]]:
    return [[m.node_id for m in group] for group in decided.groups]


def test_a_first_uniform_plan_splits_the_layers_evenly_over_the_nodes_in_join_order():
    members = _members("abc")
    decided = next_plan(PlanInputs(cfg=UNIFORM, members=members))
    assert decided.ranges == [(0, 2), (2, 3), (3, 4)]
    assert _layout(decided) == [["a"], ["b"], ["c"]]
    # Nothing moves into a first plan, and without profiles nothing prices it: one microbatch per stage in flight.
    assert decided.moved == [] and decided.before is None and decided.estimate is None and decided.inflight == 3
    assert decided.relays == [] and decided.beyond_reach == [] and decided.hierarchical == [False] * 3
    plan = _message(decided, epoch=4)
    assert plan.epoch == 4 and plan.total_layers == LAYERS and plan.inflight == 3 and plan.coordinator_key == b"k"
    assert [(s.index, s.layer_start, s.layer_end, list(s.node_ids)) for s in plan.stages] == [
        (0, 0, 2, ["a"]), (1, 2, 3, ["b"]), (2, 3, 4, ["c"])
    ]
    assert list(plan.stages[1].addresses) == [members["b"].address]
    assert list(plan.stages[1].peer_ids) == [], "a stage of one node averages with nobody"


def test_a_first_measured_plan_is_the_planners_over_the_nodes_that_reported_a_profile():
    members = _members("abc", profiled=True)
    members["d"] = _member("d", 3)  # still measuring itself
    decided = next_plan(PlanInputs(cfg=CFG, members=members))
    placed = [n for group in _layout(decided) for n in group]
    assert "d" not in placed and set(placed) <= set("abc") and all(decided.groups)
    starts, ends = zip(*decided.ranges)
    assert starts[0] == 0 and ends[-1] == LAYERS and list(starts[1:]) == list(ends[:-1]), "contiguous, every layer"
    assert decided.estimate is not None and decided.inflight == decided.estimate.chosen_inflight > 0
    assert decided.estimate.step_seconds > 0 and decided.moved == []


def test_nothing_changes_when_nothing_changed():
    for cfg, profiled in ((UNIFORM, False), (CFG, True)):
        members = _members("abc", profiled)
        first = next_plan(PlanInputs(cfg=cfg, members=members))
        plan = _message(first)
        inputs = PlanInputs(cfg=cfg, members=members, plan=plan, estimate=first.estimate, layers_may_move=True)
        again = next_plan(inputs)
        assert (again.ranges, _layout(again), again.moved) == (first.ranges, _layout(first), [])
        assert _message(again, epoch=2).stages == plan.stages, cfg.scheduler.placement


def test_a_spare_takes_the_stage_of_a_node_lost_and_a_stage_without_one_waits():
    members = _members("abc")
    plan = _message(next_plan(PlanInputs(cfg=UNIFORM, members=members)))
    members["c"].lifecycle = Lifecycle.DEAD
    with pytest.raises(placement.StageWithoutNode) as e:  # the install step waits for a node
        next_plan(PlanInputs(cfg=UNIFORM, members=members, plan=plan))
    assert e.value.ranges == placement.plan_ranges(plan)
    members["d"] = _member("d", 3)
    decided = next_plan(PlanInputs(cfg=UNIFORM, members=members, plan=plan))
    assert decided.ranges == placement.plan_ranges(plan) and _layout(decided) == [["a"], ["b"], ["d"]]
    assert decided.moved == [Move(3, 4, ("c",), ("d",))]
    assert decided.before is None, "the plan lost c: it has no step time to compare with"


def test_a_spare_becomes_a_replica_up_to_the_cap_unless_it_is_refused():
    two = load_config(None, ["model.n_layers=2", "scheduler.placement=uniform", "scheduler.stages=2"])
    members = _members("ab")
    plan = _message(next_plan(PlanInputs(cfg=two, members=members)))
    members["c"] = _member("c", 2)
    decided = next_plan(PlanInputs(cfg=two, members=members, plan=plan))
    assert _layout(decided) == [["a", "c"], ["b"]] and decided.moved == [Move(0, 2, ("a",), ("c",))]
    stage = _message(decided, epoch=2).stages[0]
    assert list(stage.peer_ids) == ["peer-of-a", "peer-of-c"], "replicas average through their hivemind peers"
    refused = next_plan(PlanInputs(cfg=two, members=members, plan=plan, refused={"c": "stalled"}))
    capped = load_config(None, ["model.n_layers=2", "scheduler.placement=uniform", "scheduler.stages=2",
                                "scheduler.replicas=1"])
    for decided in (refused, next_plan(PlanInputs(cfg=capped, members=members, plan=plan))):
        assert _layout(decided) == [["a"], ["b"]] and decided.moved == []


def test_the_planner_replaces_a_node_lost_with_a_profiled_spare():
    members = _members("abc", profiled=True)
    first = next_plan(PlanInputs(cfg=CFG, members=members))
    plan = _message(first)
    lost = _layout(first)[-1][0]
    members[lost].lifecycle = Lifecycle.DEAD
    members["d"] = _member("d", 3, "abcd")
    decided = next_plan(PlanInputs(cfg=CFG, members=members, plan=plan, estimate=first.estimate, layers_may_move=True))
    placed = [n for group in _layout(decided) for n in group]
    assert "d" in placed and lost not in placed and all(decided.groups)
    assert any("d" in move.to for move in decided.moved) and decided.before is None
    # Without a profiled node to plan with, the planner finds no plan: the install step waits for one.
    for m in members.values():
        m.profile = None
    with pytest.raises(placement.NoPlan):
        next_plan(PlanInputs(cfg=CFG, members=members, plan=plan, layers_may_move=True))
