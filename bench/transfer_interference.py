"""What a stage's state transfer costs the training beside it (#28): compute lost per GB a checkpoint moves.

One process computes (a loop of 512x512 float32 matmuls, one thread, pinned to CPU 0) from start to end. Meanwhile a
stage's state (--gb of float32 tensors) is sent as a checkpoint sends it: a holder process serves a real
StateSnapshot over a raw state stream (protocol/statestream.py), a coordinator process receives it into a real
StageFileWriter (O_DIRECT, the stage's blake3 checksum as the bytes pass), both pinned to CPU 1 and at SCHED_IDLE
as the run has them. So the transfer never takes the computing CPU's time: what it costs the compute is what two
logical CPUs of one machine share (a core's execution units where they are hyperthreads, caches, memory).

Prints one JSON line per --variant: transfer_s, compute_lost_s (the compute's seconds past its pace alone, summed over
the transfer), lost_s_per_gb, and the compute's slowdown while the transfer ran. Variants: `c` (the holder sends
through protocol/_guardedsend.c where built), `python` (the holder copies chunk by chunk in python), `unhashed` (`c`,
and the coordinator computes no checksum: what blake3 costs).

Run under the CPU lock: flock /work/cpu.lock python bench/transfer_interference.py [--gb 1] [--repeat 2]
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from geotrain.node import handover  # noqa: E402
from geotrain.protocol import framing, statestream  # noqa: E402
from geotrain.scheduler.checkpoint import StageFileWriter  # noqa: E402

TENSOR_ELEMENTS = 4 << 20  # 16 MiB tensors, about a llama block's matrices at d_model 1024


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < os.cpu_count():
        os.sched_setaffinity(0, {cpu})


def compute(stop: mp.Event, out: mp.Queue) -> None:
    """Matmuls in rounds of 20, each round's end time and seconds, until stopped."""
    _pin(0)
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    rounds = []
    while not stop.is_set():
        t = time.perf_counter()
        for _ in range(20):
            a @ b
        now = time.perf_counter()
        rounds.append((now, now - t))
    out.put(rounds)


def holder(gb: float, python: bool, ports: mp.Queue, done: mp.Queue, stop: mp.Event, rounds: mp.Queue | None) -> None:
    """Serve one stage's state over a raw state stream to the first connection; with `rounds`, compute beside it in
    a thread of this process, as a node's worker does."""
    worker = threading.Thread(target=compute, args=(stop, rounds)) if rounds is not None else None
    if worker is not None:
        worker.start()
    _pin(1)
    torch.set_num_threads(1)
    if python:
        handover._guardedsend = None
    count = max(1, round(gb * 2**30 / (TENSOR_ELEMENTS * 4)))
    items = [(f"layers.{i // 9}.w{i % 9}", torch.randn(TENSOR_ELEMENTS)) for i in range(count)]
    with tempfile.TemporaryDirectory() as spill:
        snapshot = handover.StateSnapshot(items, spill)
        server = socket.create_server(("127.0.0.1", 0))
        ports.put(server.getsockname()[1])
        conn, _ = server.accept()
        statestream.background_priority()
        statestream.send_state(conn, snapshot.sources(), "")
        conn.close()
        snapshot.close()
    done.put(sum(t.numel() * 4 for _, t in items))
    if worker is not None:
        worker.join()


def coordinator(port: int, hashed: bool, work: str, times: mp.Queue) -> None:
    """Receive the stage into its checkpoint file, as the coordinator does."""
    _pin(1)
    statestream.background_priority()
    writer = StageFileWriter(Path(work) / "stage.safetensors", (0, 10**6), False, checksummed=hashed)
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.perf_counter()
    framing.receive_state(statestream.receive_state(sock, time.monotonic() + 600), writer)
    writer.finish()
    ended = time.perf_counter()
    writer.close()
    sock.close()
    times.put((started, ended))


def run(gb: float, variant: str) -> dict:
    ctx = mp.get_context("fork")
    stop, rounds_q, ports, done, times = ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    in_node = variant.endswith("-in-node")
    worker = None if in_node else ctx.Process(target=compute, args=(stop, rounds_q))
    with tempfile.TemporaryDirectory(dir=".") as work:
        sender = ctx.Process(
            target=holder, args=(gb, variant.startswith("python"), ports, done, stop, rounds_q if in_node else None)
        )
        if worker is not None:
            worker.start()
        sender.start()
        port = ports.get(timeout=120)
        time.sleep(3.0)  # the compute's pace alone
        receiver = ctx.Process(target=coordinator, args=(port, variant != "unhashed", work, times))
        receiver.start()
        started, ended = times.get(timeout=600)
        moved = done.get(timeout=60)
        receiver.join(30)
        time.sleep(3.0)
        stop.set()
        rounds = rounds_q.get(timeout=60)
        sender.join(30)
    if worker is not None:
        worker.join(30)
    alone = statistics.median(s for t, s in rounds if t < started or t - s > ended)
    during = [s for t, s in rounds if t > started and t - s < ended]
    lost = sum(s - alone for s in during)
    return {
        "variant": variant, "bytes": moved, "transfer_s": round(ended - started, 2), "compute_lost_s": round(lost, 3),
        "lost_s_per_gb": round(lost / (moved / 1e9), 3),
        "slowdown": round(statistics.mean(during) / alone - 1, 3) if during else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--variants", default="c,python,unhashed,c-in-node,python-in-node")
    args = parser.parse_args()
    for _ in range(args.repeat):
        for variant in args.variants.split(","):
            print(json.dumps(run(args.gb, variant)), flush=True)


if __name__ == "__main__":
    main()
