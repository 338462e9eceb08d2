"""The coordinator's status page over HTTP: the page itself, /api/status (JSON) and /metrics (Prometheus text).

`StatusHttpServer` serves a status callable with aiohttp on its own event loop in a daemon thread. The page is
public by default, so nothing a request costs grows with the number of requests: `status()` is the coordinator's
snapshot (rendered again after an event or when stale, never per request), its JSON and metrics bodies are encoded
once per snapshot, each client gets a few requests a second (429 after that), an optional viewer token guards the
data (the static files hold none), and event details lose filesystem paths.

`StatusPageProcess` (what `geotrain coordinator --http` runs) puts that server in a process of its own, forked from
the forkserver, at a lower CPU priority, and hands it the coordinator's snapshot at most once every
STATUS_PUSH_EVERY_S: even the cheap per-request work (HTTP parsing, the rate limit, a 429) took the interpreter lock
the coordinator's RPCs need, and 3,000 requests slowed a run to 0.3x of its steps.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector

from geotrain.lifetime import child_with_pipe, ready_message
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import RefusalLog
from geotrain.protocol.limits import TokenBuckets
from geotrain.scheduler.status_cli import status_dict

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
RECOVERY_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_START_TIMEOUT_S = 10.0
# In-flight requests get this long to finish on stop; the page polls every second, so none should take longer.
_SHUTDOWN_GRACE_S = 2.0
# The page polls once a second and loads four files: a viewer stays far below this; a flood gets 429s.
REQUESTS_PER_S = 10.0
REQUEST_BURST = 30
# No route is longer; a longer path is answered 404 before aiohttp's static handler (which fails on it) sees it.
_MAX_PATH = 256
# An absolute POSIX path in an event's detail (a checkpoint that failed to write, a data set that vanished): where the
# coordinator keeps its files is nobody's business on a public page.
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.\-]+/)*[\w.\-]+")
# The page process gets a new snapshot at most this often: the page itself polls once a second.
STATUS_PUSH_EVERY_S = 1.0
# The page process's niceness: on a machine the run keeps busy, the page waits, not the run.
_PAGE_NICENESS = 10


def metric_families(reply: pb.StatusReply) -> Iterator[Metric]:
    """The Prometheus metric families of one status snapshot."""
    yield GaugeMetricFamily("geotrain_step", "Steps committed.", value=reply.step)
    yield GaugeMetricFamily("geotrain_steps", "Steps the run trains.", value=reply.steps)
    yield StateSetMetricFamily("geotrain_run_state", "Run state.", {reply.state: True})
    yield GaugeMetricFamily("geotrain_plan_epoch", "Epoch of the current plan.", value=reply.plan_epoch)
    if reply.history:
        yield GaugeMetricFamily("geotrain_loss", "Training loss of the last committed step.", value=reply.loss)
        yield GaugeMetricFamily("geotrain_tokens_per_second", "Tokens/s of the last step.", value=reply.tokens_per_s)
        yield GaugeMetricFamily("geotrain_eta_seconds", "Estimated time left.", value=reply.eta_s)
    if any(p.has_val_loss for p in reply.history):
        yield GaugeMetricFamily("geotrain_val_loss", "Latest validation loss.", value=reply.val_loss)
        yield GaugeMetricFamily(
            "geotrain_val_bits_per_byte", "Latest validation loss in bits per byte of text.",
            value=reply.val_bits_per_byte,
        )

    nodes = GaugeMetricFamily("geotrain_nodes", "Nodes known to the coordinator.", labels=["state"])
    alive = sum(n.alive for n in reply.nodes)
    nodes.add_metric(["alive"], alive)
    nodes.add_metric(["dead"], len(reply.nodes) - alive)
    yield nodes
    speed = GaugeMetricFamily(
        "geotrain_node_microbatches_per_second", "Measured node speed.", labels=["node", "region", "stage"]
    )
    heartbeat = GaugeMetricFamily(
        "geotrain_node_heartbeat_age_seconds", "Time since the node's last heartbeat.", labels=["node"]
    )
    sent = CounterMetricFamily("geotrain_node_sent_bytes", "Bytes a node sent to peers.", labels=["node"])
    received = CounterMetricFamily("geotrain_node_received_bytes", "Bytes a node got from peers.", labels=["node"])
    for n in reply.nodes:
        speed.add_metric([n.node_id, n.region, str(n.stage)], n.microbatches_per_s)
        heartbeat.add_metric([n.node_id], n.last_heartbeat_s)
        sent.add_metric([n.node_id], n.bytes_sent)
        received.add_metric([n.node_id], n.bytes_received)
    yield from (speed, heartbeat, sent, received)

    link_labels = ["src", "dst", "codec"]
    wire = CounterMetricFamily("geotrain_link_bytes", "Bytes sent over a link, on the wire.", labels=link_labels)
    ratio = GaugeMetricFamily("geotrain_link_compression_ratio", "Raw / wire bytes of a link.", labels=link_labels)
    bandwidth = GaugeMetricFamily("geotrain_link_bandwidth_mbps", "Measured link bandwidth.", labels=link_labels)
    for link in reply.links:
        labels = [link.src, link.dst, link.codec]
        wire.add_metric(labels, link.wire_bytes)
        ratio.add_metric(labels, link.compression_ratio)
        # 0 means not measured yet: leaving the sample out keeps dashboards from plotting a fake zero.
        if link.bandwidth_mbps:
            bandwidth.add_metric(labels, link.bandwidth_mbps)
    yield from (wire, ratio, bandwidth)

    yield CounterMetricFamily("geotrain_failures", "Node failures the run survived or died of.", value=reply.failures)
    buckets = [(str(le), sum(r <= le for r in reply.recovery_s)) for le in RECOVERY_BUCKETS_S]
    yield HistogramMetricFamily(
        "geotrain_recovery_seconds",
        "Time from a failure to the next committed step.",
        buckets=[*buckets, ("+Inf", len(reply.recovery_s))],
        sum_value=sum(reply.recovery_s),
    )


class StatusCollector(Collector):
    """A Prometheus collector that reads a fresh status snapshot on every scrape."""

    def __init__(self, status: Callable[[], pb.StatusReply]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        """The metric families of the current status."""
        return metric_families(self._status())


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http {listen!r}: expected HOST:PORT (port 0 picks a free one)")
    return host.strip("[]"), int(port)


class _RequestErrors(logging.LoggerAdapter):
    """aiohttp's server logger: a request it cannot handle (a 100 kB URL, garbage bytes) is one line per client
    and interval through RefusalLog, never a traceback per request, however many a client sends."""

    def __init__(self) -> None:
        super().__init__(log, {})
        self.refusals = RefusalLog()

    def exception(self, msg: object, *args: object, exc_info: object = True, **_kwargs: object) -> None:  # noqa: D102
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        client = str(args[0]) if args else "unknown client"
        self.refusals.refused(client, "HTTP request", "", f"{msg % args if args else msg}: {error}")


def without_paths(reply: pb.StatusReply) -> pb.StatusReply:
    """A copy of reply whose event details name no filesystem path."""
    public = pb.StatusReply()
    public.CopyFrom(reply)
    for event in public.events:
        event.detail = _PATH.sub("<path>", event.detail)
    return public


class StatusHttpServer:
    """Serves the status page, /api/status and /metrics from `status` on `listen` (HOST:PORT); with `viewer_token`,
    the page and its data only to requests that carry it (?token=... or an `Authorization: Bearer` header)."""

    def __init__(self, status: Callable[[], pb.StatusReply], listen: str, viewer_token: str | None = None) -> None:
        self._status = status
        self._host, self._port = _split_listen(listen)
        self._viewer_token = viewer_token
        self._clients = TokenBuckets(REQUESTS_PER_S, REQUEST_BURST)
        self._encoded: tuple[pb.StatusReply, bytes, bytes] | None = None  # a snapshot, its JSON and its metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._index)
        app.router.add_get("/api/status", self._api_status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_static("/static/", STATIC_DIR)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Over-long paths 404, a client past its rate 429, and the viewer token (not for the static files) 401."""
        if len(request.rel_url.raw_path) > _MAX_PATH:
            raise web.HTTPNotFound()
        if not self._clients.take(request.remote):
            raise web.HTTPTooManyRequests(headers={"Retry-After": "1"})
        if self._viewer_token is not None and not request.path.startswith("/static/"):
            offered = request.query.get("token", "")
            bearer = request.headers.get("Authorization", "")
            if bearer.startswith("Bearer "):
                offered = bearer.removeprefix("Bearer ")
            if not hmac.compare_digest(offered.encode(), self._viewer_token.encode()):
                raise web.HTTPUnauthorized(text="this status page needs its viewer token: add ?token=...")
        return await handler(request)

    async def _index(self, _request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    def _bodies(self) -> tuple[bytes, bytes]:
        """The JSON and metrics bodies of the current snapshot, encoded once per snapshot."""
        reply = self._status()
        encoded = self._encoded
        if encoded is None or encoded[0] is not reply:
            public = without_paths(reply)
            registry = CollectorRegistry()
            registry.register(StatusCollector(lambda: public))
            encoded = (reply, json.dumps(status_dict(public)).encode(), generate_latest(registry))
            self._encoded = encoded
        return encoded[1], encoded[2]

    async def _api_status(self, _request: web.Request) -> web.Response:
        # status() may take the coordinator's lock and read SQLite: keep it off the event loop.
        body, _ = await asyncio.get_running_loop().run_in_executor(None, self._bodies)
        return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-store"})

    async def _metrics(self, _request: web.Request) -> web.Response:
        _, body = await asyncio.get_running_loop().run_in_executor(None, self._bodies)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _serve(self) -> int:
        self._runner = web.AppRunner(
            self._app(), access_log=None, shutdown_timeout=_SHUTDOWN_GRACE_S, logger=_RequestErrors()
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()
        return self._runner.addresses[0][1]

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="status-http", daemon=True)
        self._thread.start()
        try:
            port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(_START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        log.info("status page on http://%s:%d/", self._host, port)
        return port

    @property
    def serving(self) -> bool:
        """Whether start() succeeded and stop() has not been called since."""
        return self._runner is not None

    def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (briefly), and end the thread; safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        if self._runner is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(_SHUTDOWN_GRACE_S + 3.0)
            except Exception:  # noqa: BLE001 - shutting down anyway; the thread is a daemon
                log.warning("status page did not shut down cleanly", exc_info=True)
            self._runner = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        if not thread.is_alive():
            loop.close()


class StatusPageProcess:
    """StatusHttpServer in a process of its own (forked from the forkserver, at a lower CPU priority), serving the
    snapshot `status()` returned last: a thread here reads it every `push_every_s` and sends the process each new
    one, so the coordinator's cost is one serialized snapshot a push, whatever the requests. The process ends when
    this object is stopped or its parent dies (it reads a pipe only the parent holds open). The same start(),
    serving and stop() as StatusHttpServer; start() raises OSError when `listen` cannot be bound."""

    def __init__(
        self, status: Callable[[], pb.StatusReply], listen: str, viewer_token: str | None = None,
        push_every_s: float = STATUS_PUSH_EVERY_S,
    ) -> None:
        _split_listen(listen)  # a bad address fails here, as StatusHttpServer's does
        self._status = status
        self._listen = listen
        self._viewer_token = viewer_token
        self._push_every_s = push_every_s
        self._conn: Connection | None = None
        self._process = None
        self._pusher: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> int:
        """Start the page's process and the pushes; returns the bound port."""
        self._process, self._conn = child_with_pipe(
            _serve_page, (self._listen, self._viewer_token), "geotrain-status-page"
        )
        try:
            self._conn.send_bytes(self._status().SerializeToString())  # served from the first request on
            # The process imports aiohttp first.
            port, errno, strerror = ready_message(self._conn, _START_TIMEOUT_S * 3, "the status page's process")
        except BaseException:
            self.stop()
            raise
        if errno is not None:
            self.stop()
            raise OSError(errno, strerror)
        self._pusher = threading.Thread(target=self._push, name="status-page-push", daemon=True)
        self._pusher.start()
        log.info("status page on http://%s:%d/", self._listen.rsplit(":", 1)[0], port)
        return port

    def _push(self) -> None:
        """Send the page process each new snapshot, at most once every push_every_s, until stopped."""
        assert self._conn is not None
        last: pb.StatusReply | None = None
        while not self._stop.wait(self._push_every_s):
            reply = self._status()
            if reply is last:
                continue
            last = reply
            try:
                self._conn.send_bytes(reply.SerializeToString())
            except OSError:  # the process is gone (stop() closed the pipe, or it died): no page to feed
                return

    @property
    def serving(self) -> bool:
        """Whether start() succeeded and stop() has not been called since."""
        return self._pusher is not None and not self._stop.is_set()

    def stop(self) -> None:
        """End the pushes and the process (it lets in-flight requests finish briefly); safe to call twice."""
        self._stop.set()
        if self._pusher is not None:
            self._pusher.join(5.0)
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            self._process.join(_SHUTDOWN_GRACE_S + 5.0)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5.0)


def _serve_page(listen: str, viewer_token: str | None, conn: Connection) -> None:
    """StatusPageProcess's process: serve the snapshots read from `conn` until the parent's end closes. It sends the
    parent (port, None, None) once serving, or (0, errno, strerror) when it cannot bind."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C at a terminal reaches this process too; the parent decides
    os.nice(_PAGE_NICENESS)
    latest = pb.StatusReply.FromString(conn.recv_bytes())
    server = StatusHttpServer(lambda: latest, listen, viewer_token)
    try:
        port = server.start()
    except OSError as e:
        conn.send((0, e.errno, e.strerror))
        return
    conn.send((port, None, None))
    try:
        while True:
            latest = pb.StatusReply.FromString(conn.recv_bytes())
    except EOFError:
        pass
    finally:
        server.stop()
