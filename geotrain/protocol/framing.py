"""Tensor framing: a tensor's encoded bytes travel as a stream of TensorChunk messages.

The first chunk of a tensor carries its header (dtype, shape, codec, payload size, crc32); every chunk carries up
to CHUNK_BYTES of payload, so no gRPC message-size limit matters however large the tensor. The reader checks the
header against what the receiver expects before it reads (or allocates) the payload, and checks the size and the
checksum at the end. Nothing from the wire is unpickled.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
import torch

from geotrain.protocol import geotrain_pb2 as pb

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


class FrameError(Exception):
    """A tensor stream is malformed; `code` is the gRPC status the server answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def make_header(name: str, tensor_dtype: torch.dtype, shape: tuple[int, ...], codec: int, payload: bytes) -> pb.TensorHeader:
    """The header describing one encoded tensor."""
    return pb.TensorHeader(
        name=name,
        dtype=TORCH_TO_WIRE[tensor_dtype],
        shape=list(shape),
        codec=codec,
        payload_bytes=len(payload),
        crc32=zlib.crc32(payload),
    )


def chunk_tensor(
    header: pb.TensorHeader, payload: bytes, ref: pb.MicrobatchRef | None = None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.TensorChunk]:
    """Split one encoded tensor into chunks; the first carries ref and header."""
    view = memoryview(payload)
    first = pb.TensorChunk(header=header, data=bytes(view[:chunk_bytes]))
    if ref is not None:
        first.ref.CopyFrom(ref)
    yield first
    for offset in range(chunk_bytes, len(payload), chunk_bytes):
        yield pb.TensorChunk(data=bytes(view[offset : offset + chunk_bytes]))


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


@dataclass
class ReceivedTensor:
    """One tensor read off a chunk stream, payload still encoded."""

    ref: pb.MicrobatchRef
    header: pb.TensorHeader
    payload: bytes


def read_tensors(
    chunks: Iterable[pb.TensorChunk],
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
        buf = bytearray(header.payload_bytes)
        filled = 0
        while True:
            n = len(chunk.data)
            if filled + n > header.payload_bytes:
                raise FrameError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor stream carries more than the {header.payload_bytes} bytes its header declares",
                )
            buf[filled : filled + n] = chunk.data
            filled += n
            chunk = next(it, None)
            if chunk is None or chunk.HasField("header"):
                break
        if filled != header.payload_bytes:
            raise FrameError(
                grpc.StatusCode.DATA_LOSS,
                f"truncated tensor stream: got {filled} of {header.payload_bytes} payload bytes",
            )
        payload = bytes(buf)
        if zlib.crc32(payload) != header.crc32:
            raise FrameError(grpc.StatusCode.DATA_LOSS, "tensor payload checksum mismatch")
        yield ReceivedTensor(ref=ref, header=header, payload=payload)


def read_one_tensor(
    chunks: Iterable[pb.TensorChunk],
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


def raw_tensor(header: pb.TensorHeader, payload: bytes) -> torch.Tensor:
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
