"""The data plane: activations forward and gradients backward to neighbour stages, compressed per link.

One channel per peer address, one codec state per (peer, direction) so that a codec's state follows the link,
encoded by one thread at a time under that link's own lock and in the order the worker made the tensors (a turn
each: PowerSGD's warm start is the previous encode's factor, and sender threads run in any order), byte counters per link before and
after compression, deadlines that follow each link's measured call times, and
an optional link emulator so that heterogeneous links are real on one machine. A link to a peer nobody can dial
(behind NAT) is the same link sent over the stream that peer opened to this node (node/reverse.py) instead of a call.
A link to a peer that can be dialled runs over a raw tensor stream (protocol/tensorstream.py) when the run's
transport.tensor_stream is "tcp", and by calls when the peer's stream port cannot be reached (said once in the log).
A stream carries no crc32, so the crc32 is computed only for a tensor that goes by a call.

The codec states keep no error-feedback residual: consecutive tensors on a link are different microbatches'
activations (or their gradients), so one microbatch's residual would be added to another sample, a bias rather
than a delayed correction. bench/convergence.py measured topk:0.1 (before its rank-1 base) at +8.3% validation
loss over none with the residual kept on activation gradients and +6.5% without it on either.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import torch

from geotrain.compression import Codec, FeedbackState
from geotrain.compression.policy import LinkEstimate, LinkEstimator
from geotrain.node.reverse import ReverseSender, relay_chunks
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.framing import Buffer
from geotrain.protocol.probe import probe_chunks
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.tensorstream import NoStream, TensorStreamClient
from geotrain.protocol.transport import TlsFiles, call_with_retry, make_channel

log = logging.getLogger(__name__)

ProbeTarget = rpc.StageStub | rpc.CoordinatorStub
"""A stub whose Probe RPC counts a probe stream: a peer's Stage service or the coordinator."""


@dataclass
class LinkStats:
    """Bytes a link carried, before (raw) and after (wire) compression."""

    raw_bytes: int = 0
    wire_bytes: int = 0
    messages: int = 0
    codec: str = ""
    stream_bytes: int = 0  # of wire_bytes, those a raw tensor stream carried (sent only): the rest went by calls


@dataclass(frozen=True)
class Encoded:
    """A tensor encoded for one link, ready to send. `header` carries no crc32 (a raw tensor stream sends none);
    `checked_header`, computed once when a call sends the tensor, does."""

    header: pb.TensorHeader
    payload: Buffer
    raw_bytes: int
    codec: str

    @functools.cached_property
    def checked_header(self) -> pb.TensorHeader:  # noqa: D102
        return framing.with_checksum(self.header, self.payload)


@dataclass(frozen=True)
class Turn:
    """A tensor's place among the encodes of its link (peer, address, direction), taken when the worker made it."""

    link: tuple[str, str, str]
    number: int


# How long an encode waits for the earlier ones of its link: they were queued first, so only a sender that never
# ran them (the node shutting down) keeps it waiting; past this it encodes out of turn rather than hang.
_TURN_WAIT_S = 60.0


@dataclass(frozen=True)
class LinkShape:
    """An emulated link: egress bandwidth (0 = unlimited) and one-way latency."""

    bandwidth_bps: float
    latency_s: float


class LinkEmulator:
    """Delays each message as a link of the given shape would: queued behind earlier messages on the same link for
    its serialisation time at the link's bandwidth, then its latency. Messages on one link pipeline like packets."""

    def __init__(self, shape_for: Callable[[str], tuple[str, LinkShape] | None]) -> None:
        self._shape_for = shape_for  # peer -> (link key, shape), or None for an unshaped link
        self._lock = threading.Lock()
        self._free_at: dict[str, float] = {}

    def delay(self, peer: str, nbytes: int) -> None:
        """Sleep until the message would have arrived at peer."""
        shaped = self._shape_for(peer)
        if shaped is None:
            return
        key, shape = shaped
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at.get(key, now))
            done = start + (nbytes * 8 / shape.bandwidth_bps if shape.bandwidth_bps else 0.0)
            self._free_at[key] = done
        time.sleep(max(0.0, done + shape.latency_s - now))

    def reply(self, peer: str) -> None:
        """Sleep the link's latency once more: the way back of a round trip, whose reply is too small to queue."""
        shaped = self._shape_for(peer)
        if shaped is not None:
            time.sleep(shaped[1].latency_s)


