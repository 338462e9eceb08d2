"""node/profiler: layers are timed and sized, --slowdown is measured, probes measure emulated links, bad probes are
rejected, and a live run ends with every member's profile on the coordinator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import grpc
import pytest

from geotrain.config import load_config
from geotrain.node.dataplane import DataPlane, LinkEmulator, LinkShape
from geotrain.node.model import build_layer
from geotrain.node import dataplane, profiler
from geotrain.node.profiler import available_memory_bytes, host_turn, probe_link, profile_layers, stretch
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import new_token
from geotrain.protocol.probe import COORDINATOR_PEER, MAX_PROBE_BYTES
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import make_channel
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.service import make_coordinator_server
from tests.conftest import REPO, expect_status, local_cluster, wait_until

CFG = load_config(None, ["model.n_layers=2", "model.d_model=64", "train.microbatch_size=4"])


@pytest.fixture
def coordinator_address() -> Iterator[tuple[str, str]]:
    """A coordinator's gRPC server on 127.0.0.1 (its Probe is what nodes measure their coordinator link with)."""
    token = new_token()
    coordinator = Coordinator(CFG)
    server, port = make_coordinator_server(coordinator, token, "127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", token
    finally:
        server.stop(grace=0.5).wait(2)
        coordinator.store.close()


@pytest.mark.timeout(30)
def test_every_layer_is_timed_and_sized():
    profile = profile_layers(CFG, slowdown=1.0, repeats=3)
    n = CFG.model.total_layers
    hidden = CFG.train.microbatch_size * CFG.model.seq_len * CFG.model.d_model * 4
    assert len(profile.layer_seconds) == n and all(t > 0 for t in profile.layer_seconds)
    assert profile.boundary_bytes == [hidden] * (n - 1) + [0]
    layers = [build_layer(CFG.model, i, CFG.run.seed) for i in range(n)]
    assert profile.param_bytes == [sum(p.numel() * 4 for p in layer.parameters()) for layer in layers]
    assert profile.param_shapes == [[tuple(p.shape) for p in layer.parameters()] for layer in layers]
    # Every layer keeps at least its input (or, for the embedding, the byte ids) for backward.
    assert all(a > 0 for a in profile.activation_bytes)
    assert profile.activation_bytes[1] > hidden, "a transformer block keeps several hidden-sized tensors"


@pytest.mark.timeout(30)
def test_timing_the_layers_leaves_none_of_them_allocated():
    import gc

    import torch

    def live_tensors() -> int:
        gc.collect()
        # By type: isinstance would ask a deprecated torch.distributed object for its class, which warns.
        return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())

    before = live_tensors()
    profile_layers(CFG, slowdown=1.0, repeats=1)
    # What a node holds after profiling is its baseline, which the planner counts on top of its stage.
    assert live_tensors() == before


class _Clock:
    """A monotonic clock that only sleeping moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.timeout(30)
@pytest.mark.parametrize("slowdown", [1.0, 3.0])
def test_slowdown_is_measured(slowdown):
    # Every layer's work takes 1 ms on a clock of the test's own (the device sync after it is where the time goes),
    # so the profile shows exactly what --slowdown adds to it.
    clock = _Clock()
    synchronize = lambda _: clock.sleep(1e-3)  # noqa: E731
    with mock.patch.object(profiler, "time", clock), mock.patch.object(profiler, "synchronize", synchronize):
        profile = profile_layers(CFG, slowdown=slowdown, repeats=3)
    assert profile.layer_seconds == pytest.approx([slowdown * 1e-3] * CFG.model.total_layers)


def test_stretch_sleeps_the_slowdown_on_the_real_clock():
    started = time.monotonic() - 0.01  # work that took 10 ms
    stretch(started, 3.0)
    assert time.monotonic() - started >= 0.03  # a sleep never ends early, however loaded the machine


_TURN_HOLDER = """
import os, sys, time
from pathlib import Path
from geotrain.node.profiler import host_turn
with host_turn(Path(sys.argv[1])):
    print("in", flush=True)
    input()
    if os.fork() == 0:  # as hivemind forks its DHT process, while the turn is held
        time.sleep(60)
        os._exit(0)
