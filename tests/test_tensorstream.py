"""Raw tensor streams (protocol/tensorstream.py) in one process: a real Stage server and its stream port on
loopback, a DataPlane or a bare socket sending to them; opened with a ticket, checked as calls are, TLS when the run
has it, and calls when the stream port cannot be reached."""

from __future__ import annotations

import logging
import shutil
import socket
import struct
import sysconfig
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

import grpc
import pytest
import torch

from geotrain.compression import get_codec
from geotrain.node import servicer as servicer_module
from geotrain.node.dataplane import DataPlane
from geotrain.node.reverse import ReverseSender
from geotrain.node.servicer import StageServicer, add_stage_service, all_finite, check_activation_header
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol import tensorstream
from geotrain.protocol.auth import RefusalLog, new_token
from geotrain.protocol.framing import FrameError
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.limits import LimitValues, PeerLimits
from geotrain.protocol.tensorstream import (
    MAX_FRAME_BYTES, NoStream, TensorStreamClient, TensorStreamServer, _Connection, read_message, write_message,
)
from geotrain.protocol.tls import TlsFiles, init_run_tls
from geotrain.protocol.transport import StatusError, make_channel, make_server
from tests.conftest import message_chunks

SHAPE = (2, 8, 16)
REF = pb.MicrobatchRef(plan_epoch=1, step=0, microbatch=3, path=["sender"])


@pytest.fixture(params=["c", "python"])
def socket_io(request) -> Iterator[None]:
    """A stream's plain sockets read and written by _streamio's C ("c") or by python's socket methods ("python", as
    where the extension is not built): each test that takes this runs both ways, and must pass alike."""
    if request.param == "c" and tensorstream._streamio is None:
        pytest.skip("geotrain.protocol._streamio is not built")
    with mock.patch.object(tensorstream, "_streamio", tensorstream._streamio if request.param == "c" else None):
        yield


@pytest.mark.timeout(30)
def test_the_stream_s_c_extension_is_built_where_a_compiler_is() -> None:
    # setup.py builds it optionally: without this, a broken build would silently leave every stream in python.
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) on this machine")
    assert tensorstream._streamio is not None


@dataclass
class _Receiver:
    """A node that takes activations of SHAPE (float32, codec none) from the key `sender`, by calls or streams."""

    sender: bytes
    taken: list = field(default_factory=list)
    ticket_asks: int = 0

    def check_incoming(self, direction, ref, header, signer) -> None:  # noqa: ANN001, D102
        if signer != self.sender:
            raise FrameError(grpc.StatusCode.PERMISSION_DENIED, "not signed by the sender's key")
        check_activation_header(header, list(SHAPE), pb.DTYPE_FLOAT32, {pb.CODEC_NONE}, 1 << 20)

    def accept(self, direction, ref, tensor, wire_bytes) -> None:  # noqa: ANN001, D102
        self.taken.append((direction, ref.microbatch, tensor))

    def may_overflow(self, direction) -> bool:  # noqa: ANN001, D102
        return False

    def check_tensor_stream(self, signer) -> None:  # noqa: ANN001, D102
        self.ticket_asks += 1
        if signer != self.sender:
            raise FrameError(grpc.StatusCode.PERMISSION_DENIED, "tensor streams open only to this node's neighbours")


@dataclass
class _Node:
    token: str
    address: str
    key: NodeKey  # the sender's
    receiver: _Receiver
    streams: TensorStreamServer


@contextmanager
def receiving_node(
    tls: TlsFiles | None = None, streams_per_peer: int = 16, idle_stream_s: float = 30.0
) -> Iterator[_Node]:
    """A receiving node's Stage server and tensor stream port on loopback, always stopped."""
    token, key = new_token(), NodeKey.generate()
    receiver = _Receiver(key.public)
    limits = PeerLimits(LimitValues(streams_per_peer=streams_per_peer, idle_stream_s=idle_stream_s))
    server, port = make_server(token, "127.0.0.1:0", limits, tls=tls)
    streams = TensorStreamServer("127.0.0.1", 0, tls, limits, 1 << 20)
    servicer = StageServicer(receiver, 1 << 20, True, RefusalLog(), ReverseSender(NodeKey.generate(), lambda: "r"),
                             streams)
    add_stage_service(servicer, server)
    server.start()
    streams.start(servicer)
    try:
        yield _Node(token, f"127.0.0.1:{port}", key, receiver, streams)
    finally:
        streams.close()
        server.stop(grace=0.5).wait(2)