class AdaptiveDeadline:
    """A per-link deadline that follows measured call times: the plan's cap (Plan.call_deadline_s) until a link has
    been measured, then a multiple of its moving average (a slow link is given time, a dead one is noticed quickly,
    a holder that stalls is reported while the step can still go around it)."""

    def __init__(self, floor_s: float = framing.CALL_DEADLINE_FLOOR_S, factor: float = 10.0) -> None:
        self.cap_s, self.floor_s, self.factor = framing.call_deadline_cap_s(pb.Plan()), floor_s, factor
        self._mean: dict[str, float] = {}

    def follow(self, plan: pb.Plan) -> None:
        """Cap the deadlines at what the plan allows."""
        self.cap_s = framing.call_deadline_cap_s(plan)

    def for_peer(self, peer: str) -> float:
        """Deadline for the next call to peer."""
        mean = self._mean.get(peer)
        return self.cap_s if mean is None else min(self.cap_s, max(self.floor_s, self.factor * mean))

    def observe(self, peer: str, seconds: float) -> None:
        """Record how long a call to peer took."""
        previous = self._mean.get(peer)
        self._mean[peer] = seconds if previous is None else 0.8 * previous + 0.2 * seconds


class DataPlane:
    """Sends tensors to peer stages over gRPC."""

    def __init__(
        self,
        token: str,
        node_id: Callable[[], str],
        tls: TlsFiles | None = None,
        emulator: LinkEmulator | None = None,
        on_peer_unavailable: Callable[[str, str], None] | None = None,
        key: NodeKey | None = None,
    ) -> None:
        self._token = token
        self._node_id = node_id
        self._tls = tls
        self._key = key  # signs every stream at its open: the receiver accepts tensors only from the plan's sender
        self._lock = threading.Lock()
        self._stubs: dict[str, rpc.StageStub] = {}
        # address -> direction (or "relay") -> its call, which sends serialized chunks as they are (framing.wire_chunks,
        # reverse.relay_chunks: no protobuf copies)
        self._tensor_calls: dict[str, dict[str, grpc.StreamUnaryMultiCallable]] = {}
        self._channels: dict[str, grpc.Channel] = {}
        # (peer, address, direction) -> (codec name, its state): a new codec on a link starts afresh. Each link's
        # state is read and written only under that link's lock in _codec_locks.
        self._codec_states: dict[tuple[str, str, str], tuple[str, FeedbackState | None]] = {}
        self._codec_locks: dict[tuple[str, str, str], threading.Lock] = defaultdict(threading.Lock)
        # Per link: the next turn to give out (take_turn), and the turn whose encode may run now (in_turn).
        self._turns_given: dict[tuple[str, str, str], int] = defaultdict(int)
        self._turn_now: dict[tuple[str, str, str], int] = defaultdict(int)
        self._turn_changed = threading.Condition(self._lock)
        self._links: dict[str, LinkEstimator] = defaultdict(LinkEstimator)
        self.sent: dict[str, LinkStats] = defaultdict(LinkStats)
        self.received: dict[str, LinkStats] = defaultdict(LinkStats)
        self.deadlines = AdaptiveDeadline()
        self.emulator = emulator
        # Links to peers nobody can dial run over streams those peers open to this node (node.reverse).
        self.reverse = ReverseSender(key, node_id) if key is not None else None
        self._reversed: set[str] = set()
        self._relays: dict[str, pb.RelayRoute] = {}  # peer -> the plan's route through a relay for links to it
        self._on_peer_unavailable = on_peer_unavailable  # (peer, detail): suspicion, reported at the first failure
        self._streams = TensorStreamClient(tls)
        self._tls_streams = tls is not None
        self._use_streams = False  # the run's transport.tensor_stream == "tcp", known once the node has registered
        self._no_stream: set[str] = set()  # addresses whose tensor stream cannot be reached: tensors go by calls
        self._said: dict[str, bool] = {}  # peer -> whether its tensors go over a stream, as the log last said

    def stub(self, address: str) -> rpc.StageStub:
        """The Stage stub for a peer, creating its channel on first use."""
        stub = self._stubs.get(address)  # as every tensor finds it: no lock taken (a dict read is atomic)
        if stub is not None:
            return stub
        with self._lock:
            if address not in self._stubs:
                channel = make_channel(address, self._token, self._node_id, self._tls, self._key)
                self._channels[address] = channel
                self._tensor_calls[address] = {
                    direction: channel.stream_unary(
                        f"/geotrain.v1.Stage/{method}", request_serializer=None,
                        response_deserializer=pb.Ack.FromString,
                    )
                    for direction, method in (("forward", "Forward"), ("backward", "Backward"), ("relay", "Relay"))
                }
                # Last: a stub read without the lock promises its tensor calls.
                self._stubs[address] = rpc.StageStub(channel)
            return self._stubs[address]

    def _tensor_call(self, address: str, name: str) -> grpc.StreamUnaryMultiCallable:
        """The call that sends serialized chunks to the peer at `address`: "forward", "backward" or "relay"."""
        self.stub(address)
        return self._tensor_calls[address][name]

    def take_turn(self, peer: str, address: str, direction: str) -> Turn:
        """The next place among the encodes of the link to `peer` in `direction` (call in the order the tensors are
        made, from one thread)."""
        link = (peer, address, direction)
        with self._lock:
            number = self._turns_given[link]
            self._turns_given[link] += 1
        return Turn(link, number)

    @contextlib.contextmanager
    def in_turn(self, turn: Turn) -> Iterator[None]:
        """Wait until the link's earlier turns are done, then hold this one until the block ends (however it ends):
        encodes run off the worker thread, in the order the worker made their tensors."""
        with self._turn_changed:
            if not self._turn_changed.wait_for(lambda: self._turn_now[turn.link] >= turn.number, _TURN_WAIT_S):
                log.warning("a tensor to %s is encoded out of turn: an earlier one was never sent", turn.link[0])
        try:
            yield
        finally:
            with self._turn_changed:
                self._turn_now[turn.link] = max(self._turn_now[turn.link], turn.number + 1)
                self._turn_changed.notify_all()

    def encode(self, peer: str, address: str, direction: str, codec: Codec, tensor: torch.Tensor) -> Encoded:
        """Encode a tensor for the link to `peer` in `direction`; encodes on one link run one at a time, in the order
        their callers take the link's lock (in_turn fixes that order). Codec none's payload is the tensor's own
        memory on the CPU: the caller keeps the tensor unchanged until it is sent."""
        key = (peer, address, direction)
        with self._lock:
            link_lock = self._codec_locks[key]
        with link_lock:
            with self._lock:
                if key not in self._codec_states or self._codec_states[key][0] != codec.name:
                    self._codec_states[key] = (codec.name, codec.new_state(error_feedback=False))
                state = self._codec_states[key][1]
            payload = codec.encode(tensor, state)
        dtype, shape = tensor.dtype, tensor.shape  # each torch attribute read once: a send's Python runs cache-cold
        header = framing.make_header("", dtype, shape, codec.codec_id, payload, checksum=False)
        return Encoded(header, payload, math.prod(shape) * dtype.itemsize, codec.name)

    def send(self, peer: str, address: str, direction: str, ref: pb.MicrobatchRef, encoded: Encoded) -> None:
        """Send one encoded tensor to node `peer` at `address`, to its Forward ("forward") or Backward ("backward")
        RPC."""
        payload = encoded.payload
        with self._lock:
            reversed_link = peer in self._reversed
            route = self._relays.get(peer)
        # The link estimate counts the emulated delay from before its queue, as a real call's time counts waiting behind
        # earlier messages: the estimator tells the wait and the latency from the wire's time.
        began = started = time.monotonic()
        if self.emulator is not None:
            self.emulator.delay(peer, len(payload))
            started = time.monotonic()
        deadline = self.deadlines.for_peer(peer)
        suspect = None
        if self._on_peer_unavailable is not None:
            # Through a relay, the relay is the node that did not answer: its receiver is not suspected.
            blamed = route.relay_id if route is not None else peer
            suspect = lambda e: self._on_peer_unavailable(blamed, e.details() or "unavailable")  # noqa: E731
        if reversed_link:
            assert self.reverse is not None
            header = encoded.checked_header
            call = lambda: self.reverse.send(peer, direction, ref, header, payload, deadline)  # noqa: E731
        elif route is not None:
            assert self._key is not None
            header = encoded.checked_header  # the relay's signature covers it: the crc32 goes end to end
            chunks = lambda: relay_chunks(self._key, self._node_id(), peer, direction, ref, header, payload)  # noqa: E731
            relay = self._tensor_call(route.relay_address, "relay")
            call = lambda: relay(chunks(), timeout=deadline)  # noqa: E731
        else:
            call = lambda: self._send_direct(peer, address, direction, ref, encoded, deadline)  # noqa: E731
        if self._use_streams and (reversed_link or route is not None):
            how = "over the stream it opened" if reversed_link else f"through relay {route.relay_id}"
            self._say(peer, False, f"tensors to {peer} go by gRPC calls, not a raw tensor stream: {how}")
        # Only a direct link's call answers True: its raw tensor stream carried the tensor (the others, None or an Ack).
        streamed = call_with_retry(call, on_unavailable=suspect) is True
        done = time.monotonic()
        self.deadlines.observe(peer, done - started)
        with self._lock:
            self._links[peer].observe(len(payload), began, done)
            stats = self.sent[peer]
            stats.raw_bytes += encoded.raw_bytes
            stats.wire_bytes += len(payload)
            stats.messages += 1
            stats.codec = encoded.codec
            stats.stream_bytes += len(payload) if streamed else 0

    def _send_direct(
        self, peer: str, address: str, direction: str, ref: pb.MicrobatchRef, encoded: Encoded, deadline: float
    ) -> bool:
        """Send to a peer that can be dialled: over its raw tensor stream when the run uses them and there is one
        (True: its header without a crc32), else by calling its Forward or Backward (False: with one)."""
        stub = self.stub(address)
        if self._use_streams and address not in self._no_stream:
            ticket = lambda: stub.OpenTensorStream(pb.TensorStreamRequest(), timeout=deadline)  # noqa: E731
            try:
                self._streams.send(
                    address, ticket, framing.DIRECTIONS[direction], ref, encoded.header, encoded.payload, deadline
                )
                if self._said.get(peer) is not True:  # as nearly every tensor finds it: no line made
                    tls = " (TLS)" if self._tls_streams else ""
                    self._say(peer, True, f"tensors to {peer} go over a raw tensor stream{tls}")
                return True
            except NoStream as e:
                if e.lasting:
                    with self._lock:
                        self._no_stream.add(address)
                    self._say(peer, False, f"tensors to {peer} go by gRPC calls, not a raw tensor stream: {e}",
                              logging.WARNING)
                else:
                    log.debug("a tensor to %s goes by a call: %s", peer, e)
        chunks = framing.wire_chunks(encoded.checked_header, encoded.payload, ref)
        self._tensor_call(address, direction)(chunks, timeout=deadline)
        return False

    def _say(self, peer: str, streamed: bool, line: str, level: int = logging.INFO) -> None:
        """Log `line` when what the log last said of tensors to `peer` (over a stream, or by calls: `streamed`)
        changes."""
        if self._said.get(peer) == streamed:  # as nearly every tensor finds it: no lock taken
            return
        with self._lock:
            told = self._said.get(peer) == streamed
            self._said[peer] = streamed
        if not told:
            log.log(level, line)

    def use_tensor_streams(self, enabled: bool) -> None:
        """Send to peers that can be dialled over raw tensor streams (the run's transport.tensor_stream is "tcp")."""
        self._use_streams = enabled

    def estimate(self, peer: str) -> LinkEstimate | None:
        """The measured bandwidth and latency of the link to peer, or None before the first call."""
        with self._lock:
            return self._links[peer].estimate() if peer in self._links else None

    def probe(self, peer: str, target: ProbeTarget, nbytes: int, timeout_s: float) -> float:
        """Seconds for a probe of nbytes to reach peer, through the link emulator as tensors go, and its reply to
        return; raises grpc.RpcError when the call fails."""
        started = time.monotonic()
        if self.emulator is not None:
            self.emulator.delay(peer, nbytes)
        target.Probe(probe_chunks(nbytes), timeout=timeout_s)
        if self.emulator is not None:
            self.emulator.reply(peer)
        seconds = time.monotonic() - started
        if nbytes == 0:
            with self._lock:
                self._links[peer].probed(seconds)
        return seconds

    def count_received(self, peer: str, raw_bytes: int, wire_bytes: int) -> None:
        """Record an incoming tensor's sizes."""
        with self._lock:
            stats = self.received[peer]
            stats.raw_bytes += raw_bytes
            stats.wire_bytes += wire_bytes
            stats.messages += 1

    def set_reversed(self, peers: set[str], relays: dict[str, pb.RelayRoute] | None = None) -> None:
        """Send to `peers` over the reverse streams they open (nobody can dial them), to those of `relays` (peer ->
        the plan's route) through their relay (nobody can dial either end), to others by calling."""
        if (peers or relays) and self.reverse is None:
            raise ValueError("reverse links and relays need the node's key: the sender proves it to the receiver")
        with self._lock:
            self._reversed = set(peers)
            self._relays = dict(relays or {})

    def relay_of(self, peer: str) -> str | None:
        """The node id of the relay that links to `peer` run through, or None for a link without one."""
        with self._lock:
            route = self._relays.get(peer)
        return route.relay_id if route is not None else None

    def reset_links(self, keep: set[str]) -> None:
        """Drop codec state (powersgd's warm start) of links to peers no longer in `keep`."""
        with self._lock:
            self._codec_states = {k: v for k, v in self._codec_states.items() if k[0] in keep}

    def link_counters(self) -> list[pb.LinkCounter]:
        """Per-peer counters of what this node sent, for the heartbeat."""
        with self._lock:
            return [
                pb.LinkCounter(peer=peer, raw_bytes=s.raw_bytes, wire_bytes=s.wire_bytes, codec=s.codec,
                               stream_bytes=s.stream_bytes)
                for peer, s in sorted(self.sent.items())
            ]

    def totals(self) -> tuple[int, int]:
        """(bytes sent on the wire, bytes received on the wire) over all links."""
        with self._lock:
            return sum(s.wire_bytes for s in self.sent.values()), sum(s.wire_bytes for s in self.received.values())

    def close(self) -> None:
        """Close every peer channel."""
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()
            self._tensor_calls.clear()
        self._streams.close()

