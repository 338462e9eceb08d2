"""State that streams: a tensor larger than 1 GiB through a state transfer in bounded memory, checkpoints written
while the run trains on and served a range at a time, incoming state checked against the stage's shapes, and
deadlines that follow the bytes (issue 28). In process, on small models; the big tensor is never materialised."""

from __future__ import annotations

import itertools
import ssl
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
import pytest
import torch

from geotrain.config import load_config
from geotrain.node.handover import Snapshots, StateSnapshot, transfer_memory_bytes
from geotrain.node.reverse import ReverseSender
from geotrain.node.servicer import StageServicer, add_stage_service
from geotrain.node.holder import StateExpectation
from geotrain.node.stage import StageRuntime
from geotrain.node.dataplane import AdaptiveDeadline
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import statestream
from geotrain.protocol.auth import RefusalLog, new_token
from geotrain.protocol.framing import FrameError
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.limits import LimitValues, PeerLimits
from geotrain.protocol.tensorstream import TensorStreamServer
from geotrain.protocol.tls import TlsFiles, init_run_tls
from geotrain.protocol.transport import make_server
from geotrain.scheduler import checkpoint as checkpoint_module
from geotrain.scheduler.checkpoint import CheckpointStore, state_bound, stage_checksum
from geotrain.scheduler.recovery import Recovery
from geotrain.scheduler.service import stage_state_stream
from geotrain.scheduler.state import RunStore, StepRecord
from geotrain.scheduler.stepdriver import StepDriver, call_deadline_s


def _cfg():
    return load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])


def _zeros_source(name: str, elements: int) -> framing.StateSource:
    """A float32 tensor of `elements` zeros that exists only as the chunks read from it."""
    zero = bytes(framing.CHUNK_BYTES)
    crc, left = 0, elements * 4
    while left:
        crc = zlib.crc32(zero[: min(left, len(zero))], crc)
        left -= min(left, len(zero))
    return framing.StateSource(name, torch.float32, (elements,), lambda: crc, lambda at, n: zero[:n])


class _CountingSink(framing.StateSink):
    """Takes each chunk and keeps only how many bytes came."""

    def __init__(self) -> None:
        self.bytes = 0

    def begin(self, header: pb.TensorHeader):  # noqa: D102
        def write(data: memoryview) -> None:
            self.bytes += len(data)

        return write


@pytest.mark.timeout(60)
def test_a_tensor_larger_than_a_gib_streams_through_a_state_transfer_in_bounded_memory():
    elements = (1 << 28) + (1 << 20)  # 1.004 GiB of float32: over the old per-tensor cap
    sink = _CountingSink()
    tracemalloc.start()
    try:
        receiver = framing.receive_state(framing.state_stream([_zeros_source("layers.0.tok.weight", elements)]), sink)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sink.bytes == elements * 4 > framing.MAX_TENSOR_BYTES and receiver.tensors == 1
    assert peak < 16 * framing.CHUNK_BYTES  # a few chunks, not the tensor

    # The coordinator's bound comes from the plan's shapes: an 8B llama's embedding passes, a larger one does not.
    bound = state_bound([[(128256, 4096)]], diloco=False)
    header = pb.TensorHeader(name="layers.0.tok.weight", dtype=pb.DTYPE_FLOAT32, shape=[128256, 4096],
                             codec=pb.CODEC_NONE, payload_bytes=128256 * 4096 * 4)
    assert header.payload_bytes <= bound.tensor_bytes and header.payload_bytes > framing.MAX_TENSOR_BYTES
    header.shape[:] = [4 * 128256, 4096]
    header.payload_bytes *= 4
    assert header.payload_bytes > bound.tensor_bytes


@pytest.mark.timeout(30)
def test_a_stage_file_written_as_it_streams_reads_back_and_serves_only_the_asked_layers(tmp_path, monkeypatch):
    cfg = _cfg()
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers)
    state = dict(runtime.full_state())
    store = CheckpointStore(tmp_path, keep=2)
    pending = store.begin(1, 1)
    writer = pending.stage(0, cfg.model.total_layers, "")
    framing.receive_state(framing.state_chunks(sorted(state.items())), writer)
    assert writer.finish() == stage_checksum(state, diloco=False)  # computed as the bytes passed
    writer.close()
    manifest = pending.commit()
    loaded = store.load_layers(manifest, 0, cfg.model.total_layers)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())

    read = []
    real_pread = checkpoint_module.os.pread
    monkeypatch.setattr(checkpoint_module.os, "pread", lambda fd, n, at: read.append(n) or real_pread(fd, n, at))
    sent = framing.read_state(framing.state_stream(store.layer_sources(manifest, 1, 2)))
    assert sent and all(k.startswith("layers.1.") for k in sent)
    assert all(torch.equal(sent[k], state[k]) for k in sent)
    asked = sum(t.numel() * t.element_size() for t in sent.values())
    whole = sum(t.numel() * t.element_size() for t in state.values())
    header = checkpoint_module.HEADER_RESERVE + 8  # read when the file is listed, and when it is served
    assert asked < whole / 2 and asked <= sum(read) <= asked + 2 * header  # the other layers' tensors are not read
    assert store.checksum(manifest, 1, 2, diloco=False) == stage_checksum(sent, diloco=False)


