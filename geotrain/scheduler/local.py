"""Local node processes for `geotrain demo` and the tests: real `geotrain join` processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


PARENT_ENV = "GEOTRAIN_PARENT_PID"


def exit_with_parent() -> None:
    """In a spawned node: have Linux SIGTERM us when the spawning process dies, so no node outlives a killed demo.

    The child arms this itself after exec: a preexec_fn would make Python fork() while gRPC threads run in the
    parent, which leaves the child's gRPC broken.
    """
    parent = os.environ.get(PARENT_ENV)
    if parent is None or sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def spawn_node(
    coordinator: str, node_id: str, token: str, log_dir: Path, extra_args: list[str] | None = None
) -> subprocess.Popen:
    """Start `geotrain join` for a local node with one compute thread; its output goes to log_dir/<node_id>.log."""
    # One thread per process: several processes share a small machine, and more threads oversubscribe it.
    env = {**os.environ, "GEOTRAIN_TOKEN": token, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           PARENT_ENV: str(os.getpid())}
    cmd = [
        sys.executable, "-m", "geotrain", "--log-level", "info", "join",
        "--coordinator", coordinator, "--node-id", node_id, "--listen", "127.0.0.1:0", *(extra_args or []),
    ]
    with open(log_dir / f"{node_id}.log", "ab") as log_file:
        return subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every process, then SIGKILL whatever is still running after grace_s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
