"""Tensor framing: a tensor's encoded bytes travel as a stream of TensorChunk messages.

The first chunk of a tensor carries its header (dtype, shape, codec, payload size, crc32); every chunk carries up
to CHUNK_BYTES of payload, so no gRPC message-size limit matters however large the tensor. The reader checks the
header against what the receiver expects before it reads (or allocates) the payload, and checks the size and the
checksum at the end. Nothing from the wire is unpickled.

Activations and gradients (the Forward and Backward calls) skip protobuf's copies of a chunk's data: `wire_chunks`
serializes a chunk with one copy of the data, from the encoded tensor into the message, and `parse_chunk` leaves the
data a view of the received message, its other fields parsed by protobuf. Protobuf would copy the data into its
message and out again on each side, and the tensor path's CPU was mostly such copies (bench/tensor_path.py). The
messages that carry a chunk on the links of nodes behind NAT (a ReverseDown, a RelayChunk) are built around it the
same way (nested_chunk) and read with `carrier_parser`. A reader given `into` copies an uncompressed tensor's chunks
straight into the tensor the receiver keeps, its decode.

The checksum is zlib's CRC-32, computed by zlib-ng (carry-less multiplies: 0.012 ms per MiB here against zlib
1.2.13's 0.18, which was a third of the raw tensor stream's CPU), and it is checked under TLS too: TLS covers one hop,
while a relayed tensor crosses two, and the crc32 goes end to end (what the relay may alter on purpose, the sender's
signature covers: node/reverse.py). A raw tensor stream carries none (protocol/tensorstream.py says why): its
headers are made without one (make_header's `checksum`), and with_checksum adds it when such a tensor goes by a call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import blake3
import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError, Message
from zlib_ng import zlib_ng

from geotrain.protocol import geotrain_pb2 as pb

crc32 = zlib_ng.crc32
"""(data, value=0) -> zlib.crc32's value, at zlib-ng's speed: a header's crc32 and its checks."""

Buffer = bytes | bytearray | memoryview

CHUNK_BYTES = 1 << 20
# Default cap on one activation's or gradient's encoded size; servers may lower it. State transfers have none of
# their own: each tensor is checked against what the receiver expects it to be (read_state).
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


def make_header(
    name: str, tensor_dtype: torch.dtype, shape: tuple[int, ...], codec: int, payload: Buffer, checksum: bool = True
) -> pb.TensorHeader:
    """The header describing one encoded tensor; without `checksum`, its crc32 is 0 (a raw tensor stream's header:
    protocol/tensorstream.py), to be set by with_checksum if the tensor goes by a call after all."""
    return pb.TensorHeader(
        name=name,
        dtype=TORCH_TO_WIRE[tensor_dtype],
        shape=list(shape),
        codec=codec,
        payload_bytes=memoryview(payload).nbytes,
        crc32=crc32(payload) if checksum else 0,
    )


def with_checksum(header: pb.TensorHeader, payload: Buffer) -> pb.TensorHeader:
    """A copy of `header` carrying its payload's crc32."""
    checked = pb.TensorHeader()
    checked.CopyFrom(header)
    checked.crc32 = crc32(payload)
    return checked


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
    """One encoded tensor's chunks (the first carries ref and header) as serialized TensorChunk messages, each data
    copied once (a request_serializer of None sends them as they are)."""
    for head, data in wire_chunk_parts(header, payload, ref, chunk_bytes):
        yield b"".join((head, data))


