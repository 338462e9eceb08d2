"""The coordinator's control plane under many idle members: open order streams and heartbeats hold no thread.

On the thread-per-call server, about 64 idle order streams from one client took every worker, and a live run
stopped committing steps. Here 200 registered members (never planned into the run) hold their streams open and
heartbeat next to a small live run, which must keep committing steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import make_channel
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler import placement
from tests.conftest import LocalCluster, local_cluster, small_run, wait_until

pytestmark = pytest.mark.cluster  # a coordinator and node processes

IDLE_MEMBERS = 200


@contextmanager
def idle_members(cluster: LocalCluster, n: int, interval_s: float) -> Iterator[list[str]]:
    """n members registered from one client, each holding its order stream open and heartbeating every interval_s
    from one thread; yields their ids; always cancels the streams. Raises, on leaving, what a heartbeat met."""
    # One client key owns every member it registers, and signs their calls.
    key = NodeKey.generate()
    channel = make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: "idle-client", key=key)
    stub = rpc.CoordinatorStub(channel)
    streams: list[grpc.Call] = []
    stop = threading.Event()
    problems: list[str] = []
    ids: list[str] = []

    def beat() -> None:
        # Members beat from the moment they registered, so that none dies while the others register.
        while not stop.wait(interval_s):
            for node_id in list(ids):
                try:
                    if not stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=10).known:
                        problems.append(f"{node_id} is unknown to the coordinator")
                except grpc.RpcError as e:
                    problems.append(f"heartbeat of {node_id}: {e.code()} {e.details()}")
                if problems or stop.is_set():
                    return

    beater = threading.Thread(target=beat, name="idle-heartbeats", daemon=True)
    beater.start()
    try:
        for i in range(n):
            request = pb.RegisterRequest(
                protocol_version=PROTOCOL_VERSION, address=f"127.0.0.2:{i + 1}", public_key=key.public
            )
            reply = stub.Register(request, timeout=30)
            assert reply.accepted, reply.message
            # A server-streaming call is open once made; nothing here reads it, as an idle node reads nothing.
            streams.append(stub.Orders(pb.OrdersRequest(node_id=reply.node_id)))
            ids.append(reply.node_id)
        yield ids
        stop.set()
        beater.join(30)
        assert not beater.is_alive() and not problems, problems[:3]
        assert all(s.is_active() for s in streams), "an idle member's order stream ended"
    finally:
        stop.set()
        for s in streams:
            s.cancel()
        channel.close()


@pytest.mark.timeout(180)
def test_idle_streams_do_not_stop_a_live_run(tmp_path):
    # One stage per node and one replica per stage: the members that join after the plan can only be spares.
    # The idle members all call from one client (one peer, one host): the per-peer limits, the spares one host may
    # hold and its pace of new ids would refuse most of them.
    cfg = small_run("run.steps=8", "scheduler.stages=2", "scheduler.replicas=1",
                    "scheduler.heartbeat_interval_s=1.0", "scheduler.heartbeat_timeout_s=5.0",
                    "limits.registration_burst=1000", "limits.calls_per_s=10000", "limits.call_burst=10000",
                    "scheduler.spares_per_host=1000", "scheduler.spares_per_subnet=1000", "scheduler.new_id_burst=1000")
    members_in = threading.Event()

    def hold_after_each_step(kind: str, _data: dict) -> None:
        # The run waits after its first step until the idle members are in, however long registering them takes, so
        # that steps are left to count with their streams open.
        if kind == "step":
            members_in.wait(120)

    with local_cluster(cfg, 2, tmp_path, on_event=hold_after_each_step) as cluster:
        coordinator = cluster.coordinator
        wait_until(lambda: coordinator.store.committed_steps() >= 1, 90, "the first step")
        with idle_members(cluster, IDLE_MEMBERS, cfg.scheduler.heartbeat_interval_s) as ids:
            assert len(coordinator.membership.alive()) == 2 + IDLE_MEMBERS
            committed = coordinator.store.committed_steps()
            members_in.set()
            wait_until(lambda: coordinator.store.committed_steps() >= committed + 3, 60,
                       f"3 more steps with {IDLE_MEMBERS} idle order streams open")
            assert not set(ids) & set(placement.plan_nodes(coordinator.plan)), "an idle member was planned in"
        summary = cluster.wait(60)
    assert summary.steps == cfg.run.steps
