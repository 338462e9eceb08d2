"""The coordinator with a thousand volunteers: a real 3-node run next to N simulated members.

An in-process coordinator (CoordinatorProcess) and three `geotrain join` processes train the default model on
three stages. Once its first step is committed, one more process adds N simulated members: grpc.aio clients that
register, hold their order streams open (reading the orders that come), and heartbeat when the coordinator says
(as nodes do: the run's interval at first, less often once it counts many spares), each on a connection of its
own, but train nothing. They cannot be planned in: scheduler.stages=3 and scheduler.replicas=1 leave no seat for a
fourth node, and they joined after the plan was made. The members grow
0 -> 100 -> 1000 in the same run; after each growth and a warm-up, a window of --window seconds is measured.

One JSON line per N: members, heartbeat_p99_ms (the simulated members' heartbeat round trips in the window; null
at 0 members), coordinator_cpu_s_per_s (CPU seconds of the coordinator's process per wall second: every thread of
it, not the nodes or the members' process), train_tokens_per_s (tokens of the steps committed in the window over
the time between the first and last of those commits); also heartbeats (in the window), steps_in_window and
members_cpu_s_per_s (the simulated members' process, which shares this machine's cores with the run).
Run: flock /tmp/geotrain-cpu.lock python bench/control_plane.py [--members 0,100,1000] [--window 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from geotrain.config import RunConfig, load_config
from geotrain.node.data import Corpus
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import TOKEN_ENV, auth_metadata, new_token
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.coordinator import Coordinator, RunAborted
from geotrain.localnodes import LocalNodes
from geotrain.scheduler.service import CoordinatorProcess

log = logging.getLogger(__name__)

NODES = 3
# Every member registers from this one host, under one node id (""): the limits per host and per peer would refuse
# most of them.
SETTINGS = ["run.steps=100000", "run.eval_every=0", "scheduler.placement=uniform", f"scheduler.stages={NODES}",
            "scheduler.replicas=1", "limits.registration_burst=100000", "limits.call_burst=100000",
            "scheduler.spares_per_host=1000000", "scheduler.spares_per_subnet=1000000", "scheduler.new_id_burst=1000000"]
_SERVICE = "/geotrain.v1.Coordinator/"
# Registrations in flight at once from the members' process: a thousand volunteers do not all start in one second.
_REGISTERING = 32
_WARMUP_S = 5.0


# -- the simulated members (a process of their own: `control_plane.py --members-of ADDRESS`) ----------------------


class Members:
    """Simulated members on this process's event loop; heartbeat round trips are kept in `samples`."""

    def __init__(self, address: str, token: str) -> None:
        self.address, self.token = address, token
        self.samples: list[float] = []
        self.errors: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self._channels: list[grpc.aio.Channel] = []
        self._gate = asyncio.Semaphore(_REGISTERING)
        self.key = NodeKey.generate()  # one key owns every simulated member and signs their calls

    def _md(self, method: str, node_id: str) -> list[tuple[str, str]]:
        return auth_metadata(self.token, _SERVICE + method, node_id, self.key)

    async def grow(self, n: int) -> None:
        """Add members until there are n, each registered with its order stream open."""
        ready = [asyncio.get_running_loop().create_future() for _ in range(n - len(self.tasks))]
        for i, future in enumerate(ready, start=len(self.tasks)):
            self.tasks.append(asyncio.create_task(self._member(i, future)))
        await asyncio.gather(*ready)

    async def _member(self, i: int, ready: asyncio.Future) -> None:
        # A connection per member, as separate volunteers have (gRPC would otherwise share one per target).
        channel = grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])
        self._channels.append(channel)
        stub = rpc.CoordinatorStub(channel)
        try:
            async with self._gate:
                request = pb.RegisterRequest(
                    protocol_version=PROTOCOL_VERSION, address=f"127.0.0.3:{i + 1}", public_key=self.key.public
                )
                reply = await stub.Register(request, metadata=self._md("Register", ""), timeout=120)
            if not reply.accepted:
                raise RuntimeError(reply.message)
            node_id = reply.node_id
            epoch = [0]
            orders = stub.Orders(pb.OrdersRequest(node_id=node_id), metadata=self._md("Orders", node_id))
            reader = asyncio.create_task(self._read(orders, epoch))
            ready.set_result(node_id)
            interval = reply.heartbeat_interval_s
            await asyncio.sleep(random.uniform(0, interval))  # members beat out of phase
            while not reader.done():
                t0 = time.perf_counter()
                beat = pb.HeartbeatRequest(node_id=node_id, plan_epoch=epoch[0])
                answer = await stub.Heartbeat(beat, metadata=self._md("Heartbeat", node_id), timeout=30)
                if not answer.known:
                    raise RuntimeError(f"{node_id} is unknown to the coordinator")
                self.samples.append(time.perf_counter() - t0)
                interval = answer.next_heartbeat_s or interval  # as a node does: spares of a large run beat less
                await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t0)))
            raise RuntimeError(f"{node_id}'s order stream ended")
        except (grpc.aio.AioRpcError, RuntimeError) as e:
            self.errors.append(str(e))
            if not ready.done():
                ready.set_exception(e)

    @staticmethod
    async def _read(orders: grpc.aio.UnaryStreamCall, epoch: list[int]) -> None:
        async for order in orders:
            if order.WhichOneof("kind") == "plan":
                epoch[0] = order.plan.epoch

    async def close(self) -> None:
        """Cancel every member and close its connection."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._channels))


async def serve_members(address: str, token: str) -> None:
    """Take commands on stdin ("grow N", "reset", "report", "quit"), answer each with one JSON line on stdout."""
    members = Members(address, token)
    loop = asyncio.get_running_loop()
    since = time.monotonic(), time.process_time()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command, *args = line.split()
        if command == "grow":
            await members.grow(int(args[0]))
            answer: dict = {"members": len(members.tasks)}
        elif command == "reset":
            members.samples.clear()
            since = time.monotonic(), time.process_time()
            answer = {}
        elif command == "report":
            samples = sorted(members.samples)
            p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))] * 1e3 if samples else None
            cpu_s_per_s = (time.process_time() - since[1]) / (time.monotonic() - since[0])
            answer = {"heartbeats": len(samples), "p99_ms": p99, "cpu_s_per_s": cpu_s_per_s, "errors": members.errors[:3]}
        else:
            break
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    await members.close()


class HelperProcess:
    """A helper process of a benchmark (`argv`), driven line by line: a command line in, one JSON line out; it ends
    when its input does."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)

    def ask(self, command: str) -> dict:
        """Send one command; its answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the helper process {self.proc.args[-2:]} ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        """End its input; kill it if it does not end."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the real run and the measurement --------------------------------------------------------------------------


