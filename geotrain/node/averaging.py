"""Replica gradient averaging through hivemind: butterfly all-reduce over libp2p among a stage's replicas.

hivemind's DecentralizedAverager finds its group by matchmaking over the DHT, which takes seconds and may form
any group. geotrain's coordinator already knows the group (the stage's replicas for that step), so each node runs
hivemind's AllReduceRunner directly with the group and order the coordinator fixed, and this servicer routes
incoming parts to the runner of their group, waiting briefly for a peer that starts its runner a little later.
How a part is reduced (exact sums, CenteredClip) is node/reducers.py; a stage's flat or region-by-region all-reduce
over these groups is node/allreduce.py, and PowerSGD's factors node/lowrank.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import AsyncIterator, NamedTuple  # noqa: UP035 - hivemind detects streaming RPCs by typing's alias only

import torch
from hivemind import DHT
from hivemind.averaging.allreduce import AllReduceRunner, AllreduceException
from hivemind.p2p import P2PContext, PeerID, ServicerBase, StubBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, aenumerate, anext, as_aiter

from geotrain.node.reducers import ClipRunner, PresummedRunner
from geotrain.protocol.auth import RefusalLog
from geotrain.protocol.transport import multiaddr_host

log = logging.getLogger(__name__)

_NAMESPACE = "geotrain"


def group_id(run: str, stage: int, step: int, epoch: int, round_: int = 0, part: str = "") -> bytes:
    """The all-reduce group of one stage's replicas for one round of one step of one plan epoch; `part` names one
    of the several all-reduces a hierarchical round runs (its phase, site, shard)."""
    name = f"{run}/{epoch}/{stage}/{step}/{round_}" + (f"/{part}" if part else "")
    return hashlib.sha256(name.encode()).digest()[:16]


def dht_maddrs(host: str, advertised: bool, port: int) -> tuple[list[str], list[str] | None]:
    """Where a node's DHT listens, and the addresses it announces (None: where it listens): on the host of its
    address at `port` (--dht-port; 0 picks one). A node advertised at a host none of its interfaces may have (a cloud
    VM's public IP, a router's port forward, a relay) listens on every interface instead, once its port is fixed, and
    announces the advertised host with that port: the port is the one a firewall or a forward lets through."""
    if advertised and port:
        return [f"/ip4/0.0.0.0/tcp/{port}"], [f"{multiaddr_host(host)}/tcp/{port}"]
    return [f"{multiaddr_host(host)}/tcp/{port}"], None


class Job(NamedTuple):
    """One weighted all-reduce: its group id, its peers (base58) in the order every member uses, the tensors."""

    gid: bytes
    peers: Sequence[str]
    tensors: Sequence[torch.Tensor]
    weight: float
    # "": hivemind's weighted mean. "mean" / "sum": float64 tensors holding weight x mean, added exactly
    # (PresummedRunner), then divided by the total weight and rounded to float32 ("mean") or left as they are ("sum");
    # "sum" also adds integer tensors (one dtype for all of a job's tensors), exactly while the sums fit the dtype.
    presummed: str = ""
    # > 0: CenteredClip with this clip radius, as a root mean square per value, instead of the mean (presummed "mean").
    clip_rms: float = 0.0


class ReplicaAverager(ServicerBase):
    """Weighted all-reduce of tensors with a group of peers the caller names."""

    def __init__(self, dht: DHT, timeout_s: float = 30.0) -> None:
        self.dht = dht
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="averaging", daemon=True)
        self._thread.start()
        self._runners: dict[bytes, asyncio.Future[AllReduceRunner]] = {}
        self._running: set[concurrent.futures.Future] = set()
        self._clipped: set[str] = set()  # peers whose parts CenteredClip clipped here since take_clipped()
        self._clipped_lock = threading.Lock()
        self._refusals = RefusalLog()  # parts from peers outside their group: one line per peer and interval
        # Peers (base58) nobody can dial, from the plan: in hivemind's client mode they send their parts and reduce
        # none, so that nobody opens a stream to them.
        self.clients: frozenset[str] = frozenset()
        self.bytes_sent = 0  # averaging messages this peer sent (its parts and, as a reducer, the averaged parts)
        self._p2p = self._call(self.dht.replicate_p2p())
        self._call(self.add_p2p_handlers(self._p2p, namespace=_NAMESPACE))
        self.peer_id = self._p2p.peer_id.to_base58()

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _runner_future(self, gid: bytes) -> asyncio.Future[AllReduceRunner]:
        if gid not in self._runners:
            self._runners[gid] = self._loop.create_future()
        return self._runners[gid]

    def average(self, gid: bytes, peers: Sequence[str], tensors: Sequence[torch.Tensor], weight: float) -> None:
        """Replace `tensors` in place by the weight-averaged tensors of the group `peers` (base58 peer ids)."""
        self.average_all([Job(gid, peers, tensors, weight)])

    def average_all(self, jobs: Sequence[Job]) -> None:
        """Run several all-reduces at once, each in its own group, and wait for all of them."""
        future = asyncio.run_coroutine_threadsafe(self._average_all(jobs), self._loop)
        self._running.add(future)
        try:
            future.result(self.timeout_s * 2)
        finally:
            self._running.discard(future)

    async def _average_all(self, jobs: Sequence[Job]) -> None:
        tasks = [
            asyncio.ensure_future(
                self._average(j.gid, [PeerID.from_base58(p) for p in j.peers], j.tensors, j.weight, j.presummed,
                              j.clip_rms)
            )
            for j in jobs
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one failed or the caller gave up: the round fails as a whole
                task.cancel()

    def take_clipped(self) -> list[str]:
        """The peers (base58) whose parts CenteredClip clipped here since the last call, sorted."""
        with self._clipped_lock:
            clipped, self._clipped = self._clipped, set()
        return sorted(clipped)

    def cancel_all(self) -> None:
        """Abandon every all-reduce in progress (its group changed); their average() calls raise CancelledError."""
        for future in list(self._running):
            future.cancel()

    async def _average(
        self, gid: bytes, peers: list[PeerID], tensors: Sequence[torch.Tensor], weight: float, presummed: str,
        clip_rms: float = 0.0,
    ) -> None:
        future = self._runner_future(gid)
        try:
            if clip_rms > 0:
                kind = functools.partial(ClipRunner, clip_rms)
            elif presummed:
                kind = functools.partial(PresummedRunner, presummed == "mean")
            else:
                kind = AllReduceRunner
            reducers = [float(p.to_base58() not in self.clients) for p in peers]
            if not any(reducers):
                raise AllreduceException("nobody can dial any replica of the group: none can reduce a part")
            runner = kind(
                p2p=self._p2p,
                servicer_type=type(self),
                prefix=_NAMESPACE,
                group_id=gid,
                tensors=tensors,
                weight=weight,
                ordered_peer_ids=peers,
                peer_fractions=tuple(r / sum(reducers) for r in reducers),
                sender_timeout=self.timeout_s / 2,
                reducer_timeout=self.timeout_s,
            )
            _close_streams_after_last_part(runner, self._count_sent)
            future.set_result(runner)
            async for index, delta in aenumerate(runner):
                tensors[index].add_(delta)
            if isinstance(runner, ClipRunner):
                for peer in runner.clipped_peers():
                    log.warning("replica %s sent an outlying gradient: CenteredClip clipped it", peer)
                    with self._clipped_lock:
                        self._clipped.add(peer)
            container = runner.tensor_part_container
            if container.failed_size:  # hivemind keeps this replica's own values for those: replicas would differ
                received = 1 - container.failed_size / container.total_size
                raise AllreduceException(f"a groupmate failed: received {received:.1%} of the averaged values")
        finally:
            self._runners.pop(gid, None)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's part: hand it to our runner for that group, once we have one. The stream stays open until
        the groupmate closes it (_close_streams_after_last_part)."""
        request = await anext(stream)
        future = self._runner_future(request.group_id)
        try:
            runner = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            self._runners.pop(request.group_id, None)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        else:
            if context.remote_id not in runner.sender_peer_ids:
                # Only the peers the coordinator named for this group may send parts (hivemind would raise on it).
                self._refusals.refused(str(context.remote_id), "averaging part", "", "not a member of its group")
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            async for message in runner.rpc_aggregate_part(achain(as_aiter(request), stream), context):
                self._count_sent(message)
                yield message
        await asyncio.sleep(self.timeout_s)  # hivemind's p2p layer cancels this wait when the groupmate closes

    def _count_sent(self, message: averaging_pb2.AveragingData) -> None:
        # Only the event loop's thread counts: no lock; readers (heartbeats) take a possibly older total.
        self.bytes_sent += message.ByteSize()

    def shutdown(self) -> None:
        """Close this averager's connection to the p2p daemon and stop the event loop thread (the DHT is the
        caller's)."""
        try:
            self._call(self._close(), timeout=2)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            log.debug("averager tasks still running at shutdown")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(2)

    async def _close(self) -> None:
        await self._p2p.shutdown()  # removes its socket file and cancels its reader and writer
        # Tasks left pending when the loop stops would be destroyed mid-await and complain about a closed loop.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _close_streams_after_last_part(
    runner: AllReduceRunner, count_sent: Callable[[averaging_pb2.AveragingData], None]
) -> None:
    """Make `runner` close its stream to each groupmate once it holds every averaged part it expects from it, and
    count what it sends them. hivemind's reducer closes the stream after its last part, and the p2p daemon can reset
    it while those parts are still on their way: the sender keeps its own values for the missing ones, and replicas
    disagree. The sender closing first, with the reducer holding the stream open until then
    (ReplicaAverager.rpc_aggregate_part), closes no stream on data."""
    stub_for = runner._get_peer_stub

    def closing_stub(peer: PeerID) -> _ClosingStub:
        expected = runner.tensor_part_container.num_parts_by_peer[runner.ordered_peer_ids.index(peer)]
        return _ClosingStub(stub_for(peer), expected, count_sent)

    runner._get_peer_stub = closing_stub  # the only way AllReduceRunner reaches a groupmate's reducer


class _ClosingStub:
    """A groupmate's averaging stub whose rpc_aggregate_part stream ends, and closes, after `expected` replies; each
    request it sends is counted."""

    def __init__(
        self, stub: StubBase, expected: int, count_sent: Callable[[averaging_pb2.AveragingData], None]
    ) -> None:
        self._stub, self._expected, self._count_sent = stub, expected, count_sent

    async def rpc_aggregate_part(
        self, requests: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Send `requests`; the replies, up to the expected number, after which the stream is closed."""
        return _take_then_close(await self._stub.rpc_aggregate_part(self._counted(requests)), self._expected)

    async def _counted(
        self, requests: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for request in requests:
            self._count_sent(request)
            yield request


async def _take_then_close(
    replies: AsyncGenerator[averaging_pb2.AveragingData, None], n: int
) -> AsyncIterator[averaging_pb2.AveragingData]:
    try:
        async for i, reply in aenumerate(replies):
            yield reply
            if i + 1 == n:
                return
    finally:
        await replies.aclose()
