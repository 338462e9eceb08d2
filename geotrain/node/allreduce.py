"""A stage's all-reduce for one replica: one flat group, or region by region (HierarchicalAllReduce: fast links inside
a region carry most of the traffic, and each replica sends only its shard across the slow ones), over the groups
node/averaging.py's ReplicaAverager runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from geotrain.node.averaging import Job, ReplicaAverager
from geotrain.node.lowrank import AllReduce


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
            round_to_float32(t)

    return flat


def round_to_float32(t: torch.Tensor) -> None:
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
    Every replica then rounds the vector to float32 (round_to_float32), which changes nothing after C and gives
    a one-member site's replica B's float32 average too.
    With `presummed` (replicas' float64 gradient sums, weight x mean) A adds the sums and the weights exactly
    instead of averaging them, and B divides the exact total by the total weight once (reducers.SumAccumulator): the
    mean train-local computes. A member whose site sum rounded (node.stage says when) may hold other float64 bits than
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
        round_to_float32(flat)
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
