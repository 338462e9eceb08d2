"""Plan versus reality on a loopback cluster: how far the cost model's step time is from the step times measured.

Each configuration trains with `geotrain demo` (default byte GPT, nodes on this machine, --slowdown making them
unequal), once per strategy: uniform (equal layer counts, nodes in join order: scheduler.placement=uniform) and
geotrain (the planner's plan from the nodes' measured profiles: scheduler.placement=measured), each run `--runs` times.
A run's estimate is its last plan's prediction as the coordinator keeps it (meta predicted_step_s in the run state):
the cost model's estimate made once the plan's second step committed (replan.PREDICT_AFTER_STEPS: the first pays for
starting the plan, new stage state, channels, a replica's first all-reduce), at the plan's window, from the profiles
corrected by what the run had measured by then (scheduler.calibration: the nodes' compute seconds per microbatch and
averaging seconds, the data heads' round trips, the commit phase; the plan's first step no longer counts once its
second is in). Its measured
step time is the median over the plan's steps after those two, of which the prediction knows nothing. Each line's
runs carry the corrections the prediction used.

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

Figures (under the CPU lock on this 2-core machine):
- This version (the data heads' round trips priced per boundary crossing, a plan checked against profiles that came
  in before its first step, an auto window never lowered by in-run times), --steps 10, 3 runs each, one run of the
  whole script:
    {"config": "slowdowns", "median_abs_error": 0.124, "runs": 6, "measured_speedup": 1.728}
      uniform errors +0.127, +0.125, +0.342; geotrain -0.006, -0.099, +0.124
    {"config": "slow_link", "median_abs_error": 0.085, "runs": 6, "measured_speedup": 10.031}
      uniform -0.082, -0.085, -0.088; geotrain +0.086, -0.052, +0.121
    {"config": "replicas", "median_abs_error": 0.075, "runs": 6, "measured_speedup": 2.26}
      uniform -0.015, -0.056, -0.035; geotrain +0.117, +0.094, +0.143
  Within 15% in all three. On loopback the measured round trips exceed the priced ones by little: the cost per
  crossing the predictions used is 0-16 ms (slow_link uniform 13-16 ms, elsewhere 0-11 ms); the run's compute scale
  1.04-1.75.
- Before in-run calibration (profiles alone; median profiles, the window's waves, all-reduce at 8 bytes a value), 3
  runs each: median absolute error 0.078 (slowdowns), 0.197 (slow_link), 0.431 (replicas). Estimates were low
  wherever slowdown-1 nodes carried short steps (0.2 s), and in replicas by hivemind's fixed cost per all-reduce
  (0.2-0.25 s a round, where bytes over the probed ~1 Gbit/s are 0.026 s).
- With in-run calibration and the prediction after a plan's SECOND step (--steps 10, measured over
  the last plan's 8 or 7 steps after those two), 3 runs each, one run of the whole script under the lock:
    {"config": "slowdowns", "median_abs_error": 0.067, "runs": 6, "measured_speedup": 2.243}
      uniform errors +0.061, +0.049, +0.150; geotrain +0.134, +0.072, -0.042
    {"config": "slow_link", "median_abs_error": 0.013, "runs": 6, "measured_speedup": 8.62}
      uniform +0.009, -0.120, -0.002; geotrain -0.017, -0.007, +0.062
    {"config": "replicas", "median_abs_error": 0.114, "runs": 6, "measured_speedup": 2.589}
      uniform (2 x 2 replicas) -0.143, +0.065, +0.320; geotrain +0.099, +0.031, +0.128
  Within 15% in all three. Corrections the predictions used: the run's compute scale 1.11-2.0, hivemind's rounds
  0.15-0.25 s beyond their bytes (replicas uniform), commits 5-29 ms. The largest single error (+0.32, replicas
  uniform 3) is a prediction that took in a slow all-reduce round (0.251 s beyond its bytes, against 0.150 and 0.165
  in the other two runs).
- With in-run calibration, the prediction after a plan's first step (the version before), 3 runs each, --steps 8,
  one run of the whole script (12 minutes):
    {"config": "slowdowns", "median_abs_error": 0.111, "runs": 6, "measured_speedup": 1.749}
      uniform errors +0.199, +0.034, +0.134; geotrain +0.088, +0.387, +0.011
    {"config": "slow_link", "median_abs_error": 0.08, "runs": 6, "measured_speedup": 4.232}
      uniform +0.016, -0.125, +0.034; geotrain +0.025, +0.154, +0.148
    {"config": "replicas", "median_abs_error": 0.233, "runs": 6, "measured_speedup": 2.066}
      uniform (2 x 2 replicas) -0.199, +0.202, +0.396; geotrain (two slowdown-1 nodes, no replicas) +0.084, +0.263,
      +0.351
  The corrections the predictions used (in each run's line): the nodes' compute 1.0-3.0x their profiles (the run's
  scale 1.19-2.04, median 1.43), hivemind's rounds 0.19-0.25 s beyond their bytes, commits 6-21 ms. Slowdowns and
  slow_link meet the 15% goal; replicas does not, and why is measured: a prediction knows only its plan's first
  step, which ran 18-55% slower than the median of the steps after it in 10 of these 18 runs and 4-9% slower in 6
  (replicas uniform 1 and 2: 0.68-0.69 s against 0.45-0.52 s; their nodes start hivemind's DHT daemons and run
  their first all-reduce then), and later steps keep getting faster (replicas uniform 1: 0.68, 0.52, 0.55, 0.45,
  0.48, 0.57, 0.45 s).
  The model met the goal once its corrections came from steady steps: the same runs' estimates at their end
  (corrected from their last five steps, so no predictions; meta estimated_step_s) were off by a median absolute
  0.031 (slowdowns), 0.014 (slow_link) and 0.067 (replicas; at most 0.173), which is why the prediction now waits
  for one steady step (above).
- Emulated slowdowns: a --slowdown node's stretched task sends its tensors when the stretch ends (before, they left
  at once and reached the next stage a stretch early, so the pipeline outran the hardware it emulates and the
  model's fill, which counts each stage's whole time, looked high).
Still not modelled: contention of several pairs on one uplink, the all-reduce overlapping the drain, and a plan's
first step (its start-up), which the prediction leaves out and the measured median does not count.
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

from geotrain.scheduler.replan import PREDICT_AFTER_STEPS

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
    if len(seconds) < PREDICT_AFTER_STEPS + 2:
        raise RuntimeError(f"{config}/{strategy}: the last plan ran {len(seconds)} steps; run more (--steps)")
    if prediction["plan_epoch"] != epoch:
        raise RuntimeError(f"{config}/{strategy}: predicted for plan epoch {prediction['plan_epoch']}, not {epoch}")
    measured = statistics.median(seconds[PREDICT_AFTER_STEPS:])
    estimated = float(prediction["step_s"])
    return {
        "measured_step_s": round(measured, 4),
        "estimated_step_s": round(estimated, 4),
        "estimate_error": round(estimated / measured - 1, 3),
        "steps": len(seconds) - PREDICT_AFTER_STEPS,
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
