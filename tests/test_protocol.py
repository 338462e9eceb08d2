"""Tensor framing and run-token auth, as units."""

from __future__ import annotations

import time
import zlib

import grpc
import pytest
import torch

from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import ServerAuth, auth_metadata
from geotrain.protocol.framing import FrameError
from tests.conftest import message_chunks


def _frames(tensor: torch.Tensor, chunk_bytes: int = 1000) -> list[pb.TensorChunk]:
    payload = framing.raw_payload(tensor)
    header = framing.make_header("w", tensor.dtype, tuple(tensor.shape), pb.CODEC_NONE, payload)
    return message_chunks(header, payload, pb.MicrobatchRef(step=3, microbatch=1), chunk_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_round_trip_over_many_chunks(dtype):
    tensor = (torch.randn(7, 33, 5) * 100).to(dtype)
    chunks = _frames(tensor)
    assert len(chunks) > 1 and not chunks[1].HasField("header")
    (received,) = list(framing.read_tensors(chunks))
    assert received.ref.step == 3 and received.header.name == "w"
    assert torch.equal(framing.raw_tensor(received.header, received.payload), tensor)


def _tensor_w() -> tuple[torch.Tensor, bytes, pb.TensorHeader, pb.MicrobatchRef]:
    """A tensor "w" of several 1000-byte chunks: itself, its payload, header and ref."""
    tensor = torch.randn(7, 33, 5)
    payload = framing.raw_payload(tensor)
    header = framing.make_header("w", tensor.dtype, tuple(tensor.shape), pb.CODEC_NONE, payload)
    return tensor, payload, header, pb.MicrobatchRef(step=3, microbatch=1, path=["node-1"])


def test_wire_chunks_are_the_protobuf_chunks_and_parse_back_with_their_data_in_place():
    tensor, payload, header, ref = _tensor_w()
    wire = list(framing.wire_chunks(header, payload, ref, 1000))
    assert [pb.TensorChunk.FromString(w) for w in wire] == message_chunks(header, payload, ref, 1000)
    parsed = [framing.parse_chunk(w) for w in wire]
    assert isinstance(parsed[0].data, memoryview) and parsed[0].data.obj is wire[0]  # a view, not a copy
    assert parsed[0].HasField("header") and not parsed[1].HasField("header") and parsed[0].ref == ref
    (received,) = list(framing.read_tensors(parsed))
    assert torch.equal(framing.raw_tensor(received.header, received.payload), tensor)


def test_a_chunk_nested_by_its_parts_is_the_message_that_carries_it():
    _, payload, header, ref = _tensor_w()
    chunks = message_chunks(header, payload, ref, 1000)
    for (head, data), chunk in zip(framing.wire_chunk_parts(header, payload, ref, 1000), chunks, strict=True):
        fields = pb.ReverseDown(seq=9, direction=pb.DIRECTION_BACKWARD, last=True, origin="node-2", signature=b"s")
        nested = framing.nested_chunk(fields.SerializeToString(), 4, head, data)
        expected = pb.ReverseDown()
        expected.CopyFrom(fields)
        expected.chunk.CopyFrom(chunk)
        assert pb.ReverseDown.FromString(nested) == expected
        # Read back with the chunk's data left in place: the message's fields as protobuf reads them.
        carried = framing.carrier_parser(pb.ReverseDown)(nested)
        fields_read = (carried.seq, carried.direction, carried.last, carried.origin, carried.signature)
        assert fields_read == (9, pb.DIRECTION_BACKWARD, True, "node-2", b"s")
        assert carried.chunk.data.obj is nested and bytes(carried.chunk.data) == chunk.data  # a view, not a copy
        expected.chunk.ClearField("data")
        assert carried.chunk.fields == expected.chunk


@pytest.mark.parametrize(
    "message",
    [
        b"\x22\x05abc",  # the chunk longer than the message
        b"\x22\x00\x22\x00",  # the chunk twice
        b"\x22\x02\x08\x01",  # a malformed chunk (a varint field)
        b"\x10",  # seq cut off
        b"\x13",  # a group (wire type 3): protobuf writes none
        b"\x0a\x02\xff",  # proof longer than the message
        b"\x32\x01\xff",  # an origin that is not UTF-8: protobuf refuses it
        b"\x29\x00\x00\x00",  # a 64-bit field cut off
    ],
)
def test_malformed_carriers_of_a_chunk_are_refused(message):
    with pytest.raises(ValueError):
        framing.carrier_parser(pb.ReverseDown)(message)


@pytest.mark.parametrize(
    "message",
    [
        b"\x1a\x05abc",  # data longer than the message
        b"\x1a\x01a\x1a\x01b",  # data twice
        b"\x08\x01",  # a varint field: no TensorChunk field is one
        b"\x1a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a length of more than 64 bits
        b"\x12\x03\xff\xff\xff",  # a header that protobuf cannot parse
    ],
)
def test_malformed_wire_chunks_are_refused(message):
    with pytest.raises(ValueError):
        framing.parse_chunk(message)


def test_several_tensors_in_one_stream():
    a, b = torch.randn(100), torch.arange(10)
    received = list(framing.read_tensors(_frames(a, 64) + _frames(b, 64)))
    assert [r.header.shape for r in received] == [[100], [10]]


def test_truncated_stream_is_data_loss():
    chunks = _frames(torch.randn(1000))[:-1]
    with pytest.raises(FrameError) as err:
        list(framing.read_tensors(chunks))
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "truncated" in str(err.value)


def test_extra_bytes_and_bad_checksum_are_rejected():
    chunks = _frames(torch.randn(1000))
    chunks.append(pb.TensorChunk(data=b"x"))
    with pytest.raises(FrameError, match="more than"):
        list(framing.read_tensors(chunks))
    chunks = _frames(torch.randn(1000))
    chunks[0].header.crc32 = zlib.crc32(b"other")
    with pytest.raises(FrameError, match="checksum"):
        list(framing.read_tensors(chunks))


def test_the_checksum_is_zlib_s_crc32():
    # The check value of CRC-32 (ISO-HDLC): the wire's crc32 is zlib's, however it is computed.
    assert framing.crc32(b"123456789") == 0xCBF43926
    data = torch.randn(1000).numpy()
    assert framing.crc32(data) == zlib.crc32(data)
    assert framing.crc32(memoryview(data).cast("B")[100:], framing.crc32(memoryview(data).cast("B")[:100])) == (
        zlib.crc32(data)
    )


def _into(tensors: list[torch.Tensor]):  # noqa: ANN202
    """A destination that gives a new tensor of the header's shape and dtype, kept in `tensors`."""

    def into(header: pb.TensorHeader) -> torch.Tensor:
        tensors.append(torch.empty(tuple(header.shape), dtype=framing.WIRE_TO_TORCH[header.dtype]))
        return tensors[-1]

    return into


def test_a_destination_receives_the_chunks_in_place_and_is_the_received_tensor():
    tensor = torch.randn(7, 33, 5)
    given: list[torch.Tensor] = []
    (received,) = list(framing.read_tensors(_frames(tensor), into=_into(given)))
    assert received.tensor is given[0] and torch.equal(received.tensor, tensor)
    assert bytes(received.payload) == framing.raw_payload(tensor)


def test_a_destination_s_chunks_are_still_checked():
    given: list[torch.Tensor] = []
    chunks = _frames(torch.randn(1000))
    chunks[2] = pb.TensorChunk(data=bytes(len(chunks[2].data)))  # a corrupted chunk of the right size
    with pytest.raises(FrameError) as err:
        list(framing.read_tensors(chunks, into=_into(given)))
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in str(err.value)
    chunks = _frames(torch.randn(1000))
    chunks.append(pb.TensorChunk(data=b"x"))
    with pytest.raises(FrameError, match="more than"):
        list(framing.read_tensors(chunks, into=_into(given)))
    with pytest.raises(FrameError, match="truncated"):
        list(framing.read_tensors(_frames(torch.randn(1000))[:-1], into=_into(given)))


def test_oversized_header_is_rejected_before_reading():
    header = pb.TensorHeader(dtype=pb.DTYPE_FLOAT32, shape=[1 << 29], codec=pb.CODEC_NONE, payload_bytes=1 << 31)
    with pytest.raises(FrameError) as err:
        framing.check_header(header, max_bytes=1 << 20)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "header",
    [
        pb.TensorHeader(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], codec=pb.CODEC_NONE),
        pb.TensorHeader(dtype=pb.DTYPE_FLOAT32, shape=[1], codec=pb.CODEC_UNSPECIFIED),
        pb.TensorHeader(dtype=pb.DTYPE_FLOAT32, shape=[-1], codec=pb.CODEC_NONE),
        pb.TensorHeader(dtype=pb.DTYPE_FLOAT32, shape=[1] * 9, codec=pb.CODEC_NONE),
    ],
)
def test_inconsistent_headers(header):
    with pytest.raises(FrameError):
        framing.check_header(header, max_bytes=1 << 20)


