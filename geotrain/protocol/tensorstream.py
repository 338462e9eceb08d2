"""Raw tensor streams: activations and gradients to a node that can be dialled, over a TCP connection of their own.

gRPC alone costs 2.75x a raw socket's CPU per MiB (bench/tensor_path.py), so the tensor bytes of a direct link leave
it: the sender keeps a TCP connection to the receiver (TLS with the run's files when the run has them) and writes
each tensor as a TensorFrame (direction, ref, header: what a Forward or Backward call's first chunk carries) followed
by its payload; the receiver answers each with a TensorStreamReply, the status the call would have had. The control
messages stay on gRPC.

Opening. The sender calls Stage.OpenTensorStream on the receiver, and gets the port the receiver listens on and a
ticket: 32 random bytes, good for one connection within TICKET_TTL_S. It connects, sends the ticket, and the
connection belongs to the key that signed the call, for its lifetime. A ticket rather than a proof on the stream
(the token's MAC and the key's signature over a nonce the receiver chose): the call already carries the run-token
proof, the key's signature, the replay guard, the per-peer limits and TLS, the same as every call, so the stream
inherits them all instead of a second implementation of each; the ticket travels only inside that call (encrypted
when the run has TLS), and the port with it, so only the plan's neighbours that asked with their keys learn it, and
what the coordinator announces stays as it is. A ticket that is unknown, used or expired closes the connection.

Each tensor's header is checked before its payload is read: its limits here (framing.check_header), then the
receiver's plan (the sink's `admit`, the check a call's first chunk gets, with the connection's key as the call's
signer). A tensor refused by the plan is answered at once, and its payload skipped without being kept; a header
that breaks the limits, a malformed frame, a stream cut mid-tensor or one silent mid-tensor for limits.idle_stream_s
end the connection. An uncompressed payload is read straight into the tensor the node is handed (the sink's
`destination`: pinned memory for a CUDA node), which is its decode; any other into a buffer the connection reuses, to
be decoded by the sink into a tensor of its own (codecs copy out of what they decode). The sink checks the decode
(its size, and that it holds no NaN or Inf) before the node takes it.

No crc32: a stream's header carries 0 and its payload is not checksummed at either end. A stream is one TCP
connection between the two nodes, never relayed: TCP's checksum covers every segment end to end and each link's CRC
its hop, and under TLS every record's MAC authenticates every byte; the crc32 checked the same bytes once more at
both ends, two passes over each tensor (about 0.06 ms of CPU per MiB of the 0.7 the stream costs:
bench/tensor_path.py). It protects against no sender, who can write any crc32 it likes. Calls keep theirs
(DataPlane computes it only when a tensor goes by one): a relayed tensor crosses two hops and the relay, and its
signature covers the crc32.

The sender keeps one connection per receiver and opens another only while the ones it has are busy (sends to one
peer from several threads at once, as concurrent calls would be), each used by one send at a time: no connection is
read and written by two threads at once, which python's ssl does not allow. A kept connection that turns out to be
closed is replaced once, silently, as gRPC reconnects a channel for its next call.
"""

from __future__ import annotations

import logging
import secrets
import socket
import ssl
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import Buffer, FrameError, ReceivedTensor
from geotrain.protocol.limits import PeerLimits, TokenBuckets
from geotrain.protocol.tls import RUN_TLS_NAME, TlsFiles, ssl_context
from geotrain.protocol.transport import StatusError, status_code

try:
    # A plain socket's receive and send in one C call each (setup.py builds it where a C compiler is found); else
    # python's socket methods, in the loops below.
    from geotrain.protocol import _streamio
except ImportError:
    _streamio = None

log = logging.getLogger(__name__)

TICKET_BYTES = 32
TICKET_TTL_S = 60.0
MAX_FRAME_BYTES = 64 << 10  # a hello, frame or reply: headers only, never a payload
CONNECT_TIMEOUT_S = 5.0
_HANDSHAKE_S = 2.0  # a connection says its hello (TLS included) within this, or is closed
# Connections that have not said their hello yet, from one host and from all: past either, the oldest such
# connection of that host (of the host holding the most) is closed to make room. A neighbour says its hello within
# a round trip of connecting, so whoever holds slots open without a ticket cannot keep it out.
_MAX_OPENING = 64
_OPENING_PER_HOST = 8
# New connections one host may open a second (and at once): past these they are closed as they are accepted, with
# no thread, so that reopening what the rule above closed costs the node little. A sender keeps its connections
# and opens at most 8 to one receiver.
_ACCEPTS_PER_HOST_S = 20.0
_ACCEPT_BURST = 64
_DISCARD_BYTES = 1 << 16
_LENGTH = struct.Struct("<I")
_OK = grpc.StatusCode.OK.value[0]