def wire_chunk_parts(
    header: pb.TensorHeader, payload: Buffer, ref: pb.MicrobatchRef | None = None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[tuple[bytes, memoryview]]:
    """wire_chunks' chunks, each as its serialized TensorChunk up to its data, and its data's view: the two joined are
    the chunk's wire form (wire_chunks); nested_chunk puts them in an enclosing message."""
    for chunk, data in _split(header, payload, ref, chunk_bytes):
        yield b"".join((chunk.SerializeToString(), bytes([_DATA_TAG]), _varint(len(data)))), data


def nested_chunk(fields: bytes, number: int, head: bytes, data: Buffer) -> bytes:
    """A serialized message of `fields` (its other fields, serialized) and a chunk of wire_chunk_parts as its field
    `number`, the chunk's data copied once, where building the message copies it twice and serializing once more
    (a message's fields may come in any order)."""
    return b"".join((fields, _varint((number << 3) | _LENGTH_DELIMITED), _varint(len(head) + len(data)), head, data))


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


def _fields(view: memoryview) -> Iterator[tuple[int, int, int, int]]:
    """Each field of a serialized message: its tag, where it starts, where its value starts and where it ends;
    ValueError when the message is malformed (a field cut off, or of a wire type protobuf no longer writes)."""
    pos = 0
    while pos < len(view):
        start = pos
        tag, pos = _read_varint(view, pos)
        wire = tag & 7
        if wire == _VARINT:
            value, (_, end) = pos, _read_varint(view, pos)
        elif wire == _LENGTH_DELIMITED:
            length, value = _read_varint(view, pos)
            end = value + length
        elif wire in _FIXED:
            value, end = pos, pos + _FIXED[wire]
        else:
            raise ValueError(f"field {tag >> 3} of wire type {wire}")
        if end > len(view):
            raise ValueError(f"field {tag >> 3} longer than its message")
        yield tag, start, value, end
        pos = end


_VARINT = 0
_FIXED = {1: 8, 5: 4}  # wire type -> its bytes: 64- and 32-bit


def parse_chunk(message: Buffer) -> WireChunk:
    """A serialized TensorChunk read with its data left in place (a request_deserializer); ValueError when it is
    malformed. Fields are length-delimited (ref, header, data): any other wire type, or data twice, is refused."""
    view = memoryview(message)
    others: list[memoryview] = []
    data = None
    for tag, start, value, end in _fields(view):
        if tag & 7 != _LENGTH_DELIMITED:
            raise ValueError(f"TensorChunk field {tag >> 3} of wire type {tag & 7}")
        if tag == _DATA_TAG:
            if data is not None:
                raise ValueError("TensorChunk carries data twice")
            data = view[value:end]
        else:
            others.append(view[start:end])
    try:
        fields = pb.TensorChunk.FromString(b"".join(others))  # ref and header: small
    except DecodeError as e:
        raise ValueError(f"malformed TensorChunk: {e}") from None
    return WireChunk(fields, data if data is not None else view[:0])


@dataclass(frozen=True)
class WireCarrier:
    """A message from the wire that carries a TensorChunk as its field `chunk` (a ReverseDown, a RelayChunk), that
    chunk read by parse_chunk (its data a view of the received message), its other fields by protobuf: it reads as the
    message itself."""

    fields: Message
    chunk: WireChunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fields, name)


def carrier_parser(kind: type[Message]) -> Callable[[bytes], WireCarrier]:
    """A deserializer of `kind`, whose field `chunk` is a TensorChunk, that leaves the chunk's data in place: the one
    copy left is the receiver's into its tensor, where protobuf's parse and the field's read made two more (a
    reverse link's or a relay's tensors, which go by gRPC). ValueError when the message is malformed."""
    chunk_tag = (kind.DESCRIPTOR.fields_by_name["chunk"].number << 3) | _LENGTH_DELIMITED

    def parse(message: bytes) -> WireCarrier:
        view = memoryview(message)
        others: list[memoryview] = []
        chunk = None
        for tag, start, value, end in _fields(view):
            if tag != chunk_tag:
                others.append(view[start:end])
            elif chunk is not None:
                raise ValueError(f"{kind.__name__} carries its chunk twice")
            else:
                chunk = parse_chunk(view[value:end])
        try:
            fields = kind.FromString(b"".join(others))
        except DecodeError as e:
            raise ValueError(f"malformed {kind.__name__}: {e}") from None
        return WireCarrier(fields, chunk if chunk is not None else WireChunk(pb.TensorChunk(), view[:0]))

    return parse


