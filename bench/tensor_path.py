"""The tensor path's cost: CPU and wall time to move a 1 MiB float32 activation between two processes on loopback.

Five paths, one JSON line each (path, cpu_ms_per_mib, wall_ms_per_mib, messages):
- "geotrain": a node's DataPlane (codec none, encode and send: framing, the run token's proof, the key's signature,
  deadline) to a receiving process's Stage server with the real StageServicer (auth and limits interceptors, the
  header checked against the plan's shape, dtype, codec and the sender's key before the payload is read, size and
  checksum, decoded to a tensor and the finiteness check), answered by its Ack;
- "geotrain-tcp": the same DataPlane and servicer with the raw tensor stream (transport.tensor_stream = "tcp",
  protocol/tensorstream.py): the connection opened once with a ticket from a signed OpenTensorStream call, then per
  tensor its frame (the same header, checked against the plan before the payload is read), the payload read into the
  tensor the node takes (its decode; no crc32 on a stream) and the finiteness check, answered by a status reply;
- "grpc-stream" and "grpc-unary": gRPC alone, the floor of any path through it: the tensor's bytes (one copy, as
  gRPC sends bytes it owns) as the only message of a stream call (as Forward sends a one-chunk tensor) or as a unary
  call's request, on a channel and a server without interceptors and with the transport's message limits, taken
  unchecked as a view;
- "raw": the physical reference, a plain TCP socket: the sender writes an 8-byte length and the tensor's bytes from
  its own memory, the receiver reads them into a buffer it reuses and views them as a tensor, and answers one byte.

cpu_ms_per_mib is the CPU time (user + system, every thread) of both processes together over the timed messages,
each process measuring its own with time.process_time; wall_ms_per_mib is the sender's time per message, one
message at a time, from the tensor in memory to the receiver's answer. The receiver is a helper process driven line
by line (bench/control_plane.py's HelperProcess). Each path runs --runs times (3), the runs taking turns; its line is
the run of median CPU, with every run's CPU per MiB. Run: python bench/tensor_path.py [--messages N] [--paths P,Q]

Measured on 2 shared cores, 200 messages: geotrain 12.0 ms of CPU per MiB before #18 (protobuf's copies, a bytes copy
of the reassembled payload, torch's finiteness check), 6.3 after, against raw's 0.78 (8x; the issue's goal is 3x).
With the bare gRPC paths, 300 messages: geotrain 3.80, grpc-stream 2.16, grpc-unary 2.18, raw 0.79 on a quiet
machine; 5.76, 3.03, 3.72, 0.95 on a busier one (the same code gave geotrain 6.6-7.4 while other runs shared the
cores: compare lines of one run). The goal's 3x is 2.36 ms on the quiet run, and gRPC alone is 2.75x raw there (3.2x
on the busier), so no path through gRPC meets it, whatever it checks. What geotrain adds to the stream call (1.64
ms) was crc32 on both ends (0.43 ms each with zlib 1.2.13; adler32 and blake3 cost the same here), the copy out of
the tensor, the auth and the key's signature on each call, the decode's copy into a writable tensor and the
finiteness check. A unary call costs no less CPU than a one-message stream (it saves wall time only), and channel
options measured in one process (HTTP/2 frames up to 16 MiB, a 16 MiB flow-control window and lookahead, BDP probing
off, optimization_target "throughput") moved the floor by less than the run-to-run noise (1.8-2.4 ms unary, 2.8-4.3
stream). Meeting 3x takes the tensor bytes off gRPC: a raw stream authenticated by the gRPC call, with TLS when the
run has it.

This version (#33: zlib-ng's crc32, no copy of the tensor at either end: sent from its memory, received into the
tensor the node takes; the finiteness check one sum; the link estimator's fit stopped at its fixed point), 200
messages, three runs, lock held, on a busy machine (the runs of one path spread by up to 0.23 ms):
  {"path": "geotrain", "cpu_ms_per_mib": 3.062, "wall_ms_per_mib": 3.197, "messages": 200, "cpu_ms_per_mib_runs": [3.062, 2.808, 3.076]}
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.953, "wall_ms_per_mib": 0.765, "messages": 200, "cpu_ms_per_mib_runs": [0.738, 0.97, 0.953]}
  {"path": "grpc-stream", "cpu_ms_per_mib": 1.952, "wall_ms_per_mib": 1.461, "messages": 200, "cpu_ms_per_mib_runs": [2.161, 1.952, 1.85]}
  {"path": "grpc-unary", "cpu_ms_per_mib": 1.983, "wall_ms_per_mib": 1.787, "messages": 200, "cpu_ms_per_mib_runs": [1.983, 1.965, 2.012]}
  {"path": "raw", "cpu_ms_per_mib": 0.438, "wall_ms_per_mib": 0.362, "messages": 200, "cpu_ms_per_mib_runs": [0.367, 0.531, 0.438]}
A second run (--paths geotrain-tcp,raw), the machine slower again:
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.772, "wall_ms_per_mib": 0.593, "messages": 200, "cpu_ms_per_mib_runs": [0.772, 0.772, 0.746]}
  {"path": "raw", "cpu_ms_per_mib": 0.492, "wall_ms_per_mib": 0.43, "messages": 200, "cpu_ms_per_mib_runs": [0.483, 0.623, 0.492]}
geotrain-tcp is 2.18x and 1.57x raw in these two, 1.86x (0.696 against 0.374) in one before the reply was made once:
short of the issue's 1.5x. The version before, the same day (--paths geotrain,geotrain-tcp,raw): geotrain-tcp 1.251
against raw's 0.368 (3.4x), geotrain 2.852. What geotrain-tcp still adds to raw, per process (its own CPU, 300
messages, before the reply was made once): the sender 0.387 ms against 0.207 (the Python of encode and
DataPlane.send, the crc32 pass, the frame, the reply read in two reads, the polls of a socket with a timeout where
raw's blocks), the receiver 0.302 against 0.160 (a new tensor for each message, the crc32 and the finiteness sum, one
pass each over the MiB, the frame's two reads, the polls). Reverse and relayed links (nodes behind NAT) still go
through gRPC, which now receives into the tensor too.

Where the rest went (#33, --paths geotrain-tcp,raw, lock held, each line the median of three runs): that code
0.776 and 0.743 ms of CPU per MiB against raw's 0.417 and 0.379; with both crc32s patched out 0.652 (raw 0.367);
without the finiteness sum too 0.578 (raw 0.405); the receiver reading into one reused tensor instead of a new one
each time 0.734 (raw 0.391), no gain. A TLS stream's receiver skipped its crc32 (TLS authenticated every byte).

This version (#33: a raw tensor stream carries no crc32, at either end, PROTOCOL_VERSION 16: TCP's checksum covers
its one hop, TLS's MACs every byte, and calls keep theirs; the finiteness check one C pass over the exponent bits,
compression/_blockquant.c; frame and payload in one sendmsg, the socket's timeout set only when the deadline moves),
200 messages, three runs, lock held (the version before printed geotrain-tcp 0.891 and raw 0.425 the same morning,
2.1x, --paths geotrain-tcp,raw):
  {"path": "geotrain", "cpu_ms_per_mib": 3.024, "wall_ms_per_mib": 3.417, "messages": 200, "cpu_ms_per_mib_runs": [2.944, 3.161, 3.024]}
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.705, "wall_ms_per_mib": 0.542, "messages": 200, "cpu_ms_per_mib_runs": [0.71, 0.705, 0.543]}
  {"path": "grpc-stream", "cpu_ms_per_mib": 2.044, "wall_ms_per_mib": 3.017, "messages": 200, "cpu_ms_per_mib_runs": [1.735, 2.3, 2.044]}
  {"path": "grpc-unary", "cpu_ms_per_mib": 2.047, "wall_ms_per_mib": 1.852, "messages": 200, "cpu_ms_per_mib_runs": [2.049, 2.047, 1.09]}
  {"path": "raw", "cpu_ms_per_mib": 0.414, "wall_ms_per_mib": 0.363, "messages": 200, "cpu_ms_per_mib_runs": [0.414, 0.397, 0.454]}
geotrain-tcp is 1.70x raw: short of the issue's 1.5x. A run of the first commit of it, a quieter machine: 0.660
against 0.355 (1.86x). Versions measured in turns, --messages 1000 (lock held): with the crc32s 0.754 and 0.818,
without them 0.693 and 0.741 (raw 0.39-0.42 in both); then 0.665 and 0.671 against 0.700 and 0.549 for the one
sendmsg, raw 0.35-0.42: the runs of one path spread wider than that change.

Where geotrain-tcp's CPU above raw's goes now (perf, cpu-clock at 4 kHz over the steady state of 15,000 and 20,000
messages, before the one sendmsg; ms per MiB, 0.766 against 0.522 there): the sender's Python +0.070 (encode,
DataPlane.send, whose link estimator refits its window of 32 calls on every call, about 10 us of the 23 a send's
Python takes in a hot loop, and the frame), the receiver's Python +0.047, torch's per-op dispatch +0.031 (the codec's
view of the tensor, the new tensor the payload is read into), the finiteness pass 0.024 (the first read of the
payload after the kernel's copy: torch's sum, second after the crc32, took 0.012), protobuf 0.019, libc 0.015, the
kernel +0.031 (a poll before each socket call under a timeout, an ioctl for each settimeout). Python costs here about
three times what a hot loop measures: each MiB the kernel copies through a core's 2 MiB L2 evicts the interpreter's
working set. 1.5x (0.2 ms over raw for both processes' Python, checks and system calls) needs about half of that
Python gone.
A reverse link's sender (a receiver behind NAT) now serializes each delivery itself, the tensor's bytes copied once
(framing.nested_chunk), where its chunks, its ReverseDown messages and gRPC's serializer copied them three times:
building and serializing a 1 MiB delivery took 1.508 and 1.556 ms of CPU, now 0.046 and 0.045 (one process, lock
held; not a path of this bench). Relayed links still copy through protobuf.

This version (#33: a stream's socket without TLS blocks, each call bounded by the kernel's SO_RCVTIMEO/SO_SNDTIMEO,
where a python timeout polled before every call, and reads with MSG_WAITALL; codec none's encode one numpy view; the
link estimator refitted every 8 calls, not every call; fewer torch calls per received tensor; 62 Python calls per
sent tensor where there were 77), --paths geotrain-tcp,raw, 200 messages, lock held, three invocations in a row:
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.616, "wall_ms_per_mib": 0.513, "messages": 200, "cpu_ms_per_mib_runs": [0.624, 0.591, 0.616]}
  {"path": "raw", "cpu_ms_per_mib": 0.39, "wall_ms_per_mib": 0.315, "messages": 200, "cpu_ms_per_mib_runs": [0.566, 0.388, 0.39]}
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.53, "wall_ms_per_mib": 0.565, "messages": 200, "cpu_ms_per_mib_runs": [0.598, 0.393, 0.53]}
  {"path": "raw", "cpu_ms_per_mib": 0.414, "wall_ms_per_mib": 0.334, "messages": 200, "cpu_ms_per_mib_runs": [0.414, 0.383, 0.496]}
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.612, "wall_ms_per_mib": 0.489, "messages": 200, "cpu_ms_per_mib_runs": [0.582, 0.687, 0.612]}
  {"path": "raw", "cpu_ms_per_mib": 0.489, "wall_ms_per_mib": 0.389, "messages": 200, "cpu_ms_per_mib_runs": [0.565, 0.489, 0.367]}
A fourth, right after:
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.505, "wall_ms_per_mib": 0.583, "messages": 200, "cpu_ms_per_mib_runs": [0.624, 0.393, 0.505]}
  {"path": "raw", "cpu_ms_per_mib": 0.422, "wall_ms_per_mib": 0.426, "messages": 200, "cpu_ms_per_mib_runs": [0.403, 0.422, 0.46]}
geotrain-tcp is 1.58x, 1.28x, 1.25x and 1.20x raw (the issue's goal is 1.5x). The runs of one path spread by up to 0.29
ms on this shared machine (geotrain-tcp's twice at raw's 0.39: the kernel's share of a transfer moves between the two
ends with their timing), and raw's own sender spends a sixth of its user time in python's garbage collector.
Per process (os.times and /proc, 4000 messages, lock held), us of CPU per message, user and system: geotrain-tcp's
sender 85-107 and 248-282, receiver 107-145 and 122-140; raw's 30-50 and 172-252, 27-47 and 110-148. What is left
above raw is user time: the finiteness pass (about 28 us of the receiver's) and some 45 Python calls on each end,
each a few us as it runs cache-cold after the payload's copy. On the merged head, the machine otherwise quiet, three
invocations: geotrain-tcp 0.562, 0.614 and 0.607 against raw 0.417, 0.421 and 0.404 (1.35x, 1.46x and 1.50x).

This version (#33: a plain stream's socket calls in C, geotrain/protocol/_streamio.c, each releasing the GIL: the
receiver's frame read in one call and its payload in another, the sender's frame, payload and reply in one; python's
socket methods where it is not built). Main's code two hours before, three invocations, lock held: geotrain-tcp
0.787, 0.683, 0.676 against raw 0.549, 0.42, 0.45 (1.43x, 1.63x, 1.50x). perf of it (cpu-clock at 2 kHz, 3000
messages, us of CPU per message, both ends): the interpreter 140 against raw's 43, the kernel 401 against 355, the
finiteness pass 24.5, torch 45 against 25, protobuf 17, libc 19 against 6, numpy 6 against 1. This version, three
invocations, lock held:
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.688, "wall_ms_per_mib": 0.556, "messages": 200, "cpu_ms_per_mib_runs": [0.688, 0.699, 0.635]}
  {"path": "raw", "cpu_ms_per_mib": 0.514, "wall_ms_per_mib": 0.413, "messages": 200, "cpu_ms_per_mib_runs": [0.514, 0.466, 0.534]}
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.721, "wall_ms_per_mib": 0.566, "messages": 200, "cpu_ms_per_mib_runs": [0.664, 0.721, 0.825]}
  {"path": "raw", "cpu_ms_per_mib": 0.519, "wall_ms_per_mib": 0.412, "messages": 200, "cpu_ms_per_mib_runs": [0.506, 0.519, 0.535]}
  {"path": "geotrain-tcp", "cpu_ms_per_mib": 0.716, "wall_ms_per_mib": 0.542, "messages": 200, "cpu_ms_per_mib_runs": [0.732, 0.673, 0.716]}
  {"path": "raw", "cpu_ms_per_mib": 0.504, "wall_ms_per_mib": 0.408, "messages": 200, "cpu_ms_per_mib_runs": [0.507, 0.472, 0.504]}
geotrain-tcp is 1.34x, 1.39x and 1.42x raw: under the issue's 1.5x in each, by less than the spread of one path's runs.
In turns with main's code, the same hour (--runs 1 --messages 600, lock held; both processes' threads on one core,
on a core each, or left to the scheduler; geotrain-tcp, raw, ratio):
  one core:   main 0.471 0.466 1.01, 0.501 0.414 1.21;  this 0.478 0.471 1.01, 0.483 0.465 1.04
  a core each: main 0.729 0.526 1.39, 0.725 0.499 1.45;  this 0.795 0.848 0.94, 0.785 0.641 1.22
  free:       main 0.689 0.504 1.37, 0.714 0.476 1.50;  this 0.700 0.494 1.42, 0.704 0.516 1.36
No difference outside the noise: the C calls take out some 10 Python calls per tensor of about 60, where what is left
above raw is spread over the rest (the plan's checks, the tensor's creation and its finiteness pass, the data plane's
bookkeeping), and on one core geotrain-tcp already costs what raw costs. perf (as above, one run of each, in turns):
main's code 731 us of CPU per message (the interpreter 155, the socket module 5), this 706 (the interpreter 143, the
C calls 2), 0.024 ms per MiB less, about 5% of raw's CPU. The bench as it is, main's code and this in turns, three
invocations each, lock held: main geotrain-tcp 0.713, 0.696, 0.717 against raw 0.517, 0.449, 0.518 (1.38x, 1.55x,
1.38x); this 0.714, 0.692, 0.687 against 0.483, 0.495, 0.519 (1.48x, 1.40x, 1.32x). Under 1.5x in six invocations of
this head out of six, by 0.02-0.18x: not the margin the issue asks, since raw's runs alone spread by 0.07 ms.
The links of nodes behind NAT, not paths of this bench (one process, lock held, the median of three runs of 300): a
reverse link's 1 MiB delivery parsed and read into a new tensor took 0.389 ms of CPU parsed by protobuf, 0.182 now
(framing.carrier_parser leaves the chunk's data where gRPC put it); a relay call's chunks for 1 MiB, the signature's
sha256 included, 2.479 ms as protobuf messages, 0.783 now (relay_chunks serialized around the data, copied once).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import numpy as np
import torch

from geotrain.compression import get_codec
from geotrain.node.dataplane import DataPlane
from geotrain.node.reverse import ReverseSender
from geotrain.node.servicer import StageServicer, add_stage_service, check_activation_header
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import RefusalLog, new_token
from geotrain.protocol.framing import FrameError
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.limits import PeerLimits
from geotrain.protocol.tensorstream import TensorStreamServer
from geotrain.protocol.transport import MAX_MESSAGE_BYTES, make_server

from control_plane import HelperProcess  # a sibling: run as bench/tensor_path.py

SHAPE = (8, 128, 256)  # 1 MiB of float32: a microbatch of 8 x 128 tokens at width 256
MIB = 1 << 20
SENDER, RECEIVER = "node-1", "node-2"
_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_LENGTH = struct.Struct("<Q")


class _Receiver:
    """The receiving node's side of the Stage service: tensors from SENDER, signed by its key, of SHAPE in float32
    and codec none, checked as a node checks them (servicer.check_activation_header); tensor streams for that key."""

    def __init__(self, sender_key: bytes) -> None:
        self.sender_key = sender_key
        self.received = 0

    def check_incoming(self, direction, ref, header, signer) -> None:  # noqa: ANN001, D102
        if signer != self.sender_key or list(ref.path) != [SENDER]:
            raise FrameError(grpc.StatusCode.PERMISSION_DENIED, "not signed by the sender's key")
        check_activation_header(header, list(SHAPE), pb.DTYPE_FLOAT32, {pb.CODEC_NONE}, 64 * MIB)

    def accept(self, direction, ref, tensor, wire_bytes) -> None:  # noqa: ANN001, D102
        if tuple(tensor.shape) != SHAPE:
            raise RuntimeError(f"decoded shape {tuple(tensor.shape)}")
        self.received += 1

    def may_overflow(self, direction) -> bool:  # noqa: ANN001, D102
        return False

    def check_tensor_stream(self, signer) -> None:  # noqa: ANN001, D102
        if signer != self.sender_key:
            raise FrameError(grpc.StatusCode.PERMISSION_DENIED, "not the sender's key")


def _serve_geotrain(token: str, sender_key_hex: str, streams: bool) -> tuple[str, Callable[[], int]]:
    """A Stage server with the real servicer, and with `streams` its tensor streams; its address and a count of
    tensors taken (over the streams only, with `streams`)."""
    receiver = _Receiver(bytes.fromhex(sender_key_hex))
    limits = PeerLimits()
    server, port = make_server(token, "127.0.0.1:0", limits)
    reverse = ReverseSender(NodeKey.generate(), lambda: RECEIVER)
    tensor_streams = TensorStreamServer("127.0.0.1", 0, None, limits, 64 * MIB) if streams else None
    servicer = StageServicer(receiver, 64 * MIB, True, RefusalLog(), reverse, tensor_streams)
    add_stage_service(servicer, server)
    server.start()
    if tensor_streams is None:
        # The count's closure holds the server: a grpc.Server stops when it is collected.
        return f"127.0.0.1:{port}", lambda: server and receiver.received
    tensor_streams.start(servicer)
    # A tensor sent by a call would count too: only a stream that stayed open counts what it took.
    return f"127.0.0.1:{port}", lambda: server and (receiver.received if tensor_streams.open_connections() else 0)


def _serve_raw() -> tuple[str, Callable[[], int]]:
    """A TCP server that takes length-prefixed tensors into one reused buffer and acks each with one byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = [0]

    def serve() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(MIB)
        view = memoryview(buf)
        length = bytearray(_LENGTH.size)
        while conn.recv_into(length, _LENGTH.size, socket.MSG_WAITALL) == _LENGTH.size:
            (n,) = _LENGTH.unpack(length)
            if n != MIB:
                raise RuntimeError(f"message of {n} bytes")
            filled = 0
            while filled < n:
                filled += conn.recv_into(view[filled:n])
            tensor = torch.frombuffer(buf, dtype=torch.float32).view(SHAPE)
            if tensor.shape != SHAPE:
                raise RuntimeError("bad shape")
            received[0] += 1
            conn.sendall(b"\x01")

    threading.Thread(target=serve, daemon=True).start()
    return "127.0.0.1:%d" % listener.getsockname()[1], lambda: received[0]


