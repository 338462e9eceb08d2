"""Shared helpers: run the CLI as a real process, a local cluster with an in-process coordinator, small-run
settings, polling with a deadline, and the comparisons and RPC checks several test files make."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from geotrain.compression import get_codec
from geotrain.config import RunConfig, load_config
from geotrain.localnodes import LocalNodes
from geotrain.node.data import Corpus
from geotrain.node.local import train_local
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import new_token
from geotrain.scheduler.coordinator import Coordinator, RunSummary
from geotrain.scheduler.service import CoordinatorProcess

REPO = Path(__file__).resolve().parent.parent

# A multi-process run kept short: three steps of four microbatches, no evaluation, deaths noticed in 2.5 s, each
# layer timed once in the node's profile (uniform placement does not use the timings).
SMALL_RUN = [
    "run.steps=3", "run.eval_every=0", "run.eval_microbatches=2", "train.microbatches=4",
    "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=2.5", "scheduler.placement=uniform",
    "profile.layer_repeats=1",
]


def small_run(*overrides: str) -> RunConfig:
    """SMALL_RUN's configuration with `overrides` applied after it."""
    return load_config(None, [*SMALL_RUN, *overrides])


def as_set_flags(settings: list[str]) -> list[str]:
    """`--set KEY=VALUE` command-line flags for each setting."""
    return [arg for s in settings for arg in ("--set", s)]


@contextmanager
def one_compute_thread() -> Iterator[None]:
    """Compute as the tests' nodes do (OMP_NUM_THREADS=1), for a reference that must equal them bit for bit:
    LayerNorm's weight and bias gradients are summed in per-thread chunks, so another thread count computes other
    bits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_local_state(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The parameters after `geotrain train-local` of cfg, computed here as the tests' nodes compute."""
    with one_compute_thread():
        runtime, _ = train_local(cfg)
    return {name: p.detach().clone() for name, p in runtime.named_state()}


def message_chunks(
    header: pb.TensorHeader, payload: Any, ref: pb.MicrobatchRef | None = None, chunk_bytes: int = framing.CHUNK_BYTES
) -> list[pb.TensorChunk]:
    """One encoded tensor's chunks built as protobuf messages (the first carries ref and header): what
    framing.wire_chunks serializes by hand, and what a gRPC client of the Stage service sends."""
    view = memoryview(payload).cast("B")
    starts = range(0, max(len(view), 1), chunk_bytes)
    chunks = [pb.TensorChunk(data=bytes(view[at : at + chunk_bytes])) for at in starts]
    chunks[0].header.CopyFrom(header)
    if ref is not None:
        chunks[0].ref.CopyFrom(ref)
    return chunks


def tensor_chunks(tensor: torch.Tensor, ref: pb.MicrobatchRef, **header_overrides: Any) -> list[pb.TensorChunk]:
    """A Forward or Backward request: `tensor` uncompressed in 64 KiB chunks, its header's fields overridden."""
    payload = get_codec("none").encode(tensor, None)
    header = framing.make_header("", tensor.dtype, tuple(tensor.shape), pb.CODEC_NONE, payload)
    for key, value in header_overrides.items():
        if key == "shape":
            del header.shape[:]
            header.shape.extend(value)
        else:
            setattr(header, key, value)
    return message_chunks(header, payload, ref, chunk_bytes=64 << 10)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def expect_status(code: grpc.StatusCode, text: str, call: Callable[[], Any]) -> None:
    """call() fails with gRPC status `code` and details containing `text`."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert text in err.value.details(), err.value.details()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll predicate until it returns something truthy (returned) or `timeout` seconds pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(interval)
    return result


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free a moment ago (bound together at port 0, then released), for a flag that
    takes a fixed port."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def geotrain_env() -> dict[str, str]:
    """Environment for geotrain processes started by tests: one compute thread each (two cores here)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m geotrain ARGS` until it exits. Its output goes to files, not pipes: the end of a pipe comes
    seconds after a coordinator exits, when torch's shared-memory manager (which hivemind starts) lets go of it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run(
            [sys.executable, "-m", "geotrain", *args], stdout=out, stderr=err, timeout=timeout, env=geotrain_env(), cwd=REPO
        )
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(done.args, done.returncode, out.read(), err.read())


@dataclass
class LocalCluster:
    """A coordinator running in a thread of the test process, with real node processes."""

    coordinator: Coordinator
    port: int
    token: str
    nodes: LocalNodes
    thread: threading.Thread
    result: dict[str, Any] = field(default_factory=dict)

    def wait(self, timeout: float) -> RunSummary:
        """Wait for the run to end; re-raise what ended it if it failed."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError("run did not finish")
        if "error" in self.result:
            raise self.result["error"]
        return self.result["summary"]


@contextmanager
def local_cluster(
    cfg: RunConfig,
    n_nodes: int,
    log_dir: Path,
    on_event: Callable[[str, dict], None] | None = None,
    state_dir: Path | None = None,
    resume: bool = False,
    node_args: dict[str, list[str]] | None = None,
    in_order: bool = False,
) -> Iterator[LocalCluster]:
    """Start a coordinator and n_nodes `geotrain join` processes, node-1 to node-N with their node_args (training
    starts when all joined; with in_order, each registers before the next starts, so uniform placement puts node-i on
    stage i-1); always tear down."""
    cfg.scheduler.min_nodes = n_nodes
    token = new_token()
    cfg.data.fingerprint = Corpus.load(cfg.data).fingerprint
    process = CoordinatorProcess(cfg, token, "127.0.0.1:0", state_dir=state_dir, resume=resume, on_event=on_event)
    nodes = LocalNodes(f"127.0.0.1:{process.port}", token, log_dir, node_args)
    if in_order:
        process.server.start()
    for i in range(n_nodes):
        nodes.start(node_id := f"node-{i + 1}")
        if in_order:
            wait_until(lambda: node_id in process.coordinator.members, 60, f"{node_id} to register")
    if not in_order:
        process.server.start()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["summary"] = process.coordinator.run()
        except Exception as e:  # handed to the test through LocalCluster.wait
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield LocalCluster(process.coordinator, process.port, token, nodes, thread, result)
    finally:
        process.coordinator.stop_requested.set()
        thread.join(10)
        process.coordinator.shutdown_nodes("test over", grace_s=1.0)
        nodes.stop_all()
        process.close()


@pytest.fixture
def small_config() -> RunConfig:
    """A fast configuration for multi-process tests."""
    return small_run()


def process_stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": the name may hold spaces and parentheses
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every process below root, as pid -> start time (which tells a reused pid from the process it was)."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        stat = process_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None:
            parents.setdefault(stat[0], []).append((int(entry.name), stat[2]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, start in parents.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def running_of(procs: dict[int, int]) -> list[int]:
    """The pids of procs that still run (zombies and reused pids do not)."""
    running = []
    for pid, start in procs.items():
        stat = process_stat(pid)
        if stat is not None and stat[1] != "Z" and stat[2] == start:
            running.append(pid)
    return running