input()
"""


def _blocked_on(lock: Path) -> bool:
    """Whether a thread of this process waits for a POSIX lock on `lock` (the kernel lists waiters after '->')."""
    inode, pid = f":{lock.stat().st_ino}", str(os.getpid())
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1] == "->" and fields[2] == "POSIX" and fields[5] == pid and fields[6].endswith(inode):
            return True
    return False


@pytest.fixture
def turn_held_elsewhere(tmp_path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A lock file whose turn another process (a node is one) holds, and what makes it let go."""
    lock = tmp_path / "profile.lock"  # not the host's: nodes of other runs may be timing their layers now
    holder = subprocess.Popen(
        [sys.executable, "-c", _TURN_HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=REPO, process_group=0,
    )

    def let_go() -> None:
        holder.stdin.write("\n")
        holder.stdin.flush()

    try:
        assert holder.stdout.readline().strip() == "in"
        yield lock, let_go
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def _waits_for_the_turn(lock: Path, let_go: Callable[[], None], take: Callable[[], None], done: threading.Event):
    """Run `take` in a thread, see it wait for the turn held elsewhere, let go, and see `done` set."""
    threading.Thread(target=take, daemon=True).start()
    wait_until(lambda: _blocked_on(lock), 20, "the thread waits for the other process's turn")
    assert not done.is_set()
    let_go()
    # The holder let go; the child it forked meanwhile still runs and must not keep the turn.
    assert done.wait(20)


@pytest.mark.cluster
@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="sees a thread wait for the lock in /proc/locks (Linux)")
@pytest.mark.timeout(60)
def test_nodes_on_one_host_take_turns_timing_layers(turn_held_elsewhere):
    lock, let_go = turn_held_elsewhere
    entered = threading.Event()

    def take_turn() -> None:
        with host_turn(lock):
            entered.set()

    _waits_for_the_turn(lock, let_go, take_turn, entered)


@pytest.mark.cluster
@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="sees a thread wait for the lock in /proc/locks (Linux)")
@pytest.mark.timeout(60)
def test_a_starting_node_times_its_speed_probe_in_the_hosts_turn(turn_held_elsewhere, monkeypatch, capsys):
    # Nodes started together on one machine timed their first matmul at once: 0.01 against 0.17 TFLOP/s.
    from geotrain.commands.node import announce_device
    from geotrain.node import device

    lock, let_go = turn_held_elsewhere
    monkeypatch.setattr(profiler, "host_turn", lambda: host_turn(lock))
    probed, measure = threading.Event(), device.matmul_flops
    monkeypatch.setattr(device, "matmul_flops", lambda d: (probed.set(), measure(d))[1])
    announced = threading.Event()

    def announce() -> None:
        announce_device("cpu")
        announced.set()

    _waits_for_the_turn(lock, let_go, announce, probed)
    assert announced.wait(20) and "TFLOP/s fp32 matmul" in capsys.readouterr().out


def test_available_memory_is_positive():
    assert available_memory_bytes() > 0


def test_emulated_link_delays_a_message_by_its_bandwidth_then_its_latency():
    clock = _Clock()
    shape = LinkShape(bandwidth_bps=8e6, latency_s=0.01)
    emulator = LinkEmulator(lambda peer: None if peer == "near" else ("egress", shape))
    with mock.patch.object(dataplane, "time", clock):
        emulator.delay("far", 1_000_000)  # 8 Mbit at 8 Mbit/s: 1 s on the wire, then 10 ms of latency
        assert clock.now == pytest.approx(101.01)
        emulator.delay("near", 1 << 30)
        assert clock.now == pytest.approx(101.01)
        emulator.reply("far")
        assert clock.now == pytest.approx(101.02)


class _FixedLink:
    """A data plane whose probes take the time a 20 Mbit/s link with a 30 ms round trip would."""

    def probe(self, peer: str, target: object, nbytes: int, timeout_s: float) -> float:
        return 0.03 + nbytes * 8 / 20e6


def test_probe_link_takes_bandwidth_net_of_the_round_trip():
    probe = probe_link(_FixedLink(), "peer", None, nbytes=2 << 20)
    assert (probe.peer, probe.bandwidth_bps, probe.rtt_s) == ("peer", pytest.approx(20e6), pytest.approx(0.03))


@pytest.mark.timeout(30)
def test_probe_measures_an_emulated_20_mbit_link(coordinator_address):
    address, token = coordinator_address
    emulator = LinkEmulator(lambda peer: ("egress", LinkShape(bandwidth_bps=20e6, latency_s=0.01)))
    dataplane = DataPlane(token, lambda: "node-a", emulator=emulator)
    channel = make_channel(address, token, lambda: "node-a")
    try:
        probe = probe_link(dataplane, COORDINATOR_PEER, rpc.CoordinatorStub(channel), nbytes=2 << 20)
    finally:
        channel.close()
        dataplane.close()
    # A busy machine can only make the real transfer slower: the emulated rate is a ceiling and the emulated
    # latency a floor (the exact arithmetic is the two tests above).
    assert probe.peer == COORDINATOR_PEER
    assert 0 < probe.bandwidth_bps <= 1.2 * 20e6, f"{probe.bandwidth_bps / 1e6:.2f} Mbit/s"
    assert probe.rtt_s >= 0.02, "the emulated 10 ms each way is part of the round trip"


