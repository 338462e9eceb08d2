"""The status page in headless Chromium against a live demo: every node and stage, a growing loss chart, a dead node."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from geotrain.localnodes import process_name
from tests.conftest import REPO, descendants, geotrain_env, running_of, wait_until

CHROMIUM = "/usr/bin/chromium"

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.browser,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"no Chromium at {CHROMIUM}: apt-get install chromium"),
]


@dataclass
class Demo:
    """A `geotrain demo --http` process and the lines it printed."""

    proc: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match:
        """The first printed line matching pattern (regex), waiting up to timeout seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                assert self.proc.poll() is None, "demo exited early:\n" + "".join(self.seen)
                continue
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r} in {timeout}s:\n" + "".join(self.seen))


@pytest.fixture
def demo() -> Iterator[Demo]:
    """A 3-node demo with the status page on a free port, which lingers so the page outlives an aborted run.

    The heartbeat timeout is generous: a node starts heartbeating only after it has loaded its corpus, which on a
    busy two-core machine can take longer than the default 5 s after registering; the killed node then counts as
    dead within 10 s.
    """
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "geotrain", "demo", "--nodes", "3", "--steps", "400",
            "--http", "127.0.0.1:0", "--http-linger", "60", "--set", "scheduler.heartbeat_timeout_s=10",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=geotrain_env(), cwd=REPO,
        process_group=0,
    )
    running = Demo(proc)
    reader = threading.Thread(target=lambda: [running.lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        yield running
    finally:
        proc.terminate()  # ends the linger; the demo then stops its nodes
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "api/status", timeout=5) as r:
        return json.load(r)


def _wait_status(url: str, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _status(url)
        if predicate(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {timeout}s; run {status['state']}, events {status['events']}")


def _chromium(url: str, profile: Path, *args: str) -> str:
    """Load url in headless Chromium (its polling gets 3 s of virtual time) and return its stdout."""
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=3000", *args, url,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, process_group=0)
    try:
        out, _ = proc.communicate(timeout=45)
    finally:
        # Chromium's helper processes share its session: end any that outlive the browser.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}"
    return out


class _Elements(HTMLParser):
    """Every start tag of a document with its attributes."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        """Attributes of the `tag` elements having every given attribute (data_x means data-x)."""
        want = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in want.items())]

    def node_cards(self) -> dict[str, list[str]]:
        """Pipeline node cards: node id -> CSS classes."""
        return {a["data-node"]: a["class"].split() for a in self.find("div") if "data-node" in a}

    def points(self, canvas_id: str) -> int:
        (canvas,) = self.find("canvas", id=canvas_id)
        return int(canvas["data-points"])


def _process_name(pid: int) -> str:
    """A process's name ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _node_pid(demo_pid: int, node_id: str) -> int:
    """The pid of the demo's local node node_id."""
    for pid in descendants(demo_pid):
        if _process_name(pid) == process_name(node_id):
            return pid
    raise AssertionError(f"no process for {node_id}")


def test_status_page_tracks_a_live_demo(demo, tmp_path):
    demo.wait_for_line(r"coordinator listening on", 30)
    url = demo.wait_for_line(r"status page at (http://127\.0\.0\.1:\d+/)", 30).group(1)
    status = _wait_status(url, lambda s: int(s["step"]) >= 3, "3 steps", 60)

    first = _Elements(_chromium(url, tmp_path / "profile", "--dump-dom"))
    node_ids = {n["node_id"] for n in status["nodes"]}
    assert len(node_ids) == 3 and set(first.node_cards()) == node_ids
    assert {a["data-stage"] for a in first.find("div", **{"class": "stage"})} == {"0", "1", "2"}
    assert {a["data-node"] for a in first.find("tr") if "data-node" in a} == node_ids
    assert first.find("li", data_kind="join") and first.find("li", data_kind="plan")
    points = first.points("loss-chart")
    assert points >= 3 and first.points("tokens-chart") == points
    # Both charts over the same axis, the run's steps.
    (loss_canvas,), (tokens_canvas,) = first.find("canvas", id="loss-chart"), first.find("canvas", id="tokens-chart")
    assert loss_canvas["data-x-axis"] == tokens_canvas["data-x-axis"] == f"step 1-{status['steps']}"
    assert first.find("section", id="problems", hidden="")  # nothing went wrong yet: no panel

    _wait_status(url, lambda s: int(s["step"]) >= points + 3, "more steps", 30)

    # Kill the middle stage's node outright: no goodbye, only missing heartbeats.
    victim = status["stages"][1]["node_ids"][0]
    os.kill(_node_pid(demo.proc.pid, victim), signal.SIGKILL)
    status = _wait_status(
        url, lambda s: any(n["node_id"] == victim and not n["alive"] for n in s["nodes"]), f"{victim} dead", 25
    )
    final = _Elements(_chromium(url, tmp_path / "profile", "--dump-dom"))
    assert final.points("loss-chart") > points  # the page follows the run
    cards = final.node_cards()
    assert "dead" in cards[victim]
    assert all("dead" not in classes for node, classes in cards.items() if node != victim)
    assert final.find("tr", data_node=victim, **{"class": "dead"})
    assert final.find("li", data_kind="dead")
    # The death is in the problems panel at the top, without scrolling the event log.
    assert final.find("li", data_kind="dead", **{"class": "problem"})
    assert final.find("section", id="problems") and not final.find("section", id="problems", hidden="")

    with urllib.request.urlopen(url + "metrics", timeout=5) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    nodes = {s.labels["state"]: s.value for s in families["geotrain_nodes"].samples}
    assert nodes == {"alive": 2, "dead": 1}

    screenshot = tmp_path / "status.png"
    _chromium(url, tmp_path / "profile", f"--screenshot={screenshot}", "--window-size=1400,1000", "--hide-scrollbars")
    assert screenshot.stat().st_size > 20_000

    # SIGTERM stops the live demo and everything it started, its nodes from its handler (test_pipeline's signal test
    # SIGKILLs a demo).
    started = descendants(demo.proc.pid)
    assert sum(name.startswith("gt-") for name in map(_process_name, started)) == 2  # the two nodes still alive
    demo.proc.send_signal(signal.SIGTERM)
    demo.proc.wait(timeout=20)
    wait_until(lambda: not running_of(started), 10, "every process the demo started to end")
