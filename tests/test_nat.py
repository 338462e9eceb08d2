"""Nodes nobody can dial (behind NAT): the coordinator's dial-back at registration, and links that run over streams the
unreachable node opens (node/reverse.py), equal to train-local."""

from __future__ import annotations

import asyncio
import socket
import zlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import ip_address

import grpc
import pytest
import torch
from safetensors.torch import load_file

from geotrain.config import load_config
from geotrain.node.reverse import ReverseError, ReverseReceiver, ReverseSender, relay_chunks
from geotrain.node.servicer import StageServicer, add_stage_service
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import RefusalLog, new_token
from geotrain.protocol.framing import FrameError
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import make_channel, make_server
from geotrain.scheduler.membership import Member
from geotrain.scheduler.placement import relay_routes, state_sources
from geotrain.scheduler.reachability import DIRECT, UNREACHABLE, target
from tests.conftest import expect_status, local_cluster, max_diff, small_run, train_local_state, wait_until


def _saved_model(coordinator, steps: int, tmp_path) -> dict[str, torch.Tensor]:
    """The model as `geotrain coordinator --save-final` writes it: streamed stage by stage from a holder of each
    (by upload from a node nobody can dial)."""
    path = tmp_path / "final.safetensors"
    coordinator.save_model(path, steps, {})
    return load_file(path)


