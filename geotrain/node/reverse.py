"""Reverse links: the data plane's links to a node that nobody can dial, over streams that node opens.

A node behind NAT (the coordinator's dial-back at registration reached it nowhere) is the receiving end of the links
from its neighbours: the previous stage sends it activations, the next stage gradients. It opens a Stage.Reverse
stream to each of them (`ReverseReceiver`); the neighbour (`ReverseSender`) sends over that stream what it would have
sent with Forward and Backward, and the receiver answers each delivery with the status that call would have had.

The contract is a direct link's: the same chunks, size limits and checks against the plan (the sender proves its
plan key by signing the receiver's nonce, so each tensor is bound to its sender as a signed call binds it), the same
codecs, and the sender's deadlines, retries on UNAVAILABLE and failure reports, which see `ReverseError` as they see a
failed call.

Relays: when neither end of a link can be dialled, both dial a relay the plan names (a node that can be dialled). The
sender calls Stage.Relay there (`relay_chunks`), the relay forwards the tensor over the Reverse stream the receiver
opened to it (`ReverseSender.send` with the sender as its origin) and answers with the receiver's status. The relay
proves its own key on that stream, and every tensor it forwards carries its sender's signature over the tensor
(`relayed_message`), which the receiver checks against the plan's key for that sender: a relay cannot forge or alter
what it forwards unnoticed. Nor replay it: what is signed holds the tensor's plan epoch, step, microbatch and
direction, which the receiver checks against its plan and step, and a tensor the receiver took once is not taken
again (its second delivery is answered as taken: the sender's retry of a tensor whose answer was lost is one).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import (
    DIRECTION_NAMES, DIRECTIONS, Buffer, FrameError, ReceivedTensor, WireCarrier, WireChunk,
)
from geotrain.protocol.identity import NodeKey, verify
from geotrain.protocol.transport import StatusError, TlsFiles, make_channel, status_code

log = logging.getLogger(__name__)

_NONCE_BYTES = 32
_RECONNECT_MAX_S = 2.0
_CHUNK_FIELD = pb.ReverseDown.DESCRIPTOR.fields_by_name["chunk"].number
_RELAY_CHUNK_FIELD = pb.RelayChunk.DESCRIPTOR.fields_by_name["chunk"].number
# A delivery's chunk data is left where gRPC received it, until the receiver copies it into its tensor.
_parse_down = framing.carrier_parser(pb.ReverseDown)


def serialize_down(down: pb.ReverseDown | bytes) -> bytes:
    """Stage.Reverse's response serializer: a delivery's messages come serialized already (ReverseSender.send builds
    them with one copy of the tensor's bytes), the opening proof as a message."""
    return down if isinstance(down, bytes) else down.SerializeToString()

Deliver = Callable[[str, Iterator[WireChunk], bytes, str, Callable[[ReceivedTensor], None] | None], None]
"""(direction, one tensor's chunks, the sender's key, its address, a check of the whole tensor before it is decoded
or None) -> None: read, check and take the tensor as the Stage service would (StageServicer.receive); FrameError when
it is refused."""


def proof_message(nonce: bytes, receiver: str, sender: str) -> bytes:
    """What a sender signs to open a reverse stream: the receiver's nonce and both ends' ids."""
    return b"geotrain reverse link\n" + nonce + f"\n{receiver}\n{sender}".encode()


def relayed_message(
    origin: str, receiver: str, direction: int, ref: pb.MicrobatchRef, header: pb.TensorHeader, payload: Buffer,
) -> bytes:
    """What the sender of a relayed tensor signs: both ends' ids, the direction and digests of the tensor (its crc32
    is no defence against a relay that alters it on purpose)."""
    digests = b"".join(
        hashlib.sha256(part).digest()
        for part in (ref.SerializeToString(deterministic=True), header.SerializeToString(deterministic=True), payload)
    )
    return b"geotrain relayed tensor\n" + f"{origin}\n{receiver}\n{direction}\n".encode() + digests


def relay_chunks(
    key: NodeKey, sender: str, receiver: str, direction: str, ref: pb.MicrobatchRef, header: pb.TensorHeader,
    payload: Buffer,
) -> Iterator[bytes]:
    """A Stage.Relay call's stream, serialized (a request_serializer of None sends it as it is): one tensor for
    `receiver`, signed by `sender`'s key, each chunk's data copied once (framing.nested_chunk)."""
    wire = DIRECTIONS[direction]
    signature = key.sign(relayed_message(sender, receiver, wire, ref, header, payload))
    for i, (head, data) in enumerate(framing.wire_chunk_parts(header, payload, ref)):
        fields = pb.RelayChunk(receiver=receiver, direction=wire, signature=signature) if i == 0 else pb.RelayChunk()
        yield framing.nested_chunk(fields.SerializeToString(), _RELAY_CHUNK_FIELD, head, data)


class _Replayed(Exception):
    """A relayed tensor this node took already."""


class _RelayedCheck:
    """The check of one relayed tensor before it is decoded: its origin's signature over it, and that this node has
    not taken it already."""

    def __init__(self, receiver: ReverseReceiver, relay: str, origin: str, key: bytes, first: WireCarrier) -> None:
        self._receiver, self._relay, self._origin, self._key = receiver, relay, origin, key
        self.direction, self.signature = first.direction, first.signature
        self.ref: pb.MicrobatchRef | None = None  # the tensor's, once its signature held

    def __call__(self, received: ReceivedTensor) -> None:
        message = relayed_message(self._origin, self._receiver.node_id(), self.direction, received.ref,
                                  received.header, received.payload)
        if not verify(self._key, self.signature, message):
            raise FrameError(grpc.StatusCode.PERMISSION_DENIED,
                             f"a tensor relayed by {self._relay} does not carry {self._origin}'s signature: refused")
        if self._receiver.has_taken(self.signature):
            raise _Replayed
        self.ref = received.ref


class ReverseError(StatusError):
    """A delivery over a reverse stream failed, with the status its Forward or Backward call would have had."""


@dataclass
class _Delivery:
    seq: int
    downs: list[bytes]  # its ReverseDown messages, serialized (serialize_down sends them as they are)
    done: futures.Future = field(default_factory=futures.Future)  # (status code, detail) from the receiver's ack


class _Stream:
    """One open reverse stream at the sender: deliveries waiting to go, and those waiting for their ack."""

    def __init__(self) -> None:
        self.outbox: queue.Queue[_Delivery | None] = queue.Queue()
        self._pending: dict[int, _Delivery] = {}
        self._lock = threading.Lock()
        self._closed = ""

    def put(self, delivery: _Delivery) -> bool:
        """Queue a delivery; False once the stream is closed."""
        with self._lock:
            if self._closed:
                return False
            self._pending[delivery.seq] = delivery
        self.outbox.put(delivery)
        return True

    def acked(self, ack: pb.ReverseAck) -> None:
        """The receiver's answer to one delivery (one it no longer waits for, or never sent, is ignored)."""
        with self._lock:
            delivery = self._pending.pop(ack.seq, None)
        if delivery is not None:
            delivery.done.set_result((status_code(ack.code), ack.detail[:1000]))

    def forget(self, seq: int) -> None:
        """Stop waiting for a delivery's ack (its sender gave up)."""
        with self._lock:
            self._pending.pop(seq, None)

    def close(self, why: str) -> None:
        """Fail what waits for an ack with UNAVAILABLE (the sender retries on a new stream), and end the stream."""
        with self._lock:
            if self._closed:
                return
            self._closed = why
            pending, self._pending = list(self._pending.values()), {}
        for delivery in pending:
            delivery.done.set_result((grpc.StatusCode.UNAVAILABLE, why))
        self.outbox.put(None)


class ReverseSender:
    """The sending end of reverse links: the streams that unreachable neighbours opened to this node, by their id."""

    def __init__(self, key: NodeKey, node_id: Callable[[], str]) -> None:
        self._key = key
        self._node_id = node_id
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._seq = itertools.count(1)
        self.relayed_bytes = 0  # payload bytes this node forwarded as a relay

    def serve(self, peer: str, requests: Iterator[pb.ReverseUp]) -> Iterator[pb.ReverseDown]:
        """This node's side of a Reverse stream that node `peer` opened (the caller checked its key): prove this
        node's key, then send what send() queues for peer, until either end closes; FrameError for a bad opening."""
        first = next(requests, None)
        nonce = first.open.nonce if first is not None and first.WhichOneof("kind") == "open" else b""
        if not 16 <= len(nonce) <= 64:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "a Reverse stream opens with a nonce of 16 to 64 bytes")
        yield pb.ReverseDown(proof=self._key.sign(proof_message(nonce, peer, self._node_id())))
        stream = _Stream()
        with self._cond:
            replaced = self._streams.get(peer)
            self._streams[peer] = stream
            self._cond.notify_all()
        if replaced is not None:
            replaced.close(f"{peer} opened a new reverse stream")
        acks = threading.Thread(target=self._read_acks, args=(stream, requests), name=f"reverse-acks-{peer}", daemon=True)
        acks.start()
        log.info("reverse link to %s open: it cannot be dialled, so it receives over the stream it opened", peer)
        try:
            while (delivery := stream.outbox.get()) is not None:
                yield from delivery.downs
        finally:
            with self._cond:
                if self._streams.get(peer) is stream:
                    del self._streams[peer]
            stream.close(f"the reverse stream from {peer} ended")

    @staticmethod
    def _read_acks(stream: _Stream, requests: Iterator[pb.ReverseUp]) -> None:
        """Hand the receiver's acks to their deliveries until its side ends (anything but an ack is a keepalive)."""
        try:
            for up in requests:
                if up.WhichOneof("kind") == "ack":
                    stream.acked(up.ack)
        except Exception as e:  # noqa: BLE001 - a cancelled or cut stream ends its request iterator with an error
            log.debug("reverse stream ended: %s", e)
        finally:
            stream.close("the receiver closed its reverse stream")

    def send(
        self, peer: str, direction: str, ref: pb.MicrobatchRef, header: pb.TensorHeader, payload: Buffer,
        timeout_s: float, origin: str = "", signature: bytes = b"",
    ) -> None:
        """Deliver one tensor to `peer` over its reverse stream within timeout_s, as a Forward or Backward call would
        (as a relay: one that node `origin` signed); ReverseError with the status such a call would have had
        (UNAVAILABLE: no stream, or it broke)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            # A receiver (re)connecting is given as long as the call itself.
            if not self._cond.wait_for(lambda: peer in self._streams, timeout_s):
                raise ReverseError(grpc.StatusCode.UNAVAILABLE, f"{peer} has no reverse stream open to this node")
            stream = self._streams[peer]
        seq, wire = next(self._seq), DIRECTIONS[direction]
        parts = list(framing.wire_chunk_parts(header, payload, ref))
        downs = []
        for i, (head, data) in enumerate(parts):
            fields = pb.ReverseDown(seq=seq, direction=wire, last=i == len(parts) - 1)
            if i == 0 and origin:
                fields.origin, fields.signature = origin, signature
            downs.append(framing.nested_chunk(fields.SerializeToString(), _CHUNK_FIELD, head, data))
        delivery = _Delivery(seq, downs)
        if not stream.put(delivery):
            raise ReverseError(grpc.StatusCode.UNAVAILABLE, f"the reverse stream from {peer} ended")
        try:
            code, detail = delivery.done.result(timeout=max(0.0, deadline - time.monotonic()))
        except futures.TimeoutError:
            stream.forget(delivery.seq)
            raise ReverseError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if code != grpc.StatusCode.OK:
            raise ReverseError(code, detail)
        if origin:
            with self._cond:
                self.relayed_bytes += len(payload)


class _Deliveries:
    """The deliveries of a Reverse stream, one iterator of chunks each; a delivery read only in part (refused at its
    header) is skipped to its end before the next."""

    def __init__(self, downs: Iterator[WireCarrier]) -> None:
        self._downs = downs

    def __iter__(self) -> Iterator[tuple[WireCarrier, Iterator[WireChunk]]]:
        for first in self._downs:
            chunks = self._chunks(first)
            yield first, chunks
            for _ in chunks:  # what the receiver did not read
                pass

    def _chunks(self, first: WireCarrier) -> Iterator[WireChunk]:
        down = first
        yield down.chunk
        while not down.last:
            down = next(self._downs, None)
            if down is None:
                return  # the stream ended mid-tensor: read_one_tensor reports it truncated
            if down.seq != first.seq:
                raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "reverse deliveries interleave")
            yield down.chunk


class _Link:
    """One reverse stream this node keeps open to a sender while the plan has that sender send to it."""

    def __init__(
        self, receiver: ReverseReceiver, peer: str, address: str, public_key: bytes, origins: dict[str, bytes]
    ) -> None:
        self.peer, self.address, self.public_key = peer, address, public_key
        self.origins = origins  # nodes whose tensors this sender relays (id -> public key), replaced as plans change
        self._receiver = receiver
        self._stopped = threading.Event()
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name=f"reverse-{peer}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the stream and stop reopening it."""
        self._stopped.set()
        call = self._call
        if call is not None:
            call.cancel()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopped.is_set():
            try:
                if self._serve_once():
                    backoff = 0.1
            except (grpc.RpcError, FrameError) as e:
                detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
                if not self._stopped.is_set():
                    log.debug("reverse link from %s at %s: %s; reopening", self.peer, self.address, detail)
            except Exception:  # noqa: BLE001 - the link must outlive a bug in one delivery, or the stage goes deaf
                log.exception("reverse link from %s at %s failed; reopening", self.peer, self.address)
            self._stopped.wait(backoff)
            backoff = min(2 * backoff, _RECONNECT_MAX_S)

    def _serve_once(self) -> bool:
        """Open the stream, check the sender's proof, take its deliveries until the stream ends; whether it opened."""
        r = self._receiver
        nonce = os.urandom(_NONCE_BYTES)
        acks: queue.Queue[pb.ReverseUp | None] = queue.Queue()

        def ups() -> Iterator[pb.ReverseUp]:
            yield pb.ReverseUp(open=pb.ReverseOpen(nonce=nonce))
            while True:
                try:
                    up = acks.get(timeout=r.keepalive_s())
                except queue.Empty:
                    up = pb.ReverseUp()  # a keepalive: the sender's server cuts silent request streams
                if up is None:
                    return
                yield up

        channel = make_channel(self.address, r.token, r.node_id, r.tls, r.key)
        try:
            self._call = call = channel.stream_stream(
                "/geotrain.v1.Stage/Reverse", request_serializer=pb.ReverseUp.SerializeToString,
                response_deserializer=_parse_down,
            )(ups())
            if self._stopped.is_set():
                return False
            downs = iter(call)
            opening = next(downs, None)
            if opening is None:
                return False
            if not verify(self.public_key, opening.proof, proof_message(nonce, r.node_id(), self.peer)):
                log.warning("%s at %s did not prove the key the plan gives it: reverse link refused", self.peer,
                            self.address)
                return False
            log.info("reverse link from %s at %s open", self.peer, self.address)
            for first, chunks in _Deliveries(downs):
                acks.put(pb.ReverseUp(ack=self._take(first, chunks)))
            return True
        finally:
            acks.put(None)
            if self._call is not None:
                self._call.cancel()
            channel.close()

    def _take(self, first: WireCarrier, chunks: Iterator[WireChunk]) -> pb.ReverseAck:
        """Take one delivery as the Stage service takes a call (a relayed one as its origin's, once its signature
        holds); the ack says what its status would have been."""
        seq, name = first.seq, DIRECTION_NAMES.get(first.direction)
        if name is None:
            return pb.ReverseAck(seq=seq, code=grpc.StatusCode.INVALID_ARGUMENT.value[0], detail="unknown direction")
        key, relayed = self.public_key, None
        try:
            if first.origin:
                key = self.origins.get(first.origin)
                if key is None:
                    raise FrameError(grpc.StatusCode.PERMISSION_DENIED,
                                     f"this node's plan relays nothing from {first.origin[:100]!r} through {self.peer}")
                relayed = _RelayedCheck(self._receiver, self.peer, first.origin, key, first)
            self._receiver.deliver(name, chunks, key, self.address, relayed)
        except _Replayed:
            return pb.ReverseAck(seq=seq)  # it had its effect once
        except FrameError as e:
            return pb.ReverseAck(seq=seq, code=e.code.value[0], detail=str(e))
        if relayed is not None and relayed.ref is not None:
            self._receiver.taken(relayed.signature, relayed.ref)
        return pb.ReverseAck(seq=seq)


