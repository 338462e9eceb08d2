"""The node's runtime in one process: the Stage service's narrow interface, per-link codec state, failure
reports sent at once, and state hand-over when a plan swaps stages."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import queue
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from geotrain.compression import FeedbackState
from geotrain.cli import EXIT_USAGE, main
from geotrain.config import RunConfig, load_config, to_proto
from geotrain.node import stage as stage_module
from geotrain.node.agent import Agent, NodeOptions
from geotrain.node.data import local_tokens
from geotrain.node.dataplane import DataPlane, Encoded
from geotrain.node.model import loss_fn
from geotrain.node.stage import StageRuntime
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import new_token
from geotrain.protocol.identity import NodeKey
from geotrain.scheduler.checkpoint import (
    CHECKPOINT_VERSION, CHECKPOINTS_DIR, MANIFEST, CheckpointStore, Manifest, StageState, stage_checksum,
)
from geotrain.scheduler.recovery import Recovery
from geotrain.scheduler.service import CoordinatorProcess
from geotrain.scheduler.state import STORE_FILE, RunStore, StepRecord
from geotrain.upgrade import upgrade_checkpoints
from tests.conftest import wait_until

NODE = Path(__file__).resolve().parent.parent / "geotrain" / "node"


def test_the_stage_servicer_imports_nothing_of_the_agent_not_even_for_typing():
    tree = ast.parse((NODE / "servicer.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("geotrain.node.agent")}
    assert "geotrain.node" not in imported  # `from geotrain.node import agent` would hide it too


# -- per-link codec state ---------------------------------------------------------------------------------------


class _CountingCodec:
    """A stateful codec whose encode is a slow read-modify-write of its link state: two encodes of one link at once
    lose an update, as two PowerSGD encodes at once would both warm-start from the same factor."""

    name, codec_id = "counting", pb.CODEC_NONE

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = self.most_active = 0

    def new_state(self, error_feedback: bool = True) -> FeedbackState:
        return FeedbackState(error_feedback=error_feedback, q=torch.zeros(1))

    def encode(self, tensor: torch.Tensor, state: FeedbackState) -> bytes:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        seen = state.q.clone()
        time.sleep(0.01)  # widens the window in which another encode of the link would read the same state
        state.q = seen + tensor.sum()
        with self._lock:
            self.active -= 1
        return b"x" * 8


@pytest.mark.timeout(30)
def test_encodes_on_one_link_from_many_threads_leave_the_state_a_single_thread_would():
    plane = DataPlane(new_token(), lambda: "node-1")
    codec = _CountingCodec()
    n_threads, per_thread = 8, 5
    start = threading.Barrier(n_threads)

    def encode_some() -> None:
        start.wait()
        for _ in range(per_thread):
            plane.encode("node-2", "127.0.0.1:1", "forward", codec, torch.ones(3))

    threads = [threading.Thread(target=encode_some) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    # Another link's state is its own, and another codec on the same link starts afresh.
    other = plane.encode("node-3", "127.0.0.1:2", "forward", codec, torch.ones(3))
    assert other.raw_bytes == 12 and other.codec == "counting"

    state = plane._codec_states[("node-2", "127.0.0.1:1", "forward")][1]
    assert codec.most_active == 1
    assert float(state.q) == 3.0 * n_threads * per_thread  # every encode saw the state the one before it left
    assert float(plane._codec_states[("node-3", "127.0.0.1:2", "forward")][1].q) == 3.0


# -- replica averaging's streams --------------------------------------------------------------------------------


def test_a_sender_closes_its_stream_to_a_reducer_once_it_holds_the_parts_it_expects():
    from geotrain.node.averaging import _take_then_close

    closed = []

    async def replies():  # a reducer's stream, which (in hivemind) would end only when the reducer closes it
        try:
            for part in range(5):
                yield part
        finally:
            closed.append(True)

    async def read(n: int) -> list[int]:
        return [part async for part in _take_then_close(replies(), n)]

    assert asyncio.run(read(3)) == [0, 1, 2] and closed == [True]
    assert asyncio.run(read(9)) == [0, 1, 2, 3, 4]  # fewer than expected: hivemind's runner then reports the rest


# -- agents in this process -------------------------------------------------------------------------------------


class _FakeCoordinator:
    """The coordinator's stub as an agent calls it: records failure reports, serves a checkpoint, knows the node."""

    def __init__(self, checkpoint: list[tuple[str, torch.Tensor]] | None = None) -> None:
        self.reports: queue.Queue[pb.FailureReport] = queue.Queue()
        self.checkpoint = checkpoint or []
        self.config = pb.RunConfig()  # the run's, handed out at registration

    def Register(self, request: pb.RegisterRequest, timeout: float) -> pb.RegisterReply:  # noqa: N802
        return pb.RegisterReply(accepted=True, node_id=request.node_id, config=self.config, heartbeat_interval_s=1.0)

    def ReportFailure(self, request: pb.FailureReport, timeout: float) -> pb.Ack:  # noqa: N802
        self.reports.put(request)
        return pb.Ack()

    def Heartbeat(self, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:  # noqa: N802
        return pb.HeartbeatReply(known=True)

    def FetchCheckpoint(self, request: pb.FetchCheckpointRequest, timeout: float):  # noqa: N802
        return framing.state_chunks(self.checkpoint)

    def StepApplied(self, request: pb.StepAppliedRequest, timeout: float) -> pb.Ack:  # noqa: N802
        return pb.Ack()


@pytest.fixture
def make_agent():
    """Agents with a fake coordinator, their Stage service serving on 127.0.0.1; always closed."""
    token, agents = new_token(), []
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])

    def make(node_id: str, coordinator: _FakeCoordinator, **options: Any) -> Agent:
        agent = Agent(NodeOptions(coordinator="127.0.0.1:9", token=token, node_id=node_id, **options))
        agents.append(agent)
        agent.cfg, agent.coordinator = cfg, coordinator
        agent._server.start()
        agent.address = f"127.0.0.1:{agent.port}"
        return agent

    yield make
    for agent in agents:
        agent.close()


