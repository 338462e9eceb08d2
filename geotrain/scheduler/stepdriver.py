"""The step driver: one synchronous training step under a fixed plan (DESIGN.md "One training step").

Microbatch ids go to the data heads (stage-0 replicas) in proportion to their measured speed; each head reports
every microbatch done once its backward has passed through every stage; then the step is committed in two rounds:
every replica averages its stage's gradients with its groupmates and reports their squared norm, so clipping
equals single-process clipping; the decision (clip factor, learning rate) is recorded in SQLite, then every
replica applies the same optimizer step and reports a checksum of its parameters, which replicas must agree on.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import NoReturn

from geotrain.config import LossScale, RunConfig, SchedulerSection
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import placement
from geotrain.scheduler.calibration import StepTimings
from geotrain.scheduler.errors import ReportRefused, RunAborted, StepFailed
from geotrain.scheduler.membership import EventSink, Membership, Scope
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.state import RunStore, StepRecord
from geotrain.scheduler.verification import Check, Verification, cross_check, device_class

log = logging.getLogger(__name__)


class StepPhase(enum.Enum):
    """Where the step in progress stands."""

    IDLE = "idle"  # no step in progress (waiting for nodes, re-planning, or done)
    DISPATCHED = "dispatched"  # microbatch ids sent to the data heads
    MICROBATCHES_DONE = "microbatches_done"  # every microbatch's backward reached stage 0
    NORMS_IN = "norms_in"  # every replica averaged its gradients and reported their norm
    DECIDED = "decided"  # clip factor and learning rate recorded: a restarted coordinator completes the step
    APPLIED = "applied"  # every replica applied the step and reported its checksum
    COMMITTED = "committed"  # the step is in the run's history
    EVALUATING = "evaluating"  # validation after a committed step


# A step past this many times its plan's estimate (unpriced: the recent steps' median) and past the shortest deadline
# a sender gives a call was held by one of its nodes: a neighbour's report of that epoch names it.
_STALL_FACTOR = 4.0
_RECENT_STEPS = 16

# Checksums are hex digests (blake3: 64 characters); anything much longer is not one.
_CHECKSUM_CHARS = 128
_DIGEST_BYTES = 64  # a commitment's digests (blake3, node/verifier.py) are 16 bytes; none is longer than this


def _refuse(node_id: str, why: str) -> NoReturn:
    raise ReportRefused(f"report from {node_id} refused: {why}")


def _check_finite(
    node_id: str, what: str, values: list[float], non_negative: bool = False, overflow: bool = False
) -> None:
    """Refuse NaN, Inf (+Inf too when `overflow` allows it: fp16's overflow) and, if non_negative, negatives."""
    if not all(
        (math.isfinite(v) or (overflow and v == math.inf)) and (v >= 0 or not non_negative) for v in values
    ):
        kind = "finite or +inf" if overflow else "finite"
        _refuse(node_id, f"its {what} is not a {kind}{' non-negative' if non_negative else ''} number")


_LOSS_SCALE_KEY = "loss_scale"


def current_loss_scale(cfg: RunConfig, store: RunStore) -> LossScale:
    """The loss scale of the next step: the last decided step's, or the run's initial one."""
    recorded = store.get(_LOSS_SCALE_KEY)
    return cfg.train.initial_loss_scale() if recorded is None else LossScale(**json.loads(recorded))


def _apply_order(step: int, decided: dict, checks: list[Check] | None = None) -> pb.ApplyStep:
    """The ApplyStep of a decision as recorded in the store, with the step's spot checks."""
    return pb.ApplyStep(
        step=step, clip_coef=decided["clip"], lr=decided["lr"], skip=decided["skip"],
        loss_scale=decided["loss_scale"]["scale"],
        checks=[c.draw() for c in checks or []],
    )


def step_timeout_s(sched: SchedulerSection, estimate_s: float | None) -> float:
    """How long a step may take under a plan estimated at estimate_s (None: not priced): scheduler.step_timeout_factor
    times the estimate, and at least scheduler.step_timeout_s, so that a plan the cost model prices slow is not
    failed by a constant sized for a small model."""
    return max(sched.step_timeout_s, sched.step_timeout_factor * estimate_s if estimate_s else 0.0)


def call_deadline_s(sched: SchedulerSection, estimate_s: float | None) -> float:
    """The longest a tensor call may wait under a plan estimated at estimate_s (Plan.call_deadline_s): past
    _STALL_FACTOR times the estimate (at least framing's floor) its step is judged stalled; half the step timeout at
    most, and without an estimate."""
    cap = step_timeout_s(sched, estimate_s) / 2
    return min(cap, max(framing.CALL_DEADLINE_FLOOR_S, _STALL_FACTOR * estimate_s)) if estimate_s else cap


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
class StepProgress:
    """What the coordinator has heard about the step in progress, and who may tell it what."""

    step: int
    plan_epoch: int = -1
    stages: tuple[frozenset[str], ...] = ()  # the plan's nodes, stage by stage
    issued: dict[int, str] = field(default_factory=dict)  # microbatch id -> the data head it was issued to
    eval_issued: dict[int, str] = field(default_factory=dict)  # validation microbatch id -> its data head
    appliers: frozenset[str] = frozenset()  # the nodes that apply the step
    done: dict[int, tuple[float, list[str]]] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)
    norm_parts: dict[str, list[float]] = field(default_factory=dict)  # each gradient tensor's squared norm
    checksums: dict[str, str] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    compute_s: dict[str, float] = field(default_factory=dict)  # node -> its stage's seconds per microbatch (reported)
    forward_s: dict[str, float] = field(default_factory=dict)  # node -> the forward part of compute_s (reported)
    averaging_s: dict[str, float] = field(default_factory=dict)  # node -> its replica averaging's seconds (reported)
    round_trip_s: dict[str, float] = field(default_factory=dict)  # data head -> its shortest round trip (reported)
    # Verification's commitments (cfg.verifying): node -> microbatch -> its digests; node -> parameters it computed with
    commitments: dict[str, dict[int, pb.MicrobatchCommitment]] = field(default_factory=dict)
    params_before: dict[str, str] = field(default_factory=dict)


