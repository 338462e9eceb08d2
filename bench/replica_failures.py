"""Steps a clean replicated run redoes: four local nodes as 2 stages x 2 replicas, no faults injected.

Every failure in such a run is a defect (hivemind's all-reduce returning partial results was one), so the figure to
see is failures 0. Measured with --steps 200: failures 6 (122.5 s) before a replica's stream to a reducer was closed
by the sender, 0 (121.4 s) after. One JSON line per run: steps, failures (steps that failed and were redone), why (the coordinator's
reasons), wall_s. Run: python bench/replica_failures.py [--steps 60] [--runs 1]
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
from geotrain.localnodes import LocalNodes
from geotrain.scheduler.service import CoordinatorProcess

NODES = 4


def run(steps: int, log_dir: Path) -> dict[str, object]:
    """Train one clean 2x2 run; its step count, failures and their reasons."""
    cfg = load_config(None, [
        f"run.steps={steps}", f"scheduler.min_nodes={NODES}", "scheduler.stages=2", "scheduler.placement=uniform",
        "run.eval_every=0", "train.microbatches=4",
        "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=2.5",
    ])
    cfg.data.fingerprint = Corpus.load(cfg.data).fingerprint
    token = new_token()
    why: list[str] = []
    host = CoordinatorProcess(
        cfg, token, "127.0.0.1:0", on_event=lambda kind, e: why.append(str(e["why"])) if kind == "failure" else None
    )
    nodes = LocalNodes(f"127.0.0.1:{host.port}", token, log_dir)
    host.server.start()
    started = time.monotonic()
    try:
        for i in range(NODES):
            nodes.start(f"node-{i + 1}")
        summary = host.coordinator.run()
    finally:
        host.coordinator.shutdown_nodes("benchmark over", grace_s=1.0)
        nodes.stop_all()
        host.close()
    return {"steps": summary.steps, "failures": host.coordinator.failures, "why": why,
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> None:
    """Run the clean replicated run --runs times and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--keep-logs", type=Path, help="write the nodes' logs here instead of a temporary directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="geotrain-bench-") as tmp:
        log_dir = args.keep_logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(args.runs):
            print(json.dumps(run(args.steps, log_dir)), flush=True)


if __name__ == "__main__":
    main()
