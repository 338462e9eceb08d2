"""Admission and liveness on the coordinator, in this process: malformed or excess registrations are turned down
with a reason and leave nothing behind, heartbeats with bad numbers are refused, members die on the timer."""

from __future__ import annotations

import threading
import time

import pytest

from geotrain.config import load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.errors import ReportRefused, StepFailed
from geotrain.scheduler.membership import _SPARE_HEARTBEATS_PER_S, Lifecycle, Member, Membership, Rejected, Scope
from geotrain.scheduler.orders import OrderQueues
from geotrain.scheduler.state import RunStore
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


# -- a token holder's identities are worth nothing: failure reports, fake ids, checkpoint fetches ---------------


def _join(m: Membership, node_id: str, host: str) -> Member:
    """A member `node_id` from `host`, with a key of its own."""
    address = f"[{host}]:1" if ":" in host else f"{host}:1"
    request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=address,
                                 public_key=NodeKey.generate().public)
    m.screen(request, host)
    return m.admit(request, set(), host=host)


def _membership(*overrides: str) -> Membership:
    cfg = load_config(None, ["scheduler.heartbeat_interval_s=1", "scheduler.heartbeat_timeout_s=5", *overrides])
    return Membership(cfg.scheduler, RunStore(), OrderQueues(), lambda kind, data: None)


def _pipeline(m: Membership, *stages: list[str]) -> pb.Plan:
    plan = pb.Plan(epoch=3, stages=[pb.StageAssignment(index=i, layer_start=i, layer_end=i + 1, node_ids=nodes)
                                    for i, nodes in enumerate(stages)])
    m.take_up(plan)
    return plan


def _late(m: Membership, node_id: str, seconds: float) -> bool:
    """Whether check_liveness declares node_id dead when its last heartbeat was `seconds` ago."""
    m.members[node_id].last_seen = time.monotonic() - seconds
    m.check_liveness()
    return not m.members[node_id].alive


def _report(m: Membership, plan: pb.Plan, reporter: str, peer: str, epoch: int = 0) -> Member | None:
    return m.report_failure(pb.FailureReport(node_id=reporter, peer=peer, detail="DEADLINE_EXCEEDED",
                                             plan_epoch=epoch), plan)


def test_a_failure_report_counts_only_from_a_neighbour_and_shortens_nothing_alone():
    m = _membership()
    for node_id, host in (("a", "10.0.0.1"), ("b", "10.0.1.1"), ("c", "10.0.2.1"), ("d", "10.0.3.1")):
        _join(m, node_id, host)
    sybil = _join(m, "sybil", "10.0.9.1")
    plan = _pipeline(m, ["a"], ["b"], ["c", "d"])
    # A member no plan used calls nobody: refused (an offence). A planned non-neighbour, or another epoch: ignored.
    with pytest.raises(ReportRefused, match="serves no stage"):
        _report(m, plan, sybil.node_id, "b")
    assert _report(m, plan, "a", "c") is None and _report(m, plan, "b", "a", epoch=2) is None
    assert not _late(m, "c", 1.7) and not _late(m, "a", 1.7)
    # One neighbour's report: the coordinator is to probe; until it fails, the timeout stays heartbeat_timeout_s.
    assert _report(m, plan, "b", "c").node_id == "c"
    assert _report(m, plan, "b", "c") is None  # the same reporter again: no second probe
    assert not _late(m, "c", 1.7)
    m.probed("c", answered=True)
    assert not _late(m, "c", 1.7)
    m.probed("c", answered=False)
    assert _late(m, "c", 1.7), "a peer reported failing that the coordinator's probe cannot reach is dead when late"
    # Two independent neighbours (other keys, other hosts) need no probe; a heartbeat clears the suspicion.
    _report(m, plan, "b", "d")
    _report(m, plan, "a", "b")
    _report(m, plan, "c", "b")
    m.heartbeat(pb.HeartbeatRequest(node_id="b"))
    assert not _late(m, "b", 1.7) and _late(m, "b", 5.1)


def test_an_accusation_the_accused_answers_in_a_fast_step_is_the_accusers_offence():
    m = _membership("scheduler.max_offences=2")
    for node_id, host in (("a", "10.0.0.1"), ("b", "10.0.1.1")):
        _join(m, node_id, host)
    plan = _pipeline(m, ["a"], ["b"])
    for step in (1, 2):
        _report(m, plan, "a", "b")
        m.heartbeat(pb.HeartbeatRequest(node_id="b", applied_step=step))  # b heartbeats and applied a step
        assert m.members["a"].offences == step - 1, "a heartbeat judges nothing: the step's commit does"
        m.judge_reports(plan.epoch, slow=False)
    assert m.members["a"].lifecycle is Lifecycle.DEAD and m.members["b"].alive
    assert [kind for _, kind, node, _ in m.store.events() if node == "a"][-1] == "evicted"


