"""Loss against bytes per codec: the default model, the same steps and data, each codec on activations and gradients.

A real run per codec: an in-process coordinator and three `geotrain join` processes in two alternating regions
whose links are emulated at 20 Mbit/s and 50 ms, so that `auto` has a narrow link to adapt to (the other codecs
train identically on any link). One JSON line per run: codec, train_loss (the last step's), val_loss (the
final validation pass), wire_bytes and raw_bytes (summed over every link's counters, from the nodes' heartbeats
after the run). Run: python bench/convergence.py [--steps N] [--codecs none,int8]

With --replica-grads none,powersgd:rank=4 it runs once per replica averaging instead: the three nodes serve one
stage as replicas (no activations cross a link) and average their gradients exactly or through PowerSGD; one JSON
line per run: replica_grads, train_loss, val_loss.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from geotrain.config import RunConfig, load_config
from geotrain.node.data import Corpus
from geotrain.protocol.auth import new_token
from geotrain.protocol.geotrain_pb2 import StatusReply
from geotrain.scheduler.coordinator import Coordinator, RunSummary
from geotrain.localnodes import LocalNodes
from geotrain.scheduler.service import CoordinatorProcess

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


def train(
    cfg: RunConfig, node_args: dict[str, list[str]], log_dir: Path
) -> tuple[RunSummary, int, int, StatusReply]:
    """Train cfg on an in-process coordinator and one `geotrain join` process per node_args entry (its flags); the
    summary, the links' (wire, raw) bytes and the final status."""
    cfg.data.fingerprint = Corpus.load(cfg.data).fingerprint
    token = new_token()
    host = CoordinatorProcess(cfg, token, "127.0.0.1:0")  # with the DHT that replicas find each other through
    coordinator = host.coordinator
    nodes = LocalNodes(f"127.0.0.1:{host.port}", token, log_dir, node_args)
    host.server.start()
    try:
        for node_id in node_args:
            nodes.start(node_id)
        summary = coordinator.run()
        wire, raw = _fresh_counters(coordinator, time.monotonic())
        status = coordinator.status()
    finally:
        coordinator.shutdown_nodes("benchmark over", grace_s=1.0)
        nodes.stop_all()
        host.close()
    return summary, wire, raw, status


def run(settings: list[str], steps: int, log_dir: Path) -> tuple[RunSummary, int, int]:
    """Train one run with these config settings; its summary and its links' (wire, raw) bytes."""
    cfg = load_config(None, [
        f"run.steps={steps}", f"scheduler.min_nodes={NODES}", f"emulation.links={LINK}", "scheduler.placement=uniform",
        *settings,
    ])
    regions = {f"node-{i + 1}": ["--region", REGIONS[i % len(REGIONS)]] for i in range(NODES)}
    summary, wire, raw, _ = train(cfg, regions, log_dir)
    return summary, wire, raw


def run_codec(codec: str, steps: int, log_dir: Path) -> dict[str, object]:
    """Train one run with `codec` on activations and activation gradients; return its JSON figures."""
    summary, wire, raw = run([f"compression.activations={codec}", f"compression.activation_grads={codec}"], steps,
                             log_dir)
    return {"codec": codec, "train_loss": summary.loss_last, "val_loss": summary.val_loss,
            "wire_bytes": wire, "raw_bytes": raw}


def run_replicas(replica_grads: str, steps: int, log_dir: Path) -> dict[str, object]:
    """Train one run on one stage of replicas that average their gradients by `replica_grads`."""
    summary, _, _ = run(["scheduler.stages=1", f"compression.replica_grads={replica_grads}"], steps, log_dir)
    return {"replica_grads": replica_grads, "train_loss": summary.loss_last, "val_loss": summary.val_loss}


def main() -> None:
    """Run every codec and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=load_config().run.steps, help="steps per run (default: the config's)")
    parser.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated (default {','.join(CODECS)})")
    parser.add_argument("--replica-grads", help="comma-separated replica averagings to compare instead of codecs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    runs = [(run_codec, c) for c in args.codecs.split(",")]
    if args.replica_grads:
        runs = [(run_replicas, r) for r in args.replica_grads.split(",")]
    with tempfile.TemporaryDirectory(prefix="geotrain-bench-") as tmp:
        for one, what in runs:
            print(json.dumps(one(what, args.steps, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
