"""Replica gradient averaging through hivemind: butterfly all-reduce over libp2p among a stage's replicas.

hivemind's DecentralizedAverager finds its group by matchmaking over the DHT, which takes seconds and may form
any group. geotrain's coordinator already knows the group (the stage's replicas for that step), so each node runs
hivemind's AllReduceRunner directly with the group and order the coordinator fixed, and this servicer routes
incoming parts to the runner of their group, waiting briefly for a peer that starts its runner a little later.

With compression.replica_grads = "powersgd[:rank=R]", LowRankAveraging all-reduces PowerSGD's two thin factors
per matrix instead of the gradients (see its docstring).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streaming RPCs by typing's alias only

import torch
from hivemind import DHT
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, aenumerate, anext, as_aiter

from geotrain.compression import PowerSgdCodec

log = logging.getLogger(__name__)

_NAMESPACE = "geotrain"


def group_id(run: str, stage: int, step: int, epoch: int, round_: int = 0) -> bytes:
    """The all-reduce group of one stage's replicas for one round of one step of one plan epoch."""
    return hashlib.sha256(f"{run}/{epoch}/{stage}/{step}/{round_}".encode()).digest()[:16]


AllReduce = Callable[[int, list[torch.Tensor]], None]
"""all_reduce(round, tensors): replace float64 tensors in place by their weighted mean over the group."""


# What is left of a column after projecting out the others, relative to its norm, below which it was dependent.
_DEPENDENT = 1e-9


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    # Exactly rounded (math.fsum), so the result does not depend on how a platform orders a reduction.
    return math.fsum((a * b).tolist())


def orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """The columns of p (float64) orthonormalised by Gram-Schmidt, run twice for accuracy; a column that depends
    on the ones before it (all but rounding noise of it projected away) comes out zero. Built from correctly
    rounded elementwise operations and exactly rounded dot products only, so any hardware computes the same bits
    from the same p (LAPACK's QR need not)."""
    columns: list[torch.Tensor] = []
    for j in range(p.shape[1]):
        v = p[:, j].clone()
        before = math.sqrt(_dot(v, v))
        for _ in range(2):
            for u in columns:
                v = v - u * _dot(u, v)
        norm = math.sqrt(_dot(v, v))
        columns.append(v / norm if norm > _DEPENDENT * before else torch.zeros_like(v))
    return torch.stack(columns, 1)


class LowRankAveraging:
    """PowerSGD (Vogels et al., NeurIPS 2019) as the replicas' gradient averaging.

    For each gradient matrix M (rows = first dimension), replica i adds its error feedback e_i, computes
    P_i = (M_i + e_i) Q with the group's shared Q, and the group all-reduces the P_i (round 0, together with the
    tensors too small to gain from a low-rank form, which are averaged whole); every replica orthonormalises the
    mean to P^, computes Q_i = (M_i + e_i)^T P^, and the group all-reduces the Q_i (round 1). Every replica's
    gradient becomes P^ mean(Q)^T and its error feedback (M_i + e_i) - P^ Q_i^T; mean(Q) warm-starts the next step.
    The wire carries rank x (rows + cols) values per matrix instead of rows x cols.

    Replicas stay bit-identical: both means come out of the all-reduce alike on every replica (float64 copies,
    as with uncompressed averaging), and what is computed from them afterwards (the orthonormalisation, the rank-R
    product) uses only operations every platform rounds alike. Error feedback and Q start afresh with a new plan
    epoch: the group, the stage's layers, and the step being redone may all have changed."""

    def __init__(self, codec: PowerSgdCodec) -> None:
        self.codec = codec
        self._epoch: int | None = None
        self._residuals: dict[int, torch.Tensor] = {}
        self._q: dict[int, torch.Tensor] = {}

    def average(self, epoch: int, grads: Sequence[torch.Tensor], all_reduce: AllReduce) -> None:
        """Replace `grads` in place by the group's low-rank mean gradient."""
        if epoch != self._epoch:
            self._epoch, self._residuals, self._q = epoch, {}, {}
        forms = {i: self.codec.matrix(tuple(g.shape)) for i, g in enumerate(grads)}
        matrices = {i: form for i, form in forms.items() if form is not None}
        whole = [i for i, form in forms.items() if form is None]
        acc: dict[int, torch.Tensor] = {}
        for i, (rows, cols, rank) in matrices.items():
            m = grads[i].double().view(rows, cols)
            residual = self._residuals.get(i)
            acc[i] = m + residual if residual is not None else m
            if i not in self._q:
                seed = torch.Generator().manual_seed(rows * cols)
                self._q[i] = torch.randn(cols, rank, generator=seed, dtype=torch.float64)
        p = {i: acc[i] @ self._q[i] for i in matrices}
        whole_values = [grads[i].double() for i in whole]
        all_reduce(0, [p[i] for i in matrices] + whole_values)
        p_hat = {i: orthonormal_columns(p[i]) for i in matrices}
        q_local = {i: acc[i].T @ p_hat[i] for i in matrices}
        q_mean = {i: q.clone() for i, q in q_local.items()}
        all_reduce(1, list(q_mean.values()))
        for i, (rows, cols, rank) in matrices.items():
            approx = torch.zeros(rows, cols, dtype=torch.float64)
            for j in range(rank):  # rank-1 terms in a fixed order: elementwise products and sums round alike
                approx = approx + p_hat[i][:, j : j + 1] * q_mean[i][:, j]
            grads[i].copy_(approx.view(grads[i].shape))
            self._residuals[i] = acc[i] - p_hat[i] @ q_local[i].T  # local: it may round as this platform likes
            # A zero column would stay zero from the warm start on; a fresh random Q replaces it next step.
            if bool((q_mean[i].abs().amax(0) > 0).all()):
                self._q[i] = q_mean[i]
            else:
                del self._q[i]
        for i, averaged in zip(whole, whole_values):
            grads[i].copy_(averaged)


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
