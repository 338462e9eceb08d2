"""A llama no single node can hold (#28): local nodes each under a real memory cap, a checkpoint, a SIGKILL and a rejoin.

A coordinator and --nodes `geotrain join` processes on 127.0.0.1, each node started inside a cgroup v1 memory cgroup
this bench creates under /sys/fs/cgroup/memory (memory.limit_in_bytes = --cap-gib, less than the whole model's
training state), one compute thread each. The run trains --steps steps of a llama (by default d_model 1024, 24
blocks, SwiGLU 2816 wide, vocab 32000: 374M parameters, about 9 GB of training state) on the byte corpus, checkpoints
every --checkpoint-every steps; once step --kill-after is committed one node is SIGKILLed, and started again with the
same state dir once the coordinator has seen it die; the run rolls back to the checkpoint and finishes. Then
train-local trains the same config in one process (one thread, no cap) and its final parameters are compared with the
run's last checkpoint.

One JSON line per node incarnation: peak_rss_bytes (the process's VmHWM, sampled every 0.2 s), cgroup_max_usage_bytes
(page cache included), planned_bytes (the plan's estimate of the node's peak: geotrain status' planned_memory_bytes,
the largest the node was planned at), error (peak_rss / planned - 1), peak_in_step (the step being trained when the
peak was first seen; 0: before the first commit, profiling included), failcnt and oom_kills of its cgroup. Then one
line for the run: params, state_bytes (training state of the whole model), cap_bytes, coordinator_peak_rss_bytes,
checkpoint_bytes (the last checkpoint's files), step_s (median commit-to-commit seconds of the steps during which
no checkpoint was being written), checkpoint_step_s (the same for the steps during which one was, from its start to
its manifest as the coordinator's log says, however little of the step it took), checkpoint_cost (their ratio - 1),
steps_s and checkpoint_steps_s (every such step's seconds: the spread the medians come from), checkpoint_write_s
(each checkpoint's start to manifest),
rejoin_s (the restarted node's process start to serving, its state load included) and rejoin_profile_s (start to its
profile on the coordinator: what the cached profile saves), run_exit (the coordinator's exit code: 0 when the run
finished), max_abs_diff (last checkpoint vs train-local), local_s (train-local's process, start to exit: the same
steps in one process, alone on the machine), oom_killed, wall_s.

Run (as root, under the CPU lock): flock /work/cpu.lock .venv/bin/python bench/scale.py [--small] [--keep]

This version (each step's mean gradients written into the same buffers, b9f3127), the defaults (374M parameters,
three nodes capped at 5 GiB, 30 steps, a checkpoint every 6, one node SIGKILLed after step 10, the run rolled back to
step 6's checkpoint), the lock held, warm-up steps left out; the version before it (be098a1) run just before, the same
hour:
    {"node": "node-1", "peak_rss_bytes": 3643240448, "planned_bytes": 4098801664, "error": -0.111, "peak_in_step": 24}
    {"node": "node-2", "peak_rss_bytes": 4051808256, "planned_bytes": 4419608576, "error": -0.083, "peak_in_step": 18}
    {"node": "node-3", "peak_rss_bytes": 3373805568, "planned_bytes": 3788382208, "error": -0.109, "peak_in_step": 3}
    {"node": "node-3 rejoined", "peak_rss_bytes": 3418214400, "planned_bytes": 3788382208, "error": -0.098, ...}
    {"run": "scale", "params": 373867520, "state_bytes": 8972820480, "cap_bytes": 5368709120,
     "coordinator_peak_rss_bytes": 374423552, "checkpoint_bytes": 4489557471, "step_s": 2.33,
     "checkpoint_step_s": 2.74, "checkpoint_cost": 0.172,
     "steps_s": [2.79, 2.19, 2.69, 2.3, 2.32, 2.82, 2.21, 2.35, 2.3, 2.1, 2.66, 2.44],
     "checkpoint_steps_s": [2.08, 3.35, 2.39, 2.62, 2.26, 3.35, 2.55, 2.18, 2.49, 2.9, 3.43, 2.94, 2.91, 2.85],
     "checkpoint_write_s": [10.5, 8.6, 8.5, 10.8, 3.4], "rejoin_s": 9.82, "rejoin_profile_s": 1.29, "run_exit": 0,
     "max_abs_diff": 0.0, "local_s": 122.3, "oom_killed": 0, "wall_s": 269.3, ...}
    be098a1: {"run": "scale", ..., "step_s": 2.59, "checkpoint_step_s": 3.31, "checkpoint_cost": 0.28, ...,
     "max_abs_diff": 0.0, "local_s": 162.2, ..., "wall_s": 317.6}, its nodes 7.0-10.2% under plan
Each step's mean gradient had been a fresh tensor, whose pages the kernel faulted in and zeroed as the mean first
wrote them: perf -g over 45 s of steady state put two thirds of the nodes' page zeroing (clear_page, 4.8% of all
samples) under the mean's kernel. Written into buffers kept from step to step (one block per dtype: kept tensor by
tensor, they left a node 25% above its plan), steps took 2.33 s against 2.59 (two earlier runs of this version:
2.11 and 2.54, against 2.61 for the version before), train-local, which runs alone after the run, 122 s against 162
(the same parameters: max |diff| 0.0 in every run), and every node stayed 8-11% under its plan. The checkpoint's
cost stays over #28's 10% and moves most from run to run: +17.2% here against +28% (the earlier runs of this version
+36.8% and +10.4%; the version before +24.7% and, with perf recording, +20.4%).
The version before it (fe8020e, a stage adds each gradient as backward produces it and frees it at once), in the
session that made it: nothing OOM-killed, the coordinator under 0.4 GB for 9 GB of training state, train-local's
parameters exactly, each node 3-11% under its plan. Steps took 2.64 s (2.72 in the first run) against 4.89 the
session before and 6.5 in the version the paragraph below describes: a node no longer faulted in a stage's
gradients afresh every microbatch (500 MB on a stage of 125M parameters). A checkpoint cost the steps it spanned
+15.7% (+20.4% in the first run): about the seconds it cost before (+0.42 and +0.55 s against +0.21 s the session
before and +0.44 s below), now a larger share of steps 45% shorter, over the 10% #28 asked for. The version before
that one, at 6.5 s a step: a checkpoint cost
the steps it spanned +6.8%, +6.2% in a second run of that head (0.062; nodes within 10% of plan, rejoin 14.2 s) and
+3.3% for the version before it (its file read through the page cache). The step times of plain steps spread by up
to 50% within one run (5.3-9.7 s), so one run's medians move by several points: the head before this change printed
0.053 the same hour, 0.128 and 0.143 the session before. What those steps paid then was mostly the snapshot's file
written on the apply's path: what a holder had not sent by its next apply (262-1,056 MB a node, 0.35-1.54 s). Now a
thread writes the unsent tensors to the file from the last back while the transfer sends from the first, and the
apply copies only what neither reached: nothing in half the checkpoints, 206-582 MB (0.3-0.75 s) in the others,
where the shared disk (three nodes' files and the coordinator's) was the limit. The file is read back past the page
cache: read through it, it filled the memory cgroups of nodes planned near their cap, which then reclaimed in the
nodes' own allocations (failcnt 2,613 and 10,770 in one run). What is left is that copy and the transfer's work
beside the compute (bench/transfer_interference.py: 0.22-0.41 s of compute a GB moved). The writer at the lowest
priority left more to the apply (0.104, 237-582 MB in two of four checkpoints); the coordinator's receivers at
normal priority measured no better (0.116). Earlier findings: in sessions of their own (start_new_session), Linux's
autogroups gave every process an equal share of the CPU whatever its threads' priorities (checkpoint_cost 0.07 to
0.45); 16 MiB pieces on the raw stream, reading a snapshot only while its node computes nothing, glibc keeping freed
memory, torch's huge pages and a holder's C sender without the GIL measured no better.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GIB = 2**30


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(args: argparse.Namespace) -> list[str]:
    """The run's config as --set arguments, shared by the coordinator and train-local."""
    return [
        "model.family=llama", f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
        f"model.n_heads={args.heads}", f"model.mlp_width={args.mlp}", f"model.vocab_size={args.vocab}",
        f"model.seq_len={args.seq_len}", "train.microbatch_size=1", f"train.microbatches={args.microbatches}",
        f"run.steps={args.steps}", "run.eval_every=0", f"scheduler.checkpoint_every={args.checkpoint_every}",
        "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=3", "profile.layer_repeats=1",
        "profile.memory_headroom_mib=256", f"scheduler.min_nodes={args.nodes}", *args.set,
    ]


