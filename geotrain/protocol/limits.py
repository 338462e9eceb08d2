"""What one peer may hold or send at a gRPC server: open streams, call rate, and how long a stream may stay silent.

A peer is a node id (as its call claims it) signed by one key (or by none) from one host: the key is checked by
the auth interceptor before these limits, so a token holder claiming a member's id from the member's host (all of
a local run, or volunteers behind one NAT) spends a budget of its own, never the member's. Every holder of the run
token can open streams, so without these limits a few dozen silent Forward streams hold every worker thread of a
node (grpc's sync server) and the run stops. `PeerLimits` counts per peer and per host; the interceptors wrap each
handler so that a call over a limit is refused with RESOURCE_EXHAUSTED before it runs, and a request stream that
sends nothing for `idle_stream_s` is cut (CANCELLED on a sync server, DEADLINE_EXCEEDED on grpc.aio). Refusals are
logged through auth's RefusalLog: one line per host per interval, never a traceback; on grpc.aio their answers
are held longer the more of a caller's calls were refused (`Backoff`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from geotrain.protocol.auth import MD_KEY, MD_NODE, RefusalLog, peer_host

# Buckets of peers not heard from for a while are forgotten past this many, oldest first.
_MAX_TRACKED = 1 << 16
# A peer: the node id its calls claim, and the public key (hex) that signed them ("": none).
Peer = tuple[str, str]
# A sync server's workers that may wait out refused callers' backoffs at once (a node has 64; the run needs a few).
_MAX_HELD = 8


@dataclass(frozen=True)
class LimitValues:
    """The numbers PeerLimits enforces: config.LimitsSection's, which protocol/ cannot import, so its defaults are
    written down again here (tests/test_config.py checks that they agree)."""

    streams_per_peer: int = 16
    streams_per_host: int = 128
    idle_stream_s: float = 30.0
    calls_per_s: float = 200.0
    call_burst: int = 400


class TokenBuckets:
    """One token bucket per key: `rate` tokens a second, at most `burst` saved; a bounded number of keys."""

    def __init__(self, rate: float, burst: int, max_keys: int = _MAX_TRACKED) -> None:
        self.rate = rate
        self.burst = burst
        self._max_keys = max_keys
        self._buckets: OrderedDict[Any, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: Any, now: float | None = None) -> bool:
        """Take one token for key; False when its bucket is empty."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, since = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - since) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self._max_keys:
                self._buckets.popitem(last=False)
            return allowed


class Backoff:
    """How long to hold the answer to a caller's refused call: from first_s, doubling with each refusal of its calls
    less than forget_s after the one before, up to max_s. A caller that waits for its answers is slowed to one call a
    max_s; a grpc.aio server holds an answer without a thread (a sync server's would hold a worker: it answers at
    once)."""

    def __init__(
        self, first_s: float = 0.01, max_s: float = 1.0, forget_s: float = 10.0, max_keys: int = _MAX_TRACKED
    ) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.forget_s = forget_s
        self._max_keys = max_keys
        self._refused: OrderedDict[Any, tuple[int, float]] = OrderedDict()  # key -> (refusals in a row, last)
        self._lock = threading.Lock()

    def delay(self, key: Any, now: float | None = None) -> float:
        """Count one refusal for key; the seconds to hold its answer."""
        now = time.monotonic() if now is None else now
        with self._lock:
            count, last = self._refused.pop(key, (0, now))
            count = count + 1 if now - last < self.forget_s else 1
            self._refused[key] = (count, now)
            while len(self._refused) > self._max_keys:
                self._refused.popitem(last=False)
        return min(self.max_s, self.first_s * 2.0 ** min(count - 1, 64))


class _Watched:
    """A request stream's idle clock: when it began waiting for its next message (None while not waiting)."""

    __slots__ = ("waiting_since", "cut")

    def __init__(self, cut: Callable[[], None]) -> None:
        self.waiting_since: float | None = None
        self.cut = cut


