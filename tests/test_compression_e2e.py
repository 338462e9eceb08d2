"""Compression end to end: real node processes train with lossy codecs, count bytes per link, and `auto` adapts."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest

from tests.conftest import local_cluster, run_cli


@pytest.mark.timeout(90)
def test_int8_run_trains_and_links_carry_fewer_wire_bytes(small_config, tmp_path):
    cfg = small_config
    cfg.compression.activations = cfg.compression.activation_grads = "int8"
    with local_cluster(cfg, 2, tmp_path) as cluster:
        summary = cluster.wait(80)
        assert math.isfinite(summary.loss_last) and summary.loss_last < summary.loss_first
        finished = time.monotonic()
        # Counters travel in heartbeats: wait for one from every node sent after the run ended.
        while any(n.last_heartbeat_s >= time.monotonic() - finished for n in cluster.coordinator.status().nodes):
            time.sleep(0.1)
        links = [link for link in cluster.coordinator.status().links if link.raw_bytes]
    assert len(links) == 2  # stage 0 -> 1 activations, stage 1 -> 0 gradients
    for link in links:
        assert link.codec == "int8:block=64"
        assert link.raw_bytes > 3.5 * link.wire_bytes > 0, link


@pytest.mark.timeout(90)
def test_auto_compresses_an_emulated_slow_link():
    result = run_cli(
        "demo", "--nodes", "2", "--steps", "6", "--regions", "eu,us", "--http", "off",
        "--set", "emulation.links=eu-us=20/50", "--set", "run.eval_every=0", "--set", "scheduler.placement=uniform",
        "--set", "compression.activations=auto", "--set", "compression.activation_grads=auto",
        timeout=80,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 6 steps" in result.stdout
    logs = Path(re.search(r"logs and state in (\S+)\)", result.stdout).group(1))
    switches = "".join(p.read_text() for p in logs.glob("*.log"))
    # 256 KiB per microbatch at 20 Mbit/s takes ~0.1 s, several times a stage's compute: both directions compress.
    assert re.search(r"activations to node-\d: none -> (fp16|int8|topk)", switches), switches[-3000:]
    assert re.search(r"activation_grads to node-\d: none -> (fp16|int8|topk)", switches), switches[-3000:]
