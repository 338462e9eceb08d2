"""Loss against bytes per codec: the default model, the same steps and data, each codec on activations and gradients.

A real run per codec: an in-process coordinator and three `geotrain join` processes in two alternating regions
whose links are emulated at 20 Mbit/s and 50 ms, so that `auto` has a narrow link to adapt to (the other codecs
train identically on any link). One JSON line per run: codec, train_loss (the last step's), val_loss (the
final validation pass), wire_bytes and raw_bytes (summed over every link's counters, from the nodes' heartbeats
after the run). Run: python bench/convergence.py [--steps N] [--codecs none,int8]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from geotrain.config import load_config
from geotrain.node.data import Corpus
from geotrain.protocol.auth import new_token
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.local import LocalNodes
from geotrain.scheduler.service import make_coordinator_server

CODECS = ["none", "fp16", "int8", "topk:0.1", "auto"]
NODES = 3
REGIONS = ("eu", "us")
LINK = "eu-us=20/50"


def _fresh_counters(coordinator: Coordinator, since: float, timeout_s: float = 30.0) -> tuple[int, int]:
    """(wire, raw) bytes over all links, once every node has heartbeated after `since` (its counters are final)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = coordinator.status()
        if all(n.last_heartbeat_s < time.monotonic() - since for n in status.nodes) or time.monotonic() > deadline:
            return sum(link.wire_bytes for link in status.links), sum(link.raw_bytes for link in status.links)
        time.sleep(0.2)


def run(codec: str, steps: int, log_dir: Path) -> dict[str, object]:
    """Train one run with `codec` on activations and activation gradients; return its JSON figures."""
    cfg = load_config(None, [
        f"run.steps={steps}", f"scheduler.min_nodes={NODES}", f"emulation.links={LINK}", "scheduler.placement=uniform",
        f"compression.activations={codec}", f"compression.activation_grads={codec}",
    ])
    cfg.data.fingerprint = Corpus.load(cfg.data).fingerprint
    token = new_token()
    coordinator = Coordinator(cfg)
    server, port = make_coordinator_server(coordinator, token, "127.0.0.1:0")
    regions = {f"node-{i + 1}": ["--region", REGIONS[i % len(REGIONS)]] for i in range(NODES)}
    nodes = LocalNodes(f"127.0.0.1:{port}", token, log_dir, regions)
    server.start()
    try:
        for node_id in regions:
            nodes.start(node_id)
        summary = coordinator.run()
        wire, raw = _fresh_counters(coordinator, time.monotonic())
    finally:
        coordinator.shutdown_nodes("benchmark over", grace_s=1.0)
        nodes.stop_all()
        server.stop(grace=0.5).wait(2)
        coordinator.store.close()
    return {"codec": codec, "train_loss": summary.loss_last, "val_loss": summary.val_loss,
            "wire_bytes": wire, "raw_bytes": raw}


def main() -> None:
    """Run every codec and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=load_config().run.steps, help="steps per run (default: the config's)")
    parser.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated (default {','.join(CODECS)})")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="geotrain-bench-") as tmp:
        for codec in args.codecs.split(","):
            print(json.dumps(run(codec, args.steps, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