M = TypeVar("M", bound=Message)
T = TypeVar("T")


class Closed(Exception):
    """The other end closed the connection, or cut it short."""


def recv_into(sock: socket.socket, view: memoryview, idle_ok: bool = False) -> None:
    """Fill `view` from sock; Closed at the end of the stream. With idle_ok, timeouts before the first byte are waited
    out (a kept connection between tensors); any other raises socket.timeout. A socket without TLS is asked for all
    of it at once (MSG_WAITALL: on a blocking socket, one system call however many segments the bytes came in), in
    one C call where _streamio is built."""
    if _in_c(sock):
        filled = _streamio.recv_exact(sock.fileno(), view, idle_ok)
    else:  # python's ssl takes no flags
        filled = _recv_loop(sock, view, idle_ok, 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL)
    if filled < len(view):
        raise Closed(f"the stream ended {len(view) - filled} bytes short" if filled else "the stream ended")


def _in_c(sock: socket.socket) -> bool:
    """Whether _streamio reads `sock`: built, and the socket blocks (bounded by the kernel's timeouts, where a python
    timeout makes it non-blocking) without TLS (whose records python's ssl reads)."""
    return _streamio is not None and sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket)


def _recv_loop(sock: socket.socket, view: memoryview, idle_ok: bool, flags: int) -> int:
    """recv_into's python: the bytes filled, fewer only where the stream ended."""
    filled, n = 0, len(view)
    while filled < n:
        try:
            got = sock.recv_into(view[filled:] if filled else view, 0, flags)
        except (socket.timeout, BlockingIOError):  # the latter: a blocking socket's kernel timeout (bound_calls)
            if idle_ok and filled == 0:
                continue
            raise socket.timeout("timed out") from None
        if not got:
            break
        filled += got
    return filled


def _tune(sock: socket.socket) -> None:
    """Small writes go at once (a reply, a frame before its payload); a peer that vanished without closing is noticed
    within about a minute (TCP keepalive, as gRPC's channels ping), not kept forever."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


def bound_calls(sock: socket.socket, seconds: float) -> None:
    """Bound each of `sock`'s sends and receives by `seconds` (> 0). A socket without TLS is made blocking and bounded
    in the kernel (SO_SNDTIMEO, SO_RCVTIMEO: recv_into raises socket.timeout past it, a send BlockingIOError): a python
    timeout polls the socket before every call, a system call each. A TLS socket, which python's ssl drives through
    its own timeout, gets that."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    microseconds = max(1, round(seconds * 1e6))
    value = _TIMEVAL.pack(microseconds // 1_000_000, microseconds % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _framed(message: Message) -> bytes:
    """One length-prefixed message, as it goes on the stream."""
    data = message.SerializeToString()
    return _LENGTH.pack(len(data)) + data


def write_message(sock: socket.socket, message: Message) -> None:
    """Send one length-prefixed message."""
    sock.sendall(_framed(message))


_OK_REPLY = _framed(pb.TensorStreamReply(code=_OK))


def read_message(sock: socket.socket, kind: type[M], idle_ok: bool = False) -> M:
    """Read one length-prefixed message of `kind`; FrameError when it is too long or malformed. One C call where
    _streamio reads the socket (as recv_into's)."""
    if _in_c(sock):
        data = _from_c(_streamio.recv_message, sock.fileno(), MAX_FRAME_BYTES, idle_ok)
    else:
        prefix = bytearray(_LENGTH.size)
        recv_into(sock, memoryview(prefix), idle_ok)
        (length,) = _LENGTH.unpack(prefix)
        if length > MAX_FRAME_BYTES:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"a message of {length} bytes on a tensor stream")
        data = bytearray(length)
        if length:  # an OK reply is empty
            recv_into(sock, memoryview(data))
    return _parse(kind, data)


