"""Admission and liveness on the coordinator, in this process: malformed or excess registrations are turned down
with a reason and leave nothing behind, heartbeats with bad numbers are refused, members die on the timer."""

from __future__ import annotations

import threading
import time

import pytest

from geotrain.config import load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.errors import ReportRefused, StepFailed
from geotrain.scheduler.membership import _SPARE_HEARTBEATS_PER_S, Lifecycle
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(30)


def _register(c: Coordinator, node_id: str = "", address: str = "127.0.0.1:1", region: str = "") -> pb.RegisterReply:
    return c.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=address, region=region))


@pytest.mark.parametrize(
    ("node_id", "address", "region"),
    [
        ("\x00", "127.0.0.1:1", ""),
        ("a" * 65, "127.0.0.1:1", ""),
        ("with space", "127.0.0.1:1", ""),
        ("", "x" * 100_000, ""),
        ("", "no-port", ""),
        ("", "127.0.0.1:0", ""),
        ("", "127.0.0.1:65536", ""),
        ("", "127.0.0.1:http", ""),
        ("", "<script>:80", ""),
        ("", "127.0.0.1:1", "eu\nus"),
    ],
)
def test_malformed_registrations_are_turned_down_and_leave_nothing(node_id, address, region):
    c = Coordinator(load_config(None, []))
    reply = _register(c, node_id, address, region)
    assert not reply.accepted and reply.reason == pb.REJECT_REASON_BAD_REQUEST
    assert len(reply.message) < 200 and "\n" not in reply.message
    assert c.members == {} and c.store.events() == []
    c.store.close()


def test_well_formed_names_are_admitted():
    c = Coordinator(load_config(None, []))
    for node_id, address in (("node-1", "127.0.0.1:7001"), ("gpu.box_2", "host.example.org:7001"), ("", "[::1]:7001")):
        assert _register(c, node_id, address, "eu-west").accepted
    c.store.close()


def test_registrations_beyond_max_members_are_turned_down():
    c = Coordinator(load_config(None, ["scheduler.max_members=100"]))
    replies = [_register(c, address=f"127.0.0.1:{1000 + i}") for i in range(1000)]
    assert sum(r.accepted for r in replies) == 100
    assert {r.reason for r in replies if not r.accepted} == {pb.REJECT_REASON_FULL}
    assert len(c.members) == 100
    assert _register(c, node_id="node-1", address="127.0.0.2:1").accepted, "a known id may still come back"
    c.store.close()


@pytest.mark.parametrize("field", ["speed", "peer id", "links"])
def test_heartbeats_with_bad_fields_are_refused_and_change_nothing(field):
    c = Coordinator(load_config(None, []))
    node_id = _register(c).node_id
    bad = {
        "speed": {"microbatches_per_s": float("inf")},
        "peer id": {"dht_peer_id": "p" * 10_000},
        "links": {"links": [pb.LinkCounter(peer="x")] * 2000},
    }[field]
    with pytest.raises(ReportRefused, match=f"heartbeat from {node_id} refused"):
        c.heartbeat(pb.HeartbeatRequest(node_id=node_id, plan_epoch=7, **bad))
    assert c.members[node_id].plan_epoch == 0 and c.members[node_id].microbatches_per_s == 0.0
    c.store.close()


def test_silent_members_are_declared_dead_on_the_timer_without_a_step_waiting():
    c = Coordinator(load_config(None, ["scheduler.heartbeat_interval_s=0.1", "scheduler.heartbeat_timeout_s=0.3"]))
    node_id = _register(c).node_id
    stop = threading.Event()
    c.membership.run_liveness(stop)
    try:
        # The death is recorded just after the member is marked dead, outside the membership lock.
        wait_until(lambda: len(c.store.events()) == 2, 5, "the silent node's death to be recorded")
    finally:
        stop.set()
    assert c.members[node_id].lifecycle.value == "dead"
    assert [k for _, k, _, _ in c.store.events()] == ["join", "dead"]
    c.store.close()