class Cgroup:
    """A cgroup v1 memory cgroup with a limit, made for one node and removed after it."""

    def __init__(self, name: str, limit: int) -> None:
        self.path = CGROUP_ROOT / "geotrain-scale" / name
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        (self.path / "memory.max_usage_in_bytes").write_text("0")  # a reused cgroup starts its peak again

    def figures(self) -> dict:
        """Its peak usage, how often it hit the limit, and how many processes the OOM killer ended in it."""
        control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {
            "cgroup_max_usage_bytes": int((self.path / "memory.max_usage_in_bytes").read_text()),
            "failcnt": int((self.path / "memory.failcnt").read_text()),
            "oom_kills": int(control.get("oom_kill", 0)),
        }

    def remove(self) -> None:
        """Remove it (once its processes are gone)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


class Peak:
    """The largest VmHWM of a process, sampled until it ends, and when (wall clock) it was first seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.bytes, self.at = pid, 0, 0.0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while True:
            try:
                text = status.read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("VmHWM:") and int(line.split()[1]) * 1024 > self.bytes:
                    self.bytes, self.at = int(line.split()[1]) * 1024, time.time()
            if "State:\tZ" in text:
                return
            time.sleep(0.2)


def start(cmd: list[str], log: Path, cgroup: Cgroup | None = None) -> subprocess.Popen:
    """Start cmd (inside cgroup, from its first instruction on) with one compute thread, its output in log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if cgroup is not None:
        cmd = ["sh", "-c", f'echo $$ > {cgroup.path}/cgroup.procs && exec "$@"', "sh", *cmd]
    with open(log, "ab") as out:
        # A process group of its own (for killpg), in the bench's session: Linux's autogroups share the CPU equally
        # between sessions, so a node or coordinator whose only runnable threads send or take state at SCHED_IDLE
        # would take a full share from the nodes training beside it, as no such process on a machine of its own does.
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0
        )


def status(address: str, token: str):
    """The coordinator's StatusReply, or None while it does not answer."""
    import grpc

    from geotrain.scheduler.status_cli import fetch_status

    try:
        return fetch_status(address, token)
    except grpc.RpcError:
        return None