def _serve_bare_grpc() -> tuple[str, Callable[[], int]]:
    """A gRPC server without interceptors whose methods take one tensor's bytes, unchecked: Stream as the only
    message of a stream call (as Forward takes a one-chunk tensor), Unary as a unary call's request."""
    received = [0]

    def take(message: bytes) -> bytes:
        if len(message) != MIB:
            raise RuntimeError(f"message of {len(message)} bytes")
        np.frombuffer(message, dtype=np.float32).reshape(SHAPE)  # a view, as raw's receiver makes one
        received[0] += 1
        return b""

    def take_stream(messages, context) -> bytes:  # noqa: ANN001
        for message in messages:
            take(message)
        return b""

    methods = {
        "Stream": grpc.stream_unary_rpc_method_handler(take_stream),
        "Unary": grpc.unary_unary_rpc_method_handler(lambda message, context: take(message)),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bare", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return f"127.0.0.1:{port}", lambda: server and received[0]


_SERVERS = {
    "geotrain": lambda token, key: _serve_geotrain(token, key, streams=False),
    "geotrain-tcp": lambda token, key: _serve_geotrain(token, key, streams=True),
    "grpc-stream": lambda token, key: _serve_bare_grpc(),
    "grpc-unary": lambda token, key: _serve_bare_grpc(),
    "raw": lambda token, key: _serve_raw(),
}


def receiver_main(path: str, token: str, sender_key_hex: str) -> None:
    """The receiving process: prints its address, then answers "cpu" with its CPU seconds and the tensors taken."""
    address, received = _SERVERS[path](token, sender_key_hex)
    print(json.dumps({"address": address}), flush=True)
    for line in sys.stdin:
        if line.strip() == "cpu":
            print(json.dumps({"cpu_s": time.process_time(), "received": received()}), flush=True)


def _geotrain_sender(
    address: str, token: str, key: NodeKey, streams: bool
) -> tuple[Callable[[torch.Tensor], None], Callable[[], None]]:
    """Send one tensor as a node sends an activation: encoded for the link, then DataPlane.send (over a tensor stream
    with `streams`)."""
    plane = DataPlane(token, lambda: SENDER, key=key)
    plane.use_tensor_streams(streams)
    codec = get_codec("none")
    ref = pb.MicrobatchRef(plan_epoch=1, step=0, microbatch=0, path=[SENDER])

    def send(tensor: torch.Tensor) -> None:
        plane.send(RECEIVER, address, "forward", ref, plane.encode(RECEIVER, address, "forward", codec, tensor))

    return send, plane.close


def _bare_grpc_sender(address: str, unary: bool) -> tuple[Callable[[torch.Tensor], None], Callable[[], None]]:
    """Send one tensor's bytes on a channel without interceptors, as a stream call's only message (as Forward sends
    a one-chunk tensor) or as a unary call: gRPC's own cost, which no path through it goes below."""
    channel = grpc.insecure_channel(address, options=_GRPC_OPTIONS)
    method = "Unary" if unary else "Stream"
    call = getattr(channel, "unary_unary" if unary else "stream_unary")(
        f"/bench.Bare/{method}", request_serializer=None, response_deserializer=None
    )

    def send(tensor: torch.Tensor) -> None:
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()  # gRPC sends bytes it owns
        call(data if unary else iter([data]), timeout=60)

    return send, channel.close


def _raw_sender(address: str) -> tuple[Callable[[torch.Tensor], None], Callable[[], None]]:
    """Send one tensor's bytes from its own memory over a TCP socket and wait for the one-byte answer."""
    host, port = address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)

    def send(tensor: torch.Tensor) -> None:
        data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
        conn.sendall(_LENGTH.pack(len(data)))
        conn.sendall(data)
        if conn.recv_into(ack, 1, socket.MSG_WAITALL) != 1:
            raise RuntimeError("the receiver closed the connection")

    return send, conn.close


