"""Replica groups for the planner: the chain of regions the pipeline crosses, the node pools it tries, and how a
pool is cut into stages' replica groups.

Regions are ordered into a chain that makes consecutive regions cheap to cross (exact for up to 7 regions, nearest
neighbour + 2-opt above), so the pipeline crosses each slow link once and only where it must. Stages are dealt to
regions by D'Hondt on compute (a region too small for a stage of its own joins its neighbour's stage or stays out), or
region borders are ignored, or every stage takes a share of every region; inside a region, nodes sorted by link then
speed are cut into stages of equal compute, so a stage's replicas share a similar uplink (FusionLLM's grouping).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np

from geotrain.scheduler.costtables import CostTables

EXACT_CHAIN_REGIONS = 7  # 7! / 2 orders are quick to enumerate; above, a heuristic chain
_HEURISTIC_CHAIN_REGIONS = 32  # above, a single nearest-neighbour chain without 2-opt
_SUBSET_QUANTILES = (0.1, 0.25, 0.5)

Pool = tuple[tuple[int, ...], list[str], bool]
"""Node indices, the chain of regions they are laid along, and whether it is the whole chain."""


class Grouping:
    """Region chains, node pools and replica groups over one CostModel's nodes."""

    def __init__(self, tables: CostTables) -> None:
        cm = tables.cm
        self.cm = cm
        self.speed = tables.speed
        intra = cm.network.intra_region.bandwidth_bps
        self.uplink = np.array([min(intra, cm.network.node_bandwidth_bps.get(n.node_id, intra)) for n in cm.nodes])
        self.device_class = [n.device_class for n in cm.nodes]
        self.region_index = {r: k for k, r in enumerate(cm.links.regions)}
        n_layers = cm.model.n_layers
        self.typical_boundary_bits = float(np.median(cm.boundary_bits[:-1])) if n_layers > 1 else 0.0
        self.region_cost = tables.region_crossing(self.typical_boundary_bits)[1]
        """[a, b] = seconds to move one typical boundary both ways between regions a and b."""
        self._region_members: dict[tuple, tuple[dict[str, list[int]], list[float]]] = {}
        # Inside a region, stages are cut from nodes sorted by device class (so that a cut mixes classes rarely), then
        # link, then speed, then id: rank them once.
        order = sorted(
            range(len(cm.nodes)),
            key=lambda i: (self.device_class[i], -self.uplink[i], -self.speed[i], cm.nodes[i].node_id),
        )
        self.rank = np.empty(len(cm.nodes), dtype=np.int64)
        self.rank[order] = np.arange(len(cm.nodes))

    def pools(self, chain: list[str]) -> list[tuple[tuple[int, ...], list[str], bool]]:
        """Node pools with their chain of regions, and whether it is the whole chain (tried in both directions): a
        few subsets of the nodes over the chain, then the fastest window of regions of each width along it."""
        pools = [(subset, chain, True) for subset in self._subsets()]
        # Fewer regions may beat crossing slow links: the fastest window of each width along the chain.
        region_of = [self.cm.nodes[i].region for i in range(len(self.cm.nodes))]
        rate = dict.fromkeys(chain, 0.0)
        for i in self.cm.usable:
            rate[region_of[i]] += self.speed[i]
        cum = np.concatenate([[0.0], np.cumsum([rate[r] for r in chain])])
        many = len(chain) > EXACT_CHAIN_REGIONS
        widths = [2**k for k in range(len(chain).bit_length()) if 2**k < len(chain)] if many else range(1, len(chain))
        for width in widths:
            start = int(np.argmax(cum[width:] - cum[:-width]))  # first maximum: stable
            window = set(chain[start : start + width])
            in_window = tuple(i for i in self.cm.usable if region_of[i] in window)
            pools.append((in_window, chain[start : start + width], False))
        return pools

    def _subsets(self) -> list[tuple[int, ...]]:
        usable = np.array(self.cm.usable)
        subsets = {tuple(usable)}
        for key in (self.uplink[usable], self.speed[usable]):
            for q in _SUBSET_QUANTILES:
                keep = usable[key >= np.quantile(key, q)]
                if len(keep):
                    subsets.add(tuple(keep))
        return sorted(subsets, key=lambda s: (-len(s), s))

    def region_chain(self, region_cost: np.ndarray) -> list[str]:
        """The regions in the order that makes the summed cost of consecutive ones least."""
        cm = self.cm
        present = sorted({int(cm.links.region_of[i]) for i in cm.usable})  # sorted indices = sorted names
        cost = region_cost[np.ix_(present, present)]

        def length(order: Sequence[int]) -> float:
            return float(cost[order[:-1], order[1:]].sum())

        n = len(present)
        if n <= EXACT_CHAIN_REGIONS:
            best = min(itertools.permutations(range(n)), key=lambda o: (length(o), o))
            return [cm.links.regions[present[k]] for k in best]
        best: list[int] = []
        # Nearest neighbour from every start, then 2-opt; with very many regions (standalone machines) one start.
        small = n <= _HEURISTIC_CHAIN_REGIONS
        for first in range(n) if small else range(1):
            order, left = [first], np.ones(n, dtype=bool)
            left[first] = False
            while left.any():
                step = np.where(left, cost[order[-1]], np.inf)
                order.append(int(np.argmin(step)))  # first minimum: ties go to the smaller name
                left[order[-1]] = False
            improved = small
            while improved:
                improved = False
                for i, j in itertools.combinations(range(1, n), 2):
                    trial = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
                    if length(trial) < length(order) - 1e-12:
                        order, improved = trial, True
            if not best or (length(order), order) < (length(best), best):
                best = order
        return [cm.links.regions[present[k]] for k in best]

    def groups(
        self, subset: Sequence[int], n_stages: int, chain: Sequence[str], mode: str
    ) -> list[list[int]] | None:
        """Replica groups in pipeline order. mode "merge": a region too small for a stage joins its neighbour's;
        "drop": it stays out; "flat": region borders are ignored, the chain of nodes is cut into equal stages;
        "deal": every stage gets its share of every region."""
        if n_stages > len(subset):
            return None
        by_region, rates = self._by_region(subset, chain)
        if mode == "flat":
            return self.cut_equal_rate([i for r in chain for i in by_region[r]], n_stages)
        if mode == "deal":
            # Each region's nodes by speed, dealt back and forth (one deal running on through the regions) so that
            # the stages' compute stays even. Where boundaries cost more than averaging, a stage in every region
            # spreads each boundary over the most pairs of nodes.
            ranked = [i for r in chain for i in sorted(by_region[r], key=lambda i: (-self.speed[i], self.rank[i]))]
            dealt: list[list[int]] = [[] for _ in range(n_stages)]
            for pos, i in enumerate(ranked):
                lap, seat = divmod(pos, n_stages)
                dealt[seat if lap % 2 == 0 else n_stages - 1 - seat].append(i)
            return dealt
        # D'Hondt: each stage goes to the region with the most compute per stage it would have; ties go up the chain.
        seats = np.zeros(len(chain), dtype=np.int64)
        heap = [(-rate, pos) for pos, rate in enumerate(rates) if by_region[chain[pos]]]
        heapq.heapify(heap)
        for _ in range(n_stages):
            _, pos = heapq.heappop(heap)
            seats[pos] += 1
            if seats[pos] < len(by_region[chain[pos]]):
                heapq.heappush(heap, (-rates[pos] / (seats[pos] + 1), pos))
        if mode == "drop" and seats.all():
            return None  # same as the merging variant
        groups: list[list[int]] = []
        first, last = np.zeros(len(chain), dtype=np.int64), np.zeros(len(chain), dtype=np.int64)  # groups it owns
        for pos in np.flatnonzero(seats):
            first[pos] = len(groups)
            groups.extend(self.cut_equal_rate(by_region[chain[pos]], int(seats[pos])))
            last[pos] = len(groups) - 1
        if mode == "merge":
            # Join the nearest seated region along the chain, on the side with the cheaper link (the later one on a
            # tie): the last group of the one before, or the first group of the one after.
            at, n = np.arange(len(chain)), len(chain)
            before = np.maximum.accumulate(np.where(seats > 0, at, -1))
            after = np.minimum.accumulate(np.where(seats > 0, at, n)[::-1])[::-1]
            where = np.array([self.region_index[r] for r in chain])
            cost_before = np.where(before >= 0, self.region_cost[where, where[np.maximum(before, 0)]], math.inf)
            cost_after = np.where(after < n, self.region_cost[where, where[np.minimum(after, n - 1)]], math.inf)
            joins = np.where(cost_after <= cost_before, first[np.minimum(after, n - 1)], last[np.maximum(before, 0)])
            for pos in np.flatnonzero(seats == 0):
                groups[joins[pos]].extend(by_region[chain[pos]])
        return groups

    def _by_region(self, subset: Sequence[int], chain: Sequence[str]) -> tuple[dict[str, list[int]], list[float]]:
        """The subset's nodes of each region of the chain, in rank order, and each region's summed speed along the
        chain. Memoised: every stage count and grouping mode of a node pool starts from them."""
        key = (tuple(subset), tuple(chain))
        if key not in self._region_members:
            members = np.asarray(subset, dtype=np.int64)
            members = members[np.argsort(self.rank[members], kind="stable")]
            of = self.cm.links.region_of[members]
            by_region = {r: members[of == self.region_index[r]].tolist() for r in chain}
            self._region_members[key] = (by_region, [float(self.speed[by_region[r]].sum()) for r in chain])
        return self._region_members[key]

    def cut_equal_rate(self, members: Sequence[int], k: int) -> list[list[int]]:
        """members cut in order into k runs of near-equal summed speed: a run takes a node while the node's midpoint
        on the cumulative speed falls short of the run's share, leaving one node for each later run."""
        rates = self.speed[list(members)]
        cum = np.cumsum(rates)
        midpoints = cum - rates / 2
        n = len(members)
        ends = np.searchsorted(midpoints, np.arange(1, k) / k * cum[-1], side="left")
        out, pos = [], 0
        for j in range(k):
            end = n if j == k - 1 else int(min(max(ends[j], pos + 1), n - (k - 1 - j)))
            out.append(list(members[pos:end]))
            pos = end
        return out