def _plan(epoch: int, steps_done: int, total: int, stages: list[tuple[int, int, Agent]]) -> pb.Plan:
    plan = pb.Plan(epoch=epoch, total_layers=total, steps_done=steps_done)
    for i, (start, end, agent) in enumerate(stages):
        plan.stages.add(
            index=i, layer_start=start, layer_end=end, node_ids=[agent.node_id], addresses=[agent.address],
            regions=["local"], public_keys=[agent.key.public],
        )
    return plan


def _start_worker(agent: Agent) -> None:
    threading.Thread(target=agent._work_loop, name="worker", daemon=True).start()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_a_node_listens_for_tensor_streams_only_once_its_run_sends_tensors_over_them(make_agent, transport):
    import grpc

    from geotrain.protocol import geotrain_pb2_grpc as rpc
    from geotrain.protocol.transport import make_channel
    from tests.conftest import expect_status, free_ports

    coordinator = _FakeCoordinator()
    coordinator.config = to_proto(load_config(None, [f"transport.tensor_stream={transport}"]))
    (port,) = free_ports(1)
    agent = make_agent("node-1", coordinator, tensor_port=port)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)  # the run's transport is not known yet
    agent._register()
    if transport == "tcp":
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    channel = make_channel(agent.address, agent.options.token, lambda: "node-2", key=NodeKey.generate())
    try:
        expect_status(grpc.StatusCode.UNIMPLEMENTED, "this node takes tensors by calls only",
                      lambda: rpc.StageStub(channel).OpenTensorStream(pb.TensorStreamRequest(), timeout=10))
    finally:
        channel.close()


@pytest.mark.timeout(30)
def test_a_state_load_failing_its_checksum_is_reported_at_once(make_agent):
    coordinator = _FakeCoordinator()
    agent = make_agent("node-1", coordinator)
    total = agent.cfg.model.total_layers
    coordinator.checkpoint = StageRuntime(agent.cfg, 0, total).full_state()
    _start_worker(agent)
    agent._on_order(pb.Order(plan=_plan(2, 1, total, [(0, total, agent)])))
    agent._on_order(pb.Order(load_state=pb.LoadState(plan_epoch=2, steps_done=1, expected_checksum="not-this-one")))

    report = coordinator.reports.get(timeout=20)
    assert (report.node_id, report.peer) == ("node-1", "node-1")
    assert report.reason == pb.FAILURE_REASON_STATE and report.plan_epoch == 2
    assert "fails its checksum" in report.detail
    assert agent.state_epoch == 0  # the node did not claim the state


@pytest.mark.timeout(30)
def test_a_compute_error_is_reported_once_per_epoch_and_not_for_an_abandoned_epoch(make_agent):
    coordinator = _FakeCoordinator()
    agent = make_agent("node-1", coordinator)
    total = agent.cfg.model.total_layers
    _start_worker(agent)
    agent._on_order(pb.Order(plan=_plan(3, 0, total, [(0, total, agent)])))

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    agent._submit(2, broken, epoch=3)
    report = coordinator.reports.get(timeout=20)
    assert report.peer == "node-1" and report.reason == pb.FAILURE_REASON_COMPUTE and report.plan_epoch == 3
    assert report.detail == "RuntimeError: CUDA error: an illegal memory access"

    # One report fails the epoch: the next failing task of it sends none.
    ran = threading.Event()
    agent._submit(2, broken, epoch=3)
    agent._submit(2, ran.set, epoch=3)  # runs after it: one worker, same priority, queued later
    assert ran.wait(20)
    # A newer plan is on its way: the failing task belonged to an epoch the coordinator has already abandoned.
    agent._newest_epoch = 4
    agent._task_failed(RuntimeError("cancelled with its epoch"))
    agent._sender.shutdown(wait=True)
    assert coordinator.reports.empty()


