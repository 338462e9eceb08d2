"""The same 3-stage run in fp32, bf16 and fp16: speed, loss, bytes on the wire and memory per precision.

A real run per precision: an in-process coordinator and three `geotrain join` processes on --device, the default
model and the demo's steps, codec none on every link. One JSON line per precision: precision, device, tokens_per_s
(the coordinator's, over the whole run), val_loss (the final validation pass), wire_bytes (every link's counter,
from the nodes' last heartbeats), wire_vs_fp32 (wire_bytes over fp32's, when fp32 ran first) and
peak_memory_bytes (the largest node's: device memory allocated on CUDA, resident host memory on the CPU). A
precision the device cannot compute in prints one line saying so instead. bf16 and fp16 send activations and their
gradients in 16 bits, so codec none's bytes halve; the CPU computes them through autocast too, without
AVX512-BF16 or AMX much slower than fp32 (its figures measure correctness, not a GPU's speed).
Run: python bench/precision.py [--device cpu] [--precisions fp32,bf16,fp16] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

from convergence import train

from geotrain.config import load_config
from geotrain.node.device import describe, resolve_device, supports

NODES = 3


def run(precision: str, device: str, steps: int, log_dir: Path) -> dict[str, object]:
    """Train the 3-stage run in `precision` on `device`; its JSON figures."""
    cfg = load_config(None, [
        f"run.steps={steps}", f"scheduler.min_nodes={NODES}", f"scheduler.stages={NODES}",
        "scheduler.placement=uniform", f"train.precision={precision}",
    ])
    summary, wire, _, status = train(cfg, {f"node-{i + 1}": ["--device", device] for i in range(NODES)}, log_dir)
    return {
        "precision": precision,
        "device": status.nodes[0].device,
        "tokens_per_s": round(summary.tokens_per_s, 1),
        "val_loss": summary.val_loss,
        "wire_bytes": wire,
        "peak_memory_bytes": max(n.peak_memory_bytes for n in status.nodes),
    }


def main() -> None:
    """Run every precision the device supports and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="every node's --device (default cpu)")
    parser.add_argument("--precisions", default="fp32,bf16,fp16", help="comma-separated (default fp32,bf16,fp16)")
    parser.add_argument("--steps", type=int, default=load_config().run.steps, help="steps (default: the demo's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = resolve_device(args.device)
    fp32_wire = None
    with tempfile.TemporaryDirectory(prefix="geotrain-bench-") as tmp:
        for precision in args.precisions.split(","):
            if not supports(device, precision):
                print(json.dumps({"precision": precision, "device": describe(device),
                                  "skipped": f"{describe(device)} cannot compute in {precision}"}), flush=True)
                continue
            figures = run(precision, args.device, args.steps, Path(tmp))
            if precision == "fp32":
                fp32_wire = figures["wire_bytes"]
            if fp32_wire:
                figures["wire_vs_fp32"] = round(figures["wire_bytes"] / fp32_wire, 4)
            print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
