"""Channels and servers with auth, optional TLS (see protocol.tls for its trust model), deadlines and retries on
UNAVAILABLE."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

import grpc

from geotrain.protocol.auth import ClientAuth, ServerAuth
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
]


def make_channel(address: str, token: str, node_id: Callable[[], str], tls: TlsFiles | None = None) -> grpc.Channel:
    """A channel to `address` that signs every call with the run token."""
    if tls is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)
        # Peers are dialled by whatever IP:port they advertise; every run certificate names RUN_TLS_NAME instead.
        options = [*_OPTIONS, ("grpc.ssl_target_name_override", RUN_TLS_NAME)]
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=_OPTIONS)
    return grpc.intercept_channel(channel, ClientAuth(token, node_id))


def make_server(token: str, listen: str, max_workers: int = 32, tls: TlsFiles | None = None) -> tuple[grpc.Server, int]:
    """A started-later server bound to `listen` (port 0 picks one); returns it and the bound port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[ServerAuth(token)],
        options=_OPTIONS,
    )
    if tls is not None:
        # Mutual TLS: a client without the run's files cannot get as far as the auth interceptor.
        creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True)
        port = server.add_secure_port(listen, creds)
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return server, port


def call_with_retry(
    fn: Callable[[], T],
    attempts: int = 5,
    first_backoff_s: float = 0.2,
    on_unavailable: Callable[[grpc.RpcError], None] | None = None,
) -> T:
    """Call fn, retrying with exponential backoff only while it fails with UNAVAILABLE (on_unavailable hears each)."""
    for attempt in range(attempts - 1):
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            log.debug("unavailable (%s), retrying", e.details())
            if on_unavailable is not None:
                on_unavailable(e)
            time.sleep(first_backoff_s * 2**attempt)
    return fn()