def _from_c(read: Callable[..., T], *args: object) -> T:
    """`read(*args)`, a _streamio call that reads a message, raising what read_message's python raises: Closed at the
    stream's end, FrameError for a length over the limit."""
    try:
        return read(*args)
    except EOFError as e:
        raise Closed(str(e)) from None
    except ValueError as e:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def _parse(kind: type[M], data: Buffer) -> M:
    """A message of `kind` from its bytes; FrameError when they are not one."""
    try:
        return kind.FromString(data)
    except DecodeError as e:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {kind.__name__}: {e}") from None


def reply(sock: socket.socket, code: grpc.StatusCode, detail: str = "") -> None:
    """Send a TensorStreamReply: the status of a hello, a tensor, or a state stream."""
    if code == grpc.StatusCode.OK and not detail:
        sock.sendall(_OK_REPLY)  # every tensor taken: made once
        return
    write_message(sock, pb.TensorStreamReply(code=code.value[0], detail=detail[:1000]))


class TensorSink(Protocol):
    """What a tensor stream hands its tensors to (the Stage service's checks and its node)."""

    def admit(self, direction: str, ref: pb.MicrobatchRef, header: pb.TensorHeader, key: bytes) -> None:
        """Raise FrameError unless the node's plan expects this tensor from the node whose key is `key`, before its
        payload is read."""

    def destination(self, header: pb.TensorHeader) -> torch.Tensor | None:
        """The tensor an admitted header's payload is read straight into, when that payload is its own decode
        (framing.Destination); None: into the connection's buffer."""

    def take(self, direction: str, received: ReceivedTensor) -> None:
        """Decode the tensor (into memory of its own: the payload's buffer is reused; a payload read into its
        destination is received.tensor) and hand it to the node; FrameError when it is refused."""

    def refused(self, peer: str, direction: str, why: str) -> None:
        """Note a refused tensor from `peer` (as gRPC names one: "ipv4:HOST:PORT")."""


