"""The coordinator: a facade over the parts that run one training run.

- membership: who registered, their lifecycle, liveness on its own timer (scheduler.membership);
- orders: per-node order queues behind the Orders streams (scheduler.orders);
- placement: pure functions deciding layouts, estimates and state sources (scheduler.placement);
- plan epochs: making and installing the next plan (scheduler.replan);
- the step driver: one synchronous step and its phases (scheduler.stepdriver);
- recovery: checkpoints, snapshots, rollback (scheduler.recovery);
- uploads: state from nodes nobody can dial, which they send when ordered to (scheduler.uploads);
- status: a function of a read-only snapshot (scheduler.status).

This module holds the run loop that ties them together: wait for min_nodes, then for every step re-plan when the
plan no longer fits, run the step, and after each commit validate and checkpoint as configured. A step that fails
(a node died, replicas disagree) bumps the plan epoch, which drops every uncommitted gradient on every node, and
runs again: each (stage, microbatch) is counted exactly once (DESIGN.md "Failure, join, restart").
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import Counter
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from geotrain import __version__
from geotrain.config import RunConfig, to_proto
from geotrain.dataset import PreparedDataset, bits_per_byte
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import FrameError
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.probe import COORDINATOR_PEER
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler import costmodel, placement
from geotrain.scheduler.checkpoint import CheckpointStore, ModelFileWriter
from geotrain.scheduler.errors import ReportRefused, RunAborted, StepFailed
from geotrain.scheduler.membership import EventSink, Member, Membership, Rejected
from geotrain.scheduler.metrics import RunMetrics
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.profiles import check_report
from geotrain.scheduler.reachability import DialedBack
from geotrain.scheduler.recovery import Recovery, stage_bound
from geotrain.scheduler.replan import Planning
from geotrain.scheduler.state import RunStore, StepRecord
from geotrain.scheduler.status import StatusSnapshot, render
from geotrain.scheduler.stepdriver import StepDriver
from geotrain.scheduler.uploads import StateUploads, UploadInbox

__all__ = ["Coordinator", "EventSink", "Member", "RunAborted", "RunSummary", "StepFailed"]

log = logging.getLogger(__name__)

# How stale the status may be between events: heartbeat ages and link counters move without one.
_STATUS_MAX_AGE_S = 0.5
# After an event the status is rendered again once the last rendering is this old: a fast run has dozens of events a
# second, and a rendering reads every step's history from SQLite (3,000 status-page requests once slowed a run 4x).
_STATUS_MIN_AGE_S = 0.2


@dataclass
class RunSummary:
    """What a finished run reports (the --json line)."""

    steps: int
    loss_first: float
    loss_last: float
    val_loss: float | None
    val_bits_per_byte: float | None  # val_loss per byte of validation text, in bits: byte and BPE runs compare
    tokens_per_s: float
    wall_s: float
    nodes: int
    stages: int
    validation: list[tuple[int, float, float]]
    """Each validation pass: (steps done, val_loss, training seconds to then: the committed steps' own times)."""
    wire_bytes: int
    """Activation and gradient bytes the nodes sent their neighbours on the wire (their last heartbeats' counters)."""
    raw_bytes: int
    """The same tensors' bytes before compression."""
    stream_bytes: int
    """Of wire_bytes, those raw tensor streams carried, as the senders counted them; the rest went by gRPC calls."""
    estimated_step_s: float | None  # the cost model's step time for the last plan (None: no profiles to price it)
    relayed_bytes: int  # payload bytes the nodes forwarded as relays for links whose two ends nobody can dial
    averaging_bytes: int  # replica-averaging bytes the nodes sent (their last heartbeats' counters)
    peak_memory_bytes: int  # the most memory one node held (its last heartbeat's peak)
    inflight: int  # the last plan's window per data head (train.inflight, or the plan's own under "auto")

    def as_dict(self) -> dict[str, Any]:
        """The summary as a JSON-ready dict."""
        return asdict(self)


class Coordinator:
    """Membership, planning, the step clock and recovery of one run, behind the methods the RPC service calls."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        store: RunStore | None = None,
        checkpoints: CheckpointStore | None = None,
        fetch_state: Callable[[str, int, float], Iterator[pb.TensorChunk]] | None = None,
        dht_peers: Callable[[], list[str]] = list,
        run_id: str = "run",
        on_event: EventSink | None = None,
        key: NodeKey | None = None,
        metrics: RunMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics  # where each committed step's figures and each failure are written
        # Signs the coordinator's own calls to nodes (state downloads); its public half travels in every plan.
        self.key = key or NodeKey.generate()
        # The prepared data set whose windows the nodes fetch (Windows); None: every node reads the byte corpus.
        self.dataset = PreparedDataset.open(cfg.data.prepared) if cfg.data.prepared else None
        self.store = store or RunStore()
        self.run_id = run_id
        self._sink = on_event or (lambda kind, data: None)
        self.orders = OrderQueues()
        self.membership = Membership(cfg.scheduler, self.store, self.orders, self._on_event)
        self.uploads = StateUploads(self.orders)
        # (address, steps_done, deadline seconds) -> the chunks of the state of the stage the node there serves
        self._dial_state = fetch_state
        self.recovery = Recovery(
            checkpoints, self.member_stream if fetch_state is not None else None, self.store, self._on_event,
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
        self._status_lock = threading.Lock()
        self._status: pb.StatusReply | None = None  # see status()
        self._status_at = float("-inf")
        self._status_stale = False  # an event since it was rendered
        self.step = self.store.committed_steps()
        self.finished = False
        # Why the run owner ended the run for every node (the Stop RPC); None while nobody has. A stop_requested
        # without it is the coordinator's own process stopping, which only pauses the run.
        self.ended_by_owner: str | None = None
        self.state = "waiting"
        self.failures = 0
        self.recoveries: list[float] = []
        self._failed_at: float | None = None
        self._clipped_step = -1  # the step _clipped holds the members flagged in (replica_robust)
        self._clipped: set[str] = set()
        self._clip_reports: dict[str, set[str]] = {}  # in _clipped_step: member -> the replicas that clipped it

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        """Every part reports what happened here: the status is due for rendering, and the caller's sink hears it."""
        self._status_stale = True
        self._sink(kind, data)

    def _set_state(self, state: str) -> None:
        self.state = state
        self._status_stale = True

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
        self, request: pb.RegisterRequest, signer: bytes | None = None, dial_back: Callable[[], DialedBack] | None = None,
        host: str = "",
    ) -> pb.RegisterReply:
        """Admit a node (new, or returning with the stage it holds), or say why not. `signer`: the key that signed
        the call (the RPC service passes it, b"" for an unsigned call), which must be the key the request carries;
        None in-process, where the request's key is taken as it is. `dial_back`: dials the node and says what it
        found (the RPC service's; None in-process: not dialled), called only for a request that passed every check
        (a token holder cannot make the coordinator dial for a refused one) and kept with the member from its first
        moment, so that no plan counts it before its reachability is known. `host`: the caller's IP (the limits on
        new ids and spares per host; "": in process, none)."""
        refusal = self._refusal(request, signer)
        if refusal is not None:
            return refusal
        try:
            member = self.membership.admit(request, set(placement.plan_nodes(self.plan)), dial_back, host)
        except Rejected as e:
            return pb.RegisterReply(accepted=False, reason=e.reason, message=str(e))
        reply = pb.RegisterReply(
            accepted=True,
            node_id=member.node_id,
            config=to_proto(self.cfg),
            heartbeat_interval_s=self.cfg.scheduler.heartbeat_interval_s,
            run_id=self.run_id,
        )
        if member.reachability:  # dialled: the address that answered is the member's
            reply.reachability = pb.REACHABILITY_UNREACHABLE if member.unreachable else pb.REACHABILITY_DIRECT
            reply.reachable_at = "" if member.unreachable else member.address
        return reply

    def screen(self, request: pb.RegisterRequest, signer: bytes | None, host: str) -> pb.RegisterReply | None:
        """The reply refusing a registration from `host` before any dial-back (register's own checks, and
        Membership.screen's: room, the host's pace of new ids), or None when it may be dialled."""
        refusal = self._refusal(request, signer)
        if refusal is not None:
            return refusal
        try:
            self.membership.screen(request, host)
        except Rejected as e:
            return pb.RegisterReply(accepted=False, reason=e.reason, message=str(e))
        return None

    def _refusal(self, request: pb.RegisterRequest, signer: bytes | None) -> pb.RegisterReply | None:
        if request.protocol_version != PROTOCOL_VERSION:
            return pb.RegisterReply(
                accepted=False,
                reason=pb.REJECT_REASON_PROTOCOL_VERSION,
                message=f"coordinator speaks protocol {PROTOCOL_VERSION} (geotrain {__version__}), "
                f"node speaks {request.protocol_version}",
            )
        if self.finished:
            return pb.RegisterReply(accepted=False, reason=pb.REJECT_REASON_RUN_FINISHED, message="the run is over")
        if signer is not None and (not signer or signer != request.public_key):
            return pb.RegisterReply(
                accepted=False,
                reason=pb.REJECT_REASON_IDENTITY,
                message="a registration must carry the node's public key and be signed with it",
            )
        return None

    def member_stream(self, member: Member, layers: tuple[int, int], steps_done: int) -> Iterator[pb.TensorChunk]:
        """The chunks of the state of `layers` after steps_done steps from a member that holds them, as they arrive:
        downloaded by dialling it, or uploaded by it when nobody can dial it; within a deadline for its bytes over
        its measured link to the coordinator."""
        deadline = self._state_deadline_s(member, layers)
        if member.unreachable:
            return self.uploads.stream(member.node_id, steps_done, layers, deadline)
        assert self._dial_state is not None
        return self._dial_state(member.address, steps_done, deadline)

    def _state_deadline_s(self, member: Member, layers: tuple[int, int]) -> float:
        """How long the state of `layers` may take to come from `member`: its bytes (the plan's bound) over the
        member's measured link to the coordinator, or over scheduler.state_link_mbps where none was measured."""
        sched = self.cfg.scheduler
        bound = stage_bound(member, layers, self.cfg.compression.diloco)
        links = member.profile.links if member.profile is not None else []
        measured = [link.bandwidth_bps for link in links if link.peer == COORDINATOR_PEER and link.bandwidth_bps > 0]
        bits_per_s = measured[0] if measured else sched.state_link_mbps * 1e6
        return framing.state_deadline_s(bound.total_bytes if bound else 0, bits_per_s / 8, sched.state_deadline_floor_s)

    def save_model(self, path: Path, steps_done: int, metadata: dict[str, str]) -> None:
        """Write the whole model's parameters after steps_done steps to `path` (safetensors, `metadata` in its header)
        as a live holder of each stage streams them: the coordinator holds a chunk of it at a time, never the model.
        LookupError when a stage has no holder, or its holder cannot send it; nothing is left at `path` then."""
        assert self.plan is not None
        total = self.plan.stages[-1].layer_end
        partial = path.with_name(path.name + ".partial")
        writer: ModelFileWriter | None = None
        try:
            for s in self.plan.stages:
                layers = (s.layer_start, s.layer_end)
                have = placement.holders(self.membership.alive(), layers, steps_done)
                if not have:
                    raise LookupError(f"no live node holds stage {s.index} after {steps_done} steps")
                if writer is None:
                    writer = ModelFileWriter(partial, total, metadata, stage_bound(have[0], (0, total), False))
                try:
                    framing.receive_state(self.member_stream(have[0], layers, steps_done), writer)
                except FrameError as e:
                    raise LookupError(f"{have[0].node_id} sent malformed state: {e}") from None
            assert writer is not None
            writer.finish()
            os.replace(partial, path)
        except BaseException:
            if writer is not None:
                writer.close()
            partial.unlink(missing_ok=True)
            raise

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
        """The orders for one node, as long as its stream is open (iterated on the server's event loop); KeyError
        for an unknown node."""
        return self.orders.stream(node_id)

    # -- reports (called from RPC threads) ----------------------------------------------------------------------

    def microbatch_done(self, request: pb.MicrobatchDoneRequest) -> None:
        """A data head finished a microbatch's backward."""
        self.driver.microbatch_done(request)

    def eval_done(self, request: pb.EvalDoneRequest) -> None:
        """A last stage computed a validation loss."""
        self.driver.eval_done(request)

    def grad_norm(self, request: pb.GradNormRequest) -> None:
        """A stage replica's squared gradient norm for the step being committed."""
        self.driver.grad_norm(request)

    def note_clipped(self, request: pb.GradNormRequest) -> None:
        """An event (and a warning) for each replica of the reporter's stage whose gradient CenteredClip clipped in
        the step in progress, once, when the flag is consistent: raised by its own reduction, or by a strict
        majority of the stage's replicas. So one member's report cannot flag an honest peer; with two replicas
        neither can flag the other (which of two gradients is the outlier, nothing tells). Peer ids outside the
        stage, and reports about another step, are ignored."""
        with self.membership.cond:
            plan = self.plan
            stage = next((s for s in plan.stages if request.node_id in s.node_ids), None) if plan else None
            if stage is None or request.step != self.step:
                return
            if request.step != self._clipped_step:
                self._clipped_step, self._clipped, self._clip_reports = request.step, set(), {}
            by_peer = dict(zip(stage.peer_ids, stage.node_ids))
            fresh: list[tuple[str, list[str]]] = []
            for node_id in sorted({by_peer[p] for p in request.clipped_peers if p in by_peer}):
                reporters = self._clip_reports.setdefault(node_id, set())
                reporters.add(request.node_id)
                if node_id not in self._clipped and (node_id in reporters or 2 * len(reporters) > len(stage.node_ids)):
                    self._clipped.add(node_id)
                    fresh.append((node_id, sorted(reporters)))
        for node_id, reporters in fresh:
            why = f"step {request.step}: CenteredClip clipped its gradient (seen by {', '.join(reporters)})"
            log.warning("replica %s sent an outlying gradient: %s", node_id, why)
            self.store.event("clipped", node_id, why)
        if fresh:
            self._status_stale = True

    def step_applied(self, request: pb.StepAppliedRequest) -> None:
        """A stage replica applied the step."""
        self.driver.step_applied(request)

    def load_ordered(self, key: bytes | None, layer_start: int, layer_end: int, steps_done: int) -> bool:
        """Whether a member of `key` was ordered in the current plan epoch to load these layers after steps_done
        steps from the coordinator (Membership.load_ordered): FetchCheckpoint serves nobody else."""
        return self.membership.load_ordered(key, self.plan, (layer_start, layer_end), steps_done)

    def verified(self, request: pb.VerifyReport) -> None:
        """A verifier's recompute of a spot check; a recompute that accuses its target goes to a second verifier."""
        verification = self.driver.verification
        if verification is None:
            raise ReportRefused(f"verify report from {request.node_id} refused: this run verifies nothing")
        with self.membership.cond:
            dispute = verification.report(request)
        if dispute is not None:
            self.orders.send([dispute.verifier], pb.Order(verify=dispute.order()))
        self._status_stale = True

    def checkpoint_state(self, layer_start: int, layer_end: int, steps_done: int) -> Iterator[pb.TensorChunk] | None:
        """The chunks of the parameters and optimizer state of a layer range at steps_done: from the checkpoint, read
        from its files as they are sent, else passed on as a live holder nobody can dial uploads them (a node told to
        load its state from such a holder fetches it here; it checks what it gets); None if neither."""
        sources = self.recovery.checkpoint_state(layer_start, layer_end, steps_done)
        if sources is not None:
            return framing.state_stream(sources)
        layers = (layer_start, layer_end)
        with self.membership.cond:
            undialable = [m for m in placement.holders(self.membership.alive(), layers, steps_done) if m.unreachable]
        if not undialable:
            return None
        chunks = self.member_stream(undialable[0], layers, steps_done)
        try:
            return itertools.chain([next(chunks)], chunks)
        except (LookupError, StopIteration) as e:
            log.warning("layers [%d, %d) after %d steps: %s", layer_start, layer_end, steps_done, e)
            return None

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Wait for min_nodes, plan, then train every step, recovering from failures; returns the summary."""
        done = threading.Event()
        self.membership.run_liveness(done, lambda: set(placement.plan_nodes(self.plan)))
        try:
            return self._train()
        except RunAborted as e:
            self._set_state("aborted")
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
        self._set_state("training")
        if self.cfg.compression.inexact_replicas:
            log.warning("%s", self.cfg.compression.inexact_replicas)
        if self.plan is not None:
            self._await_returning_nodes()
            self.step = self.driver.finish_decided(self.plan) or self.step
        first_step = self.step
        while self.step < self.cfg.run.steps:
            try:
                self._settle_verdicts()
                if not self.planning.is_current():
                    self.driver.idle()
                    self.step = self.planning.replan(self.step)
                    # What came in while the nodes took the plan up (a profile, a death) is checked before its first
                    # step as before every other.
                    continue
                record = self.driver.run_step(self.step, self.plan)
            except StepFailed as e:
                self._note_failure(str(e))
                continue
            if self._failed_at is not None:
                self.recoveries.append(time.monotonic() - self._failed_at)
                self._failed_at = None
            self.step += 1
            record = self._after_commit(record)
            bits = None if record.val_loss is None else self.bits_per_byte(record.val_loss)
            if self.metrics is not None:
                self.metrics.step(record, self.driver.timings, self._microbatches_through(), self._link_bytes(), bits)
            self._on_event("step", {"record": record, "of": self.cfg.run.steps, "val_bits_per_byte": bits})
        if self.recovery.checkpoint_due(self.step):
            self.recovery.checkpoint(self.plan, self.step, self.membership.alive())
        self._set_state("done")
        history = self.store.steps()
        train_s = sum(r.seconds for r in history if r.step >= first_step)
        vals = [r.val_loss for r in history if r.val_loss is not None]
        trained_s = list(itertools.accumulate(r.seconds for r in history))
        with self.membership.cond:
            links = [link for m in self.membership.alive() for link in m.links]
        return RunSummary(
            steps=len(history),
            loss_first=history[0].loss,
            loss_last=history[-1].loss,
            val_loss=vals[-1] if vals else None,
            val_bits_per_byte=self.bits_per_byte(vals[-1]) if vals else None,
            tokens_per_s=self.cfg.tokens_per_step * (self.step - first_step) / train_s if train_s else 0.0,
            wall_s=time.monotonic() - started,
            nodes=len(self.membership.alive()),
            stages=len(self.plan.stages) if self.plan else 0,
            validation=[(r.step + 1, r.val_loss, s) for r, s in zip(history, trained_s) if r.val_loss is not None],
            wire_bytes=sum(link.wire_bytes for link in links),
            raw_bytes=sum(link.raw_bytes for link in links),
            stream_bytes=sum(min(link.stream_bytes, link.wire_bytes) for link in links),  # a node's word, bounded
            estimated_step_s=self.planning.estimate.step_seconds if self.planning.estimate is not None else None,
            relayed_bytes=sum(m.relayed_bytes for m in self.membership.members.values()),
            averaging_bytes=sum(m.averaging_bytes_sent for m in self.membership.members.values()),
            peak_memory_bytes=max((m.peak_memory_bytes for m in self.membership.members.values()), default=0),
            inflight=self.plan.inflight if self.plan else 0,
        )

    def _microbatches_through(self) -> Counter[str]:
        """Node -> the microbatches of the step just committed whose path went through it."""
        return Counter(n for _, path in self.driver.progress.done.values() for n in path)

    def _link_bytes(self) -> dict[tuple[str, str], int]:
        """(sender, receiver) -> the wire bytes the sender counted on that link (its last heartbeat's)."""
        with self.membership.cond:
            return {(m.node_id, link.peer): link.wire_bytes for m in self.membership.alive() for link in m.links}

    def _await_returning_nodes(self) -> None:
        """On resume, give the restored plan's nodes a moment (scheduler.heartbeat_timeout_s) to register again and
        resend their profiles, as each does at once on its return: a plan made before they are all in would be made
        again as each one comes in (a plan epoch apiece)."""
        nodes = set(placement.plan_nodes(self.plan))

        def back() -> bool:
            alive = self.membership.alive()
            return nodes <= {m.node_id for m in alive} and all(m.profile is not None for m in alive if m.held)

        try:
            self.membership.wait(back, "the plan's nodes to come back", self.cfg.scheduler.heartbeat_timeout_s)
        except RunAborted:
            if self.stop_requested.is_set():
                raise
            log.info("planning without every node of the last plan: not all came back within %.0fs",
                     self.cfg.scheduler.heartbeat_timeout_s)

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
                log.warning("rolling back from step %d to step %d, before %s's first step", self.step, back_to, v.guilty)
                self.store.event("rollback", v.guilty, f"from step {self.step} to step {back_to}")
                self._on_event("rollback", {"from": self.step, "to": back_to, "node_id": v.guilty})
                self.store.rollback_to(back_to)
                self.step = back_to
            self.planning.dirty = True

    def _note_failure(self, why: str) -> None:
        self.planning.dirty = True  # a new epoch drops whatever the failed step left half-done
        self.failures += 1
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        log.warning("step %d failed (%s); re-planning", self.step, why)
        self.store.event("failure", detail=f"step {self.step}: {why}")
        if self.metrics is not None:
            self.metrics.failure(self.step, why)
        self._on_event("failure", {"step": self.step, "why": why})

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
        """A microbatch's token windows from the prepared data set; ReportRefused for a run on the byte corpus, a
        caller that is no live member, or a step or microbatch the run never issues."""
        cfg = self.cfg
        with self.membership.cond:
            member = self.members.get(request.node_id)
            if member is None or not member.alive:
                raise ReportRefused(f"windows for {request.node_id!r} refused: not a live member of the run")
        if self.dataset is None:
            raise ReportRefused("this run trains on the byte corpus, which every node reads itself")
        count = cfg.run.eval_microbatches if request.validation else cfg.train.microbatches
        if request.step >= cfg.run.steps or request.microbatch >= count:
            raise ReportRefused(
                f"windows refused: step {request.step} microbatch {request.microbatch} is not one of the run's "
                f"{cfg.run.steps} steps of {count} {'validation ' if request.validation else ''}microbatches"
            )
        windows = self.dataset.windows(
            seed=cfg.run.seed, step=request.step, microbatch=request.microbatch, size=cfg.train.microbatch_size,
            seq_len=cfg.model.seq_len, validation=request.validation,
        )
        return pb.WindowsReply(
            fingerprint=self.dataset.fingerprint, rows=windows.shape[0], cols=windows.shape[1],
            tokens=windows.astype("<u4").tobytes(),
        )

    def bits_per_byte(self, loss: float) -> float:
        """A validation loss (nats per token) as bits per byte of the validation text."""
        if self.dataset is not None:
            return self.dataset.bits_per_byte(loss)
        return bits_per_byte(loss, 1, 1)  # the byte corpus: one token a byte

    # -- status and shutdown --------------------------------------------------------------------------------------

    def snapshot(self) -> StatusSnapshot:
        """The run as it stands, copied out for the status."""
        verification = self.driver.verification
        with self.membership.cond:
            members = tuple(replace(m) for m in self.members.values())
            verify = verification.counts.as_proto() if verification is not None else None
        return StatusSnapshot(
            state=self.state,
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
        """The run's status for `geotrain status`, the status page and /metrics (do not modify it: it is shared).
        Rendered again only when older than _STATUS_MAX_AGE_S, or than _STATUS_MIN_AGE_S after an event, so that
        however many viewers ask and however fast the run goes, the coordinator reads SQLite and copies its members
        a few times a second at most."""
        with self._status_lock:
            now = time.monotonic()
            age = now - self._status_at
            if age > _STATUS_MAX_AGE_S or (self._status_stale and age > _STATUS_MIN_AGE_S):
                self._status_stale = False
                self._status, self._status_at = render(self.snapshot()), now
            return self._status

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
            self.finished = True
            alive = [m.node_id for m in self.membership.alive()]
        self.orders.broadcast_shutdown(alive, pb.Shutdown(reason=reason, aborted=aborted), grace_s)