@contextmanager
def sending_plane(node: _Node, tls: TlsFiles | None = None) -> Iterator[DataPlane]:
    plane = DataPlane(node.token, lambda: "sender", tls, key=node.key)
    plane.use_tensor_streams(True)
    try:
        yield plane
    finally:
        plane.close()


def _send(plane: DataPlane, node: _Node, tensor: torch.Tensor) -> None:
    encoded = plane.encode("receiver", node.address, "forward", get_codec("none"), tensor)
    plane.send("receiver", node.address, "forward", REF, encoded)


def _ticket(node: _Node, key: NodeKey | None = None) -> pb.TensorStreamTicket:
    channel = make_channel(node.address, node.token, lambda: "sender", key=key or node.key)
    try:
        return rpc.StageStub(channel).OpenTensorStream(pb.TensorStreamRequest(), timeout=10)
    finally:
        channel.close()


@contextmanager
def bare_stream(node: _Node) -> Iterator[socket.socket]:
    """A plaintext socket to the node's stream port, past its hello with a fresh ticket."""
    ticket = _ticket(node)
    with socket.create_connection(("127.0.0.1", ticket.port), timeout=10) as sock:
        write_message(sock, pb.TensorStreamHello(ticket=ticket.ticket))
        assert read_message(sock, pb.TensorStreamReply).code == 0
        yield sock


def _frame(sock: socket.socket, tensor: torch.Tensor, crc: int | None = None) -> bytes:
    """Write a tensor's frame (its header says tensor's shape; crc: a wrong checksum); its payload, not sent."""
    payload = framing.raw_payload(tensor)
    header = framing.make_header("", tensor.dtype, tuple(tensor.shape), pb.CODEC_NONE, payload)
    if crc is not None:
        header.crc32 = crc
    write_message(sock, pb.TensorFrame(direction=pb.DIRECTION_FORWARD, ref=REF, header=header))
    return payload


def _status(sock: socket.socket) -> tuple[grpc.StatusCode, str]:
    reply = read_message(sock, pb.TensorStreamReply)
    return next(c for c in grpc.StatusCode if c.value[0] == reply.code), reply.detail


