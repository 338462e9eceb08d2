"""Local node processes for `geotrain demo` and the tests: real `geotrain join` processes on 127.0.0.1."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from geotrain.lifetime import signal_when_parent_dies

PARENT_ENV = "GEOTRAIN_PARENT_PID"


def exit_with_parent() -> None:
    """In a spawned node: have Linux SIGTERM us when the spawning thread dies (the kernel ties PR_SET_PDEATHSIG to
    the thread that forked, not its process), so no node outlives a killed demo; LocalNodes spawns from one thread
    that lives as long as the process.

    The child arms this itself after exec: a preexec_fn would make Python fork() while gRPC threads run in the
    parent, which leaves the child's gRPC broken.
    """
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        signal_when_parent_dies(int(parent), signal.SIGTERM)


def spawn_node(
    coordinator: str, node_id: str, token: str, log_dir: Path, extra_args: list[str] | None = None,
    state_dir: Path | None = None,
) -> subprocess.Popen:
    """Start `geotrain join` for a local node with one compute thread; its output goes to log_dir/<node_id>.log, its
    key to (state_dir or log_dir)/<node_id>/, so that a node started again under the same id is the same node."""
    # One thread per process: several processes share a small machine, and more threads oversubscribe it.
    env = {**os.environ, "GEOTRAIN_TOKEN": token, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           PARENT_ENV: str(os.getpid())}
    cmd = [
        sys.executable, "-m", "geotrain", "--log-level", "info", "join",
        "--coordinator", coordinator, "--node-id", node_id, "--listen", "127.0.0.1:0",
        "--state-dir", str((state_dir or log_dir) / node_id), *(extra_args or []),
    ]
    with open(log_dir / f"{node_id}.log", "ab") as log_file:
        # A session of its own: killing the node's process group also ends its hivemind DHT fork and p2pd.
        return subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every node, then SIGKILL whatever of its process group (its DHT fork, p2pd) still runs after grace_s."""
    for p in procs:
        if p.poll() is None:
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
        self.procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        # Nodes die with the thread that spawned them (exit_with_parent): spawn all of them from one thread that
        # outlives the callers, which may be short-lived (a chaos thread, the coordinator's run thread).
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="node-spawner")

    def start(self, node_id: str) -> subprocess.Popen:
        """Start (or restart) the node `node_id`."""
        with self._lock:
            args = (self.coordinator, node_id, self.token, self.log_dir, self.extra_args.get(node_id), self.state_dir)
            proc = self._spawner.submit(spawn_node, *args).result()
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
