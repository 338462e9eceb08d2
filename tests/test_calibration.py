"""scheduler/calibration: what committed steps measured becomes bounded corrections to the cost model's inputs."""

from __future__ import annotations

import pytest

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import costmodel
from geotrain.scheduler.calibration import SCALE_BOUNDS, Calibration, Corrections, StepTimings

PLAN = pb.Plan(epoch=3, stages=[
    pb.StageAssignment(index=0, layer_start=0, layer_end=2, node_ids=["a", "b"]),
    pb.StageAssignment(index=1, layer_start=2, layer_end=4, node_ids=["c"]),
])
PROFILES = {n: pb.NodeProfileReport(node_id=n, layer_seconds=[0.01, 0.02, 0.03, 0.04]) for n in "abc"}


def _stage(allreduce_s: float, rounds: int) -> costmodel.StagePlan:
    return costmodel.StagePlan(start=0, end=1, node_ids=[], compute_s=0.0, transfer_s=0.0, allreduce_s=allreduce_s,
                               allreduce_rounds=rounds, memory_bytes=0)


def _estimate(*stages: costmodel.StagePlan) -> costmodel.Plan:
    return costmodel.Plan(stages=list(stages), excluded={}, microbatches=4, microbatch_size=1, step_seconds=1.0,
                          samples_per_s=4.0, bottleneck="", compute_bound_samples_per_s=4.0)


def _observe(calibration: Calibration, timings: StepTimings, *priced: costmodel.StagePlan) -> None:
    """A step after its plan's first, whose stages the estimate priced as given."""
    calibration.observe(timings, PLAN, PROFILES, _estimate(*priced), first_of_plan=False)


def _timings(commit_s=0.1, epoch=3, **reported: tuple[float, float]) -> StepTimings:
    """Node -> (compute seconds per microbatch, averaging seconds)."""
    return StepTimings(plan_epoch=epoch, commit_s=commit_s, compute_s={n: c for n, (c, _) in reported.items()},
                       averaging_s={n: a for n, (_, a) in reported.items()})


def test_in_run_compute_scales_each_nodes_layer_times_within_bounds():
    calibration = Calibration(averages_each_step=True)
    assert calibration.corrections == Corrections() and Corrections().scale("a") == 1.0
    # a's layers 0-1 profiled at 0.03 s ran at 0.06 s in the run (2x); c's 2-3 (0.07 s) at 0.035 s (0.5x); b computed
    # nothing. The run's scale, the median of the nodes', counts as one more observation of each, and stands for b.
    calibration.observe(_timings(a=(0.06, 0.0), b=(0.0, 0.0), c=(0.035, 0.0)), PLAN, PROFILES, None,
                        first_of_plan=False)
    corrections = calibration.corrections
    assert corrections.run_scale == pytest.approx(1.25)
    assert corrections.scale("a") == pytest.approx((2.0 + 1.25) / 2)
    assert corrections.scale("c") == pytest.approx((0.5 + 1.25) / 2)
    assert corrections.scale("b") == pytest.approx(1.25) and "b" not in corrections.scales
    # Reports of nonsense move a node's figures no further than the bounds; a median of the recent steps follows
    # what the node does most of the time.
    for _ in range(5):
        calibration.observe(_timings(a=(1e4, 0.0), c=(1e-9, 0.0)), PLAN, PROFILES, None, first_of_plan=False)
    assert calibration.corrections.scales == {"a": SCALE_BOUNDS[1], "c": SCALE_BOUNDS[0]}
    # Timings of another plan epoch (its stages had other layers) are not this plan's.
    calibration.observe(_timings(epoch=2, a=(0.03, 0.0)), PLAN, PROFILES, None, first_of_plan=False)
    assert calibration.corrections.scale("a") == SCALE_BOUNDS[1]


def test_a_plans_first_step_counts_only_until_later_steps_are_measured():
    calibration = Calibration(averages_each_step=True)
    calibration.observe(_timings(a=(0.09, 0.0)), PLAN, PROFILES, None, first_of_plan=True)
    assert calibration.corrections.scale("a") == pytest.approx(3.0)  # nothing else is known yet
    calibration.observe(_timings(a=(0.06, 0.0)), PLAN, PROFILES, None, first_of_plan=False)
    assert calibration.corrections.scale("a") == pytest.approx(2.0)
    calibration.observe(_timings(a=(0.3, 0.0)), PLAN, PROFILES, None, first_of_plan=True)  # the next plan's start
    assert calibration.corrections.scale("a") == pytest.approx(2.0)