@pytest.mark.timeout(60)
def test_a_header_larger_than_its_reserve_moves_the_data_and_the_file_reads_back_whole(tmp_path, monkeypatch):
    reserve = 4096 - 8  # the smallest that keeps the data aligned
    monkeypatch.setattr(checkpoint_module, "HEADER_RESERVE", reserve)
    cfg = load_config(None, ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])
    state = dict(StageRuntime(cfg, 0, cfg.model.total_layers).full_state())
    store = CheckpointStore(tmp_path, keep=2)
    manifest = store.write(1, 1, [checkpoint_module.StageState(0, cfg.model.total_layers, "", state)])
    with open(manifest.path / manifest.stages[0]["file"], "rb") as f:
        assert int.from_bytes(f.read(8), "little") > reserve
    back = store.load_layers(manifest, 0, cfg.model.total_layers)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert store.checksum(manifest, 0, cfg.model.total_layers, diloco=False) == stage_checksum(state, diloco=False)


def test_the_final_model_is_written_from_stage_streams_with_its_parameters_only(tmp_path):
    from safetensors import safe_open

    cfg = _cfg()
    total, cut = cfg.model.total_layers, cfg.model.total_layers // 2
    stages = [StageRuntime(cfg, 0, cut), StageRuntime(cfg, cut, total)]
    path = tmp_path / "final.safetensors"
    writer = checkpoint_module.ModelFileWriter(path, total, {"geotrain.model": "{}"}, None)
    for stage in stages:  # each stage's whole state streams in, optimizer included, as a holder sends it
        framing.receive_state(framing.state_chunks(sorted(stage.full_state())), writer)
    assert writer.finish() == ""  # no checksum: nothing to compare one with, and the stages come out of name order
    params = {name: p for stage in stages for name, p in stage.named_state()}
    with safe_open(str(path), "pt") as saved:
        assert saved.metadata()["geotrain.model"] == "{}"
        assert set(saved.keys()) == set(params)
        assert all(torch.equal(saved.get_tensor(k), v) for k, v in params.items())


def _record(step: int) -> StepRecord:
    return StepRecord(step=step, loss=1.0, val_loss=None, tokens_per_s=1.0, seconds=1.0, plan_epoch=1)


@pytest.mark.timeout(30)
def test_a_checkpoint_is_written_while_the_stage_trains_on_and_a_failed_one_leaves_the_previous(tmp_path):
    cfg = _cfg()
    total = cfg.model.total_layers
    runtime = StageRuntime(cfg, 0, total)
    snapshots = Snapshots(str(tmp_path))
    gate, opened = threading.Event(), []
    fail = False

    def fetch(member, layers, steps_done):
        snapshot = snapshots.open(runtime)  # as the holder's FetchState does, under its state lock
        opened.append(snapshot)
        for i, chunk in enumerate(framing.state_stream(snapshot.sources())):
            if i == 1:
                gate.wait(10)  # the link is slow: the run goes on meanwhile
                if fail:
                    raise LookupError("the holder died mid-transfer")
            yield chunk
        snapshots.close(snapshot)

    store = RunStore()
    store.commit_step(_record(0), {0: runtime.checksum()})
    checkpoints = CheckpointStore(tmp_path / "checkpoints", keep=3)
    recovery = Recovery(checkpoints, fetch, store, lambda kind, data: None)
    holder = SimpleNamespace(node_id="node-1", held=(0, total), applied_steps=1, unreachable=False, profile=None)
    plan = pb.Plan(epoch=1, stages=[pb.StageAssignment(index=0, layer_start=0, layer_end=total)])
    committed = {k: v.clone() for k, v in runtime.full_state()}

    recovery.start_checkpoint(plan, 1, [holder])  # returns once the holder began sending, not once written
    assert checkpoints.latest() is None  # no manifest yet: the checkpoint does not exist
    snapshots.preserve(runtime)  # the next step's apply, under the state lock, before it changes the stage
    with torch.no_grad():
        for p in runtime.parameters():
            p.add_(1.0)
    gate.set()
    manifest = recovery.finish_checkpoint()
    assert manifest is not None and (manifest.path / "manifest.json").is_file()
    written = checkpoints.load_layers(manifest, 0, total)
    assert all(torch.equal(written[k], v) for k, v in committed.items())  # step 1 as committed, not as changed

    # The next one fails mid-transfer: it does not exist, and the one before is whole.
    fail = True
    gate.clear()
    store.commit_step(_record(1), {0: runtime.checksum()})
    recovery.start_checkpoint(plan, 2, [SimpleNamespace(**{**vars(holder), "applied_steps": 2})])
    gate.set()
    assert recovery.finish_checkpoint() is None
    assert checkpoints.latest().steps_done == 1 and not list(checkpoints.root.glob(".step-*"))
    assert all(torch.equal(checkpoints.load_layers(checkpoints.latest(), 0, total)[k], v) for k, v in committed.items())


