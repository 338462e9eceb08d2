"""The cost model's terms over every layer range at once: the tables the planner's layer split searches.

Each table applies CostModel's own formulas (compute_terms, boundary_terms, sync_seconds, stage_memory_bytes) to
arrays of layer bounds, so that a plan the planner builds from them is priced exactly as CostModel.step_seconds
prices it.
"""

from __future__ import annotations

import numpy as np

from geotrain.scheduler.costmodel import CostModel


class CostTables:
    """Memoised per-range tables of one CostModel; candidates share groups, so tables are kept by group."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        n_layers = cm.model.n_layers
        self.speed = 1.0 / cm.prefix_seconds[:, -1]
        """Microbatches per second of each node on the whole model."""
        self._starts, self._ends = np.ogrid[: n_layers + 1, : n_layers + 1]  # [a, b] grids
        self._below_diagonal = np.tril_indices(n_layers + 1)
        # Nodes with the same layer times and memory are interchangeable inside the layer DP: count them once.
        keys = np.column_stack([cm.prefix_seconds, cm.memory])
        self.profile_class = np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)
        self._need: dict[int, np.ndarray] = {}
        self._stages: dict[tuple[tuple[int, ...], int], tuple[np.ndarray, ...]] = {}
        self._links: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}

    def memory_need(self, n_stages: int) -> np.ndarray:
        """[a, b] = memory a replica of layers [a, b) needs among n_stages stages; inf where b <= a."""
        if n_stages not in self._need:
            need = self.cm.stage_memory_bytes(self._starts, self._ends, n_stages)
            need[self._below_diagonal] = np.inf
            self._need[n_stages] = need
        return self._need[n_stages]

    def stage(self, group: tuple[int, ...], n_stages: int) -> tuple[np.ndarray, ...]:
        """For a replica group among n_stages stages, over every layer range [a, b): the paced occupancy, the fill
        latency, the gradient all-reduce, and which of the group's profile classes fit in memory; then each member's
        class and each class's member count."""
        key = (group, n_stages)
        if key not in self._stages:
            cm = self.cm
            need = self.memory_need(n_stages)
            idx = np.asarray(group, dtype=np.int64)
            _, first, member_class, count = np.unique(
                self.profile_class[idx], return_index=True, return_inverse=True, return_counts=True
            )
            rep = idx[first]
            p = cm.prefix_seconds[rep]
            secs = p[:, None, :] - p[:, :, None]  # [class, a, b] = seconds over [a, b)
            fit_rep = cm.memory[rep][:, None, None] >= need[None]
            # Only the members that fit a range compute on it; h, the links and the all-reduce are priced over the
            # whole group (counting only the members that fit makes the DP search longer for the same plans).
            rate = np.where(fit_rep, count[:, None, None] / np.where(fit_rep, secs, 1.0), 0.0).sum(axis=0)
            with np.errstate(divide="ignore"):  # a range no member can hold: c and h are inf
                c, h = cm.compute_terms(rate, len(idx))
            sync = np.broadcast_to(cm.sync_seconds(idx, self._starts, self._ends), c.shape)
            paced = cm.paced_seconds(c, cm.lone_starters(n_stages, len(idx)))
            self._stages[key] = (paced, h, sync, fit_rep, member_class.reshape(-1), count)
        return self._stages[key]

    @staticmethod
    def members(group: tuple[int, ...], table: tuple[np.ndarray, ...], start: int, end: int) -> np.ndarray:
        """The node indices of the group's members that fit layers [start, end), by the group's stage table."""
        fit_class, member_class = table[3:5]
        return np.asarray(group, dtype=np.int64)[fit_class[member_class, start, end]]

    def link(self, left: tuple[int, ...], right: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """For each cut position between two replica groups: the link's paced occupancy and its fill."""
        key = (left, right)
        if key not in self._links:
            cm = self.cm
            a, b = np.asarray(left, dtype=np.int64), np.asarray(right, dtype=np.int64)
            wa, wb = self.speed[a] / self.speed[a].sum(), self.speed[b] / self.speed[b].sum()
            per_bit, lat = cm.links.mean_link(a, wa, b, wb)
            occupancy, transfer = cm.boundary_terms(cm.boundary_bits, per_bit, lat, min(len(a), len(b)))
            # No cut before the first layer.
            self._links[key] = (
                np.concatenate([[np.inf], cm.paced_seconds(occupancy)]),
                np.concatenate([[np.inf], transfer]),
            )
        return self._links[key]

    def region_crossing(self, bits: float) -> tuple[np.ndarray, np.ndarray]:
        """[a, b] = o and x of a boundary of `bits` per microbatch between regions a and b (links.regions), one pair."""
        links = self.cm.links
        return self.cm.boundary_terms(bits, links.region_seconds_per_bit, links.region_lat, 1)

    def stage_load(self, rate: float, replicas: int, links: list[tuple[float, float, int]], counts: list[float]) -> float:
        """A stage's seconds per microbatch for dealing nodes to it: its occupancy at `rate` microbatches per
        second over `replicas` nodes, or that of an adjacent link (bits, seconds per bit, neighbour) where it is
        the side with fewer replicas (counts: every stage's replica count)."""
        load = self.cm.compute_terms(rate, replicas)[0]
        for bits, per_bit, other in links:
            if replicas <= counts[other]:
                load = max(load, self.cm.boundary_terms(bits, per_bit, 0.0, replicas)[0])
        return load
