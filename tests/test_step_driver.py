"""The coordinator's step protocol against scripted nodes in this process: every phase, a node restarted inside a
decided step, a lost replica, a node that reports it cannot take part, and the phase as `geotrain status` shows it.
The scripted nodes answer orders the way real ones do, without models: what is tested is the coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable, Collection
from contextlib import contextmanager
from typing import Iterator

import pytest

from geotrain.config import load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import new_token
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.coordinator import Coordinator, EventSink, RunSummary
from geotrain.scheduler.errors import ReportRefused
from geotrain.scheduler.reachability import DialedBack
from geotrain.scheduler.service import CoordinatorProcess
from tests.conftest import run_cli, wait_until

pytestmark = pytest.mark.timeout(60)

STEPS = 3


def _config(nodes: int, stages: int, *overrides: str):
    return load_config(
        None,
        [f"run.steps={STEPS}", "run.eval_every=0", "train.microbatches=4", f"scheduler.min_nodes={nodes}",
         f"scheduler.stages={stages}", "scheduler.placement=uniform", "scheduler.heartbeat_interval_s=0.1",
         "scheduler.heartbeat_timeout_s=0.6", "scheduler.step_timeout_s=30", *overrides],
    )


class ScriptedNode:
    """Registers, heartbeats and answers orders as a node would, reporting a fixed loss, norm and checksum, and an
    averaging peer id once told to join averaging. `hold(kind)` makes it sit on orders of that kind until
    `release()`; `stop()` silences it (a crash). `unreachable`: the coordinator's dial-back reaches it nowhere."""

    def __init__(self, coordinator: Coordinator, node_id: str, address: str, unreachable: bool = False) -> None:
        self.c = coordinator
        self.node_id = node_id
        self.epoch = self.state_epoch = self.applied = 0
        self.plan = pb.Plan()
        self.stage = -1
        self.peer_id = ""
        self.orders: list[pb.Order] = []
        self._held: set[str] = set()
        self._released = threading.Event()
        self._stopped = threading.Event()
        self._stream: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None
        request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=address)
        reply = coordinator.register(request, dial_back=(lambda: DialedBack(None)) if unreachable else None)
        assert reply.accepted, reply.message
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._beat_loop, self._order_loop)]
        for t in self._threads:
            t.start()

    def hold(self, kind: str) -> None:
        self._held.add(kind)
        self._released.clear()

    def release(self) -> None:
        self._held.clear()
        self._released.set()

    def stop(self) -> None:
        self._stopped.set()
        self._released.set()
        if self._stream is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed: the stream is over
                self._stream[0].call_soon_threadsafe(self._stream[1].cancel)

    def _beat_loop(self) -> None:
        while not self._stopped.wait(0.05):
            self.c.heartbeat(
                pb.HeartbeatRequest(
                    node_id=self.node_id, plan_epoch=self.epoch, applied_step=self.applied,
                    state_epoch=self.state_epoch, dht_peer_id=self.peer_id,
                )
            )

    def _order_loop(self) -> None:
        asyncio.run(self._take_orders())

    async def _take_orders(self) -> None:
        """The Orders stream, consumed on this node's own event loop as the server's async stream is."""
        self._stream = (asyncio.get_running_loop(), asyncio.current_task())
        if self._stopped.is_set():
            return
        try:
            async for order in self.c.order_stream(self.node_id):
                kind = order.WhichOneof("kind")
                self.orders.append(order)
                if kind in self._held:
                    self._released.wait()
                if self._stopped.is_set() or kind == "shutdown":
                    return
                self._answer(kind, order)
        except asyncio.CancelledError:
            pass

    def _answer(self, kind: str, order: pb.Order) -> None:
        c, me = self.c, self.node_id
        if self.stage < 0 and kind in ("start_step", "commit", "apply", "evaluate"):
            return  # a node without a stage (a new incarnation before its plan) has nothing to do them with
        if kind == "join_averaging":
            self.peer_id = f"peer-{me}"
        elif kind == "plan":
            self.epoch, self.plan = order.plan.epoch, order.plan
            self.stage = next((s.index for s in order.plan.stages if me in s.node_ids), -1)
        elif kind == "load_state":
            self.applied, self.state_epoch = order.load_state.steps_done, order.load_state.plan_epoch
        elif kind == "start_step":
            path = [me] + [s.node_ids[0] for s in self.plan.stages[1:]]  # through the first node of each stage
            for mb in order.start_step.microbatches:
                c.microbatch_done(
                    pb.MicrobatchDoneRequest(node_id=me, step=order.start_step.step, microbatch=mb, path=path,
                                             loss=2.0, plan_epoch=self.epoch)
                )
        elif kind == "commit":
            c.grad_norm(pb.GradNormRequest(node_id=me, step=order.commit.step, sq_norm=0.5, sq_norm_parts=[0.25, 0.25],
                                           plan_epoch=self.epoch))
        elif kind == "evaluate":  # the head's microbatches, scored as the last stage's first node would
            last = self.plan.stages[-1].node_ids[0]
            for mb in order.evaluate.microbatches:
                c.eval_done(pb.EvalDoneRequest(node_id=last, step=order.evaluate.step, microbatch=mb, loss=2.5,
                                               plan_epoch=self.epoch))
        elif kind == "apply":
            self.applied = order.apply.step + 1
            c.step_applied(pb.StepAppliedRequest(node_id=me, step=order.apply.step,
                                                 checksum=f"stage {self.stage} after {self.applied}"))

    def kinds(self) -> list[str]:
        return [o.WhichOneof("kind") for o in self.orders]