def _write_ahead(snapshot: StateSnapshot) -> threading.Thread:
    """The snapshot's writer ahead on a thread of its own, as Snapshots.open starts it."""
    thread = threading.Thread(target=snapshot.write_ahead)
    thread.start()
    return thread


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ahead", [False, True], ids=["copied-at-the-change", "written-ahead"])
def test_a_snapshot_serves_its_step_after_the_stage_changed_from_copies_made_ahead_or_at_the_change(tmp_path, ahead):
    cfg = _cfg()
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers)
    before = {k: v.clone() for k, v in runtime.full_state()}
    untouched = StateSnapshot(runtime.full_state(), str(tmp_path))
    assert framing.read_state(framing.state_stream(untouched.sources())).keys() == before.keys()
    assert untouched._spill is None  # served from the stage's own tensors
    snapshot = StateSnapshot(runtime.full_state(), str(tmp_path))
    sources = snapshot.sources()
    first = next(sources)  # the transfer is at the first tensor
    if ahead:  # the writer ahead stops short of it: the change copies only that one
        _write_ahead(snapshot).join(10)
    sizes = [v.numel() * v.element_size() for _, v in sorted(before.items())]
    assert snapshot.preserve() == (sizes[0] if ahead else sum(sizes))
    with torch.no_grad():
        for p in runtime.parameters():
            p.mul_(-3.0)
    got = framing.read_state(framing.state_stream([first, *sources]))
    assert all(torch.equal(got[k], v) for k, v in before.items())
    snapshot.close()
    assert transfer_memory_bytes(2) == 2 * transfer_memory_bytes(1) < 64 * framing.CHUNK_BYTES


@pytest.mark.timeout(60)
def test_a_writer_ahead_racing_the_stage_s_change_or_the_close_serves_the_committed_state(tmp_path):
    cfg = _cfg()
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers)
    for round_ in range(20):
        before = {k: v.clone() for k, v in runtime.full_state()}
        snapshot = StateSnapshot(runtime.full_state(), str(tmp_path))
        writer = _write_ahead(snapshot)
        if round_ % 2:  # the transfer ended (or failed) while the writer wrote
            snapshot.close()
            writer.join(10)
            assert not writer.is_alive() and snapshot._spill is None
            continue
        snapshot.preserve()
        with torch.no_grad():
            for p in runtime.parameters():
                p.add_(1.0)
        got = framing.read_state(framing.state_stream(snapshot.sources()))
        writer.join(10)
        assert all(torch.equal(got[k], v) for k, v in before.items())
        snapshot.close()
    assert not list(tmp_path.iterdir())  # the spill files were never linked in the directory


@pytest.mark.timeout(30)
def test_incoming_state_of_another_shape_or_dtype_or_name_is_refused_with_a_clear_status():
    cfg = _cfg()
    runtime = StageRuntime(cfg, 0, 2)
    expect = StateExpectation(runtime)
    name, p = runtime.named_state()[0]
    assert expect(pb.TensorHeader(name=name, dtype=pb.DTYPE_FLOAT32, shape=list(p.shape))) is not None
    cases = [
        (pb.TensorHeader(name=name, dtype=pb.DTYPE_FLOAT32, shape=[p.shape[0] + 1, *p.shape[1:]]), "of shape"),
        (pb.TensorHeader(name=name, dtype=pb.DTYPE_FLOAT16, shape=list(p.shape)), "torch.float16"),
        (pb.TensorHeader(name="layers.99.w", dtype=pb.DTYPE_FLOAT32, shape=[1]), "no parameter's of layers [0, 2)"),
        (pb.TensorHeader(name=f"optim.{name}.step", dtype=pb.DTYPE_FLOAT32, shape=[2]), "of shape [2]"),
    ]
    for header, message in cases:
        with pytest.raises(FrameError, match=message.replace("[", r"\[").replace(")", r"\)")) as e:
            expect(header)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # A stream whose header lies about its payload is refused before any of it is taken.
    bad = pb.TensorChunk(header=pb.TensorHeader(name=name, dtype=pb.DTYPE_FLOAT32, shape=list(p.shape),
                                                codec=pb.CODEC_NONE, payload_bytes=4))
    with pytest.raises(FrameError, match="do not fill shape"):
        framing.read_state([bad], expect=expect)