def _check_probe_rejections(stub: rpc.StageStub | rpc.CoordinatorStub) -> None:
    """Each malformed probe stream gets its status, and the server still counts a good one afterwards."""

    def send(*chunks: pb.ProbeChunk):
        return lambda: stub.Probe(iter(chunks), timeout=10)

    expect_status(grpc.StatusCode.INVALID_ARGUMENT, "empty", send())
    expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds", send(pb.ProbeChunk(total_bytes=MAX_PROBE_BYTES + 1)))
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, "more than", send(pb.ProbeChunk(total_bytes=4, data=b"12345")))
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, "first",
                  send(pb.ProbeChunk(total_bytes=8), pb.ProbeChunk(total_bytes=8)))
    expect_status(grpc.StatusCode.DATA_LOSS, "truncated", send(pb.ProbeChunk(total_bytes=8, data=b"1234")))
    assert send(pb.ProbeChunk(total_bytes=6, data=b"123"), pb.ProbeChunk(data=b"456"))().received_bytes == 6


@pytest.mark.timeout(30)
def test_bad_probes_and_reports_are_rejected_by_the_coordinator(coordinator_address):
    address, token = coordinator_address
    channel = make_channel(address, token, lambda: "tester", key=NodeKey.generate())  # reports must be signed
    try:
        stub = rpc.CoordinatorStub(channel)
        _check_probe_rejections(stub)
        n = CFG.model.total_layers
        report = pb.NodeProfileReport(
            node_id="nobody", layer_seconds=[0.01] * n, boundary_bytes=[1] * n, param_bytes=[1] * n,
            activation_bytes=[1] * n, memory_bytes=1 << 30, device="cpu", precision="fp32",
        )
        expect_status(grpc.StatusCode.NOT_FOUND, "register first", lambda: stub.ReportProfile(report, timeout=10))
        del report.layer_seconds[1:]
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, "layer_seconds", lambda: stub.ReportProfile(report, timeout=10))
    finally:
        channel.close()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_live_run_ends_with_every_profile_on_the_coordinator(small_config, tmp_path):
    cfg = small_config
    cfg.profile.layer_repeats = 1  # timing quality is another test's business; keep this run short
    cfg.profile.reprobe_s = 0.5
    cfg.run.steps = 6
    with local_cluster(cfg, 2, tmp_path) as cluster:
        coordinator = cluster.coordinator
        wait_until(lambda: coordinator.plan is not None or not cluster.thread.is_alive(), 60, "a plan")
        first, second = (s.node_ids[0] for s in coordinator.plan.stages)
        # Each node measures the coordinator; the upstream end of a pair measures the pair.
        wanted = {first: {second, COORDINATOR_PEER}, second: {COORDINATOR_PEER}}

        def profiled() -> bool:
            members = dict(coordinator.members)
            return all(
                n in members and members[n].profile is not None
                and peers <= {p.peer for p in members[n].profile.links}
                for n, peers in wanted.items()
            )

        wait_until(profiled, 40, "every node's profile with the links it measures")
        # Every node measures its links again every profile.reprobe_s and sends the coordinator a new report.
        reported = {n: coordinator.members[n].profile for n in wanted}
        wait_until(lambda: all(coordinator.members[n].profile is not reported[n] for n in wanted), 20,
                   "a profile from every node after its links were first measured")
        for n, peers in wanted.items():
            again = coordinator.members[n].profile
            assert peers <= {p.peer for p in again.links}
        cluster.wait(40)
        for node_id in wanted:
            assert len(coordinator.members[node_id].profile.layer_seconds) == cfg.model.total_layers
        links = {(link.src, link.dst): link for link in coordinator.status().links}
        for src, peers in wanted.items():
            for dst in peers:
                assert links[(src, dst)].bandwidth_mbps > 0 and links[(src, dst)].latency_ms > 0
        # The nodes' Stage service rejects bad probes the same way.
        channel = make_channel(coordinator.plan.stages[0].addresses[0], cluster.token, lambda: "tester")
        try:
            _check_probe_rejections(rpc.StageStub(channel))
        finally:
            channel.close()
