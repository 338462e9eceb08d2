"""A token holder floods a live run: idle streams, registrations, status-page requests, profiles with extreme numbers.

Each cluster test attacks a 3-node run while it trains, with the run token (the attacker is as authentic as any
volunteer); the run must go on committing steps and end where training in one process ends. The status page's
guards (viewer token, rate, long paths, no filesystem paths) are also checked on their own, without a run.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest

from geotrain.node.local import train_local
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.limits import Backoff, LimitValues, PeerLimits
from geotrain.protocol.transport import NODE_STREAMS_PER_CONNECTION, call_with_retry, make_channel, make_server
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler import http as http_module
from geotrain.scheduler.http import REQUEST_BURST, StatusHttpServer, StatusPageProcess
from geotrain.scheduler.service import fetch_model_state
from geotrain.scheduler.status_cli import status_dict
from tests.attackers import (
    ATTACKER, Attacker, IdleStreams, answer, extreme_profiles, flood_status_page, register_many,
)
from tests.conftest import (
    LocalCluster, expect_status, local_cluster, max_diff, one_compute_thread, small_run, wait_until,
)


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
        state = fetch_model_state(cluster.coordinator.plan, cluster.token, summary.steps, cluster.coordinator.key)
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


pytestmark = pytest.mark.timeout(300)


@pytest.mark.cluster
def test_200_idle_streams_at_a_node_and_at_the_coordinator(tmp_path):
    with _attacked_run(tmp_path, "limits.idle_stream_s=2", "limits.streams_per_peer=8") as (cluster, _):
        plan = cluster.coordinator.plan
        node_channel = make_channel(plan.stages[1].addresses[0], cluster.token, lambda: ATTACKER)
        coordinator_channel = make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: ATTACKER)
        at_node = IdleStreams(lambda it: rpc.StageStub(node_channel).Forward.future(it, timeout=60), 200)
        at_coordinator = IdleStreams(
            lambda it: rpc.CoordinatorStub(coordinator_channel).Probe.future(it, timeout=60), 200
        )
        try:
            # Steps go on while 2 x 200 streams are held open, cut and opened again; the deadline cuts some, and the
            # limits below refuse most (counted as the attack reopens them, however fast the steps went).
            _steps_while(cluster, lambda: at_node.running and at_coordinator.running, 3, 90)
            cut = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
            wait_until(lambda: any(at_node.ended[c] for c in cut) and at_coordinator.ended[cut[1]], 30,
                       "idle streams cut at their deadline")
            wait_until(lambda: at_node.ended[grpc.StatusCode.UNAVAILABLE] >= 150
                       and at_coordinator.ended[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 150, 30,
                       "150 streams refused at each")
        finally:
            at_node.stop()
            at_coordinator.stop()
        node_channel.close()
        coordinator_channel.close()
        # The node's server refuses one connection's streams past its 16 in HTTP/2 (UNAVAILABLE), before its Python;
        # those within them past streams_per_peer, and every one past it at the coordinator, over the limit.
        refused = {at_node: grpc.StatusCode.UNAVAILABLE, at_coordinator: grpc.StatusCode.RESOURCE_EXHAUSTED}
        for streams, code in refused.items():
            assert streams.ended[code] >= 150, streams.ended
            assert set(streams.ended) <= {code, grpc.StatusCode.RESOURCE_EXHAUSTED, *cut}, streams.ended


@pytest.mark.cluster
def test_1000_registrations_3000_status_page_requests_and_extreme_profiles(tmp_path):
    # One flood after another in one run. The profiles are sent as node-1 itself, signed with its key; refused
    # profiles count as offences, which would evict it before the last of them (another test's subject).
    with _attacked_run(tmp_path, "run.steps=10", "scheduler.max_offences=100") as (cluster, _):
        stub = rpc.CoordinatorStub(make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: ""))
        # Refused by the host's registration rate, or (faster) by the peer's call rate.
        started = time.monotonic()
        outcomes = register_many(stub, 1000)
        elapsed = time.monotonic() - started
        assert set(outcomes) <= {"accepted", "rejected", "refused"}, outcomes
        # At most limits.registration_burst at once, then limits.registrations_per_s, get as far as being read (and
        # rejected: they carry no key); a slower machine lets more through, never more than that.
        limits = cluster.coordinator.cfg.limits
        read = outcomes["accepted"] + outcomes["rejected"]
        assert read <= limits.registration_burst + limits.registrations_per_s * elapsed + 1, (outcomes, elapsed)
        assert len(cluster.coordinator.members) == 3
        _steps_while(cluster, lambda: True, 2, 90)

        page = StatusPageProcess(cluster.coordinator.status, "127.0.0.1:0")
        port = page.start()
        try:
            codes = flood_status_page(port, 3000)
            assert sum(codes.values()) == 3000
            assert set(codes) <= {200, 429} and codes[429] >= 2000, codes
            assert codes[200] >= REQUEST_BURST
            _steps_while(cluster, lambda: True, 2, 90)
        finally:
            page.stop()

        key, _ = NodeKey.load_or_create(tmp_path / "node-1")
        stub = rpc.CoordinatorStub(make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: "node-1", key=key))
        honest = cluster.coordinator.members["node-1"].profile
        for report in extreme_profiles(honest, "node-2"):
            expect_status(grpc.StatusCode.INVALID_ARGUMENT, "must be in", lambda: stub.ReportProfile(report, timeout=10))
        assert cluster.coordinator.members["node-1"].profile is honest
        _steps_while(cluster, lambda: True, 2, 90)


@pytest.mark.timeout(60)
def test_a_registration_flood_from_one_key_leaves_a_neighbour_behind_the_same_nat_its_own_budget():
    from geotrain.protocol.auth import new_token
    from geotrain.scheduler.coordinator import Coordinator
    from geotrain.scheduler.service import make_coordinator_server

    coordinator = Coordinator(small_run("limits.registrations_per_s=0.5", "limits.registration_burst=3"))
    token = new_token()
    server, port = make_coordinator_server(coordinator, token, "127.0.0.1:0")
    server.start()
    attacker = Attacker(f"127.0.0.1:{port}", token)  # every caller here comes from 127.0.0.1: one NAT

    def register(node_id: str, key: NodeKey) -> str:
        try:
            return "accepted" if attacker.register(node_id, key).accepted else "rejected"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"

    try:
        started = time.monotonic()
        unsigned = register_many(attacker.coordinator(None, ""), 30)
        assert unsigned["refused"] >= 25, unsigned
        # One after another: the answer to each refused call is held twice as long as the last.
        one_key = Counter(register(f"{ATTACKER}-{i}", attacker.outsider) for i in range(10))
        assert sum(n for o, n in one_key.items() if "from this key" in o) >= 6, one_key
        assert register("neighbour", NodeKey.generate()) == "accepted"
        # A fresh key for every call empties the host's budget (8 keys' worth: a burst of 24, 4 a second) instead.
        fresh_keys = Counter(register(f"{ATTACKER}-fresh-{i}", NodeKey.generate()) for i in range(60))
        elapsed = time.monotonic() - started
        assert any("from this host" in o for o in fresh_keys), fresh_keys
        read = sum(c["accepted"] + c["rejected"] for c in (unsigned, one_key, fresh_keys)) + 1
        assert read <= 24 + 4 * elapsed + 1, (unsigned, one_key, fresh_keys, elapsed)
    finally:
        attacker.close()
        server.stop(grace=0.5).wait(2)
        coordinator.store.close()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_the_page_process_reads_the_status_once_a_push_however_many_requests():
    reads: list[float] = []

    def status() -> pb.StatusReply:
        reads.append(time.monotonic())
        return pb.StatusReply(state="training", step=len(reads), steps=10**6)  # a new snapshot at every read

    page = StatusPageProcess(status, "127.0.0.1:0", push_every_s=0.25)
    started = time.monotonic()
    port = page.start()
    try:
        codes = flood_status_page(port, 600)
        assert set(codes) <= {200, 429} and codes[200] >= REQUEST_BURST, codes
        # Pushes go on: the page shows later snapshots than the first (once the flood's 429s are over).
        def step_shown() -> int:
            code, body = _get(port, "/api/status")
            return int(json.loads(body)["step"]) if code == 200 else 0

        wait_until(lambda: step_shown() > 1, 10, "a later snapshot served", interval=0.2)
        assert len(reads) <= 2 + (time.monotonic() - started) / 0.25, (len(reads), codes)
        with pytest.raises(OSError):  # the port is taken: the process says so, and ends
            StatusPageProcess(status, f"127.0.0.1:{port}").start()
    finally:
        page.stop()
    assert not page.serving
    with pytest.raises(ConnectionRefusedError):
        _get(port, "/api/status")


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


def test_a_clipped_replica_is_an_event_once_per_step_when_a_majority_or_itself_says_so():
    from geotrain.scheduler.coordinator import Coordinator

    coordinator = Coordinator(small_run())
    coordinator.planning.plan = pb.Plan(epoch=1, stages=[
        pb.StageAssignment(index=0, node_ids=["a", "b", "c"], peer_ids=["peer-a", "peer-b", "peer-c"]),
        pb.StageAssignment(index=1, node_ids=["d"]),
    ])
    step = coordinator.step

    def report(reporter: str, peers: list[str], at: int = step) -> None:
        coordinator.note_clipped(pb.GradNormRequest(node_id=reporter, step=at, clipped_peers=peers))

    def clipped() -> list[tuple[str, str]]:
        return [(node, detail) for _, kind, node, detail in coordinator.store.events() if kind == "clipped"]

    # One replica of three flags b (a forged flag, or the first of a majority), as often as it likes; a node of
    # another stage, and a report about another step, count for nothing.
    for _ in range(3):
        report("a", ["peer-b", "nobody"])
    report("d", ["peer-b"])
    report("c", ["peer-b"], at=step + 1)
    assert clipped() == []
    report("c", ["peer-b"])  # the second of three: a majority
    report("b", ["peer-b"])  # and b's own reduction: still one event
    assert clipped() == [("b", f"step {step}: CenteredClip clipped its gradient (seen by a, c)")]
    report("c", ["peer-c"])  # its own reduction says so
    assert clipped()[-1] == ("c", f"step {step}: CenteredClip clipped its gradient (seen by c)")
    assert [e.kind for e in coordinator.status().events].count("clipped") == 2


@contextmanager
def _rate_limited_stage(limits: PeerLimits) -> Iterator[Attacker]:
    """A Stage server under `limits` whose every method answers UNIMPLEMENTED once admitted, and a caller of it."""
    server, port = make_server("limits-token", "127.0.0.1:0", limits)
    rpc.add_StageServicer_to_server(rpc.StageServicer(), server)
    server.start()
    caller = Attacker(f"127.0.0.1:{port}", "limits-token")
    try:
        yield caller
    finally:
        caller.close()
        server.stop(None)


@pytest.mark.timeout(30)
def test_a_peers_call_rate_is_its_keys_so_a_token_holder_claiming_its_id_spends_its_own():
    # From one host (as every node of a local run, or volunteers behind one NAT): an impostor that claims node-1's id,
    # signed by a key of its own or by none, uses up its own budget; node-1's signed calls still get through.
    member = NodeKey.generate()
    with _rate_limited_stage(PeerLimits(LimitValues(calls_per_s=1.0, call_burst=3))) as attacker:
        def fetch(key: NodeKey | None) -> grpc.StatusCode:
            stub = attacker.stage(attacker.address, key, "node-1")
            return answer(lambda: list(stub.FetchState(pb.FetchStateRequest(), timeout=10)))

        for key in (attacker.outsider, None):
            assert [fetch(key) for _ in range(5)][-1] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert fetch(member) == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.timeout(30)
def test_a_member_that_outpaces_its_call_budget_is_let_in_again_by_retrying():
    # A data head of a small fast model makes hundreds of calls a second to the coordinator: a call over its budget is
    # refused (RESOURCE_EXHAUSTED), and the caller's retry lands once the budget has refilled instead of failing.
    with _rate_limited_stage(PeerLimits(LimitValues(calls_per_s=4.0, call_burst=1))) as caller:
        stub = caller.stage(caller.address, NodeKey.generate(), "node-1")

        def fetch() -> list:
            return list(stub.FetchState(pb.FetchStateRequest(), timeout=10))

        assert answer(fetch) == grpc.StatusCode.UNIMPLEMENTED  # the burst
        assert answer(fetch) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert answer(lambda: call_with_retry(fetch, first_backoff_s=0.1)) == grpc.StatusCode.UNIMPLEMENTED


def test_a_backoff_doubles_with_each_refusal_in_a_row_up_to_its_cap_and_forgets():
    backoff = Backoff(first_s=0.01, max_s=0.05, forget_s=10.0)
    assert [backoff.delay("mallory", now=t) for t in range(5)] == [0.01, 0.02, 0.04, 0.05, 0.05]
    assert backoff.delay("neighbour", now=5.0) == 0.01  # a caller of its own
    assert backoff.delay("mallory", now=20.0) == 0.01  # quiet for longer than forget_s


class _Denying(rpc.StageServicer):
    """FetchState refused to every caller, as to a key that may not read the state."""

    def FetchState(self, request, context):  # noqa: N802
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")


@pytest.mark.timeout(30)
def test_a_sync_server_holds_its_answers_to_a_caller_it_keeps_denying():
    limits = PeerLimits()
    limits.backoff = Backoff(first_s=0.05, max_s=0.2)
    server, port = make_server("limits-token", "127.0.0.1:0", limits)
    rpc.add_StageServicer_to_server(_Denying(), server)
    server.start()
    attacker = Attacker(f"127.0.0.1:{port}", "limits-token")
    try:
        stub = attacker.stage(attacker.address, attacker.outsider, "node-1")
        started = time.monotonic()
        codes = {answer(lambda: list(stub.FetchState(pb.FetchStateRequest(), timeout=10))) for _ in range(5)}
        assert codes == {grpc.StatusCode.PERMISSION_DENIED}
        assert time.monotonic() - started >= 0.05 + 0.1 + 0.2 * 3  # held: 0.05, 0.1, then 0.2 each
    finally:
        attacker.close()
        server.stop(None)


class _Holding(rpc.StageServicer):
    """Forward holds its worker until `release`, counting the calls inside at once."""

    def __init__(self) -> None:
        self.inside = 0
        self.over_cap = threading.Event()  # set if more calls than a connection may have are inside at once
        self.release = threading.Event()
        self._lock = threading.Lock()

    def Forward(self, request_iterator, context):  # noqa: N802
        with self._lock:
            self.inside += 1
            if self.inside > NODE_STREAMS_PER_CONNECTION:
                self.over_cap.set()
        self.release.wait(20)
        with self._lock:
            self.inside -= 1
        return pb.Ack()


@pytest.mark.timeout(30)
def test_a_node_takes_at_most_16_streams_a_connection_at_once_in_http2_before_its_python():
    # 20 streams on one connection, under a per-peer limit of 32: the node's server runs 16 at once; HTTP/2 keeps the
    # other 4 from its workers, interceptors and interpreter lock (the client holds them for a free stream, or they
    # are refused, UNAVAILABLE, when they race one that ends); none is refused over a limit.
    holding = _Holding()
    server, port = make_server("limits-token", "127.0.0.1:0", PeerLimits(LimitValues(streams_per_peer=32)))
    rpc.add_StageServicer_to_server(holding, server)
    server.start()
    attacker = Attacker(f"127.0.0.1:{port}", "limits-token")
    try:
        stub = attacker.stage(attacker.address, attacker.outsider, ATTACKER)
        calls = [stub.Forward.future(iter(()), timeout=20) for _ in range(20)]
        wait_until(lambda: holding.inside == NODE_STREAMS_PER_CONNECTION, 10, "16 calls inside the node's server")
        assert not holding.over_cap.wait(0.5), "more of one connection's calls inside the server at once than 16"
        holding.release.set()
        codes = Counter(answer(call.result) for call in calls)
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
        assert codes[grpc.StatusCode.OK] >= NODE_STREAMS_PER_CONNECTION, codes
    finally:
        holding.release.set()
        attacker.close()
        server.stop(None)