class ReverseReceiver:
    """The receiving end of reverse links: a stream to each sender the plan gives this node, reopened while it does."""

    def __init__(
        self, token: str, node_id: Callable[[], str], tls: TlsFiles | None, key: NodeKey, deliver: Deliver,
        keepalive_s: Callable[[], float],
    ) -> None:
        self.token, self.node_id, self.tls, self.key = token, node_id, tls, key
        self.deliver = deliver
        self.keepalive_s = keepalive_s  # seconds between keepalives: well within the senders' idle-stream cut
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        # The signatures of the relayed tensors taken, by their (plan epoch, step); only those of the newest epoch's
        # last two steps are kept: the plan and step checks refuse anything older (they let in the validation of step
        # k while step k + 1 trains).
        self._taken: dict[bytes, tuple[int, int]] = {}

    def has_taken(self, signature: bytes) -> bool:
        """Whether a relayed tensor with this signature was taken already."""
        with self._lock:
            return signature in self._taken

    def taken(self, signature: bytes, ref: pb.MicrobatchRef) -> None:
        """Note a relayed tensor taken."""
        with self._lock:
            self._taken[signature] = (ref.plan_epoch, ref.step)
            epoch, step = max(self._taken.values())
            self._taken = {s: (e, t) for s, (e, t) in self._taken.items() if e == epoch and t + 1 >= step}

    def follow(self, senders: dict[str, tuple[str, bytes]], relayed: dict[str, dict[str, bytes]] | None = None) -> None:
        """Keep a stream open to each of `senders` (node id -> (address, public key)), and none to others; a sender
        that is a relay forwards tensors of the nodes `relayed` names for it (relay id -> {node id: public key})."""
        with self._lock:
            for peer in list(self._links):
                link = self._links[peer]
                if senders.get(peer) != (link.address, link.public_key):
                    link.stop()
                    del self._links[peer]
            for peer, (address, public_key) in senders.items():
                origins = dict((relayed or {}).get(peer, {}))
                if peer in self._links:
                    self._links[peer].origins = origins
                else:
                    self._links[peer] = _Link(self, peer, address, public_key, origins)

    def close(self) -> None:
        """Close every stream."""
        self.follow({})
