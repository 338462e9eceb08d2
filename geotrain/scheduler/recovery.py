"""Recovery: checkpoints of the committed state, snapshots when layers move, and rollback when a stage lost every
copy of the committed step (DESIGN.md "Failure, join, restart")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler import placement
from geotrain.scheduler.checkpoint import CheckpointStore, Manifest, StageState, stage_checksum
from geotrain.scheduler.membership import EventSink, Member
from geotrain.scheduler.state import RunStore

log = logging.getLogger(__name__)

StateFetcher = Callable[[Member, tuple[int, int], int], dict[str, Any]]
"""(a member holding the layers, the layer range, steps done) -> the state tensors (Coordinator.member_state)."""


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

    def checkpoint(self, plan: pb.Plan, steps_done: int, alive: list[Member]) -> Manifest | None:
        """Write a checkpoint of the committed state, fetched from a live holder of each stage and checked against
        the checksum its replicas reported; None (and no checkpoint) when a stage has none, a download fails, or a
        holder sends other parameters."""
        assert self.checkpoints is not None and self._fetch_state is not None
        checksums = self.store.checksums(steps_done - 1)
        stages = []
        try:
            for s in plan.stages:
                have = placement.holders(alive, (s.layer_start, s.layer_end), steps_done)
                if not have:
                    raise LookupError(f"no live node holds stage {s.index}")
                state = self._fetch_state(have[0], (s.layer_start, s.layer_end), steps_done)
                recorded = checksums.get(s.index, "")
                if recorded and stage_checksum(state, self._diloco) != recorded:
                    raise ValueError(f"{have[0].node_id} sent stage {s.index} with another checksum than its replicas'")
                stages.append(StageState(s.layer_start, s.layer_end, recorded, state))
        except Exception as e:  # a node lost mid-download: the next checkpoint will do
            log.warning("checkpoint of step %d skipped: %s", steps_done, e)
            return None
        manifest = self.checkpoints.write(steps_done, plan.epoch, stages)
        self.store.put("checkpoint", str(manifest.path))
        self.store.event("checkpoint", detail=f"step {steps_done}")
        self._on_event("checkpoint", {"steps_done": steps_done, "path": str(manifest.path)})
        return manifest

    def checkpoint_due(self, steps_done: int) -> bool:
        """Whether the newest checkpoint is older than steps_done (a finished run writes one)."""
        if self.checkpoints is None:
            return False
        latest = self.checkpoints.latest()
        return latest is None or latest.steps_done != steps_done

    def checkpoint_state(self, layer_start: int, layer_end: int, steps_done: int) -> dict[str, Any] | None:
        """Parameters and optimizer state of a layer range from the checkpoint at steps_done, if there is one."""
        manifest = self.checkpoints.latest(at_most=steps_done) if self.checkpoints else None
        if manifest is None or manifest.steps_done != steps_done:
            return None
        return self.checkpoints.load_layers(manifest, layer_start, layer_end)

    def _snapshot(self, plan: pb.Plan | None, steps_done: int, alive: list[Member]) -> Manifest | None:
        """A checkpoint of the committed step: the newest one if it is of this step, else one written now from
        live holders of the current plan's stages; None when there is no checkpoint store or a stage of the
        current plan has no live copy of this step."""
        if self.checkpoints is None or plan is None:
            return None
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
