"""Pipeline planner: stages, layer ranges, replicas and stage order that minimise the cost model's step time.

How it searches (every candidate is scored by CostModel, the same model that scores any other plan):
1. Nodes without memory for even a one-layer stage are left out, with the reason. A stage's replicas share one
   device class (NodeProfile.device_class: their parameter checksums must agree bit for bit): a replica group that
   mixes classes keeps the class with the most compute, and no move puts a node among replicas of another class.
2. Regions are ordered into a chain that makes consecutive regions cheap to cross (exact for up to 7 regions,
   nearest neighbour + 2-opt above), so the pipeline crosses each slow link once and only where it must.
3. For both directions of the chain and a few node subsets (all nodes; without the slowest links; without the
   slowest devices), stages are dealt to regions by D'Hondt on compute (a region too small for a stage of its own
   either joins its neighbour's stage or stays out), or region borders are ignored; inside a region, nodes sorted by
   link then speed are cut into stages of equal compute, so a stage's replicas share a similar uplink (FusionLLM's
   grouping). Over a few regions, every stage may also take a share of every region (nodes dealt by speed), which
   spreads a heavy boundary over the most pairs of nodes. Every such grouping is tried at S = 1, 2, ... stages until
   four counts in a row cost more than twice the best step found so far.
4. A dynamic program splits the layers over those stages. The step pays two maxima, the pace (M-1) x the slowest
   stage or link per microbatch, and the slowest gradient all-reduce: the DP minimises the pace under a cap on every
   stage's all-reduce, lowering the cap until the pace alone costs more than the best step found.
5. The best few candidates are varied in their replica counts, which equal-compute groups fix too early: each
   region's nodes are dealt again among its stages by load (a stage's compute, or a slow link it feeds with fewer
   parallel pairs than its neighbour), and a local search moves chunks of nodes between neighbouring stages; both
   split the layers again. Then all of them get a local search: shift a stage boundary by one layer and, on small
   clusters, move a node to another stage or out (each pass goes on after the last node move that improved).
6. Re-planning from a previous plan adds that plan, with departed nodes removed and new ones added where they
   relieve most, as a candidate; among plans within `replan_tolerance` of the best, the one moving the fewest
   layers wins. Ties break on stable keys, so the same inputs give the same plan.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from geotrain.scheduler.costmodel import CostModel, ModelProfile, Network, NodeProfile, Plan, StepShape

logger = logging.getLogger(__name__)

_GIB = 2**30
_EXACT_CHAIN_REGIONS = 7  # 7! / 2 orders are quick to enumerate; above, a heuristic chain
_HEURISTIC_CHAIN_REGIONS = 32  # above, a single nearest-neighbour chain without 2-opt
_SUBSET_QUANTILES = (0.1, 0.25, 0.5)
_STAGE_SWEEP_FACTOR, _STAGE_SWEEP_PATIENCE = 2.0, 4  # stage counts stop once 4 in a row cost > 2x the best step

Stage = tuple[int, int, tuple[int, ...]]


@dataclass(kw_only=True)
class PlannerConfig:
    """Knobs of the planner's search."""

    stages: int | None = None
    """Fixed number of stages; None lets the planner choose."""
    replan_tolerance: float = 0.02
    """When re-planning, a plan this much slower than the best still wins if it moves fewer layers."""
    refine_candidates: int = 4
    """How many of the best constructed plans get a local search."""
    node_move_limit: int = 600
    """Try moving single nodes only when nodes x stages is at most this (small clusters)."""
    max_refine_passes: int = 30
    """Upper bound on local-search passes per candidate."""

    def __post_init__(self) -> None:
        if self.stages is not None and self.stages <= 0:
            raise ValueError(f"stages must be > 0, got {self.stages}")
        if not 0 <= self.replan_tolerance < 1:
            raise ValueError(f"replan_tolerance must be in [0, 1), got {self.replan_tolerance}")
        if self.refine_candidates <= 0 or self.max_refine_passes <= 0 or self.node_move_limit < 0:
            raise ValueError("refine_candidates and max_refine_passes must be > 0, node_move_limit >= 0")