_CODECS = frozenset(pb.Codec.values()) - {pb.CODEC_UNSPECIFIED}  # once: Codec.values() makes a list each call


def check_header(header: pb.TensorHeader, max_bytes: int) -> None:
    """Reject a header that is self-inconsistent or too large, before any payload is read."""
    dtype, shape = WIRE_TO_TORCH.get(header.dtype), header.shape  # each field read once: it runs for every tensor
    if dtype is None:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported tensor dtype {header.dtype}")
    if header.codec not in _CODECS:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown tensor codec {header.codec}")
    if len(shape) > MAX_RANK or (shape and min(shape) < 0):
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"bad tensor shape {list(shape)}")
    if header.payload_bytes > max_bytes:
        raise FrameError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"tensor payload of {header.payload_bytes} bytes exceeds the limit of {max_bytes} bytes",
        )
    if math.prod(shape) * dtype.itemsize > max_bytes * 16:
        raise FrameError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tensor of shape {list(shape)} is too large")


def check_checksum(header: pb.TensorHeader, payload: Buffer) -> None:
    """Reject a payload whose crc32 is not the one its header declares."""
    if crc32(payload) != header.crc32:
        raise FrameError(grpc.StatusCode.DATA_LOSS, "tensor payload checksum mismatch")


@dataclass
class ReceivedTensor:
    """One tensor read off a chunk stream, payload still encoded; or, with `tensor`, an uncompressed payload read
    straight into that tensor of its own, its decode (payload is then that tensor's bytes)."""

    ref: pb.MicrobatchRef
    header: pb.TensorHeader
    payload: Buffer
    tensor: torch.Tensor | None = None


Destination = Callable[[pb.TensorHeader], torch.Tensor | None]
"""An admitted header -> a new contiguous CPU tensor its payload is copied into as it arrives, for a payload that is
its own decode (uncompressed, filling the header's shape and dtype); None: the payload is kept as received."""


def read_tensors(
    chunks: Iterable[pb.TensorChunk | WireChunk],
    max_bytes: int = MAX_TENSOR_BYTES,
    on_header: Callable[[pb.MicrobatchRef, pb.TensorHeader], None] | None = None,
    into: Destination | None = None,
) -> Iterator[ReceivedTensor]:
    """Reassemble tensors from a chunk stream, validating each header (and on_header) before its payload; a payload
    `into` gives a tensor for is copied into it chunk by chunk (one copy, where joining chunks and decoding made
    two)."""
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
        tensor = into(header) if into is not None else None
        out = byte_view(tensor) if tensor is not None else None
        # Without `into`, a tensor of one chunk is decoded from that chunk's data as received.
        parts, filled = [], 0
        while True:
            size = len(chunk.data)
            if filled + size > header.payload_bytes:
                raise FrameError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor stream carries more than the {header.payload_bytes} bytes its header declares",
                )
            if out is not None:
                out[filled : filled + size] = chunk.data
            else:
                parts.append(chunk.data)
            filled += size
            chunk = next(it, None)
            if chunk is None or chunk.HasField("header"):
                break
        if filled != header.payload_bytes:
            raise FrameError(
                grpc.StatusCode.DATA_LOSS,
                f"truncated tensor stream: got {filled} of {header.payload_bytes} payload bytes",
            )
        payload = out if out is not None else parts[0] if len(parts) == 1 else b"".join(parts)
        check_checksum(header, payload)
        yield ReceivedTensor(ref=ref, header=header, payload=payload, tensor=tensor)


def read_one_tensor(
    chunks: Iterable[pb.TensorChunk | WireChunk],
    max_bytes: int = MAX_TENSOR_BYTES,
    on_header: Callable[[pb.MicrobatchRef, pb.TensorHeader], None] | None = None,
    into: Destination | None = None,
) -> ReceivedTensor:
    """Read a stream that must carry exactly one tensor."""
    tensors = read_tensors(chunks, max_bytes, on_header, into)
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