class PeerLimits:
    """Per-peer and per-host counts of one server's calls and open request streams, and the idle-stream watchdog of
    a sync server. `configure` replaces the numbers (a node learns the run's from the coordinator)."""

    def __init__(self, values: LimitValues | None = None, refusals: RefusalLog | None = None) -> None:
        self.refusals = refusals or RefusalLog()
        self.backoff = Backoff()  # by (host, key)
        self._held = threading.BoundedSemaphore(_MAX_HELD)
        self._lock = threading.Lock()
        self._streams: dict[tuple[str, Peer], int] = {}
        self._host_streams: dict[str, int] = {}
        self._watched: dict[int, _Watched] = {}
        self._ids = itertools.count()
        self._watchdog: threading.Thread | None = None
        self.configure(values or LimitValues())

    def configure(self, values: LimitValues) -> None:
        """Enforce `values` from now on (counts of open streams carry over)."""
        self.values = values
        self._calls = TokenBuckets(values.calls_per_s, values.call_burst)

    def open(self, host: str, peer: Peer, stream: bool) -> str | None:
        """Count the start of a call (a request stream when `stream`); why it is refused, or None. An admitted
        stream must be closed with close()."""
        v = self.values
        if not self._calls.take((host, peer)):
            return f"more than {v.calls_per_s:g} calls a second (burst {v.call_burst}) from this peer"
        if not stream:
            return None
        with self._lock:
            at = (host, peer)
            if self._streams.get(at, 0) >= v.streams_per_peer:
                return f"{v.streams_per_peer} streams already open from this peer"
            if self._host_streams.get(host, 0) >= v.streams_per_host:
                return f"{v.streams_per_host} streams already open from this host"
            self._streams[at] = self._streams.get(at, 0) + 1
            self._host_streams[host] = self._host_streams.get(host, 0) + 1
        return None

    def close(self, host: str, peer: Peer) -> None:
        """A stream admitted by open() has ended."""
        with self._lock:
            for counts, key in ((self._streams, (host, peer)), (self._host_streams, host)):
                left = counts[key] - 1
                if left:
                    counts[key] = left
                else:
                    del counts[key]

    def hold(self, host: str, key: str) -> None:
        """A sync server's refused caller (its host and key) waits out its backoff in the worker that refused it,
        while fewer than _MAX_HELD workers wait; beyond that it is answered at once."""
        delay = self.backoff.delay((host, key))
        if self._held.acquire(blocking=False):
            try:
                time.sleep(delay)
            finally:
                self._held.release()

    def open_streams(self) -> int:
        """Request streams open now, all peers together."""
        with self._lock:
            return sum(self._host_streams.values())

    def watched(self, requests: Iterator[Any], cut: Callable[[], None]) -> Iterator[Any]:
        """`requests` (a sync server's request stream), cut by calling `cut` once it waits longer than
        idle_stream_s for a message."""
        clock = _Watched(cut)
        key = next(self._ids)
        with self._lock:
            self._watched[key] = clock
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="idle-streams", daemon=True)
                self._watchdog.start()
        try:
            while True:
                clock.waiting_since = time.monotonic()
                try:
                    message = next(requests)
                except StopIteration:
                    return
                clock.waiting_since = None
                yield message
        finally:
            with self._lock:
                del self._watched[key]

    def _watch(self) -> None:
        """Cut the sync streams that wait too long; runs for the server's life (a daemon thread)."""
        while True:
            idle_s = self.values.idle_stream_s
            time.sleep(min(1.0, idle_s / 4))
            now = time.monotonic()
            with self._lock:
                late = [w for w in self._watched.values() if w.waiting_since is not None and now - w.waiting_since > idle_s]
                for w in late:
                    w.waiting_since = None  # cut once
            for w in late:
                w.cut()


def _peer(details: grpc.HandlerCallDetails) -> Peer:
    metadata = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
    return metadata.get(MD_NODE, ""), metadata.get(MD_KEY, "")