@pytest.mark.timeout(30)
def test_a_tensor_a_relay_does_not_deliver_is_reported_against_the_relay_not_its_receiver(make_agent):
    coordinator = _FakeCoordinator()
    agent = make_agent("node-2", coordinator)
    payload = bytes(16)
    encoded = Encoded(framing.make_header("", torch.float32, (4,), pb.CODEC_NONE, payload), payload, 16, "none")
    ref = pb.MicrobatchRef(plan_epoch=4, step=1, path=["node-2"])
    with socket.socket() as dead:  # bound, never listening: the relay refuses every connection
        dead.bind(("127.0.0.1", 0))
        route = pb.RelayRoute(a="node-2", b="node-3", relay_id="node-1",
                              relay_address=f"127.0.0.1:{dead.getsockname()[1]}")
        agent.dataplane.set_reversed(set(), {"node-3": route})
        send = lambda: agent.dataplane.send("node-3", "", "forward", ref, encoded)  # noqa: E731
        agent._send(send, "forward to node-3", "node-3", ref.plan_epoch)
        agent._sender.shutdown(wait=True)
    reports = []
    while not coordinator.reports.empty():
        reports.append(coordinator.reports.get())
    # Each refused attempt makes the relay a suspect; the call given up is the relay's failure to reach node-3.
    assert reports and {(r.peer, r.relayed_to) for r in reports[:-1]} == {("node-1", "")}
    last = reports[-1]
    assert (last.node_id, last.peer, last.relayed_to, last.plan_epoch) == ("node-2", "node-1", "node-3", 4)
    assert "forward to node-3 through relay node-1: UNAVAILABLE" in last.detail


@pytest.mark.timeout(30)
def test_a_replica_without_averaging_reports_it_at_its_first_commit(make_agent):
    coordinator = _FakeCoordinator()
    agent = make_agent("node-1", coordinator)
    peer = make_agent("node-2", _FakeCoordinator())
    total = agent.cfg.model.total_layers
    plan = _plan(2, 0, total, [(0, total, agent)])
    plan.stages[0].node_ids.append(peer.node_id)
    plan.stages[0].addresses.append(peer.address)
    plan.stages[0].regions.append("local")
    agent._averaging_ready.set()  # hivemind failed to start: no averager
    _start_worker(agent)
    agent._on_order(pb.Order(plan=plan))
    agent._on_order(pb.Order(commit=pb.CommitStep(plan_epoch=2, step=0)))

    report = coordinator.reports.get(timeout=20)
    assert report.reason == pb.FAILURE_REASON_AVERAGING and report.peer == "node-1"
    assert "not available" in report.detail


@pytest.mark.timeout(30)
def test_a_dht_process_that_is_never_ready_is_shut_down_and_another_started(make_agent, monkeypatch, caplog):
    # hivemind forks the DHT's process from the node, whose gRPC threads may leave a lock taken in the child: such a
    # child dies before it is ready, and waiting on it without a bound left the node out of averaging for good.
    import hivemind

    import geotrain.node.averaging
    import geotrain.node.commit

    class DHT:
        def __init__(self, *, start: bool, await_ready: bool, **kwargs: Any) -> None:
            assert start and not await_ready
            self.dead, self.shut_down = not started, False  # the first one never gets ready
            started.append(self)

        def wait_until_ready(self, timeout: float) -> None:
            assert timeout == geotrain.node.commit._DHT_READY_S
            if self.dead:
                raise TimeoutError

        def shutdown(self) -> None:
            self.shut_down = True

    started: list[DHT] = []

    class Averager:
        peer_id, bytes_sent = "QmReplica", 0

        def __init__(self, dht: DHT) -> None:
            self.dht = dht

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(hivemind, "DHT", DHT)
    monkeypatch.setattr(geotrain.node.averaging, "ReplicaAverager", Averager)
    monkeypatch.setattr(geotrain.node.commit, "tie_children_to_this_process", lambda: None)
    agent = make_agent("node-1", _FakeCoordinator())
    agent._start_averaging(["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"])
    assert [d.shut_down for d in started] == [True, False]
    assert agent._averaging_ready.is_set() and agent.averager.dht is started[1]
    assert "attempt 1 of 3): TimeoutError (not ready within" in caplog.text


def _trained_stages(cfg: RunConfig) -> list[StageRuntime]:
    """The model in two stages, layers [0, 2) and the rest, with state that differs from the seed's (as trained
    steps leave it; under diloco its anchor too)."""
    stages = [StageRuntime(cfg, 0, 2), StageRuntime(cfg, 2, cfg.model.total_layers)]
    with torch.no_grad():
        for stage in stages:
            for p in [*stage.parameters(), *(stage.sync.anchor if stage.sync is not None else [])]:
                p.add_(0.25)
    return stages


def _first_step(checksums: dict[int, str]) -> tuple[StepRecord, dict[int, str]]:
    """Step 0 committed with these stage checksums (its other figures made up)."""
    return StepRecord(step=0, loss=1.0, val_loss=None, tokens_per_s=1.0, seconds=1.0, plan_epoch=1), checksums


