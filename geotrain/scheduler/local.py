"""Local node processes for `geotrain demo` and the tests: real `geotrain join` processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM us when the parent dies, so no node outlives a killed demo."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn_node(
    coordinator: str, node_id: str, token: str, log_dir: Path, extra_args: list[str] | None = None
) -> subprocess.Popen:
    """Start `geotrain join` for a local node with one compute thread; its output goes to log_dir/<node_id>.log."""
    # One thread per process: several processes share a small machine, and more threads oversubscribe it.
    env = {**os.environ, "GEOTRAIN_TOKEN": token, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "geotrain", "--log-level", "info", "join",
        "--coordinator", coordinator, "--node-id", node_id, "--listen", "127.0.0.1:0", *(extra_args or []),
    ]
    with open(log_dir / f"{node_id}.log", "ab") as log_file:
        return subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)


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
