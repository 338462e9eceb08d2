"""Churn: 6 local nodes (3 stages x 2 replicas), a random node SIGKILLed every 20 s and restarted 5 s later.

Runs `geotrain demo --chaos` for the churn window and, for reference, the same demo without chaos; then reads the
run state (SQLite) of each. Prints JSON lines: one per failure (kill time to the next committed step), one per run,
and last one summary object with keys steps_completed, lost_steps, repeated_steps, throughput_ratio,
longest_stall_s, recovery_median_s, recovery_max_s.

    python bench/churn.py [--minutes 3] [--kill-every 20] [--down 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SETTINGS = [
    "run.steps=1000000", "run.eval_every=0", "scheduler.heartbeat_interval_s=0.5",
    "scheduler.heartbeat_timeout_s=2.5", "scheduler.checkpoint_every=20",
]


def run_demo(state_dir: Path, seconds: float, chaos: str | None) -> list[float]:
    """Run the demo for `seconds` of training; returns the unix times of the kills chaos made."""
    cmd = [sys.executable, "-m", "geotrain", "demo", "--nodes", "6", "--stages", "3", "--http", "off",
           "--state-dir", str(state_dir), *[a for s in SETTINGS for a in ("--set", s)]]
    if chaos:
        cmd += ["--chaos", chaos]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    kills: list[float] = []
    started = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("step"):
                started.set()
            if re.match(r"chaos: killed", line):
                kills.append(time.time())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not started.wait(120):
        proc.kill()
        raise RuntimeError("the demo did not start training")
    time.sleep(seconds)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    reader.join(5)
    return kills


def committed(state_dir: Path) -> tuple[list[tuple[int, float]], list[str]]:
    """(step, committed_at) of every committed step, and the details of rollback events."""
    db = sqlite3.connect(state_dir / "run.sqlite")
    try:
        steps = db.execute("SELECT step, committed_at FROM steps ORDER BY step").fetchall()
        rollbacks = [r[0] for r in db.execute("SELECT detail FROM events WHERE kind = 'rollback'")]
    finally:
        db.close()
    return steps, rollbacks


def main() -> None:
    """Run both demos and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--kill-every", type=float, default=20.0)
    parser.add_argument("--down", type=float, default=5.0)
    parser.add_argument("--baseline-minutes", type=float, help="length of the run without churn (default: --minutes)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="geotrain-churn-"))

    base_dir = work / "baseline"
    run_demo(base_dir, (args.baseline_minutes or args.minutes) * 60, None)
    base_steps, _ = committed(base_dir)
    base_rate = (len(base_steps) - 1) / (base_steps[-1][1] - base_steps[0][1])
    print(json.dumps({"run": "baseline", "steps": len(base_steps), "steps_per_s": round(base_rate, 3)}), flush=True)

    churn_dir = work / "churn"
    kills = run_demo(churn_dir, args.minutes * 60, f"kill-every={args.kill_every}s,down={args.down}s,seed=1")
    steps, rollbacks = committed(churn_dir)
    times = [t for _, t in steps]
    recoveries = []
    for killed_at in [k for k in kills if k > times[0]]:  # a kill before the first step only delays the start
        after = [t for t in times if t > killed_at]
        if after:
            recoveries.append(after[0] - killed_at)
            print(json.dumps({"failure_at_s": round(killed_at - times[0], 1), "recovery_s": round(recoveries[-1], 2)}),
                  flush=True)
    rate = (len(times) - 1) / (times[-1] - times[0])
    print(json.dumps({"run": "churn", "steps": len(steps), "kills": len(kills), "steps_per_s": round(rate, 3)}),
          flush=True)
    numbers = [s for s, _ in steps]
    repeated = 0
    for detail in rollbacks:  # "from step A to step B": steps B..A-1 were undone and trained again
        a, b = (int(x) for x in re.findall(r"\d+", detail))
        repeated += a - b
    print(json.dumps({
        "steps_completed": len(steps),
        "lost_steps": len(set(range(max(numbers) + 1)) - set(numbers)),
        "repeated_steps": repeated,
        "throughput_ratio": round(rate / base_rate, 3),
        "longest_stall_s": round(max(b - a for a, b in zip(times, times[1:])), 2),
        "recovery_median_s": round(statistics.median(recoveries), 2) if recoveries else None,
        "recovery_max_s": round(max(recoveries), 2) if recoveries else None,
    }), flush=True)


if __name__ == "__main__":
    main()
