"""Replica gradient averaging through hivemind: butterfly all-reduce over libp2p among a stage's replicas.

hivemind's DecentralizedAverager finds its group by matchmaking over the DHT, which takes seconds and may form
any group. geotrain's coordinator already knows the group (the stage's replicas for that step), so each node runs
hivemind's AllReduceRunner directly with the group and order the coordinator fixed, and this servicer routes
incoming parts to the runner of their group, waiting briefly for a peer that starts its runner a little later.

With compression.replica_grads = "powersgd[:rank=R]", node.lowrank.LowRankAveraging runs on top of it and
all-reduces PowerSGD's two thin factors per matrix instead of the gradients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streaming RPCs by typing's alias only

import torch
from hivemind import DHT
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, aenumerate, anext, as_aiter

log = logging.getLogger(__name__)

_NAMESPACE = "geotrain"


def group_id(run: str, stage: int, step: int, epoch: int, round_: int = 0) -> bytes:
    """The all-reduce group of one stage's replicas for one round of one step of one plan epoch."""
    return hashlib.sha256(f"{run}/{epoch}/{stage}/{step}/{round_}".encode()).digest()[:16]


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
        future = asyncio.run_coroutine_threadsafe(
            self._average(gid, [PeerID.from_base58(p) for p in peers], tensors, weight), self._loop
        )
        self._running.add(future)
        try:
            future.result(self.timeout_s * 2)
        finally:
            self._running.discard(future)

    def cancel_all(self) -> None:
        """Abandon every all-reduce in progress (its group changed); their average() calls raise CancelledError."""
        for future in list(self._running):
            future.cancel()

    async def _average(
        self, gid: bytes, peers: list[PeerID], tensors: Sequence[torch.Tensor], weight: float
    ) -> None:
        future = self._runner_future(gid)
        try:
            runner = AllReduceRunner(
                p2p=self._p2p,
                servicer_type=type(self),
                prefix=_NAMESPACE,
                group_id=gid,
                tensors=tensors,
                weight=weight,
                ordered_peer_ids=peers,
                peer_fractions=tuple(1.0 / len(peers) for _ in peers),
                sender_timeout=self.timeout_s / 2,
                reducer_timeout=self.timeout_s,
            )
            future.set_result(runner)
            async for index, delta in aenumerate(runner):
                tensors[index].add_(delta)
        finally:
            self._runners.pop(gid, None)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's part: hand it to our runner for that group, once we have one."""
        request = await anext(stream)
        future = self._runner_future(request.group_id)
        try:
            runner = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            self._runners.pop(request.group_id, None)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in runner.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    def shutdown(self) -> None:
        """Stop the event loop thread (the DHT is the caller's)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(2)
