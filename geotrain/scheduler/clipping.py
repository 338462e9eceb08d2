"""Which replicas CenteredClip clipped in the step in progress (compression.replica_robust), flagged once each."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from geotrain.protocol import geotrain_pb2 as pb

log = logging.getLogger(__name__)


class ClipFlags:
    """Flags a replica of a stage whose gradient CenteredClip clipped, when the flag is consistent: raised by its own
    reduction, or by a strict majority of the stage's replicas. So one member's report cannot flag an honest peer;
    with two replicas neither can flag the other (which of two gradients is the outlier, nothing tells).
    `record(kind, node_id, detail)` writes the run's event for each flag; `plan` and `step` (read under `cond`, the
    membership condition) say the current plan and the step in progress."""

    def __init__(
        self, record: Callable[[str, str, str], None], cond: threading.Condition,
        plan: Callable[[], pb.Plan | None], step: Callable[[], int],
    ) -> None:
        self._record = record
        self._cond = cond
        self._plan = plan
        self._step_now = step
        self._step = -1  # the step _flagged holds the members flagged in
        self._flagged: set[str] = set()
        self._reporters: dict[str, set[str]] = {}  # in _step: member -> the replicas that clipped it

    def note(self, request: pb.GradNormRequest) -> bool:
        """Count a replica's report of the peers it clipped; a warning and an event for each member it newly flags
        (True if any). Reports about another step, from outside the plan, and peer ids outside the reporter's stage
        are ignored."""
        with self._cond:
            plan = self._plan()
            stage = next((s for s in plan.stages if request.node_id in s.node_ids), None) if plan else None
            if stage is None or request.step != self._step_now():
                return False
            fresh = self._flag(request, stage)
        for node_id, reporters in fresh:  # outside the condition: SQLite
            why = f"step {request.step}: CenteredClip clipped its gradient (seen by {', '.join(reporters)})"
            log.warning("replica %s sent an outlying gradient: %s", node_id, why)
            self._record("clipped", node_id, why)
        return bool(fresh)

    def _flag(self, request: pb.GradNormRequest, stage: pb.StageAssignment) -> list[tuple[str, list[str]]]:
        """The members a report newly flags, each with the replicas that saw it clipped."""
        if request.step != self._step:
            self._step, self._flagged, self._reporters = request.step, set(), {}
        by_peer = dict(zip(stage.peer_ids, stage.node_ids))
        fresh: list[tuple[str, list[str]]] = []
        for node_id in sorted({by_peer[p] for p in request.clipped_peers if p in by_peer}):
            reporters = self._reporters.setdefault(node_id, set())
            reporters.add(request.node_id)
            if node_id not in self._flagged and (node_id in reporters or 2 * len(reporters) > len(stage.node_ids)):
                self._flagged.add(node_id)
                fresh.append((node_id, sorted(reporters)))
        return fresh