@contextmanager
def scripted_run(
    n_nodes: int, stages: int, on_phase: Callable[[int, str, dict[str, ScriptedNode]], None] | None = None,
    make_coordinator: Callable[[EventSink], Coordinator] | None = None, unreachable: Collection[str] = (),
) -> Iterator[tuple[Coordinator, dict[str, ScriptedNode], dict]]:
    """A coordinator's run() in a thread with n scripted nodes (those named in `unreachable` behind NAT);
    on_phase(step, phase, nodes) is called at each phase change (from the step driver's thread, before the phase's
    orders go out); always stops everything."""
    phases: list[tuple[int, str]] = []
    nodes: dict[str, ScriptedNode] = {}

    def on_event(kind: str, data: dict) -> None:
        if kind == "phase":
            phases.append((data["step"], data["phase"]))
            if on_phase is not None:
                on_phase(data["step"], data["phase"], nodes)

    c = make_coordinator(on_event) if make_coordinator else Coordinator(_config(n_nodes, stages), on_event=on_event)
    result: dict = {"phases": phases}

    def run() -> None:
        try:
            result["summary"] = c.run()
        except Exception as e:  # handed to the test
            result["error"] = e

    for i in range(n_nodes):
        node_id = f"node-{i + 1}"
        nodes[node_id] = ScriptedNode(c, node_id, f"10.0.0.{i + 1}:1", node_id in unreachable)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield c, nodes, result
        thread.join(40)
        assert not thread.is_alive(), "the run did not finish"
        if "error" in result:
            raise result["error"]
    finally:
        c.stop_requested.set()
        c.shutdown_nodes("test over", grace_s=0.5)
        for node in nodes.values():
            node.stop()
        thread.join(5)


def _summary(result: dict) -> RunSummary:
    return result["summary"]


def test_every_step_passes_every_phase_in_order():
    with scripted_run(2, 2) as (c, nodes, result):
        pass
    expected = ["dispatched", "microbatches_done", "norms_in", "decided", "applied", "committed"]
    for step in range(STEPS):
        validated = ["evaluating"] if step == STEPS - 1 else []  # the last step is validated (run.eval_every=0)
        assert [p for s, p in result["phases"] if s == step] == expected + validated
    assert _summary(result).steps == STEPS and _summary(result).val_loss == 2.5 and c.failures == 0
    assert c.driver.phase.value == "idle"
    assert {m.lifecycle.value for m in c.members.values()} == {"serving"}
    assert all(r.loss == 2.0 for r in c.store.steps())


def test_only_replicas_join_averaging_and_before_their_plan():
    # 3 nodes on 2 stages: one stage has two replicas, which must join the DHT (a process and a p2p daemon each) and
    # be in the plan with their peer ids; the lone node never starts hivemind.
    with scripted_run(3, 2) as (c, nodes, result):
        pass
    assert _summary(result).steps == STEPS
    replicated = next(s for s in c.plan.stages if len(s.node_ids) == 2)
    for node_id, node in nodes.items():
        kinds = node.kinds()
        if node_id in replicated.node_ids:
            assert kinds.count("join_averaging") == 1 and kinds.index("join_averaging") < kinds.index("plan"), kinds
            assert list(replicated.peer_ids)[list(replicated.node_ids).index(node_id)] == f"peer-{node_id}"
        else:
            assert "join_averaging" not in kinds, (node_id, kinds)


