"""Processes a geotrain process forks end soon after it dies, even by SIGKILL.

hivemind runs its DHT in a forked process, which runs p2pd; a node or coordinator that crashed or was SIGKILLed
would leave both behind, announcing stale DHT records and holding ports. One os.register_at_fork hook reaches both
without touching hivemind: Python runs it in the DHT process after os.fork, and uvloop, which spawns p2pd from the
DHT process, runs it between fork and exec. (torch_shm_manager, which torch starts without Python's hooks, already
exits once no process uses it.)

The process's forkserver lives here too. Local nodes (localnodes.py) and the coordinator's DHT process
(scheduler.service) are both forked from it: it is a fresh process without threads, so nothing it forks inherits a
lock that a thread held (a fork from a process with busy gRPC threads can hang the child), and it imports once what
a node imports, so a forked local node starts without seconds of imports. multiprocessing keeps one forkserver per
process, whose imports are fixed by whoever starts it first: both go through forkserver() so that they agree, and
the coordinator command, which forks no node, starts it first with no imports (its DHT process, which only a run
with replicas starts, imports hivemind itself).

The node (agent) and the coordinator (scheduler.service) both start a DHT and neither may import the other, so this
sits beside config.py at the top of the package and imports nothing of ours (protocol/ is shared too, but it is the
wire contract); the forkserver's imports are named, not imported.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

_PR_SET_PDEATHSIG = 1
# What `geotrain join` imports up to its first optimizer step, and hivemind for the coordinator's DHT process; in a
# forked child they cost nothing. (forkserver skips a module that fails to import: the child then imports it itself,
# or reports why.)
NODE_PRELOAD = ["geotrain.localnodes", "geotrain.cli", "geotrain.node.agent", "torch._dynamo", "hivemind"]
_WATCH_INTERVAL_S = 0.5

# This process as its children see it: its pid and its main thread, once tie_children_to_this_process has run.
_pid = 0
_main_thread: int | None = None


def tie_children_to_this_process() -> None:
    """From now on, children this process forks through Python (the DHT process, and p2pd from it) are SIGKILLed soon
    after their parent dies."""
    global _pid, _main_thread
    if _main_thread is None:
        _pid, _main_thread = os.getpid(), threading.main_thread().ident
        os.register_at_fork(after_in_child=_die_with_parent)


def _die_with_parent() -> None:
    global _pid, _main_thread
    parent, forked_by_main_thread = _pid, threading.get_ident() == _main_thread
    _pid, _main_thread = os.getpid(), threading.get_ident()  # the thread that forked a child is the child's main one
    # A forked child keeps its parent's Python handlers: the CLI's SIGTERM handler would stop only the child's copy of
    # the node, and hivemind's DHT.shutdown falls back to terminate() (SIGTERM) on a DHT process that does not stop.
    # So SIGTERM gets its default back, and the parent's death is signalled with SIGKILL. The kernel sends
    # PR_SET_PDEATHSIG when the forking *thread* ends, so it serves only forks from the main thread (which lasts as
    # long as its process): the node starts its DHT from a short-lived thread.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not (forked_by_main_thread and signal_when_parent_dies(parent, signal.SIGKILL)):
        # A child that execs next loses this thread. p2pd, spawned from the DHT process's main thread, has the signal
        # on Linux; elsewhere it shuts down by itself once the DHT process's connection to it closes.
        threading.Thread(target=_watch_parent, args=(parent,), name="watch-parent", daemon=True).start()


def signal_when_parent_dies(parent: int, sig: int) -> bool:
    """Have Linux send `sig` to this process when the thread that forked it ends (PR_SET_PDEATHSIG; at once if
    `parent` is already gone). False, doing nothing, off Linux."""
    if sys.platform != "linux":
        return False
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
    return True


def _watch_parent(parent: int) -> None:
    """SIGKILL this process once its parent is gone (it is then adopted: its parent pid changes)."""
    while os.getppid() == parent:
        time.sleep(_WATCH_INTERVAL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def signal_when_process_ends(pid: int, sig: int) -> None:
    """Send `sig` to this process once process `pid`, which need not be its parent, has ended (at once if it has).
    A daemon thread waits for it: on a pidfd where Linux has them (an ended process that nobody reaped yet counts
    as ended), else by polling."""
    threading.Thread(target=_signal_when_ended, args=(pid, sig), name="watch-starter", daemon=True).start()


def _signal_when_ended(pid: int, sig: int) -> None:
    try:
        if hasattr(os, "pidfd_open"):
            fd = os.pidfd_open(pid)
            select.select([fd], [], [])  # readable once the process has ended
            os.close(fd)
        else:
            while True:
                os.kill(pid, 0)
                time.sleep(_WATCH_INTERVAL_S)
    except ProcessLookupError:  # already gone
        pass
    os.kill(os.getpid(), sig)


def forkserver(preload: list[str] = NODE_PRELOAD) -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver context, its imports set (they take effect if it is not running yet)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    return context


def child_with_pipe(target: Callable[..., None], args: tuple, name: str) -> tuple[BaseProcess, Connection]:
    """A daemon process forked from the forkserver, running target(*args, its end of a pipe), and this end. The
    child reads EOF on its end once this process closes it or dies, however it died."""
    context = forkserver()
    conn, child_conn = context.Pipe()
    process = context.Process(target=target, args=(*args, child_conn), name=name, daemon=True)
    process.start()
    child_conn.close()
    return process, conn


def ready_message(conn: Connection, timeout_s: float, what: str) -> Any:
    """The first message a child_with_pipe process sends, which says it is ready; RuntimeError naming `what` when
    none comes within timeout_s or the child ends first (its own error is then in the log above)."""
    if not conn.poll(timeout_s):
        raise RuntimeError(f"{what} did not start within {timeout_s:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"{what} ended before it was ready: its error is above") from None


def start_forkserver(preload: list[str] = NODE_PRELOAD) -> None:
    """Start the forkserver now, not with the first process forked from it, so that its imports overlap with
    whatever the caller does until then (a demo: the coordinator's start)."""
    forkserver(preload)
    multiprocessing.forkserver.ensure_running()