class TensorStreamServer:
    """The receiving end: listens on host:port, hands out tickets, and reads each connection in a thread of its own."""

    def __init__(
        self, host: str, port: int, tls: TlsFiles | None, limits: PeerLimits, max_tensor_bytes: int
    ) -> None:
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self.port: int = self._listener.getsockname()[1]
        self._context = ssl_context(tls, server=True) if tls is not None else None
        self._limits = limits
        self._max_bytes = max_tensor_bytes
        self._sink: TensorSink | None = None
        self._lock = threading.Lock()
        self._tickets: dict[bytes, tuple[bytes, float, Serve | None]] = {}  # ticket -> (key, expiry, serve)
        self._open: dict[bytes, int] = defaultdict(int)  # key -> its connections
        self._connections: set[socket.socket] = set()
        self._opening: dict[str, list[socket.socket]] = defaultdict(list)  # host -> its pre-hello, oldest first
        self._accepts = TokenBuckets(_ACCEPTS_PER_HOST_S, _ACCEPT_BURST)
        self._closed = False

    def start(self, sink: TensorSink) -> None:
        """Accept connections, whose tensors go to `sink`."""
        self._sink = sink
        threading.Thread(target=self._accept_loop, name="tensor-streams", daemon=True).start()

    def ticket(self, key: bytes, serve: Serve | None = None) -> bytes:
        """A ticket for one connection of `key` (the caller checked that key), whose tensors come in, or which
        `serve` is handed once past its hello (a state stream); FrameError (RESOURCE_EXHAUSTED) when the key holds as
        many connections and tickets as limits.streams_per_peer."""
        now = time.monotonic()
        with self._lock:
            self._tickets = {t: v for t, v in self._tickets.items() if v[1] > now}
            held = self._open[key] + sum(k == key for k, *_ in self._tickets.values())
            if held >= self._limits.values.streams_per_peer:
                raise FrameError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"{held} tensor streams already open or opening for this key"
                )
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._tickets[ticket] = (key, now + TICKET_TTL_S, serve)
        return ticket

    def open_connections(self) -> int:
        """Connections past their hello, every key together."""
        with self._lock:
            return sum(self._open.values())

    def _redeem(self, ticket: bytes) -> tuple[bytes, Serve | None] | None:
        """The key a ticket was given to, counted as one of its connections, and what serves it; None for a ticket
        unknown, used or expired."""
        with self._lock:
            key, expiry, serve = self._tickets.pop(ticket, (None, 0.0, None))
            if key is None or expiry <= time.monotonic():
                return None
            self._open[key] += 1
            return key, serve

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError:
                return  # closed
            host, port = address[:2]
            peer = f"ipv6:[{host}]:{port}" if sock.family == socket.AF_INET6 else f"ipv4:{host}:{port}"
            with self._lock:
                if self._closed or not self._accepts.take(host):
                    sock.close()
                    continue
                self._make_room(host)
                self._opening[host].append(sock)
                self._connections.add(sock)
            threading.Thread(target=self._serve, args=(sock, peer, host), name="tensor-stream", daemon=True).start()

    def _make_room(self, host: str) -> None:
        """Close pre-hello connections (the oldest first) until `host` has fewer than _OPENING_PER_HOST and all hosts
        together fewer than _MAX_OPENING. Under the lock."""
        while True:
            if len(self._opening[host]) >= _OPENING_PER_HOST:
                crowded = host
            elif sum(map(len, self._opening.values())) >= _MAX_OPENING:
                crowded = max(self._opening, key=lambda h: len(self._opening[h]))
            else:
                return
            oldest = self._opening[crowded].pop(0)
            try:  # its thread sees the end and closes it
                oldest.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _said_hello(self, host: str, raw: socket.socket) -> None:
        with self._lock:
            opening = self._opening.get(host)
            if opening is not None and raw in opening:
                opening.remove(raw)
            if not opening:
                self._opening.pop(host, None)

    def _serve(self, sock: socket.socket, peer: str, host: str) -> None:
        """One connection from `peer` (as gRPC names one): its hello, then its tensors until it ends."""
        raw, key = sock, None
        try:
            try:
                sock.settimeout(_HANDSHAKE_S)
                _tune(sock)
                if self._context is not None:
                    sock = self._context.wrap_socket(sock, server_side=True)
                    with self._lock:  # the wrapped socket owns the connection now: close() ends it through this one
                        self._connections.discard(raw)
                        self._connections.add(sock)
                ticket = read_message(sock, pb.TensorStreamHello).ticket
            finally:
                self._said_hello(host, raw)
            redeemed = self._redeem(ticket)
            if redeemed is None:
                self._limits.refusals.refused(peer, "tensor stream", "", "an unknown, used or expired ticket")
                reply(sock, grpc.StatusCode.UNAUTHENTICATED, "an unknown, used or expired ticket")
                return
            key, serve = redeemed
            reply(sock, grpc.StatusCode.OK)
            if serve is not None:
                serve(sock)
            else:
                self._tensors(sock, peer, key)
        except (OSError, Closed, FrameError) as e:  # ssl.SSLError and socket.timeout are OSErrors
            log.debug("tensor stream from %s ended: %s", peer, e)
        finally:
            with self._lock:
                self._connections.discard(sock)
                self._connections.discard(raw)
                if key is not None:
                    self._open[key] -= 1
                    if not self._open[key]:
                        del self._open[key]
            sock.close()

    def _tensors(self, sock: socket.socket, peer: str, key: bytes) -> None:
        """Read, check and hand over tensors until the connection ends (Closed) or breaks a limit."""
        assert self._sink is not None
        sink, buffer, idle = self._sink, bytearray(), 0.0
        while True:
            idle_s = self._limits.values.idle_stream_s
            if idle_s != idle:  # setting it costs system calls, whatever it was
                bound_calls(sock, idle_s)
                idle = idle_s
            frame = read_message(sock, pb.TensorFrame, idle_ok=True)
            header, direction = frame.header, framing.DIRECTION_NAMES.get(frame.direction, "")
            try:
                framing.check_header(header, self._max_bytes)
            except FrameError as e:
                # A payload over the limits is not read, even to skip it: the connection ends.
                sink.refused(peer, direction or "tensor stream", str(e))
                reply(sock, e.code, str(e))
                return
            size = header.payload_bytes
            try:
                if not direction:
                    raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown direction {frame.direction}")
                sink.admit(direction, frame.ref, header, key)
            except FrameError as e:
                sink.refused(peer, direction or "tensor stream", str(e))
                reply(sock, e.code, str(e))
                _skip(sock, size)
                continue
            tensor = sink.destination(header)
            if tensor is not None:
                payload = framing.byte_view(tensor)
            else:
                if len(buffer) < size:
                    buffer = bytearray(size)
                payload = memoryview(buffer)[:size]
            try:
                recv_into(sock, payload)
            except Closed as e:
                why = f"truncated tensor stream: {e}"
                sink.refused(peer, direction, why)
                reply(sock, grpc.StatusCode.DATA_LOSS, why)
                return
            try:
                sink.take(direction, ReceivedTensor(ref=frame.ref, header=header, payload=payload, tensor=tensor))
            except FrameError as e:
                sink.refused(peer, direction, str(e))
                reply(sock, e.code, str(e))
                continue
            reply(sock, grpc.StatusCode.OK)

    def close(self) -> None:
        """Stop listening and end every connection."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (closing alone does not, on Linux)
        except OSError:
            pass  # never accepted
        self._listener.close()
        for sock in connections:
            try:
                # The TCP connection itself, under TLS too: its reader sees the end (ssl's own shutdown would unhook
                # the TLS layer from under that thread).
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass  # already gone


def _skip(sock: socket.socket, size: int) -> None:
    """Read and drop `size` bytes of a refused tensor's payload, a piece at a time."""
    scratch = memoryview(bytearray(min(size, _DISCARD_BYTES)))
    while size:
        piece = scratch[: min(size, len(scratch))]
        recv_into(sock, piece)
        size -= len(piece)


