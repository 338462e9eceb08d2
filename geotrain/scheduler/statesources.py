"""Stage state the coordinator passes on: from a live member (dialled, or uploaded by one nobody can dial) within a
deadline for its bytes, and the final model streamed stage by stage into one file."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from geotrain.config import SchedulerSection
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import FrameError
from geotrain.protocol.probe import COORDINATOR_PEER
from geotrain.scheduler import placement
from geotrain.scheduler.checkpoint import ModelFileWriter
from geotrain.scheduler.membership import Member
from geotrain.scheduler.recovery import stage_bound
from geotrain.scheduler.uploads import StateUploads

log = logging.getLogger(__name__)

# (address, steps_done, deadline seconds) -> the chunks of the state of the stage the node there serves
StateDialler = Callable[[str, int, float], Iterator[pb.TensorChunk]]


class StateSources:
    """Streams a stage's state from the members that hold it; `alive` (called under `cond`) lists the live members."""

    def __init__(
        self, sched: SchedulerSection, diloco: bool, uploads: StateUploads, dial: StateDialler | None,
        alive: Callable[[], list[Member]], cond: threading.Condition,
    ) -> None:
        self._sched = sched
        self._diloco = diloco  # a stage's state holds its anchor too (recovery.stage_bound)
        self._uploads = uploads
        self._dial = dial
        self._alive = alive
        self._cond = cond

    def member_stream(self, member: Member, layers: tuple[int, int], steps_done: int) -> Iterator[pb.TensorChunk]:
        """The chunks of the state of `layers` after steps_done steps from a member that holds them, as they arrive:
        downloaded by dialling it, or uploaded by it when nobody can dial it; within a deadline for its bytes over
        its measured link to the coordinator."""
        deadline = self._deadline_s(member, layers)
        if member.unreachable:
            return self._uploads.stream(member.node_id, steps_done, layers, deadline)
        assert self._dial is not None
        return self._dial(member.address, steps_done, deadline)

    def _deadline_s(self, member: Member, layers: tuple[int, int]) -> float:
        """How long the state of `layers` may take to come from `member`: its bytes (the plan's bound) over the
        member's measured link to the coordinator, or over scheduler.state_link_mbps where none was measured."""
        bound = stage_bound(member, layers, self._diloco)
        links = member.profile.links if member.profile is not None else []
        measured = [link.bandwidth_bps for link in links if link.peer == COORDINATOR_PEER and link.bandwidth_bps > 0]
        bits_per_s = measured[0] if measured else self._sched.state_link_mbps * 1e6
        return framing.state_deadline_s(
            bound.total_bytes if bound else 0, bits_per_s / 8, self._sched.state_deadline_floor_s
        )

    def from_undialable(self, layers: tuple[int, int], steps_done: int) -> Iterator[pb.TensorChunk] | None:
        """The state of `layers` at steps_done as a live holder nobody can dial uploads it (a node told to load from
        such a holder fetches it through the coordinator), its first chunk already in; None when none sends it."""
        with self._cond:
            undialable = [m for m in placement.holders(self._alive(), layers, steps_done) if m.unreachable]
        if not undialable:
            return None
        chunks = self.member_stream(undialable[0], layers, steps_done)
        try:
            return itertools.chain([next(chunks)], chunks)
        except (LookupError, StopIteration) as e:
            log.warning("layers [%d, %d) after %d steps: %s", *layers, steps_done, e)
            return None

    def save_model(self, plan: pb.Plan, path: Path, steps_done: int, metadata: dict[str, str]) -> None:
        """Write the whole model's parameters after steps_done steps to `path` (safetensors, `metadata` in its header)
        as a live holder of each stage streams them: the coordinator holds a chunk of it at a time, never the model.
        LookupError when a stage has no holder, or its holder cannot send it; nothing is left at `path` then."""
        total = plan.stages[-1].layer_end
        partial = path.with_name(path.name + ".partial")
        writer: ModelFileWriter | None = None
        try:
            for s in plan.stages:
                layers = (s.layer_start, s.layer_end)
                have = placement.holders(self._alive(), layers, steps_done)
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