@dataclass(frozen=True)
class StateSource:
    """One tensor of a state transfer as its sender serves it: its header's fields and a reader of its raw bytes, so
    that a stream never holds more of it than the chunk it is sending."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32: Callable[[], int]
    """The payload's crc32, computed when a header asks for it (gRPC's; a raw stream's carries none)."""
    read: Callable[[int, int], Buffer]
    """(offset, size <= CHUNK_BYTES) -> that many payload bytes from offset, valid until the next read."""

    @property
    def nbytes(self) -> int:  # noqa: D102
        return math.prod(self.shape) * self.dtype.itemsize


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (the same memory, on its device)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes, to be filled from the wire: through numpy's view, one torch call
    where flat_bytes makes three tensors (each a tenth of a raw tensor stream's CPU above a raw socket's, run
    cache-cold after each payload's copy: bench/tensor_path.py), except for bfloat16, which numpy lacks."""
    if tensor.dtype is not torch.bfloat16:
        try:
            return memoryview(tensor.numpy()).cast("B")
        except TypeError:
            pass  # an empty tensor: a view with a zero in its shape has no byte view
    return memoryview(flat_bytes(tensor).numpy())


def tensor_crc32(flat: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> int:
    """crc32 of a flat uint8 tensor, read in place on the CPU, a chunk at a time from another device."""
    if flat.device.type == "cpu":
        return crc32(memoryview(flat.numpy()))
    crc = 0
    for offset in range(0, flat.numel(), chunk_bytes):
        crc = crc32(memoryview(flat[offset : offset + chunk_bytes].cpu().numpy()), crc)
    return crc


def tensor_source(name: str, tensor: torch.Tensor) -> StateSource:
    """A tensor served from its own memory: no copy of it but the chunk being sent (and a contiguous copy of a tensor
    that is not contiguous). The caller keeps the tensor unchanged until the stream has sent it."""
    t = tensor.detach()
    t = t if t.is_contiguous() else t.contiguous()
    flat = flat_bytes(t)
    if flat.device.type == "cpu":
        view = memoryview(flat.numpy())
        return StateSource(name, t.dtype, tuple(t.shape), lambda: crc32(view), lambda at, n: view[at : at + n])
    return StateSource(
        name, t.dtype, tuple(t.shape), lambda: tensor_crc32(flat),
        lambda at, n: flat[at : at + n].cpu().numpy().tobytes(),
    )


def state_header(source: StateSource, checksum: bool = True) -> pb.TensorHeader:
    """The header a state tensor travels under: uncompressed; without `checksum`, its crc32 is 0 (a raw stream's:
    TCP's checksum, or TLS, covers its one hop, as on a raw tensor stream)."""
    return pb.TensorHeader(
        name=source.name, dtype=TORCH_TO_WIRE[source.dtype], shape=list(source.shape), codec=pb.CODEC_NONE,
        payload_bytes=source.nbytes, crc32=source.crc32() if checksum else 0,
    )


def state_stream(sources: Iterable[StateSource], chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """The chunks of a state transfer, uncompressed, tensor after tensor; each chunk's data is read when it is made."""
    for source in sources:
        header = state_header(source)
        yield pb.TensorChunk(header=header, data=bytes(source.read(0, min(chunk_bytes, source.nbytes))))
        for offset in range(chunk_bytes, source.nbytes, chunk_bytes):
            yield pb.TensorChunk(data=bytes(source.read(offset, min(chunk_bytes, source.nbytes - offset))))


def state_chunks(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[pb.TensorChunk]:
    """Named tensors, uncompressed, one after another: the stream of a state transfer."""
    return state_stream(tensor_source(name, tensor) for name, tensor in items)


def check_state_header(header: pb.TensorHeader) -> None:
    """Reject a state tensor's header that is self-inconsistent: a state transfer is uncompressed, so its payload is
    exactly its shape's bytes. Its size is bounded by what the receiver expects of the tensor (StateSink.begin)."""
    if header.dtype not in WIRE_TO_TORCH:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported tensor dtype {header.dtype}")
    if header.codec != pb.CODEC_NONE:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "state tensors travel uncompressed")
    if not header.name or len(header.name) > MAX_STATE_NAME:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "a state tensor without a name, or with a name too long")
    if len(header.shape) > MAX_RANK:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"bad tensor shape {list(header.shape)}")
    if header.payload_bytes != math.prod(header.shape) * WIRE_TO_TORCH[header.dtype].itemsize:
        raise FrameError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"state tensor {header.name}: {header.payload_bytes} bytes do not fill shape {list(header.shape)}",
        )