def test_stream_must_start_with_header():
    with pytest.raises(FrameError, match="header"):
        list(framing.read_tensors([pb.TensorChunk(data=b"abc")]))
    with pytest.raises(FrameError, match="empty"):
        list(framing.read_tensors([]))


def test_raw_tensor_size_must_match():
    header = pb.TensorHeader(dtype=pb.DTYPE_FLOAT32, shape=[4], codec=pb.CODEC_NONE)
    with pytest.raises(FrameError, match="do not fill"):
        framing.raw_tensor(header, b"\0" * 12)


def _metadata(token: str, method: str = "/geotrain.v1.Stage/Forward") -> dict[str, str]:
    return dict(auth_metadata(token, method, "node-1"))


def test_auth_accepts_good_and_rejects_wrong_token_replay_and_stale():
    guard = ServerAuth("secret")
    md = _metadata("secret")
    assert guard.check("/geotrain.v1.Stage/Forward", md) is None
    assert "replayed" in guard.check("/geotrain.v1.Stage/Forward", md)
    assert "wrong token" in guard.check("/geotrain.v1.Stage/Forward", _metadata("guess"))
    # The MAC covers the method: a proof for one RPC does not open another.
    assert "wrong token" in guard.check("/geotrain.v1.Stage/Backward", _metadata("secret"))
    assert "stale" in guard.check("/geotrain.v1.Stage/Forward", _metadata("secret"), now=time.time() + 3600)
    assert "missing" in guard.check("/geotrain.v1.Stage/Forward", {})
