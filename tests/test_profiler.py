"""node/profiler: layers are timed and sized, --slowdown is measured, probes measure emulated links, bad probes are
rejected, and a live run ends with every member's profile on the coordinator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from geotrain.config import load_config
from geotrain.node.dataplane import DataPlane, LinkEmulator, LinkShape
from geotrain.node.model import build_layer
from geotrain.node.profiler import available_memory_bytes, host_turn, probe_link, profile_layers
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import new_token
from geotrain.protocol.probe import COORDINATOR_PEER, MAX_PROBE_BYTES
from geotrain.protocol.transport import make_channel
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.service import make_coordinator_server
from tests.conftest import REPO, local_cluster

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
def test_slowdown_is_measured():
    # Other processes may share the CPU and load one profile more than the next: unstretched and stretched
    # profiles alternate, and the round they loaded alike shows the factor (without a slowdown none shows 2x).
    ratios = []
    for _ in range(3):
        fast = sum(profile_layers(CFG, slowdown=1.0, repeats=3).layer_seconds)
        ratios.append(sum(profile_layers(CFG, slowdown=3.0, repeats=3).layer_seconds) / fast)
    assert max(ratios) > 2, f"--slowdown 3 measured {', '.join(f'{r:.2f}x' for r in ratios)}"


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


@pytest.mark.timeout(60)
def test_nodes_on_one_host_take_turns_timing_layers(tmp_path):
    lock = tmp_path / "profile.lock"  # not the host's: nodes of other runs may be timing their layers now
    # Another process (a node is one) holds the turn until told to let go.
    holder = subprocess.Popen(
        [sys.executable, "-c", _TURN_HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=REPO, start_new_session=True,
    )
    entered = threading.Event()

    def take_turn() -> None:
        with host_turn(lock):
            entered.set()

    try:
        assert holder.stdout.readline().strip() == "in"
        waiter = threading.Thread(target=take_turn, daemon=True)
        waiter.start()
        assert not entered.wait(0.5)  # blocked while the other process holds the turn
        holder.stdin.write("\n")
        holder.stdin.flush()
        # The holder let go; the child it forked meanwhile still runs and must not keep the turn.
        assert entered.wait(20)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def test_available_memory_is_positive():
    assert available_memory_bytes() > 0


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
    assert probe.peer == COORDINATOR_PEER
    assert abs(probe.bandwidth_bps - 20e6) <= 0.2 * 20e6, f"{probe.bandwidth_bps / 1e6:.2f} Mbit/s"
    assert 0.02 <= probe.rtt_s < 0.2, "the emulated 10 ms each way is part of the round trip"


def _expect(code: grpc.StatusCode, text: str, call) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert text in err.value.details(), err.value.details()


def _check_probe_rejections(stub: rpc.StageStub | rpc.CoordinatorStub) -> None:
    """Each malformed probe stream gets its status, and the server still counts a good one afterwards."""

    def send(*chunks: pb.ProbeChunk):
        return lambda: stub.Probe(iter(chunks), timeout=10)

    _expect(grpc.StatusCode.INVALID_ARGUMENT, "empty", send())
    _expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds", send(pb.ProbeChunk(total_bytes=MAX_PROBE_BYTES + 1)))
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "more than", send(pb.ProbeChunk(total_bytes=4, data=b"12345")))
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "first", send(pb.ProbeChunk(total_bytes=8), pb.ProbeChunk(total_bytes=8)))
    _expect(grpc.StatusCode.DATA_LOSS, "truncated", send(pb.ProbeChunk(total_bytes=8, data=b"1234")))
    assert send(pb.ProbeChunk(total_bytes=6, data=b"123"), pb.ProbeChunk(data=b"456"))().received_bytes == 6


@pytest.mark.timeout(30)
def test_bad_probes_and_reports_are_rejected_by_the_coordinator(coordinator_address):
    address, token = coordinator_address
    channel = make_channel(address, token, lambda: "tester")
    try:
        stub = rpc.CoordinatorStub(channel)
        _check_probe_rejections(stub)
        n = CFG.model.total_layers
        report = pb.NodeProfileReport(
            node_id="nobody", layer_seconds=[0.01] * n, boundary_bytes=[1] * n, param_bytes=[1] * n,
            activation_bytes=[1] * n, memory_bytes=1 << 30,
        )
        _expect(grpc.StatusCode.NOT_FOUND, "register first", lambda: stub.ReportProfile(report, timeout=10))
        del report.layer_seconds[1:]
        _expect(grpc.StatusCode.INVALID_ARGUMENT, "layer_seconds", lambda: stub.ReportProfile(report, timeout=10))
    finally:
        channel.close()


@pytest.mark.timeout(60)
def test_live_run_ends_with_every_profile_on_the_coordinator(small_config, tmp_path):
    cfg = small_config
    cfg.profile.layer_repeats = 1  # timing quality is another test's business; keep this run short
    cfg.profile.reprobe_s = 0.5
    cfg.run.steps = 6
    with local_cluster(cfg, 2, tmp_path) as cluster:
        coordinator = cluster.coordinator
        while coordinator.plan is None and cluster.thread.is_alive():
            time.sleep(0.1)
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

        deadline = time.monotonic() + 40
        while not profiled() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert profiled(), f"profiles: { {n: m.profile for n, m in coordinator.members.items()} }"
        # Every node measures its links again every profile.reprobe_s and sends the coordinator a new report.
        reported = {n: coordinator.members[n].profile for n in wanted}
        deadline = time.monotonic() + 20
        while any(coordinator.members[n].profile is reported[n] for n in wanted) and time.monotonic() < deadline:
            time.sleep(0.1)
        for n, peers in wanted.items():
            again = coordinator.members[n].profile
            assert again is not reported[n], f"{n} sent no profile after its links were first measured"
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
