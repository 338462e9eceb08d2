"""A node's reports of its own failures: errors that keep it from taking part in the current plan epoch.

The worker runs every task; a task that raises (a state load whose checksum fails, averaging that cannot run, a
compute error) would otherwise be noticed only when the step times out. The agent turns the error into a
FailureReport with peer == the node's own id, a FailureReason and the plan epoch, sent to the coordinator at once.
"""

from __future__ import annotations

from geotrain.protocol import geotrain_pb2 as pb


class StageFailure(Exception):
    """This node cannot take part in the current plan epoch, for `reason` (a pb.FailureReason value)."""

    def __init__(self, reason: int, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def self_report(node_id: str, error: Exception, plan_epoch: int, steps_done: int) -> pb.FailureReport:
    """The FailureReport telling the coordinator that this node's task failed with `error` in plan_epoch."""
    reason = error.reason if isinstance(error, StageFailure) else pb.FAILURE_REASON_COMPUTE
    detail = str(error) if isinstance(error, StageFailure) else f"{type(error).__name__}: {error}"
    return pb.FailureReport(
        node_id=node_id, peer=node_id, detail=detail, reason=reason, plan_epoch=plan_epoch, step=steps_done
    )
