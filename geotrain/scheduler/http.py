"""The coordinator's status page over HTTP: the page itself, /api/status (JSON) and /metrics (Prometheus text).

aiohttp runs on its own event loop in a daemon thread, so the coordinator's threads never wait on it; every
request takes a fresh `status()` snapshot, so the server keeps no state of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
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

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.status_cli import status_dict

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
RECOVERY_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_START_TIMEOUT_S = 10.0
# In-flight requests get this long to finish on stop; the page polls every second, so none should take longer.
_SHUTDOWN_GRACE_S = 2.0


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


class StatusHttpServer:
    """Serves the status page, /api/status and /metrics from `status` on `listen` (HOST:PORT)."""

    def __init__(self, status: Callable[[], pb.StatusReply], listen: str) -> None:
        self._status = status
        self._host, self._port = _split_listen(listen)
        self._registry = CollectorRegistry()
        self._registry.register(StatusCollector(status))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/api/status", self._api_status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_static("/static/", STATIC_DIR)
        return app

    async def _index(self, _request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def _api_status(self, _request: web.Request) -> web.Response:
        # status() takes the coordinator's lock and reads SQLite: keep it off the event loop.
        reply = await asyncio.get_running_loop().run_in_executor(None, self._status)
        return web.json_response(status_dict(reply), headers={"Cache-Control": "no-store"})

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _serve(self) -> int:
        self._runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=_SHUTDOWN_GRACE_S)
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