def test_an_accusation_the_accused_answers_in_a_slow_step_benches_it_and_costs_the_accuser_nothing():
    m = _membership("scheduler.max_offences=2", "scheduler.stall_refusal_s=30")
    for node_id, host in (("a", "10.0.0.1"), ("b", "10.0.1.1"), ("c", "10.0.2.1")):
        _join(m, node_id, host)
    plan = _pipeline(m, ["a"], ["b"], ["c"])
    for step in (1, 2, 3):  # more reports than max_offences: none counts against a
        _report(m, plan, "a", "b")
        m.heartbeat(pb.HeartbeatRequest(node_id="b", applied_step=step))
        m.judge_reports(plan.epoch, slow=True)
    assert m.members["a"].offences == 0 and m.members["a"].alive
    assert set(m.benched()) == {"b"} and m._stalls[("key", m.members["b"].public_key)][0] == 3
    # A step neither fast nor slow judges nobody; a report the accused has not answered yet waits for its commit;
    # one about an earlier epoch is dropped.
    _report(m, plan, "b", "c")
    m.heartbeat(pb.HeartbeatRequest(node_id="c", applied_step=4))
    m.judge_reports(plan.epoch, slow=None)
    _report(m, plan, "c", "b")
    m.judge_reports(plan.epoch, slow=False)
    assert "b" in m._accusations and m.members["c"].offences == 0 and m.members["b"].offences == 0
    m.judge_reports(plan.epoch + 1, slow=False)
    assert m._accusations == {} and m.members["c"].offences == 0


def test_a_step_past_what_its_plan_allows_fails_at_once_and_benches_the_reported_holder():
    m = _membership("scheduler.stall_refusal_s=30")
    for node_id, host in (("a", "10.0.0.1"), ("b", "10.0.1.1"), ("c", "10.0.2.1")):
        _join(m, node_id, host)
    plan = _pipeline(m, ["a"], ["b"], ["c"])
    nodes = ("a", "b", "c")
    past = Scope(plan.epoch, nodes, stall_after=time.monotonic() - 1)
    with pytest.raises(StepFailed, match="timed out"):  # nobody reported: the step times out as before
        m.wait(lambda: False, "microbatches", 0.3, past)
    assert m.benched() == {}
    _report(m, plan, "a", "b")
    with pytest.raises(StepFailed, match="stalled past what plan epoch 3 allows"):
        m.wait(lambda: False, "microbatches", 30, Scope(plan.epoch, nodes, stall_after=time.monotonic() + 0.2))
    assert set(m.benched()) == {"b"}


def test_ids_that_stay_dead_or_never_profile_are_forgotten_and_max_members_counts_live_ones():
    m = _membership("scheduler.max_members=3", "scheduler.forget_after_s=60")
    for i in range(3):
        _join(m, f"fake-{i}", f"10.{i}.0.1")
    with pytest.raises(Rejected, match="admits 3 nodes"):
        _join(m, "honest", "10.9.0.1")
    for i in range(3):
        assert _late(m, f"fake-{i}", 6)  # the fakes never heartbeat
    honest = _join(m, "honest", "10.9.0.1")  # dead ones hold no room
    for member in m.members.values():
        member.died_at -= 61
    honest.joined_at -= 61
    m.check_liveness()
    assert set(m.members) == set(), "dead for 60 s, or never profiled for 60 s: forgotten"
    # A forgotten id stays its key's.
    with pytest.raises(Rejected, match="belongs to another key"):
        _join(m, "fake-0", "10.0.0.1")


def test_new_ids_from_one_place_are_capped_and_paced_and_others_still_get_in():
    m = _membership("scheduler.spares_per_host=3", "scheduler.spares_per_subnet=5", "scheduler.new_id_burst=100")
    for i in range(3):
        _join(m, f"h-{i}", "10.0.0.1")
    with pytest.raises(Rejected, match="host 10.0.0.1 has 3 members that serve no stage"):
        _join(m, "h-3", "10.0.0.1")
    _join(m, "n-0", "10.0.0.2")
    _join(m, "n-1", "10.0.0.3")
    with pytest.raises(Rejected, match=r"network 10.0.0.0/24 has 5"):
        _join(m, "n-2", "10.0.0.4")
    assert _join(m, "elsewhere", "10.0.1.1").alive
    _pipeline(m, ["h-0"])  # planned members count against no cap
    assert _join(m, "h-3", "10.0.0.1").alive
    paced = _membership("scheduler.new_id_burst=4", "scheduler.new_ids_per_s=0.001")
    for i in range(4):
        _join(paced, f"p-{i}", "2001:db8::1")
    with pytest.raises(Rejected, match="this host registers new node ids at most"):
        _join(paced, "p-4", "2001:db8::1")
    with pytest.raises(Rejected, match="this subnet registers new node ids at most"):
        for i in range(40):
            _join(paced, f"q-{i}", f"2001:db8::{i + 2:x}")
    assert _join(paced, "v", "2001:db8:1::1").alive, "a flood from one /64 leaves room for volunteers of another"


