"""Plan versus reality on a loopback cluster: how far the cost model's step time is from the step times measured.

Each configuration trains with `geotrain demo` (default byte GPT, nodes on this machine, --slowdown making them
unequal), once per strategy: uniform (equal layer counts, nodes in join order: scheduler.placement=uniform) and
geotrain (the planner's plan from the nodes' measured profiles: scheduler.placement=measured), each run `--runs` times.
A run's measured step time is the median over the steps of its last plan epoch after that epoch's first (the first
pays for starting the plan: new stage state, channels); its estimate is the cost model's for that plan from the
latest profiles, at the plan's window, as the coordinator keeps it (run state, SQLite).

Configurations:
    slowdowns  3 nodes in one region, --slowdowns 1,2,4: uniform runs one stage per node
    slow_link  4 nodes, regions eu,us in turn (node-1 and node-3 in eu) and --slowdowns 1,2, eu-us emulated at
               10 Mbit/s and 30 ms (emulation.links)
    replicas   4 nodes in one region, --slowdowns 1,1,2,2, 2 stages: each stage has replicas averaging over hivemind
               (in one region: hivemind's traffic does not pass the link emulator)

One JSON line per configuration and strategy: config, strategy, measured_step_s, estimated_step_s, estimate_error
(estimate / measured - 1; medians over the runs) and the runs; then one line per configuration with the median
absolute error over all its runs and the measured speed-up of geotrain over uniform.

    python bench/plan_vs_real.py [--steps 10] [--runs 3] [--config slowdowns ...]

Figures (--steps 8, each configuration alone under the CPU lock on this 2-core machine):
- One run each, median profiles, before the window's waves (a diagnostic run with the phases timed, slowdowns
  2,3,6 / 2,3 / 2,2,4,4 for the three configurations): slowdowns uniform
  +9%, geotrain -6%; slow_link uniform +13%: Little's law charged a window of 4 that holds the whole step (M = 4)
  1.22 s of pacing (as waves: 2.27 s against 2.52 s measured, -10%), geotrain +20%; replicas uniform -16%: the
  replicas' hivemind all-reduce took 0.2-0.25 s (microbatches done to norms in) where the model, from loopback probes
  of about 1 Gbit/s, counts 0.026 s; geotrain -2%, the planner left the slow pair out (no replicas).
- Every layer's fastest timed run instead of the median (tried, not kept): every estimate low, median absolute
  error 0.195 (slowdowns), 0.225 (slow_link), 0.35 (replicas): a stage's forward and backward tasks in the run take
  longer than its layers' fastest runs alone (tensor decoding and encoding, float64 gradient sums, the node's other
  threads), so profiles keep the median.
- This version (median profiles, the window's waves, all-reduce at 8 bytes a value), 3 runs each:
    {"config": "slowdowns", "median_abs_error": 0.078, "runs": 6, "measured_speedup": 2.064}
      uniform errors -0.082, -0.055, -0.014; geotrain -0.176, +0.074, +0.156
    {"config": "slow_link", "median_abs_error": 0.197, "runs": 6, "measured_speedup": 8.025}
      uniform -0.146, -0.013, +0.029; geotrain (two slowdown-1 nodes in eu, 0.21 s steps) -0.262, -0.398, -0.248
    {"config": "replicas", "median_abs_error": 0.431, "runs": 6, "measured_speedup": 2.056}
      uniform (2 x 2 replicas) -0.496, -0.431, -0.506; geotrain (two slowdown-1 nodes, no replicas) -0.309, -0.431,
      -0.245
  The 15% goal holds for slowdowns only. Estimates are low wherever slowdown-1 nodes carry short steps (0.2 s): the
  per-step costs below are a larger share of them, and nodes that compute without sleeping share the 2 cores.
Not modelled, and the largest errors left: hivemind's fixed cost per all-reduce (replicas), the commit phase
(0.015-0.065 s per step without replicas: the commit order, float64 means and gradient norms, their reports), and
the spread of profiles measured while the other local nodes start (one slowdown-6 node timed its blocks at 0.09 s in
one run and 0.13 s in another).
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

STRATEGIES = ("uniform", "geotrain")
CONFIGS: dict[str, dict[str, list[str]]] = {
    # Flags of `geotrain demo` per configuration; "stages" per strategy below.
    "slowdowns": {"demo": ["--nodes", "3", "--slowdowns", "1,2,4"], "settings": []},
    "slow_link": {
        "demo": ["--nodes", "4", "--regions", "eu,us", "--slowdowns", "1,2"],
        "settings": ["emulation.links=eu-us=10/30"],
    },
    "replicas": {"demo": ["--nodes", "4", "--slowdowns", "1,1,2,2", "--stages", "2"], "settings": []},
}


def run(config: str, strategy: str, state_dir: Path, steps: int) -> dict:
    """Train one run; returns its measured and estimated step seconds and the plan that ran."""
    placement = "uniform" if strategy == "uniform" else "measured"
    flags = list(CONFIGS[config]["demo"])
    if "--stages" not in flags:
        # uniform: one stage per node; geotrain: the planner chooses the stages too.
        flags += ["--stages", "0" if strategy == "geotrain" else flags[flags.index("--nodes") + 1]]
    settings = [*CONFIGS[config]["settings"], f"scheduler.placement={placement}", "run.eval_every=0"]
    cmd = [
        sys.executable, "-m", "geotrain", "demo", *flags, "--http", "off", "--state-dir", str(state_dir),
        "--steps", str(steps), *(arg for s in settings for arg in ("--set", s)),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"{config}/{strategy} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    db = sqlite3.connect(state_dir / "run.sqlite")
    try:
        epoch = int(db.execute("SELECT value FROM meta WHERE key = 'plan_epoch'").fetchone()[0])
        seconds = [r[0] for r in db.execute("SELECT seconds FROM steps WHERE plan_epoch = ? ORDER BY step", (epoch,))]
        prediction = json.loads(db.execute("SELECT value FROM meta WHERE key = 'predicted_step_s'").fetchone()[0])
        plan = [r[0] for r in db.execute("SELECT detail FROM events WHERE kind = 'plan' ORDER BY id")]
    finally:
        db.close()
    if len(seconds) < 3:
        raise RuntimeError(f"{config}/{strategy}: the last plan ran {len(seconds)} steps; run more (--steps)")
    if prediction["plan_epoch"] != epoch:
        raise RuntimeError(f"{config}/{strategy}: the prediction is for plan epoch {prediction['plan_epoch']}, not {epoch}")
    measured = statistics.median(seconds[1:])
    estimated = float(prediction["step_s"])
    return {
        "measured_step_s": round(measured, 4),
        "estimated_step_s": round(estimated, 4),
        "estimate_error": round(estimated / measured - 1, 3),
        "steps": len(seconds) - 1,
        "corrections": {k: v for k, v in prediction.items() if k not in ("plan_epoch", "step_s")},
        "plan": plan[-1],
    }


def main() -> None:
    """Run every configuration and strategy --runs times and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS), help="only these (default: all)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="geotrain-plan-vs-real-"))
    for config in args.config or CONFIGS:
        errors, measured = [], {}
        for strategy in STRATEGIES:
            runs = [run(config, strategy, work / f"{config}-{strategy}-{i}", args.steps) for i in range(args.runs)]
            line = {"config": config, "strategy": strategy}
            for key in ("measured_step_s", "estimated_step_s", "estimate_error"):
                line[key] = round(statistics.median(r[key] for r in runs), 4)
            print(json.dumps({**line, "runs": runs}), flush=True)
            errors += [abs(r["estimate_error"]) for r in runs]
            measured[strategy] = line["measured_step_s"]
        print(json.dumps({
            "config": config,
            "median_abs_error": round(statistics.median(errors), 3),
            "runs": len(errors),
            "measured_speedup": round(measured["uniform"] / measured["geotrain"], 3),
        }), flush=True)


if __name__ == "__main__":
    main()
