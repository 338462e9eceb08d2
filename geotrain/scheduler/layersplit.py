"""Layer cuts for fixed replica groups: the planner's dynamic program over the cost model's tables."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from geotrain.scheduler.costtables import CostTables

Stage = tuple[int, int, tuple[int, ...]]


class LayerSplitter:
    """Splits the layers over replica groups, memoised by the groups (grouping modes and local-search moves often
    arrive at group lists already split)."""

    def __init__(self, tables: CostTables) -> None:
        self.tables = tables
        self.cm = tables.cm
        self.n_layers = self.cm.model.n_layers
        self.device_class = [n.device_class for n in self.cm.nodes]
        self._splits: dict[tuple[tuple[int, ...], ...], tuple[tuple[Stage, ...], float] | None] = {}
        self._best_split = math.inf  # the best step time over every group list split so far

    def split_layers(self, groups: Sequence[Sequence[int]]) -> tuple[tuple[Stage, ...], float] | None:
        """Layer cuts for fixed replica groups, and the step time the tables price them at, that minimise the step
        time's two maxima, (M-1) x the slowest stage or link per microbatch (the pace) plus the slowest gradient
        all-reduce: a min-max DP on the pace under a cap on every stage's all-reduce, with the cap lowered below the
        last answer's slowest all-reduce until the pace alone outweighs the best step time found."""
        if len(groups) > self.n_layers:
            return None
        groups = tuple(self.one_class(g) for g in groups)
        if groups not in self._splits:
            self._splits[groups] = self._split(groups)
        return self._splits[groups]

    def one_class(self, group: Sequence[int]) -> tuple[int, ...]:
        """The group's members of one device class (replicas' checksums must agree bit for bit): the class with the
        most summed speed (ties: the first name)."""
        classes = {self.device_class[i] for i in group}
        if len(classes) <= 1:
            return tuple(group)
        speed = {c: sum(self.tables.speed[i] for i in group if self.device_class[i] == c) for c in classes}
        keep = min(classes, key=lambda c: (-speed[c], c))
        return tuple(i for i in group if self.device_class[i] == keep)

    def _split(self, groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[Stage, ...], float] | None:
        """split_layers, unmemoised."""
        cm, n_stages = self.cm, len(groups)
        tables = [self.tables.stage(g, n_stages) for g in groups]
        links = [self.tables.link(groups[s], groups[s + 1]) for s in range(n_stages - 1)]
        best, best_cost, cap = None, math.inf, math.inf
        while True:
            found = self._split_under(tables, links, cap)
            if found is None:
                break
            bounds, pace, fill, slowest_sync = found
            # The cost model adds the DP's terms up; the data heads are the members of the first stage that fit.
            heads = self.tables.members(groups[0], tables[0], 0, bounds[1])
            cost = cm.step_from(pace, fill, slowest_sync, len(heads), cm.fixed_window, cm.control_seconds(heads))
            if cost < best_cost:
                best, best_cost = bounds, cost
            # A lower cap cannot lower the pace, so once the pace alone reaches the best step of these groups, or
            # of any groups split so far, nothing lower beats it.
            if pace >= min(best_cost, self._best_split) or slowest_sync <= 0:
                break
            cap = slowest_sync * (1 - 1e-9)
        if best is None:
            return None
        self._best_split = min(self._best_split, best_cost)
        stages = tuple(
            (a, b, tuple(sorted(self.tables.members(g, tables[s], a, b).tolist())))
            for s, (g, a, b) in enumerate(zip(groups, best[:-1], best[1:]))
        )
        return stages, best_cost

    def _split_under(
        self, tables: Sequence[tuple[np.ndarray, ...]], links: Sequence[tuple[np.ndarray, np.ndarray]], cap: float
    ) -> tuple[list[int], float, float, float] | None:
        """Min-max DP over layer cuts of the pace, stages whose all-reduce exceeds cap excluded; ties go to the
        smaller fill, then the earlier cut. Returns the layer bounds, the pace, the fill and the slowest all-reduce."""
        n_layers = self.n_layers
        pace, fill, sync = tables[0][0], tables[0][1], tables[0][2]
        worst = np.where(sync[0] <= cap, pace[0], np.inf)  # cut at b: best bottleneck of stages so far
        total = fill[0].copy()
        back = []
        cols = np.arange(n_layers + 1)
        for s in range(1, len(tables)):
            pace, fill, sync = tables[s][:3]
            link_occ, link_fill = links[s - 1]
            prev_worst = np.maximum(worst, link_occ)
            cand_worst = np.maximum(prev_worst[:, None], np.where(sync <= cap, pace, np.inf))
            cand_total = (total + link_fill)[:, None] + fill
            # Per column b: smallest worst, then total, then earliest cut (argmin's first); cuts at or after b are
            # inf in the pace tables. Keys compare at float32 precision so that summation-order noise in the last
            # bits cannot pick a different split among equal ones.
            worst32 = cand_worst.astype(np.float32)
            key = np.where(worst32 == worst32.min(axis=0), cand_total.astype(np.float32), np.inf).argmin(axis=0)
            worst, total = cand_worst[key, cols], cand_total[key, cols]
            back.append(key)
        if not math.isfinite(worst[n_layers]):
            return None
        cuts = [n_layers]
        for key in reversed(back):
            cuts.append(int(key[cuts[-1]]))
        bounds = [0] + cuts[::-1]
        slowest_sync = max(float(t[2][a, b]) for t, a, b in zip(tables, bounds[:-1], bounds[1:]))
        return bounds, float(worst[n_layers]), float(total[n_layers]), slowest_sync
