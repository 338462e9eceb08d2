"""Tensor framing: a tensor's encoded bytes travel as a stream of TensorChunk messages.

The first chunk of a tensor carries its header (dtype, shape, codec, payload size, crc32); every chunk carries up
to CHUNK_BYTES of payload, so no gRPC message-size limit matters however large the tensor. The reader checks the
header against what the receiver expects before it reads (or allocates) the payload, and checks the size and the
checksum at the end. Nothing from the wire is unpickled.

Activations and gradients (the Forward and Backward calls) skip protobuf's copies of a chunk's data: `wire_chunks`
serializes a chunk with one copy of the data, from the encoded tensor into the message, and `parse_chunk` leaves the
data a view of the received message, its other fields parsed by protobuf. Protobuf would copy the data into its
message and out again on each side, and the tensor path's CPU was mostly such copies (bench/tensor_path.py).
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError

from geotrain.protocol import geotrain_pb2 as pb

Buffer = bytes | bytearray | memoryview

CHUNK_BYTES = 1 << 20
# Default cap on one tensor's encoded size; servers may lower it.
MAX_TENSOR_BYTES = 1 << 30
MAX_RANK = 8

TORCH_TO_WIRE = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.int64: pb.DTYPE_INT64,
    torch.int32: pb.DTYPE_INT32,
    torch.uint8: pb.DTYPE_UINT8,
    torch.int8: pb.DTYPE_INT8,
}
WIRE_TO_TORCH = {v: k for k, v in TORCH_TO_WIRE.items()}
# The call a tensor stands for, as the node names it ("forward", "backward"), and back from the wire.
DIRECTIONS = {"forward": pb.DIRECTION_FORWARD, "backward": pb.DIRECTION_BACKWARD}
DIRECTION_NAMES = {wire: name for name, wire in DIRECTIONS.items()}


class FrameError(Exception):
    """A tensor stream is malformed; `code` is the gRPC status the server answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def make_header(name: str, tensor_dtype: torch.dtype, shape: tuple[int, ...], codec: int, payload: Buffer) -> pb.TensorHeader:
    """The header describing one encoded tensor."""
    return pb.TensorHeader(
        name=name,
        dtype=TORCH_TO_WIRE[tensor_dtype],
        shape=list(shape),
        codec=codec,
        payload_bytes=memoryview(payload).nbytes,
        crc32=zlib.crc32(payload),
    )


def _split(
    header: pb.TensorHeader, payload: Buffer, ref: pb.MicrobatchRef | None, chunk_bytes: int
) -> Iterator[tuple[pb.TensorChunk, memoryview]]:
    """One encoded tensor's chunks without their data (the first carries ref and header), each with its data's view."""
    view = memoryview(payload).cast("B")
    first = pb.TensorChunk(header=header)
    if ref is not None:
        first.ref.CopyFrom(ref)
    yield first, view[:chunk_bytes]
    for offset in range(chunk_bytes, len(view), chunk_bytes):
        yield pb.TensorChunk(), view[offset : offset + chunk_bytes]


def chunk_tensor(
    header: pb.TensorHeader, payload: Buffer, ref: pb.MicrobatchRef | None = None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.TensorChunk]:
    """Split one encoded tensor into chunks; the first carries ref and header."""
    for chunk, data in _split(header, payload, ref, chunk_bytes):
        chunk.data = bytes(data)
        yield chunk


_DATA_TAG = (3 << 3) | 2  # TensorChunk.data: field 3, length-delimited
_LENGTH_DELIMITED = 2


def _varint(value: int) -> bytes:
    """`value` as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; ValueError if it is cut off or longer than 64 bits."""
    value = 0
    for shift in range(0, 64, 7):
        if pos >= len(view):
            raise ValueError("truncated varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise ValueError("varint longer than 64 bits")


def wire_chunks(
    header: pb.TensorHeader, payload: Buffer, ref: pb.MicrobatchRef | None = None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """chunk_tensor's chunks as the serialized TensorChunk messages, each data copied once (a request_serializer of
    None sends them as they are)."""
    for chunk, data in _split(header, payload, ref, chunk_bytes):
        yield b"".join((chunk.SerializeToString(), bytes([_DATA_TAG]), _varint(len(data)), data))


@dataclass(frozen=True)
class WireChunk:
    """A TensorChunk from the wire whose data is a view of the received message (its other fields parsed)."""

    fields: pb.TensorChunk
    data: memoryview

    @property
    def ref(self) -> pb.MicrobatchRef:  # noqa: D102
        return self.fields.ref

    @property
    def header(self) -> pb.TensorHeader:  # noqa: D102
        return self.fields.header

    def HasField(self, name: str) -> bool:  # noqa: N802 - a TensorChunk's name, which read_tensors calls
        """Whether the chunk carries field `name`, as TensorChunk.HasField."""
        return self.fields.HasField(name)


def parse_chunk(message: bytes) -> WireChunk:
    """A serialized TensorChunk read with its data left in place (a request_deserializer); ValueError when it is
    malformed. Fields are length-delimited (ref, header, data): any other wire type, or data twice, is refused."""
    view = memoryview(message)
    others: list[memoryview] = []
    data = None
    pos = 0
    while pos < len(view):
        start = pos
        tag, pos = _read_varint(view, pos)
        if tag & 7 != _LENGTH_DELIMITED:
            raise ValueError(f"TensorChunk field {tag >> 3} of wire type {tag & 7}")
        length, pos = _read_varint(view, pos)
        if length > len(view) - pos:
            raise ValueError("TensorChunk field longer than its message")
        if tag == _DATA_TAG:
            if data is not None:
                raise ValueError("TensorChunk carries data twice")
            data = view[pos : pos + length]
        else:
            others.append(view[start : pos + length])
        pos += length
    try:
        fields = pb.TensorChunk.FromString(b"".join(others))  # ref and header: small
    except DecodeError as e:
        raise ValueError(f"malformed TensorChunk: {e}") from None
    return WireChunk(fields, data if data is not None else view[:0])


def check_header(header: pb.TensorHeader, max_bytes: int) -> None:
    """Reject a header that is self-inconsistent or too large, before any payload is read."""
    if header.dtype not in WIRE_TO_TORCH:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported tensor dtype {header.dtype}")
    if header.codec == pb.CODEC_UNSPECIFIED or header.codec not in pb.Codec.values():
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown tensor codec {header.codec}")
    if len(header.shape) > MAX_RANK or any(d < 0 for d in header.shape):
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"bad tensor shape {list(header.shape)}")
    if header.payload_bytes > max_bytes:
        raise FrameError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"tensor payload of {header.payload_bytes} bytes exceeds the limit of {max_bytes} bytes",
        )
    raw_bytes = math.prod(header.shape) * WIRE_TO_TORCH[header.dtype].itemsize
    if raw_bytes > max_bytes * 16:
        raise FrameError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tensor of shape {list(header.shape)} is too large")


