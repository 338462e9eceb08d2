"""A stage's state over a raw tensor stream: a checkpoint's gigabytes off gRPC, at the lowest CPU priority.

Over gRPC a state transfer cost its sender and the coordinator about a second of CPU per GB each (HTTP/2 framing,
protobuf's copies), taken from the training beside them (bench/scale.py). So the coordinator asks a node for a ticket
(Stage.OpenStateStream, signed by its key as FetchState is, carrying the same request), connects to the node's raw
tensor stream port with it (protocol/tensorstream.py: its TLS, its limits), and the node answers with a
TensorStreamReply (the snapshot's status, as FetchState's would be), then each tensor as a TensorFrame carrying its
header followed by its payload, and a TensorFrame without a header at the end. A node that serves no raw streams, or a
holder nobody can dial, is fetched from by FetchState as before.

Both ends run their part at SCHED_IDLE (background_priority): a checkpoint is not urgent, and a pipeline's cores sit
idle between its stages' turns, so the transfer takes those first. The sender copies each chunk out of the snapshot
under its lock and sends it outside it, so the stage's next optimizer step never waits for a thread that the scheduler
holds back.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.framing import CHUNK_BYTES, FrameError, StateSource, WireChunk
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.tensorstream import Closed, NoStream, dial, read_message, recv_into, reply, write_message
from geotrain.protocol.tls import TlsFiles, ssl_context
from geotrain.protocol.transport import make_channel

log = logging.getLogger(__name__)

SEND_IDLE_S = 60.0
"""A receiver that takes nothing for this long is gone (one at the lowest CPU priority may pause for seconds)."""
_END = pb.TensorFrame()
_NO_HEADER = pb.TensorChunk()


def background_priority() -> None:
    """Run the calling thread only when a core would otherwise idle (Linux SCHED_IDLE; elsewhere as it is)."""
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # a system that refuses it: the transfer runs at the priority it has
            pass


def send_state(sock: socket.socket, sources: Iterable[StateSource] | None, unavailable: str) -> None:
    """The sending end: a state stream's status (FAILED_PRECONDITION `unavailable` when `sources` is None), then
    each source as a frame and its payload, then the end frame."""
    sock.settimeout(SEND_IDLE_S)
    if sources is None:
        reply(sock, grpc.StatusCode.FAILED_PRECONDITION, unavailable)
        return
    reply(sock, grpc.StatusCode.OK)
    for source in sources:
        write_message(sock, pb.TensorFrame(header=framing.state_header(source, checksum=False)))
        for offset in range(0, source.nbytes, CHUNK_BYTES):
            sock.sendall(source.read(offset, min(CHUNK_BYTES, source.nbytes - offset)))
    write_message(sock, _END)


def receive_state(sock: socket.socket, deadline: float) -> Iterator[WireChunk]:
    """The receiving end: the stream's tensors as the chunks a state transfer's receiver takes (framing.
    StateReceiver, which checks each header before its payload is taken), each chunk's data a view of a buffer
    reused for the next; LookupError when the node has no such state, the stream breaks or `deadline`
    (time.monotonic) passes. Each header is checked here only for what reading its payload needs."""
    try:
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        status = read_message(sock, pb.TensorStreamReply)
        if status.code != grpc.StatusCode.OK.value[0]:
            raise LookupError(status.detail[:1000])
        buffer = memoryview(bytearray(CHUNK_BYTES))
        while True:
            frame = read_message(sock, pb.TensorFrame)
            if not frame.HasField("header"):
                return
            framing.check_state_header(frame.header)
            frame.header.crc32 = 0  # not checksummed here, whatever the sender wrote (state_header)
            first, left = pb.TensorChunk(header=frame.header), frame.header.payload_bytes
            while first is not None or left:
                data = buffer[: min(left, CHUNK_BYTES)]
                sock.settimeout(max(1e-3, deadline - time.monotonic()))
                recv_into(sock, data)
                left -= len(data)
                yield WireChunk(first if first is not None else _NO_HEADER, data)
                first = None
    except (OSError, Closed, FrameError) as e:  # socket.timeout is an OSError
        raise LookupError(f"the state stream broke: {e}") from None


def fetch_state(
    address: str, token: str, caller_id: str, key: NodeKey, tls: TlsFiles | None, request: pb.FetchStateRequest,
    deadline_s: float,
) -> Iterator[pb.TensorChunk | WireChunk]:
    """The chunks of the state `request` asks of the node whose Stage service is at `address`, as they arrive: over
    its raw tensor stream where it serves one, else by FetchState (the transfer starts at the first read; the
    channel closes with the stream), the calls signed by `key`; LookupError when it cannot be had by the deadline."""
    channel = make_channel(address, token, lambda: caller_id, tls, key)
    stub = rpc.StageStub(channel)
    deadline = time.monotonic() + deadline_s
    try:
        try:
            sock = dial(
                address, lambda: stub.OpenStateStream(request, timeout=deadline_s),
                ssl_context(tls, server=False) if tls is not None else None, deadline,
            )
        except NoStream as e:
            log.debug("the state from %s comes by FetchState: %s", address, e)
            yield from stub.FetchState(request, timeout=max(1e-3, deadline - time.monotonic()))
            return
        try:
            yield from receive_state(sock, deadline)
        finally:
            sock.close()
    except grpc.RpcError as e:
        raise LookupError(f"the state download from {address} failed: {e.code().name} {e.details()}") from None
    finally:
        channel.close()