def test_a_node_restarted_inside_a_decided_step_does_not_undo_it():
    restarted: dict[str, ScriptedNode] = {}

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if step == 1 and phase == "decided" and not restarted:
            nodes["node-4"].stop()  # the process dies; a new one takes the id back from another address
            restarted["node-4"] = ScriptedNode(nodes["node-4"].c, "node-4", "10.0.0.44:1")

    with scripted_run(4, 2, on_phase) as (c, nodes, result):
        pass
    assert _summary(result).steps == STEPS
    assert [r.step for r in c.store.steps()] == list(range(STEPS)), "step 1 committed once, not redone"
    new = restarted["node-4"]
    loads = [o.load_state for o in new.orders if o.WhichOneof("kind") == "load_state"]
    assert loads and loads[0].steps_done == 2, "it took up the committed state of step 1 from its replica"
    assert "join_averaging" in new.kinds(), "the new incarnation has no DHT yet: it is told to join"
    replica = next(n for n in ("node-3", "node-1", "node-2") if n in c.plan.stages[new.stage].node_ids and n != "node-4")
    assert loads[0].source_address == c.members[replica].address
    assert any(k == "rejoin" for _, k, _, _ in c.store.events())


def test_a_lost_replica_fails_the_step_which_runs_again_without_it():
    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if step == 1 and phase == "microbatches_done":
            nodes["node-4"].stop()  # a stage-1 replica: the step waits for its norm until it is declared dead

    with scripted_run(4, 2, on_phase) as (c, nodes, result):
        pass
    assert _summary(result).steps == STEPS and c.failures == 1
    assert not c.members["node-4"].alive and "node-4" not in [n for s in c.plan.stages for n in s.node_ids]
    starts = [o.start_step.step for n in ("node-1", "node-2", "node-3") for o in nodes[n].orders
              if o.WhichOneof("kind") == "start_step"]
    assert starts.count(1) >= 2, "step 1's microbatches were issued again under the new plan"
    assert [r.step for r in c.store.steps()] == list(range(STEPS))


def test_a_node_that_reports_it_cannot_take_part_fails_the_step_at_once():
    reported: list[float] = []

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if step == 1 and phase == "dispatched" and not reported:
            node = nodes["node-2"]
            reported.append(time.monotonic())
            node.c.report_failure(
                pb.FailureReport(node_id="node-2", peer="node-2", reason=pb.FAILURE_REASON_AVERAGING,
                                 detail="averaging is down", plan_epoch=node.epoch)
            )

    with scripted_run(2, 2, on_phase) as (c, nodes, result):
        pass
    assert _summary(result).steps == STEPS and c.failures == 1
    events = [(k, n, d) for _, k, n, d in c.store.events()]
    assert any(k == "node_failure" and n == "node-2" and "averaging is down" in d for k, n, d in events)
    assert any(k == "failure" and "node-2 cannot take part" in d for k, n, d in events)


def test_a_relay_that_does_not_deliver_is_blamed_and_the_next_plan_relays_through_another_node():
    # node-2 and node-3 are neighbours nobody can dial: their link goes through node-1, the first of the two nodes
    # that can be dialled. node-2 reports that node-1 did not deliver its tensor to node-3.
    reported: list[int] = []

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if step == 1 and phase == "dispatched" and not reported:
            c, epoch = nodes["node-2"].c, nodes["node-2"].epoch
            reported.append(epoch)
            assert [(r.a, r.b, r.relay_id) for r in c.plan.relays] == [("node-2", "node-3", "node-1")]

            def report(node_id: str, relay: str, relayed_to: str, plan_epoch: int) -> None:
                c.report_failure(pb.FailureReport(node_id=node_id, peer=relay, relayed_to=relayed_to,
                                                  plan_epoch=plan_epoch, detail="DEADLINE_EXCEEDED"))

            # About no route of the plan, or of another epoch: nothing changes.
            report("node-4", "node-1", "node-3", epoch)
            report("node-2", "node-4", "node-3", epoch)
            report("node-2", "node-1", "node-3", epoch - 1)
            assert c.members["node-1"].relay_failures == 0 and c.members["node-1"].failed_epoch == 0
            report("node-2", "node-1", "node-3", epoch)

    with scripted_run(4, 4, on_phase, unreachable={"node-2", "node-3"}) as (c, nodes, result):
        pass
    # The step failed at once (not at its timeout) and ran again through node-4; nobody was declared dead.
    assert _summary(result).steps == STEPS and c.failures == 1
    assert [(r.a, r.b, r.relay_id) for r in c.plan.relays] == [("node-2", "node-3", "node-4")]
    assert c.plan.epoch > reported[0] and all(m.alive for m in c.members.values())
    assert [list(s.node_ids) for s in c.plan.stages] == [["node-1"], ["node-2"], ["node-3"], ["node-4"]]
    events = [(k, n, d) for _, k, n, d in c.store.events()]
    assert [(k, n) for k, n, _ in events if k in ("relay_failure", "node_failure", "dead")] == [
        ("relay_failure", "node-1")]
    assert any(k == "failure" and "node-1 cannot take part: it did not relay node-2's tensor to node-3" in d
               for k, _, d in events)


