"""Run-token authentication of every RPC (an HMAC over method, node id, timestamp and nonce), and a node's signature
over the same fields with its key (protocol.identity).

The token never travels. A request is accepted when its MAC verifies, its timestamp is within MAX_SKEW_S of the
server's clock, and its nonce was not seen before within that window (so a captured request cannot be replayed).
A call that carries a public key must also carry that key's signature of the same fields, or it is refused; the
handler then knows the caller holds the key (`signer`) and decides whether that key may make the call: the token
proves membership of the run, the key which member is speaking.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc

from geotrain.protocol.identity import NodeKey, verify

MD_NODE = "x-geotrain-node"
MD_TS = "x-geotrain-ts"
MD_NONCE = "x-geotrain-nonce"
MD_MAC = "x-geotrain-mac"
MD_KEY = "x-geotrain-key"  # the caller's Ed25519 public key, hex
MD_SIG = "x-geotrain-sig"  # its signature of the same fields the MAC covers, hex
MAX_SKEW_S = 60.0
TOKEN_ENV = "GEOTRAIN_TOKEN"
# A peer retrying with a wrong token calls many times a second: its first refusal is logged, then one a minute.
REFUSAL_LOG_INTERVAL_S = 60.0

log = logging.getLogger(__name__)


def resolve_token(token: str | None) -> str:
    """The run token from the flag, else from GEOTRAIN_TOKEN; raises ValueError when neither is set."""
    value = token or os.environ.get(TOKEN_ENV, "")
    if not value:
        raise ValueError(f"a run token is required: pass --token or set {TOKEN_ENV}")
    return value


def new_token() -> str:
    """A fresh random run token (hex: a token starting with "-" would read as an option on a command line)."""
    return secrets.token_hex(24)


def _message(method: str, node_id: str, ts: str, nonce: str) -> bytes:
    """What the MAC and the signature of one request cover: a replay (same nonce) or a swapped field fails both."""
    return "\n".join((method, node_id, ts, nonce)).encode()


def sign(token: str, method: str, node_id: str, ts: str, nonce: str) -> str:
    """The MAC of one request."""
    return hmac.new(token.encode(), _message(method, node_id, ts, nonce), hashlib.sha256).hexdigest()


def auth_metadata(token: str, method: str, node_id: str, key: NodeKey | None = None) -> list[tuple[str, str]]:
    """Metadata that proves knowledge of the token for one call of `method` and, with `key`, that the caller holds
    that key."""
    ts = f"{time.time():.6f}"
    nonce = secrets.token_hex(16)
    metadata = [(MD_NODE, node_id), (MD_TS, ts), (MD_NONCE, nonce), (MD_MAC, sign(token, method, node_id, ts, nonce))]
    if key is not None:
        signature = key.sign(_message(method, node_id, ts, nonce))
        metadata += [(MD_KEY, key.public.hex()), (MD_SIG, signature.hex())]
    return metadata


def _as_dict(metadata: Any) -> dict[str, str]:
    """gRPC metadata as a dict of its text values (the last of a repeated key, as everywhere here)."""
    return {k: v for k, v in metadata if isinstance(v, str)}


def _hex(value: str | None) -> bytes | None:
    try:
        return bytes.fromhex(value) if value else None
    except ValueError:
        return None


def signer(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> bytes | None:
    """The public key whose signature of this call ServerAuth verified, or None for a call signed by no key."""
    return _hex(_as_dict(context.invocation_metadata() or ()).get(MD_KEY))


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression
        self.metadata = metadata


class ClientAuth(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fresh auth metadata to every outgoing call, signed with `key` if given (once per call: a stream is
    signed when it opens, not per message)."""

    def __init__(self, token: str, node_id: Callable[[], str], key: NodeKey | None = None) -> None:
        self._token = token
        self._node_id = node_id
        self._key = key

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or []) + auth_metadata(
            self._token, details.method, self._node_id(), self._key
        )
        return _ClientCallDetails(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: D102
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # noqa: D102
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # noqa: D102
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # noqa: D102
        return continuation(self._details(client_call_details), request_iterator)


class ReplayGuard:
    """Remembers nonces seen within the skew window."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def first_use(self, nonce: str, now: float) -> bool:
        """True the first time a nonce is presented within the window."""
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - self._window_s:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


class RefusalLog:
    """Logs refused calls at most once per peer host per interval, so a misconfigured node cannot flood the log."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S, max_peers: int = 4096) -> None:
        self._interval_s = interval_s
        self._max_peers = max_peers
        self._last: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def refused(self, peer: str, method: str, node_id: str, why: str, now: float | None = None) -> bool:
        """Note one refused call from `peer` (gRPC's "ipv4:HOST:PORT"); True when it was logged."""
        now = time.monotonic() if now is None else now
        host = peer_host(peer)
        with self._lock:
            last = self._last.pop(host, None)
            if last is not None and now - last < self._interval_s:
                self._last[host] = last
                return False
            self._last[host] = now
            while len(self._last) > self._max_peers:
                self._last.popitem(last=False)
        log.warning(
            "refused %s from %s (node id %r): %s; further refusals from %s are logged at most once every %.0fs",
            method, host, node_id, why, host, self._interval_s,
        )
        return True


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"): one per machine, not connection."""
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host, sep, _ = address.rpartition(":")
    return (host if sep else address).strip("[]")


def _rejecting_handler(handler: Any, message: str, on_refused: Callable[[str], None], aio: bool = False) -> Any:
    """A handler of the same streaming kind as `handler` that answers UNAUTHENTICATED (on_refused hears the peer);
    with `aio`, a coroutine for grpc.aio servers, whose abort must be awaited."""

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        on_refused(context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_aio(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        on_refused(context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    refuse = abort_aio if aio else abort
    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class ServerAuth(grpc.ServerInterceptor):
    """Rejects calls whose token proof is missing, wrong, stale or replayed, or whose key signature (if the call
    carries a key) does not verify."""

    def __init__(self, token: str, max_skew_s: float = MAX_SKEW_S) -> None:
        self._token = token
        self._max_skew_s = max_skew_s
        self._replays = ReplayGuard(2 * max_skew_s)
        self.refusals = RefusalLog()

    def check(self, method: str, metadata: dict[str, str], now: float | None = None) -> str | None:
        """None if the call is authentic, else why not."""
        now = time.time() if now is None else now
        node, ts, nonce, mac = (metadata.get(k) for k in (MD_NODE, MD_TS, MD_NONCE, MD_MAC))
        if node is None or not ts or not nonce or not mac:
            return "missing run-token proof (x-geotrain-* metadata)"
        if not hmac.compare_digest(sign(self._token, method, node, ts, nonce), mac):
            return "bad run-token proof: wrong token?"
        try:
            age = now - float(ts)
        except ValueError:
            return "malformed timestamp"
        if abs(age) > self._max_skew_s:
            return f"stale request: timestamp {age:.1f}s off (clocks out of sync?)"
        if MD_KEY in metadata or MD_SIG in metadata:
            key, signature = _hex(metadata.get(MD_KEY)), _hex(metadata.get(MD_SIG))
            if key is None or signature is None or not verify(key, signature, _message(method, node, ts, nonce)):
                return "bad key signature: the call is not signed by the key it presents"
        if not self._replays.first_use(nonce, now):
            return "replayed request rejected"
        return None

    def intercept_service(self, continuation, handler_call_details):  # noqa: D102
        return self.admit(continuation(handler_call_details), handler_call_details)

    def admit(self, handler: Any, handler_call_details: grpc.HandlerCallDetails, aio: bool = False) -> Any:
        """`handler` for an authentic call, else a handler of its kind that refuses it (with `aio`, for grpc.aio)."""
        metadata = _as_dict(handler_call_details.invocation_metadata)
        problem = self.check(handler_call_details.method, metadata)
        if problem is None:
            return handler
        method, node_id = handler_call_details.method, metadata.get(MD_NODE, "")
        return _rejecting_handler(
            handler, problem, lambda peer: self.refusals.refused(peer, method, node_id, problem), aio
        )


class AioServerAuth(grpc.aio.ServerInterceptor):
    """ServerAuth for a grpc.aio server: the same checks, replay window and refusal log."""

    def __init__(self, token: str, max_skew_s: float = MAX_SKEW_S) -> None:
        self.auth = ServerAuth(token, max_skew_s)

    async def intercept_service(self, continuation, handler_call_details):  # noqa: D102
        return self.auth.admit(await continuation(handler_call_details), handler_call_details, aio=True)