def test_the_status_is_rendered_a_few_times_a_second_however_often_it_is_asked(monkeypatch):
    c = Coordinator(load_config(None, []))
    _register(c)
    taken = []
    snapshot = c.snapshot
    monkeypatch.setattr(c, "snapshot", lambda: taken.append(1) or snapshot())
    started = time.monotonic()
    replies = [c.status() for _ in range(3000)]
    elapsed = time.monotonic() - started
    assert len(taken) <= 1 + elapsed / 0.5
    assert all(r.nodes[0].node_id == "node-1" for r in replies)
    _register(c)  # an event: the status shows it within _STATUS_MIN_AGE_S
    wait_until(lambda: [n.node_id for n in c.status().nodes] == ["node-1", "node-2"], 2, "the new member shown")
    c.store.close()


def test_spares_of_a_large_run_beat_less_often_and_are_given_as_many_of_their_intervals():
    c = Coordinator(load_config(None, ["scheduler.heartbeat_interval_s=1", "scheduler.heartbeat_timeout_s=5"]))
    ids = [_register(c, address=f"127.0.0.1:{1000 + i}").node_id for i in range(200)]
    serving = c.members[ids[0]]
    serving.lifecycle = Lifecycle.SERVING  # as a plan would have it
    beat = lambda node_id: c.heartbeat(pb.HeartbeatRequest(node_id=node_id)).next_heartbeat_s  # noqa: E731
    assert beat(ids[1]) == 1.0, "a small crowd of spares beats at the run's interval until the timer counts them"
    c.membership.check_liveness()
    spare_interval = 199 / _SPARE_HEARTBEATS_PER_S
    assert beat(ids[1]) == pytest.approx(spare_interval) and beat(ids[0]) == 1.0
    for member in (serving, c.members[ids[1]]):
        member.last_seen -= 10  # two of the run's timeouts, less than the spare's (as many of its intervals)
    c.membership.check_liveness()
    assert not serving.alive and c.members[ids[1]].alive
    c.members[ids[1]].last_seen -= 5 * spare_interval
    c.membership.check_liveness()
    assert not c.members[ids[1]].alive
    assert not c.heartbeat(pb.HeartbeatRequest(node_id=ids[1])).known
    c.store.close()


def test_a_replica_whose_hivemind_never_joins_is_left_out_after_two_plans():
    # Three replicas of one stage; node-3's DHT never reports a peer id (a firewall, a broken install). Each plan that
    # waits for it fails the step instead of ending the run, and after two the layout goes on without it.
    c = Coordinator(load_config(None, ["scheduler.stages=1", "scheduler.placement=uniform", "scheduler.step_timeout_s=1"]))
    ids = [_register(c, address=f"127.0.0.1:{7001 + i}").node_id for i in range(3)]
    for node_id in ids[:2]:
        c.heartbeat(pb.HeartbeatRequest(node_id=node_id, dht_peer_id=f"peer-of-{node_id}"))
    for _ in range(2):
        with pytest.raises(StepFailed, match=f"replicas {ids[2]} did not join the averaging"):
            c.planning.replan(0)
    with pytest.raises(StepFailed, match="nodes to take up the plan"):  # nobody runs these nodes: the plan is made
        c.planning.replan(0)
    assert list(c.plan.stages[0].node_ids) == ids[:2]
    assert "averaging (hivemind)" in c.plan.excluded[ids[2]]
    assert [(kind, node_id) for _, kind, node_id, _ in c.store.events() if kind == "excluded"] == [("excluded", ids[2])]
    # Its DHT joining late, or registering again (a fixed firewall, a restart), makes it a candidate once more.
    c.heartbeat(pb.HeartbeatRequest(node_id=ids[2], dht_peer_id="late"))
    assert ids[2] not in c.planning.left_out()
    c.heartbeat(pb.HeartbeatRequest(node_id=ids[2]))  # its DHT gone again
    assert ids[2] in c.planning.left_out()
    _register(c, node_id=ids[2], address="127.0.0.1:7101")
    assert ids[2] not in c.planning.left_out()
    c.store.close()