def _short_timeout(on_event: EventSink) -> Coordinator:
    """_config(4, 2) with a 4 s step timeout: a call's deadline is at most 2 s, and so is a stall's allowance."""
    cfg = _config(4, 2)
    cfg.scheduler.step_timeout_s = 4.0
    return Coordinator(cfg, on_event=on_event)


def test_a_holder_that_stalls_is_named_before_the_step_timeout_and_the_step_runs_again_without_it():
    stalled: list[tuple[str, float]] = []

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if step == 1 and phase == "microbatches_done" and not stalled:
            c = nodes["node-1"].c
            stage = next(s for s in c.plan.stages if len(s.node_ids) > 1)  # its replica goes on without it
            holder = stage.node_ids[-1]
            neighbour = c.plan.stages[1 - stage.index].node_ids[0]
            nodes[holder].hold("commit")  # it took the stage, answers heartbeats, and sits on its tensors
            c.report_failure(pb.FailureReport(node_id=neighbour, peer=holder, detail="Forward: DEADLINE_EXCEEDED"))
            stalled.append((holder, time.monotonic()))

    with scripted_run(4, 2, on_phase, make_coordinator=_short_timeout) as (c, nodes, result):
        pass
    holder = stalled[0][0]
    assert c.plan.call_deadline_s == 2.0, "unpriced, nodes cap their calls' deadlines at half the step timeout"
    assert _summary(result).steps == STEPS and c.failures == 1
    failure = next((at, d) for at, k, _, d in c.store.events() if k == "failure")
    assert "stalled past what plan epoch" in failure[1], "named after the plan's allowance, not at the step timeout"
    assert holder in c.planning.left_out() and holder not in [n for s in c.plan.stages for n in s.node_ids]
    assert [(k, n) for _, k, n, _ in c.store.events() if k in ("benched", "dead", "evicted")] == [("benched", holder)]
    assert all(m.offences == 0 for m in c.members.values()), "the neighbour's true report cost it nothing"


def test_the_next_step_starts_while_its_nodes_apply_the_one_before():
    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if step == 0 and phase == "decided":
            nodes["node-2"].hold("apply")  # stage 1 is slow to apply step 0

    with scripted_run(2, 2, on_phase) as (c, nodes, result):
        head = nodes["node-1"]
        wait_until(lambda: [o.start_step.step for o in head.orders if o.WhichOneof("kind") == "start_step"] == [0, 1],
                   20, "step 1 dispatched to the data head")
        assert not c.store.steps(), "step 1 went out before step 0's checksums were in"
        nodes["node-2"].release()
    assert _summary(result).steps == STEPS and c.failures == 0
    assert [r.step for r in c.store.steps()] == list(range(STEPS))


def test_a_step_validated_after_it_is_committed_before_the_next_starts():
    starts: list[tuple[int, int]] = []  # (step dispatched, steps committed by then)

    def make_coordinator(on_event: EventSink) -> Coordinator:
        return Coordinator(_config(2, 2, "run.eval_every=1"), on_event=on_event)

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if phase == "dispatched":
            starts.append((step, len(nodes["node-1"].c.store.steps())))

    with scripted_run(2, 2, on_phase, make_coordinator) as (c, nodes, result):
        pass
    assert _summary(result).steps == STEPS
    assert starts == [(step, step) for step in range(STEPS)]
    assert all(r.val_loss == 2.5 for r in c.store.steps())


def test_a_report_the_accused_answers_in_a_fast_step_is_the_reporters_offence():
    reported: list[str] = []

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if step == 1 and phase == "dispatched" and not reported:
            c = nodes["node-1"].c
            accused, reporter = c.plan.stages[1].node_ids[0], c.plan.stages[0].node_ids[0]
            c.report_failure(pb.FailureReport(node_id=reporter, peer=accused, detail="DEADLINE_EXCEEDED"))
            reported.append(reporter)

    with scripted_run(4, 2, on_phase, make_coordinator=_short_timeout) as (c, nodes, result):
        pass
    assert _summary(result).steps == STEPS and c.failures == 0
    assert {n: m.offences for n, m in c.members.items() if m.offences} == {reported[0]: 1}
    assert c.planning.left_out() == {}


