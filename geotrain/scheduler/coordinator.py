"""The coordinator: admits nodes, plans stages, and drives synchronous training steps.

A step (DESIGN.md "One training step"): microbatch ids go to the data heads; each head reports every microbatch
done once its backward has passed through every stage; then the coordinator commits the step in two rounds: every
stage reports the squared norm of its gradients (so clipping equals single-process clipping), then every stage
applies the same clipped optimizer step and reports a checksum of its parameters, which replicas must agree on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from geotrain import __version__
from geotrain.config import RunConfig, to_proto
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.state import RunStore, StepRecord

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict[str, Any]], None]


class RunAborted(RuntimeError):
    """The run cannot go on (stopped, a node lost, a step timed out)."""


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
    alive: bool = True
    bytes_sent: int = 0
    bytes_received: int = 0
    links: list[pb.LinkCounter] = field(default_factory=list)
    microbatches_per_s: float = 0.0


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


def assign_microbatches(heads: list[str], microbatches: int) -> dict[str, list[int]]:
    """Share microbatch ids 0..M-1 among the data heads round-robin."""
    shares: dict[str, list[int]] = {h: [] for h in heads}
    for mb in range(microbatches):
        shares[heads[mb % len(heads)]].append(mb)
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
    """Membership, planning and the step clock of one run."""

    def __init__(self, cfg: RunConfig, *, store: RunStore | None = None, on_event: EventSink | None = None) -> None:
        self.cfg = cfg
        self.store = store or RunStore()
        self._on_event = on_event or (lambda kind, data: None)
        self._cond = threading.Condition()
        self.members: dict[str, Member] = {}
        self.plan: pb.Plan | None = None
        self.step = 0
        self.finished = False
        self.stop_requested = threading.Event()
        self._progress = _StepProgress(step=-1)
        self._next_id = 1
        self.state = "waiting"

    # -- membership (called from RPC threads) -------------------------------------------------------------------

    def register(self, request: pb.RegisterRequest) -> pb.RegisterReply:
        """Admit a node, or say why not."""
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
            if existing is not None and existing.alive:
                return pb.RegisterReply(
                    accepted=False, reason=pb.REJECT_REASON_DUPLICATE_NODE, message=f"node {node_id} is already live"
                )
            if not node_id:
                while f"node-{self._next_id}" in self.members:
                    self._next_id += 1
                node_id = f"node-{self._next_id}"
            now = time.monotonic()
            self.members[node_id] = Member(node_id, request.address, request.region or "local", now, now)
            self._cond.notify_all()
        self.store.upsert_member(node_id, request.address, request.region, "alive")
        self.store.event("join", node_id, request.address)
        self._on_event("join", {"node_id": node_id, "address": request.address, "region": request.region})
        return pb.RegisterReply(
            accepted=True,
            node_id=node_id,
            config=to_proto(self.cfg),
            heartbeat_interval_s=self.cfg.scheduler.heartbeat_interval_s,
        )

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Note that a node is alive and which plan it runs."""
        with self._cond:
            member = self.members.get(request.node_id)
            if member is None or not member.alive:
                return pb.HeartbeatReply(known=False)
            member.last_seen = time.monotonic()
            member.plan_epoch = request.plan_epoch
            member.bytes_sent, member.bytes_received = request.bytes_sent, request.bytes_received
            member.links = list(request.links)
            member.microbatches_per_s = request.microbatches_per_s
            self._cond.notify_all()
        return pb.HeartbeatReply(known=True)

    def order_stream(self, node_id: str, is_active: Callable[[], bool]) -> Iterator[pb.Order]:
        """The orders for one node, as long as its stream is open."""
        with self._cond:
            member = self.members.get(node_id)
        if member is None:
            raise KeyError(node_id)
        while is_active():
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
            if request.step == self._progress.step:
                self._progress.done.setdefault(request.microbatch, (request.loss, list(request.path)))
                self._cond.notify_all()

    def eval_done(self, request: pb.EvalDoneRequest) -> None:
        """A last stage computed a validation loss."""
        with self._cond:
            if request.step == self._progress.step:
                self._progress.eval_losses[request.microbatch] = request.loss
                self._cond.notify_all()

    def grad_norm(self, request: pb.GradNormRequest) -> None:
        """A stage replica's squared gradient norm for the step being committed."""
        with self._cond:
            if request.step == self._progress.step:
                self._progress.norms[request.node_id] = request.sq_norm
                self._cond.notify_all()

    def step_applied(self, request: pb.StepAppliedRequest) -> None:
        """A stage replica applied the step."""
        with self._cond:
            if request.step == self._progress.step:
                self._progress.checksums[request.node_id] = request.checksum
                self._cond.notify_all()

    # -- the run ------------------------------------------------------------------------------------------------

    def _alive(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive]

    def _plan_nodes(self) -> list[str]:
        assert self.plan is not None
        return [n for s in self.plan.stages for n in s.node_ids]

    def _wait(self, predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Block until predicate() holds (under the lock), raising RunAborted on stop, node loss or timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate():
                if self.stop_requested.is_set():
                    raise RunAborted("stopped")
                self._check_liveness()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RunAborted(f"timed out after {timeout_s:.0f}s waiting for {what}")
                self._cond.wait(min(remaining, 0.2))

    def _check_liveness(self) -> None:
        """Mark silent nodes dead; losing a node of the plan ends the run (replicas come with fault tolerance)."""
        now = time.monotonic()
        timeout = self.cfg.scheduler.heartbeat_timeout_s
        for member in self.members.values():
            if member.alive and now - member.last_seen > timeout:
                member.alive = False
                log.warning("node %s missed heartbeats for %.1fs: declared dead", member.node_id, timeout)
                self.store.upsert_member(member.node_id, member.address, member.region, "dead")
                self.store.event("dead", member.node_id)
                self._on_event("dead", {"node_id": member.node_id})
                if self.plan is not None and member.node_id in self._plan_nodes():
                    raise RunAborted(f"node {member.node_id} of the plan stopped responding")

    def _make_plan(self) -> None:
        """Give the first nodes one stage each (balanced layers) and wait until they all run it."""
        members = sorted(self._alive(), key=lambda m: m.joined_at)
        n_stages = self.cfg.scheduler.stages or len(members)
        if n_stages > len(members):
            raise RunAborted(f"{n_stages} stages need {n_stages} nodes, only {len(members)} joined")
        ranges = split_layers(self.cfg.model.total_layers, n_stages)
        epoch = (self.plan.epoch if self.plan else 0) + 1
        plan = pb.Plan(epoch=epoch, total_layers=self.cfg.model.total_layers)
        for i, ((start, end), member) in enumerate(zip(ranges, members)):
            plan.stages.add(
                index=i, layer_start=start, layer_end=end, node_ids=[member.node_id], addresses=[member.address]
            )
        self.plan = plan
        self.store.put("plan_epoch", str(epoch))
        self.store.event("plan", detail=f"epoch {epoch}: {n_stages} stages")
        self._send([m.node_id for m in self._alive()], pb.Order(plan=plan))
        self._wait(
            lambda: all(self.members[n].plan_epoch == epoch for n in self._plan_nodes()),
            "nodes to take up the plan",
            self.cfg.scheduler.step_timeout_s,
        )
        self._on_event("plan", {"plan": plan})

    def run(self) -> RunSummary:
        """Wait for min_nodes, plan, then train every step; returns the summary."""
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
        self._make_plan()
        train_started = time.monotonic()
        records: list[StepRecord] = []
        val_loss: float | None = None
        for step in range(self.step, self.cfg.run.steps):
            record = self._run_step(step)
            every = self.cfg.run.eval_every
            last = step == self.cfg.run.steps - 1
            if last or (every and (step + 1) % every == 0):
                val_loss = self._evaluate(step)
                self.store.set_val_loss(step, val_loss)
                record = StepRecord(**{**asdict(record), "val_loss": val_loss})
            records.append(record)
            self.step = step + 1
            self._on_event("step", {"record": record, "of": self.cfg.run.steps})
        train_s = time.monotonic() - train_started
        self.state = "done"
        return RunSummary(
            steps=len(records),
            loss_first=records[0].loss,
            loss_last=records[-1].loss,
            val_loss=val_loss,
            tokens_per_s=self.cfg.tokens_per_step * len(records) / train_s,
            wall_s=time.monotonic() - started,
            nodes=len(self._alive()),
            stages=len(self.plan.stages) if self.plan else 0,
        )

    def _run_step(self, step: int) -> StepRecord:
        assert self.plan is not None
        t0 = time.monotonic()
        total = self.cfg.train.microbatches
        timeout = self.cfg.scheduler.step_timeout_s
        with self._cond:
            self._progress = _StepProgress(step=step)
        heads = list(self.plan.stages[0].node_ids)
        for head, ids in assign_microbatches(heads, total).items():
            self._send([head], pb.Order(start_step=pb.StartStep(step=step, microbatches=ids, total_microbatches=total)))
        self._wait(lambda: len(self._progress.done) == total, f"step {step}'s microbatches", timeout)

        nodes = self._plan_nodes()
        self._send(nodes, pb.Order(commit=pb.CommitStep(step=step)))
        self._wait(lambda: all(n in self._progress.norms for n in nodes), f"step {step}'s gradient norms", timeout)
        # One replica per stage: replicas hold the same averaged gradients.
        total_sq = sum(self._progress.norms[s.node_ids[0]] for s in self.plan.stages)
        clip = self.cfg.train.clip_coefficient(total_sq)
        lr = self.cfg.train.lr_at(step, self.cfg.run.steps)
        self._send(nodes, pb.Order(apply=pb.ApplyStep(step=step, clip_coef=clip, lr=lr)))
        self._wait(lambda: all(n in self._progress.checksums for n in nodes), f"step {step}'s checksums", timeout)
        checksums = self._stage_checksums()

        seconds = time.monotonic() - t0
        losses = [loss for loss, _ in self._progress.done.values()]
        record = StepRecord(
            step=step,
            loss=sum(losses) / len(losses),
            val_loss=None,
            tokens_per_s=self.cfg.tokens_per_step / seconds,
            seconds=seconds,
            plan_epoch=self.plan.epoch,
        )
        self.store.commit_step(record, checksums)
        return record

    def _stage_checksums(self) -> dict[int, str]:
        """Each stage's parameter checksum; replicas of a stage must agree."""
        assert self.plan is not None
        result: dict[int, str] = {}
        for stage in self.plan.stages:
            sums = {self._progress.checksums[n] for n in stage.node_ids}
            if len(sums) != 1:
                raise RunAborted(f"replicas of stage {stage.index} disagree on their parameters")
            result[stage.index] = sums.pop()
        return result

    def _evaluate(self, step: int) -> float:
        assert self.plan is not None
        n = self.cfg.run.eval_microbatches
        with self._cond:
            self._progress.eval_losses = {}
        for head, ids in assign_microbatches(list(self.plan.stages[0].node_ids), n).items():
            self._send([head], pb.Order(evaluate=pb.Evaluate(step=step, microbatches=ids)))
        self._wait(lambda: len(self._progress.eval_losses) == n, "validation", self.cfg.scheduler.step_timeout_s)
        return sum(self._progress.eval_losses.values()) / n

    # -- status ---------------------------------------------------------------------------------------------------

    def status(self) -> pb.StatusReply:
        """A snapshot of the run for `geotrain status`, the status page and /metrics."""
        history = self.store.steps()
        reply = pb.StatusReply(state=self.state, step=len(history), steps=self.cfg.run.steps)
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
            point = reply.history.add(step=r.step, loss=r.loss, tokens_per_s=r.tokens_per_s, seconds=r.seconds)
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
            )
            for link in m.links:
                reply.links.add(
                    src=m.node_id,
                    dst=link.peer,
                    codec=link.codec,
                    compression_ratio=link.raw_bytes / link.wire_bytes if link.wire_bytes else 1.0,
                    raw_bytes=link.raw_bytes,
                    wire_bytes=link.wire_bytes,
                )
        if plan:
            reply.plan_epoch = plan.epoch
            for st in plan.stages:
                reply.stages.add(
                    index=st.index, layer_start=st.layer_start, layer_end=st.layer_end, node_ids=list(st.node_ids)
                )
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
