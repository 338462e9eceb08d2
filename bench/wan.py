"""Throughput over a slow WAN: tokens/s of a loopback pipeline whose hops are emulated at 20 Mbit/s and 50 ms.

`geotrain demo` with three stages on nodes that each have an emulated 20 Mbit/s, 50 ms uplink (`--uplink 20/50`)
carrying all their traffic, so every hop is shaped whatever order the nodes join in (with regions alternating
between two, an order that put the two nodes of one region next to each other left a hop unshaped) and the middle
stage's activations and gradients share one uplink, as a real node's do; once per codec on activations and
activation gradients. The
default model's activations are 8 x 64 x 128 float32 = 256 KiB per microbatch, about 0.1 s per hop at 20 Mbit/s
against a few tens of ms of compute per stage, so the links are the bottleneck. One JSON line per codec:
codec, tokens_per_s (the run's mean). Run: python bench/wan.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CODECS = ["none", "int8", "auto"]
REPO = Path(__file__).resolve().parent.parent


def run(codec: str, steps: int) -> dict[str, object]:
    """One demo run with `codec`; returns its JSON figures."""
    settings = [
        # All 8 microbatches in flight: a microbatch's round trip crosses four 50 ms hops, and the default window
        # of 4 would cap a compressed run's pace at round trip / 4 instead of the links' rate.
        "train.microbatches=8", "train.inflight=8", "run.eval_every=0", "scheduler.placement=uniform",
        f"compression.activations={codec}", f"compression.activation_grads={codec}",
    ]
    cmd = [sys.executable, "-m", "geotrain", "demo", "--nodes", "3", "--steps", str(steps), "--uplink", "20/50",
           "--http", "off", "--json", *(arg for s in settings for arg in ("--set", s))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"demo with {codec} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {"codec": codec, "tokens_per_s": summary["tokens_per_s"]}


def main() -> None:
    """Run every codec and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    args = parser.parse_args()
    for codec in CODECS:
        print(json.dumps(run(codec, args.steps)), flush=True)


if __name__ == "__main__":
    main()
