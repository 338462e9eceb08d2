"""The coordinator: a facade over the parts that run one training run.

- membership: who registered, their lifecycle, liveness on its own timer (scheduler.membership);
- orders: per-node order queues behind the Orders streams (scheduler.orders);
- placement: pure functions deciding layouts, estimates and state sources (scheduler.placement);
- plan epochs: making and installing the next plan (scheduler.replan);
- the step driver: one synchronous step and its phases (scheduler.stepdriver);
- recovery: checkpoints, snapshots, rollback (scheduler.recovery);
- uploads: state from nodes nobody can dial, which they send when ordered to (scheduler.uploads);
- state sources: a stage's state streamed from a live member, and the final model (scheduler.statesources);
- registration (scheduler.registration); clip flags (scheduler.clipping); token windows (scheduler.windows);
- the run summary (scheduler.summary); the status, rendered a few times a second (scheduler.statuscache);
- status: a function of a read-only snapshot (scheduler.status).

This module holds the run loop that ties them together, and the run's RunState: wait for min_nodes, then for every
step re-plan when the plan no longer fits, run the step, and after each commit validate and checkpoint as configured.
A step that fails (a node died, replicas disagree) bumps the plan epoch, which drops every uncommitted gradient on
every node, and runs again: each (stage, microbatch) is counted exactly once (DESIGN.md "Failure, join, restart").
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from geotrain.config import RunConfig
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.identity import NodeKey
from geotrain.scheduler import costmodel, placement
from geotrain.scheduler.registration import Registration, await_returning
from geotrain.scheduler.checkpoint import CheckpointStore
from geotrain.scheduler.clipping import ClipFlags
from geotrain.scheduler.errors import ReportRefused, RunAborted, StepFailed
from geotrain.scheduler.membership import EventSink, Member, Membership
from geotrain.scheduler.metrics import RunMetrics
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.profiles import check_report
from geotrain.scheduler.reachability import DialedBack
from geotrain.scheduler.recovery import Recovery
from geotrain.scheduler.replan import Planning
from geotrain.scheduler.state import RunStore, StepRecord
from geotrain.scheduler.statesources import StateDialler, StateSources
from geotrain.scheduler.status import StatusSnapshot, render
from geotrain.scheduler.statuscache import StatusCache
from geotrain.scheduler.stepdriver import StepDriver
from geotrain.scheduler.summary import RunSummary, summarize
from geotrain.scheduler.uploads import StateUploads, UploadInbox
from geotrain.scheduler.windows import TokenWindows

__all__ = ["Coordinator", "EventSink", "Member", "RunAborted", "RunState", "RunSummary", "StepFailed"]

log = logging.getLogger(__name__)


class RunState(enum.Enum):
    """Where the run stands; `geotrain status` shows the value."""

    WAITING = "waiting"  # for scheduler.min_nodes nodes to join
    TRAINING = "training"
    RECOVERING = "recovering"  # a step failed: re-planning and running it again until one commits
    DONE = "done"  # every step committed
    PAUSED = "paused"  # the coordinator's own process stopped; its nodes wait for `coordinator --resume`
    ABORTED = "aborted"  # failed, or ended for every node, before its last step


_OVER = (RunState.DONE, RunState.ABORTED)  # registrations are refused: the run is over


class Coordinator:
    """Membership, planning, the step clock and recovery of one run, behind the methods the RPC service calls."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        store: RunStore | None = None,
        checkpoints: CheckpointStore | None = None,
        fetch_state: StateDialler | None = None,
        dht_peers: Callable[[], list[str]] = list,
        run_id: str = "run",
        on_event: EventSink | None = None,
        key: NodeKey | None = None,
        metrics: RunMetrics | None = None,
        pause_on_stop: bool = False,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics  # where each committed step's figures and each failure are written
        # Signs the coordinator's own calls to nodes (state downloads); its public half travels in every plan.
        self.key = key or NodeKey.generate()
        self.tokens = TokenWindows(cfg)  # the prepared data set's windows the nodes fetch
        self.store = store or RunStore()
        self.run_id = run_id
        self._sink = on_event or (lambda kind, data: None)
        self._status = StatusCache(lambda: render(self.snapshot()))  # before any part reports an event
        self.orders = OrderQueues()
        self.membership = Membership(cfg.scheduler, self.store, self.orders, self._on_event)
        self.uploads = StateUploads(self.orders)
        self.sources = StateSources(
            cfg.scheduler, cfg.compression.diloco, self.uploads, fetch_state, self.membership.alive,
            self.membership.cond,
        )
        self.recovery = Recovery(
            checkpoints, self.sources.member_stream if fetch_state is not None else None, self.store, self._on_event,
            cfg.compression.diloco,
        )
        self.planning = Planning(
            cfg, self.membership, self.orders, self.store, self.recovery, self._on_event, dht_peers,
            self.key.public,
        )
        self.driver = StepDriver(
            cfg, self.membership, self.orders, self.store, self._on_event,
            lambda: self.planning.estimate.step_seconds if self.planning.estimate is not None else None,
        )
        self.registration = Registration(
            cfg, run_id, self.membership, lambda: set(placement.plan_nodes(self.plan)), lambda: self.state in _OVER
        )
        self.clips = ClipFlags(
            lambda *event: self.store.event(*event), self.membership.cond, lambda: self.plan, lambda: self.step
        )
        self.step = self.store.committed_steps()
        # Why the run owner ended the run for every node (the Stop RPC); None while nobody has. A stop_requested
        # without it is the coordinator's own process stopping, which pauses a run that can resume (pause_on_stop).
        self.ended_by_owner: str | None = None
        self._pause_on_stop = pause_on_stop
        self.state = RunState.WAITING
        self.failures = 0
        self.recoveries: list[float] = []
        self._recovering_since = 0.0  # when the step that put the run in RECOVERING failed (time.monotonic)

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        """Every part reports what happened here: the status is due for rendering, and the caller's sink hears it."""
        self._status.stale()
        self._sink(kind, data)

    def _set_state(self, state: RunState) -> None:
        self.state = state
        self._status.stale()

    @property
    def members(self) -> dict[str, Member]:
        """Every node that registered, by id (the latest incarnation)."""
        return self.membership.members

    @property
    def plan(self) -> pb.Plan | None:
        """The current plan."""
        return self.planning.plan

    @property
    def estimate(self) -> costmodel.Plan | None:
        """The cost model's view of the current plan."""
        return self.planning.estimate

    @property
    def stop_requested(self) -> threading.Event:
        """Set it to stop the run at the next wait."""
        return self.membership.stop_requested

    # -- membership (called from RPC threads) -------------------------------------------------------------------

    def register(
        self, request: pb.RegisterRequest, signer: bytes | None = None,
        dial_back: Callable[[], DialedBack] | None = None, host: str = "",
    ) -> pb.RegisterReply:
        """Admit a node (new, or returning with the stage it holds), or say why not (Registration.register)."""
        return self.registration.register(request, signer, dial_back, host)

    def screen(self, request: pb.RegisterRequest, signer: bytes | None, host: str) -> pb.RegisterReply | None:
        """The reply refusing a registration before any dial-back, or None when it may be dialled
        (Registration.screen)."""
        return self.registration.screen(request, signer, host)

    def save_model(self, path: Path, steps_done: int, metadata: dict[str, str]) -> None:
        """Write the whole model's parameters after steps_done steps to `path` as live holders stream them
        (StateSources.save_model); LookupError when a stage has no holder, or its holder cannot send it."""
        assert self.plan is not None
        self.sources.save_model(self.plan, path, steps_done, metadata)

    def upload_inbox(self, node_id: str, request: int) -> UploadInbox:
        """Where a member's upload for an UploadState order goes; ReportRefused for one that was not asked of it."""
        inbox = self.uploads.inbox(node_id, request)
        if inbox is None:
            raise ReportRefused(f"no state upload {request} was asked of {node_id}")
        return inbox

    def authorize(self, node_id: str, signer: bytes | None) -> None:
        """Unauthorized unless a call about member `node_id` was signed by its key (Membership.authorize)."""
        self.membership.authorize(node_id, signer)

    def refused(self, sender: str | None, why: str) -> None:
        """A report from `sender` (a member whose key signed it; None: no member's) was refused: it counts against
        the sender, and scheduler.max_offences of them evict it."""
        if sender is not None:
            self.membership.offence(sender, why)

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Note that a node is alive, which plan and state it runs, and what it measured."""
        next_s = self.membership.heartbeat(request)
        return pb.HeartbeatReply(known=next_s is not None, next_heartbeat_s=next_s or 0.0)

    def report_profile(self, request: pb.NodeProfileReport) -> None:
        """Keep a node's latest profile; KeyError for an unknown node, ValueError for a malformed report."""
        check_report(request, self.cfg.model.total_layers)
        self.membership.set_profile(request)
        log.debug("profile of %s: %d link(s)", request.node_id, len(request.links))

    def report_failure(self, request: pb.FailureReport) -> Member | None:
        """A node's calls to a peer fail, a node cannot take part in a plan epoch, or a relay did not deliver
        (FailureReport); a relay's is taken only about a route of the current plan that links the reporter. Returns
        the member to probe (Membership.report_failure), if any; ReportRefused from a member no plan ever used."""
        if not request.relayed_to:
            return self.membership.report_failure(request, self.plan)
        plan = self.plan
        ends = {request.node_id, request.relayed_to}
        if plan is None or request.plan_epoch != plan.epoch or not any(
            r.relay_id == request.peer and {r.a, r.b} == ends for r in plan.relays
        ):
            log.debug("relay failure report of %s about %s ignored: no route of the current plan", request.node_id,
                      request.peer)
            return None
        return self.membership.relay_failed(request)

    def order_stream(self, node_id: str) -> AsyncIterator[pb.Order]:
        """The orders for one node while its stream is open (on the server loop); KeyError for an unknown one."""
        return self.orders.stream(node_id)

    # -- reports (called from RPC threads) ----------------------------------------------------------------------

    def microbatch_done(self, request: pb.MicrobatchDoneRequest) -> None:
        """A data head finished a microbatch's backward."""
        self.driver.microbatch_done(request)

    def eval_done(self, request: pb.EvalDoneRequest) -> None:
        """A last stage computed a validation loss."""
        self.driver.eval_done(request)

    def grad_norm(self, request: pb.GradNormRequest) -> None:
        """A stage replica's squared gradient norm for the step being committed (and its reports as a verifier)."""
        self.driver.grad_norm(request)
        if request.reports:
            self._status.stale()

    def note_clipped(self, request: pb.GradNormRequest) -> None:
        """A replica's report of the peers whose gradient CenteredClip clipped in the step in progress (ClipFlags)."""
        if self.clips.note(request):
            self._status.stale()

    def step_applied(self, request: pb.StepAppliedRequest) -> None:
        """A stage replica applied the step."""
        self.driver.step_applied(request)

    def load_ordered(self, key: bytes | None, layer_start: int, layer_end: int, steps_done: int) -> bool:
        """Whether a member of `key` was ordered in the current plan epoch to load these layers after steps_done
        steps from the coordinator (Membership.load_ordered): FetchCheckpoint serves nobody else."""
        return self.membership.load_ordered(key, self.plan, (layer_start, layer_end), steps_done)

    def checkpoint_state(self, layer_start: int, layer_end: int, steps_done: int) -> Iterator[pb.TensorChunk] | None:
        """The chunks of the parameters and optimizer state of a layer range at steps_done: from the checkpoint, read
        from its files as they are sent, else passed on as a live holder nobody can dial uploads them (a node told to
        load its state from such a holder fetches it here; it checks what it gets); None if neither."""
        sources = self.recovery.checkpoint_state(layer_start, layer_end, steps_done)
        if sources is not None:
            return framing.state_stream(sources)
        return self.sources.from_undialable((layer_start, layer_end), steps_done)

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Wait for min_nodes, plan, then train every step, recovering from failures; returns the summary."""
        done = threading.Event()
        self.membership.run_liveness(done, lambda: set(placement.plan_nodes(self.plan)))
        try:
            return self._train()
        except RunAborted as e:
            paused = self._pause_on_stop and self.stop_requested.is_set() and self.ended_by_owner is None
            self._set_state(RunState.PAUSED if paused else RunState.ABORTED)
            self.store.event("aborted", detail=str(e))
            raise
        finally:
            done.set()
            self.driver.idle()

    def _train(self) -> RunSummary:
        started = time.monotonic()
        need = self.cfg.scheduler.min_nodes
        log.info("waiting for %d node(s)", need)
        self.membership.wait(lambda: len(self.membership.alive()) >= need, f"{need} nodes to join", float("inf"))
        self._set_state(RunState.TRAINING)
        if self.cfg.compression.inexact_replicas:
            log.warning("%s", self.cfg.compression.inexact_replicas)
        if self.plan is not None:
            await_returning(
                self.membership, set(placement.plan_nodes(self.plan)), self.cfg.scheduler.heartbeat_timeout_s
            )
            self.step = self.driver.finish_decided(self.plan) or self.step
        first_step = self.step
        while self.step < self.cfg.run.steps:
            try:
                self._settle_verdicts()
                # A step started while the last one was applied runs under its plan: one that lost a node fails at
                # once and is redone under the next plan; one a spare could now join goes on, and the plan grows after.
                if not self.planning.is_current() and not self.driver.started(self.step, self.plan):
                    self.driver.idle()
                    self.step = self.planning.replan(self.step)
                    # What came in while the nodes took the plan up (a profile, a death) is checked before its first
                    # step as before every other.
                    continue
                record = self.driver.run_step(self.step, self.plan, self._next_follows)
            except StepFailed as e:
                self._note_failure(str(e))
                continue
            self._committed(record)
        if self.recovery.checkpoint_due(self.step):
            self.recovery.checkpoint(self.plan, self.step, self.membership.alive())
        self._set_state(RunState.DONE)
        with self.membership.cond:
            alive, members = self.membership.alive(), list(self.membership.members.values())
        return summarize(
            self.store.steps(), first_step, self.step, self.cfg.tokens_per_step, time.monotonic() - started,
            alive=alive, members=members, plan=self.plan,
            estimated_step_s=self.estimate.step_seconds if self.estimate is not None else None,
            bits_per_byte=self.bits_per_byte,
        )

    def _committed(self, record: StepRecord) -> None:
        """Step self.step committed: out of RECOVERING, then what is due after it, its metrics and its event."""
        if self.state is RunState.RECOVERING:
            self.recoveries.append(time.monotonic() - self._recovering_since)
            self._set_state(RunState.TRAINING)
        self.step += 1
        record = self._after_commit(record)
        bits = None if record.val_loss is None else self.bits_per_byte(record.val_loss)
        if self.metrics is not None:
            with self.membership.cond:  # (sender, receiver) -> the wire bytes its last heartbeat counted
                links = {(m.node_id, link.peer): link.wire_bytes for m in self.membership.alive() for link in m.links}
            through = Counter(n for _, path in self.driver.applying.done.values() for n in path)  # node -> microbatches
            self.metrics.step(record, self.driver.timings, through, links, bits)
        self._on_event("step", {"record": record, "of": self.cfg.run.steps, "val_bits_per_byte": bits})

    def _settle_verdicts(self) -> None:
        """Evict each node a settled dispute found wrong (its key refused from then on) and roll the run back to the
        newest checkpoint at or before the first step it was planned on: every step it touched is redone without it."""
        verification = self.driver.verification
        if verification is None:
            return
        with self.membership.cond:
            verdicts = verification.take_verdicts()
            first = {v.guilty: verification.first_planned.get(v.guilty, 0) for v in verdicts}
        for v in verdicts:
            member = self.members.get(v.guilty)
            if member is None or not member.alive:
                continue
            log.warning("verification: %s computed wrong or accused falsely: %s", v.guilty, v.why)
            self.store.event("verdict", v.guilty, v.why)
            for _ in range(self.cfg.scheduler.max_offences):
                if self.membership.offence(v.guilty, v.why):
                    break
            verification.counts.evicted += 1
            latest = self.recovery.checkpoints.latest(at_most=first[v.guilty]) if self.recovery.checkpoints else None
            back_to = latest.steps_done if latest is not None else 0
            if back_to < self.step:
                log.warning("rolling back from step %d to step %d, before %s's first step", self.step, back_to,
                            v.guilty)
                self.store.event("rollback", v.guilty, f"from step {self.step} to step {back_to}")
                self._on_event("rollback", {"from": self.step, "to": back_to, "node_id": v.guilty})
                self.store.rollback_to(back_to)
                self.step = back_to
            self.planning.dirty = True

    def _note_failure(self, why: str) -> None:
        self.planning.dirty = True  # a new epoch drops whatever the failed step left half-done
        self.failures += 1
        if self.state is not RunState.RECOVERING:
            self._recovering_since = time.monotonic()
            self._set_state(RunState.RECOVERING)
        log.warning("step %d failed (%s); re-planning", self.step, why)
        self.store.event("failure", detail=f"step {self.step}: {why}")
        if self.metrics is not None:
            self.metrics.failure(self.step, why)
        self._on_event("failure", {"step": self.step, "why": why})

    def _next_follows(self) -> bool:
        """Called once step self.step is decided and its apply is out: whether the next step runs under this plan
        with nothing due between them (validation, a checkpoint, a re-plan, a verdict, the run's end), so that it may
        start while the nodes apply this one. (A re-plan that this step's timings call for comes a step later.)"""
        done = self.step + 1  # steps done once this one commits
        validation, checkpoints = self.cfg.run.eval_every, self.cfg.scheduler.checkpoint_every
        verification = self.driver.verification
        return (
            done < self.cfg.run.steps
            and not (validation and done % validation == 0)
            and not (self.recovery.checkpoints is not None and checkpoints and done % checkpoints == 0)
            and not (verification is not None and verification.verdicts)
            and not self.stop_requested.is_set()
            and self.planning.is_current()
        )

    def _after_commit(self, record: StepRecord) -> StepRecord:
        """The plan's estimate corrected by what the step measured; validation and checkpoints due after it."""
        assert self.driver.timings is not None  # the committed step's
        self.planning.after_commit(self.driver.timings)
        last = self.step == self.cfg.run.steps
        every = self.cfg.run.eval_every
        if last or (every and self.step % every == 0):
            try:
                val_loss = self.driver.evaluate(record.step, self.plan)
            except StepFailed as e:
                log.warning("validation after step %d skipped: %s", record.step, e)
            else:
                self.store.set_val_loss(record.step, val_loss)
                record = replace(record, val_loss=val_loss)
        every = self.cfg.scheduler.checkpoint_every
        if self.recovery.checkpoints is not None and every and self.step % every == 0:
            self.recovery.start_checkpoint(self.plan, self.step, self.membership.alive())
        return record

    # -- data (called from RPC threads) -------------------------------------------------------------------------

    def windows(self, request: pb.WindowsRequest) -> pb.WindowsReply:
        """A microbatch's token windows from the prepared data set (TokenWindows.serve); ReportRefused also for a
        caller that is no live member."""
        with self.membership.cond:
            member = self.members.get(request.node_id)
            if member is None or not member.alive:
                raise ReportRefused(f"windows for {request.node_id!r} refused: not a live member of the run")
        return self.tokens.serve(request)

    def bits_per_byte(self, loss: float) -> float:
        """A validation loss (nats per token) as bits per byte of the validation text."""
        return self.tokens.bits_per_byte(loss)

    # -- status and shutdown --------------------------------------------------------------------------------------

    def snapshot(self) -> StatusSnapshot:
        """The run as it stands, copied out for the status."""
        verification = self.driver.verification
        with self.membership.cond:
            members = tuple(replace(m) for m in self.members.values())
            verify = verification.counts.as_proto() if verification is not None else None
        return StatusSnapshot(
            state=self.state.value,
            phase=self.driver.phase.value,
            steps=self.cfg.run.steps,
            failures=self.failures,
            recoveries=tuple(self.recoveries),
            history=tuple(self.store.steps()),
            members=members,
            plan=self.plan,
            estimate=self.estimate,
            events=tuple(self.store.events()),
            now=time.monotonic(),
            bits_per_byte=self.bits_per_byte,
            exactness=self.cfg.compression.inexact_replicas,
            verify=verify,
        )

    def status(self) -> pb.StatusReply:
        """The run's status for `geotrain status`, the status page and /metrics (do not modify it: it is shared),
        rendered a few times a second at most (StatusCache)."""
        return self._status.get()

    def end_run(self, reason: str) -> None:
        """The run owner ends the run for every node: the run loop stops at its next wait."""
        log.warning("the run owner ends the run: %s", reason)
        self.store.event("stopped", detail=reason)
        self.ended_by_owner = reason
        self.stop_requested.set()

    def shutdown_nodes(self, reason: str, grace_s: float = 3.0, *, aborted: bool = False) -> None:
        """Tell every live node the run is over (aborted: failed or stopped, so nodes exit non-zero) and give their
        order streams a moment to deliver it."""
        with self.membership.cond:
            if self.state not in _OVER:  # ended before its last step: from now on registrations are refused
                self._set_state(RunState.ABORTED)
            alive = [m.node_id for m in self.membership.alive()]
        self.orders.broadcast_shutdown(alive, pb.Shutdown(reason=reason, aborted=aborted), grace_s)
