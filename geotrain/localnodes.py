"""Local node processes for `geotrain demo`, the tests and the benchmarks: real `geotrain join` processes on
127.0.0.1, forked from a process that has already imported what a node needs.

Started as `python -m geotrain join`, each node would first spend seconds of CPU importing torch, gRPC and the node's
modules, and torch._dynamo, which torch's optimizers import on first use: most of what a short local run's nodes
spend before their first step, paid again at every restart. multiprocessing's forkserver imports all of it once
and forks each node from it. A node is still a process of its own, in a session of its own, that can be SIGKILLed
and started again.

It sits at the top of the package, not in scheduler/: its forkserver imports the node's modules, which the
scheduler may not import.
"""

from __future__ import annotations

import os
import random
import runpy
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from geotrain.lifetime import forkserver, signal_when_process_ends

# One thread per process: several processes share a small machine, and more threads oversubscribe it.
_NODE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def process_name(node_id: str) -> str:
    """What `ps -e` and top call a local node's process (Linux keeps 15 characters): its command line is the
    forkserver's."""
    return f"gt-{node_id}"[:15]


def _run_join(node_id: str, argv: list[str], env: dict[str, str], log_path: str, starter: int) -> None:
    """A local node's process, forked by the forkserver: `geotrain` with argv, its output in log_path; stopped as
    by Ctrl+C once the process that started it (`starter`) ends, however it ended. (Ending with the forkserver would
    not do: it outlives the starter while any node runs, since every child it forks holds its alive pipe.)"""
    # A process group of its own, so that killing it also ends the node's hivemind DHT fork and p2pd; not a session
    # of its own: Linux's autogroups give each session an equal share of the CPU, so a node whose only runnable
    # thread sends state at SCHED_IDLE would take a full share from the nodes training beside it.
    os.setpgid(0, 0)
    try:
        Path("/proc/self/comm").write_text(process_name(node_id))
    except OSError:  # not Linux: the process keeps the forkserver's name
        pass
    signal_when_process_ends(starter, signal.SIGTERM)
    nothing = os.open(os.devnull, os.O_RDONLY)  # a background process group that read the terminal would stop
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(nothing, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(nothing)
    os.close(log)
    os.environ.update(env)
    sys.argv = ["geotrain", *argv]
    runpy.run_module("geotrain", run_name="__main__")  # as `python -m geotrain ...` would: it exits from there


class NodeProcess:
    """A local node's process, with the part of subprocess.Popen's interface that callers use."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process
        # multiprocessing reads a child's exit code from a pipe once: two threads polling at once could both see it
        # ready and one would then block reading it.
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        """The node's process id."""
        assert self._process.pid is not None  # set by start(), before a NodeProcess exists
        return self._process.pid

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        with self._lock:
            return self._process.exitcode

    @property
    def returncode(self) -> int | None:
        """As poll()."""
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the node exits and return its exit code; subprocess.TimeoutExpired after `timeout` seconds."""
        connection.wait([self._process.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"geotrain join (pid {self.pid})", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the node, if it still runs."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it exited since poll()
                pass

    def terminate(self) -> None:
        """SIGTERM: the node stops as on Ctrl+C."""
        self.send_signal(signal.SIGTERM)


def spawn_node(
    coordinator: str, node_id: str, token: str, log_dir: Path, extra_args: list[str] | None = None,
    state_dir: Path | None = None,
) -> NodeProcess:
    """Start `geotrain join` for a local node with one compute thread; its output goes to log_dir/<node_id>.log, its
    key to (state_dir or log_dir)/<node_id>/, so that a node started again under the same id is the same node."""
    argv = [
        "--log-level", "info", "join",
        "--coordinator", coordinator, "--node-id", node_id, "--listen", "127.0.0.1:0",
        "--state-dir", str((state_dir or log_dir) / node_id), *(extra_args or []),
    ]
    env = {**_NODE_ENV, "GEOTRAIN_TOKEN": token}
    log_path = str(log_dir / f"{node_id}.log")
    process = forkserver().Process(
        target=_run_join, args=(node_id, argv, env, log_path, os.getpid()), name=f"geotrain-{node_id}"
    )
    process.start()
    return NodeProcess(process)


def stop_processes(procs: list[NodeProcess], grace_s: float = 5.0) -> None:
    """SIGTERM every node, then SIGKILL whatever of its process group (its DHT fork, p2pd) still runs after grace_s."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


class LocalNodes:
    """Named local node processes that can be killed and started again under the same identity."""

    def __init__(
        self, coordinator: str, token: str, log_dir: Path, extra_args: dict[str, list[str]] | None = None,
        state_dir: Path | None = None,
    ):
        self.coordinator, self.token, self.log_dir = coordinator, token, log_dir
        self.state_dir = state_dir  # where each node keeps its key, under its id (default: log_dir)
        self.extra_args = extra_args or {}
        self.procs: dict[str, NodeProcess] = {}
        self._lock = threading.Lock()

    def start(self, node_id: str) -> NodeProcess:
        """Start (or restart) the node `node_id`."""
        with self._lock:
            proc = spawn_node(
                self.coordinator, node_id, self.token, self.log_dir, self.extra_args.get(node_id), self.state_dir
            )
            self.procs[node_id] = proc
            return proc

    def kill(self, node_id: str) -> None:
        """SIGKILL a node with everything it started, as a crash or a pulled plug would end it."""
        with self._lock:
            proc = self.procs[node_id]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def running(self) -> list[str]:
        """Ids of the nodes whose process is alive."""
        with self._lock:
            return sorted(n for n, p in self.procs.items() if p.poll() is None)

    def stop_all(self) -> None:
        """Stop every node process."""
        with self._lock:
            procs = list(self.procs.values())
        stop_processes(procs)


@dataclass(frozen=True)
class Chaos:
    """`--chaos kill-every=20s,down=5s,seed=1`: SIGKILL a random node every so often, restart it after `down`."""

    kill_every_s: float
    down_s: float = 5.0
    seed: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    @classmethod
    def parse(cls, spec: str) -> Chaos:
        """Parse the --chaos value; raises ValueError naming what is wrong."""
        values: dict[str, float] = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            if key not in ("kill-every", "down", "seed") or not value:
                raise ValueError(f"--chaos takes kill-every=20s[,down=5s][,seed=N], got {spec!r}")
            try:
                values[key] = float(value.removesuffix("s"))
            except ValueError:
                raise ValueError(f"--chaos {key} must be a number of seconds, got {value!r}") from None
        if values.get("kill-every", 0) <= 0:
            raise ValueError("--chaos needs kill-every=SECONDS greater than 0")
        return cls(kill_every_s=values["kill-every"], down_s=values.get("down", 5.0), seed=int(values.get("seed", 0)))

    def start(self, nodes: LocalNodes, out) -> None:
        """Run in a daemon thread until stop()."""
        threading.Thread(target=self._run, args=(nodes, out), name="chaos", daemon=True).start()

    def stop(self) -> None:
        """End the chaos thread."""
        self._stop.set()

    def _run(self, nodes: LocalNodes, out) -> None:
        rng = random.Random(self.seed)
        while not self._stop.wait(self.kill_every_s):
            running = nodes.running()
            if not running:
                continue
            victim = rng.choice(running)
            nodes.kill(victim)
            print(f"chaos: killed {victim}; restarting it in {self.down_s:.0f}s", file=out, flush=True)
            if self._stop.wait(self.down_s):
                return
            nodes.start(victim)
            print(f"chaos: restarted {victim}", file=out, flush=True)