class Commits:
    """When each step was committed (from the coordinator's events)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.first = threading.Event()

    def on_event(self, kind: str, _data: dict) -> None:
        """The coordinator's event sink."""
        if kind == "step":
            self.times.append(time.monotonic())
            self.first.set()

    def tokens_per_s(self, cfg: RunConfig, since: float, until: float) -> float | None:
        """Training throughput over the commits in [since, until]."""
        inside = [t for t in self.times if since <= t <= until]
        if len(inside) < 2:
            return None
        return cfg.tokens_per_step * (len(inside) - 1) / (inside[-1] - inside[0])


def measure(cfg: RunConfig, counts: list[int], window_s: float, log_dir: Path) -> None:
    """Run the real training, grow the members through `counts`, and print one JSON line per count."""
    cfg.scheduler.min_nodes = NODES
    cfg.data.fingerprint = Corpus.load(cfg.data).fingerprint
    token = new_token()
    commits = Commits()
    host = CoordinatorProcess(cfg, token, "127.0.0.1:0", on_event=commits.on_event)
    coordinator = host.coordinator
    address = f"127.0.0.1:{host.port}"
    nodes = LocalNodes(address, token, log_dir)
    host.server.start()
    run = threading.Thread(target=_train, args=(coordinator,), name="run", daemon=True)
    members: HelperProcess | None = None
    try:
        for i in range(NODES):
            nodes.start(f"node-{i + 1}")
        run.start()
        if not commits.first.wait(300):
            raise RuntimeError(f"no step committed in 300 s; node logs in {log_dir}")
        env = {**os.environ, TOKEN_ENV: token, "OMP_NUM_THREADS": "1"}
        members = HelperProcess([sys.executable, __file__, "--members-of", address], env)
        for n in counts:
            grown = members.ask(f"grow {n}")
            if grown["members"] != n:
                raise RuntimeError(f"asked for {n} members, have {grown['members']}")
            time.sleep(_WARMUP_S)
            members.ask("reset")
            wall0, cpu0 = time.monotonic(), time.process_time()
            time.sleep(window_s)
            wall1, cpu1 = time.monotonic(), time.process_time()
            report = members.ask("report")
            if report["errors"]:
                raise RuntimeError(f"simulated members failed: {report['errors']}")
            if not run.is_alive():
                raise RuntimeError("the run ended during the measurement")
            print(json.dumps({
                "members": n,
                "heartbeat_p99_ms": round(report["p99_ms"], 2) if report["p99_ms"] is not None else None,
                "heartbeats": report["heartbeats"],
                "coordinator_cpu_s_per_s": round((cpu1 - cpu0) / (wall1 - wall0), 3),
                "train_tokens_per_s": round(commits.tokens_per_s(cfg, wall0, wall1) or 0.0, 1),
                "steps_in_window": sum(wall0 <= t <= wall1 for t in commits.times),
                "members_cpu_s_per_s": round(report["cpu_s_per_s"], 3),
            }), flush=True)
    finally:
        if members is not None:
            members.close()
        coordinator.stop_requested.set()
        run.join(30)
        coordinator.shutdown_nodes("benchmark over", grace_s=1.0)
        nodes.stop_all()
        host.close()


def _train(coordinator: Coordinator) -> None:
    try:
        coordinator.run()
    except RunAborted:
        pass  # stopped at the end of the measurement


def main() -> None:
    """Measure each member count, or (--members-of) be the simulated members' process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="0,100,1000", help="comma-separated, increasing (default 0,100,1000)")
    parser.add_argument("--window", type=float, default=40.0, help="seconds measured per member count")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run config overrides")
    parser.add_argument("--members-of", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.members_of:
        asyncio.run(serve_members(args.members_of, os.environ[TOKEN_ENV]))
        return
    counts = [int(n) for n in args.members.split(",")]
    if counts != sorted(counts):
        parser.error("--members must be increasing: members are added, never removed")
    with tempfile.TemporaryDirectory(prefix="geotrain-bench-") as tmp:
        measure(load_config(None, [*SETTINGS, *args.set]), counts, args.window, Path(tmp))


if __name__ == "__main__":
    main()
