"""Planner: stages, layer ranges, replicas and stage order that minimise the cost model's step time.

Every candidate is scored by CostModel, the model that scores any other plan; the layer split searches the cost
model's own tables (costtables). How it searches:
1. Nodes without memory for even a one-layer stage are left out, with the reason. A stage's replicas share one device
   class (their parameter checksums must agree bit for bit).
2. Node pools along a chain of regions (grouping) are cut into replica groups for S = 1, 2, ... stages until four
   counts in a row cost more than twice the best step found so far; S = 1 is data parallelism, every node a replica
   of the whole model.
3. A dynamic program splits the layers over those groups (layersplit).
4. The best few candidates have their replica counts re-dealt by load and resized, then all get a local search:
   shift a stage boundary by one layer and, on small clusters, move a node to another stage or out.
5. Re-planning adds the previous plan, departed nodes removed and new ones added where they relieve most; among plans
   within `replan_tolerance` of the best, the one moving the fewest layers wins. Ties break on stable keys, so the
   same inputs give the same plan.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from geotrain.scheduler.costmodel import CostModel, ModelProfile, Network, NodeProfile, Plan, StepShape, layout_of
from geotrain.scheduler.costtables import CostTables
from geotrain.scheduler.grouping import EXACT_CHAIN_REGIONS, Grouping, Pool
from geotrain.scheduler.layersplit import LayerSplitter, Stage

logger = logging.getLogger(__name__)

_GIB = 2**30
_STAGE_SWEEP_FACTOR, _STAGE_SWEEP_PATIENCE = 2.0, 4  # stage counts stop once 4 in a row cost > 2x the best step


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
        self.tables = CostTables(cm)
        self.grouping = Grouping(self.tables)
        self.splitter = LayerSplitter(self.tables)
        self.speed, self.rank, self.uplink = self.tables.speed, self.grouping.rank, self.grouping.uplink
        self.device_class = self.grouping.device_class
        self._previously_out: set[int] = set()

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
        chain = self.grouping.region_chain(self.grouping.region_cost)
        scored = self._constructed(self.grouping.pools(chain))
        ranked = sorted((c for c in scored if math.isfinite(scored[c])), key=lambda c: (scored[c], c))
        if not ranked:
            raise ValueError("no feasible plan: the nodes lack memory for every layer split tried")
        for cand in ranked[: self.config.refine_candidates]:
            self._improve(cand, scored)
        self._paced_chain(chain, scored)
        self._lone_nodes(scored)
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
        return cm.plan(best, self._exclusions(best), layout_steps=self._layout_steps(scored))

    @staticmethod
    def _layout_steps(scored: dict[tuple[Stage, ...], float]) -> dict[str, float]:
        """The best step time of each layout (pipeline, data parallel, hybrid) among the scored plans."""
        best: dict[str, float] = {}
        for cand, cost in scored.items():
            if math.isfinite(cost):
                layout = layout_of(cand)
                best[layout] = min(best.get(layout, math.inf), float(cost))
        return dict(sorted(best.items(), key=lambda item: (item[1], item[0])))

    def _paced_chain(self, chain: list[str], scored: dict[tuple[Stage, ...], float]) -> None:
        """Score into scored the best plan along the chain ordered by what a boundary adds to the step, its paced
        occupancy too (by the transfer alone the chain may put a slower link under the pipeline to save latency),
        after its local search. Only over the few regions whose chain is exact: over many it costs most."""
        cm = self.cm
        if len(chain) > EXACT_CHAIN_REGIONS:
            return
        occupancy, transfer = self.tables.region_crossing(self.grouping.typical_boundary_bits)
        paced_chain = self.grouping.region_chain(cm.paced_seconds(occupancy) + transfer)
        if paced_chain in (chain, chain[::-1]):
            return
        extra = self._constructed([(tuple(cm.usable), paced_chain, True)])
        feasible = [c for c in extra if math.isfinite(extra[c])]
        if feasible:
            scored.update(extra)
            refined = self._refine(min(feasible, key=lambda c: (extra[c], c)))
            scored.setdefault(refined, cm.step_seconds(refined))

    def _lone_nodes(self, scored: dict[tuple[Stage, ...], float]) -> None:
        """Score into scored the whole model on each usable node alone. Construction and resizing come down to one
        node by dropping the slowest, so one a little slower but nearer the coordinator (whose round trip each step
        waits for: CostModel.control_seconds) was never tried."""
        if self.config.stages not in (None, 1):
            return
        for i in self.cm.usable:
            lone = ((0, self.n_layers, (i,)),)
            scored.setdefault(lone, self.cm.step_seconds(lone))

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
                    f"planner choice: with a {self.uplink[i] / 1e6:.0f} Mbit/s link, {1 / self.speed[i]:.3g} s per"
                    f" microbatch for the whole model and {cm.coordinator_rtt[i] * 1e3:.0f} ms to the coordinator and"
                    " back it would slow the stage it joined"
                )
        return reasons

    # --- construction ----------------------------------------------------------------------------------

    def _constructed(self, pools: list[Pool]) -> dict[tuple[Stage, ...], float]:
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
            if 1 < len(order) <= EXACT_CHAIN_REGIONS and whole:
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
        groups = self.grouping.groups(subset, n_stages, chain, mode)
        split = self.splitter.split_layers(groups) if groups is not None else None
        if split is None:
            return math.inf
        if split[0] not in scored:
            scored[split[0]] = self.cm.step_seconds(split[0])
        return scored[split[0]]

    def _redealt(self, stages: tuple[Stage, ...], rounds: int = 3) -> list[tuple[Stage, ...]]:
        """The plan with each region's nodes dealt again among the stages that region alone serves, then the layer
        DP again, a few rounds. Equal-rate groups leave a stage that drew heavy layers, or that feeds a slow link
        with few parallel pairs, as the pace; dealing by load gives it more replicas instead. Stages stay inside
        their region, so no all-reduce moves onto a slower link."""
        cm, out = self.cm, []
        for _ in range(rounds):
            n_stages = len(stages)
            idx = [np.asarray(nodes, dtype=np.int64) for _, _, nodes in stages]
            speed = [self.speed[g] / self.speed[g].sum() for g in idx]
            # Each boundary's bits per microbatch and seconds per bit of its link.
            bits = [float(cm.boundary_bits[stages[s][1] - 1]) for s in range(n_stages - 1)]
            per_bit = [cm.links.mean_link(idx[s], speed[s], idx[s + 1], speed[s + 1])[0] for s in range(n_stages - 1)]
            # The links into and out of each stage: bits per microbatch, seconds per bit, the other side.
            sides = [
                [(bits[link], per_bit[link], other) for link, other in ((s - 1, s - 1), (s, s + 1))
                 if 0 <= link < n_stages - 1]
                for s in range(n_stages)
            ]
            count = [float(len(g)) for g in idx]
            owner = [{int(cm.links.region_of[i]) for i in nodes} for _, _, nodes in stages]
            groups = [list(nodes) if len(regions) > 1 else [] for regions, (_, _, nodes) in zip(owner, stages)]
            for region in sorted({next(iter(r)) for r in owner if len(r) == 1}):
                self._deal(stages, [s for s, r in enumerate(owner) if r == {region}], groups, count, sides)
            if not all(groups):
                break
            split = self.splitter.split_layers(groups)
            if split is None or split[0] == stages:
                break
            stages = split[0]
            out.append(stages)
        return out

    def _deal(
        self, stages: tuple[Stage, ...], served: list[int], groups: list[list[int]], count: list[float], sides: list
    ) -> None:
        """Deal the nodes of the stages `served` (one region's) among them into groups, longest-processing-time
        first: the fastest node joins the stage it fits with the highest load (CostTables.stage_load). count holds
        every stage's replicas as dealt so far."""
        cm = self.cm
        members = sorted((i for s in served for i in stages[s][2]), key=lambda i: self.rank[i])
        a, b = np.array([stages[s][0] for s in served]), np.array([stages[s][1] for s in served])
        secs = (cm.prefix_seconds[np.ix_(members, b)] - cm.prefix_seconds[np.ix_(members, a)]).tolist()
        need = np.array([cm.stage_memory_bytes(stages[s][0], stages[s][1], len(stages)) for s in served])
        fits = (cm.memory[members][:, None] >= need[None, :]).tolist()
        for s in served:
            count[s] = 0.0
        inv = [0.0] * len(served)
        # Python numbers: this runs once per member over a handful of stages.
        for row, i in enumerate(members):
            if not any(fits[row]):
                continue
            k, best = 0, None
            for col, s in enumerate(served):
                load = self.tables.stage_load(inv[col], count[s], sides[s], count) if count[s] else math.inf
                # Highest load first (an empty stage before any); among empty stages, the one this node is slowest on.
                key = (-load if fits[row][col] else 1.0, -secs[row][col])
                if best is None or key < best:
                    k, best = col, key
            groups[served[k]].append(i)
            inv[k] += 1.0 / secs[row][k]
            count[served[k]] += 1

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
                split = self.splitter.split_layers(groups)
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
            (a, b, self.splitter.one_class(sorted(i for i in nodes if cm.memory[i] >= cm.stage_memory_bytes(a, b, len(kept)))))
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
