"""Link probes: a stream of throwaway bytes whose receiver only counts them, so the sender can time the link.

Both the Stage and the Coordinator service answer Probe by counting it (`ProbeCount`); the sender builds its stream with
`probe_chunks`. The first chunk declares the total, checked against a cap before anything more is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import RefusalLog
from geotrain.protocol.framing import CHUNK_BYTES, FrameError

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


class ProbeCount:
    """Counts a probe stream chunk by chunk (from a blocking or an async iterator); add() raises FrameError as soon
    as the stream is oversized or inconsistent, reply() once it ended short or empty."""

    def __init__(self, max_bytes: int = MAX_PROBE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.declared: int | None = None
        self.received = 0

    def add(self, chunk: pb.ProbeChunk) -> None:
        """Count one chunk; the first declares the total, checked against the cap before anything more is read."""
        if self.declared is None:
            if chunk.total_bytes > self.max_bytes:
                raise FrameError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"probe of {chunk.total_bytes} bytes exceeds the limit of {self.max_bytes} bytes",
                )
            self.declared = chunk.total_bytes
        elif chunk.total_bytes:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "only the first probe chunk may declare the total")
        self.received += len(chunk.data)
        if self.received > self.declared:
            too_many = f"probe stream carries more than the {self.declared} bytes it declares"
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, too_many)

    def reply(self) -> pb.ProbeReply:
        """The reply to a stream that has ended."""
        if self.declared is None:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "empty probe stream")
        if self.received < self.declared:
            truncated = f"truncated probe stream: got {self.received} of {self.declared} bytes"
            raise FrameError(grpc.StatusCode.DATA_LOSS, truncated)
        return pb.ProbeReply(received_bytes=self.received)


def count_probe(chunks: Iterable[pb.ProbeChunk], max_bytes: int = MAX_PROBE_BYTES) -> pb.ProbeReply:
    """Read a probe stream and reply with its size; raises FrameError if it is empty, oversized or inconsistent."""
    count = ProbeCount(max_bytes)
    for chunk in chunks:
        count.add(chunk)
    return count.reply()


def serve_probe(chunks: Iterable[pb.ProbeChunk], context: grpc.ServicerContext, refusals: RefusalLog) -> pb.ProbeReply:
    """The Probe handler of a sync server: count the stream, or abort with the status count_probe names (refusals
    logs it, rate-limited)."""
    try:
        return count_probe(chunks)
    except FrameError as e:
        refusals.refused(context.peer(), "Probe", "", str(e))
        context.abort(e.code, str(e))
