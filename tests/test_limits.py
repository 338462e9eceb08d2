"""A token holder floods a live run: idle streams, registrations, status-page requests, profiles with extreme numbers.

Each cluster test attacks a 3-node run while it trains, with the run token (the attacker is as authentic as any
volunteer); the run must go on committing steps and end where training in one process ends. The status page's
guards (viewer token, rate, long paths, no filesystem paths) are also checked on their own, without a run.
"""

from __future__ import annotations

import http.client
import json
import math
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest

from geotrain.node.local import train_local
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import make_channel
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler import http as http_module
from geotrain.scheduler.http import REQUEST_BURST, StatusHttpServer
from geotrain.scheduler.service import fetch_model_state
from geotrain.scheduler.status_cli import status_dict
from tests.conftest import (
    LocalCluster, expect_status, local_cluster, max_diff, one_compute_thread, small_run, wait_until,
)

ATTACKER = "mallory"


@contextmanager
def _attacked_run(tmp_path, *overrides: str) -> Iterator[tuple[LocalCluster, threading.Event]]:
    """A 3-node run of 8 steps; yields it and an event set once its first step commits (attack from there). After
    the block the run must finish and equal train-local within 1e-4."""
    cfg = small_run("run.steps=8", *overrides)
    first_step = threading.Event()

    def on_event(kind: str, _data: dict) -> None:
        if kind == "step":
            first_step.set()

    with local_cluster(cfg, 3, tmp_path, on_event=on_event) as cluster:
        assert first_step.wait(90), "the run did not commit its first step"
        yield cluster, first_step
        summary = cluster.wait(120)
        assert summary.steps == cfg.run.steps
        state = fetch_model_state(cluster.coordinator.plan, cluster.token, summary.steps)
    with one_compute_thread():
        runtime, _ = train_local(cfg)
    assert max_diff(state, dict(runtime.named_state())) <= 1e-4


def _steps_while(cluster: LocalCluster, attack_running: Callable[[], bool], steps: int, timeout: float) -> int:
    """Wait until the run commits `steps` more steps (or ends) while the attack still runs; the steps committed."""
    start = cluster.coordinator.step
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            if cluster.coordinator.step - start >= steps or not cluster.thread.is_alive():
                done.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert done.wait(timeout), f"fewer than {steps} steps in {timeout} s under attack"
    assert attack_running(), "the attack ended before the steps were committed"
    return cluster.coordinator.step - start


class _IdleStreams:
    """`count` request streams that send nothing, each opened again as soon as the server ends it; counts how they
    ended (RESOURCE_EXHAUSTED: refused over a limit; CANCELLED or DEADLINE_EXCEEDED: cut when idle)."""

    def __init__(self, open_stream: Callable[[Iterator], grpc.Future], count: int) -> None:
        self._open_stream = open_stream
        self._closing = threading.Event()  # no more reopening or counting
        self._stop = threading.Event()  # the silent streams end (the server answers them INVALID_ARGUMENT: empty)
        self.ended: Counter[grpc.StatusCode] = Counter()
        self._futures = [self._open() for _ in range(count)]
        self._thread = threading.Thread(target=self._reopen, daemon=True)
        self._thread.start()

    def _silence(self) -> Iterator:
        self._stop.wait()
        yield from ()

    def _open(self) -> grpc.Future:
        return self._open_stream(self._silence())

    def _reopen(self) -> None:
        while not self._closing.wait(0.1):
            for i, future in enumerate(self._futures):
                if future.done():
                    self.ended[future.code()] += 1
                    self._futures[i] = self._open()

    @property
    def running(self) -> bool:
        return not self._closing.is_set()

    def stop(self) -> None:
        self._closing.set()
        self._thread.join(5)
        self._stop.set()
        for future in self._futures:
            future.cancel()


pytestmark = pytest.mark.timeout(300)


@pytest.mark.cluster
def test_200_idle_streams_at_a_node_and_at_the_coordinator(tmp_path):
    with _attacked_run(tmp_path, "limits.idle_stream_s=2", "limits.streams_per_peer=8") as (cluster, _):
        plan = cluster.coordinator.plan
        node_channel = make_channel(plan.stages[1].addresses[0], cluster.token, lambda: ATTACKER)
        coordinator_channel = make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: ATTACKER)
        at_node = _IdleStreams(lambda it: rpc.StageStub(node_channel).Forward.future(it, timeout=60), 200)
        at_coordinator = _IdleStreams(
            lambda it: rpc.CoordinatorStub(coordinator_channel).Probe.future(it, timeout=60), 200
        )
        try:
            # Steps go on while 2 x 200 streams are held open, cut and opened again; the deadline cuts some.
            _steps_while(cluster, lambda: at_node.running and at_coordinator.running, 3, 90)
            cut = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
            wait_until(lambda: any(at_node.ended[c] for c in cut) and at_coordinator.ended[cut[1]], 30,
                       "idle streams cut at their deadline")
        finally:
            at_node.stop()
            at_coordinator.stop()
        node_channel.close()
        coordinator_channel.close()
        for streams in (at_node, at_coordinator):
            assert streams.ended[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 150, streams.ended
            assert set(streams.ended) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, *cut}, streams.ended