def measure(path: str, messages: int, warmup: int) -> dict[str, object]:
    """Send `messages` 1 MiB activations over `path` after `warmup` untimed ones; its JSON line."""
    token, key = new_token(), NodeKey.generate()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    receiver = HelperProcess([sys.executable, __file__, "--receive", path, token, key.public.hex()], env)
    try:
        assert receiver.proc.stdout is not None
        address = json.loads(receiver.proc.stdout.readline())["address"]
        senders = {
            "geotrain": lambda: _geotrain_sender(address, token, key, streams=False),
            "geotrain-tcp": lambda: _geotrain_sender(address, token, key, streams=True),
            "grpc-stream": lambda: _bare_grpc_sender(address, unary=False),
            "grpc-unary": lambda: _bare_grpc_sender(address, unary=True),
            "raw": lambda: _raw_sender(address),
        }
        send, close = senders[path]()
        tensor = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
        for _ in range(warmup):
            send(tensor)
        before = receiver.ask("cpu")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(messages):
            send(tensor)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        after = receiver.ask("cpu")
        close()
        if after["received"] - before["received"] != messages:
            raise RuntimeError(f"{path}: the receiver took {after['received'] - before['received']} of {messages}")
    finally:
        receiver.close()
    mib = messages * tensor.numel() * tensor.element_size() / MIB
    cpu_s = (cpu1 - cpu0) + (after["cpu_s"] - before["cpu_s"])
    return {
        "path": path,
        "cpu_ms_per_mib": round(cpu_s * 1e3 / mib, 3),
        "wall_ms_per_mib": round((wall1 - wall0) * 1e3 / mib, 3),
        "messages": messages,
    }