@pytest.mark.timeout(10)
def test_state_deadlines_and_step_timeouts_follow_bytes_and_the_plan_estimate():
    floor = 300.0
    small = framing.state_deadline_s(1 << 20, 100e6 / 8, floor)
    big = framing.state_deadline_s(12 * 8 * 10**9, 100e6 / 8, floor)  # an 8B model's state over 100 Mbit/s
    assert floor < small < floor + 1 and big > 12 * 8 * 10**9 * 8 / 100e6
    cfg = load_config(None, ["scheduler.step_timeout_s=120", "scheduler.step_timeout_factor=10"])
    estimate: list[float | None] = [None]
    driver = StepDriver(cfg, None, None, None, lambda kind, data: None, lambda: estimate[0])
    assert driver.step_timeout_s() == 120.0
    estimate[0] = 5.0
    assert driver.step_timeout_s() == 120.0  # the floor
    estimate[0] = 60.0
    assert driver.step_timeout_s() == 600.0  # a slow plan has the time it needs


def test_a_call_s_deadline_is_capped_by_the_plan_the_first_to_a_peer_included():
    sched = load_config(None, ["scheduler.step_timeout_s=30", "scheduler.step_timeout_factor=10"]).scheduler
    assert call_deadline_s(sched, None) == 15.0  # unpriced: half the step timeout
    assert call_deadline_s(sched, 0.05) == framing.CALL_DEADLINE_FLOOR_S  # a fast plan: the floor
    assert call_deadline_s(sched, 2.0) == 8.0  # _STALL_FACTOR times the estimate
    assert call_deadline_s(sched, 60.0) == 240.0
    tight = load_config(None, ["scheduler.step_timeout_s=30", "scheduler.step_timeout_factor=2"]).scheduler
    assert call_deadline_s(tight, 60.0) == 60.0  # at most half the step timeout
    deadlines = AdaptiveDeadline()
    assert deadlines.for_peer("b") == 60.0  # a plan of an older coordinator names no cap
    deadlines.follow(pb.Plan(call_deadline_s=15.0))
    assert deadlines.for_peer("b") == 15.0, "a holder that stalls its first call is reported in time"
    deadlines.observe("b", 0.01)
    assert deadlines.for_peer("b") == framing.CALL_DEADLINE_FLOOR_S
    deadlines.observe("c", 10.0)
    assert deadlines.for_peer("c") == 15.0
    deadlines.follow(pb.Plan(call_deadline_s=2.0))
    assert deadlines.for_peer("b") == deadlines.for_peer("new") == 2.0


class _StateHolder:
    """The state-serving part of a node (servicer.StageHandler): `runtime`'s state after `steps_done` steps, to the
    key `reader` only."""

    def __init__(self, runtime: StageRuntime, steps_done: int, reader: bytes, spill_dir: str) -> None:
        self.runtime, self.steps_done, self.reader = runtime, steps_done, reader
        self.snapshots = Snapshots(spill_dir)
        self.open = 0  # snapshots open

    def may_read_state(self, signer: bytes | None) -> bool:  # noqa: D102
        return signer == self.reader

    def state_snapshot(self, steps_done: int, layers=None):  # noqa: ANN001, D102
        if steps_done != self.steps_done:
            return None
        self.open += 1
        return self.snapshots.open(self.runtime)

    def close_snapshot(self, snapshot: StateSnapshot) -> None:  # noqa: D102
        self.open -= 1
        self.snapshots.close(snapshot)


def _snapshots_closed(holder: _StateHolder, within_s: float = 20.0) -> bool:
    """Whether every snapshot `holder` opened is closed within `within_s`: a sender closes its snapshot once its last
    write returns, on a thread at the lowest CPU priority, which a busy machine may hold back."""
    closing = time.monotonic() + within_s
    while holder.open and time.monotonic() < closing:
        time.sleep(0.01)
    return holder.open == 0


