"""The Stage gRPC service: parse, validate against the plan, decode, then hand over to the agent.

Validation happens on the first chunk, before the payload is read; a bad request gets a status with a clear message
and changes nothing on the node.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

import grpc
import torch

from geotrain.compression import CodecError, codec_from_payload
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.framing import FrameError
from geotrain.protocol.probe import serve_probe

if TYPE_CHECKING:
    from geotrain.node.agent import Agent

log = logging.getLogger(__name__)


def decode_tensor(received: framing.ReceivedTensor, check_finite: bool) -> torch.Tensor:
    """Decode a received payload with the codec its header names; raises FrameError on bad input."""
    header = received.header
    try:
        codec = codec_from_payload(header.codec, received.payload)
        tensor = codec.decode(received.payload, tuple(header.shape), framing.WIRE_TO_TORCH[header.dtype])
    except CodecError as e:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode tensor: {e}") from None
    if check_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "tensor contains NaN or Inf")
    return tensor


class StageServicer(rpc.StageServicer):
    """Receives activations and gradients for the agent's stage, and serves its state."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def _receive(self, direction: str, chunks: Iterator[pb.TensorChunk], context: grpc.ServicerContext) -> pb.Ack:
        agent = self.agent
        try:
            received = framing.read_one_tensor(
                chunks, agent.options.max_tensor_bytes, lambda ref, h: agent.check_incoming(direction, ref, h)
            )
            tensor = decode_tensor(received, agent.options.check_finite)
        except FrameError as e:
            log.warning("rejected %s from %s: %s", direction, context.peer(), e)
            context.abort(e.code, str(e))
        agent.accept(direction, received.ref, tensor, wire_bytes=len(received.payload))
        return pb.Ack()

    def Forward(self, request_iterator, context):  # noqa: D102, N802
        return self._receive("forward", request_iterator, context)

    def Backward(self, request_iterator, context):  # noqa: D102, N802
        return self._receive("backward", request_iterator, context)

    def FetchState(self, request, context):  # noqa: D102, N802
        snapshot = self.agent.state_snapshot(request.steps_done)
        if snapshot is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node holds no state after {request.steps_done} steps")
        yield from framing.state_chunks(snapshot)

    def Probe(self, request_iterator, context):  # noqa: D102, N802
        return serve_probe(request_iterator, context)


def check_activation_header(
    header: pb.TensorHeader, shape: list[int], codec_ids: Collection[int], max_bytes: int
) -> None:
    """Raise FrameError unless header describes an fp32 activation of `shape` in one of the codecs `codec_ids`."""
    if header.dtype != pb.DTYPE_FLOAT32:
        raise FrameError(
            grpc.StatusCode.INVALID_ARGUMENT, f"expected float32 activations, got {pb.DType.Name(header.dtype)}"
        )
    if list(header.shape) != shape:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"expected shape {shape}, got {list(header.shape)}")
    if header.codec not in codec_ids:
        expected = " or ".join(pb.Codec.Name(c) for c in sorted(codec_ids))
        raise FrameError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"expected codec {expected}, got {pb.Codec.Name(header.codec)}"
            if header.codec in pb.Codec.values()
            else f"unknown codec {header.codec}",
        )
    if header.payload_bytes > min(max_bytes, 2 * math.prod(shape) * 4 + 4096):
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"payload of {header.payload_bytes} bytes is too large")