@pytest.mark.timeout(60)
@pytest.mark.parametrize("diloco", [False, True], ids=["gradients", "diloco"])
def test_layers_moved_through_a_checkpoint_load_to_the_checksum_the_coordinator_checks(tmp_path, diloco):
    # The coordinator writes a checkpoint from a holder of each stage only when the holder's parameters (under diloco
    # its anchor) have the checksum the stage's replicas reported; a layer range the next plan moves is loaded against
    # a checksum computed from that checkpoint.
    cfg = load_config(None, ["compression.replica_sync=diloco"] if diloco else [])
    total = cfg.model.total_layers
    stages = _trained_stages(cfg)
    store = RunStore()
    store.commit_step(*_first_step({i: stage.checksum() for i, stage in enumerate(stages)}))
    holders = [SimpleNamespace(node_id=f"node-{i}", held=(s.start, s.end), applied_steps=1, unreachable=False,
                               profile=None) for i, s in enumerate(stages)]
    plan = pb.Plan(epoch=1, stages=[pb.StageAssignment(index=i, layer_start=s.start, layer_end=s.end)
                                    for i, s in enumerate(stages)])
    sent = {holder.node_id: dict(stage.full_state()) for holder, stage in zip(holders, stages)}
    recovery = Recovery(CheckpointStore(tmp_path, keep=2), lambda m, rng, steps: framing.state_chunks(sent[m.node_id].items()), store,
                        lambda kind, data: None, diloco)
    manifest = recovery.checkpoint(plan, 1, holders)
    assert manifest is not None

    moved = StageRuntime(cfg, 1, total - 1)
    moved.load_full_state(recovery.checkpoints.load_layers(manifest, 1, total - 1), 1)
    assert recovery.checkpoints.checksum(manifest, 1, total - 1, diloco) == moved.checksum()
    assert recovery.checkpoints.checksum(manifest, 0, 2, diloco) == stages[0].checksum()
    # A holder that sends other parameters than its replicas reported leaves no checkpoint.
    covered = next(k for k in sent["node-1"] if k.startswith("sync.anchor.layers." if diloco else "layers."))
    sent["node-1"][covered] = sent["node-1"][covered] + 1.0
    assert recovery.checkpoint(plan, 1, holders) is None


def _layer_order_checksum(stage: StageRuntime) -> str:
    """A stage's checksum as geotrain computed it before checkpoint version 2 (StageRuntime.checksum until f33b4b1):
    its parameters (under diloco its anchor) in the stage's own order."""
    digest = hashlib.sha256()
    tensors = stage.sync.anchor if stage.sync is not None else stage.parameters()
    for (name, _), p in zip(stage.named_state(), tensors, strict=True):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _as_written_before_version_2(manifest: Manifest) -> None:
    """Drop the version from a checkpoint's manifest, as geotrain wrote them before checkpoint version 2."""
    data = json.loads((manifest.path / MANIFEST).read_text())
    del data["version"]
    (manifest.path / MANIFEST).write_text(json.dumps(data))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("diloco", [False, True], ids=["gradients", "diloco"])
def test_resume_converts_an_older_geotrains_checkpoints_whose_files_pass_their_recorded_checksums(
    tmp_path, diloco, capsys, monkeypatch
):
    # Before checkpoint version 2 a stage's checksum was over its parameters in its own order: a node loading such a
    # checkpoint found another checksum and refused it, plan after plan (about five plan epochs a second, for ever).
    settings = ["compression.replica_sync=diloco"] if diloco else []
    cfg = load_config(None, settings)
    stages = _trained_stages(cfg)
    older = [_layer_order_checksum(stage) for stage in stages]
    assert older != [stage.checksum() for stage in stages]  # the orders differ, or this would prove nothing
    store = RunStore(tmp_path / STORE_FILE)
    store.commit_step(*_first_step(dict(enumerate(older))))
    store.close()
    checkpoints = CheckpointStore(tmp_path / CHECKPOINTS_DIR, keep=3)
    states = [dict(stage.full_state()) for stage in stages]
    _as_written_before_version_2(checkpoints.write(
        1, 1, [StageState(s.start, s.end, checksum, state) for s, checksum, state in zip(stages, older, states)]
    ))
    with pytest.raises(ValueError, match="written by an older geotrain: resume with `geotrain coordinator --resume`"):
        CoordinatorProcess(cfg, new_token(), "127.0.0.1:0", state_dir=tmp_path, resume=True)

    assert upgrade_checkpoints(tmp_path, cfg) == 1
    (manifest,) = checkpoints.complete()
    assert manifest.version == CHECKPOINT_VERSION
    # What each stage's node computes once it loaded the checkpoint, and what the committed step says.
    assert [checkpoints.checksum(manifest, s.start, s.end, diloco) for s in stages] == [s.checksum() for s in stages]
    store = RunStore(tmp_path / STORE_FILE)
    assert store.checksums(0) == {i: stage.checksum() for i, stage in enumerate(stages)}
    store.close()
    assert upgrade_checkpoints(tmp_path, cfg) == 0

    # A stage file changed since it was written: resuming refuses it in one line that names it, and converts nothing.
    covered = next(k for k in states[0] if k.startswith("sync.anchor.layers." if diloco else "layers."))
    states[0][covered] = states[0][covered] + 1.0
    _as_written_before_version_2(checkpoints.write(
        2, 1, [StageState(s.start, s.end, checksum, state) for s, checksum, state in zip(stages, older, states)]
    ))
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")  # what main sets for gRPC's C core, undone after the test
    capsys.readouterr()
    code = main(["coordinator", "--token", "t", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path), "--resume",
                 *(arg for s in settings for arg in ("--set", s))])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and len(lines) == 1, lines
    assert "stage-0000-0002.safetensors does not match the checksum recorded when it was written" in lines[0]
    assert [m.version for m in checkpoints.complete()] == [CHECKPOINT_VERSION, 1]


