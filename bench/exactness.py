"""Distance from train-local over long runs: a real coordinator and node processes train a tiny model, then the
same run trains in one process, and the largest parameter difference between the two is printed.

One JSON line per run: nodes, stages, steps, kill_after (the step after which a replica was killed, or null),
regions, max_abs_diff, wall_s. Run: python bench/exactness.py [--steps 300] [--layouts 3x3,4x2] [--kill STEP]
[--regions eu,us --set scheduler.allreduce=hierarchical]. A layout NxS is N nodes serving S stages (4x2: two stages
of two replicas); --regions deals the nodes into those regions in turn.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import threading
import time
from pathlib import Path

import torch

from geotrain.config import RunConfig, load_config
from geotrain.node.data import Corpus
from geotrain.node.local import train_local
from geotrain.protocol.auth import new_token
from geotrain.localnodes import LocalNodes
from geotrain.scheduler.service import CoordinatorProcess, fetch_model_state

# Small enough that a step costs the RPCs more than the compute; clipping stays active for most of the run.
TINY = [
    "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.seq_len=16", "train.microbatch_size=2",
    "train.microbatches=4", "train.inflight=4", "run.eval_every=0", "run.eval_microbatches=1",
    "scheduler.placement=uniform", "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=2.5",
]


def tiny_config(steps: int, stages: int, *overrides: str) -> RunConfig:
    """The tiny run of `steps` steps on `stages` stages."""
    return load_config(None, [*TINY, f"run.steps={steps}", f"scheduler.stages={stages}", *overrides])


def local_reference(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """train-local's final parameters for cfg, computed on one thread like the nodes LocalNodes starts (LayerNorm's
    parameter gradients depend on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runtime, _ = train_local(cfg)
    finally:
        torch.set_num_threads(threads)
    return {name: p.detach().clone() for name, p in runtime.named_state()}


def distributed(
    cfg: RunConfig, n_nodes: int, log_dir: Path, kill_after: int | None, regions: list[str]
) -> dict[str, torch.Tensor]:
    """Train cfg on n_nodes local node processes dealt into `regions` (SIGKILLing the last stage's second replica
    once step kill_after is committed); returns the final parameters."""
    cfg.scheduler.min_nodes = n_nodes
    cfg.data.fingerprint = Corpus.load(cfg.data).fingerprint
    token = new_token()
    host = CoordinatorProcess(cfg, token, "127.0.0.1:0")
    coordinator = host.coordinator
    node_args = {f"node-{i + 1}": ["--region", regions[i % len(regions)]] for i in range(n_nodes)} if regions else None
    nodes = LocalNodes(f"127.0.0.1:{host.port}", token, log_dir, node_args)
    host.server.start()

    def kill() -> None:
        while coordinator.step <= kill_after and not coordinator.stop_requested.is_set():
            time.sleep(0.02)
        nodes.kill(coordinator.plan.stages[-1].node_ids[1])

    try:
        for i in range(n_nodes):
            nodes.start(f"node-{i + 1}")
        if kill_after is not None:
            threading.Thread(target=kill, daemon=True).start()
        summary = coordinator.run()
        return fetch_model_state(coordinator.plan, token, summary.steps, coordinator.key)
    finally:
        coordinator.stop_requested.set()
        coordinator.shutdown_nodes("benchmark over", grace_s=1.0)
        nodes.stop_all()
        host.close()


def main() -> None:
    """Run each layout and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layouts", default="3x3,4x2", help="comma-separated NODESxSTAGES (default 3x3,4x2)")
    parser.add_argument("--kill", type=int, default=None, help="kill a replica after this step (replicated layouts)")
    parser.add_argument("--regions", default="", help="comma-separated regions the nodes are dealt into")
    parser.add_argument("--set", action="append", default=[], help="extra config settings")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="geotrain-exact-") as tmp:
        for layout in args.layouts.split(","):
            n_nodes, stages = map(int, layout.split("x"))
            kill_after = args.kill if n_nodes > stages else None
            started = time.monotonic()
            regions = [r for r in args.regions.split(",") if r]
            state = distributed(tiny_config(args.steps, stages, *args.set), n_nodes, Path(tmp), kill_after, regions)
            exact = local_reference(tiny_config(args.steps, stages, *args.set))
            diff = max(float((state[k] - exact[k]).abs().max()) for k in exact)
            print(json.dumps({"nodes": n_nodes, "stages": stages, "steps": args.steps, "kill_after": kill_after,
                              "regions": regions, "max_abs_diff": diff, "wall_s": round(time.monotonic() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