def wait_for(what: str, until, timeout: float, poll: float = 0.2, process: subprocess.Popen | None = None):
    """Poll until() until it returns something true; RuntimeError after timeout, or once `process` has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the coordinator ended (exit {process.returncode}) while waiting for {what}")
        value = until()
        if value:
            return value
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def checkpoint_diff(state_dir: Path, local_path: Path) -> tuple[float, int]:
    """Largest |parameter difference| between the run's last checkpoint and train-local's saved model, stage by
    stage, and the checkpoint's bytes on disk."""
    from safetensors import safe_open

    from geotrain.scheduler.checkpoint import CHECKPOINTS_DIR, CheckpointStore

    store = CheckpointStore(state_dir / CHECKPOINTS_DIR, keep=10)
    manifest = store.latest()
    nbytes = sum(f.stat().st_size for f in Path(manifest.path).rglob("*") if f.is_file())
    diff, compared = 0.0, 0
    with safe_open(str(local_path), "pt") as local:
        names = set(local.keys())
        for stage in manifest.stages:
            state = store.load_layers(manifest, stage["layer_start"], stage["layer_end"])
            for name, tensor in state.items():
                if not name.startswith("layers."):
                    continue  # AdamW's moments: train-local saves parameters only
                key = name if name in names else name.removeprefix("layers.")
                compared += 1
                diff = max(diff, float((tensor.float() - local.get_tensor(key).float()).abs().max()))
            del state
    if compared != len(names):
        raise RuntimeError(f"the checkpoint has {compared} parameters, train-local saved {len(names)}")
    return diff, nbytes


def commits(state_dir: Path) -> list[tuple[int, float]]:
    """Each committed step and when (wall clock), in step order."""
    db = sqlite3.connect(state_dir / "run.sqlite")
    try:
        return db.execute("SELECT step, committed_at FROM steps ORDER BY step").fetchall()
    finally:
        db.close()


def step_at(rows: list[tuple[int, float]], at: float) -> int:
    """The step that was being trained at wall time `at`: the first committed after it (0: none was)."""
    return next((step for step, committed in rows if committed >= at), 0)


