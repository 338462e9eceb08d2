"""Replica gradient averaging through hivemind: butterfly all-reduce over libp2p among a stage's replicas.

hivemind's DecentralizedAverager finds its group by matchmaking over the DHT, which takes seconds and may form
any group. geotrain's coordinator already knows the group (the stage's replicas for that step), so each node runs
hivemind's AllReduceRunner directly with the group and order the coordinator fixed, and this servicer routes
incoming parts to the runner of their group, waiting briefly for a peer that starts its runner a little later.

With compression.replica_grads = "powersgd[:rank=R]", node.lowrank.LowRankAveraging runs on top of it and
all-reduces PowerSGD's two thin factors per matrix instead of the gradients.

With compression.replica_robust = "centered_clip", each part's reducer keeps every replica's part and aggregates them
with CenteredClip (Gorbunov et al. 2021, "Secure Distributed Training at Scale", as BTARD does per part) instead of
the mean: a replica that sends an outlying gradient moves the result by at most its share (one of the replicas) of
the clip radius, and is flagged; one that claims a weight above its microbatch count moves it at most the radius.

A stage whose plan says hierarchical_allreduce averages region by region instead (HierarchicalAllReduce): fast
links inside a region carry most of the traffic, and each replica sends only its shard across the slow ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import math
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import AsyncIterator, NamedTuple  # noqa: UP035 - hivemind detects streaming RPCs by typing's alias only

import torch
from hivemind import DHT
from hivemind.averaging.allreduce import AllReduceRunner, AllreduceException
from hivemind.averaging.partition import TensorPartReducer
from hivemind.p2p import P2PContext, PeerID, ServicerBase, StubBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, aenumerate, anext, as_aiter

from geotrain.node.lowrank import AllReduce
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
    # (_PresummedRunner), then divided by the total weight and rounded to float32 ("mean") or left as they are ("sum");
    # "sum" also adds integer tensors (one dtype for all of a job's tensors), exactly while the sums fit the dtype.
    presummed: str = ""
    # > 0: CenteredClip with this clip radius, as a root mean square per value, instead of the mean (presummed "mean").
    clip_rms: float = 0.0


class _SumAccumulator:
    """Takes the place of TensorPartReducer's float32 accumulator, which rounds every addition in the order parts
    arrive. Parts here are replicas' float64 sums of float32 gradients (weight x mean), or integers: adding them in
    float64 is exact wherever each replica's own sums were (node.stage), so the total does not depend on the order.
    With `mean` it is divided by the total weight and rounded to float32 once, as train-local rounds its mean;
    without, the exact sum is returned in the parts' dtype, and each member's own part plus its delta (the others'
    exact sum) is that sum again."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, mean: bool) -> None:
        self.total = torch.zeros(shape, dtype=torch.float64)
        self.dtype = dtype
        self.mean = mean

    def add_(self, part: torch.Tensor, alpha: float) -> None:  # noqa: ARG002 - the weight is already in the part
        if part.dtype != self.dtype:  # a wider part would be cut back to this dtype, differently from its sender
            raise AllreduceException(f"a part of dtype {part.dtype} in an all-reduce of {self.dtype}")
        self.total.add_(part)

    def div_(self, denominator: float) -> torch.Tensor:
        if not self.mean:
            return self.total.to(self.dtype)
        # On the float32 grid, so that each replica's x + (average - x) rounds back to these bits (_round_to_float32).
        return self.total.div_(denominator).float().double()