class NoStream(Exception):
    """No tensor stream to a receiver: send this tensor by calling it. `lasting`: none ever will be (its port cannot
    be reached, or it serves none), so every tensor to it goes by calls."""

    def __init__(self, why: str, lasting: bool) -> None:
        super().__init__(why)
        self.lasting = lasting


class _Connection:
    """One open tensor stream at the sender, used by one send at a time. Without TLS its socket blocks, bounded by
    the kernel's timeouts (bound_calls), so that a tensor is one system call out and one back: with _streamio, the
    two in one C call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._exchange = not isinstance(sock, ssl.SSLSocket) and _streamio is not None
        if self._exchange:
            sock.settimeout(None)  # blocking, bounded by the kernel's timeouts that exchange sets before each call
        self._timeout = 0.0  # what the socket's operations are bounded by now; 0: not yet set

    def send(self, frame: bytes, payload: Buffer, deadline: float) -> pb.TensorStreamReply:
        """Write one tensor and read its reply by `deadline` (time.monotonic, within a tenth of the time left);
        socket.timeout past it, OSError or Closed when the connection broke."""
        sock = self.sock
        head = _LENGTH.pack(len(frame)) + frame
        if self._exchange:
            data, self._timeout = _from_c(
                _streamio.exchange, sock.fileno(), head, payload, deadline, self._timeout, MAX_FRAME_BYTES
            )
            return _parse(pb.TensorStreamReply, data)
        self._bound(deadline)
        if isinstance(sock, ssl.SSLSocket):  # python's ssl has no sendmsg
            sock.sendall(head)
            sock.sendall(payload)
        else:  # frame and payload in one system call, which returns short only at the timeout
            try:
                sent = sock.sendmsg((head, payload))
                view = memoryview(payload).cast("B")
                if sent < len(head) + len(view):
                    self._send_rest(head[sent:], deadline)
                    self._send_rest(view[max(0, sent - len(head)) :], deadline)
            except BlockingIOError:  # the kernel's timeout, nothing sent
                raise socket.timeout("timed out") from None
        self._bound(deadline)
        return read_message(sock, pb.TensorStreamReply)

    def _send_rest(self, view: Buffer, deadline: float) -> None:
        """Send what a write left, each call bounded by the time left (as a python timeout bounds sendall)."""
        view = memoryview(view)
        while view:
            self._bound(deadline)
            view = view[self.sock.send(view) :]

    def _bound(self, deadline: float) -> None:
        """Bound the socket's operations by the time left to `deadline`; setting it costs system calls, so one set
        within a tenth of that is kept."""
        left = max(1e-3, deadline - time.monotonic())
        if not 0.9 * self._timeout <= left <= 1.1 * self._timeout:
            bound_calls(self.sock, left)
            self._timeout = left

    def close(self) -> None:
        self.sock.close()


TicketCall = Callable[[], pb.TensorStreamTicket]
"""Stage.OpenTensorStream (or OpenStateStream) on the node that serves the stream, signed by the caller's key; raises
grpc.RpcError."""

Serve = Callable[[socket.socket], None]
"""What serves a connection past its hello in place of reading tensors from it (a state stream's sender)."""


class TensorStreamClient:
    """The sending end: connections kept per receiver address, opened with a ticket from the receiver."""

    def __init__(self, tls: TlsFiles | None) -> None:
        self._context = ssl_context(tls, server=False) if tls is not None else None
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Connection]] = defaultdict(list)
        self._closed = False

    def send(
        self, address: str, open_ticket: TicketCall, direction: int, ref: pb.MicrobatchRef, header: pb.TensorHeader,
        payload: Buffer, timeout_s: float,
    ) -> None:
        """Deliver one tensor to the Stage service at `address` within timeout_s, as a Forward or Backward call
        would; StatusError with the status such a call would have had, NoStream when there is no stream to it."""
        deadline = time.monotonic() + timeout_s
        frame = pb.TensorFrame(direction=direction, ref=ref, header=header).SerializeToString()
        with self._lock:
            kept = self._idle[address].pop() if self._idle[address] else None
        conn = kept or self._open(address, open_ticket, deadline)
        try:
            try:
                reply = conn.send(frame, payload, deadline)
            except socket.timeout:
                raise
            except (OSError, Closed, FrameError):
                if kept is None:
                    raise
                # The kept one had closed (its receiver restarted, or ended it after a header it refused): a fresh
                # one, once, as gRPC reconnects a channel for its next call.
                conn.close()
                conn = self._open(address, open_ticket, deadline)
                reply = conn.send(frame, payload, deadline)
        except socket.timeout:
            conn.close()
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (OSError, Closed, FrameError) as e:
            conn.close()
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"the tensor stream to {address} broke: {e}") from None
        with self._lock:
            if self._closed:
                conn.close()
            else:
                self._idle[address].append(conn)
        if reply.code != _OK:
            raise StatusError(status_code(reply.code), reply.detail)

    def _open(self, address: str, open_ticket: TicketCall, deadline: float) -> _Connection:
        """A new connection to the receiver at `address`, past its hello; NoStream when there can be none."""
        return _Connection(dial(address, open_ticket, self._context, deadline))

    def close(self) -> None:
        """Close every kept connection; those in use close when their send ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = [c for conns in self._idle.values() for c in conns], defaultdict(list)
        for conn in idle:
            conn.close()


def dial(address: str, open_ticket: TicketCall, context: ssl.SSLContext | None, deadline: float) -> socket.socket:
    """A new raw stream to the node whose Stage service is at `address`, past its hello (TLS with `context`, when the
    run has it); NoStream when there can be none."""
    try:
        ticket = open_ticket()
    except grpc.RpcError as e:
        # A receiver that serves no tensor streams says so for good; anything else may pass (a plan it has not
        # taken yet, its connections all busy): this tensor goes by a call, the next one tries again.
        serves_none = e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)
        raise NoStream(f"it gives no tensor stream ticket ({e.code().name}: {e.details()})", serves_none) from None
    if not 0 < ticket.port < 65536 or len(ticket.ticket) != TICKET_BYTES:
        raise NoStream(f"it answered a malformed ticket (port {ticket.port})", lasting=True)
    host = address.rpartition(":")[0].strip("[]")
    try:
        sock = socket.create_connection(
            (host, ticket.port), timeout=min(CONNECT_TIMEOUT_S, max(1e-3, deadline - time.monotonic()))
        )
    except OSError as e:
        raise NoStream(f"its tensor stream port {host}:{ticket.port} cannot be reached ({e})", lasting=True) from None
    try:
        _tune(sock)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=RUN_TLS_NAME)
        write_message(sock, pb.TensorStreamHello(ticket=ticket.ticket))
        answer = read_message(sock, pb.TensorStreamReply)
    except ssl.SSLError as e:
        sock.close()
        if isinstance(e, ssl.SSLEOFError):  # cut during the handshake: as below
            raise NoStream(f"its tensor stream {host}:{ticket.port} closed before answering ({e})",
                           lasting=False) from None
        raise NoStream(f"its tensor stream port {host}:{ticket.port} cannot be reached ({e})", lasting=True) from None
    except (OSError, Closed, FrameError) as e:
        # Connected, then cut before the receiver's answer (it made room for newer connections, or restarted):
        # this tensor goes by a call, the next one tries a stream again.
        sock.close()
        raise NoStream(f"its tensor stream {host}:{ticket.port} closed before answering ({e})", lasting=False) from None
    if answer.code != _OK:
        sock.close()
        raise NoStream(f"it refused the tensor stream: {answer.detail[:200]}", lasting=False)
    return sock