@contextmanager
def _state_server(holder: _StateHolder, token: str, raw_streams: bool, tls: TlsFiles | None = None) -> Iterator[str]:
    """A node's Stage server on loopback serving `holder`'s state, with a raw stream port or without, over TLS with
    `tls`; its address."""
    limits = PeerLimits(LimitValues())
    server, port = make_server(token, "127.0.0.1:0", limits, tls=tls)
    streams = TensorStreamServer("127.0.0.1", 0, tls, limits, 1 << 20) if raw_streams else None
    reverse = ReverseSender(NodeKey.generate(), lambda: "n")
    servicer = StageServicer(holder, 1 << 20, True, RefusalLog(), reverse, streams)
    add_stage_service(servicer, server)
    server.start()
    if streams is not None:
        streams.start(servicer)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if streams is not None:
            streams.close()
        server.stop(grace=0.5).wait(2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raw_streams", [True, False], ids=["raw-stream", "fetch-state"])
def test_the_coordinator_fetches_a_stage_s_state_over_its_raw_stream_or_by_fetch_state(
    tmp_path, monkeypatch, raw_streams
):
    cfg, token, coordinator = _cfg(), new_token(), NodeKey.generate()
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers)
    holder = _StateHolder(runtime, 3, coordinator.public, str(tmp_path))
    sent = []
    real_send = statestream.send_state
    monkeypatch.setattr(statestream, "send_state", lambda sock, *a: sent.append(1) or real_send(sock, *a))
    crcs = []

    def noting_crcs(chunks):
        for chunk in chunks:
            if chunk.HasField("header"):
                crcs.append(chunk.header.crc32)
            yield chunk

    with _state_server(holder, token, raw_streams) as address:
        state = framing.read_state(noting_crcs(stage_state_stream(address, token, 3, coordinator)))
        expected = dict(runtime.full_state())
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
        assert len(sent) == raw_streams
        assert (set(crcs) == {0}) if raw_streams else (0 not in crcs)  # a raw stream's tensors are not checksummed
        with pytest.raises(LookupError, match="holds no state after 4 steps"):
            framing.read_state(stage_state_stream(address, token, 4, coordinator))
        with pytest.raises(LookupError, match="PERMISSION_DENIED"):  # a key outside the node's plan
            framing.read_state(stage_state_stream(address, token, 3, NodeKey.generate()))
    assert _snapshots_closed(holder)  # whatever became of its stream


@pytest.mark.timeout(60)
def test_a_tls_run_s_state_streams_are_tls_with_its_files(tmp_path, monkeypatch):
    cfg, token, coordinator = _cfg(), new_token(), NodeKey.generate()
    files = []
    for name in ("a", "b"):
        init_run_tls(tmp_path / name)
        files.append(TlsFiles.load(tmp_path / name))
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers)
    holder = _StateHolder(runtime, 3, coordinator.public, str(tmp_path))
    sent = []
    real_send = statestream.send_state
    monkeypatch.setattr(statestream, "send_state", lambda sock, *a: sent.append(type(sock)) or real_send(sock, *a))
    with _state_server(holder, token, True, tls=files[0]) as address:
        state = framing.read_state(stage_state_stream(address, token, 3, coordinator, files[0]))
        expected = dict(runtime.full_state())
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
        assert sent == [ssl.SSLSocket]  # over the raw stream, encrypted
        with pytest.raises(LookupError):  # another run's files fail the handshake
            framing.read_state(stage_state_stream(address, token, 3, coordinator, files[1], deadline_s=10))
    assert _snapshots_closed(holder)


@pytest.mark.timeout(60)
def test_a_state_stream_waits_out_a_receiver_that_pauses_for_seconds(tmp_path):
    # A receiver at the lowest CPU priority may take nothing for seconds while the cores train; the sender's socket
    # must not give up at the hello's deadline (2 s) once the stream is under way.
    cfg = load_config(None, ["model.n_layers=4", "model.d_model=384", "model.n_heads=4", "model.seq_len=16"])
    token, coordinator = new_token(), NodeKey.generate()
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers)
    holder = _StateHolder(runtime, 3, coordinator.public, str(tmp_path))
    expected = dict(runtime.full_state())
    assert sum(t.numel() * t.element_size() for t in expected.values()) > 16 << 20  # more than the sockets buffer
    with _state_server(holder, token, raw_streams=True) as address:
        chunks = stage_state_stream(address, token, 3, coordinator)
        first = next(chunks)
        time.sleep(3.0)
        state = framing.read_state(itertools.chain([first], chunks))
    assert all(torch.equal(state[k], expected[k]) for k in expected)
