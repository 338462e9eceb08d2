"""Plan versus reality on a loopback cluster: 4 emulated nodes of different speed in two regions joined by a slow link.

Trains the same run twice with `geotrain demo`: once with the uniform split (equal layer counts, nodes in join
order: scheduler.placement=uniform, one stage per node) and once with geotrain's plan from the nodes' measured
profiles (scheduler.placement=measured). For each it reads the run state (SQLite): the measured seconds per step
(median over the steps after the first) and the cost model's estimate for the plan that ran. Prints one JSON line
per strategy with keys strategy, measured_step_s, estimated_step_s (plus the estimate's error), then one line with
the measured speed-up.

    python bench/plan_vs_real.py [--steps 12] [--link 10/30]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(strategy: str, state_dir: Path, steps: int, link: str) -> dict:
    """Train one run; returns its measured and estimated step seconds."""
    # uniform: one stage per node, equal layer counts, nodes in join order; measured: the planner decides all.
    placement = "uniform" if strategy == "uniform" else "measured"
    cmd = [
        sys.executable, "-m", "geotrain", "demo", "--nodes", "4", "--stages", "0", "--http", "off",
        "--regions", "eu,us", "--slowdowns", "1,1,4,4", "--state-dir", str(state_dir), "--steps", str(steps),
        "--set", f"emulation.links=eu-us={link}", "--set", f"scheduler.placement={placement}",
        "--set", "run.eval_every=0",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"{strategy} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    db = sqlite3.connect(state_dir / "run.sqlite")
    try:
        seconds = [r[0] for r in db.execute("SELECT seconds FROM steps ORDER BY step")]
        estimate = db.execute("SELECT value FROM meta WHERE key = 'estimated_step_s'").fetchone()
        plan = [r[0] for r in db.execute("SELECT detail FROM events WHERE kind = 'plan' ORDER BY id")]
    finally:
        db.close()
    measured = statistics.median(seconds[1:])
    estimated = float(estimate[0]) if estimate else None
    return {
        "strategy": strategy,
        "measured_step_s": round(measured, 4),
        "estimated_step_s": round(estimated, 4) if estimated else None,
        "estimate_error": round(estimated / measured - 1, 3) if estimated else None,
        "plan": plan[-1] if plan else "",
    }


def main() -> None:
    """Run both strategies and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--link", default="10/30", help="the eu-us link: Mbit/s / one-way ms")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="geotrain-plan-vs-real-"))
    results = {}
    for strategy in ("uniform", "geotrain"):
        results[strategy] = run(strategy, work / strategy, args.steps, args.link)
        print(json.dumps(results[strategy]), flush=True)
    speedup = results["uniform"]["measured_step_s"] / results["geotrain"]["measured_step_s"]
    print(json.dumps({"measured_speedup": round(speedup, 3)}), flush=True)


if __name__ == "__main__":
    main()
