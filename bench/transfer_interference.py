"""What a stage's state transfer costs the training beside it (#28), with its processes in one session or in several.

Two processes compute (loops of 512x512 float32 matmuls, one thread each, pausing a quarter of the time) while a
stage's state (--gb of float32 tensors) moves as a checkpoint moves it: a holder process serves a real StateSnapshot
over a raw state stream (protocol/statestream.py) and a coordinator process takes it into a real StageFileWriter
(O_DIRECT, the stage's blake3 checksum as the bytes pass), both at SCHED_IDLE as a run has them. A transfer that
took only what the computing processes leave would cost them nothing. Linux's autogroups (on by default on most
desktops and servers) share the CPU equally between sessions, though: a process in a session of its own whose only
runnable threads are at SCHED_IDLE still takes a full session's share.

Prints one JSON line per --variant and repeat: transfer_s, compute_lost_s (the two computing processes' seconds past
their pace alone, summed over the transfer), lost_s_per_gb, their slowdown while it ran, and the CPU seconds per GB of
the holder and of the coordinator while it ran. Variants: `shared` (every
process in this one's session, as bench/scale.py and local nodes start them), `own` (each in a session of its own, as
processes started from separate terminals are).

Run under the CPU lock: flock /work/cpu.lock python bench/transfer_interference.py [--gb 1] [--repeat 2]

This version, the defaults, the lock held (a 2-vCPU VM):
    {"variant": "shared", "transfer_s": 3.04, "compute_lost_s": 0.439, "lost_s_per_gb": 0.408, "slowdown": 0.105,
     "holder_cpu_s_per_gb": 0.426, "coordinator_cpu_s_per_gb": 0.381}
    {"variant": "own", "transfer_s": 1.44, "compute_lost_s": 0.505, "lost_s_per_gb": 0.47, "slowdown": 0.301, ...}
    {"variant": "shared", "transfer_s": 2.91, "compute_lost_s": 0.237, "lost_s_per_gb": 0.221, "slowdown": 0.057,
     "holder_cpu_s_per_gb": 0.453, "coordinator_cpu_s_per_gb": 0.383}
    {"variant": "own", "transfer_s": 1.5, "compute_lost_s": 0.511, "lost_s_per_gb": 0.475, "slowdown": 0.292, ...}
and two runs before, with the holder's CPU then counted from its start: shared 0.303 and 0.285 s lost a GB (slowdown
7.5%), own 0.537 and 0.569 (32-37%). In sessions of their own the transfer runs twice as fast on CPU the computing
processes wanted, and their slowdown is four times as large. What one session still costs (0.22-0.41 s a GB) the
transfer's work costs the compute though it runs only where a CPU would idle: the two CPUs are not independent. A
holder's C sender that took neither the GIL nor a lock (a later-dropped protocol/_guardedsend.c) measured worse here
than python's chunked copy: 0.31-0.41 s lost a GB against 0.17-0.28, three runs each.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from geotrain.node import handover  # noqa: E402
from geotrain.protocol import framing, statestream  # noqa: E402
from geotrain.scheduler.checkpoint import StageFileWriter  # noqa: E402

TENSOR_ELEMENTS = 4 << 20  # 16 MiB tensors, about a llama block's matrices at d_model 1024


def _session(own: bool) -> None:
    if own:
        os.setsid()


def compute(own: bool, stop: mp.Event, out: mp.Queue) -> None:
    """Matmuls in rounds of 20, each round's end time and seconds, until stopped; a pause of a third of a round after
    each, as a pipeline's stage waits for its neighbours: the CPUs' idle time a transfer at SCHED_IDLE may take."""
    _session(own)
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    rounds = []
    while not stop.is_set():
        t = time.perf_counter()
        for _ in range(20):
            a @ b
        now = time.perf_counter()
        rounds.append((now, now - t))
        time.sleep((now - t) / 3)
    out.put(rounds)


def holder(own: bool, gb: float, ports: mp.Queue, done: mp.Queue) -> None:
    """Serve one stage's state over a raw state stream to the first connection."""
    _session(own)
    torch.set_num_threads(1)
    count = max(1, round(gb * 2**30 / (TENSOR_ELEMENTS * 4)))
    items = [(f"layers.{i // 9}.w{i % 9}", torch.randn(TENSOR_ELEMENTS)) for i in range(count)]
    with tempfile.TemporaryDirectory() as spill:
        snapshot = handover.StateSnapshot(items, spill)
        server = socket.create_server(("127.0.0.1", 0))
        ports.put(server.getsockname()[1])
        conn, _ = server.accept()
        statestream.background_priority()
        cpu = time.process_time()
        statestream.send_state(conn, snapshot.sources(), "")
        cpu = time.process_time() - cpu
        conn.close()
        snapshot.close()
    done.put((sum(t.numel() * 4 for _, t in items), cpu))


def coordinator(own: bool, port: int, work: str, times: mp.Queue) -> None:
    """Take the stage into its checkpoint file, as the coordinator does."""
    _session(own)
    statestream.background_priority()
    cpu = time.process_time()
    writer = StageFileWriter(Path(work) / "stage.safetensors", (0, 10**6), False)
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.perf_counter()
    framing.receive_state(statestream.receive_state(sock, time.monotonic() + 600), writer)
    writer.finish()
    ended = time.perf_counter()
    writer.close()
    sock.close()
    times.put((started, ended, time.process_time() - cpu))


def run(gb: float, variant: str) -> dict:
    ctx = mp.get_context("fork")
    own = variant == "own"
    stop, rounds_q, ports, done, times = ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=compute, args=(own, stop, rounds_q)) for _ in range(2)]
    with tempfile.TemporaryDirectory(dir=".") as work:
        sender = ctx.Process(target=holder, args=(own, gb, ports, done))
        sender.start()
        port = ports.get(timeout=120)
        for w in workers:
            w.start()
        time.sleep(3.0)  # the computing processes' pace alone
        receiver = ctx.Process(target=coordinator, args=(own, port, work, times))
        receiver.start()
        started, ended, coordinator_cpu = times.get(timeout=900)
        moved, holder_cpu = done.get(timeout=60)
        receiver.join(30)
        sender.join(30)
    time.sleep(3.0)
    stop.set()
    rounds = [r for _ in workers for r in rounds_q.get(timeout=60)]
    for w in workers:
        w.join(30)
    alone = statistics.median(s for t, s in rounds if t < started or t - s > ended)
    during = [s for t, s in rounds if t > started and t - s < ended]
    lost = sum(s - alone for s in during)
    return {
        "variant": variant, "bytes": moved, "transfer_s": round(ended - started, 2), "compute_lost_s": round(lost, 3),
        "lost_s_per_gb": round(lost / (moved / 1e9), 3),
        "slowdown": round(statistics.mean(during) / alone - 1, 3) if during else 0.0,
        "holder_cpu_s_per_gb": round(holder_cpu / (moved / 1e9), 3),
        "coordinator_cpu_s_per_gb": round(coordinator_cpu / (moved / 1e9), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--variants", default="shared,own")
    args = parser.parse_args()
    for _ in range(args.repeat):
        for variant in args.variants.split(","):
            print(json.dumps(run(args.gb, variant)), flush=True)


if __name__ == "__main__":
    main()
