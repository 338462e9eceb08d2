"""The coordinator's RunState: its transitions, what the status shows, and when registrations are refused."""

from __future__ import annotations

import pytest

from geotrain.config import load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.coordinator import Coordinator, RunAborted, RunState
from tests.test_step_driver import ScriptedNode, scripted_run


def _register(c: Coordinator, node_id: str) -> pb.RegisterReply:
    key = NodeKey.generate()
    request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address="10.0.0.9:1",
                                 public_key=key.public)
    return c.register(request, key.public)


@pytest.mark.timeout(60)
def test_a_failed_step_is_recovering_until_the_next_commit_then_the_run_is_done():
    seen: dict[tuple[int, str], RunState] = {}

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        c = nodes["node-1"].c
        seen.setdefault((step, phase), c.state)
        if step == 1 and phase == "dispatched" and c.failures == 0:
            c.report_failure(pb.FailureReport(node_id="node-2", peer="node-2", reason=pb.FAILURE_REASON_AVERAGING,
                                              detail="averaging is down", plan_epoch=nodes["node-2"].epoch))

    with scripted_run(2, 2, on_phase) as (c, nodes, result):
        pass
    assert seen[(0, "dispatched")] is RunState.TRAINING
    assert seen[(1, "committed")] is RunState.RECOVERING, "step 1 ran again after its failure"
    assert seen[(2, "microbatches_done")] is RunState.TRAINING  # dispatched as step 1 was applied, still recovering
    assert c.failures == 1 and len(c.recoveries) == 1
    assert c.state is RunState.DONE and c.status().state == "done"
    refused = _register(c, "late")
    assert not refused.accepted and refused.reason == pb.REJECT_REASON_RUN_FINISHED


def test_nodes_shut_down_before_the_last_step_end_the_run():
    c = Coordinator(load_config(None, []))
    assert c.state is RunState.WAITING and c.status().state == "waiting"
    assert _register(c, "early").accepted
    c.shutdown_nodes("stopped by its owner", grace_s=0.1, aborted=True)
    assert c.state is RunState.ABORTED
    assert _register(c, "late").reason == pb.REJECT_REASON_RUN_FINISHED


@pytest.mark.parametrize("pause_on_stop", [True, False])
def test_a_stop_pauses_a_run_that_can_resume_and_aborts_one_that_cannot(pause_on_stop):
    c = Coordinator(load_config(None, ["scheduler.min_nodes=2"]), pause_on_stop=pause_on_stop)
    c.stop_requested.set()
    with pytest.raises(RunAborted):
        c.run()
    assert c.state is (RunState.PAUSED if pause_on_stop else RunState.ABORTED)
    # A paused run's nodes come back to it once it resumes: until the process ends, it still admits them.
    assert _register(c, "node-1").accepted is pause_on_stop