@pytest.mark.timeout(60)
def test_resume_converts_version_2_checkpoints_whose_checksums_were_sha256(tmp_path):
    # Version 2 recorded sha256 over the parameters in name order; a node now reports blake3 over the same bytes.
    cfg = load_config(None, [])
    stages = _trained_stages(cfg)
    states = [dict(stage.full_state()) for stage in stages]
    older = [stage_checksum(state, False, hashlib.sha256) for state in states]
    assert older != [stage.checksum() for stage in stages]
    store = RunStore(tmp_path / STORE_FILE)
    store.commit_step(*_first_step(dict(enumerate(older))))
    store.close()
    checkpoints = CheckpointStore(tmp_path / CHECKPOINTS_DIR, keep=3)
    written = checkpoints.write(
        1, 1, [StageState(s.start, s.end, checksum, state) for s, checksum, state in zip(stages, older, states)]
    )
    data = json.loads((written.path / MANIFEST).read_text())
    (written.path / MANIFEST).write_text(json.dumps({**data, "version": 2}))

    assert upgrade_checkpoints(tmp_path, cfg) == 1
    (manifest,) = checkpoints.complete()
    assert manifest.version == CHECKPOINT_VERSION
    assert [checkpoints.checksum(manifest, s.start, s.end, False) for s in stages] == [s.checksum() for s in stages]
    store = RunStore(tmp_path / STORE_FILE)
    assert store.checksums(0) == {i: stage.checksum() for i, stage in enumerate(stages)}
    store.close()


@pytest.mark.timeout(60)
def test_two_nodes_swapping_stages_each_fetch_the_state_the_other_held(make_agent):
    a, b = make_agent("node-a", _FakeCoordinator()), make_agent("node-b", _FakeCoordinator())
    total = a.cfg.model.total_layers
    cut = total // 2
    for agent in (a, b):
        agent._apply_plan(_plan(1, 0, total, [(0, cut, a), (cut, total, b)]))
        runtime = agent.runtime
        with torch.no_grad():  # stands for a trained step: its state differs from the seed's
            for p in runtime.parameters():
                p.add_(0.25)
        runtime.load_full_state(dict(runtime.full_state()), 1)
    held = {a.node_id: a.runtime.checksum(), b.node_id: b.runtime.checksum()}

    # After a coordinator restart the planner swaps them; each applies the plan before the other has fetched.
    swapped = _plan(2, 1, total, [(0, cut, b), (cut, total, a)])
    a._apply_plan(swapped)
    b._apply_plan(swapped)
    # Layers taken over after step 0 are built for the load, uninitialised: they serve no state until it is whole.
    assert a.state_snapshot(0) is None and b.state_snapshot(0) is None
    a._load_state(pb.LoadState(plan_epoch=2, steps_done=1, source_address=b.address, expected_checksum=held["node-b"]))
    b._load_state(pb.LoadState(plan_epoch=2, steps_done=1, source_address=a.address, expected_checksum=held["node-a"]))
    assert (a.runtime.start, a.runtime.end, a.runtime.checksum()) == (cut, total, held["node-b"])
    assert (b.runtime.start, b.runtime.end, b.runtime.checksum()) == (0, cut, held["node-a"])
    assert a.state_epoch == b.state_epoch == 2

    # A plan at the same step that gives the layers back finds them kept; one past that step lets them go.
    a._apply_plan(_plan(3, 1, total, [(0, cut, a), (cut, total, b)]))
    assert (a.runtime.start, a.runtime.checksum(), a.runtime.applied_step) == (0, held["node-a"], 0)
    assert a.state_snapshot(1, (cut, total)) is not None  # the layers it loaded in epoch 2, kept for b
    a._apply_plan(_plan(4, 2, total, [(0, cut, a), (cut, total, b)]))
    assert a.state_snapshot(1, (cut, total)) is None


@pytest.mark.timeout(60)
def test_a_node_whose_layers_a_plan_splits_anew_keeps_no_copy_of_them(make_agent):
    a, b = make_agent("node-a", _FakeCoordinator()), make_agent("node-b", _FakeCoordinator())
    total = a.cfg.model.total_layers
    cut = total // 2
    a._apply_plan(_plan(1, 0, total, [(0, cut, a), (cut, total, b)]))
    a.runtime.load_full_state(dict(a.runtime.full_state()), 1)  # it holds step 1, committed
    # The new cut leaves no stage of a's layers: every stage loads from the checkpoint the coordinator writes first.
    a._apply_plan(_plan(2, 1, total, [(0, cut - 1, a), (cut - 1, total, b)]))
    assert (a.runtime.start, a.runtime.end) == (0, cut - 1)
    assert a.state_snapshot(1, (0, cut)) is None and a.held.get((0, cut), 1) is None


