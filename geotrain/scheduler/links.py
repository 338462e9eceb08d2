"""Link classes: the cost model's links between nodes, grouped so that a plan's link terms cost O(classes^2).

Nodes of one region with the same access cap, the same reachability and no measured pair override see identical
links, so a 1,000-node cluster has a few dozen classes. Terms over a group of nodes read a base link (the default
inter-region one) and the few class pairs whose link differs from it, never dense matrices: where machines are
regions there are thousands of classes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from geotrain.scheduler.costinputs import CodecRatio, Network, NodeProfile


class LinkClasses:
    """Region and link-class matrices of a set of nodes, and the link terms of groups of them."""

    def __init__(self, nodes: Sequence[NodeProfile], network: Network, codec_ratio: CodecRatio) -> None:
        self.nodes, self.network, self.codec_ratio = list(nodes), network, codec_ratio
        self._region_matrices()
        self._class_matrices()
        self._group_memo: dict[tuple[bytes, str], tuple] = {}

    def _region_matrices(self) -> None:
        """Bandwidth, latency and seconds per raw bit between regions, filled from the few listed pairs: standalone
        machines make hundreds of regions."""
        self.regions = sorted({n.region for n in self.nodes})
        pos = {r: k for k, r in enumerate(self.regions)}
        self.region_of = np.array([pos[n.region] for n in self.nodes], dtype=np.int64)
        default = self.network.default_inter_region
        r_bw = np.full((len(pos), len(pos)), float(default.bandwidth_bps) if default else math.nan)
        r_lat = np.full_like(r_bw, float(default.latency_s) if default else math.nan)
        for (ra, rb), link in self.network.inter_region.items():
            if ra in pos and rb in pos:
                r_bw[pos[ra], pos[rb]] = r_bw[pos[rb], pos[ra]] = link.bandwidth_bps
                r_lat[pos[ra], pos[rb]] = r_lat[pos[rb], pos[ra]] = link.latency_s
        np.fill_diagonal(r_bw, self.network.intra_region.bandwidth_bps)
        np.fill_diagonal(r_lat, self.network.intra_region.latency_s)
        self.region_ratio = np.full_like(r_bw, self.codec_ratio.inter_region)
        np.fill_diagonal(self.region_ratio, self.codec_ratio.intra_region)
        missing = np.argwhere(np.isnan(r_bw))
        if len(missing):
            self.network.region_link(self.regions[missing[0][0]], self.regions[missing[0][1]])  # raises, naming it
        self.region_bw, self.region_lat = r_bw, r_lat
        self.region_seconds_per_bit = self.region_ratio / r_bw

    def _class_matrices(self) -> None:
        """Link classes, their matrices, and the class pairs whose link differs from the base link."""
        index = {n.node_id: i for i, n in enumerate(self.nodes)}
        caps = np.array([self.network.node_bandwidth_bps.get(n.node_id, math.inf) for n in self.nodes])
        overrides = {(index[a], index[b]): link for (a, b), link in self.network.pair_overrides.items()
                     if a in index and b in index}
        measured = {i for pair in overrides for i in pair}
        # A node with a measured pair gets a class of its own, so a class pair never mixes measured and default links.
        behind = [n.unreachable for n in self.nodes]
        keys = [("node", i) if i in measured else ("region", int(self.region_of[i]), float(caps[i]), behind[i])
                for i in range(len(self.nodes))]
        first: dict[tuple, int] = {}
        self.link_class = np.array([first.setdefault(k, len(first)) for k in keys], dtype=np.int64)
        self.n_link_classes = len(first)
        reps = np.unique(self.link_class, return_index=True)[1]  # each class's first node
        rc = self.region_of[reps]
        self.class_region = rc
        bw = np.minimum(self.region_bw[np.ix_(rc, rc)], np.minimum.outer(caps[reps], caps[reps]))
        lat = self.region_lat[np.ix_(rc, rc)]
        for (i, j), link in overrides.items():
            ci, cj = self.link_class[i], self.link_class[j]
            bw[ci, cj] = bw[cj, ci] = link.bandwidth_bps
            lat[ci, cj] = lat[cj, ci] = link.latency_s
        # Two nodes nobody can dial talk through a relay: each byte crosses twice, each way has two hops.
        behind_class = np.array(behind, dtype=bool)[reps]
        relayed = np.logical_and.outer(behind_class, behind_class)
        self.class_bw, self.class_lat = np.where(relayed, bw / 2, bw), np.where(relayed, 2 * lat, lat)
        self.class_seconds_per_bit = self.region_ratio[np.ix_(rc, rc)] / self.class_bw
        default = self.network.default_inter_region
        base = default or self.network.intra_region
        ratio = self.codec_ratio.inter_region if default else self.codec_ratio.intra_region
        self.base_link = (base.bandwidth_bps, base.latency_s, ratio / base.bandwidth_bps)
        base_bw, base_lat, base_per_bit = self.base_link
        rows, cols = np.nonzero(
            (self.class_bw != base_bw) | (self.class_lat != base_lat) | (self.class_seconds_per_bit != base_per_bit)
        )
        self._odd_rows, self._odd_cols = rows, cols
        self._odd_bw, self._odd_lat = self.class_bw[rows, cols], self.class_lat[rows, cols]
        self._odd_extra_per_bit = self.class_seconds_per_bit[rows, cols] - base_per_bit

    def class_weights(self, idx: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The link classes present in idx and the summed weights of their nodes."""
        of = self.link_class[idx]
        classes = np.flatnonzero(np.bincount(of, minlength=self.n_link_classes))
        return classes, np.bincount(of, weights=weights, minlength=self.n_link_classes)[classes]

    def mean_link(self, a: np.ndarray, wa: np.ndarray, b: np.ndarray, wb: np.ndarray) -> tuple[float, float]:
        """Seconds per raw bit (codec applied) and latency between disjoint node sets a and b, expected over
        routing weights wa and wb (each summing to 1)."""
        return self.class_link(*self.class_weights(a, wa), *self.class_weights(b, wb))

    def class_link(self, ca: np.ndarray, va: np.ndarray, cb: np.ndarray, vb: np.ndarray) -> tuple[float, float]:
        """mean_link over link classes ca, cb with summed weights va, vb: the base link's terms over all the weight,
        corrected on the class pairs whose link differs from it."""
        wa, wb = np.zeros(self.n_link_classes), np.zeros(self.n_link_classes)
        wa[ca], wb[cb] = va, vb
        both = wa[self._odd_rows] * wb[self._odd_cols]
        total = float(va.sum() * vb.sum())
        _, base_lat, base_per_bit = self.base_link
        per_bit = base_per_bit * total + float(both @ self._odd_extra_per_bit)
        lat = base_lat * total + float(both @ (self._odd_lat - base_lat))
        return per_bit, lat

    def _extreme_link(self, pairs: np.ndarray, n_pairs: int) -> tuple[float, float]:
        """The lowest bandwidth and the highest latency over n_pairs ordered class pairs, of which `pairs` selects
        those whose link differs from the base link (the rest have the base link)."""
        bw, lat = self._odd_bw[pairs], self._odd_lat[pairs]
        if len(bw) < n_pairs:
            base_bw, base_lat, _ = self.base_link
            return min(bw.min(initial=math.inf), base_bw), max(lat.max(initial=-math.inf), base_lat)
        return float(bw.min()), float(lat.max())

    def group_terms(self, idx: np.ndarray, allreduce: str) -> tuple:
        """Coefficients of the flat and (unless allreduce is "flat") the hierarchical all-reduce among the replicas
        idx, each as (seconds per bit, seconds): arrays of them over the regions for the in-region rounds, one pair
        for the shards. Memoised by the group's make-up (how many of each link class): the terms read nothing else,
        and planners score many groups of the same make-up."""
        n = len(idx)
        classes, counts = self.class_weights(idx, np.ones(n))
        key = (classes.tobytes() + counts.tobytes(), allreduce)
        if key not in self._group_memo:
            count = np.zeros(self.n_link_classes)
            count[classes] = counts
            rows, cols = self._odd_rows, self._odd_cols
            # Two different nodes of one class meet over the class's own link only when the class has two of them.
            pairs = (count[rows] > 0) & (count[cols] > 0) & ((rows != cols) | (count[rows] >= 2))
            bw, lat = self._extreme_link(pairs, len(classes) * (len(classes) - 1) + int(np.sum(counts >= 2)))
            flat = (2 * (n - 1) / n / bw, 2 * lat)
            regions, region = np.unique(self.class_region[classes], return_inverse=True)  # of each class, from 0
            k = np.bincount(region, weights=counts).astype(np.int64)  # replicas per region
            hierarchical = None
            if allreduce != "flat" and len(k) > 1 and k.max() > 1:
                hierarchical = self._hierarchical_terms(classes, counts, pairs, regions, region, k)
            self._group_memo[key] = (flat, hierarchical)
        return self._group_memo[key]

    def _hierarchical_terms(
        self, classes: np.ndarray, counts: np.ndarray, pairs: np.ndarray, regions: np.ndarray, region: np.ndarray,
        k: np.ndarray,
    ) -> tuple:
        """group_terms' hierarchical coefficients: the in-region rounds of every region with two replicas or more,
        and the shards' round across regions."""
        shared = np.flatnonzero(k > 1)
        classes_in = np.bincount(region)
        in_bw, in_lat = np.empty(len(shared)), np.empty(len(shared))
        # A region of one link class (the usual case; thousands of them where machines are regions) reads its class's
        # own link; the others take the slowest pair of their classes.
        one = classes_in[shared] == 1
        only_class = classes[np.argsort(region, kind="stable")[np.searchsorted(np.sort(region), shared[one])]]
        in_bw[one], in_lat[one] = self.class_bw[only_class, only_class], self.class_lat[only_class, only_class]
        row_region, col_region = self.class_region[self._odd_rows], self.class_region[self._odd_cols]
        several = np.flatnonzero(~one)
        if len(several):
            # _extreme_link over each region's own class pairs, every region at once.
            inner = pairs & (row_region == col_region)
            at = np.searchsorted(regions, row_region[inner])
            low_bw, high_lat = np.full(len(regions), math.inf), np.full(len(regions), -math.inf)
            np.minimum.at(low_bw, at, self._odd_bw[inner])
            np.maximum.at(high_lat, at, self._odd_lat[inner])
            in_pairs = classes_in * (classes_in - 1) + np.bincount(region, weights=counts >= 2)
            base = np.bincount(at, minlength=len(regions)) < in_pairs  # some pair has the base link
            base_bw, base_lat, _ = self.base_link
            low_bw = np.where(base, np.minimum(low_bw, base_bw), low_bw)
            high_lat = np.where(base, np.maximum(high_lat, base_lat), high_lat)
            in_bw[several], in_lat[several] = low_bw[shared[several]], high_lat[shared[several]]
        # The slowest region's rounds, a maximum over lines in the bits: only the lines no other one beats at every
        # size matter (spot instances of one kind are all the same line).
        per_bit, fixed = 2 * (k[shared] - 1) / k[shared] / in_bw, 2 * in_lat
        order = np.lexsort((-fixed, -per_bit))
        beaten = np.concatenate([[False], fixed[order][1:] <= np.maximum.accumulate(fixed[order])[:-1]])
        inside = (per_bit[order][~beaten], fixed[order][~beaten])
        across_bw, across_lat = self._extreme_link(
            pairs & (row_region != col_region), len(classes) ** 2 - int(np.sum(classes_in**2))
        )
        m, shards = len(k), int(k.max())
        share = max(math.ceil(shards / kr) for kr in k) / shards
        return inside, (share * 2 * (m - 1) / m / across_bw, 2 * across_lat)