@pytest.mark.cluster
def test_1000_registrations(tmp_path):
    with _attacked_run(tmp_path) as (cluster, _):
        stub = rpc.CoordinatorStub(make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: ""))
        outcomes: Counter[str] = Counter()
        for i in range(1000):
            request = pb.RegisterRequest(
                protocol_version=PROTOCOL_VERSION, node_id=f"{ATTACKER}-{i}", address=f"127.0.0.1:{10000 + i}"
            )
            try:
                outcomes["accepted" if stub.Register(request, timeout=10).accepted else "rejected"] += 1
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                # Refused by the host's registration rate, or (faster) by the peer's call rate.
                assert "registrations a second" in e.details() or "calls a second" in e.details(), e.details()
                outcomes["refused"] += 1
        # limits.registration_burst at once, then limits.registrations_per_s: most are refused.
        assert outcomes["refused"] >= 700, outcomes
        assert len(cluster.coordinator.members) <= 3 + 300
        _steps_while(cluster, lambda: True, 2, 90)


@pytest.mark.cluster
def test_3000_status_page_requests(tmp_path):
    with _attacked_run(tmp_path) as (cluster, _):
        page = StatusHttpServer(cluster.coordinator.status, "127.0.0.1:0")
        port = page.start()
        codes: Counter[int] = Counter()
        lock = threading.Lock()
        requests: queue.Queue[int] = queue.Queue()
        for i in range(3000):
            requests.put(i)

        def client() -> None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            while True:
                try:
                    i = requests.get_nowait()
                except queue.Empty:
                    break
                connection.request("GET", ("/api/status", "/metrics", "/")[i % 3])
                response = connection.getresponse()
                response.read()
                with lock:
                    codes[response.status] += 1
            connection.close()

        flooders = [threading.Thread(target=client) for _ in range(4)]
        try:
            for t in flooders:
                t.start()
            for t in flooders:
                t.join(120)
            assert sum(codes.values()) == 3000
            assert set(codes) <= {200, 429} and codes[429] >= 2000, codes
            assert codes[200] >= REQUEST_BURST
            _steps_while(cluster, lambda: True, 2, 90)
        finally:
            page.stop()


@pytest.mark.cluster
def test_profile_with_extreme_numbers(tmp_path):
    # Sent as node-1 itself, signed with its key; refused profiles count as offences, which would evict it before the
    # last of them (another test's subject).
    with _attacked_run(tmp_path, "scheduler.max_offences=100") as (cluster, _):
        key, _ = NodeKey.load_or_create(tmp_path / "node-1")
        stub = rpc.CoordinatorStub(make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: "node-1", key=key))
        honest = cluster.coordinator.members["node-1"].profile
        for value in (0.0, 5e-324, 1e308, math.nan, math.inf):
            for field in ("layer_seconds", "bandwidth_bps", "memory_bytes"):
                report = pb.NodeProfileReport()
                report.CopyFrom(honest)
                if field == "layer_seconds":
                    report.layer_seconds[0] = value
                elif field == "bandwidth_bps":
                    report.links.add(peer="node-2", bandwidth_bps=value, rtt_s=0.001)
                elif math.isfinite(value) and value < 2**64:
                    report.memory_bytes = int(value)
                else:
                    continue
                expect_status(grpc.StatusCode.INVALID_ARGUMENT, "must be in",
                              lambda: stub.ReportProfile(report, timeout=10))
        assert cluster.coordinator.members["node-1"].profile is honest
        _steps_while(cluster, lambda: True, 2, 90)


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _status_with_a_path() -> pb.StatusReply:
    reply = pb.StatusReply(state="training", step=1, steps=3)
    reply.events.add(at=1.0, kind="aborted", detail="cannot write /home/alice/run/checkpoints/step-3: disk full")
    return reply


