"""The status server's /metrics and /api/status, and `geotrain status` against the same coordinator."""

from __future__ import annotations

import io
import json
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from geotrain.config import load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import new_token
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler import status_cli
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.http import StatusHttpServer
from geotrain.scheduler.service import make_coordinator_server
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(30)


def _fixed_status() -> pb.StatusReply:
    """A run two steps in, one node dead, with a failure survived: every section of the reply filled."""
    reply = pb.StatusReply(
        state="training", step=2, steps=10, loss=2.5, val_loss=2.75, tokens_per_s=1000.0, eta_s=8.0, plan_epoch=2,
        failures=1, recovery_s=[1.5, 40.0], val_bits_per_byte=3.5,
    )
    reply.nodes.add(node_id="a", region="eu", stage=0, layer_end=3, role="stage", microbatches_per_s=4.0,
                    bytes_sent=2048, bytes_received=1024, compression_ratio=2.0, alive=True)
    reply.nodes.add(node_id="b", region="us", stage=1, layer_start=3, layer_end=6, role="stage", alive=False)
    reply.stages.add(index=0, layer_start=0, layer_end=3, node_ids=["a"])
    reply.stages.add(index=1, layer_start=3, layer_end=6, node_ids=["b"])
    reply.links.add(src="a", dst="b", codec="int8", compression_ratio=2.0, raw_bytes=4096, wire_bytes=2048)
    reply.history.add(step=0, loss=3.0, tokens_per_s=900.0, seconds=1.0)
    reply.history.add(step=1, loss=2.5, has_val_loss=True, val_loss=2.75, tokens_per_s=1000.0, seconds=1.0)
    reply.events.add(at=1.0, kind="join", node_id="a", detail="127.0.0.1:1")
    reply.events.add(at=2.0, kind="dead", node_id="b")
    return reply


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


@pytest.fixture
def fixed_server() -> Iterator[str]:
    """A status server over _fixed_status(); yields its base URL."""
    server = StatusHttpServer(_fixed_status, "127.0.0.1:0")
    port = server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def test_metrics_parse_with_the_expected_families_and_values(fixed_server):
    content_type, text = _get(fixed_server + "/metrics")
    assert content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {
        "geotrain_step", "geotrain_loss", "geotrain_val_loss", "geotrain_tokens_per_second", "geotrain_nodes",
        "geotrain_link_bytes", "geotrain_failures", "geotrain_recovery_seconds", "geotrain_run_state",
    } <= set(families)

    def samples(name: str) -> dict[tuple, float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in families[name].samples}

    assert samples("geotrain_step") == {("geotrain_step", ()): 2}
    assert samples("geotrain_val_loss") == {("geotrain_val_loss", ()): 2.75}
    assert samples("geotrain_val_bits_per_byte") == {("geotrain_val_bits_per_byte", ()): 3.5}
    assert samples("geotrain_nodes") == {
        ("geotrain_nodes", (("state", "alive"),)): 1, ("geotrain_nodes", (("state", "dead"),)): 1,
    }
    assert samples("geotrain_link_bytes") == {
        ("geotrain_link_bytes_total", (("codec", "int8"), ("dst", "b"), ("src", "a"))): 2048,
    }
    assert samples("geotrain_failures") == {("geotrain_failures_total", ()): 1}
    recovery = samples("geotrain_recovery_seconds")
    assert recovery[("geotrain_recovery_seconds_count", ())] == 2
    assert recovery[("geotrain_recovery_seconds_sum", ())] == 41.5
    assert recovery[("geotrain_recovery_seconds_bucket", (("le", "2.0"),))] == 1
    # Bandwidth 0 means "not measured": no sample rather than a fake zero.
    assert "geotrain_link_bandwidth_mbps" not in families or not families["geotrain_link_bandwidth_mbps"].samples


def test_page_and_static_files_are_served(fixed_server):
    _, page = _get(fixed_server + "/")
    assert "/static/chart.umd.min.js" in page and "loss-chart" in page
    _, chart = _get(fixed_server + "/static/chart.umd.min.js")
    assert chart.startswith("/*!\n * Chart.js v4") and "MIT" in chart[:200]
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(fixed_server + "/static/../http.py")
    assert e.value.code in (403, 404)