MAX_STATE_NAME = 512


class StateSink:
    """Where a state transfer's tensors go as they arrive (StateReceiver): `begin` checks a tensor's header against
    what the receiver expects, raising FrameError if it is not that, and returns the writer its payload is passed to
    in order, chunk by chunk; `end` is told once the tensor is whole and its crc32 checked (one that is not 0)."""

    def begin(self, header: pb.TensorHeader) -> Callable[[memoryview], None]:  # noqa: D102
        raise NotImplementedError

    def end(self, header: pb.TensorHeader) -> None:  # noqa: D102
        pass


class StateReceiver:
    """A state-transfer stream read chunk by chunk (`feed`, then `close` at its end) into a StateSink: each header is
    checked before any of its payload is taken, each payload is checked for its size and crc32 as it passes, and no
    chunk is kept once it has been written. A header's crc32 of 0 says the payload is not checksummed (a raw stream's,
    whose hop TCP's checksum or TLS covers): a sender's checksum guards against accidents, never against the sender,
    who can write any it likes."""

    def __init__(self, sink: StateSink) -> None:
        self._sink = sink
        self._header: pb.TensorHeader | None = None
        self._write: Callable[[memoryview], None] | None = None
        self._filled = self._crc = 0
        self.tensors = 0
        self.bytes = 0

    def feed(self, chunk: pb.TensorChunk | WireChunk) -> None:
        """Take the stream's next chunk."""
        if chunk.HasField("header"):
            self._finish()
            check_state_header(chunk.header)
            self._header, self._filled, self._crc = chunk.header, 0, 0
            self._write = self._sink.begin(chunk.header)
        elif self._header is None:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "tensor stream does not start with a header chunk")
        data = memoryview(chunk.data)
        self._filled += len(data)
        if self._filled > self._header.payload_bytes:
            raise FrameError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor stream carries more than the {self._header.payload_bytes} bytes its header declares",
            )
        if self._header.crc32:
            self._crc = crc32(data, self._crc)
        if len(data):
            self._write(data)

    def close(self) -> None:
        """The stream ended: the last tensor must be whole; an empty stream is refused."""
        if self._header is None:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "empty tensor stream")
        self._finish()

    def _finish(self) -> None:
        header = self._header
        if header is None:
            return
        if self._filled != header.payload_bytes:
            raise FrameError(
                grpc.StatusCode.DATA_LOSS,
                f"truncated tensor stream: got {self._filled} of {header.payload_bytes} payload bytes",
            )
        if header.crc32 and self._crc != header.crc32:
            raise FrameError(grpc.StatusCode.DATA_LOSS, "tensor payload checksum mismatch")
        self._sink.end(header)
        self._header, self.tensors, self.bytes = None, self.tensors + 1, self.bytes + header.payload_bytes


def receive_state(chunks: Iterable[pb.TensorChunk | WireChunk], sink: StateSink) -> StateReceiver:
    """Read a whole state-transfer stream into `sink`; returns the receiver (its counts of tensors and bytes)."""
    receiver = StateReceiver(sink)
    for chunk in chunks:
        receiver.feed(chunk)
    receiver.close()
    return receiver


Expectation = Callable[[pb.TensorHeader], torch.Tensor]
"""A header -> the tensor its payload is written into (of the header's shape and dtype, contiguous, on any device),
or FrameError when the receiver expects no such tensor."""