def test_checkpoint_state_goes_only_to_a_member_ordered_to_load_it_in_that_epoch():
    m = _membership()
    a, b = _join(m, "a", "10.0.0.1"), _join(m, "b", "10.0.1.1")
    plan = _pipeline(m, ["a"], ["b"])
    m.orders.send(["a"], pb.Order(load_state=pb.LoadState(plan_epoch=3, steps_done=7)))
    m.orders.send(["b"], pb.Order(load_state=pb.LoadState(plan_epoch=3, steps_done=7, source_address="x:1")))
    assert m.load_ordered(a.public_key, plan, (0, 1), 7)
    assert not m.load_ordered(a.public_key, plan, (1, 2), 7)  # another stage's layers
    assert not m.load_ordered(a.public_key, plan, (0, 1), 6)  # another step
    assert not m.load_ordered(b.public_key, plan, (1, 2), 7)  # ordered to load from a peer, not the coordinator
    assert not m.load_ordered(NodeKey.generate().public, plan, (0, 1), 7) and not m.load_ordered(None, plan, (0, 1), 7)
    later = pb.Plan(epoch=4, stages=plan.stages)
    assert not m.load_ordered(a.public_key, later, (0, 1), 7)  # ordered in another epoch


def test_a_key_whose_stages_stall_is_refused_stages_for_a_growing_time_and_then_its_host_new_ids():
    m = _membership("scheduler.stall_refusal_s=30")
    for node_id, host in (("a", "10.0.0.1"), ("b", "10.0.1.1"), ("c", "10.0.2.1")):
        _join(m, node_id, host)
    plan = _pipeline(m, ["a"], ["b"], ["c"])

    def stall(epoch: int) -> None:
        with pytest.raises(StepFailed, match="timed out"):
            m.wait(lambda: False, "microbatches", 0.01, Scope(epoch, tuple(n for s in plan.stages for n in s.node_ids)))

    _report(m, plan, "a", "b")  # b took the stage, answers the probe, and never forwards
    stall(3)
    assert set(m.benched()) == {"b"}
    first = m._stalls[("key", m.members["b"].public_key)][1] - time.monotonic()
    assert 29 < first <= 30  # scheduler.stall_refusal_s
    # The same key under a new id is refused stages as well; the next stall doubles the time.
    again = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id="b2", address="10.0.1.1:2",
                               public_key=m.members["b"].public_key)
    m.admit(again, set(), host="10.0.1.1")
    assert set(m.benched()) == {"b", "b2"}
    plan.epoch = 4
    _report(m, plan, "a", "b")
    stall(4)
    assert m._stalls[("key", m.members["b"].public_key)][1] - time.monotonic() > 1.9 * first
    # Keys of that host that never stalled keep their stages (local nodes share a host); once three of its keys
    # stalled, the host registers no new ids for a while, and its other keys still serve.
    honest = _join(m, "h", "10.0.1.1")
    for epoch, node_id in ((5, "b3"), (6, "b4")):
        _join(m, node_id, "10.0.1.1")
        plan = _pipeline(m, ["a"], [node_id], ["c"])
        plan.epoch = epoch
        _report(m, plan, "a", node_id)
        stall(epoch)
        assert node_id in m.benched() and "h" not in m.benched()
    with pytest.raises(Rejected, match="host 10.0.1.1 registers no new node ids for 3[0-9]s more: 3 of its keys"):
        _join(m, "b5", "10.0.1.1")
    assert honest.alive and "h" not in m.benched() and _join(m, "elsewhere", "10.0.2.2").alive
    # Two nodes that blame each other are not told apart: neither is refused.
    plan.epoch = 7
    _report(m, plan, "a", "c")
    _report(m, plan, "c", "a")
    stall(7)
    assert "a" not in m.benched() and "c" not in m.benched()


def test_a_stage_holder_whose_key_stalled_is_left_out_of_the_next_plan_and_a_spare_takes_its_stage():
    c = Coordinator(load_config(None, ["scheduler.stages=3", "scheduler.replicas=1", "scheduler.placement=uniform",
                                       "scheduler.step_timeout_s=1", "scheduler.state_deadline_floor_s=1"]))
    for i, node_id in enumerate("abcd"):  # d joins last: a spare
        c.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=f"127.0.0.1:{7001 + i}",
                                      public_key=NodeKey.generate().public))
    failed = []

    def replan() -> None:
        with pytest.raises(StepFailed, match="timed out") as e:  # nobody runs these nodes: nobody takes the plan up
            c.planning.replan(0)
        failed.append(e.value)

    taking_up = threading.Thread(target=replan)
    taking_up.start()
    wait_until(lambda: c.plan is not None, 10, "the first plan")
    assert [list(s.node_ids) for s in c.plan.stages] == [["a"], ["b"], ["c"]]
    c.report_failure(pb.FailureReport(node_id="a", peer="b", detail="DEADLINE_EXCEEDED"))  # b holds a's tensors
    taking_up.join()
    assert failed and "b" in c.planning.left_out() and "refused stages" in c.planning.left_out()["b"]
    assert not c.planning.is_current(), "a plan with a benched node is replaced before the next step"
    assert [(kind, node) for _, kind, node, _ in c.store.events() if kind == "benched"] == [("benched", "b")]
    replan()  # the next plan: b stays a spare, d takes its stage
    assert [list(s.node_ids) for s in c.plan.stages] == [["a"], ["d"], ["c"]] and "b" in c.plan.excluded
    c.store.close()