@pytest.mark.timeout(30)
def test_fetch_state_goes_only_to_plan_keys_and_refuses_an_empty_layer_range(make_agent):
    import grpc

    from geotrain.protocol import geotrain_pb2_grpc as rpc
    from geotrain.protocol.transport import make_channel

    agent = make_agent("node-a", _FakeCoordinator())
    total = agent.cfg.model.total_layers
    plan = _plan(1, 0, total, [(0, total, agent)])
    coordinator_key = NodeKey.generate()
    plan.coordinator_key = coordinator_key.public
    agent._apply_plan(plan)
    # Only the plan's coordinator (or a node of the plan) may download state: not a token holder's own key, nor none.
    for key in (NodeKey.generate(), None):
        stranger = make_channel(agent.address, agent.options.token, lambda: "node-b", key=key)
        with pytest.raises(grpc.RpcError) as err:
            list(rpc.StageStub(stranger).FetchState(pb.FetchStateRequest(steps_done=0), timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "signed by their keys" in err.value.details()
        stranger.close()
    channel = make_channel(agent.address, agent.options.token, lambda: "node-b", key=coordinator_key)
    try:
        stub = rpc.StageStub(channel)
        for request, code, message in [
            (pb.FetchStateRequest(steps_done=0, layer_start=3, layer_end=1), grpc.StatusCode.INVALID_ARGUMENT,
             "empty layer range [3, 1)"),
            (pb.FetchStateRequest(steps_done=0, layer_start=0, layer_end=1), grpc.StatusCode.FAILED_PRECONDITION,
             "this node holds no layers [0, 1) after 0 steps"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.FetchState(request, timeout=10))
            assert (err.value.code(), err.value.details()) == (code, message)
        # Its whole stage at step 0 it does hold.
        whole = pb.FetchStateRequest(steps_done=0, layer_start=0, layer_end=total)
        assert framing.read_state(stub.FetchState(whole, timeout=10)).keys() == dict(agent.runtime.full_state()).keys()
    finally:
        channel.close()


@pytest.mark.timeout(30)
def test_a_boundary_rank_stage_takes_k_wide_activations_and_refuses_full_width_ones_by_calls_and_streams(make_agent):
    import grpc

    from geotrain.compression import get_codec
    from geotrain.compression.policy import CodecPolicy
    from geotrain.protocol import geotrain_pb2_grpc as rpc
    from geotrain.protocol.transport import make_channel
    from tests.conftest import expect_status, tensor_chunks

    a, b = make_agent("node-a", _FakeCoordinator()), make_agent("node-b", _FakeCoordinator())
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16",
                             "model.boundary_rank=4"])
    total = cfg.model.total_layers
    b.cfg = cfg
    b._policies = {"activations": CodecPolicy("activations", cfg.compression.activations)}
    plan = _plan(1, 0, total, [(0, 2, a), (2, total, b)])
    b._apply_plan(plan)
    channel = make_channel(b.address, b.options.token, lambda: a.node_id, key=a.key)
    try:
        forward = rpc.StageStub(channel).Forward
        ref = pb.MicrobatchRef(plan_epoch=1, step=0, microbatch=0, path=[a.node_id], eval=True)
        rows = (cfg.train.microbatch_size, cfg.model.seq_len)
        for width in (cfg.model.d_model, 5):  # the stream's full width, and one more than the rank
            expect_status(grpc.StatusCode.INVALID_ARGUMENT, f"expected shape [{rows[0]}, {rows[1]}, 4]",
                          lambda: forward(iter(tensor_chunks(torch.randn(*rows, width), ref)), timeout=10))
        assert forward(iter(tensor_chunks(torch.randn(*rows, 4), ref)), timeout=10) == pb.Ack()
        # Over a raw tensor stream, the same checks against the plan (the stream opens for a, b's neighbour).
        b.listen_for_tensor_streams()
        a.dataplane.use_tensor_streams(True)

        def send(width: int) -> None:
            tensor = torch.randn(*rows, width)
            a.dataplane.send(b.node_id, b.address, "forward", ref,
                             a.dataplane.encode(b.node_id, b.address, "forward", get_codec("none"), tensor))

        for width in (cfg.model.d_model, 5):
            expect_status(grpc.StatusCode.INVALID_ARGUMENT, f"expected shape [{rows[0]}, {rows[1]}, 4]",
                          lambda: send(width))
        send(4)
        assert b.tensor_streams.open_connections() == 1
    finally:
        channel.close()


@pytest.mark.timeout(30)
def test_activations_of_the_next_step_wait_for_the_apply_and_none_come_from_further_ahead(make_agent):
    # The coordinator starts step 1 as its nodes apply step 0: step 1's first activations may reach a stage before
    # the order to apply step 0 does. They are taken, and computed once the stage has applied; step 2's are refused.
    import grpc

    from geotrain.compression.policy import CodecPolicy
    from geotrain.node.worker import CONTROL
    from geotrain.protocol import geotrain_pb2_grpc as rpc
    from geotrain.protocol.transport import make_channel
    from tests.conftest import expect_status, tensor_chunks

    a, b = make_agent("node-a", _FakeCoordinator()), make_agent("node-b", _FakeCoordinator())
    cfg = b.cfg
    total = cfg.model.total_layers
    b._policies = {kind: CodecPolicy(kind, "none") for kind in ("activations", "activation_grads")}
    b.corpus = local_tokens(cfg)  # the last stage's targets
    b._apply_plan(_plan(1, 0, total, [(0, 2, a), (2, total, b)]))
    _start_worker(b)
    channel = make_channel(b.address, b.options.token, lambda: a.node_id, key=a.key)
    shape = (cfg.train.microbatch_size, cfg.model.seq_len, cfg.model.d_model)
    try:
        forward = rpc.StageStub(channel).Forward

        def activations(step: int) -> list[pb.TensorChunk]:
            ref = pb.MicrobatchRef(plan_epoch=1, step=step, microbatch=0, path=[a.node_id])
            return tensor_chunks(torch.randn(*shape), ref)

        assert forward(iter(activations(1)), timeout=10) == pb.Ack()
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, "step 2, this node applied step -1",
                      lambda: forward(iter(activations(2)), timeout=10))
        assert len(b._parked) == 1 and b.runtime.grads is None, "step 1's forward waits for step 0's apply"
        b._submit(CONTROL, lambda: b._apply(pb.ApplyStep(step=0, clip_coef=1.0, lr=1e-3)))
        wait_until(lambda: b.runtime.grads is not None and b.runtime.grads.counted == {0}, 10,
                   "step 1's microbatch computed after the apply")
        assert b.runtime.applied_step == 0 and b.runtime.grads.step == 1
    finally:
        channel.close()


