"""Recovery: checkpoints of the committed state, snapshots when layers move, and rollback when a stage lost every
copy of the committed step (DESIGN.md "Failure, join, restart").

A checkpoint streams: each stage's state goes from one live holder straight into its file, chunk by chunk, so the
coordinator never holds more than a few chunks of it. The coordinator writes the durable copy itself rather than
having holders write shards (torch.distributed.checkpoint's way): holders are volunteers who may vanish or lie, so
the copy that survives them must be on the coordinator's disk, and their bytes must pass through it anyway to be
checked against the checksum their replicas agreed on.

And it does not stop the run (torchtitan's async checkpointing): `start_checkpoint` returns once every holder has
begun sending, which pins the snapshot it sends from (node.handover.StateSnapshot: it keeps serving the committed
step after the next one is applied), and the files are written while the run goes on, every stage at once, each by
a thread of its own at the lowest CPU priority, over the holder's raw tensor stream where it has one
(protocol/statestream.py) and past the page cache (durable.SequentialFile). One checkpoint is written at a time;
whatever reads checkpoints to decide (sources, rollback) waits for it first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import StateReceiver, StateSource
from geotrain.protocol.statestream import background_priority
from geotrain.scheduler import placement
from geotrain.scheduler.checkpoint import (
    CheckpointStore, CheckpointWrite, Manifest, StageFileWriter, StateBound, state_bound,
)
from geotrain.scheduler.membership import EventSink, Member
from geotrain.scheduler.state import RunStore

log = logging.getLogger(__name__)

StateFetcher = Callable[[Member, tuple[int, int], int], Iterator[pb.TensorChunk]]
"""(a member holding the layers, the layer range, steps done) -> the chunks of that state, as they arrive
(StateSources.member_stream)."""


def stage_bound(member: Member, layers: tuple[int, int], diloco: bool) -> StateBound | None:
    """The most the state of `layers` may hold, from the parameter shapes in the member's profile (None: it sent
    none, and its state is bounded only by the file system)."""
    profile = member.profile
    if profile is None or len(profile.param_shapes) < layers[1]:
        return None
    shapes = [[tuple(t.dims) for t in profile.param_shapes[i].tensors] for i in range(*layers)]
    return state_bound(shapes, diloco)


class Recovery:
    """Writes checkpoints from live holders and decides where every node's state comes from after a re-plan."""

    def __init__(
        self,
        checkpoints: CheckpointStore | None,
        fetch_state: StateFetcher | None,
        store: RunStore,
        on_event: EventSink,
        diloco: bool = False,
    ) -> None:
        self.checkpoints = checkpoints
        self._fetch_state = fetch_state
        self.store = store
        self._on_event = on_event
        self._diloco = diloco  # a stage's checksum covers its anchor (node.stage)
        self._writing: threading.Thread | None = None  # the checkpoint being written
        self._written: Manifest | None = None  # what it wrote

    def checkpoint(self, plan: pb.Plan, steps_done: int, alive: list[Member]) -> Manifest | None:
        """Write a checkpoint of the committed state and wait until it is written (start_checkpoint's)."""
        self.start_checkpoint(plan, steps_done, alive)
        return self.finish_checkpoint()

    def start_checkpoint(self, plan: pb.Plan, steps_done: int, alive: list[Member]) -> None:
        """Start a checkpoint of the committed state, streamed from a live holder of each stage and checked against
        the checksum its replicas reported: returns once every holder has begun sending (its snapshot of this step
        is pinned), while the files are written on. No checkpoint when a stage has no holder, a download fails, or a
        holder sends other parameters (finish_checkpoint says None)."""
        assert self.checkpoints is not None and self._fetch_state is not None
        self.finish_checkpoint()
        checksums = self.store.checksums(steps_done - 1)
        streams: list[tuple[pb.StageAssignment, Member, pb.TensorChunk, Iterator[pb.TensorChunk]]] = []
        try:
            for s in plan.stages:
                have = placement.holders(alive, (s.layer_start, s.layer_end), steps_done)
                if not have:
                    raise LookupError(f"no live node holds stage {s.index}")
                chunks = self._fetch_state(have[0], (s.layer_start, s.layer_end), steps_done)
                streams.append((s, have[0], next(chunks), chunks))
        except Exception as e:  # a node lost before it began sending: the next checkpoint will do
            log.warning("checkpoint of step %d skipped: %s", steps_done, e)
            for *_, chunks in streams:
                _close(chunks)
            return
        pending = self.checkpoints.begin(steps_done, plan.epoch)
        self._writing = threading.Thread(
            target=self._write, args=(pending, streams, checksums), name=f"checkpoint-{steps_done}", daemon=True
        )
        self._writing.start()

    def finish_checkpoint(self) -> Manifest | None:
        """Wait for the checkpoint being written, if any; the checkpoint it wrote (None: none, or it failed)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.join()
        written, self._written = self._written, None
        return written

    def _write(
        self, pending: CheckpointWrite, streams: list[tuple[pb.StageAssignment, Member, Any, Iterator[pb.TensorChunk]]],
        checksums: dict[int, str],
    ) -> None:
        """Stream every stage into its file, all at once (each holder sends over its own link, and a snapshot whose
        transfer ends before its stage's next step costs its holder no copy), then commit the checkpoint (the
        checkpoint thread)."""
        steps_done = pending.steps_done
        writers: list[StageFileWriter] = []
        handed = 0  # the streams handed to a stage's thread, which closes them
        try:
            for s, member, *_ in streams:
                layers = (s.layer_start, s.layer_end)
                bound = stage_bound(member, layers, self._diloco)
                writers.append(pending.stage(*layers, checksums.get(s.index, ""), self._diloco, bound))
            lost = threading.Event()  # set when one stage failed: the others need not be read on
            with ThreadPoolExecutor(len(streams), thread_name_prefix=f"checkpoint-{steps_done}") as pool:
                handed = len(streams)
                stages = [
                    pool.submit(_write_stage, writer, first, chunks, lost)
                    for writer, (_, _, first, chunks) in zip(writers, streams)
                ]
                done, _ = wait(stages, return_when=FIRST_EXCEPTION)
                if any(f.exception() for f in done):
                    lost.set()
                written = [f.result() for f in stages]
            for (s, member, *_), checksum in zip(streams, written):
                recorded = checksums.get(s.index, "")
                if recorded and checksum != recorded:
                    raise ValueError(f"{member.node_id} sent stage {s.index} with another checksum than its replicas'")
            manifest = pending.commit()
        except Exception as e:  # a node lost mid-download: the next checkpoint will do
            log.warning("checkpoint of step %d skipped: %s", steps_done, e)
            for writer in writers:
                writer.close()
            pending.abandon()
            for *_, chunks in streams[handed:]:
                _close(chunks)
            return
        self.store.put("checkpoint", str(manifest.path))
        self.store.event("checkpoint", detail=f"step {steps_done}")
        self._on_event("checkpoint", {"steps_done": steps_done, "path": str(manifest.path)})
        self._written = manifest

    def checkpoint_due(self, steps_done: int) -> bool:
        """Whether the newest checkpoint is older than steps_done (a finished run writes one)."""
        if self.checkpoints is None:
            return False
        self.finish_checkpoint()
        latest = self.checkpoints.latest()
        return latest is None or latest.steps_done != steps_done

    def checkpoint_state(self, layer_start: int, layer_end: int, steps_done: int) -> Iterator[StateSource] | None:
        """Parameters and optimizer state of a layer range from the checkpoint at steps_done, if there is one: its
        tensors, each read from the file as it is sent."""
        manifest = self.checkpoints.latest(at_most=steps_done) if self.checkpoints else None
        if manifest is None or manifest.steps_done != steps_done:
            return None
        return self.checkpoints.layer_sources(manifest, layer_start, layer_end)

    def _snapshot(self, plan: pb.Plan | None, steps_done: int, alive: list[Member]) -> Manifest | None:
        """A checkpoint of the committed step: the newest one if it is of this step, else one written now from
        live holders of the current plan's stages; None when there is no checkpoint store or a stage of the
        current plan has no live copy of this step."""
        if self.checkpoints is None or plan is None:
            return None
        self.finish_checkpoint()
        latest = self.checkpoints.latest(at_most=steps_done)
        if latest is not None and latest.steps_done == steps_done:
            return latest
        if not all(placement.holders(alive, rng, steps_done) for rng in placement.plan_ranges(plan)):
            return None
        return self.checkpoint(plan, steps_done, alive)

    def sources(
        self, ranges: placement.Ranges, groups: placement.Groups, plan: pb.Plan | None, alive: list[Member], steps_done: int
    ) -> tuple[dict[str, tuple[str, str]], int]:
        """For each node that lacks its stage's committed state: (source address or '' for the checkpoint, expected
        checksum), and the step the run continues from. A stage whose range no live node holds whole (the plan
        moved layers) loads from a checkpoint of the committed step, written now from the current plan's live
        holders if there is none; when a stage of the current plan lost every copy, the run rolls back to the
        newest checkpoint."""
        if steps_done == 0 and not any(m.applied_steps for m in alive):
            return {}, 0  # step 0 is each layer's initialisation from the seed: every node builds it itself
        found = placement.state_sources(ranges, groups, placement.plan_ranges(plan), alive, steps_done, self.store.checksums(steps_done - 1))
        sources, reshaped = dict(found.from_peers), found.reshaped
        if not reshaped:
            return sources, steps_done
        manifest = self._snapshot(plan, steps_done, alive)
        if manifest is None:
            self.finish_checkpoint()
            manifest = self.checkpoints.latest(at_most=steps_done) if self.checkpoints else None
            back_to = manifest.steps_done if manifest else 0
            log.warning("a stage lost every copy of step %d: rolling back to step %d", steps_done, back_to)
            self.store.event("rollback", detail=f"from step {steps_done} to step {back_to}")
            self.store.rollback_to(back_to)
            steps_done, reshaped, sources = back_to, list(range(len(ranges))), {}
        for i in reshaped:
            checksum = self.checkpoints.checksum(manifest, *ranges[i], self._diloco) if manifest else ""
            for m in groups[i]:
                sources[m.node_id] = ("", checksum)
        return sources, steps_done


def _write_stage(
    writer: StageFileWriter, first: pb.TensorChunk, chunks: Iterator[pb.TensorChunk], lost: threading.Event
) -> str:
    """One stage's stream into its file, until the checkpoint is `lost`; returns the stage's checksum. The stream is
    closed here, by the thread that reads it (a generator cannot be closed while another thread runs it). The thread
    is a checkpoint's own, and runs only on cores the run leaves idle (statestream.background_priority)."""
    background_priority()
    try:
        receiver = StateReceiver(writer)
        receiver.feed(first)
        for chunk in chunks:
            if lost.is_set():
                raise LookupError("another stage of the checkpoint failed")
            receiver.feed(chunk)
        receiver.close()
        return writer.finish()
    finally:
        writer.close()
        _close(chunks)


def _close(chunks: Iterator[Any]) -> None:
    """End a state stream that will not be read on (a gRPC call is cancelled, a generator closed)."""
    cancel = getattr(chunks, "cancel", None) or getattr(chunks, "close", None)
    if cancel is not None:
        cancel()