def check_checksum(header: pb.TensorHeader, payload: Buffer) -> None:
    """Reject a payload whose crc32 is not the one its header declares."""
    if zlib.crc32(payload) != header.crc32:
        raise FrameError(grpc.StatusCode.DATA_LOSS, "tensor payload checksum mismatch")


@dataclass
class ReceivedTensor:
    """One tensor read off a chunk stream, payload still encoded."""

    ref: pb.MicrobatchRef
    header: pb.TensorHeader
    payload: Buffer


def read_tensors(
    chunks: Iterable[pb.TensorChunk | WireChunk],
    max_bytes: int = MAX_TENSOR_BYTES,
    on_header: Callable[[pb.MicrobatchRef, pb.TensorHeader], None] | None = None,
) -> Iterator[ReceivedTensor]:
    """Reassemble tensors from a chunk stream, validating each header (and on_header) before its payload."""
    it = iter(chunks)
    chunk = next(it, None)
    if chunk is None:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "empty tensor stream")
    while chunk is not None:
        if not chunk.HasField("header"):
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "tensor stream does not start with a header chunk")
        header, ref = chunk.header, chunk.ref
        check_header(header, max_bytes)
        if on_header is not None:
            on_header(ref, header)
        # A tensor of one chunk (most activations) is decoded from that chunk's data as received.
        parts, filled = [], 0
        while True:
            filled += len(chunk.data)
            if filled > header.payload_bytes:
                raise FrameError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor stream carries more than the {header.payload_bytes} bytes its header declares",
                )
            parts.append(chunk.data)
            chunk = next(it, None)
            if chunk is None or chunk.HasField("header"):
                break
        if filled != header.payload_bytes:
            raise FrameError(
                grpc.StatusCode.DATA_LOSS,
                f"truncated tensor stream: got {filled} of {header.payload_bytes} payload bytes",
            )
        payload = parts[0] if len(parts) == 1 else b"".join(parts)
        check_checksum(header, payload)
        yield ReceivedTensor(ref=ref, header=header, payload=payload)


def read_one_tensor(
    chunks: Iterable[pb.TensorChunk | WireChunk],
    max_bytes: int = MAX_TENSOR_BYTES,
    on_header: Callable[[pb.MicrobatchRef, pb.TensorHeader], None] | None = None,
) -> ReceivedTensor:
    """Read a stream that must carry exactly one tensor."""
    tensors = read_tensors(chunks, max_bytes, on_header)
    first = next(tensors)
    if next(tensors, None) is not None:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "expected one tensor, the stream carries more")
    return first


def raw_payload(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, uncompressed (CODEC_NONE), little-endian as the machine stores them."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def raw_tensor(header: pb.TensorHeader, payload: Buffer) -> torch.Tensor:
    """Decode an uncompressed (CODEC_NONE) payload; raises FrameError if its size does not match the header."""
    dtype = WIRE_TO_TORCH.get(header.dtype)
    if dtype is None or header.codec != pb.CODEC_NONE:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "expected an uncompressed tensor of a known dtype")
    shape = tuple(header.shape)
    if len(payload) != math.prod(shape) * dtype.itemsize:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"{len(payload)} bytes do not fill shape {list(shape)}")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


def state_chunks(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[pb.TensorChunk]:
    """Named tensors, uncompressed, one after another: the stream of a state transfer."""
    for name, tensor in items:
        payload = raw_payload(tensor)
        header = make_header(name, tensor.dtype, tuple(tensor.shape), pb.CODEC_NONE, payload)
        yield from chunk_tensor(header, payload)


def read_state(chunks: Iterable[pb.TensorChunk], max_bytes: int = MAX_TENSOR_BYTES) -> dict[str, torch.Tensor]:
    """The named tensors of a state-transfer stream."""
    return {r.header.name: raw_tensor(r.header, r.payload) for r in read_tensors(chunks, max_bytes)}


def parameters_checksum(params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over named parameters in name order, each name then its raw bytes. A stage's replicas that applied the
    same steps agree on it bit for bit, and the coordinator computes it from a checkpoint for any layer range: the
    order in which a node, a transfer or a checkpoint file holds the tensors does not change it."""
    digest = hashlib.sha256()
    for name, tensor in sorted(params, key=lambda item: item[0]):
        digest.update(name.encode())
        # Hashed where the bytes lie (a host tensor's own memory, not a copy of it); hashlib lets go of the GIL.
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