def bounded(max_bytes: int) -> Expectation:
    """An expectation for a receiver that knows no shapes: any tensor of at most max_bytes, into a new CPU tensor."""

    def expect(header: pb.TensorHeader) -> torch.Tensor:
        if header.payload_bytes > max_bytes:
            raise FrameError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"tensor payload of {header.payload_bytes} bytes exceeds the limit of {max_bytes} bytes",
            )
        return torch.empty(tuple(header.shape), dtype=WIRE_TO_TORCH[header.dtype])

    return expect


class TensorSink(StateSink):
    """State tensors written straight into the tensors `expect` gives for them (a stage's own, or new ones): each
    chunk is copied once, into its place. `tensors`: what arrived, by name; a name twice is refused."""

    def __init__(self, expect: Expectation) -> None:
        self._expect = expect
        self.tensors: dict[str, torch.Tensor] = {}

    def begin(self, header: pb.TensorHeader) -> Callable[[memoryview], None]:  # noqa: D102
        if header.name in self.tensors:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"state tensor {header.name} sent twice")
        tensor = self._expect(header)
        self.tensors[header.name] = tensor
        flat, at = flat_bytes(tensor), 0
        host = flat.numpy() if flat.device.type == "cpu" else None

        def write(data: memoryview) -> None:
            nonlocal at
            if host is not None:
                host[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
            else:  # a chunk staged on the host on its way to the device
                flat[at : at + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            at += len(data)

        return write


def read_state(
    chunks: Iterable[pb.TensorChunk | WireChunk], max_bytes: int = MAX_TENSOR_BYTES, expect: Expectation | None = None
) -> dict[str, torch.Tensor]:
    """The named tensors of a state-transfer stream: into what `expect` gives for each (no size cap but what it
    expects), else into new tensors of at most max_bytes each."""
    sink = TensorSink(expect or bounded(max_bytes))
    receive_state(chunks, sink)
    return sink.tensors


# A tensor call's deadline: ten times the link's mean call, at least CALL_DEADLINE_FLOOR_S, at most the plan's
# call_deadline_s (the first call to a peer not measured yet has that). The coordinator judges failure reports by
# them: a step shorter than the shortest let no honest call time out.
CALL_DEADLINE_FLOOR_S = 5.0
_UNNAMED_CALL_DEADLINE_S = 60.0  # under a plan that names none (a plan built by hand, as tests do)


def call_deadline_cap_s(plan: pb.Plan) -> float:
    """The longest a tensor call waits under `plan`."""
    return plan.call_deadline_s or _UNNAMED_CALL_DEADLINE_S


def state_deadline_s(nbytes: int, bytes_per_s: float, floor_s: float) -> float:
    """How long a state transfer of nbytes may take over a link of bytes_per_s: floor_s (the connection, the
    snapshot, a slow disk) and twice the time its bytes take (the link's measure is one probe)."""
    return floor_s + 2.0 * nbytes / max(bytes_per_s, 1.0)


def checksum_hasher() -> blake3.blake3:
    """The hash of stage checksums (parameters_checksum): blake3, several times sha256's speed on one core, since
    every replica hashes its whole stage every step and a checkpoint's writer every stage it receives."""
    return blake3.blake3()


def parameters_checksum(params: Iterable[tuple[str, torch.Tensor]], hasher: Callable[[], Any] = checksum_hasher) -> str:
    """A hash (blake3 unless `hasher` says) over named parameters in name order, each name then its raw bytes. A
    stage's replicas that applied the same steps agree on it bit for bit, and the coordinator computes it from a
    checkpoint for any layer range: the order in which a node, a transfer or a checkpoint file holds the tensors does
    not change it."""
    digest = hasher()
    for name, tensor in sorted(params, key=lambda item: item[0]):
        digest.update(name.encode())
        # Hashed where the bytes lie (a host tensor's own memory, not a copy of it); both hashes let go of the GIL.
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
