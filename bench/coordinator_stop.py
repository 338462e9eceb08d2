"""A coordinator stopped mid-run (SIGTERM, then SIGKILL) and resumed `--down` seconds later: the same two node
processes, never restarted, wait for it and finish the run.

Runs `geotrain coordinator --state-dir` with two local `geotrain join` nodes (byte GPT, two stages), stops the
coordinator once it printed step `--stop-at` (SIGTERM, and in the next incarnation SIGKILL, each once the run is
`--every` steps further), starts it again with `--resume` after `--down` seconds, and prints one JSON line per stop:
the signal, the step it stopped after, the seconds from the restart (its process started) to the next committed
step, and from its listening line to that step; and a last line with the final parameters' largest difference from
train-local's and whether every node process lived through both stops.

    OMP_NUM_THREADS=1 python bench/coordinator_stop.py [--down 20] [--steps 10] [--stop-at 3] [--every 3]

This version's run (`--down 20`, the defaults otherwise, under the shared lock on 2 cores):

    {"signal": "SIGTERM", "stopped_after_step": 3, "exit_code": 130, "down_s": 20.0, "next_committed_step": 4,
     "restart_to_commit_s": 3.09, "listening_to_commit_s": 1.92}
    {"signal": "SIGKILL", "stopped_after_step": 7, "exit_code": -9, "down_s": 20.0, "next_committed_step": 8,
     "restart_to_commit_s": 3.16, "listening_to_commit_s": 2.02}
    {"final_max_abs_diff_vs_train_local": 0.0, "same_node_processes": true}

3.1-3.2 s from the restart to the next committed step after either stop, the step after the last one committed (no
rollback): about 1.15 s of the coordinator's start-up, then the nodes' next redial (at most 2 s apart once away),
their registration and one step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ECHO = "--echo" in sys.argv  # the coordinators' output, timed, on stderr
REPO = Path(__file__).resolve().parent.parent
SETTINGS = [
    "run.eval_every=0", "train.microbatches=4", "scheduler.heartbeat_interval_s=0.5",
    "scheduler.heartbeat_timeout_s=2.5", "scheduler.placement=uniform", "scheduler.min_nodes=2",
    "scheduler.checkpoint_every=100", "profile.layer_repeats=1",
]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _coordinator(port: int, token: str, state_dir: Path, settings: list[str], *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "geotrain", "coordinator", "--listen", f"127.0.0.1:{port}", "--token", token,
        "--state-dir", str(state_dir), *extra, *[a for s in settings for a in ("--set", s)],
    ]
    # Its own process group: a SIGKILL of the group takes its DHT fork too, as a host's crash would. Not a session of
    # its own: Linux gives each session an equal share of the CPU, which would weigh the coordinator against the nodes.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO,
                            process_group=0)


def _until(proc: subprocess.Popen, pattern: str) -> tuple[re.Match, float]:
    """The first line of proc's output matching pattern, and when it came (time.monotonic())."""
    seen = []
    for line in proc.stdout:
        if _ECHO:
            print(f"{time.monotonic():.2f} {line}", end="", file=sys.stderr)
        if m := re.match(pattern, line):
            return m, time.monotonic()
        seen.append(line)
    raise RuntimeError(f"exited with {proc.wait()} before printing {pattern!r}: {''.join(seen)[-3000:]}")


def stop_and_resume(
    work_dir: Path, down_s: float, steps: int, stop_at: int, every: int, settings: list[str] = SETTINGS
) -> tuple[list[dict], Path, bool]:
    """The scenario of this file: one dict per stop, the final model's path, and whether the node processes that
    started the run are the ones that finished it."""
    from geotrain.localnodes import LocalNodes
    from geotrain.protocol.auth import new_token

    token, state_dir = new_token(), work_dir / "state"
    settings = [*settings, f"run.steps={steps}"]
    final = state_dir / "final.safetensors"
    with socket.socket() as s:  # a free port, which the coordinator keeps across its restarts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    coordinator = _coordinator(port, token, state_dir, settings)
    nodes = LocalNodes(f"127.0.0.1:{port}", token, work_dir)
    stops: list[dict] = []
    try:
        procs = [nodes.start(f"node-{i}") for i in (1, 2)]
        pids = [p.pid for p in nodes.procs.values()]
        at = stop_at
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _until(coordinator, rf"step\s+{at}/{steps}\b")
            if sig == signal.SIGTERM:
                coordinator.send_signal(sig)
                _until(coordinator, r"geotrain: coordinator stopped; the run is paused")
            else:
                os.killpg(coordinator.pid, sig)
            code = coordinator.wait(60)
            time.sleep(down_s)
            restarted = time.monotonic()
            coordinator = _coordinator(port, token, state_dir, settings, "--resume",
                                       *(["--save-final", str(final)] if sig == signal.SIGKILL else []))
            _, listening = _until(coordinator, r"coordinator listening on")
            m, committed = _until(coordinator, r"step\s+(\d+)/")
            stops.append({
                "signal": sig.name, "stopped_after_step": at, "exit_code": code, "down_s": down_s,
                "next_committed_step": int(m.group(1)), "restart_to_commit_s": round(committed - restarted, 2),
                "listening_to_commit_s": round(committed - listening, 2),
            })
            at = int(m.group(1)) + every
        _until(coordinator, rf"done: {steps} steps")
        if coordinator.wait(60) != 0:
            raise RuntimeError(f"the last coordinator exited with {coordinator.returncode}")
        same_nodes = [p.pid for p in nodes.procs.values()] == pids and all(p.poll() in (None, 0) for p in procs)
    finally:
        if coordinator.poll() is None:
            os.killpg(coordinator.pid, signal.SIGKILL)
            coordinator.wait()
        nodes.stop_all()
    return stops, final, same_nodes


def main() -> None:
    """Print the figures as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--down", type=float, default=20.0, help="seconds the coordinator stays down")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--stop-at", type=int, default=3)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--echo", action="store_true", help="copy the coordinators' output, timed, to stderr")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from safetensors.torch import load_file

    from geotrain.config import load_config
    from geotrain.node.local import train_local

    with tempfile.TemporaryDirectory() as d:
        stops, final, same_nodes = stop_and_resume(Path(d), args.down, args.steps, args.stop_at, args.every)
        for stop in stops:
            print(json.dumps(stop), flush=True)
        torch.set_num_threads(1)
        runtime, _ = train_local(load_config(None, [*SETTINGS, f"run.steps={args.steps}"]))
        reference = {name: p.detach() for name, p in runtime.named_state()}
        state = load_file(final)
        diff = max((state[k] - reference[k]).abs().max().item() for k in reference)
    print(json.dumps({"final_max_abs_diff_vs_train_local": diff, "same_node_processes": same_nodes}), flush=True)


if __name__ == "__main__":
    main()
