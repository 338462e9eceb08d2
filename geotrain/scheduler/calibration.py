"""In-run calibration of the cost model: what committed steps measured corrects the figures that estimates and the
planner start from.

Profiles time each layer alone, while the neighbours start; in the run a stage's tasks also encode and decode
tensors, add float64 gradient sums and share the host with the node's other threads, and the profiles of one node
spread 40% from run to run (bench/plan_vs_real.py). With each step's gradient norm a node reports its stage's
forward + backward seconds per microbatch and the seconds its replica averaging took (GradNormRequest), and the
coordinator times the commit phase itself. Over the last _RECENT committed steps (medians: one slow step moves
little), and only those after a plan's first once there are some (a plan's first step pays for starting it: new
neighbours' connections and probes, fresh buffers; its tasks took up to twice as long as the next steps' on the
bench's loopback runs):
- a node's compute scale: its in-run seconds per microbatch over its profile's seconds for the same layers; estimates
  and the planner read its layer times times the scale, for whatever layers they give it (within SCALE_BOUNDS: a
  node that reports nonsense moves its own figures at most that far). The run's scale (the median of the nodes') counts
  as one more observation of every node, which steadies a replica that computed one or two microbatches a step, and
  stands for a node not measured yet: measured nodes would otherwise look slower than unmeasured ones, and the
  planner would move layers to nodes for no better reason than that;
- the fixed seconds of an all-reduce round: a stage's averaging (its slowest replica) beyond what the cost model
  prices for its bytes, per round, of the stage where that is most (the step waits for the slowest averaging; hivemind's
  matchmaking and message costs: 0.1-0.2 s a round on loopback where the bytes over the probed bandwidth are 0.03 s);
- the commit's fixed seconds: the commit phase (every microbatch done to every gradient norm in) beyond the slowest
  stage's averaging (the commit order, the gradient means and norms, their reports);
- the fixed seconds of a boundary crossing: the data heads' shortest microbatch round trip (the median over the heads)
  beyond what the cost model prices for it, per crossing (2 (S - 1) of them: encoding and decoding, framing, a rate
  limiter's queue). "auto" sizes the window by the round trip, and sized from the priced one alone it kept too few
  microbatches in flight over the namespace WAN of bench/window.py (its docstring has the figures).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import costmodel

SCALE_BOUNDS = (0.25, 4.0)
"""How far in-run compute may move a node's profiled layer times (a factor either way)."""
_RECENT = 5  # committed steps the corrections are medians over


class _Recent:
    """The last _RECENT observations of one quantity, those of a plan's first step apart."""

    def __init__(self) -> None:
        self._after_first: deque[float] = deque(maxlen=_RECENT)
        self._first: deque[float] = deque(maxlen=_RECENT)

    def add(self, value: float, first_of_plan: bool) -> None:
        """Keep an observation of a plan's first step (first_of_plan) or of a later one."""
        (self._first if first_of_plan else self._after_first).append(value)

    def values(self) -> list[float]:
        """The observations after a plan's first step where there are some, else those of first steps."""
        return list(self._after_first or self._first)


@dataclass(frozen=True)
class StepTimings:
    """What one committed step measured: the coordinator's commit phase and the nodes' checked reports."""

    plan_epoch: int
    commit_s: float
    """Every microbatch done to every gradient norm in."""
    compute_s: Mapping[str, float]
    """Node -> its stage's forward + backward seconds per microbatch (0: it computed none)."""
    averaging_s: Mapping[str, float]
    """Node -> the seconds its replica averaging took (0: it averaged with nobody)."""
    microbatches_s: float = 0.0
    """The step's microbatches dispatched to every one done."""
    round_trip_s: Mapping[str, float] = field(default_factory=dict)
    """Data head -> its shortest microbatch round trip of the step (0: not measured)."""
    forward_s: Mapping[str, float] = field(default_factory=dict)
    """Node -> the forward task's part of its compute_s (the rest is its backward task's)."""