@pytest.mark.timeout(30)
def test_a_tensor_stream_delivers_as_a_call_would_and_refuses_as_one_would(socket_io):
    with receiving_node() as node, sending_plane(node) as plane:
        tensor = torch.randn(SHAPE)
        _send(plane, node, tensor)
        assert node.streams.open_connections() == 1  # it came over the stream, which stays open
        (direction, microbatch, taken), = node.receiver.taken
        assert (direction, microbatch) == ("forward", 3) and torch.equal(taken, tensor)
        with pytest.raises(StatusError) as err:
            _send(plane, node, torch.randn(2, 8, 17))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected shape" in err.value.details()
        with pytest.raises(StatusError) as err:
            _send(plane, node, torch.full(SHAPE, float("nan")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in err.value.details()
        # Both were refused on the same connection, which goes on: the next tensor decodes into memory of its own.
        _send(plane, node, tensor + 1)
        assert node.streams.open_connections() == 1 and node.receiver.ticket_asks == 1
        assert len(node.receiver.taken) == 2 and torch.equal(taken, tensor)
        assert torch.equal(node.receiver.taken[1][2], tensor + 1)
        # What the heartbeat reports: the two tensors taken went over the stream, every byte of them.
        (counter,) = plane.link_counters()
        assert counter.wire_bytes == counter.stream_bytes == 2 * tensor.numel() * 4


def test_a_call_s_uncompressed_chunks_are_read_into_the_tensor_the_node_takes():
    key = NodeKey.generate()
    receiver = _Receiver(key.public)
    servicer = StageServicer(receiver, 1 << 20, True, RefusalLog(), ReverseSender(NodeKey.generate(), lambda: "r"))
    tensor = torch.randn(SHAPE)
    payload = framing.raw_payload(tensor)
    header = framing.make_header("", tensor.dtype, SHAPE, pb.CODEC_NONE, payload)
    chunks = [framing.parse_chunk(w) for w in framing.wire_chunks(header, payload, REF, chunk_bytes=100)]
    servicer.receive("forward", iter(chunks), key.public, "ipv4:127.0.0.1:1")
    (_, _, taken), = receiver.taken
    assert torch.equal(taken, tensor)
    taken.add_(1)  # memory of its own, writable, not the received messages'
    assert torch.equal(taken, tensor + 1)


@pytest.mark.parametrize("kernel", [True, False], ids=["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_finiteness_check_finds_nan_and_inf_and_passes_finite_values_whose_sum_overflows(dtype, kernel):
    if kernel and servicer_module._finite_kernel is None:
        pytest.skip("the C kernel is not built")
    with mock.patch.object(servicer_module, "_finite_kernel", servicer_module._finite_kernel if kernel else None):
        assert all_finite(torch.randn(10_000).to(dtype))
        assert all_finite(torch.full((1000,), torch.finfo(dtype).max, dtype=dtype))
        assert all_finite(torch.full((3,), torch.finfo(dtype).tiny / 2, dtype=dtype))  # subnormal
        for at in (0, 417, 4095, 4096, 9_999):  # the kernel's blocks are 4096 values
            for bad in (float("nan"), float("inf"), -float("inf")):
                tensor = torch.randn(10_000).to(dtype)
                tensor[at] = bad
                assert not all_finite(tensor)
                assert not all_finite(tensor, memoryview(framing.flat_bytes(tensor).numpy()))
        # A NaN's other bit patterns (payload, sign) are NaN too.
        bits = torch.randn(100).to(dtype)
        raw = bits.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize])
        raw[5] = -1  # every bit set: a negative NaN with a full payload
        assert not all_finite(bits)


@pytest.mark.timeout(30)
def test_a_header_the_plan_does_not_expect_is_refused_before_its_payload_is_sent(socket_io):
    with receiving_node() as node, bare_stream(node) as sock:
        payload = _frame(sock, torch.randn(2, 8, 17))
        code, detail = _status(sock)  # answered while the payload has not left the sender
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "expected shape" in detail
        sock.sendall(payload)  # skipped by the receiver, which then reads the next tensor
        good = torch.randn(SHAPE)
        sock.sendall(_frame(sock, good))
        assert _status(sock)[0] == grpc.StatusCode.OK
        assert [torch.equal(t, good) for _, _, t in node.receiver.taken] == [True]


@pytest.mark.timeout(30)
def test_a_stream_s_header_carries_no_crc32_and_none_is_checked_but_calls_keep_theirs():
    with receiving_node() as node, sending_plane(node) as plane:
        tensor = torch.randn(SHAPE)
        encoded = plane.encode("receiver", node.address, "forward", get_codec("none"), tensor)
        assert encoded.header.crc32 == 0  # nothing computed for a stream: TCP's checksum (or TLS) covers its one hop
        assert encoded.checked_header.crc32 == zlib.crc32(framing.raw_payload(tensor))
        with bare_stream(node) as sock:
            sock.sendall(_frame(sock, tensor, crc=zlib.crc32(b"other")))
            assert _status(sock)[0] == grpc.StatusCode.OK
        # A call's chunks still carry the crc32, and a payload that does not match it is refused.
        channel = make_channel(node.address, node.token, lambda: "sender", key=node.key)
        try:
            call = rpc.StageStub(channel).Forward
            call(iter(message_chunks(encoded.checked_header, encoded.payload, REF)), timeout=10)
            flipped = bytearray(framing.raw_payload(tensor))
            flipped[7] ^= 1
            with pytest.raises(grpc.RpcError) as err:
                call(iter(message_chunks(encoded.checked_header, bytes(flipped), REF)), timeout=10)
        finally:
            channel.close()
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in err.value.details()
        assert len(node.receiver.taken) == 2


@pytest.mark.timeout(30)
def test_a_tensor_stream_cut_mid_tensor_is_data_loss_and_takes_nothing(socket_io):
    with receiving_node() as node, bare_stream(node) as sock:
        payload = _frame(sock, torch.randn(SHAPE))
        sock.sendall(payload[: len(payload) // 2])
        sock.shutdown(socket.SHUT_WR)
        code, detail = _status(sock)
        assert code == grpc.StatusCode.DATA_LOSS and "truncated" in detail
        assert sock.recv(1) == b""  # and the receiver closed the connection
        assert not node.receiver.taken


_F32, _NONE, _INVALID = pb.DTYPE_FLOAT32, pb.CODEC_NONE, grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "header, code",
    [
        (pb.TensorHeader(dtype=99, shape=list(SHAPE), codec=_NONE, payload_bytes=1024), _INVALID),
        (pb.TensorHeader(dtype=_F32, shape=[1] * 9, codec=_NONE, payload_bytes=4), _INVALID),
        (pb.TensorHeader(dtype=_F32, shape=list(SHAPE), codec=_NONE, payload_bytes=(1 << 20) + 1),
         grpc.StatusCode.RESOURCE_EXHAUSTED),
        (pb.TensorHeader(dtype=_F32, shape=list(SHAPE), payload_bytes=1024), _INVALID),
    ],
    ids=["unknown-dtype", "rank-9", "over-the-limit", "no-codec"],
)
def test_a_malformed_header_ends_the_stream_with_its_payload_unread(socket_io, header, code):
    with receiving_node() as node, bare_stream(node) as sock:
        write_message(sock, pb.TensorFrame(direction=pb.DIRECTION_FORWARD, ref=REF, header=header))
        assert _status(sock)[0] == code
        assert sock.recv(1) == b""  # closed: what followed the header is never read
        assert not node.receiver.taken


@pytest.mark.timeout(30)
def test_a_frame_that_is_not_a_frame_or_too_long_to_be_one_ends_the_stream(socket_io):
    with receiving_node() as node:
        with bare_stream(node) as sock:
            sock.sendall(struct.pack("<I", 5) + b"\xff\xff\xff\xff\xff")  # no protobuf message
            assert sock.recv(1) == b""
        with bare_stream(node) as sock:
            # A length over the limit: closed with nothing more read, though the bytes it announced never come.
            sock.sendall(struct.pack("<I", MAX_FRAME_BYTES + 1))
            assert sock.recv(1) == b""
        with bare_stream(node) as sock:  # the length's own 4 bytes cut short
            sock.sendall(b"\x01\x00")
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(1) == b""
        assert not node.receiver.taken
        # A sender reading the same from a receiver: FrameError and Closed, alike both ways.
        left, right = socket.socketpair()
        with left, right:
            right.sendall(struct.pack("<I", MAX_FRAME_BYTES + 1))
            with pytest.raises(FrameError, match=f"a message of {MAX_FRAME_BYTES + 1} bytes"):
                read_message(left, pb.TensorStreamReply)
            right.sendall(struct.pack("<I", 10) + b"abc")
            right.shutdown(socket.SHUT_WR)
            with pytest.raises(tensorstream.Closed, match="the stream ended 7 bytes short"):
                read_message(left, pb.TensorStreamReply)


@pytest.mark.timeout(30)
def test_a_tensor_stream_silent_mid_tensor_is_ended_after_idle_stream_s_but_may_idle_between_tensors(socket_io):
    with receiving_node(idle_stream_s=0.3) as node, bare_stream(node) as sock:
        time.sleep(0.6)  # between tensors a kept connection waits as long as it likes
        sock.sendall(_frame(sock, torch.ones(SHAPE)))
        assert _status(sock)[0] == grpc.StatusCode.OK
        payload = _frame(sock, torch.randn(SHAPE))
        sock.sendall(payload[: len(payload) // 2])
        began = time.monotonic()
        assert sock.recv(1) == b""  # the receiver's kernel timeout ran out mid-payload: it closed the connection
        assert 0.2 < time.monotonic() - began < 5
        assert len(node.receiver.taken) == 1


@pytest.mark.timeout(30)
def test_a_sender_gives_up_at_its_deadline_on_a_receiver_that_neither_reads_nor_answers(socket_io):
    frame = pb.TensorFrame(direction=pb.DIRECTION_FORWARD, ref=REF).SerializeToString()
    for payload, what in ((bytes(64 << 20), "a payload it never reads"), (b"x", "a reply it never sends")):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            sender = socket.create_connection(listener.getsockname())
            receiver, _ = listener.accept()
            with sender, receiver:
                began = time.monotonic()
                with pytest.raises(socket.timeout):
                    _Connection(sender).send(frame, payload, began + 0.3)
                assert 0.25 < time.monotonic() - began < 3, what


@pytest.mark.timeout(30)
def test_a_sender_writes_the_frame_then_the_payload_whatever_part_the_socket_takes_at_once(socket_io):
    frame = pb.TensorFrame(direction=pb.DIRECTION_FORWARD, ref=REF).SerializeToString()
    payload = memoryview(torch.arange(1 << 20, dtype=torch.float32).numpy())  # 4 MiB, as the none codec gives it
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # one sendmsg cannot take it all
        receiver, _ = listener.accept()
        got = bytearray()

        def read_then_answer() -> None:
            while len(got) < 4 + len(frame) + payload.nbytes:
                got.extend(receiver.recv(1 << 16))
            write_message(receiver, pb.TensorStreamReply(code=0))

        reader = threading.Thread(target=read_then_answer)
        reader.start()
        with sender, receiver:
            assert _Connection(sender).send(frame, payload, time.monotonic() + 20).code == 0
            reader.join()
    assert bytes(got) == struct.pack("<I", len(frame)) + frame + payload.cast("B").tobytes()


@pytest.mark.timeout(30)
def test_a_tensor_stream_opens_only_with_a_fresh_ticket_given_to_a_neighbour_s_key():
    with receiving_node(streams_per_peer=2) as node:
        ticket = _ticket(node)

        def hello(ticket_bytes: bytes) -> tuple[grpc.StatusCode, str]:
            with socket.create_connection(("127.0.0.1", ticket.port), timeout=10) as sock:
                write_message(sock, pb.TensorStreamHello(ticket=ticket_bytes))
                return _status(sock)

        assert hello(bytes(32))[0] == grpc.StatusCode.UNAUTHENTICATED
        with socket.create_connection(("127.0.0.1", ticket.port), timeout=10) as used:
            write_message(used, pb.TensorStreamHello(ticket=ticket.ticket))
            assert _status(used)[0] == grpc.StatusCode.OK
            assert hello(ticket.ticket) == (grpc.StatusCode.UNAUTHENTICATED, "an unknown, used or expired ticket")
            # One connection open and one ticket out hold the key's two streams.
            _ticket(node)
            with pytest.raises(grpc.RpcError) as err:
                _ticket(node)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:
            _ticket(node, NodeKey.generate())  # a key the plan does not give a neighbour
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "neighbours" in err.value.details()


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> tuple[TlsFiles, TlsFiles]:
    """Two runs' TLS files."""
    files = []
    for name in ("a", "b"):
        directory = tmp_path_factory.mktemp(f"tls-{name}")
        init_run_tls(directory)
        files.append(TlsFiles.load(directory))
    return files[0], files[1]


@pytest.mark.timeout(30)
def test_a_tls_run_s_tensor_streams_are_tls_with_its_files(run_files):
    run_a, run_b = run_files
    with receiving_node(tls=run_a) as node:
        with sending_plane(node, tls=run_a) as plane:
            tensor = torch.randn(SHAPE)
            _send(plane, node, tensor)
            assert node.streams.open_connections() == 1 and torch.equal(node.receiver.taken[0][2], tensor)
        # A plaintext hello never gets an answer; another run's files fail the handshake.
        port = node.streams.port
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            write_message(sock, pb.TensorStreamHello(ticket=node.streams.ticket(node.key.public)))
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass  # closed with the hello unread
        ticket = pb.TensorStreamTicket(port=port, ticket=node.streams.ticket(node.key.public))
        with pytest.raises(NoStream) as err:
            TensorStreamClient(run_b).send(node.address, lambda: ticket, pb.DIRECTION_FORWARD, REF,
                                           pb.TensorHeader(), b"", 10)
        assert err.value.lasting and "cannot be reached" in str(err.value)


@pytest.mark.timeout(30)
def test_tensors_go_by_calls_when_the_stream_port_is_closed_and_the_log_says_so_once(caplog):
    with receiving_node() as node, sending_plane(node) as plane:
        node.streams.close()  # the port refuses connections, the Stage server still answers calls
        caplog.set_level(logging.INFO, logger="geotrain.node.dataplane")
        for i in range(3):
            _send(plane, node, torch.full(SHAPE, float(i)))
        assert [t[0, 0, 0].item() for _, _, t in node.receiver.taken] == [0.0, 1.0, 2.0]
        assert node.receiver.ticket_asks == 1  # the first tensor found the port closed; the others did not try
        (counter,) = plane.link_counters()
        assert counter.wire_bytes == 3 * SHAPE[0] * SHAPE[1] * SHAPE[2] * 4 and counter.stream_bytes == 0
        said = [r.getMessage() for r in caplog.records if "go by gRPC calls" in r.getMessage()]
        assert len(said) == 1 and "cannot be reached" in said[0], said


@pytest.mark.timeout(30)
def test_a_connection_that_never_says_its_hello_is_closed_by_the_hello_deadline():
    with receiving_node() as node:
        with socket.create_connection(("127.0.0.1", node.streams.port), timeout=10) as silent:
            assert silent.recv(1) == b"", "closed by the node (a timeout here: held past its 10 s)"


@pytest.mark.timeout(30)
def test_strangers_holding_the_port_without_a_hello_cannot_keep_a_neighbour_out():
    with receiving_node() as node, sending_plane(node) as plane:
        port = node.streams.port
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(60)]
        try:
            tensor = torch.randn(SHAPE)
            _send(plane, node, tensor)  # the neighbour's connection makes room: the oldest silent ones are closed
            assert node.streams.open_connections() == 1 and torch.equal(node.receiver.taken[0][2], tensor)
            assert node.receiver.ticket_asks == 1, "it went over the stream, not by a call"
            assert all(s.recv(1) == b"" for s in held[:-8])
            # Reopening what was closed: past the host's burst, connections are closed as they are accepted.
            flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(100)]
            held += flood
            assert sum(s.recv(1) == b"" for s in flood) >= 90
        finally:
            for s in held:
                s.close()