CHECKPOINT_WRITTEN = re.compile(
    r"^(\S+ \S+) INFO geotrain\.scheduler\.checkpoint: checkpoint of step \d+ written to \S+ in ([\d.]+)s$"
)


def checkpoint_windows(log: Path) -> list[tuple[float, float]]:
    """When each checkpoint was being written (wall clock, start to manifest), from the coordinator's log."""
    windows = []
    for line in log.read_text().splitlines():
        if match := CHECKPOINT_WRITTEN.match(line):
            end = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            windows.append((end - float(match.group(2)), end))
    return windows


def step_intervals(
    rows: list[tuple[int, float]], windows: list[tuple[float, float]], rejoined_at: float
) -> tuple[list[float], list[float]]:
    """Commit-to-commit seconds of the steps during which no checkpoint was being written, and of those during which
    one was (however little of the step it took), leaving out the warm-up steps: the run's first, the one across the
    rejoin and the one after it (a process's first step pays for its connections and first allocations: 9.8-13.6 s
    against about 6)."""
    plain, during = [], []
    warming = 1  # steps still to leave out
    for (_, before), (_, at) in zip(rows, rows[1:]):
        if before < rejoined_at < at:
            warming = 2
        if warming:
            warming -= 1
            continue
        overlaps = any(start < at and end > before for start, end in windows)
        (during if overlaps else plain).append(at - before)
    return plain, during