def test_averaging_is_measured_beyond_what_the_estimate_priced_per_round():
    calibration = Calibration(averages_each_step=True)
    # Stage 0's replicas averaged in 0.35 s (the slower of them) where the estimate priced 0.05 s for the bytes: one
    # flat round, 0.3 s fixed. The commit took 0.4 s: 0.05 s beyond the slowest averaging.
    first = _timings(commit_s=0.4, a=(0.0, 0.35), b=(0.0, 0.2), c=(0.0, 0.0))
    _observe(calibration, first, _stage(0.05, 1), _stage(0.0, 0))
    assert calibration.corrections.averaging_round_s == pytest.approx(0.3)
    assert calibration.corrections.commit_s == pytest.approx(0.05)
    # Priced with that (0.05 + 0.3), the same step measures the same fixed cost again, not 0.3 on top of it.
    _observe(calibration, first, _stage(0.35, 1), _stage(0.0, 0))
    assert calibration.corrections.averaging_round_s == pytest.approx(0.3)
    # A low-rank stage runs two rounds: its 0.6 s beyond the bytes is 0.3 a round; faster than priced is no cost.
    calibration = Calibration(averages_each_step=True)
    _observe(calibration, _timings(commit_s=0.8, a=(0.0, 0.7), b=(0.0, 0.7)), _stage(0.1, 2), _stage(0, 0))
    assert calibration.corrections.averaging_round_s == pytest.approx(0.3)
    # Averaging happens within the commit phase the coordinator timed: a node that claims longer is held to it.
    calibration = Calibration(averages_each_step=True)
    _observe(calibration, _timings(commit_s=0.4, a=(0.0, 30.0), b=(0.0, 0.2)), _stage(0.05, 1), _stage(0, 0))
    assert calibration.corrections.averaging_round_s == pytest.approx(0.35)
    assert calibration.corrections.commit_s == 0.0
    calibration = Calibration(averages_each_step=True)
    _observe(calibration, _timings(a=(0.0, 0.01), b=(0.0, 0.01)), _stage(0.1, 1), _stage(0, 0))
    assert calibration.corrections.averaging_round_s == 0.0
    # Under diloco a sync's seconds are no step's: the commit is measured, the rounds' cost is not.
    diloco = Calibration(averages_each_step=False)
    _observe(diloco, first, _stage(0.05, 1), _stage(0.0, 0))
    assert diloco.corrections.averaging_round_s == 0.0 and diloco.corrections.commit_s == pytest.approx(0.05)


def _priced_round_trip(seconds: float) -> costmodel.Plan:
    return costmodel.Plan(stages=[], excluded={}, microbatches=4, microbatch_size=1, step_seconds=1.0,
                          samples_per_s=4.0, bottleneck="", compute_bound_samples_per_s=4.0, round_trip_s=seconds)


def _round_trips(microbatches_s=2.0, **heads: float) -> StepTimings:
    return StepTimings(plan_epoch=3, commit_s=0.1, compute_s={}, averaging_s={}, microbatches_s=microbatches_s,
                       round_trip_s=heads)


def test_round_trips_beyond_what_the_estimate_priced_are_a_cost_per_crossing():
    calibration = Calibration(averages_each_step=True)
    # PLAN's two stages: a round trip crosses their boundary twice. The heads a and b measured 0.7 and 0.9 s (the
    # median 0.8) where the estimate priced 0.5 s: 0.15 s a crossing. c serves stage 1 and measures no round trip.
    timings = _round_trips(a=0.7, b=0.9, c=5.0)
    calibration.observe(timings, PLAN, PROFILES, _priced_round_trip(0.5), first_of_plan=False)
    assert calibration.corrections.crossing_s == pytest.approx(0.15)
    # Priced with it (0.5 + 2 * 0.15), the same round trips measure the same cost again, not 0.15 on top of it.
    calibration.observe(timings, PLAN, PROFILES, _priced_round_trip(0.8), first_of_plan=False)
    assert calibration.corrections.crossing_s == pytest.approx(0.15)
    # Faster than priced is no negative cost; a head that measured nothing (0) counts not.
    calibration = Calibration(averages_each_step=True)
    calibration.observe(_round_trips(a=0.2, b=0.0), PLAN, PROFILES, _priced_round_trip(0.5), first_of_plan=False)
    assert calibration.corrections.crossing_s == 0.0
    # A round trip happens inside the microbatch phase the coordinator timed: a head claiming longer is held to it.
    calibration = Calibration(averages_each_step=True)
    calibration.observe(_round_trips(microbatches_s=1.5, a=60.0, b=70.0), PLAN, PROFILES, _priced_round_trip(0.5),
                        first_of_plan=False)
    assert calibration.corrections.crossing_s == pytest.approx((1.5 - 0.5) / 2)
    # Without an estimate, or with one stage (no boundary), nothing is measured.
    calibration = Calibration(averages_each_step=True)
    calibration.observe(timings, PLAN, PROFILES, None, first_of_plan=False)
    one_stage = pb.Plan(epoch=3, stages=[pb.StageAssignment(index=0, layer_start=0, layer_end=4, node_ids=["a"])])
    calibration.observe(timings, one_stage, PROFILES, _priced_round_trip(0.5), first_of_plan=False)
    assert calibration.corrections.crossing_s == 0.0