def _same_kind(handler: Any, behavior: Callable[..., Any]) -> Any:
    """A method handler of handler's streaming kind and (de)serializers that runs `behavior`."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _inner_behavior(handler: Any) -> Callable[..., Any]:
    return (
        (handler.stream_stream or handler.stream_unary)
        if handler.request_streaming
        else (handler.unary_stream or handler.unary_unary)
    )


class LimitsInterceptor(grpc.ServerInterceptor):
    """Applies PeerLimits to every call of a sync grpc.Server: refuses calls over a limit, cuts idle request streams
    (a cut stream frees its worker thread at once), and holds the answer to a call refused over a limit or as not the
    caller's to make (PERMISSION_DENIED: signed by a key that may not send it) by the caller's backoff."""

    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits

    def intercept_service(self, continuation, handler_call_details):  # noqa: D102
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        limits, method, peer = self.limits, handler_call_details.method, _peer(handler_call_details)
        node_id = peer[0]
        inner, stream = _inner_behavior(handler), handler.request_streaming

        def admit(context: grpc.ServicerContext) -> str:
            host = peer_host(context.peer())
            why = limits.open(host, peer, stream)
            if why is not None:
                limits.refusals.refused(context.peer(), method, node_id, why)
                limits.hold(host, peer[1])
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            return host

        def held_if_denied(host: str, context: grpc.ServicerContext) -> None:
            if context.code() == grpc.StatusCode.PERMISSION_DENIED:
                limits.hold(host, peer[1])

        def request_of(request: Any, context: grpc.ServicerContext) -> Any:
            if not stream:
                return request

            def cut() -> None:
                limits.refusals.refused(
                    context.peer(), method, node_id, f"stream idle for {limits.values.idle_stream_s:g}s: cut"
                )
                context.cancel()

            return limits.watched(iter(request), cut)

        if handler.response_streaming:

            def behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                host = admit(context)
                try:
                    yield from inner(request_of(request, context), context)
                except Exception:
                    held_if_denied(host, context)
                    raise
                finally:
                    if stream:
                        limits.close(host, peer)
        else:

            def behavior(request: Any, context: grpc.ServicerContext) -> Any:
                host = admit(context)
                try:
                    return inner(request_of(request, context), context)
                except Exception:
                    held_if_denied(host, context)
                    raise
                finally:
                    if stream:
                        limits.close(host, peer)

        return _same_kind(handler, behavior)


class AioLimitsInterceptor(grpc.aio.ServerInterceptor):
    """LimitsInterceptor for a grpc.aio server: the same counts; an idle request stream is aborted with
    DEADLINE_EXCEEDED by its own handler's coroutine (no watchdog thread)."""

    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits

    async def intercept_service(self, continuation, handler_call_details):  # noqa: D102
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        limits, method, peer = self.limits, handler_call_details.method, _peer(handler_call_details)
        node_id = peer[0]
        inner, stream = _inner_behavior(handler), handler.request_streaming

        async def admit(context: grpc.aio.ServicerContext) -> str:
            host = peer_host(context.peer())
            why = limits.open(host, peer, stream)
            if why is not None:
                limits.refusals.refused(context.peer(), method, node_id, why)
                await asyncio.sleep(limits.backoff.delay((host, peer[1])))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            return host

        async def watched(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            idle_s = limits.values.idle_stream_s
            it = aiter(requests)
            while True:
                try:
                    message = await asyncio.wait_for(anext(it), idle_s)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    why = f"stream idle for {idle_s:g}s: cut"
                    limits.refusals.refused(context.peer(), method, node_id, why)
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)
                yield message

        def request_of(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return watched(request, context) if stream else request

        if handler.response_streaming:

            async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                host = await admit(context)
                try:
                    async for response in inner(request_of(request, context), context):
                        yield response
                finally:
                    if stream:
                        limits.close(host, peer)
        else:

            async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
                host = await admit(context)
                try:
                    return await inner(request_of(request, context), context)
                finally:
                    if stream:
                        limits.close(host, peer)

        return _same_kind(handler, behavior)