@contextmanager
def dead_port() -> Iterator[int]:
    """A loopback port that refuses connections while the block runs: bound, never listening, so no one takes it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_dial_back_dials_only_the_callers_own_address():
    def where(advertised: str, caller: str) -> tuple[str | None, str | None, str]:
        found = target(advertised, caller,
                       resolver=lambda name: {ip_address("203.0.113.9")} if name == "me.example" else set())
        return found.dial, found.reached, found.case

    # A local run: 127.0.0.1 advertised and called from, dialled there.
    assert where("127.0.0.1:7100", "ipv4:127.0.0.1:4000") == ("127.0.0.1:7100", "127.0.0.1:7100", "DIRECT")
    assert where("203.0.113.9:7100", "ipv4:203.0.113.9:51234") == ("203.0.113.9:7100", "203.0.113.9:7100", "DIRECT")
    # A LAN address behind a forwarded port (the NAT case): the advertised port at the caller's host, not the LAN's.
    assert where("192.168.1.5:7100", "ipv4:203.0.113.9:51234") == ("203.0.113.9:7100", "203.0.113.9:7100", "NAT")
    assert where("[fd00::5]:7100", "ipv6:[2001:db8::9]:4000") == ("[2001:db8::9]:7100", "[2001:db8::9]:7100", "NAT")
    # A third host named by the caller is never dialled: its own host is, at that port.
    assert where("127.0.0.2:7100", "ipv4:198.51.100.7:4000")[0] == "198.51.100.7:7100"
    # A DNS name that resolves to the caller: its address dialled, the name kept for peers; one that does not: NAT.
    assert where("me.example:7100", "ipv4:203.0.113.9:1") == ("203.0.113.9:7100", "me.example:7100", "NAME")
    assert where("other.example:7100", "ipv4:203.0.113.9:1")[0] == "203.0.113.9:7100"
    # Through a proxy on the coordinator's host (loopback naming another host) or no TCP: nothing is dialled.
    assert where("10.0.0.5:7100", "ipv4:127.0.0.1:4000") == (None, None, "PROXIED")
    assert where("127.0.0.2:7100", "ipv4:127.0.0.1:4000") == (None, None, "PROXIED")
    assert where("10.0.0.5:7100", "unix:/tmp/socket") == (None, None, "PROXIED")
    # Unless the operator said calls come through a relay on the coordinator's host (scheduler.behind_proxy).
    relayed = target("10.0.0.5:7100", "ipv4:127.0.0.1:4000", behind_proxy=True)
    assert (relayed.dial, relayed.case) == ("10.0.0.5:7100", "RELAYED")


def _attack(cluster, tmp_path) -> None:
    """Reverse streams and state uploads nobody asked for, each refused with a clear status (the run goes on)."""
    keys = {n: NodeKey.load_or_create(tmp_path / n)[0] for n in ("node-1", "node-2", "node-3")}
    node_1 = cluster.coordinator.plan.stages[0].addresses[0]

    def stage(as_node: str) -> rpc.StageStub:
        return rpc.StageStub(make_channel(node_1, cluster.token, lambda: as_node, key=keys[as_node]))

    def reverse(as_node: str, nonce: bytes) -> list[pb.ReverseDown]:
        return list(stage(as_node).Reverse(iter([pb.ReverseUp(open=pb.ReverseOpen(nonce=nonce))]), timeout=10))

    # node-1 sends to node-2 over a stream only node-2 may open; node-3 can be dialled, and is no neighbour of node-1.
    refused = "sends to no unreachable node"
    expect_status(grpc.StatusCode.FAILED_PRECONDITION, refused, lambda: reverse("node-3", bytes(32)))
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, "nonce of 16 to 64 bytes", lambda: reverse("node-2", b"short"))
    coordinator = rpc.CoordinatorStub(make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: "node-1",
                                                   key=keys["node-1"]))

    def upload(node_id: str) -> None:
        coordinator.UploadState(iter([pb.StateUpload(node_id=node_id, request=999)]), timeout=10)

    expect_status(grpc.StatusCode.INVALID_ARGUMENT, "no state upload 999 was asked of node-1", lambda: upload("node-1"))
    expect_status(grpc.StatusCode.PERMISSION_DENIED, "", lambda: upload("node-3"))


def test_a_state_held_only_by_nodes_nobody_can_dial_comes_through_the_coordinator():
    def member(node_id: str, reachability: str, held: tuple[int, int] = (0, 0)) -> Member:
        return Member(node_id, f"{node_id}:1", "eu", 0.0, 0.0, held=held, applied_steps=5 if held != (0, 0) else 0,
                      reachability=reachability)

    nat, open_, joiner = member("nat", UNREACHABLE, (0, 2)), member("open", DIRECT, (0, 2)), member("new", DIRECT)
    # A holder that can be dialled is the source wherever there is one; else the joiner loads through the coordinator
    # (LoadState.source_address ''), which has the holder upload the state.
    found = state_sources([(0, 2)], [[nat, open_, joiner]], [(0, 2)], [nat, open_, joiner], 5, {0: "sum"})
    assert found.from_peers == {"new": ("open:1", "sum")} and not found.reshaped
    found = state_sources([(0, 2)], [[nat, joiner]], [(0, 2)], [nat, joiner], 5, {0: "sum"})
    assert found.from_peers == {"new": ("", "sum")} and not found.reshaped


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_a_node_nobody_can_dial_serves_its_stage_over_reverse_links(tmp_path):
    # node-2 advertises a port that refuses every connection, so the coordinator's dial-back fails as it does behind
    # NAT; its neighbours must send to it over the streams it opens, and the run must still equal train-local.
    # Links reach the status with heartbeats: frequent ones, so that the last has counted every link of so short a run
    # (at 1 s, node-2's link to node-1 was missing from it once in a loaded suite run).
    settings = ["run.steps=4", "train.microbatches=4", "train.inflight=2", "run.eval_every=2",
                "run.eval_microbatches=2", "scheduler.placement=uniform", "profile.layer_repeats=1",
                "scheduler.heartbeat_interval_s=0.2"]
    cfg = load_config(None, settings)
    plan_ready, attacks_done = threading.Event(), threading.Event()

    def hold_after_plan(kind: str, _data: dict) -> None:
        if kind == "plan":
            plan_ready.set()
            attacks_done.wait(60)

    with dead_port() as dead:
        node_args = {"node-2": ["--advertise", f"127.0.0.1:{dead}"]}
        with local_cluster(cfg, 3, tmp_path, on_event=hold_after_plan, node_args=node_args,
                           state_dir=tmp_path / "run", in_order=True) as cluster:
            assert plan_ready.wait(90)
            try:
                _attack(cluster, tmp_path)
            finally:
                attacks_done.set()
            summary = cluster.wait(120)
            plan = cluster.coordinator.plan
            status = cluster.coordinator.status()
            # node-2's stage cannot be downloaded by dialling: node-2 uploads it when ordered to.
            state = _saved_model(cluster.coordinator, summary.steps, tmp_path)
            checkpoint = cluster.coordinator.recovery.checkpoints.latest()
    assert checkpoint is not None and checkpoint.steps_done == cfg.run.steps  # written from node-2's upload too
    assert summary.steps == cfg.run.steps
    assert [list(s.node_ids) for s in plan.stages] == [["node-1"], ["node-2"], ["node-3"]]
    assert max_diff(state, train_local_state(cfg)) <= 1e-4
    flags = {n: u for s in plan.stages for n, u in zip(s.node_ids, s.unreachable)}
    assert flags == {"node-1": False, "node-2": True, "node-3": False}
    assert {n.node_id: n.reachability for n in status.nodes} == {
        "node-1": "direct", "node-2": "unreachable", "node-3": "direct"
    }
    assert {(link.src, link.dst): link.transport for link in status.links if link.transport} == {
        ("node-1", "node-2"): "reversed", ("node-3", "node-2"): "reversed",
        ("node-2", "node-1"): "direct", ("node-2", "node-3"): "direct",
    }
    joins = {n: (tmp_path / f"{n}.log").read_text() for n in ("node-1", "node-2", "node-3")}
    assert "not reachable from outside: neighbours will use connections this node opens" in joins["node-2"]
    for n in ("node-1", "node-3"):
        assert "reachable at 127.0.0.1:" in joins[n] and "not reachable" not in joins[n]
    # The middle stage received activations and gradients over the streams it opened to both neighbours.
    for n in ("node-1", "node-3"):
        assert f"reverse link from {n} at " in joins["node-2"], joins["node-2"][-3000:]
        assert "reverse link to node-2 open" in joins[n]


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_two_neighbouring_stages_nobody_can_dial_link_through_a_relay(tmp_path):
    # node-1 and node-2 advertise ports that refuse every connection: their link runs through node-3, the one node
    # that can be dialled, and the run must still equal train-local.
    # Links reach the status with heartbeats: frequent ones, so that the last has counted every link of so short a run.
    settings = ["run.steps=3", "train.microbatches=4", "train.inflight=2", "run.eval_every=0",
                "scheduler.placement=uniform", "profile.layer_repeats=1", "scheduler.heartbeat_interval_s=0.2"]
    cfg = load_config(None, settings)
    with dead_port() as dead_1, dead_port() as dead_2:
        node_args = {"node-1": ["--advertise", f"127.0.0.1:{dead_1}"], "node-2": ["--advertise", f"127.0.0.1:{dead_2}"]}
        with local_cluster(cfg, 3, tmp_path, node_args=node_args, in_order=True) as cluster:
            summary = cluster.wait(120)
            plan = cluster.coordinator.plan
            status = cluster.coordinator.status()
            state = _saved_model(cluster.coordinator, summary.steps, tmp_path)
    assert summary.steps == cfg.run.steps
    assert [list(s.node_ids) for s in plan.stages] == [["node-1"], ["node-2"], ["node-3"]]
    assert [(r.a, r.b, r.relay_id) for r in plan.relays] == [("node-1", "node-2", "node-3")]
    assert max_diff(state, train_local_state(cfg)) <= 1e-4
    assert {(link.src, link.dst): link.transport for link in status.links if link.transport} == {
        ("node-1", "node-2"): "relayed via node-3", ("node-2", "node-1"): "relayed via node-3",
        ("node-3", "node-2"): "reversed", ("node-2", "node-3"): "direct",
    }
    relayed = {n.node_id: n.relayed_bytes for n in status.nodes}
    assert relayed["node-3"] > 0 and relayed["node-1"] == relayed["node-2"] == 0
    joins = {n: (tmp_path / f"{n}.log").read_text() for n in ("node-1", "node-2")}
    assert "not reachable from outside: links with node-2 go through relay node-3" in joins["node-1"]
    assert "not reachable from outside: links with node-1 go through relay node-3" in joins["node-2"]


class _Sender:
    """What the Stage service needs of a node for Reverse streams: it sends to `receiver`, whose key is `key`."""

    def __init__(self, receiver: str, key: bytes) -> None:
        self.receiver, self.key = receiver, key

    def reverse_receiver(self, signer: bytes | None) -> str | None:
        return self.receiver if signer == self.key else None


@contextmanager
def reverse_pair(token: str, proven_key: bytes | None = None) -> Iterator[tuple[ReverseSender, list, dict]]:
    """A sender's Stage server on loopback and a receiver following it; the receiver takes the sender's key to be
    proven_key (default: its real one). Yields the sender's ReverseSender, what the receiver took, and how it
    answers: refuse["why"] makes the next delivery fail with INVALID_ARGUMENT."""
    sender_key, receiver_key = NodeKey.generate(), NodeKey.generate()
    reverse = ReverseSender(sender_key, lambda: "sender")
    server, port = make_server(token, "127.0.0.1:0")
    servicer = StageServicer(_Sender("receiver", receiver_key.public), 1 << 20, True, RefusalLog(), reverse)
    add_stage_service(servicer, server)  # as a node serves it
    server.start()
    taken: list = []
    refuse: dict = {}

    def deliver(direction: str, chunks: Iterator[pb.TensorChunk], key: bytes, address: str, check) -> None:
        received = framing.read_one_tensor(chunks)
        if check is not None:
            check(received)
        if "why" in refuse:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, refuse.pop("why"))
        taken.append((direction, received.ref.microbatch, received.payload, key))

    receiver = ReverseReceiver(token, lambda: "receiver", None, receiver_key, deliver, lambda: 0.2)
    receiver.follow({"sender": (f"127.0.0.1:{port}", proven_key or sender_key.public)})
    try:
        yield reverse, taken, refuse
    finally:
        receiver.close()
        server.stop(grace=0.5).wait(2)


def _send(reverse: ReverseSender, microbatch: int, timeout_s: float = 10.0) -> bytes:
    payload = bytes(range(256)) * 8192  # 2 MiB: two chunks
    header = framing.make_header("", torch.float32, (len(payload) // 4,), pb.CODEC_NONE, payload)
    reverse.send("receiver", "backward", pb.MicrobatchRef(microbatch=microbatch), header, payload, timeout_s)
    return payload


@pytest.mark.timeout(60)
def test_a_reverse_link_delivers_as_a_call_would_and_fails_as_one_would():
    token = new_token()
    with reverse_pair(token) as (reverse, taken, refuse):
        payload = _send(reverse, 3)  # waits for the receiver's stream, then for its ack
        assert [(d, mb, p) for d, mb, p, _ in taken] == [("backward", 3, payload)]
        refuse["why"] = "expected shape [2, 3]"
        with pytest.raises(ReverseError) as err:
            _send(reverse, 4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected shape" in err.value.details()
        _send(reverse, 5)  # the link goes on after a refused tensor
        assert [mb for _, mb, _, _ in taken] == [3, 5]
        with pytest.raises(ReverseError) as err:  # a neighbour that opened no stream is unavailable
            reverse.send("stranger", "forward", pb.MicrobatchRef(), pb.TensorHeader(), b"", 0.2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(60)
def test_a_receiver_refuses_a_sender_that_cannot_prove_the_plan_key():
    with reverse_pair(new_token(), proven_key=NodeKey.generate().public) as (reverse, taken, _):
        with pytest.raises(ReverseError) as err:
            _send(reverse, 1, timeout_s=2.0)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert not taken


def test_a_link_between_two_nodes_nobody_can_dial_goes_through_a_node_that_can_be_dialled():
    def member(node_id: str, reachability: str) -> Member:
        return Member(node_id, f"{node_id}:1", "eu", 0.0, 0.0, public_key=node_id.encode(), reachability=reachability)

    a, b, c, d = (member(n, UNREACHABLE) for n in "abcd")
    open_1, open_2 = member("o1", DIRECT), member("o2", DIRECT)
    routes, stranded = relay_routes([[a, open_1], [b, c], [open_2, d]])
    # Every pair of neighbours both behind NAT gets a relay among the layout's nodes that can be dialled, the least
    # loaded first; o1 and o2's own links need none.
    assert [(r.a, r.b, r.relay_id, r.relay_address, r.relay_key) for r in routes] == [
        ("a", "b", "o1", "o1:1", b"o1"), ("a", "c", "o2", "o2:1", b"o2"),
        ("b", "d", "o1", "o1:1", b"o1"), ("c", "d", "o2", "o2:1", b"o2"),
    ]
    assert not stranded
    assert relay_routes([[a], [b]]) == ([], ["a-b"])


class _Relay:
    """What the Stage service needs of a node for relaying: it relays between `ends` (node id -> key)."""

    def __init__(self, ends: dict[str, bytes]) -> None:
        self.ends = ends

    def reverse_receiver(self, signer: bytes | None) -> str | None:
        return next((n for n, k in self.ends.items() if k == signer), None)

    def relay_sender(self, signer: bytes | None, receiver: str) -> str | None:
        sender = self.reverse_receiver(signer)
        return sender if sender is not None and receiver in self.ends and receiver != sender else None


class _FlippingSender(ReverseSender):
    """A relay that alters what it forwards: one payload byte flipped, the crc32 made to match."""

    def send(self, peer, direction, ref, header, payload, timeout_s, origin="", signature=b""):  # noqa: D102
        altered = bytearray(payload)
        altered[0] ^= 1
        forged = pb.TensorHeader()
        forged.CopyFrom(header)
        forged.crc32 = zlib.crc32(altered)
        super().send(peer, direction, ref, forged, altered, timeout_s, origin, signature)


class _RelabellingSender(ReverseSender):
    """A relay that passes a signed tensor off as another step's, as a replay of an old one into a new step would."""

    def send(self, peer, direction, ref, header, payload, timeout_s, origin="", signature=b""):  # noqa: D102
        later = pb.MicrobatchRef()
        later.CopyFrom(ref)
        later.step += 1
        super().send(peer, direction, later, header, payload, timeout_s, origin, signature)


