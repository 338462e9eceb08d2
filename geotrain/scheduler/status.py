"""The run's status for `geotrain status`, the status page and /metrics: a pure function of a read-only snapshot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import costmodel
from geotrain.scheduler.membership import Member
from geotrain.scheduler.profiles import measured_link
from geotrain.scheduler.state import StepRecord


@dataclass(frozen=True)
class StatusSnapshot:
    """Everything the status shows, copied out of the coordinator at one moment."""

    state: str
    phase: str
    steps: int
    failures: int
    recoveries: tuple[float, ...]
    history: tuple[StepRecord, ...]
    members: tuple[Member, ...]  # copies: the coordinator goes on changing its own
    plan: pb.Plan | None
    estimate: costmodel.Plan | None
    events: tuple[tuple[float, str, str, str], ...]
    now: float  # time.monotonic() when taken, for heartbeat ages
    bits_per_byte: Callable[[float], float]  # a validation loss as bits per byte of the run's validation text
    exactness: str = ""  # why the run is not exact (config's inexact_replicas), "" when it is
    verify: pb.VerifyStatus | None = None  # spot checks so far (None: the run verifies nothing)


def render(snap: StatusSnapshot) -> pb.StatusReply:
    """The StatusReply for a snapshot."""
    history = snap.history
    reply = pb.StatusReply(
        state=snap.state, phase=snap.phase, step=len(history), steps=snap.steps, failures=snap.failures,
        recovery_s=snap.recoveries, exactness=snap.exactness,
    )
    if snap.verify is not None:
        reply.verify.CopyFrom(snap.verify)
    if history:
        last = history[-1]
        recent = history[-10:]
        mean_s = sum(r.seconds for r in recent) / len(recent)
        reply.loss, reply.tokens_per_s = last.loss, last.tokens_per_s
        reply.eta_s = mean_s * max(0, snap.steps - len(history))
        vals = [r.val_loss for r in history if r.val_loss is not None]
        if vals:
            reply.val_loss, reply.val_bits_per_byte = vals[-1], snap.bits_per_byte(vals[-1])
    for r in history:
        point = reply.history.add(step=r.step, loss=r.loss, tokens_per_s=r.tokens_per_s, seconds=r.seconds, at=r.committed_at)
        if r.val_loss is not None:
            point.has_val_loss, point.val_loss = True, r.val_loss
    plan = snap.plan
    stage_of = {n: st for st in plan.stages for n in st.node_ids} if plan else {}
    unreachable = {m.node_id for m in snap.members if m.unreachable}
    relays = {frozenset((r.a, r.b)): r.relay_id for r in plan.relays} if plan else {}

    def transport(src: str, dst: str) -> str:
        relay = relays.get(frozenset((src, dst)))
        return f"relayed via {relay}" if relay else "reversed" if dst in unreachable else "direct"

    for m in snap.members:
        _add_node(reply, m, stage_of.get(m.node_id), snap.now, transport)
    estimate = snap.estimate
    if estimate is not None:
        reply.estimated_step_s, reply.bottleneck = estimate.step_seconds, estimate.bottleneck
        for node in reply.nodes:
            node.planned_memory_bytes = estimate.node_memory_bytes.get(node.node_id, 0)
    if plan:
        reply.plan_epoch = plan.epoch
        for st in plan.stages:
            stage = reply.stages.add(
                index=st.index, layer_start=st.layer_start, layer_end=st.layer_end, node_ids=list(st.node_ids)
            )
            if estimate is not None and st.index < len(estimate.stages):
                est = estimate.stages[st.index]
                stage.est_compute_s, stage.est_transfer_s = est.compute_s, est.transfer_s
                stage.utilisation = min(1.0, est.compute_s / estimate.step_seconds) if estimate.step_seconds else 0.0
    for at, kind, node_id, detail in snap.events:
        reply.events.add(at=at, kind=kind, node_id=node_id, detail=detail)
    return reply


def _add_node(
    reply: pb.StatusReply, m: Member, st: pb.StageAssignment | None, now: float, transport: Callable[[str, str], str]
) -> None:
    """A member's row, and the rows of the links it sends on (each with its `transport`: direct, reversed or
    relayed via a node) or measured."""
    sent_raw = sum(link.raw_bytes for link in m.links)
    sent_wire = sum(link.wire_bytes for link in m.links)
    probes = {p.peer: p for p in m.profile.links} if m.profile else {}
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
        profiled_microbatch_s=sum(m.profile.layer_seconds) if m.profile else 0.0,
        memory_bytes=m.profile.memory_bytes if m.profile else 0,
        lifecycle=m.lifecycle.value,
        device=f"{m.profile.device} ({m.profile.device_name})" if m.profile else "",
        precision=m.profile.precision if m.profile else "",
        peak_memory_bytes=m.peak_memory_bytes,
        averaging_bytes_sent=m.averaging_bytes_sent,
        reachability=m.reachability,
        relayed_bytes=m.relayed_bytes,
    )
    for link in m.links:
        reply.links.add(
            src=m.node_id,
            dst=link.peer,
            codec=link.codec,
            compression_ratio=link.raw_bytes / link.wire_bytes if link.wire_bytes else 1.0,
            raw_bytes=link.raw_bytes,
            wire_bytes=link.wire_bytes,
            transport=transport(m.node_id, link.peer),
            **measured_link(probes.pop(link.peer, None)),
        )
    for probe in probes.values():  # measured, no training traffic yet (or never: the coordinator's link)
        reply.links.add(src=m.node_id, dst=probe.peer, compression_ratio=1.0, **measured_link(probe))