def main() -> None:
    """Run the bench and print its JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 20M-parameter shake-out of the bench (1 GiB caps)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--mlp", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=10, help="SIGKILL a node once this many steps are done")
    parser.add_argument("--cap-gib", type=float, default=5.0, help="each node's cgroup memory limit")
    parser.add_argument("--set", action="append", default=[], help="extra config settings (SECTION.KEY=VALUE)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the run's state dirs and checkpoints (GBs), not just its logs")
    args = parser.parse_args()
    if args.small:
        args.layers, args.d_model, args.heads, args.mlp, args.vocab, args.cap_gib = 8, 256, 4, 704, 32000, 1.0
    work = Path(tempfile.mkdtemp(prefix="geotrain-scale-"))
    try:
        bench(args, work)
    finally:
        if not args.keep:  # each run leaves about 14 GB of state and checkpoints: only the logs stay
            for path in work.iterdir():
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                elif path.suffix != ".log":
                    path.unlink()


def bench(args: argparse.Namespace, work: Path) -> None:
    """The bench itself, in `work`."""
    started = time.monotonic()
    token = "scale-bench-" + os.urandom(8).hex()
    os.environ["GEOTRAIN_TOKEN"] = token
    port = free_port()
    address = f"127.0.0.1:{port}"
    sets = [a for s in settings(args) for a in ("--set", s)]
    python = [sys.executable, "-m", "geotrain"]
    cap = int(args.cap_gib * GIB)
    coordinator = start([*python, "coordinator", "--listen", address, "--state-dir", str(work / "coordinator"),
                         "--http", "off", *sets], work / "coordinator.log")
    coordinator_peak = Peak(coordinator.pid)
    # One entry per node incarnation, by label ("node-2", then "node-2 rejoined"): process, peak, cgroup, plan.
    runs: dict[str, dict] = {}
    current: dict[str, str] = {}  # node id -> its incarnation's label

    def join(node_id: str, label: str) -> None:
        cgroup = Cgroup(label.replace(" ", "-"), cap)
        cmd = [*python, "join", "--coordinator", address, "--listen", "127.0.0.1:0", "--node-id", node_id,
               "--state-dir", str(work / node_id), "--device", "cpu"]
        proc = start(cmd, work / f"{node_id}.log", cgroup)
        runs[label] = {"proc": proc, "peak": Peak(proc.pid), "cgroup": cgroup, "planned": 0}
        current[node_id] = label

    def watch_plans() -> None:
        while coordinator.poll() is None:
            reply = status(address, token)
            for n in reply.nodes if reply else []:
                if n.node_id in current and n.alive:
                    run = runs[current[n.node_id]]
                    run["planned"] = max(run["planned"], n.planned_memory_bytes)
            time.sleep(0.5)

    rejoin_s = rejoin_profile_s = None
    rejoined_at = 0.0
    try:
        for i in range(args.nodes):
            join(f"node-{i + 1}", f"node-{i + 1}")
        threading.Thread(target=watch_plans, daemon=True).start()
        reply = wait_for(f"{args.kill_after} steps", lambda: (r := status(address, token)) and r.step >= args.kill_after
                         and r, 1800, 0.5, coordinator)
        victim = reply.stages[1].node_ids[0] if len(reply.stages) > 1 else reply.nodes[0].node_id
        killed = runs[current.pop(victim)]
        os.killpg(killed["proc"].pid, signal.SIGKILL)
        killed["proc"].wait()
        wait_for(f"{victim} to be seen dead", lambda: (r := status(address, token)) and any(
            n.node_id == victim and not n.alive for n in r.nodes), 60, 0.2, coordinator)
        restarted = time.monotonic()
        rejoined_at = time.time()
        join(victim, f"{victim} rejoined")

        def member():
            r = status(address, token)
            return next((n for n in r.nodes if n.node_id == victim), None) if r else None

        wait_for(f"{victim}'s profile", lambda: (m := member()) and m.alive and m.memory_bytes, 300, 0.05, coordinator)
        rejoin_profile_s = time.monotonic() - restarted
        wait_for(f"{victim} serving again", lambda: (m := member()) and m.alive and m.lifecycle == "serving", 900, 0.1, coordinator)
        rejoin_s = time.monotonic() - restarted
        coordinator.wait(1800)
    finally:
        if coordinator.poll() is None:
            coordinator.send_signal(signal.SIGTERM)
            coordinator.wait(60)
        for run in runs.values():
            try:
                run["proc"].wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(run["proc"].pid, signal.SIGKILL)
                run["proc"].wait()
    oom, rows = 0, commits(work / "coordinator")
    for label, run in runs.items():
        figures, peak, estimate = run["cgroup"].figures(), run["peak"].bytes, run["planned"]
        oom += figures["oom_kills"]
        print(json.dumps({"node": label, "peak_rss_bytes": peak, "planned_bytes": estimate,
                          "error": round(peak / estimate - 1, 3) if estimate else None,
                          "peak_in_step": step_at(rows, run["peak"].at), "cap_bytes": cap, **figures}), flush=True)
        run["cgroup"].remove()
    local_path = work / "local.safetensors"
    local_started = time.monotonic()
    local = start([*python, "train-local", *sets, "--save-final", str(local_path)], work / "local.log")
    if local.wait(3600):
        raise RuntimeError(f"train-local failed: see {work / 'local.log'}")
    local_s = time.monotonic() - local_started
    diff, checkpoint_bytes = checkpoint_diff(work / "coordinator", local_path)
    windows = checkpoint_windows(work / "coordinator.log")
    plain, after = step_intervals(rows, windows, rejoined_at)
    from geotrain.config import load_config
    from geotrain.memory import training_bytes_per_param
    from geotrain.node.model import family_of

    cfg = load_config(None, settings(args))
    params = sum(math.prod(s) for layer in family_of(cfg.model).param_shapes(cfg.model) for s in layer)
    step_s = statistics.median(plain) if plain else None
    checkpoint_step_s = statistics.median(after) if after else None
    print(json.dumps({
        "run": "scale", "nodes": args.nodes, "params": params, "state_bytes": params * training_bytes_per_param(False),
        "cap_bytes": cap, "coordinator_peak_rss_bytes": coordinator_peak.bytes, "checkpoint_bytes": checkpoint_bytes,
        "step_s": round(step_s, 2) if step_s else None,
        "checkpoint_step_s": round(checkpoint_step_s, 2) if checkpoint_step_s else None,
        "checkpoint_cost": round(checkpoint_step_s / step_s - 1, 3) if step_s and checkpoint_step_s else None,
        "steps_s": [round(s, 2) for s in plain], "checkpoint_steps_s": [round(s, 2) for s in after],
        "checkpoint_write_s": [round(end - start, 1) for start, end in windows],
        "rejoin_s": round(rejoin_s, 2) if rejoin_s else None,
        "rejoin_profile_s": round(rejoin_profile_s, 2) if rejoin_profile_s else None,
        "run_exit": coordinator.returncode, "max_abs_diff": diff, "local_s": round(local_s, 1), "oom_killed": oom,
        "wall_s": round(time.monotonic() - started, 1), "work": str(work),
    }), flush=True)


if __name__ == "__main__":
    main()
