"""What a token holder can throw at a live run, shared by the attack tests (test_identity.py, test_limits.py) and
bench/attack.py: stubs that claim any node id and sign with any key (or none), forged reports and tensors, silent
streams, floods of registrations and status-page requests, profiles with extreme numbers, and real nodes with a hook
in their own process (a stage holder that stalls).

The tests check each answer; the benchmark repeats the attacks for a while and counts the answers.
"""

from __future__ import annotations

import http.client
import math
import multiprocessing
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from geotrain.localnodes import NodeProcess, _run_join
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import TOKEN_ENV
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import make_channel
from geotrain.protocol.version import PROTOCOL_VERSION
from tests.conftest import tensor_chunks

ATTACKER = "mallory"
# The numbers a profile was once let through with, and their neighbours: none is any hardware's measurement.
EXTREME_NUMBERS = (0.0, 5e-324, 1e308, math.nan, math.inf)
# A forged gradient norm: large enough to clip every step to nothing, had it been believed.
FORGED_SQ_NORM = 1e9


class Attacker:
    """A token holder at a coordinator: stubs to it and to any node, claiming any node id, signed by any key (None:
    unsigned). `outsider` is a key of its own that no member has. Channels are kept and closed by close()."""

    def __init__(self, address: str, token: str) -> None:
        self.address = address
        self.token = token
        self.outsider = NodeKey.generate()
        self._channels: dict[tuple[str, bytes | None, str], grpc.Channel] = {}

    def _channel(self, address: str, key: NodeKey | None, node_id: str) -> grpc.Channel:
        which = (address, key.public if key else None, node_id)
        if which not in self._channels:
            self._channels[which] = make_channel(address, self.token, lambda: node_id, key=key)
        return self._channels[which]

    def coordinator(self, key: NodeKey | None, node_id: str) -> rpc.CoordinatorStub:
        """A coordinator stub that claims `node_id` and signs with `key`."""
        return rpc.CoordinatorStub(self._channel(self.address, key, node_id))

    def stage(self, address: str, key: NodeKey | None, node_id: str) -> rpc.StageStub:
        """A stub to the node at `address` that claims `node_id` and signs with `key`."""
        return rpc.StageStub(self._channel(address, key, node_id))

    def register(self, node_id: str, key: NodeKey, public_key: bytes | None = None) -> pb.RegisterReply:
        """Register `node_id` with a call signed by `key`, carrying `public_key` (key's own by default)."""
        request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address="127.0.0.1:9",
                                     public_key=key.public if public_key is None else public_key)
        return self.coordinator(key, node_id).Register(request, timeout=10)

    def close(self) -> None:
        """Close every channel opened."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def answer(call: Callable[[], Any]) -> grpc.StatusCode:
    """How call() ended: OK, or the status of the RpcError it raised."""
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def forged_report(
    method: str, node_id: str, step: int, plan_epoch: int, path: list[str] | None = None, loss: float = 0.0
) -> pb.MicrobatchDoneRequest | pb.GradNormRequest | pb.StepAppliedRequest:
    """A report of `method` (MicrobatchDone of microbatch 0 along `path`, GradNorm, StepApplied) about `node_id`
    for `step`, with numbers that would change the run had they been believed."""
    if method == "MicrobatchDone":
        return pb.MicrobatchDoneRequest(node_id=node_id, step=step, microbatch=0, path=path or [node_id], loss=loss,
                                        plan_epoch=plan_epoch)
    if method == "GradNorm":
        return pb.GradNormRequest(node_id=node_id, step=step, sq_norm=FORGED_SQ_NORM, sq_norm_parts=[FORGED_SQ_NORM],
                                  plan_epoch=plan_epoch)
    if method == "StepApplied":
        return pb.StepAppliedRequest(node_id=node_id, step=step, checksum="f" * 64)
    raise ValueError(f"no forged report for {method}")


def forged_tensors(
    plan: pb.Plan, step: int, shape: tuple[int, ...]
) -> dict[str, tuple[str, str, list[pb.TensorChunk]]]:
    """Activations for stage 1 and gradients for stage 0 of microbatch 0, each claiming the path's own sender:
    direction -> (receiver's address, claimed sender, request chunks)."""
    first, second = plan.stages[0], plan.stages[1]
    tensor = torch.randn(shape)
    forward = pb.MicrobatchRef(plan_epoch=plan.epoch, step=step, microbatch=0, path=[first.node_ids[0]])
    backward = pb.MicrobatchRef(plan_epoch=plan.epoch, step=step, microbatch=0,
                                path=[first.node_ids[0], second.node_ids[0]])
    return {
        "Forward": (second.addresses[0], first.node_ids[0], tensor_chunks(tensor, forward)),
        "Backward": (first.addresses[0], second.node_ids[0], tensor_chunks(tensor, backward)),
    }


def extreme_profiles(honest: pb.NodeProfileReport, peer: str) -> Iterator[pb.NodeProfileReport]:
    """Copies of an honest profile with one number made extreme: a layer's time, a link to `peer`'s bandwidth,
    the memory."""
    for value in EXTREME_NUMBERS:
        for field in ("layer_seconds", "bandwidth_bps", "memory_bytes"):
            report = pb.NodeProfileReport()
            report.CopyFrom(honest)
            if field == "layer_seconds":
                report.layer_seconds[0] = value
            elif field == "bandwidth_bps":
                report.links.add(peer=peer, bandwidth_bps=value, rtt_s=0.001)
            elif math.isfinite(value) and 1 <= value < 2**64:  # 0 bytes is an honest "no room", not extreme
                report.memory_bytes = int(value)
            else:
                continue
            yield report


def register_many(stub: rpc.CoordinatorStub, count: int, first: int = 0) -> Counter[str]:
    """`count` registrations of new ids without a key, all sent at once (the coordinator holds the answers to refused
    calls a while: one after another they would take minutes): how many were accepted, rejected, refused by a rate
    limit (RESOURCE_EXHAUSTED: registrations or calls a second), or failed otherwise (by status)."""
    outcomes: Counter[str] = Counter()
    calls = [stub.Register.future(pb.RegisterRequest(
        protocol_version=PROTOCOL_VERSION, node_id=f"{ATTACKER}-{i}", address=f"127.0.0.1:{10000 + i % 50000}",
    ), timeout=60) for i in range(first, first + count)]
    for call in calls:
        try:
            outcomes["accepted" if call.result().accepted else "rejected"] += 1
        except grpc.RpcError as e:
            limited = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (
                "registrations a second" in e.details() or "calls a second" in e.details())
            outcomes["refused" if limited else f"{e.code().name}: {e.details()}"] += 1
    return outcomes


def flood_status_page(port: int, count: int, clients: int = 4) -> Counter[int]:
    """`count` GETs of the status page's JSON, metrics and HTML in turn, from `clients` keep-alive connections at
    once; how many got each HTTP status."""
    codes: Counter[int] = Counter()
    lock = threading.Lock()
    requests: queue.Queue[int] = queue.Queue()
    for i in range(count):
        requests.put(i)

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            while True:
                try:
                    i = requests.get_nowait()
                except queue.Empty:
                    break
                connection.request("GET", ("/api/status", "/metrics", "/")[i % 3])
                response = connection.getresponse()
                response.read()
                with lock:
                    codes[response.status] += 1
        finally:
            connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return codes


class IdleStreams:
    """`count` request streams that send nothing, each opened again as soon as the server ends it; counts how they
    ended (RESOURCE_EXHAUSTED: refused over a limit; UNAVAILABLE: refused by a node's HTTP/2 past the streams one
    connection may have; CANCELLED or DEADLINE_EXCEEDED: cut when idle)."""

    def __init__(self, open_stream: Callable[[Iterator], grpc.Future], count: int) -> None:
        self._open_stream = open_stream
        self._closing = threading.Event()  # no more reopening or counting
        self._stop = threading.Event()  # the silent streams end (the server answers them INVALID_ARGUMENT: empty)
        self.ended: Counter[grpc.StatusCode] = Counter()
        self._futures = [self._open() for _ in range(count)]
        self._thread = threading.Thread(target=self._reopen, daemon=True)
        self._thread.start()

    def _silence(self) -> Iterator:
        self._stop.wait()
        yield from ()

    def _open(self) -> grpc.Future:
        return self._open_stream(self._silence())

    def _reopen(self) -> None:
        while not self._closing.wait(0.1):
            for i, future in enumerate(self._futures):
                if future.done():
                    self.ended[future.code()] += 1
                    self._futures[i] = self._open()

    @property
    def running(self) -> bool:
        return not self._closing.is_set()

    def stop(self) -> None:
        self._closing.set()
        self._thread.join(5)
        self._stop.set()
        for future in self._futures:
            future.cancel()


class CountingListener:
    """A TCP port on `host` that counts the connections made to it and closes each at once (a third host that a
    token holder names for the coordinator to dial), or with `hold`, keeps each open without a byte (a tarpit)."""

    def __init__(self, host: str, hold: bool = False) -> None:
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self.connections = 0
        self._hold = hold
        self._held: list[socket.socket] = []
        _accept_each(self._server, self._take)

    def _take(self, sock: socket.socket) -> None:
        self.connections += 1
        if self._hold:
            self._held.append(sock)
        else:
            sock.close()

    def close(self) -> None:
        """Stop listening and drop every held connection."""
        self._server.close()
        for sock in self._held:
            sock.close()


class SourceProxy:
    """A loopback port whose connections reach `upstream` from source address `source` (another 127.x address): a
    volunteer on another host, as the coordinator sees it."""

    def __init__(self, upstream: str, source: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream, self._source = (host, int(port)), source
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        _accept_each(self._server, self._forward)

    def _forward(self, down: socket.socket) -> None:
        up = socket.create_connection(self._upstream, source_address=(self._source, 0))
        for a, b in ((down, up), (up, down)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        """Stop listening (open connections end with their ends)."""
        self._server.close()


def _accept_each(server: socket.socket, take: Callable[[socket.socket], None]) -> None:
    """take() each connection `server` accepts, in a thread of its own, until the server is closed."""

    def accept() -> None:
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return
            take(sock)

    threading.Thread(target=accept, daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def hooked_node(install: Callable[[Any], None], arg: Any, node_id: str, coordinator: str, token: str, log_dir: Path,
                state_dir: Path) -> NodeProcess:
    """`geotrain join` as node_id in a process of its own with install(arg) run first, in that process only: an
    adversarial node made without touching node code. Its key is state_dir's, the same whatever id it claims."""
    argv = ["--log-level", "info", "join", "--coordinator", coordinator, "--node-id", node_id,
            "--listen", "127.0.0.1:0", "--state-dir", str(state_dir)]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", TOKEN_ENV: token}
    process = multiprocessing.get_context("spawn").Process(
        target=_hooked_join, args=(install, arg, node_id, argv, env, str(log_dir / f"{node_id}.log"), os.getpid()),
    )
    process.start()
    return NodeProcess(process)


def _hooked_join(install: Callable[[Any], None], arg: Any, node_id: str, argv: list[str], env: dict[str, str],
                 log_path: str, starter: int) -> None:
    install(arg)
    _run_join(node_id, argv, env, log_path, starter)


def stall_tensors(hold_s: float) -> None:
    """A stalling stage holder's hook (hooked_node's install): of the tensors its stage gets in each step it takes
    the first at once and holds every later one hold_s before taking it, so their senders' calls wait that long
    (the stage taken, one microbatch answered, the rest never in time)."""
    from geotrain.node.servicer import StageServicer

    take = StageServicer.take
    answered: set[tuple[int, int]] = set()

    def stalling(self: StageServicer, direction: str, received: Any) -> None:
        step = (received.ref.plan_epoch, received.ref.step)
        if step in answered:
            time.sleep(hold_s)
        answered.add(step)
        take(self, direction, received)

    StageServicer.take = stalling