def test_every_phase_is_said_in_the_same_words_by_the_page_and_geotrain_status(fixed_server):
    # Both showed the step driver's names, "(dispatched)", which mean nothing to someone watching a run.
    from geotrain.scheduler.stepdriver import StepPhase

    assert set(status_cli.PHASE_WORDS) == {p.value for p in StepPhase} - {"idle"}
    _, script = _get(fixed_server + "/static/status.js")
    phases = re.search(r"const PHASES = \{(.*?)\};", script, re.S).group(1)
    assert dict(re.findall(r'(\w+): "([^"]+)"', phases)) == status_cli.PHASE_WORDS
    shown = status_cli.render_status(pb.StatusReply(state="training", phase="norms_in", step=2, steps=5))
    assert shown.startswith("run training, deciding the update: step 2/5")


def test_stop_is_graceful_and_idempotent():
    server = StatusHttpServer(_fixed_status, "127.0.0.1:0")
    port = server.start()
    assert server.serving
    server.stop()
    server.stop()
    assert not server.serving
    with pytest.raises(urllib.error.URLError):
        _get(f"http://127.0.0.1:{port}/api/status")


def test_bad_listen_address_is_a_value_error():
    with pytest.raises(ValueError, match="HOST:PORT"):
        StatusHttpServer(_fixed_status, "localhost")


@pytest.fixture
def live_coordinator() -> Iterator[tuple[str, str, str]]:
    """A real Coordinator with one registered node, served over gRPC and HTTP; yields (address, token, url)."""
    coordinator = Coordinator(load_config(None, []))
    coordinator.register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id="n1", address="127.0.0.1:1"))
    coordinator.heartbeat(pb.HeartbeatRequest(
        node_id="n1", bytes_sent=10, bytes_received=20, microbatches_per_s=3.0,
        links=[pb.LinkCounter(peer="n2", raw_bytes=40, wire_bytes=10, codec="int8")],
    ))
    token = new_token()
    grpc_server, grpc_port = make_coordinator_server(coordinator, token, "127.0.0.1:0")
    grpc_server.start()
    http = StatusHttpServer(coordinator.status, "127.0.0.1:0")
    http_port = http.start()
    try:
        yield f"127.0.0.1:{grpc_port}", token, f"http://127.0.0.1:{http_port}"
    finally:
        http.stop()
        grpc_server.stop(grace=0.5).wait(2)
        coordinator.store.close()


def _without_heartbeat_age(status: dict) -> dict:
    # The one field that changes while nothing happens: seconds since each node's last heartbeat.
    for node in status["nodes"]:
        node.pop("last_heartbeat_s")
    return status


@pytest.mark.cluster
def test_api_status_equals_cli_json(live_coordinator):
    address, token, url = live_coordinator
    cli = run_cli("status", "--coordinator", address, "--token", token, "--json", timeout=20)
    assert cli.returncode == 0, cli.stderr
    from_cli = json.loads(cli.stdout)
    from_http = json.loads(_get(url + "/api/status")[1])
    assert _without_heartbeat_age(from_cli) == _without_heartbeat_age(from_http)
    assert from_http["links"][0]["codec"] == "int8" and from_http["links"][0]["wire_bytes"] == "10"


class _CtrlCAfterFirstFrame(io.StringIO):
    """Output that presses Ctrl+C once the first frame is drawn."""

    def flush(self) -> None:
        super().flush()
        raise KeyboardInterrupt


def test_status_table_and_watch(live_coordinator):
    address, token, _ = live_coordinator
    out = io.StringIO()
    assert status_cli.run_status(address, token, as_json=False, watch=False, out=out) == 0
    table = out.getvalue()
    assert "run waiting: step 0/" in table and "bottleneck n/a" in table
    assert "n1" in table and "n1 -> n2" in table and "int8" in table and "4.00x" in table

    out = _CtrlCAfterFirstFrame()
    assert status_cli.run_status(address, token, as_json=True, watch=True, out=out) == 0
    assert out.getvalue().startswith("\x1b[H\x1b[2J{")


def test_status_with_a_wrong_token_fails_clearly(live_coordinator, capsys):
    address, _, _ = live_coordinator
    assert status_cli.run_status(address, "wrong", as_json=True, watch=False, out=sys.stdout) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "UNAUTHENTICATED" in captured.err