class _PresummedReducer(TensorPartReducer):
    """hivemind's reducer (waiting, part order, failed senders) with _SumAccumulator for its arithmetic."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, dtype: torch.dtype, mean: bool) -> None:
        self.dtype, self.mean = dtype, mean  # before hivemind's __init__, which makes the first accumulator
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:  # noqa: D102
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _SumAccumulator(self.part_shapes[self.current_part_index], self.dtype, self.mean)


class _PresummedRunner(AllReduceRunner):
    """AllReduceRunner whose reducer sums presummed parts exactly (_SumAccumulator)."""

    def __init__(self, mean: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        dtype = kwargs["tensors"][0].dtype  # a job's tensors share one dtype (Job)
        unused, self.tensor_part_reducer = self.tensor_part_reducer, _PresummedReducer(
            self.tensor_part_reducer.part_shapes, self.tensor_part_reducer.num_senders, dtype, mean
        )
        unused.finished.set()  # it never takes a part: finalising it would warn that parts were missing


# Iterations of CenteredClip: each moves the estimate by at most the clip radius; from the median these are plenty.
CLIP_ITERATIONS = 20


def centered_clip(values: Sequence[torch.Tensor], radius: float) -> tuple[torch.Tensor, list[int]]:
    """CenteredClip of `values` (one tensor per replica, each counted once): from their coordinate-wise median,
    repeat v <- v + mean_i clip(x_i - v, radius), where clip scales a difference longer than `radius` (an L2 norm)
    down to it. Returns v and the indices of the values still farther than `radius` from it (the clipped)."""
    stacked = torch.stack(list(values))
    v = stacked.median(dim=0).values
    for _ in range(CLIP_ITERATIONS):
        diff = stacked - v
        norms = diff.flatten(1).norm(dim=1)
        scale = torch.clamp(radius / torch.clamp(norms, min=1e-300), max=1.0).view(-1, *([1] * (stacked.dim() - 1)))
        v = v + (scale * diff).mean(dim=0)
    norms = (stacked - v).flatten(1).norm(dim=1)
    return v, [i for i, n in enumerate(norms.tolist()) if n > radius]


class _ClipAccumulator:
    """Takes the place of the reducer's accumulator under CenteredClip: keeps each sender's part (replicas' float64
    sums, weight x mean) and, once all are in, returns a robust estimate of their mean on the float32 grid (as
    _SumAccumulator's mean), noting which senders it clipped.

    A sender's weight (its microbatch count) is its own claim, which nothing here can check: CenteredClip counts
    every replica that computed a microbatch once, so that a replica claiming a huge weight pulls no harder than
    the others. When it clips no one, every replica's mean lies within the radius of its estimate, and so does
    their weighted mean, which is returned instead: the exact mean of an honest step (as the summing reducer's),
    and one that a liar about its weight can move at most the radius from the robust estimate."""

    def __init__(self, shape: torch.Size, clip_rms: float, clipped: set[int]) -> None:
        self.shape = shape
        self.radius = clip_rms * max(1, shape.numel()) ** 0.5
        self.parts: list[tuple[int, torch.Tensor, float]] = []
        self.clipped = clipped

    def add_(self, sender_part: tuple[int, torch.Tensor], alpha: float) -> None:
        sender, part = sender_part
        self.parts.append((sender, part, alpha))

    def div_(self, _denominator: float) -> torch.Tensor:
        counted = [(sender, part, weight) for sender, part, weight in self.parts if weight > 0]
        # A NaN or an infinity would make the median and every distance NaN: such a part or weight is left out, and
        # flagged.
        self.clipped.update(sender for sender, part, weight in counted
                            if not (math.isfinite(weight) and bool(torch.isfinite(part).all())))
        counted = [c for c in counted if c[0] not in self.clipped]
        if not counted:  # no replica computed a microbatch: the mean of nothing, as the summing reducer gives
            return torch.zeros(self.shape, dtype=torch.float64)
        estimate, clipped = centered_clip([part / weight for _, part, weight in counted], self.radius)
        if clipped:
            self.clipped.update(counted[i][0] for i in clipped)
            return estimate.float().double()
        return (sum(part for _, part, _ in counted) / sum(weight for _, _, weight in counted)).float().double()


class _ClipReducer(TensorPartReducer):
    """hivemind's reducer with _ClipAccumulator: each part travels to the accumulator with its sender's index."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, clip_rms: float) -> None:
        self.clip_rms = clip_rms
        self.clipped: set[int] = set()  # sender indices clipped in any part
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:  # noqa: D102
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _ClipAccumulator(self.part_shapes[self.current_part_index], self.clip_rms, self.clipped)

    async def accumulate_part(  # noqa: D102
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        return await super().accumulate_part(sender_index, part_index, (sender_index, tensor_part), weight)


class _ClipRunner(AllReduceRunner):
    """AllReduceRunner whose reducer aggregates presummed parts by CenteredClip (_ClipReducer)."""

    def __init__(self, clip_rms: float, **kwargs) -> None:
        super().__init__(**kwargs)
        unused, self.tensor_part_reducer = self.tensor_part_reducer, _ClipReducer(
            self.tensor_part_reducer.part_shapes, self.tensor_part_reducer.num_senders, clip_rms
        )
        unused.finished.set()

    def clipped_peers(self) -> list[str]:
        """The groupmates (base58) whose parts this peer's reducer clipped."""
        return [self.ordered_peer_ids[i].to_base58() for i in sorted(self.tensor_part_reducer.clipped)]


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
                kind = functools.partial(_ClipRunner, clip_rms)
            elif presummed:
                kind = functools.partial(_PresummedRunner, presummed == "mean")
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
            if isinstance(runner, _ClipRunner):
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
    count what it sends them.

    hivemind's reducer closes the stream after sending its last part, and its p2p daemon can then reset the stream
    while those last parts are still on their way: the sender counts fewer parts than it expects ("peer sent 11
    parts, but we expected 13"), keeps its own values for the rest ("received 85% results"), and the replicas
    disagree. That failed 6 steps in 200 of a clean 2x2 run (bench/replica_failures.py), and 4 of 300 back-to-back
    all-reduces of a stage's gradients between two averagers; 0 of each since. With the sender closing first, once nothing is in flight, and the reducer
    holding the stream open until then (ReplicaAverager.rpc_aggregate_part), no stream closes on data."""
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


def sites_of(peers: Sequence[str], regions: Sequence[str]) -> list[list[str]]:
    """Replicas grouped by region: sites in order of first appearance, members in the order given."""
    sites: dict[str, list[str]] = {}
    for peer, region in zip(peers, regions, strict=True):
        sites.setdefault(region, []).append(peer)
    return list(sites.values())


def replica_all_reduce(
    averager: ReplicaAverager,
    peers: Sequence[str],
    regions: Sequence[str],
    weight: float,
    gid: Callable[[int, str], bytes],
    hierarchical: bool,
    presummed: bool = False,
    clip_rms: float = 0.0,
) -> AllReduce:
    """The stage's all_reduce(round, tensors) for this replica: region by region when asked and the sites make it
    differ from one flat group (several sites, one of them with several replicas), else one flat group.
    gid(round, part) names each all-reduce's group. With `presummed` the tensors hold weight x mean (this replica's
    float64 sums), which either way are added exactly, in any order, and divided by the total weight once. With
    `clip_rms` (presummed only) one flat group aggregates them by CenteredClip: a robust aggregate needs every
    replica's values in one place, which the region-by-region phases never have."""
    sites = sites_of(peers, regions)
    if clip_rms > 0:
        assert presummed, "CenteredClip aggregates gradients, not PowerSGD's factors"
        hierarchical = False
    if hierarchical and len(sites) > 1 and max(map(len, sites)) > 1:
        return HierarchicalAllReduce(averager, sites, weight, gid, presummed)

    def flat(round_: int, tensors: list[torch.Tensor]) -> None:
        if presummed:
            averager.average_all([Job(gid(round_, ""), peers, tensors, weight, presummed="mean", clip_rms=clip_rms)])
        else:
            averager.average(gid(round_, ""), peers, tensors, weight)
        for t in tensors:
            _round_to_float32(t)

    return flat


def _round_to_float32(t: torch.Tensor) -> None:
    """Round an all-reduced float64 tensor to the float32 average the reducer computed, the same bits on every
    replica. A replica holds its own value plus the reducer's delta (average - own value, rounded in float64), which
    differs from the average in the last float64 bits wherever the two differ in sign or scale (a tenth of the values
    of independent normal tensors), differently on each replica: harmless for gradients copied into float32, but
    PowerSGD computes on from the float64 values."""
    t.copy_(t.float())


class HierarchicalAllReduce:
    """Weighted all-reduce of a stage's replicas site by site (a site: the replicas in one region).

    With k_r replicas in site r and L = max k_r, the tensors are flattened into one vector cut into L contiguous
    shards, and member j of site r handles the shards p with p % k_r == j.
    A: each site averages the whole vector inside itself, weighted by the members' weights, and the members'
       weights unweighted, which gives the site's total weight W_r: k_r times their mean, to float32 precision
       like every average here.
    B: for each shard, its handlers (one per site) average it across sites, weighted by W_r: the weighted mean
       over all replicas. Only this phase crosses regions, with 1/k_r of the vector per replica.
    C: each site shares its handlers' shards: one all-reduce per member j in which j sends its shards with weight
       1 and the others zeros with weight 0. hivemind's reducer sums weight x part into a float32 accumulator and
       divides by the summed weight, 1.0, so every member gets the float32 rounding of j's values, j included:
       B's float32 average.
    Every replica then rounds the vector to float32 (_round_to_float32), which changes nothing after C and gives
    a one-member site's replica B's float32 average too.
    With `presummed` (replicas' float64 gradient sums, weight x mean) A adds the sums and the weights exactly
    instead of averaging them, and B divides the exact total by the total weight once (_SumAccumulator): the mean
    train-local computes. A member whose site sum rounded (node.stage says when) may hold other float64 bits than
    its site mates, but B takes each shard from one member per site, so every replica still ends alike."""

    def __init__(
        self,
        averager: ReplicaAverager,
        sites: list[list[str]],
        weight: float,
        gid: Callable[[int, str], bytes],
        presummed: bool = False,
    ) -> None:
        self.averager, self.sites, self.weight, self.gid, self.presummed = averager, sites, weight, gid, presummed
        self.site = next(r for r, members in enumerate(sites) if averager.peer_id in members)
        self.member = sites[self.site].index(averager.peer_id)
        self.n_shards = max(map(len, sites))

    def __call__(self, round_: int, tensors: list[torch.Tensor]) -> None:
        """Replace float64 `tensors` in place by their weighted mean over every replica of the stage."""
        if not any(t.numel() for t in tensors):
            return  # e.g. PowerSGD's second round on a stage without matrices; every replica returns alike
        members = self.sites[self.site]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        shards = torch.tensor_split(flat, self.n_shards)  # views: all-reducing a shard writes into flat
        # An empty shard (fewer values than shards) needs no all-reduce; every replica skips the same ones.
        held_by = [[p for p in range(len(shards)) if p % len(members) == j and shards[p].numel()]
                   for j in range(len(members))]
        site_weight = self._average_in_site(round_, flat)
        self.averager.average_all([
            Job(self.gid(round_, f"B/{p}"), [site[p % len(site)] for site in self.sites], [shards[p]], site_weight,
                "mean" if self.presummed else "")
            for p in held_by[self.member]
        ])
        if len(members) > 1:
            jobs = []
            for j, held in enumerate(held_by):
                if not held:
                    continue
                if j != self.member:
                    for p in held:
                        shards[p].zero_()
                jobs.append(Job(self.gid(round_, f"C/{self.site}/{j}"), members, [shards[p] for p in held],
                                1.0 if j == self.member else 0.0))
            self.averager.average_all(jobs)
        _round_to_float32(flat)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()

    def _average_in_site(self, round_: int, flat: torch.Tensor) -> float:
        """Phase A: replace `flat` by the site's weighted mean (presummed: its exact sum); returns the site's total
        weight."""
        members = self.sites[self.site]
        if len(members) == 1:
            return self.weight
        weights = torch.tensor([self.weight], dtype=torch.float64)
        if self.presummed:
            self.averager.average_all([
                Job(self.gid(round_, f"A/{self.site}"), members, [flat], self.weight, "sum"),
                Job(self.gid(round_, f"A/{self.site}/weight"), members, [weights], 1.0, "sum"),
            ])
            return float(weights)
        self.averager.average_all([
            Job(self.gid(round_, f"A/{self.site}"), members, [flat], self.weight),
            Job(self.gid(round_, f"A/{self.site}/weight"), members, [weights], 1.0),
        ])
        # The reducer's float32 mean, the same on every member (the float64 copy may differ in its last bits).
        total = len(members) * float(weights.float())
        if total == 0:
            flat.zero_()  # no microbatch in this site: its mean is 0/0, and with weight 0 in B it counts for nothing
        return total