class _Backwards(ReverseSender):
    """A relay that passes activations off as gradients."""

    def send(self, peer, direction, ref, header, payload, timeout_s, origin="", signature=b""):  # noqa: D102
        super().send(peer, "backward", ref, header, payload, timeout_s, origin, signature)


@contextmanager
def relayed_pair(token: str, relay_class: type[ReverseSender] = ReverseSender) -> Iterator[tuple[callable, list]]:
    """A relay's Stage server on loopback, a receiver following it, and a sender calling it (nobody dials either end).
    Yields a function that sends one 2 MiB tensor through the relay as the sender, and what the receiver took."""
    sender_key, receiver_key, relay_key = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    server, port = make_server(token, "127.0.0.1:0")
    ends = {"sender": sender_key.public, "receiver": receiver_key.public}
    servicer = StageServicer(_Relay(ends), 4 << 20, True, RefusalLog(), relay_class(relay_key, lambda: "relay"))
    add_stage_service(servicer, server)  # as a node serves it
    server.start()
    taken: list = []

    def deliver(direction: str, chunks: Iterator[pb.TensorChunk], key: bytes, address: str, check) -> None:
        received = framing.read_one_tensor(chunks)
        check(received)  # every delivery here is relayed: a relay's own would come without a check
        taken.append((direction, received.ref.microbatch, received.payload, key))

    receiver = ReverseReceiver(token, lambda: "receiver", None, receiver_key, deliver, lambda: 0.2)
    receiver.follow({"relay": (f"127.0.0.1:{port}", relay_key.public)}, {"relay": {"sender": sender_key.public}})
    # relay_chunks are serialized already, as the data plane sends them.
    relay = make_channel(f"127.0.0.1:{port}", token, lambda: "sender", key=sender_key).stream_unary(
        "/geotrain.v1.Stage/Relay", request_serializer=None, response_deserializer=pb.Ack.FromString
    )

    def send(microbatch: int, key: NodeKey = sender_key) -> bytes:
        payload = bytes(range(256)) * 8192
        header = framing.make_header("", torch.float32, (len(payload) // 4,), pb.CODEC_NONE, payload)
        ref = pb.MicrobatchRef(microbatch=microbatch, path=["sender"])
        relay(relay_chunks(key, "sender", "receiver", "forward", ref, header, payload), timeout=10)
        return payload

    try:
        yield send, taken
    finally:
        receiver.close()
        server.stop(grace=0.5).wait(2)


@pytest.mark.timeout(60)
def test_a_relay_forwards_a_signed_tensor_as_its_sender_s():
    with relayed_pair(new_token()) as (send, taken):
        payload = send(7)  # waits for the receiver's stream to the relay, then for its ack through the relay
        [(direction, microbatch, got, key)] = taken
        # The receiver takes it as the sender's, whose key its plan checks, not the relay's.
        assert (direction, microbatch, got) == ("forward", 7, payload)
        # The same signed tensor again (a relay replaying it, or the sender retrying after a lost answer) is
        # answered as taken, and not taken twice.
        send(7)
        assert len(taken) == 1
        # A tensor signed by another key than the sender's is refused by the receiver: the relay passes it on.
        expect_status(grpc.StatusCode.PERMISSION_DENIED, "does not carry sender's signature",
                      lambda: send(8, key=NodeKey.generate()))
        assert len(taken) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("relay_class", [_FlippingSender, _RelabellingSender, _Backwards])
def test_a_relay_that_alters_a_tensor_is_refused_by_the_receiver(relay_class):
    with relayed_pair(new_token(), relay_class) as (send, taken):
        expect_status(grpc.StatusCode.PERMISSION_DENIED, "does not carry sender's signature", lambda: send(1))
        assert not taken


def test_a_receiver_remembers_the_relayed_tensors_of_the_steps_its_checks_still_let_in():
    receiver = ReverseReceiver(new_token(), lambda: "receiver", None, NodeKey.generate(), lambda *_: None, lambda: 1.0)

    def take(signature: bytes, epoch: int, step: int) -> None:
        receiver.taken(signature, pb.MicrobatchRef(plan_epoch=epoch, step=step))

    take(b"a", 1, 3)
    take(b"b", 1, 4)  # step 3's validation runs while step 4 trains
    assert receiver.has_taken(b"a") and receiver.has_taken(b"b")
    take(b"c", 1, 5)  # step 3 is behind the step check now
    assert not receiver.has_taken(b"a") and receiver.has_taken(b"b") and receiver.has_taken(b"c")
    take(b"d", 2, 5)  # a new plan epoch: the plan check refuses the old one's
    assert [receiver.has_taken(s) for s in (b"b", b"c", b"d")] == [False, False, True]


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_replica_in_hivemind_client_mode_averages_exactly_without_being_dialled():
    # The replica behind NAT runs its DHT in client mode and reduces no part: it only opens streams to its
    # groupmate, which reduces every part and answers over those streams. Both end with the same exact mean.
    from hivemind import DHT

    from geotrain.node.allreduce import replica_all_reduce
    from geotrain.node.averaging import ReplicaAverager, group_id

    dhts, averagers = [], []
    try:
        dhts.append(DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True))
        initial = [str(a) for a in dhts[0].get_visible_maddrs()]
        dhts.append(DHT(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, client_mode=True))
        averagers = [ReplicaAverager(dht, timeout_s=10.0) for dht in dhts]
        peers = [a.peer_id for a in averagers]
        for a in averagers:
            a.clients = frozenset(peers[1:])
        g = torch.Generator().manual_seed(5)
        tensors = [[torch.randn(3000, generator=g, dtype=torch.float64)] for _ in averagers]
        expected = (tensors[0][0] + 3 * tensors[1][0]) / 4
        errors: list[BaseException] = []

        def average(averager, mine, weight) -> None:
            all_reduce = replica_all_reduce(averager, peers, ["eu", "eu"], weight,
                                            lambda r, part: group_id("client-mode", 0, 0, 1, r, part), False)
            try:
                all_reduce(0, mine)
            except BaseException as e:  # handed to the test below
                errors.append(e)

        threads = [threading.Thread(target=average, args=(a, t, w), daemon=True)
                   for a, t, w in zip(averagers, tensors, (1.0, 3.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert not errors and not any(t.is_alive() for t in threads)
        assert torch.equal(tensors[0][0], tensors[1][0])
        assert torch.allclose(tensors[0][0], expected, rtol=1e-6, atol=1e-6)
        # A group where nobody can be dialled cannot average: refused at once rather than waited out.
        for a in averagers:
            a.clients = frozenset(peers)
        with pytest.raises(Exception, match="none can reduce a part"):
            averagers[1].average(b"all-clients", peers, [torch.zeros(3)], 1.0)
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_replica_nobody_can_dial_averages_and_rejoins_after_sigkill(tmp_path):
    # 2x2, node-4 behind NAT: it averages with its stage's other replica from hivemind's client mode. It is killed
    # after step 2 and started again; it rejoins as a node with an open port would, and the run equals train-local.
    cfg = small_run("run.steps=6", "scheduler.stages=2", "scheduler.step_timeout_s=60", "scheduler.placement=uniform")
    victim = "node-4"
    with dead_port() as dead:
        with local_cluster(cfg, 4, tmp_path, node_args={victim: ["--advertise", f"127.0.0.1:{dead}"]},
                           in_order=True) as cluster:
            coordinator = cluster.coordinator
            wait_until(lambda: coordinator.step >= 2, 120, "step 2 committed", interval=0.02)
            stage = next(s for s in coordinator.plan.stages if victim in s.node_ids)
            assert len(stage.node_ids) == 2 and list(stage.unreachable) == [n == victim for n in stage.node_ids]
            cluster.nodes.kill(victim)
            wait_until(lambda: not coordinator.members[victim].alive, 30, "the victim's death noticed")
            cluster.nodes.start(victim)
            wait_until(lambda: coordinator.members[victim].alive, 60, "the victim registered again")
            summary = cluster.wait(150)
            plan = coordinator.plan
            state = _saved_model(coordinator, summary.steps, tmp_path)
            member = coordinator.members[victim]
    assert summary.steps == cfg.run.steps
    assert member.unreachable and victim in {n for s in plan.stages for n in s.node_ids}
    assert max_diff(state, train_local_state(cfg)) <= 1e-4
    log_text = (tmp_path / f"{victim}.log").read_text()
    assert log_text.count("not reachable from outside: neighbours will use connections this node opens") == 2


def test_dial_backs_run_off_the_blocking_pool_two_at_a_time_per_host():
    from concurrent.futures import ThreadPoolExecutor

    from geotrain.protocol.limits import PeerLimits
    from geotrain.scheduler.coordinator import Coordinator
    from geotrain.scheduler.service import _DIALS_PER_HOST, CoordinatorServicer

    c = Coordinator(load_config(None, []))
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    lock = threading.Lock()
    release = threading.Event()

    def dial(address: str, timeout_s: float) -> bool:  # a tarpit for host "slow", an answer at once elsewhere
        host = address.rpartition(":")[0]
        with lock:
            running[host] = running.get(host, 0) + 1
            most[host] = max(most.get(host, 0), running[host])
        if host == "slow":
            release.wait(10)
        with lock:
            running[host] -= 1
        return True

    blocking, dialling = ThreadPoolExecutor(1), ThreadPoolExecutor(16)
    servicer = CoordinatorServicer(c, blocking, PeerLimits(c.cfg.limits.values()), dial, dialling)

    async def scenario() -> bool:
        slow = [asyncio.create_task(servicer._dial("slow", "slow:1")) for _ in range(6)]
        answered = await asyncio.wait_for(servicer._dial("fast", "fast:1"), 5)  # not behind the slow host's dials
        blocked = await asyncio.get_running_loop().run_in_executor(blocking, lambda: "free")  # the pool is free
        release.set()
        await asyncio.gather(*slow)
        return answered and blocked == "free"

    try:
        assert asyncio.run(scenario())
        assert most == {"slow": _DIALS_PER_HOST, "fast": 1}
    finally:
        release.set()
        blocking.shutdown()
        dialling.shutdown()
        c.store.close()