class StepDriver:
    """Runs steps: dispatches microbatches, collects reports, decides, and commits."""

    def __init__(
        self, cfg: RunConfig, membership: Membership, orders: OrderQueues, store: RunStore, on_event: EventSink,
        estimate_s: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self._estimate_s = estimate_s  # the current plan's estimated step time (None: not priced yet)
        self.membership = membership
        self.orders = orders
        self.store = store
        self._on_event = on_event
        self.progress = StepProgress(step=-1)
        self.phase = StepPhase.IDLE
        self.timings: StepTimings | None = None  # what the last decided step measured
        self.verification = Verification(cfg.verify.fraction) if cfg.verifying else None
        self._committed: tuple[int, int, dict[int, str]] = (-1, -1, {})  # (plan epoch, step, stage checksums) last
        # The step whose apply is out: its checksums come in while the next step may already run. After its commit,
        # the last committed step's.
        self.applying = self.progress
        self._dispatched: tuple[int, int, float] | None = None  # (plan epoch, step, when) of a step started early
        self._recent_s: deque[float] = deque(maxlen=_RECENT_STEPS)  # the last committed steps' seconds

    def step_timeout_s(self) -> float:
        """How long a step (and each of its phases) may take under the current plan (step_timeout_s)."""
        return step_timeout_s(self.cfg.scheduler, self._estimate_s())

    def _pace(self, plan: pb.Plan) -> tuple[float, float | None]:
        """(fast, slow) for a step of `plan`: under `fast` seconds no honest call of it can have timed out (the
        shortest deadline its senders give, framing's); past `slow` (None: nothing to compare with) it stalled."""
        fast = min(framing.CALL_DEADLINE_FLOOR_S, framing.call_deadline_cap_s(plan))
        reference = self._estimate_s() or (statistics.median(self._recent_s) if self._recent_s else None)
        return fast, max(fast, _STALL_FACTOR * reference) if reference else None

    def _enter(self, phase: StepPhase, step: int) -> None:
        self.phase = phase
        self._on_event("phase", {"step": step, "phase": phase.value})

    def idle(self) -> None:
        """No step is in progress."""
        self.phase = StepPhase.IDLE

    def _begin(self, step: int, plan: pb.Plan, appliers: list[str]) -> None:
        with self.membership.cond:
            stages = tuple(frozenset(s.node_ids) for s in plan.stages)
            self.progress = StepProgress(step=step, plan_epoch=plan.epoch, stages=stages, appliers=frozenset(appliers))

    # -- reports (called from RPC threads) -----------------------------------------------------------------------

    def _current(self, step: int, epoch: int) -> bool:
        """A report belongs to the step in progress under its plan epoch (others are from an abandoned epoch)."""
        return step == self.progress.step and epoch == self.progress.plan_epoch

    def microbatch_done(self, request: pb.MicrobatchDoneRequest) -> None:
        """A data head finished a microbatch's backward; ReportRefused unless it is the head the microbatch was
        issued to and the path runs through one node of each stage of the plan, starting at it."""
        with self.membership.cond:
            progress = self.progress
            if not self._current(request.step, request.plan_epoch):
                return
            head = progress.issued.get(request.microbatch)
            if head != request.node_id:
                _refuse(request.node_id, f"microbatch {request.microbatch} of step {request.step} was not issued to it")
            path = list(request.path)
            if len(path) != len(progress.stages) or path[0] != head or any(
                n not in nodes for n, nodes in zip(path, progress.stages)
            ):
                _refuse(request.node_id, f"microbatch {request.microbatch}'s path {path} does not follow the plan")
            _check_finite(request.node_id, "loss", [request.loss])
            progress.done.setdefault(request.microbatch, (request.loss, path))
            self.membership.cond.notify_all()

    def eval_done(self, request: pb.EvalDoneRequest) -> None:
        """A last stage computed a validation loss; ReportRefused unless it serves the last stage and the
        microbatch was issued for validation."""
        with self.membership.cond:
            progress = self.progress
            if not self._current(request.step, request.plan_epoch):
                return
            if request.microbatch not in progress.eval_issued or request.node_id not in progress.stages[-1]:
                _refuse(request.node_id, f"validation microbatch {request.microbatch} is not its to score")
            _check_finite(request.node_id, "validation loss", [request.loss])
            progress.eval_losses.setdefault(request.microbatch, request.loss)
            self.membership.cond.notify_all()

    def grad_norm(self, request: pb.GradNormRequest) -> None:
        """A stage replica's squared gradient norm for the step being committed, once; ReportRefused from a node
        outside the plan, with a negative or non-finite number, or contradicting its earlier report. Its reports as a
        verifier are taken first: they count whatever step they come with."""
        if request.reports and self.verification is not None:
            self._verified(request)
        with self.membership.cond:
            progress = self.progress
            if not self._current(request.step, request.plan_epoch):
                return
            if request.node_id not in progress.appliers:
                _refuse(request.node_id, f"it serves no stage of plan epoch {request.plan_epoch}")
            parts = list(request.sq_norm_parts)
            _check_finite(
                request.node_id, "squared gradient norm", [request.sq_norm, *parts], non_negative=True,
                overflow=self.cfg.train.precision == "fp16",
            )
            reported = (request.sq_norm, parts)
            earlier = (progress.norms.get(request.node_id), progress.norm_parts.get(request.node_id))
            if earlier[0] is not None and earlier != reported:
                _refuse(request.node_id, f"a second, different gradient norm for step {request.step}")
            # Measurements, not state: bounded by the step timeout (a step that took longer would have failed).
            timeout = self.step_timeout_s()
            measured = (request.compute_s_per_microbatch, request.averaging_s, request.round_trip_s)
            if not all(0 <= v <= timeout for v in measured):
                _refuse(request.node_id, f"its compute, averaging or round trip seconds are not in [0, {timeout:g}]")
            if not 0 <= request.forward_s_per_microbatch <= request.compute_s_per_microbatch:
                _refuse(request.node_id, "its forward seconds are not in [0, its compute seconds]")
            if self.verification is not None:
                self._take_commitments(request)
            progress.norms[request.node_id], progress.norm_parts[request.node_id] = reported
            progress.compute_s[request.node_id] = request.compute_s_per_microbatch
            progress.forward_s[request.node_id] = request.forward_s_per_microbatch
            progress.averaging_s[request.node_id] = request.averaging_s
            progress.round_trip_s[request.node_id] = request.round_trip_s
            self.membership.cond.notify_all()

    def _verified(self, request: pb.GradNormRequest) -> None:
        """A verifier's recomputes of its spot checks, which come with its GradNorm; one that accuses its target goes
        to a second verifier. ReportRefused when they are not its own (Verification.reports)."""
        assert self.verification is not None
        with self.membership.cond:
            disputes = self.verification.reports(request.node_id, request.reports)
        for dispute in disputes:
            self.orders.send([dispute.verifier], pb.Order(verify=dispute.order()))

    def _take_commitments(self, request: pb.GradNormRequest) -> None:
        """Keep a GradNorm's commitments; ReportRefused when malformed (more than one per microbatch, a microbatch
        the step does not have, an oversized digest)."""
        total = self.cfg.train.microbatches
        if len(request.params_before) > _CHECKSUM_CHARS or len(request.commitments) > total:
            _refuse(request.node_id, "its commitments are oversized")
        by_microbatch: dict[int, pb.MicrobatchCommitment] = {}
        for c in request.commitments:
            digests = (c.received, c.sent, c.received_grad, c.sent_grad, c.param_grads)
            if c.microbatch >= total or c.microbatch in by_microbatch or any(len(d) > _DIGEST_BYTES for d in digests):
                _refuse(request.node_id, f"its commitment for microbatch {c.microbatch} is malformed")
            by_microbatch[c.microbatch] = c
        self.progress.commitments[request.node_id] = by_microbatch
        self.progress.params_before[request.node_id] = request.params_before

    def _cross_check(self, plan: pb.Plan) -> None:
        """StepFailed (an offence for each node that may have lied) unless both ends of every hop committed to the
        same tensors and every stage computed with the parameters last committed (under the same plan)."""
        progress, epoch = self.progress, plan.epoch
        with self.membership.cond:
            last_epoch, last_step, checksums = self._committed
            same = last_epoch == epoch and last_step == progress.step - 1
            recorded = {n: checksums[s.index] for s in plan.stages for n in s.node_ids if same and s.index in checksums}
            found = cross_check(
                {mb: path for mb, (_, path) in progress.done.items()}, progress.commitments, progress.params_before,
                recorded,
            )
        if not found:
            return
        assert self.verification is not None
        self.verification.counts.commitments_refused += len(found)
        for d in found:
            log.warning("step %d microbatch %d: %s disagree: %s", progress.step, d.microbatch, "/".join(d.nodes), d.what)
            for n in d.nodes:
                self.membership.offence(n, f"step {progress.step}: {d.what}")
        raise StepFailed(f"commitments of step {progress.step} disagree ({found[0].what}, {len(found)} in all)")

    def _draw_checks(self, step: int, plan: pb.Plan) -> list[Check]:
        """The decided step's spot checks, drawn once every commitment is in (no node can change what it committed)
        and issued: they go out with the apply, to their targets, so that only the drawn microbatches' evidence is kept,
        and to their verifiers, whose orders need no message of their own."""
        assert self.verification is not None
        with self.membership.cond:
            members = self.membership.members
            classes = {n: device_class(members[n]) for n in placement.plan_nodes(plan) if members[n].alive}
            checks = self.verification.draw_checks(
                step, plan, {mb: path for mb, (_, path) in self.progress.done.items()}, self.progress.commitments,
                self.progress.params_before, classes,
            )
            self.verification.issue(checks)
            return checks

    def step_applied(self, request: pb.StepAppliedRequest) -> None:
        """A stage replica applied the step, once; ReportRefused from a node that was not told to apply it, or
        with another checksum than it reported before."""
        with self.membership.cond:
            progress = self.applying
            if request.step != progress.step:
                return
            if request.node_id not in progress.appliers:
                _refuse(request.node_id, f"it was not told to apply step {request.step}")
            if not request.checksum or len(request.checksum) > _CHECKSUM_CHARS:
                _refuse(request.node_id, "the checksum is empty or too long")
            earlier = progress.checksums.setdefault(request.node_id, request.checksum)
            if earlier != request.checksum:
                _refuse(request.node_id, f"a second, different checksum for step {request.step}")
            self.membership.note_applied(request.node_id, request.step + 1)
            self.membership.cond.notify_all()

    # -- driving -------------------------------------------------------------------------------------------------

    def _heads(self, plan: pb.Plan) -> dict[str, float]:
        members = self.membership.members
        return {h: members[h].microbatches_per_s for h in plan.stages[0].node_ids}

    def started(self, step: int, plan: pb.Plan) -> bool:
        """Whether step `step` was dispatched under `plan` as the step before it was applied (run_step's
        next_follows)."""
        return self._dispatched is not None and self._dispatched[:2] == (plan.epoch, step)

    def run_step(self, step: int, plan: pb.Plan, next_follows: Callable[[], bool] = lambda: False) -> StepRecord:
        """Train step `step` under `plan` and commit it; StepFailed if it cannot complete under this plan. Once its
        apply is out (and its timings set), next_follows() says whether step + 1 runs next under the same plan, with
        nothing between them: then step + 1 starts before this step's checksums are in, and the nodes apply this step
        while its first microbatches flow (a node keeps its tensors until it has applied)."""
        early, self._dispatched = self._dispatched, None
        total = self.cfg.train.microbatches
        timeout = self.step_timeout_s()
        nodes = placement.plan_nodes(plan)
        if early is not None and early[:2] == (plan.epoch, step):
            dispatched = t0 = early[2]
        else:
            t0 = time.monotonic()
            self._begin(step, plan, nodes)
            dispatched = self._dispatch(step, plan, nodes)
        fast, slow = self._pace(plan)
        in_step = Scope(plan.epoch, tuple(nodes), t0 + slow if slow is not None else 0.0)
        wait = self.membership.wait
        wait(lambda: len(self.progress.done) == total, f"step {step}'s microbatches", timeout, in_step)
        self._enter(StepPhase.MICROBATCHES_DONE, step)
        commit_started = time.monotonic()

        self.orders.send(nodes, pb.Order(commit=pb.CommitStep(step=step, plan_epoch=plan.epoch)))
        wait(lambda: all(n in self.progress.norms for n in nodes), f"step {step}'s gradient norms", timeout, in_step)
        self._enter(StepPhase.NORMS_IN, step)
        if self.verification is not None:
            self._cross_check(plan)
        self.timings = self._timings(plan, dispatched, commit_started)
        with self.membership.cond:
            applying = self.applying = self.progress
        record, decided = self._decide(step, plan, t0)
        checks = self._draw_checks(step, plan) if self.verification is not None else []
        self.orders.send(nodes, pb.Order(apply=_apply_order(step, decided, checks)))
        if next_follows():
            self._begin(step + 1, plan, nodes)
            self._dispatched = (plan.epoch, step + 1, self._dispatch(step + 1, plan, nodes))
        # The step is decided: a node lost now (dead, or restarted and so without its state) does not undo it; it
        # takes up the committed state with the next plan.
        wait(
            lambda: all(n in applying.checksums or n in self.membership.lost() for n in nodes),
            f"step {step}'s checksums",
            timeout,
        )
        self._enter(StepPhase.APPLIED, step)
        checksums = self._stage_checksums(plan, applying)
        self.store.commit_step(record, checksums)
        # Reports its nodes answered by applying the step: the step's time says whether it stalled or they lied.
        seconds = record.seconds
        verdict = True if slow and seconds > slow else False if seconds < fast else None
        self.membership.judge_reports(plan.epoch, verdict)
        self._recent_s.append(seconds)
        self._committed = (plan.epoch, step, checksums)
        self._enter(StepPhase.COMMITTED, step)
        if self._dispatched is not None:
            self.phase = StepPhase.DISPATCHED  # step + 1's, entered before this step's commit
        return record

    def _dispatch(self, step: int, plan: pb.Plan, nodes: list[str]) -> float:
        """Give the data heads the step's microbatch ids by their speeds; when the orders went out."""
        total = self.cfg.train.microbatches
        if self.verification is not None:
            with self.membership.cond:
                self.verification.planned(step, nodes)
        shares = assign_microbatches(self._heads(plan), total)
        with self.membership.cond:
            self.progress.issued = {mb: head for head, ids in shares.items() for mb in ids}
        dispatched = time.monotonic()  # a head's round trips start once its order is out
        for head, ids in shares.items():
            if ids:
                start = pb.StartStep(step=step, microbatches=ids, total_microbatches=total)
                self.orders.send([head], pb.Order(start_step=start))
        self._enter(StepPhase.DISPATCHED, step)
        return dispatched

    def _timings(self, plan: pb.Plan, dispatched: float, commit_started: float) -> StepTimings:
        """What the step measured, once its norms are in."""
        with self.membership.cond:
            return StepTimings(
                plan_epoch=plan.epoch,
                commit_s=time.monotonic() - commit_started,
                compute_s=dict(self.progress.compute_s),
                forward_s=dict(self.progress.forward_s),
                averaging_s=dict(self.progress.averaging_s),
                microbatches_s=commit_started - dispatched,
                round_trip_s=dict(self.progress.round_trip_s),
            )

    def _decide(self, step: int, plan: pb.Plan, t0: float) -> tuple[StepRecord, dict]:
        """Decide the step (clip factor, learning rate, loss scale) and record the decision; (its record, the
        decision as stored)."""
        # Every tensor's part, added exactly: the same clip factor as train-local's, however stages split the model.
        clip, skip, scale = self.cfg.train.decide(
            (p for s in plan.stages for p in self._stage_norm_parts(s)), current_loss_scale(self.cfg, self.store)
        )
        lr = self.cfg.train.lr_at(step, self.cfg.run.steps)
        losses = [loss for loss, _ in self.progress.done.values()]
        seconds = time.monotonic() - t0
        record = StepRecord(
            step=step,
            loss=sum(losses) / len(losses),
            val_loss=None,
            tokens_per_s=self.cfg.tokens_per_step / seconds,
            seconds=seconds,
            plan_epoch=plan.epoch,
        )
        # Decided before any node applies it: a restarted coordinator completes this step instead of redoing it.
        decided = {"record": asdict(record), "clip": clip, "lr": lr, "skip": skip, "loss_scale": asdict(scale)}
        self.store.put("decided", json.dumps(decided))
        # A decided step is always completed (finish_decided), so the scale of the steps after it is set with it.
        self.store.put(_LOSS_SCALE_KEY, json.dumps(asdict(scale)))
        if skip:
            log.warning("step %d: gradients overflowed in fp16: step skipped, loss scale now %g", step, scale.scale)
        self._enter(StepPhase.DECIDED, step)
        return record, decided

    def _stage_norm_parts(self, stage: pb.StageAssignment) -> list[float]:
        """The squared norm of each of a stage's gradient tensors. Replicas that average their gradients report the
        same parts (StepFailed if not); under diloco each applies its own, and their mean part stands for the
        stage's (every replica is clipped by the one factor the decision sends all)."""
        reported = [self.progress.norm_parts[n] for n in stage.node_ids]
        if not self.cfg.compression.diloco:
            if len({self.progress.norms[n] for n in stage.node_ids}) != 1:
                raise StepFailed(f"replicas of stage {stage.index} disagree on their averaged gradients")
            return reported[0]
        if len({len(parts) for parts in reported}) != 1:
            raise StepFailed(f"replicas of stage {stage.index} report different numbers of gradient tensors")
        return [math.fsum(column) / len(reported) for column in zip(*reported)]

    def finish_decided(self, plan: pb.Plan) -> int | None:
        """After a coordinator restart: complete a step whose decision was recorded but not its commit; returns
        the steps done after it (None when there was none)."""
        decided = self.store.get("decided")
        if decided is None:
            return None
        data = json.loads(decided)
        record = StepRecord(**data["record"])
        step = record.step
        ranges = placement.plan_ranges(plan)
        log.info("completing step %d, decided before the restart", step)

        def holders_at(steps: int) -> list[list[str]]:
            alive = self.membership.alive()
            return [[m.node_id for m in placement.holders(alive, rng, steps)] for rng in ranges]

        self.membership.wait(
            lambda: all(a or b for a, b in zip(holders_at(step), holders_at(step + 1))),
            "the nodes of the decided step to return",
            self.cfg.scheduler.rejoin_timeout_s,
        )
        behind = [n for ns in holders_at(step) for n in ns]
        self._begin(step, plan, behind)
        with self.membership.cond:
            applying = self.applying = self.progress
        self.orders.send(behind, pb.Order(apply=_apply_order(step, data)))
        self.membership.wait(
            lambda: all(n in applying.checksums for n in behind),
            "the decided step's apply",
            self.step_timeout_s(),
        )
        self.store.commit_step(record, {})
        return step + 1

    def _stage_checksums(self, plan: pb.Plan, applied: StepProgress) -> dict[int, str]:
        """Each stage's parameter checksum of the `applied` step; replicas of a stage must agree."""
        result: dict[int, str] = {}
        for stage in plan.stages:
            sums = {applied.checksums[n] for n in stage.node_ids if n in applied.checksums}
            if len(sums) > 1:
                raise RunAborted(f"replicas of stage {stage.index} disagree on their parameters")
            if sums:
                result[stage.index] = sums.pop()
        return result

    def evaluate(self, step: int, plan: pb.Plan) -> float:
        """Validation loss after `step`, over run.eval_microbatches computed by the pipeline."""
        n = self.cfg.run.eval_microbatches
        shares = assign_microbatches(self._heads(plan), n)
        with self.membership.cond:
            self.progress.eval_losses = {}
            self.progress.eval_issued = {mb: head for head, ids in shares.items() for mb in ids}
        self._enter(StepPhase.EVALUATING, step)
        for head, ids in shares.items():
            if ids:
                self.orders.send([head], pb.Order(evaluate=pb.Evaluate(step=step, microbatches=ids)))
        self.membership.wait(
            lambda: len(self.progress.eval_losses) == n,
            "validation",
            self.step_timeout_s(),
            Scope(plan.epoch, tuple(placement.plan_nodes(plan))),
        )
        return sum(self.progress.eval_losses.values()) / n
