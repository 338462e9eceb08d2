"""The Stage gRPC service: parse, validate against the plan, decode, then hand over to the node's StageHandler.

Validation happens on the first chunk, before the payload is read; a bad request gets a status with a clear message
and changes nothing on the node. Tensors on the raw tensor streams this service hands out tickets for
(protocol/tensorstream.py) pass the same checks, which the stream calls around its own reading (admit, take). The
service sees the node only through StageHandler (the agent implements it), so this module imports nothing of the
agent's.
"""

from __future__ import annotations

import itertools
import math
import socket
from collections.abc import Callable, Collection, Iterator
from typing import Protocol

import grpc
import torch

from geotrain.compression import CodecError, codec_from_payload, new_tensor
from geotrain.node.handover import StateSnapshot
from geotrain.node.reverse import ReverseError, ReverseSender, serialize_down
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol import statestream
from geotrain.protocol.auth import RefusalLog
from geotrain.protocol.auth import signer
from geotrain.protocol.framing import Buffer, FrameError
from geotrain.protocol.probe import serve_probe
from geotrain.protocol.tensorstream import TensorStreamServer

try:
    # The finiteness kernel (setup.py builds it where a C compiler is found); else torch's sum. An extension built
    # before the kernel existed (a checkout updated without `make`) lacks it: a missing kernel must not fail a tensor.
    from geotrain.compression import _blockquant

    _finite_kernel = getattr(_blockquant, "all_finite", None)
except ImportError:
    _finite_kernel = None


# A float format's width in bytes and exponent mask: a value is NaN or Inf where every bit of the mask is set.
_EXPONENTS = {
    torch.float16: (2, 0x7C00), torch.bfloat16: (2, 0x7F80), torch.float32: (4, 0x7F800000),
    torch.float64: (8, 0x7FF0000000000000),
}


