"""What a finished run reports (the --json line): a function of its step history and its members' last counters."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.membership import Member
from geotrain.scheduler.state import StepRecord


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
    stage_nodes: list[list[str]]  # the last plan's node ids of each stage, in pipeline order
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


def summarize(
    history: Sequence[StepRecord], first_step: int, last_step: int, tokens_per_step: int, wall_s: float, *,
    alive: Sequence[Member],
    members: Sequence[Member], plan: pb.Plan | None, estimated_step_s: float | None,
    bits_per_byte: Callable[[float], float],
) -> RunSummary:
    """The summary of a run whose steps from first_step to last_step ran in this process (its tokens/s counts only
    those); `alive`: the live members, whose links' counters count; `members`: every one, whose own counters count."""
    train_s = sum(r.seconds for r in history if r.step >= first_step)
    vals = [r.val_loss for r in history if r.val_loss is not None]
    trained_s = list(itertools.accumulate(r.seconds for r in history))
    links = [link for m in alive for link in m.links]
    return RunSummary(
        steps=len(history),
        loss_first=history[0].loss,
        loss_last=history[-1].loss,
        val_loss=vals[-1] if vals else None,
        val_bits_per_byte=bits_per_byte(vals[-1]) if vals else None,
        tokens_per_s=tokens_per_step * (last_step - first_step) / train_s if train_s else 0.0,
        wall_s=wall_s,
        nodes=len(alive),
        stages=len(plan.stages) if plan else 0,
        stage_nodes=[list(s.node_ids) for s in plan.stages] if plan else [],
        validation=[(r.step + 1, r.val_loss, s) for r, s in zip(history, trained_s) if r.val_loss is not None],
        wire_bytes=sum(link.wire_bytes for link in links),
        raw_bytes=sum(link.raw_bytes for link in links),
        stream_bytes=sum(min(link.stream_bytes, link.wire_bytes) for link in links),  # a node's word, bounded
        estimated_step_s=estimated_step_s,
        relayed_bytes=sum(m.relayed_bytes for m in members),
        averaging_bytes=sum(m.averaging_bytes_sent for m in members),
        peak_memory_bytes=max((m.peak_memory_bytes for m in members), default=0),
        inflight=plan.inflight if plan else 0,
    )
