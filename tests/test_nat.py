"""Nodes nobody can dial (behind NAT): the coordinator's dial-back at registration, and links that run over streams the
unreachable node opens (node/reverse.py), equal to train-local."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch

from geotrain.config import load_config
from geotrain.node.reverse import ReverseError, ReverseReceiver, ReverseSender
from geotrain.node.servicer import StageServicer
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import RefusalLog, new_token
from geotrain.protocol.framing import FrameError
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import make_channel, make_server
from geotrain.scheduler.membership import Member
from geotrain.scheduler.placement import state_sources
from geotrain.scheduler.reachability import DIRECT, UNREACHABLE, candidates
from tests.conftest import expect_status, local_cluster, max_diff, train_local_state


@contextmanager
def dead_port() -> Iterator[int]:
    """A loopback port that refuses connections while the block runs: bound, never listening, so no one takes it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_dial_back_tries_the_advertised_address_then_where_the_call_came_from():
    assert candidates("192.168.1.5:7100", "ipv4:203.0.113.9:51234") == ["192.168.1.5:7100", "203.0.113.9:7100"]
    assert candidates("203.0.113.9:7100", "ipv4:203.0.113.9:51234") == ["203.0.113.9:7100"]
    assert candidates("[fd00::5]:7100", "ipv6:[2001:db8::9]:4000") == ["[fd00::5]:7100", "[2001:db8::9]:7100"]
    assert candidates("10.0.0.5:7100", "unix:/tmp/socket") == ["10.0.0.5:7100"]
    # Through a proxy on the coordinator's host: loopback there is not the node.
    assert candidates("10.0.0.5:7100", "ipv4:127.0.0.1:4000") == ["10.0.0.5:7100"]


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
    settings = ["run.steps=4", "train.microbatches=4", "train.inflight=2", "run.eval_every=2",
                "run.eval_microbatches=2", "scheduler.placement=uniform"]
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
            state = cluster.coordinator.model_state(summary.steps)
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
    rpc.add_StageServicer_to_server(servicer, server)
    server.start()
    taken: list = []
    refuse: dict = {}

    def deliver(direction: str, chunks: Iterator[pb.TensorChunk], key: bytes, address: str) -> None:
        received = framing.read_one_tensor(chunks)
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