def all_finite(tensor: torch.Tensor, data: Buffer | None = None) -> bool:
    """Whether a CPU floating-point tensor (whose bytes are `data`, where the caller has them) holds no NaN or Inf,
    in one pass: the C kernel's test of each value's exponent bits (compression/_blockquant.c) where it was built,
    else the sum (in float32 at least), finite only if every element is, as NaN and Inf carry through a sum, and the
    exact test only where the sum is not (such an element, or finite ones that overflow). On a 1 MiB activation the
    kernel reads it at about the sum's speed, without its dispatch."""
    layout = _EXPONENTS.get(tensor.dtype)
    if _finite_kernel is not None and layout is not None:
        if data is not None:  # the tensor's own bytes: contiguous
            return _finite_kernel(data, *layout)
        if tensor.is_contiguous():
            return _finite_kernel(framing.flat_bytes(tensor).numpy(), *layout)
    if math.isfinite(tensor.sum(dtype=torch.promote_types(tensor.dtype, torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def decode_tensor(received: framing.ReceivedTensor, check_finite: bool, pin: bool = False) -> torch.Tensor:
    """Decode a received payload with the codec its header names (into pinned memory if `pin`: for a CUDA device);
    raises FrameError on bad input."""
    header, data = received.header, None
    dtype = framing.WIRE_TO_TORCH[header.dtype]  # the decode's: torch's own attributes cost more
    try:
        if received.tensor is not None:  # read into a tensor of its own, as destination() gave it: its own decode
            tensor, data = received.tensor, received.payload
        else:
            codec = codec_from_payload(header.codec, received.payload)
            tensor = codec.decode(received.payload, tuple(header.shape), dtype, pin)
    except CodecError as e:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode tensor: {e}") from None
    if check_finite and dtype.is_floating_point and not all_finite(tensor, data):
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "tensor contains NaN or Inf")
    return tensor


class StageHandler(Protocol):
    """What the Stage service needs of the node behind it; `direction` is "forward" or "backward"."""

    def check_incoming(
        self, direction: str, ref: pb.MicrobatchRef, header: pb.TensorHeader, signer: bytes | None
    ) -> None:
        """Raise FrameError unless the node's current plan expects this tensor from the node whose key is `signer`
        (the key that signed the stream; None: unsigned), called before its payload is read."""

    def accept(self, direction: str, ref: pb.MicrobatchRef, tensor: torch.Tensor, wire_bytes: int) -> None:
        """Take a validated, decoded tensor (queue its compute); must not block on compute."""

    def may_overflow(self, direction: str) -> bool:
        """Whether tensors of this direction may hold Inf or NaN by design (fp16's scaled gradients)."""

    def state_snapshot(self, steps_done: int, layers: tuple[int, int] | None = None) -> StateSnapshot | None:
        """A snapshot of the state of `layers` (None: the current stage's) after steps_done committed steps, or None
        if the node holds none; closed with close_snapshot once sent."""

    def close_snapshot(self, snapshot: StateSnapshot) -> None:
        """A snapshot's transfer ended (sent, failed or cancelled)."""

    def evidence_snapshot(self, step: int, microbatch: int) -> list[tuple[str, torch.Tensor]] | None:
        """What the node kept of a step's microbatch for a verifier (node/verifier.py), or None."""

    def reverse_receiver(self, signer: bytes | None) -> str | None:
        """The node id of the neighbour, one nobody can dial, that the current plan has this node send to and whose
        key is `signer`; None when there is none."""

    def may_read_state(self, signer: bytes | None) -> bool:
        """Whether the key that signed a FetchState (None: unsigned) may download this node's state."""

    def relay_sender(self, signer: bytes | None, receiver: str) -> str | None:
        """The node id of the sender, signed by key `signer`, whose tensors the current plan has this node relay to
        node `receiver`; None when it has none."""

    def check_tensor_stream(self, signer: bytes | None) -> None:
        """Raise FrameError unless the key that signed an OpenTensorStream (None: unsigned) may open a raw tensor
        stream to this node: the run sends tensors over them, and the key is a neighbour's in the current plan."""


class StageServicer(rpc.StageServicer):
    """Receives activations and gradients for a node's stage, and serves its state."""

    def __init__(
        self, handler: StageHandler, max_tensor_bytes: int, check_finite: bool, refusals: RefusalLog,
        reverse: ReverseSender, tensor_streams: TensorStreamServer | None = None, pin_decoded: bool = False,
    ) -> None:
        self.handler = handler
        self.pin_decoded = pin_decoded  # the node computes on CUDA: tensors are decoded into pinned memory
        self.max_tensor_bytes = max_tensor_bytes
        self.check_finite = check_finite
        self.refusals = refusals  # one line per sending host and minute, however many bad tensors it sends
        self.reverse = reverse  # the streams unreachable neighbours open to receive over
        # Where neighbours that can dial this node send tensors; None: calls only (a run without raw tensor streams).
        self.tensor_streams = tensor_streams

    def receive(
        self, direction: str, chunks: Iterator[pb.TensorChunk | framing.WireChunk], key: bytes | None, peer: str,
        check: Callable[[framing.ReceivedTensor], None] | None = None,
    ) -> None:
        """Read, check and decode one tensor signed by `key` and hand it to the node, from a call or a reverse
        stream (`check`: a relayed tensor's signature, checked before it is decoded); FrameError (logged for `peer`,
        rate-limited) when it is refused, with nothing changed."""
        try:
            received = framing.read_one_tensor(
                chunks, self.max_tensor_bytes, lambda ref, header: self.admit(direction, ref, header, key),
                self.destination,
            )
            if check is not None:
                check(received)
            self.take(direction, received)
        except FrameError as e:
            self.refused(peer, direction, str(e))
            raise

    # The checks and the hand-over of a tensor, whichever way it came: a call or a reverse stream (receive), or a raw
    # tensor stream (protocol/tensorstream.py), which calls them itself around its own reading.

    def admit(self, direction: str, ref: pb.MicrobatchRef, header: pb.TensorHeader, key: bytes | None) -> None:
        """Raise FrameError unless the node's plan expects this tensor from the node whose key is `key`; called once
        the header passed framing's checks, before the payload is read."""
        self.handler.check_incoming(direction, ref, header, key)

    def destination(self, header: pb.TensorHeader) -> torch.Tensor | None:
        """A new tensor that an admitted uncompressed payload is read straight into (pinned for a CUDA node), its
        decode; None for any other payload, decoded (or refused) from the bytes received."""
        dtype, shape = framing.WIRE_TO_TORCH.get(header.dtype), header.shape
        if header.codec != pb.CODEC_NONE or dtype is None:
            return None
        if header.payload_bytes != math.prod(shape) * dtype.itemsize:
            return None  # the codec's decode refuses it
        return new_tensor(shape, dtype, self.pin_decoded)

    def take(self, direction: str, received: framing.ReceivedTensor) -> None:
        """Decode a tensor whose payload passed its checksum (into a tensor of its own) and hand it to the node;
        FrameError when it cannot be decoded or is not finite."""
        check_finite = self.check_finite and not self.handler.may_overflow(direction)
        tensor = decode_tensor(received, check_finite, self.pin_decoded)
        self.handler.accept(direction, received.ref, tensor, wire_bytes=len(received.payload))

    def refused(self, peer: str, direction: str, why: str) -> None:
        """Note a refused tensor from `peer` (one log line per host and interval)."""
        self.refusals.refused(peer, direction, "", why)

    def _receive(self, direction: str, chunks: Iterator[pb.TensorChunk], context: grpc.ServicerContext) -> pb.Ack:
        try:
            self.receive(direction, chunks, signer(context), context.peer())
        except FrameError as e:
            context.abort(e.code, str(e))
        return pb.Ack()

    def Forward(self, request_iterator, context):  # noqa: D102, N802
        return self._receive("forward", request_iterator, context)

    def Backward(self, request_iterator, context):  # noqa: D102, N802
        return self._receive("backward", request_iterator, context)

    def FetchState(self, request, context):  # noqa: D102, N802
        layers = self._state_asked(request, context, "FetchState")
        snapshot = self.handler.state_snapshot(request.steps_done, layers)
        if snapshot is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, _no_state(request))
        try:
            yield from framing.state_stream(snapshot.sources())
        finally:
            self.handler.close_snapshot(snapshot)

    def OpenStateStream(self, request, context):  # noqa: D102, N802
        if self.tensor_streams is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node serves its state by FetchState only")
        layers = self._state_asked(request, context, "OpenStateStream")

        def serve(sock: socket.socket) -> None:
            statestream.background_priority()  # this connection's own thread
            snapshot = self.handler.state_snapshot(request.steps_done, layers)
            try:
                statestream.send_state(sock, snapshot.sources() if snapshot else None, _no_state(request))
            finally:
                if snapshot is not None:
                    self.handler.close_snapshot(snapshot)

        try:
            ticket = self.tensor_streams.ticket(signer(context), serve)
        except FrameError as e:
            self.refusals.refused(context.peer(), "OpenStateStream", "", str(e))
            context.abort(e.code, str(e))
        return pb.TensorStreamTicket(port=self.tensor_streams.port, ticket=ticket)

    def _state_asked(self, request: pb.FetchStateRequest, context, call: str) -> tuple[int, int] | None:
        """The layers a state request asks for (None: the node's current stage), once its signer may read them."""
        if not self.handler.may_read_state(signer(context)):
            why = "state goes only to the nodes of this node's plan and its coordinator, signed by their keys"
            self.refusals.refused(context.peer(), call, "", why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        layers = (request.layer_start, request.layer_end) if request.layer_end else None
        if layers is not None and request.layer_start >= request.layer_end:
            empty = f"empty layer range [{request.layer_start}, {request.layer_end})"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, empty)
        return layers

    def FetchEvidence(self, request, context):  # noqa: D102, N802
        if not self.handler.may_read_state(signer(context)):
            why = "evidence goes only to the nodes of this node's plan and its coordinator, signed by their keys"
            self.refusals.refused(context.peer(), "FetchEvidence", "", why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        evidence = self.handler.evidence_snapshot(request.step, request.microbatch)
        if evidence is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node keeps no evidence of step {request.step} microbatch {request.microbatch}",
            )
        yield from framing.state_chunks(evidence)

    def Probe(self, request_iterator, context):  # noqa: D102, N802
        return serve_probe(request_iterator, context, self.refusals)

    def Reverse(self, request_iterator, context):  # noqa: D102, N802
        peer = self.handler.reverse_receiver(signer(context))
        if peer is None:
            why = "this node's plan sends to no unreachable node with the key that signed this stream"
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        try:
            yield from self.reverse.serve(peer, request_iterator)
        except FrameError as e:
            self.refusals.refused(context.peer(), "Reverse", peer, str(e))
            context.abort(e.code, str(e))

    def Relay(self, request_iterator, context):  # noqa: D102, N802
        first = next(request_iterator, None)
        direction = framing.DIRECTION_NAMES.get(first.direction) if first is not None else None
        if direction is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Relay stream opens with its receiver and direction")
        origin = self.handler.relay_sender(signer(context), first.receiver)
        if origin is None:
            why = f"this node's plan relays nothing to {first.receiver[:100]!r} from the key that signed this call"
            self.refusals.refused(context.peer(), "Relay", "", why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        chunks = itertools.chain([first.chunk], (m.chunk for m in request_iterator))
        try:
            # Framing and size are checked here, the plan's shapes and the signature by the receiver.
            received = framing.read_one_tensor(chunks, self.max_tensor_bytes)
            remaining = context.time_remaining()
            self.reverse.send(first.receiver, direction, received.ref, received.header, received.payload,
                              remaining if remaining is not None else _RELAY_DEADLINE_S, origin, first.signature)
        except FrameError as e:
            self.refusals.refused(context.peer(), "Relay", origin, str(e))
            context.abort(e.code, str(e))
        except ReverseError as e:
            context.abort(e.code(), e.details())
        return pb.Ack()

    def OpenTensorStream(self, request, context):  # noqa: D102, N802
        if self.tensor_streams is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node takes tensors by calls only")
        key = signer(context)
        try:
            self.handler.check_tensor_stream(key)
            ticket = self.tensor_streams.ticket(key)
        except FrameError as e:
            self.refusals.refused(context.peer(), "OpenTensorStream", "", str(e))
            context.abort(e.code, str(e))
        return pb.TensorStreamTicket(port=self.tensor_streams.port, ticket=ticket)


_RELAY_DEADLINE_S = 60.0  # a Relay call without a deadline waits this long for the receiver's ack

class _Handlers:
    """Stands in for a server to collect the generated code's method handlers of a service."""

    def __init__(self) -> None:
        self.methods: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:  # noqa: D102 - the registered ones are the same
        pass

    def add_registered_method_handlers(  # noqa: D102
        self, service: str, methods: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service, self.methods = service, dict(methods)


def add_stage_service(servicer: StageServicer, server: grpc.Server) -> None:
    """Serve `servicer` on `server`: Forward and Backward read their chunks with framing.parse_chunk (a chunk's data
    left where it arrived), Relay its RelayChunks likewise (framing.carrier_parser), Reverse sends deliveries
    serialized already (reverse.serialize_down), the other methods as generated."""
    handlers = _Handlers()
    rpc.add_StageServicer_to_server(servicer, handlers)
    for name in ("Forward", "Backward"):
        handlers.methods[name] = grpc.stream_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=framing.parse_chunk,
            response_serializer=pb.Ack.SerializeToString,
        )
    handlers.methods["Reverse"] = grpc.stream_stream_rpc_method_handler(
        servicer.Reverse, request_deserializer=pb.ReverseUp.FromString, response_serializer=serialize_down
    )
    handlers.methods["Relay"] = grpc.stream_unary_rpc_method_handler(
        servicer.Relay, request_deserializer=framing.carrier_parser(pb.RelayChunk),
        response_serializer=pb.Ack.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(handlers.service, handlers.methods),))
    server.add_registered_method_handlers(handlers.service, handlers.methods)


# The dtype activations and their gradients travel in, by train.precision: the compute dtype.
WIRE_DTYPES = {"fp32": pb.DTYPE_FLOAT32, "bf16": pb.DTYPE_BFLOAT16, "fp16": pb.DTYPE_FLOAT16}


def _dtype_name(wire_dtype: int) -> str:
    """float32, bfloat16, ...: the torch name of a wire dtype, or its number when it is none we know."""
    known = framing.WIRE_TO_TORCH.get(wire_dtype)
    return str(known).removeprefix("torch.") if known is not None else f"dtype {wire_dtype}"


def check_activation_header(
    header: pb.TensorHeader, shape: list[int], dtype: int, codec_ids: Collection[int], max_bytes: int
) -> None:
    """Raise FrameError unless header describes an activation of `shape` and wire `dtype` in one of the codecs
    `codec_ids`."""
    if header.dtype != dtype:
        raise FrameError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"expected {_dtype_name(dtype)} activations, got {_dtype_name(header.dtype)}",
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


def _no_state(request: pb.FetchStateRequest) -> str:
    """Why a state request finds nothing to serve."""
    which = f"layers [{request.layer_start}, {request.layer_end})" if request.layer_end else "state"
    return f"this node holds no {which} after {request.steps_done} steps"