def main() -> None:
    """Print one JSON line per path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200, help="timed messages per path (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed messages first (default 20)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each path; the median's line (default 3)")
    parser.add_argument("--paths", default=",".join(_SERVERS), help=f"comma-separated, of {', '.join(_SERVERS)}")
    parser.add_argument("--receive", nargs=3, metavar=("PATH", "TOKEN", "SENDER_KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.receive:
        receiver_main(*args.receive)
        return
    paths = args.paths.split(",")
    if unknown := [path for path in paths if path not in _SERVERS]:
        parser.error(f"--paths: unknown {', '.join(unknown)}")
    # Runs take turns path by path, so that a change in the machine's load touches every path alike.
    runs = [[measure(path, args.messages, args.warmup) for path in paths] for _ in range(args.runs)]
    for lines in zip(*runs):
        print(json.dumps(median_line(list(lines))), flush=True)


def median_line(lines: list[dict[str, object]]) -> dict[str, object]:
    """One path's runs as one line: the run of median CPU per MiB, with every run's CPU per MiB."""
    median = sorted(lines, key=lambda line: line["cpu_ms_per_mib"])[len(lines) // 2]
    return {**median, "cpu_ms_per_mib_runs": [line["cpu_ms_per_mib"] for line in lines]}


if __name__ == "__main__":
    main()
