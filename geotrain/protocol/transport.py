"""Channels and servers with auth, optional TLS (see protocol.tls for its trust model), deadlines and retries on
UNAVAILABLE."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

import grpc

from geotrain.protocol.auth import AioServerAuth, ClientAuth, ServerAuth
from geotrain.protocol.limits import AioLimitsInterceptor, LimitsInterceptor, LimitValues, PeerLimits
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.tls import RUN_TLS_NAME, TlsFiles

log = logging.getLogger(__name__)
T = TypeVar("T")

# Chunks are 1 MiB; this leaves room for the header and rejects anything far larger.
MAX_MESSAGE_BYTES = 4 << 20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Servers accept the clients' keepalive pings (the default minimum interval of 5 minutes answers a 20 s ping on
    # an idle channel with GOAWAY "too_many_pings").
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # A channel whose server is down dials again at most this far apart (gRPC's default grows to 2 minutes): a
    # resumed coordinator finds its waiting nodes within seconds.
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Without SO_REUSEPORT a second server on a taken port fails instead of sharing its connections.
_SERVER_OPTIONS = [*_OPTIONS, ("grpc.so_reuseport", 0)]
# Calls one connection may have open at once at a node's (sync) server: the default streams_per_peer, and twice what a
# sender opens. HTTP/2 (MAX_CONCURRENT_STREAMS) keeps the calls past them from any Python (the client holds them for a
# free stream, or they are refused, UNAVAILABLE, when they race one that ends): 200 silent streams on one connection
# cost the node 16 idle workers, not ~200 refusals a second in its Python (auth, limits, a worker) under the
# interpreter lock its compute needs. The coordinator's grpc.aio server holds its refusals without a thread
# (limits.Backoff) and keeps the default: nodes in one process share one connection to it, each with its order stream.
NODE_STREAMS_PER_CONNECTION = LimitValues.streams_per_peer


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The status code a wire number stands for (UNKNOWN for none)."""
    return _STATUS_CODES.get(value, grpc.StatusCode.UNKNOWN)


class StatusError(grpc.RpcError):
    """A tensor's delivery outside a call (a reverse stream, a raw tensor stream) failed, with the status its Forward
    or Backward call would have had: retries, deadlines and failure reports see it as they see a failed call."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self._code, self._detail = code, detail

    def code(self) -> grpc.StatusCode:  # noqa: D102
        return self._code

    def details(self) -> str:  # noqa: D102
        return self._detail


def make_channel(
    address: str, token: str, node_id: Callable[[], str], tls: TlsFiles | None = None, key: NodeKey | None = None
) -> grpc.Channel:
    """A channel to `address` that proves the run token on every call, and signs it with `key` if given."""
    if tls is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)
        # Peers are dialled by whatever IP:port they advertise; every run certificate names RUN_TLS_NAME instead.
        options = [*_OPTIONS, ("grpc.ssl_target_name_override", RUN_TLS_NAME)]
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=_OPTIONS)
    return grpc.intercept_channel(channel, ClientAuth(token, node_id, key))


class ListenError(OSError):
    """A server cannot bind its listen address (taken, not this host's, or not an address)."""


def check_listen(listen: str) -> str:
    """`listen` with its host resolved to an IP address, checked to be bindable; raises ListenError naming why not
    (gRPC itself only says "Failed to bind", and hivemind takes no host names)."""
    host, sep, port_text = listen.rpartition(":")
    try:
        port = int(port_text)
        if not sep or not 0 <= port < 65536:
            raise ValueError
    except ValueError:
        raise ListenError(f"listen address must be HOST:PORT with a port in 0..65535, got {listen!r}") from None
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {listen}: {e.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a TIME_WAIT port is free
        try:
            sock.bind(sockaddr)
        except OSError as e:
            why = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise ListenError(f"cannot listen on {listen}: {why}") from None
    address = sockaddr[0]
    return f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"


def multiaddr_host(host: str) -> str:
    """A host as the first part of a multiaddr (hivemind's addresses): /ip4/ or /ip6/ for an address, /dns/ for a
    name."""
    try:
        return f"/ip{ipaddress.ip_address(host).version}/{host}"
    except ValueError:
        return f"/dns/{host}"


def make_server(
    token: str, listen: str, limits: PeerLimits | None = None, max_workers: int = 64, tls: TlsFiles | None = None
) -> tuple[grpc.Server, int]:
    """A started-later server bound to `listen` (port 0 picks one) that enforces `limits` on authentic calls;
    returns it and the bound port. One peer holds at most limits' streams_per_peer of its workers (default limits
    when None), and one connection NODE_STREAMS_PER_CONNECTION calls at once."""
    listen = check_listen(listen)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[ServerAuth(token), LimitsInterceptor(limits or PeerLimits())],
        options=[*_SERVER_OPTIONS, ("grpc.max_concurrent_streams", NODE_STREAMS_PER_CONNECTION)],
    )
    return server, _add_port(server, listen, tls)


def make_aio_server(
    token: str, listen: str, thread_pool: futures.Executor, tls: TlsFiles | None = None,
    limits: PeerLimits | None = None,
) -> tuple[grpc.aio.Server, int]:
    """make_server for grpc.aio, with the same auth, TLS and limits; call it on the event loop it will serve on.
    Its async handlers run on that loop, its plain (blocking) ones on thread_pool."""
    listen = check_listen(listen)
    interceptors = [AioServerAuth(token), AioLimitsInterceptor(limits or PeerLimits())]
    server = grpc.aio.server(thread_pool, interceptors=interceptors, options=_SERVER_OPTIONS)
    return server, _add_port(server, listen, tls)


def _add_port(server: grpc.Server | grpc.aio.Server, listen: str, tls: TlsFiles | None) -> int:
    """Bind `listen` (a checked address) with the run's TLS if any; the bound port, or ListenError."""
    try:
        if tls is not None:
            # Mutual TLS: a client without the run's files cannot get as far as the auth interceptor.
            creds = grpc.ssl_server_credentials(
                [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True
            )
            port = server.add_secure_port(listen, creds)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0  # taken between the check and the bind
    if port == 0:
        raise ListenError(f"cannot listen on {listen}")
    return port


def call_with_retry(
    fn: Callable[[], T],
    attempts: int = 5,
    first_backoff_s: float = 0.2,
    on_unavailable: Callable[[grpc.RpcError], None] | None = None,
) -> T:
    """Call fn, retrying with exponential backoff while it fails with UNAVAILABLE (on_unavailable hears each) or
    RESOURCE_EXHAUSTED: a peer's call budget (protocol.limits) refills, so an honest caller that outpaced it, as a
    data head of a small fast model does, is let in again after a short wait instead of failing its step."""
    for attempt in range(attempts - 1):
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise
            log.debug("%s (%s), retrying", e.code().name.lower(), e.details())
            if on_unavailable is not None and e.code() == grpc.StatusCode.UNAVAILABLE:
                on_unavailable(e)
            time.sleep(first_backoff_s * 2**attempt)
    return fn()