@pytest.mark.timeout(30)
def test_status_page_viewer_token_long_paths_and_no_filesystem_paths(caplog):
    reply = _status_with_a_path()
    page = StatusHttpServer(lambda: reply, "127.0.0.1:0", viewer_token="let-me-see")
    port = page.start()
    try:
        assert _get(port, "/api/status")[0] == 401
        assert _get(port, "/metrics?token=wrong")[0] == 401
        assert _get(port, "/static/status.js")[0] == 200  # the page's code holds no run data
        status, body = _get(port, "/api/status?token=let-me-see")
        assert status == 200
        detail = json.loads(body)["events"][0]["detail"]
        assert detail == "cannot write <path>: disk full"
        assert _get(port, "/metrics", {"Authorization": "Bearer let-me-see"})[0] == 200
        # A request line that long is refused by aiohttp's parser: 400, and one log line for the client, no traceback.
        assert [_get(port, "/static/" + "a" * 100_000)[0] for _ in range(3)] == [400] * 3
        assert not [r for r in caplog.records if r.exc_info or r.exc_text]
        assert len([r for r in caplog.records if "HTTP request" in r.getMessage()]) == 1
        assert _get(port, "/static/" + "a" * 5000)[0] == 404
        assert _get(port, "/" + "x/" * 2000)[0] == 404
    finally:
        page.stop()
    assert reply.events[0].detail.startswith("cannot write /home")  # the coordinator's own snapshot is untouched


@pytest.mark.timeout(30)
def test_status_page_encodes_each_snapshot_once_and_limits_each_client(monkeypatch):
    encoded = Counter()
    snapshots = [_status_with_a_path()]

    def counting_status_dict(reply: pb.StatusReply) -> dict:
        encoded["json"] += 1
        return status_dict(reply)

    monkeypatch.setattr(http_module, "status_dict", counting_status_dict)
    page = StatusHttpServer(lambda: snapshots[-1], "127.0.0.1:0")
    port = page.start()
    try:
        assert len({_get(port, "/api/status")[1] for _ in range(5)}) == 1
        assert encoded["json"] == 1
        snapshots.append(pb.StatusReply(state="training", step=2, steps=3))  # the coordinator renders a new one
        assert json.loads(_get(port, "/api/status")[1])["step"] == "2"
        assert encoded["json"] == 2
        codes = Counter(_get(port, "/metrics")[0] for _ in range(REQUEST_BURST + 20))
        assert codes[429] >= 10, codes
    finally:
        page.stop()


@pytest.mark.parametrize(
    "setting, message",
    [
        ("limits.streams_per_host=4", "limits.streams_per_host must be at least limits.streams_per_peer"),
        ("limits.idle_stream_s=0", "limits.idle_stream_s must be in"),
        ("limits.calls_per_s=nan", "limits.calls_per_s must be in"),
        ("compression.replica_robust=krum", "compression.replica_robust must be none or centered_clip"),
        ("compression.replica_clip_rms=0", "compression.replica_clip_rms must be in"),
    ],
)
def test_limits_and_robust_averaging_settings_are_checked(setting, message):
    from geotrain.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        small_run(setting)


def test_robust_averaging_refuses_powersgd_and_travels_to_the_nodes():
    from geotrain.config import ConfigError, from_proto, to_proto

    with pytest.raises(ConfigError, match="not PowerSGD's factors"):
        small_run("compression.replica_robust=centered_clip", "compression.replica_grads=powersgd:rank=2")
    cfg = small_run("compression.replica_robust=centered_clip", "compression.replica_clip_rms=0.5",
                    "limits.idle_stream_s=7")
    on_node = from_proto(to_proto(cfg))
    assert on_node.compression.replica_clip == 0.5 and on_node.limits == cfg.limits
    assert small_run().compression.replica_clip == 0.0  # the default: the exact mean


def test_a_clipped_replica_is_an_event_once_per_step():
    from geotrain.scheduler.coordinator import Coordinator

    coordinator = Coordinator(small_run())
    for node_id, peer in (("a", "peer-a"), ("b", "peer-b")):
        coordinator.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id,
                                                address="127.0.0.1:1"))
        coordinator.heartbeat(pb.HeartbeatRequest(node_id=node_id, dht_peer_id=peer))
    # No step is in progress: the norm itself is stale and ignored, what it saw is still noted.
    for _ in range(3):  # the same report again, and from the other replica: one event
        for reporter in ("a", "b"):
            coordinator.grad_norm(pb.GradNormRequest(node_id=reporter, step=4, clipped_peers=["peer-b", "nobody"]))
    coordinator.grad_norm(pb.GradNormRequest(node_id="a", step=5, clipped_peers=["peer-b"]))
    clipped = [(node, detail) for _, kind, node, detail in coordinator.store.events() if kind == "clipped"]
    assert clipped == [("b", "step 4: CenteredClip clipped its gradient (seen by a)"),
                       ("b", "step 5: CenteredClip clipped its gradient (seen by a)")]
    assert [e.kind for e in coordinator.status().events].count("clipped") == 2