@dataclass(frozen=True)
class Corrections:
    """The cost model's inputs as committed steps measured them; no measurement corrects nothing."""

    scales: Mapping[str, float] = field(default_factory=dict)
    """Node -> in-run compute seconds over its profile's."""
    run_scale: float = 1.0
    """The scale of a node not measured yet: the median of the measured ones' (1 before any)."""
    averaging_round_s: float = 0.0
    """Fixed seconds of each all-reduce round (costmodel.StepShape.averaging_round_s)."""
    commit_s: float = 0.0
    """The commit's fixed seconds (costmodel.StepShape.commit_s)."""
    crossing_s: float = 0.0
    """Fixed seconds of each boundary crossing (costmodel.StepShape.crossing_s)."""

    def scale(self, node_id: str) -> float:
        """The factor on node_id's profiled layer times."""
        return self.scales.get(node_id, self.run_scale)


class Calibration:
    """Corrections from the last committed steps of a run."""

    def __init__(self, averages_each_step: bool) -> None:
        # Under diloco replicas sync once every H steps, which the cost model spreads over them: a sync's seconds
        # are no step's, so only gradient averaging (every step) measures the rounds' fixed cost.
        self._averages_each_step = averages_each_step
        self._scales: dict[str, _Recent] = defaultdict(_Recent)
        self._round_s = _Recent()
        self._commit_s = _Recent()
        self._crossing_s = _Recent()
        self.corrections = Corrections()

    def observe(
        self,
        timings: StepTimings,
        plan: pb.Plan,
        profiles: Mapping[str, pb.NodeProfileReport | None],
        estimate: costmodel.Plan | None,
        *,
        first_of_plan: bool,
    ) -> None:
        """Take a committed step's timings under `plan` (its first step: first_of_plan), whose current estimate (made
        with self.corrections) is `estimate`; timings of another plan epoch are ignored."""
        if timings.plan_epoch != plan.epoch:
            return
        lo, hi = SCALE_BOUNDS
        for stage in plan.stages:
            for node_id in stage.node_ids:
                profile, measured = profiles.get(node_id), timings.compute_s.get(node_id, 0.0)
                if profile is None or measured <= 0:
                    continue
                profiled = math.fsum(profile.layer_seconds[stage.layer_start : stage.layer_end])
                self._scales[node_id].add(min(max(measured / profiled, lo), hi), first_of_plan)
        # A node's averaging happens inside the commit phase the coordinator timed itself: a report beyond it is
        # false, and one volunteer's would price every replica of the run out of the plans.
        averaging = [
            min(timings.commit_s, max(timings.averaging_s.get(n, 0.0) for n in s.node_ids)) for s in plan.stages
        ]
        if self._averages_each_step and estimate is not None:
            # The estimate priced each stage's averaging at its bytes plus the rounds' fixed cost as known so far.
            known = self.corrections.averaging_round_s
            per_round = [
                (measured - priced.allreduce_s) / priced.allreduce_rounds + known
                for measured, priced in zip(averaging, estimate.stages)
                if priced.allreduce_rounds and measured > 0
            ]
            if per_round:  # the slowest stage's: the step waits for it
                self._round_s.add(max(0.0, *per_round), first_of_plan)
        self._commit_s.add(max(0.0, timings.commit_s - max(averaging)), first_of_plan)
        # A head's round trip happened inside the microbatch phase the coordinator timed: a report beyond it is false.
        round_trips = [min(timings.microbatches_s, timings.round_trip_s.get(n, 0.0)) for n in plan.stages[0].node_ids]
        round_trips = [r for r in round_trips if r > 0]
        crossings = 2 * (len(plan.stages) - 1)
        if crossings and round_trips and estimate is not None:
            # The estimate priced each crossing with the fixed cost as known so far.
            known = self.corrections.crossing_s
            per_crossing = (statistics.median(round_trips) - estimate.round_trip_s) / crossings + known
            self._crossing_s.add(max(0.0, per_crossing), first_of_plan)
        own = {n: statistics.median(seen.values()) for n, seen in self._scales.items()}
        run_scale = statistics.median(own.values()) if own else 1.0
        rounds, crossing = self._round_s.values(), self._crossing_s.values()
        self.corrections = Corrections(
            scales={n: statistics.median([*seen.values(), run_scale]) for n, seen in self._scales.items()},
            run_scale=run_scale,
            averaging_round_s=statistics.median(rounds) if rounds else 0.0,
            commit_s=statistics.median(self._commit_s.values()),
            crossing_s=statistics.median(crossing) if crossing else 0.0,
        )