def plan(
    *,
    nodes: Sequence[NodeProfile],
    model: ModelProfile,
    network: Network,
    shape: StepShape,
    config: PlannerConfig | None = None,
    previous: Plan | None = None,
) -> Plan:
    """Plan the pipeline for steps of this shape with the lowest estimated step time (fewest moved layers within
    tolerance of it)."""
    cm = CostModel(nodes=nodes, model=model, network=network, shape=shape)
    return Planner(cm, config or PlannerConfig()).plan(previous)


class Planner:
    """Search over plans for one CostModel."""

    def __init__(self, cm: CostModel, config: PlannerConfig) -> None:
        self.cm = cm
        self.config = config
        self.n_layers = cm.model.n_layers
        self.speed = 1.0 / cm.prefix_seconds[:, -1]
        intra = cm.network.intra_region.bandwidth_bps
        self.uplink = np.array([min(intra, cm.network.node_bandwidth_bps.get(n.node_id, intra)) for n in cm.nodes])
        self._need_cache: dict[int, np.ndarray] = {}
        self._stage_tables: dict[tuple[tuple[int, ...], int], tuple[np.ndarray, ...]] = {}
        # Grouping modes and local-search moves often arrive at group lists already split.
        self._splits: dict[tuple[tuple[int, ...], ...], tuple[tuple[Stage, ...], float] | None] = {}
        self._link_tables: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
        self._starts, self._ends = np.ogrid[: cm.model.n_layers + 1, : cm.model.n_layers + 1]  # [a, b] grids
        self._below_diagonal = np.tril_indices(self.n_layers + 1)
        self.device_class = [n.device_class for n in cm.nodes]
        self._previously_out: set[int] = set()
        self._region_members: dict[tuple, tuple[dict[str, list[int]], list[float]]] = {}
        self._best_split = math.inf  # the DP's best step time over every group list split so far
        self.typical_boundary_bits = float(np.median(cm.boundary_bits[:-1])) if self.n_layers > 1 else 0.0
        self.region_cost = self._region_costs()
        self.region_index = {r: k for k, r in enumerate(cm.links.regions)}
        # Nodes with the same layer times and memory are interchangeable inside the layer DP: count them once.
        keys = np.column_stack([cm.prefix_seconds, cm.memory])
        _, self.profile_class = np.unique(keys, axis=0, return_inverse=True)
        self.profile_class = self.profile_class.reshape(-1)
        # Inside a region, stages are cut from nodes sorted by device class (so that a cut mixes classes rarely), then
        # link, then speed, then id: rank them once.
        order = sorted(
            range(len(cm.nodes)),
            key=lambda i: (self.device_class[i], -self.uplink[i], -self.speed[i], cm.nodes[i].node_id),
        )
        self.rank = np.empty(len(cm.nodes), dtype=np.int64)
        self.rank[order] = np.arange(len(cm.nodes))

    # --- top level -------------------------------------------------------------------------------------

    def plan(self, previous: Plan | None) -> Plan:
        """Search and return the chosen plan."""
        cm = self.cm
        if not cm.usable:
            raise ValueError(f"no node has memory for even a one-layer stage: {cm.no_room()}")
        if self.config.stages is not None and self.config.stages > min(self.n_layers, len(cm.usable)):
            raise ValueError(
                f"cannot make {self.config.stages} stages from {self.n_layers} layers and {len(cm.usable)} usable nodes"
            )
        chain = self._region_chain(self.region_cost)
        scored = self._constructed(self._pools(chain))
        ranked = sorted((c for c in scored if math.isfinite(scored[c])), key=lambda c: (scored[c], c))
        if not ranked:
            raise ValueError("no feasible plan: the nodes lack memory for every layer split tried")
        for cand in ranked[: self.config.refine_candidates]:
            self._improve(cand, scored)
        # The chain by what a boundary adds to the step, its paced occupancy too: by the transfer alone it may put a
        # slower link under the pipeline to save latency (dtfm_regional 16: Ohio-Oregon at 1.10 Gbit/s, 49 ms, where
        # Oregon-Virginia has 1.15 Gbit/s, 67 ms). Its best candidate gets the local search on its own, after the
        # others, so that it can only add a better plan.
        # Only over the few regions whose chain is exact: over many (volunteers, machines as regions) it costs most.
        paced_chain = chain
        if len(chain) <= _EXACT_CHAIN_REGIONS:
            occupancy, transfer = cm.boundary_terms(
                self.typical_boundary_bits, cm.links.region_seconds_per_bit, cm.links.region_lat, 1
            )
            paced_chain = self._region_chain(cm.paced_seconds(occupancy) + transfer)
        if paced_chain not in (chain, chain[::-1]):
            extra = self._constructed([(tuple(cm.usable), paced_chain, True)])
            feasible = [c for c in extra if math.isfinite(extra[c])]
            if feasible:
                scored.update(extra)
                refined = self._refine(min(feasible, key=lambda c: (extra[c], c)))
                scored.setdefault(refined, cm.step_seconds(refined))
        prev_ranges = self._previous_ranges(previous)
        adapted = self._adapt(prev_ranges) if prev_ranges else None
        if adapted is not None:
            scored.setdefault(adapted, cm.step_seconds(adapted))
            refined = self._refine(adapted, nodes_first=True)
            scored.setdefault(refined, cm.step_seconds(refined))
        best_cost = min(scored[c] for c in scored)
        if prev_ranges:
            limit = best_cost * (1 + self.config.replan_tolerance)
            close = [c for c in scored if scored[c] <= limit]
            best = min(close, key=lambda c: (self._moved_layers(c, prev_ranges), scored[c], c))
        else:
            best = min(scored, key=lambda c: (scored[c], c))
        logger.debug("planner scored %d candidates, best %.4g s/step", len(scored), scored[best])
        return cm.plan(best, self._exclusions(best))

    def _improve(self, cand: tuple[Stage, ...], scored: dict[tuple[Stage, ...], float]) -> None:
        """Score into scored the candidate's local search, its replica counts re-dealt by load and resized by a
        local search, and the local search of the best of those (it may start behind the candidate's refinement and
        end ahead)."""
        cm = self.cm
        refined = self._refine(cand)
        scored.setdefault(refined, cm.step_seconds(refined))
        others = {*self._redealt(cand), self._resized(cand)} - {cand, refined}
        for other in others:
            scored.setdefault(other, cm.step_seconds(other))
        if others:
            refined = self._refine(min(others, key=lambda c: (scored[c], c)))
            scored.setdefault(refined, cm.step_seconds(refined))

    def _exclusions(self, stages: Sequence[Stage]) -> dict[str, str]:
        cm = self.cm
        used = {i for _, _, nodes in stages for i in nodes}
        classes = {self.device_class[i] for i in used}
        smallest_stage = min(cm.stage_memory_bytes(a, b, len(stages)) for a, b, _ in stages)
        reasons = {}
        for i, node in enumerate(cm.nodes):
            if i in used:
                continue
            if node.unfit:
                reasons[node.node_id] = node.unfit
            elif self.device_class[i] not in classes:
                reasons[node.node_id] = (
                    f"device class: no stage computes on {self.device_class[i] or 'its kind of device'}, and the "
                    "replicas of a stage share device, torch build and precision"
                )
            elif cm.memory[i] < smallest_stage:
                reasons[node.node_id] = (
                    f"memory: has {max(cm.memory[i], 0) / _GIB:.2f} GiB beyond its baseline, the smallest stage needs"
                    f" {smallest_stage / _GIB:.2f} GiB"
                )
            else:
                reasons[node.node_id] = (
                    f"planner choice: with a {self.uplink[i] / 1e6:.0f} Mbit/s link and {1 / self.speed[i]:.3g} s per"
                    " microbatch for the whole model it would slow the stage it joined"
                )
        return reasons

    # --- construction ----------------------------------------------------------------------------------

    def _pools(self, chain: list[str]) -> list[tuple[tuple[int, ...], list[str], bool]]:
        """Node pools with their chain of regions, and whether it is the whole chain (tried in both directions): a
        few subsets of the nodes over the chain, then the fastest window of regions of each width along it."""
        pools = [(subset, chain, True) for subset in self._subsets()]
        # Fewer regions may beat crossing slow links: the fastest window of each width along the chain.
        region_of = [self.cm.nodes[i].region for i in range(len(self.cm.nodes))]
        rate = dict.fromkeys(chain, 0.0)
        for i in self.cm.usable:
            rate[region_of[i]] += self.speed[i]
        cum = np.concatenate([[0.0], np.cumsum([rate[r] for r in chain])])
        many = len(chain) > _EXACT_CHAIN_REGIONS
        widths = [2**k for k in range(len(chain).bit_length()) if 2**k < len(chain)] if many else range(1, len(chain))
        for width in widths:
            start = int(np.argmax(cum[width:] - cum[:-width]))  # first maximum: stable
            window = set(chain[start : start + width])
            in_window = tuple(i for i in self.cm.usable if region_of[i] in window)
            pools.append((in_window, chain[start : start + width], False))
        return pools

    def _constructed(self, pools: list[tuple[tuple[int, ...], list[str], bool]]) -> dict[tuple[Stage, ...], float]:
        """Constructed candidates of the pools and their step times: every chain direction and grouping mode, over
        stage counts from one up until they stop paying."""
        scored: dict[tuple[Stage, ...], float] = {}
        best = math.inf
        for subset, order, whole in pools:
            # No plan of a pool paces faster than its compute bound (every node on its share of the whole model):
            # a pool whose bound alone reaches the best step so far has nothing to offer.
            if self.cm.paced_seconds(1.0 / self.speed[list(subset)].sum()) >= best:
                continue
            top = min(self.n_layers, len(subset))
            counts = [self.config.stages] if self.config.stages else range(1, top + 1)
            # Direction decides which end region holds the embedding and the head; worth trying on the full chain.
            directions = [order] if len(order) == 1 or not whole else [order, order[::-1]]
            modes = [(d, m) for d in directions for m in ("merge", "drop", "flat")]
            # The chain's direction means nothing to stages that span it all. Over many regions (machines as regions)
            # such stages would all-reduce across every one of them: not worth the planning time.
            if 1 < len(order) <= _EXACT_CHAIN_REGIONS and whole:
                modes.append((order, "deal"))
            for direction, mode in modes:
                above = 0
                for n_stages in counts:
                    cost = self._construct(subset, n_stages, direction, mode, scored)
                    if not math.isfinite(cost):
                        continue
                    best = min(best, cost)
                    # A grouping's step time over stage counts is ragged (the layers divide unevenly) but climbs past
                    # its valley: more stages once several in a row cost over twice the best step so far add nothing.
                    above = above + 1 if cost > _STAGE_SWEEP_FACTOR * best else 0
                    if above == _STAGE_SWEEP_PATIENCE:
                        break
        return scored

    def _construct(
        self, subset: Sequence[int], n_stages: int, chain: Sequence[str], mode: str, scored: dict
    ) -> float:
        """Group the subset into n_stages stages (_groups), split the layers, score the plan into scored, and return
        its step time (inf where there is none)."""
        groups = self._groups(subset, n_stages, chain, mode)
        split = self.split_layers(groups) if groups is not None else None
        if split is None:
            return math.inf
        if split[0] not in scored:
            scored[split[0]] = self.cm.step_seconds(split[0])
        return scored[split[0]]

    def _subsets(self) -> list[tuple[int, ...]]:
        usable = np.array(self.cm.usable)
        subsets = {tuple(usable)}
        for key in (self.uplink[usable], self.speed[usable]):
            for q in _SUBSET_QUANTILES:
                keep = usable[key >= np.quantile(key, q)]
                if len(keep):
                    subsets.add(tuple(keep))
        return sorted(subsets, key=lambda s: (-len(s), s))

    def _region_costs(self) -> np.ndarray:
        """[a, b] = seconds to move one typical boundary both ways between regions a and b (CostModel.regions)."""
        cm = self.cm
        return cm.boundary_terms(self.typical_boundary_bits, cm.links.region_seconds_per_bit, cm.links.region_lat, 1)[1]

    def _region_chain(self, region_cost: np.ndarray) -> list[str]:
        """The regions in the order that makes the summed cost of consecutive ones least."""
        cm = self.cm
        present = sorted({int(cm.links.region_of[i]) for i in cm.usable})  # sorted indices = sorted names
        cost = region_cost[np.ix_(present, present)]

        def length(order: Sequence[int]) -> float:
            return float(cost[order[:-1], order[1:]].sum())

        n = len(present)
        if n <= _EXACT_CHAIN_REGIONS:
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

    def _groups(
        self, subset: Sequence[int], n_stages: int, chain: Sequence[str], mode: str
    ) -> list[list[int]] | None:
        """Replica groups in pipeline order. mode "merge": a region too small for a stage joins its neighbour's;
        "drop": it stays out; "flat": region borders are ignored, the chain of nodes is cut into equal stages;
        "deal": every stage gets its share of every region."""
        if n_stages > len(subset):
            return None
        by_region, rates = self._by_region(subset, chain)
        if mode == "flat":
            return self._cut_equal_rate([i for r in chain for i in by_region[r]], n_stages)
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
            groups.extend(self._cut_equal_rate(by_region[chain[pos]], int(seats[pos])))
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

    def _cut_equal_rate(self, members: Sequence[int], k: int) -> list[list[int]]:
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

    def split_layers(self, groups: Sequence[Sequence[int]]) -> tuple[tuple[Stage, ...], float] | None:
        """Layer cuts for fixed replica groups, and the step time the tables price them at, that minimise the step
        time's two maxima, (M-1) x the slowest stage or link per microbatch (the pace) plus the slowest gradient
        all-reduce: a min-max DP on the pace under a cap on every stage's all-reduce, with the cap lowered below the
        last answer's slowest all-reduce until the pace alone outweighs the best step time found. That walks the
        whole pace/all-reduce trade-off."""
        n_stages = len(groups)
        if n_stages > self.n_layers:
            return None
        groups = tuple(self._one_class(g) for g in groups)
        if groups not in self._splits:
            self._splits[groups] = self._split(groups)
        return self._splits[groups]

    def _one_class(self, group: Sequence[int]) -> tuple[int, ...]:
        """The group's members of one device class: the class with the most summed speed (ties: the first name)."""
        classes = {self.device_class[i] for i in group}
        if len(classes) <= 1:
            return tuple(group)
        speed = {c: sum(self.speed[i] for i in group if self.device_class[i] == c) for c in classes}
        keep = min(classes, key=lambda c: (-speed[c], c))
        return tuple(i for i in group if self.device_class[i] == keep)

    def _split(self, groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[Stage, ...], float] | None:
        """split_layers, unmemoised."""
        cm, n_stages = self.cm, len(groups)
        tables = [self._stage_table(g, n_stages) for g in groups]
        links = [self._link_table(groups[s], groups[s + 1]) for s in range(n_stages - 1)]
        best, best_cost, cap = None, math.inf, math.inf
        while True:
            found = self._split_under(tables, links, cap)
            if found is None:
                break
            bounds, pace, fill, slowest_sync = found
            # The cost model adds the DP's terms up; the data heads are the members of the first stage that fit.
            cost = cm.step_from(pace, fill, slowest_sync, self._fitting(tables[0], 0, bounds[1]), cm.fixed_window)
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
            (a, b, tuple(sorted(np.asarray(g, dtype=np.int64)[tables[s][3][tables[s][4], a, b]].tolist())))
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

    def _link_table(self, left: tuple[int, ...], right: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """For each cut position between two replica groups: (M-1) x the link's occupancy and its fill. Memoised:
        neighbouring groups recur across stage counts and local-search moves."""
        key = (left, right)
        if key not in self._link_tables:
            cm = self.cm
            a, b = np.asarray(left, dtype=np.int64), np.asarray(right, dtype=np.int64)
            wa, wb = self.speed[a] / self.speed[a].sum(), self.speed[b] / self.speed[b].sum()
            per_bit, lat = cm.links.mean_link(a, wa, b, wb)
            occupancy, transfer = cm.boundary_terms(cm.boundary_bits, per_bit, lat, min(len(a), len(b)))
            # No cut before the first layer.
            self._link_tables[key] = (
                np.concatenate([[np.inf], cm.paced_seconds(occupancy)]),
                np.concatenate([[np.inf], transfer]),
            )
        return self._link_tables[key]

    def _stage_table(self, group: tuple[int, ...], n_stages: int) -> tuple[np.ndarray, ...]:
        """For a replica group among n_stages stages, over every layer range [a, b): (M-1) x occupancy, the fill
        latency, the gradient all-reduce, and which of the group's profile classes fit in memory; then each member's
        class and each class's member count. Memoised: candidates share groups."""
        key = (group, n_stages)
        if key not in self._stage_tables:
            cm = self.cm
            need = self._memory_need(n_stages)
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
            self._stage_tables[key] = (cm.paced_seconds(c), h, sync, fit_rep, member_class.reshape(-1), count)
        return self._stage_tables[key]

    @staticmethod
    def _fitting(table: tuple[np.ndarray, ...], start: int, end: int) -> int:
        """How many members of a stage table's group fit layers [start, end)."""
        fit_class, _, count = table[3:]
        return int(count[fit_class[:, start, end]].sum())

    def _memory_need(self, n_stages: int) -> np.ndarray:
        """[a, b] = memory a replica of layers [a, b) needs among n_stages stages; inf where b <= a."""
        if n_stages in self._need_cache:
            return self._need_cache[n_stages]
        need = self.cm.stage_memory_bytes(self._starts, self._ends, n_stages)
        need[self._below_diagonal] = np.inf
        self._need_cache[n_stages] = need
        return need

    def _redealt(self, stages: tuple[Stage, ...], rounds: int = 3) -> list[tuple[Stage, ...]]:
        """The plan with each region's nodes dealt again among the stages that region alone serves, then the layer
        DP again, a few rounds. Equal-rate groups leave a stage that drew heavy layers, or that feeds a slow link
        with few parallel pairs, as the pace; dealing by load gives it more replicas instead. Longest-processing-time
        first: the fastest node joins the stage it fits with the highest load, its seconds per microbatch or those
        of an adjacent link where it is the side with fewer replicas. Stages stay inside their region, so no
        all-reduce moves onto a slower link."""
        cm, out = self.cm, []
        for _ in range(rounds):
            n_stages = len(stages)
            idx = [np.asarray(nodes, dtype=np.int64) for _, _, nodes in stages]
            speed = [self.speed[g] / self.speed[g].sum() for g in idx]
            # Each boundary's bits per microbatch and seconds per bit of its link.
            bits = [float(cm.boundary_bits[stages[s][1] - 1]) for s in range(n_stages - 1)]
            per_bit = [cm.links.mean_link(idx[s], speed[s], idx[s + 1], speed[s + 1])[0] for s in range(n_stages - 1)]
            count = [float(len(g)) for g in idx]
            owner = [{int(cm.links.region_of[i]) for i in nodes} for _, _, nodes in stages]
            groups = [list(nodes) if len(regions) > 1 else [] for regions, (_, _, nodes) in zip(owner, stages)]
            for region in sorted({next(iter(r)) for r in owner if len(r) == 1}):
                served = [s for s, r in enumerate(owner) if r == {region}]
                members = sorted((i for s in served for i in stages[s][2]), key=lambda i: self.rank[i])
                a, b = np.array([stages[s][0] for s in served]), np.array([stages[s][1] for s in served])
                secs = cm.prefix_seconds[np.ix_(members, b)] - cm.prefix_seconds[np.ix_(members, a)]
                need = np.array([cm.stage_memory_bytes(stages[s][0], stages[s][1], n_stages) for s in served])
                fits = (cm.memory[members][:, None] >= need[None, :]).tolist()
                secs = secs.tolist()
                for s in served:
                    count[s] = 0.0
                inv = [0.0] * len(served)
                # The links into and out of each served stage: bits per microbatch, seconds per bit, the other side.
                sides = [
                    [(bits[link], per_bit[link], other) for link, other in ((s - 1, s - 1), (s, s + 1))
                     if 0 <= link < n_stages - 1]
                    for s in served
                ]
                # Python numbers: this runs once per member over a handful of stages.
                for row, i in enumerate(members):
                    if not any(fits[row]):
                        continue
                    k, best = 0, None
                    for col, s in enumerate(served):
                        own = count[s]
                        load = math.inf  # an empty stage first
                        if own:
                            load = cm.compute_terms(inv[col], own)[0]
                            for link_bits, link_per_bit, other in sides[col]:
                                if own <= count[other]:
                                    # The link's occupancy were this stage the side with fewer replicas.
                                    load = max(load, cm.boundary_terms(link_bits, link_per_bit, 0.0, own)[0])
                        # Highest load first; among empty stages, the one this node is slowest on.
                        key = (-load if fits[row][col] else 1.0, -secs[row][col])
                        if best is None or key < best:
                            k, best = col, key
                    groups[served[k]].append(i)
                    inv[k] += 1.0 / secs[row][k]
                    count[served[k]] += 1
            if not all(groups):
                break
            split = self.split_layers(groups)
            if split is None or split[0] == stages:
                break
            stages = split[0]
            out.append(stages)
        return out

    def _resized(self, stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
        """Local search over replica counts: move a chunk of nodes between neighbouring stages (the last-ranked of
        one to the other) and split the layers again, halving the chunk down to one node when nothing improves. The
        layer DP alone cannot trade a stage's replicas for a neighbour's, e.g. more parallel pairs on a slow link."""
        cm = self.cm
        best, best_cost = stages, cm.step_seconds(stages)
        # From a quarter of the smallest stage down to a sixteenth: single nodes matter only in small stages.
        smallest = min(len(nodes) for _, _, nodes in stages)
        chunk, finest = max(1, smallest // 4), max(1, smallest // 16)
        ranked = [sorted(nodes, key=lambda i: self.rank[i]) for _, _, nodes in best]
        while True:
            improved = False
            for s, (src, dst) in itertools.product(range(len(best) - 1), ((0, 1), (1, 0))):
                groups = list(ranked)
                give, take = groups[s + src], groups[s + dst]
                if len(give) <= chunk:
                    continue
                moved = give[-chunk:] if src == 0 else give[:chunk]
                groups[s + src] = give[:-chunk] if src == 0 else give[chunk:]
                groups[s + dst] = moved + take if src == 0 else take + moved
                split = self.split_layers(groups)
                cost = cm.step_seconds(split[0]) if split is not None else math.inf
                if cost < best_cost * (1 - 1e-9):
                    best, best_cost, improved = split[0], cost, True
                    ranked = [sorted(nodes, key=lambda i: self.rank[i]) for _, _, nodes in best]
            if not improved:
                if chunk <= finest:
                    return best
                chunk //= 2

    # --- local search ----------------------------------------------------------------------------------

    def _refine(self, stages: tuple[Stage, ...], *, nodes_first: bool = False) -> tuple[Stage, ...]:
        """First-improvement local search; nodes_first (for the adapted previous plan) tries moves that shift
        one node's layers before those that shift a whole stage's."""
        cm = self.cm
        best, best_cost = stages, cm.step_seconds(stages)
        at = 0  # where the last improving node move stood among the node moves
        for _ in range(self.config.max_refine_passes):
            improved = False
            # Node moves go on from the last improving one, round the list: the moves before it were just tried and
            # rarely improve after one node moved, and trying them again every pass was most of the search's work.
            node_moves = list(self._node_moves(best))
            at = min(at, len(node_moves))
            moves = [self._boundary_moves(best), node_moves[at:] + node_moves[:at], self._swap_moves(best)]
            for trial in itertools.chain(*(moves[::-1] if nodes_first else moves)):
                cost = cm.step_seconds(trial)
                if cost < best_cost * (1 - 1e-9):
                    best, best_cost, improved = trial, cost, True
                    if trial in node_moves:
                        at = node_moves.index(trial)
                    break
            if not improved:
                break
        return best

    def _boundary_moves(self, stages: tuple[Stage, ...]):
        """Shift one stage boundary by one layer."""
        for s in range(len(stages) - 1):
            (a, b, left), (_, c, right) = stages[s], stages[s + 1]
            for cut in (b - 1, b + 1):
                if a < cut < c:
                    yield stages[:s] + ((a, cut, left), (cut, c, right)) + stages[s + 2 :]

    def _node_moves(self, stages: tuple[Stage, ...]):
        """Move one node to another stage or out; only on small clusters, where there are few such moves."""
        if len(self.cm.usable) * len(stages) > self.config.node_move_limit:
            return
        where = {i: s for s, (_, _, nodes) in enumerate(stages) for i in nodes}
        for i in self.cm.usable:
            src = where.get(i)
            for dst in [*range(len(stages)), None]:
                if dst == src or (src is not None and len(stages[src][2]) == 1):
                    continue
                if dst is not None and self.device_class[stages[dst][2][0]] != self.device_class[i]:
                    continue
                trial = list(stages)
                if src is not None:
                    a, b, nodes = trial[src]
                    trial[src] = (a, b, tuple(n for n in nodes if n != i))
                if dst is not None:
                    a, b, nodes = trial[dst]
                    trial[dst] = (a, b, tuple(sorted(nodes + (i,))))
                yield tuple(trial)

    def _swap_moves(self, stages: tuple[Stage, ...]):
        """Swap the nodes of two stages, keeping the layer ranges: the order of the stages' node groups sets which
        links the pipeline uses (two nodes nobody can dial are better not neighbours: their link needs a relay)."""
        if len(self.cm.usable) * len(stages) > self.config.node_move_limit:
            return
        for s, t in itertools.combinations(range(len(stages)), 2):
            trial = list(stages)
            trial[s], trial[t] = (*stages[s][:2], stages[t][2]), (*stages[t][:2], stages[s][2])
            yield tuple(trial)

    # --- re-planning -----------------------------------------------------------------------------------

    def _previous_ranges(self, previous: Plan | None) -> dict[int, tuple[int, int]]:
        if previous is None or not previous.stages or previous.stages[-1].end != self.n_layers:
            return {}
        self._previously_out = {self.cm.index[n] for n in previous.excluded if n in self.cm.index}
        return {self.cm.index[n]: r for n, r in previous.layer_ranges().items() if n in self.cm.index}

    def _adapt(self, prev: dict[int, tuple[int, int]]) -> tuple[Stage, ...] | None:
        """The previous plan with departed nodes removed and new nodes added where compute is scarcest."""
        cm = self.cm
        usable = set(cm.usable)
        ranges = sorted(set(prev.values()))
        members = {r: [i for i in sorted(prev) if prev[i] == r and i in usable] for r in ranges}
        kept: list[list] = []
        for r in ranges:
            if members[r]:
                kept.append([r[0], r[1], members[r]])
            elif kept:
                kept[-1][1] = r[1]  # an orphaned range joins the stage before it
        if not kept:
            return None
        kept[0][0] = 0
        for s in range(1, len(kept)):
            kept[s][0] = kept[s - 1][1]
        kept[-1][1] = self.n_layers
        if self.config.stages is not None and len(kept) != self.config.stages:
            return None
        newcomers = [i for i in cm.usable if i not in prev and i not in self._previously_out]
        for i in newcomers:
            options = [
                s
                for s, (a, b, nodes) in enumerate(kept)
                if cm.memory[i] >= cm.stage_memory_bytes(a, b, len(kept))
                and self.device_class[nodes[0]] == self.device_class[i]
            ]
            if not options:
                continue
            local = [s for s in options if any(cm.nodes[j].region == cm.nodes[i].region for j in kept[s][2])]
            pool = local or options
            occupancy = {s: cm.occupancy(kept[s][0], kept[s][1], kept[s][2]) for s in pool}
            kept[max(pool, key=lambda s: (occupancy[s], -s))][2].append(i)
        stages = tuple(
            (a, b, self._one_class(sorted(i for i in nodes if cm.memory[i] >= cm.stage_memory_bytes(a, b, len(kept)))))
            for a, b, nodes in kept
        )
        return stages if all(nodes for _, _, nodes in stages) else None

    def _moved_layers(self, stages: Sequence[Stage], prev: dict[int, tuple[int, int]]) -> int:
        moved = 0
        for a, b, nodes in stages:
            for i in nodes:
                if i in prev:
                    pa, pb = prev[i]
                    moved += (b - a) - max(0, min(b, pb) - max(a, pa))
        return moved