def test_reports_that_contradict_the_plan_are_refused_and_change_nothing():
    refused: list[str] = []

    def forge(call: Callable[[], None]) -> None:
        try:
            call()
        except ReportRefused as e:
            refused.append(str(e))

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        c, epoch = nodes["node-1"].c, nodes["node-1"].epoch
        if step == 1 and phase == "dispatched":
            heads = c.plan.stages[0].node_ids
            forge(lambda: c.microbatch_done(  # a node of stage 1 claims a head's microbatch
                pb.MicrobatchDoneRequest(node_id="node-2", step=1, microbatch=0, path=["node-2", "node-2"], loss=0.1,
                                         plan_epoch=epoch)))
            forge(lambda: c.microbatch_done(  # the right head, a path that skips stage 1's nodes
                pb.MicrobatchDoneRequest(node_id=heads[0], step=1, microbatch=0, path=[heads[0], "intruder"],
                                         loss=0.1, plan_epoch=epoch)))
            forge(lambda: c.microbatch_done(
                pb.MicrobatchDoneRequest(node_id=heads[0], step=1, microbatch=0, path=[heads[0], "node-2"],
                                         loss=float("nan"), plan_epoch=epoch)))
        if step == 1 and phase == "microbatches_done":
            forge(lambda: c.grad_norm(pb.GradNormRequest(node_id="intruder", step=1, sq_norm=1e9, plan_epoch=epoch)))
            forge(lambda: c.grad_norm(pb.GradNormRequest(node_id="node-1", step=1, sq_norm=-1.0, plan_epoch=epoch)))
            for seconds in ({"compute_s_per_microbatch": math.nan}, {"averaging_s": -1.0}, {"averaging_s": 1e9},
                            {"round_trip_s": -1.0}, {"forward_s_per_microbatch": math.nan},
                            {"compute_s_per_microbatch": 0.1, "forward_s_per_microbatch": 0.2}):
                forge(lambda: c.grad_norm(  # measurements outside [0, the step timeout], a forward part over the whole
                    pb.GradNormRequest(node_id="node-1", step=1, sq_norm=0.5, plan_epoch=epoch, **seconds)))
        if step == 1 and phase == "norms_in":  # node-1 reported 0.5 already
            forge(lambda: c.grad_norm(pb.GradNormRequest(node_id="node-1", step=1, sq_norm=1e9, plan_epoch=epoch)))
        if step == 1 and phase == "decided":
            forge(lambda: c.step_applied(pb.StepAppliedRequest(node_id="intruder", step=1, checksum="x")))
        if step == 2 and phase == "evaluating":
            forge(lambda: c.eval_done(pb.EvalDoneRequest(node_id="node-1", step=2, microbatch=0, loss=0.0,
                                                         plan_epoch=epoch)))  # node-1 serves stage 0, not the last

    with scripted_run(2, 2, on_phase) as (c, nodes, result):
        pass
    assert len(refused) == 14, refused
    assert all(r.startswith("report from ") and " refused: " in r for r in refused)
    assert _summary(result).steps == STEPS and c.failures == 0
    assert [r.loss for r in c.store.steps()] == [2.0] * STEPS, "no forged loss was counted"
    assert _summary(result).val_loss == 2.5


@pytest.mark.cluster
def test_geotrain_status_shows_the_phase_of_the_step_in_progress(tmp_path):
    token = new_token()
    processes: list[CoordinatorProcess] = []

    def make_coordinator(on_event: EventSink) -> Coordinator:
        processes.append(CoordinatorProcess(_config(2, 2), token, "127.0.0.1:0", on_event=on_event))
        processes[0].server.start()
        return processes[0].coordinator

    def on_phase(step: int, phase: str, nodes: dict[str, ScriptedNode]) -> None:
        if step == 0 and phase == "decided":
            # The data head sits on step 1's microbatches, which go out as step 0 is applied.
            nodes["node-1"].hold("start_step")

    try:
        with scripted_run(2, 2, on_phase, make_coordinator) as (c, nodes, result):
            process = processes[0]
            wait_until(lambda: len(c.store.steps()) == 1 and c.driver.phase.value == "dispatched", 20,
                       "step 0 to commit with step 1 dispatched")
            shown = run_cli("status", "--coordinator", f"127.0.0.1:{process.port}", "--token", token, timeout=30)
            nodes["node-1"].release()
        assert shown.returncode == 0, shown.stderr
        first = shown.stdout.splitlines()[0]
        assert first.startswith("run training, computing microbatches: step 1/3"), first
        assert "serving" in shown.stdout and "MICROBATCHES/S" in shown.stdout
    finally:
        for process in processes:
            process.close()
