"""Link probes: a stream of throwaway bytes whose receiver only counts them, so the sender can time the link.

Both the Stage and the Coordinator service answer Probe with `count_probe`; the sender builds its stream with
`probe_chunks`. The first chunk declares the total, checked against a cap before anything more is read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import grpc

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import CHUNK_BYTES, FrameError

log = logging.getLogger(__name__)

COORDINATOR_PEER = "coordinator"
"""LinkProbe.peer of a node's link to the coordinator."""
# Probes measure links, they carry no data: a few MiB are plenty, and a receiver reads no more than this.
MAX_PROBE_BYTES = 64 << 20


def probe_chunks(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.ProbeChunk]:
    """A probe stream of nbytes zero bytes; the first chunk declares the total."""
    if not 0 <= nbytes <= MAX_PROBE_BYTES:
        raise ValueError(f"a probe carries 0..{MAX_PROBE_BYTES} bytes, got {nbytes}")
    block = bytes(min(chunk_bytes, nbytes))
    yield pb.ProbeChunk(total_bytes=nbytes, data=block)
    for offset in range(chunk_bytes, nbytes, chunk_bytes):
        yield pb.ProbeChunk(data=block[: min(chunk_bytes, nbytes - offset)])


def count_probe(chunks: Iterable[pb.ProbeChunk], max_bytes: int = MAX_PROBE_BYTES) -> pb.ProbeReply:
    """Read a probe stream and reply with its size; raises FrameError if it is empty, oversized or inconsistent."""
    it = iter(chunks)
    first = next(it, None)
    if first is None:
        raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "empty probe stream")
    declared = first.total_bytes
    if declared > max_bytes:
        raise FrameError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"probe of {declared} bytes exceeds the limit of {max_bytes} bytes"
        )
    received = len(first.data)
    for chunk in it:
        if chunk.total_bytes:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "only the first probe chunk may declare the total")
        received += len(chunk.data)
        if received > declared:
            break
    if received > declared:
        raise FrameError(
            grpc.StatusCode.INVALID_ARGUMENT, f"probe stream carries more than the {declared} bytes it declares"
        )
    if received < declared:
        raise FrameError(grpc.StatusCode.DATA_LOSS, f"truncated probe stream: got {received} of {declared} bytes")
    return pb.ProbeReply(received_bytes=received)


def serve_probe(chunks: Iterable[pb.ProbeChunk], context: grpc.ServicerContext) -> pb.ProbeReply:
    """The Probe handler both services share: count the stream, or abort with the status count_probe names."""
    try:
        return count_probe(chunks)
    except FrameError as e:
        log.warning("rejected probe from %s: %s", context.peer(), e)
        context.abort(e.code, str(e))