@pytest.mark.timeout(60)
def test_a_stage_held_alone_reports_its_norm_without_waiting_for_the_commit_order(make_agent):
    # The coordinator's commit order comes once the data heads have reported every microbatch; a stage nobody else
    # holds knows before that its gradients are complete, and its report saves the order's round trip.
    class Coordinator(_FakeCoordinator):
        def __init__(self) -> None:
            super().__init__()
            self.norms: queue.Queue[pb.GradNormRequest] = queue.Queue()

        def MicrobatchDone(self, request: pb.MicrobatchDoneRequest, timeout: float) -> pb.Ack:  # noqa: N802
            return pb.Ack()

        def GradNorm(self, request: pb.GradNormRequest, timeout: float) -> pb.Ack:  # noqa: N802
            self.norms.put(request)
            return pb.Ack()

    coordinator = Coordinator()
    agent = make_agent("node-1", coordinator)
    cfg = agent.cfg
    total, microbatches = cfg.model.total_layers, cfg.train.microbatches
    agent.corpus = local_tokens(cfg)
    agent._apply_plan(_plan(1, 0, total, [(0, total, agent)]))
    _start_worker(agent)
    agent._on_order(pb.Order(start_step=pb.StartStep(
        step=0, microbatches=range(microbatches), total_microbatches=microbatches)))

    report = coordinator.norms.get(timeout=30)
    assert (report.node_id, report.step, report.plan_epoch) == ("node-1", 0, 1)
    assert report.sq_norm > 0 and len(report.sq_norm_parts) == len(agent.runtime.parameters())
    agent._on_order(pb.Order(commit=pb.CommitStep(plan_epoch=1, step=0)))
    agent._on_order(pb.Order(apply=pb.ApplyStep(step=0, clip_coef=1.0, lr=1e-3)))
    wait_until(lambda: agent.runtime.applied_step == 0, 10, "step 0 applied")
    assert coordinator.norms.empty(), "the commit order found the norm reported, and sent no second one"


@pytest.mark.timeout(60)
@pytest.mark.skipif(stage_module._gradsums is None, reason="the gradient sums' C kernels are not built")
def test_the_gradient_sums_c_kernels_compute_torchs_bits(monkeypatch):
    # node/_gradsums.c must give what torch's zeros_like + add_, div_ + cast and the squares' sums give, bit for bit:
    # a node without a C compiler trains the same run. Both runs see the same microbatches, in the same order.
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])
    corpus = local_tokens(cfg)

    def gradients(mean_at: int = 0) -> tuple[list[torch.Tensor], list[float]]:
        stage = StageRuntime(cfg, 0, cfg.model.total_layers)
        stage.mean_at = mean_at
        for microbatch in range(3):
            x, y = corpus.batch(seed=1, step=0, microbatch=microbatch, size=2, seq_len=cfg.model.seq_len)
            stage.forward((0, microbatch), x)
            stage.loss_backward((0, microbatch), y)
        stage.mean_gradients(0)
        return [g.clone() for g in stage.gradients()], stage.grad_sq_norm_parts()

    kernels = stage_module._gradsums
    # Each way: the mean taken by mean_gradients, or as the last microbatch is added (a stage held alone).
    with_kernels = [gradients(), gradients(mean_at=3)]
    monkeypatch.setattr(stage_module, "_gradsums", None)
    without = [gradients(), gradients(mean_at=3)]
    reference, parts = without[0]
    for grads, norm_parts in with_kernels + without[1:]:
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(grads, reference))
        assert norm_parts == parts
    # The norm's parts: what torch sums over the gradients widened and squared, as every version before summed them.
    assert parts == [g.double().pow(2).sum().item() for g in reference]

    # Values across float32's range, signed zeros, Inf and NaN, through both kernels.
    values = torch.tensor([0.0, -0.0, 1e-45, -3e38, 3e38, float("inf"), float("nan"), 1.0 / 3, -7.25e-20])
    grads = [values[torch.randperm(len(values))] * s for s in (1.0, -1.0, 0.5)]
    sums = torch.empty(len(values), dtype=torch.float64)
    expected = torch.zeros_like(sums)
    for i, g in enumerate(grads):
        kernels.accumulate(sums.numpy(), g.numpy(), i == 0)
        expected.add_(g)
    assert torch.equal(sums.view(torch.int64), expected.view(torch.int64))
    for count in (3, 7):
        out, squares = torch.empty(len(values)), sums.clone()
        kernels.mean_squares(out.numpy(), squares.numpy(), count)
        assert torch.equal(out.view(torch.int32), expected.div(count).float().view(torch.int32))
        assert torch.equal(squares.view(torch.int64), out.double().mul(out.double()).view(torch.int64))
        fused, fused_out = torch.empty_like(sums), torch.empty(len(values))
        for i, g in enumerate(grads[:-1]):
            kernels.accumulate(fused.numpy(), g.numpy(), i == 0)
        kernels.accumulate_mean_squares(fused.numpy(), grads[-1].numpy(), fused_out.numpy(), False, count)
        assert torch.equal(fused_out.view(torch.int32), out.view(torch.int32))
        assert torch.equal(fused.view(torch.int64), squares.view(torch.int64))
    with pytest.raises(ValueError, match="not the same elements"):
        kernels.accumulate(sums.numpy(), values[:4].numpy(), False)
    with pytest.raises(ValueError, match="a mean over 0 microbatches"):
        kernels.mean_squares(out.numpy(), sums.numpy(), 0)


@pytest.mark.timeout(30)
def test_the_norm_squares_a_gradient_written_after_the_mean():
    # PowerSGD's averaging replaces the mean in place: the squares the mean left are then stale.
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])
    stage = StageRuntime(cfg, 0, cfg.model.total_layers)
    x, y = local_tokens(cfg).batch(seed=1, step=0, microbatch=0, size=2, seq_len=cfg.model.seq_len)
    stage.forward((0, 0), x)
    stage.loss_backward((0, 0), y)
    stage.mean_gradients(0)
    first = stage.gradients()[0]
    first.mul_(3.0)
    parts = stage.grad_sq_norm_parts()
    assert parts == [g.double().pow(2).sum().item() for g in stage.gradients()]
    assert parts[0] > 0


@pytest.mark.timeout(30)
def test_a_stage_adds_each_gradient_as_backward_makes_it_to_what_autograd_grad_gives():
    # Each microbatch's gradients are added as backward produces them; the mean must be what each microbatch's
    # torch.autograd.grad summed in float64 gives, and the gradient sent back that of the stage's input.
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])
    corpus = local_tokens(cfg)
    first, last = StageRuntime(cfg, 0, 2), StageRuntime(cfg, 2, cfg.model.total_layers)
    reference = StageRuntime(cfg, 2, cfg.model.total_layers)
    params = reference.parameters()
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for microbatch in range(3):
        x, y = corpus.batch(seed=1, step=0, microbatch=microbatch, size=2, seq_len=cfg.model.seq_len)
        h = first.forward((0, microbatch), x)
        last.forward((0, microbatch), h)
        _, sent = last.loss_backward((0, microbatch), y)
        inputs = h.clone().requires_grad_(True)
        *grads, grad_in = torch.autograd.grad(loss_fn(reference._run(inputs), y), [*params, inputs])
        for total, g in zip(sums, grads):
            total.add_(g)
        assert torch.equal(sent, grad_in)
    last.mean_gradients(0)
    for g, total in zip(last.gradients(), sums):
        assert torch.equal(g.view(torch.int32), total.div(3).float().view(torch.int32))


@pytest.mark.timeout(30)
def test_a_backward_failing_partway_leaves_its_step_unusable():
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])
    stage = StageRuntime(cfg, 0, cfg.model.total_layers)
    batch = local_tokens(cfg).batch(seed=1, step=0, microbatch=0, size=2, seq_len=cfg.model.seq_len)

    def refuse(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory")

    # The embedding's gradient comes last, after the later layers' have been added.
    hook = stage.parameters()[0].register_hook(refuse)
    stage.forward((0, 0), batch[0])
    with pytest.raises(RuntimeError, match="out of memory"):
        stage.loss_backward((0, 0), batch[1])
    hook.remove()
    stage.forward((0, 1), batch[0])
    with pytest.raises(ValueError, match="failed partway"):
        stage.loss_backward((0, 1), batch[1])
    with pytest.raises(ValueError, match="failed partway"):
        stage.mean_gradients(0)
    stage.reset_step()  # a new plan epoch redoes the step
    stage.forward((0, 0), batch[0])
    stage.loss_backward((0, 0), batch[1])
    assert stage.mean_gradients(0) == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mean_at", [0, 2], ids=["at_mean_gradients", "with_the_last_microbatch"])
def test_each_step_writes_its_mean_gradients_where_the_last_step_did(mean_at):
    # A fresh mean each step was faulted in and zeroed by the kernel; the same tensors take every step's, and the
    # values stay those of a stage that allocated them anew (a second stage, reset before every step).
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])
    corpus = local_tokens(cfg)
    reused, fresh = StageRuntime(cfg, 0, cfg.model.total_layers), StageRuntime(cfg, 0, cfg.model.total_layers)
    reused.mean_at = fresh.mean_at = mean_at
    previous = None
    for step in range(3):
        fresh.reset_step()
        for stage in (reused, fresh):
            for microbatch in range(2):
                x, y = corpus.batch(seed=1, step=step, microbatch=microbatch, size=2, seq_len=cfg.model.seq_len)
                stage.forward((step, microbatch), x)
                stage.loss_backward((step, microbatch), y)
            stage.mean_gradients(step)
        means = reused.gradients()
        assert previous is None or all(a is b for a, b in zip(means, previous, strict=True))
        previous = means  # held: a stage allocating anew could not take the same memory
        assert all(torch.equal(a, b) for a, b in zip(reused.gradients(), fresh.gradients()))
        assert reused.grad_sq_norm_parts() == fresh.grad_sq_norm_parts()
        for stage in (reused, fresh):
            stage.apply(step, 0.5, 1e-3)
    reused.reset_step()  # a runtime kept for a stage's new holder keeps no mean buffers
    assert reused._means == []
