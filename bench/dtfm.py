"""DT-FM's scheduler, a peer for bench/planner.py, scored by geotrain's CostModel like every other strategy.

DT-FM (Yuan et al., "Decentralized Training of Foundation Models in Heterogeneous Environments", NeurIPS 2022,
sections 3 and 4) gives every device one tasklet: the layers are cut into D_PP stages of equal layer count, and the
devices into D_PP data-parallel groups of D_DP devices each, a balanced partition. Which devices share a group is
searched by a genetic algorithm (GCMA: a population of random balanced partitions; an offspring is a five-point
crossover of two parents, improved by a round of cyclic partitioning, and replaces the worse parent unless it is worse
than both). The order of the groups along the pipeline is an open-loop travelling salesman path over the coarsened
graph, whose nodes are the groups and whose edges are the cost of moving activations between two groups.

What this implementation simplifies or changes, and why:
- Fitness: geotrain's CostModel step time of the plan (so that every strategy of the benchmark is scored the same
  way), not DT-FM's own communication cost (the data-parallel cost plus twice the pipeline cost, with compute
  assumed equal everywhere).
- Coarsened graph edges: the cost model's price of a typical boundary between the two groups over a step, (M-1) x
  its link occupancy plus its transfer, with speed-weighted routing between them; DT-FM matches the two groups'
  devices one to one (a bottleneck perfect matching), since its pipelines are fixed chains of devices, where
  geotrain routes each microbatch to any replica of the next stage.
- Budget: DT-FM's own, per D_PP: its scheduler runs GCMA(population_size=100, trails=4900) (DS3Lab/DT-FM,
  scheduler/heuristic_evolutionary_solver/scheduler.py, the __main__ block calling GCMA): 100 random balanced
  partitions, then 4,900 offspring, each a five-point crossover of two parents improved by one round of cyclic
  partitioning and scored once, 5,000 scorings in all (31.5-148.7 s a pair in bench/planner.py's run). An offspring
  takes the place of the worse parent unless it is worse than both, as that code means it (its test,
  `offspring_score > max(score1, offspring_score > score2)`, compares with the first parent only, a slip).
- Local search: one round of cyclic partitioning, with its gains from DT-FM's pairwise communication costs (the
  delay plus one activation's bits over the bandwidth between two devices), never from the cost model; its cycles of
  moves are swaps (cycles through two groups), made where they lower the groups' summed pairwise costs; first moves
  are ranked by DT-FM's gain (a device's mean cost to its own group against another's), a few of them tried for a swap
  that pays. The round works on counts of devices per link class, and costs about one scoring of the cost model at
  16 groups of 1,024 devices, a fraction of one at fewer groups.
- Parents are two different members of the population (DT-FM's draw may pick one twice).
- D_PP: DT-FM fixes it (8 for its 64 GPUs); here every power of two up to the layer count is searched and the best
  kept. D_DP = N / D_PP where it divides; otherwise group sizes differ by one.
- Devices that cannot hold the largest of the D_PP stages are left out (DT-FM assumes every device holds any
  tasklet).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from geotrain.scheduler.costmodel import CostModel

POPULATION = 100
OFFSPRING = 4900
SWAP_TRIES = 4  # first moves tried per swap of the local search
CROSSOVER_POINTS = 5
EXACT_PATH_GROUPS = 8

Stages = tuple[tuple[int, int, tuple[int, ...]], ...]


def uniform_cuts(n_layers: int, n_stages: int) -> list[int]:
    """Layer bounds of n_stages stages with equal layer counts (within one)."""
    return [round(k * n_layers / n_stages) for k in range(n_stages + 1)]


def balanced_labels(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A random balanced partition of n items into k groups: group g gets n // k items, one more for g < n % k."""
    labels = np.repeat(np.arange(k), [n // k + (g < n % k) for g in range(k)])
    return rng.permutation(labels)


def crossover(parent1: np.ndarray, parent2: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """GCMA's five-point crossover: parent2's labels with parent1's at CROSSOVER_POINTS random items, then items
    of groups over their size moved at random to groups under theirs, so the child is balanced like its parents."""
    child = parent2.copy()
    points = rng.choice(len(child), size=min(CROSSOVER_POINTS, len(child)), replace=False)
    child[points] = parent1[points]
    target = np.bincount(parent2, minlength=k)
    surplus = np.bincount(child, minlength=k) - target
    movers = np.concatenate(
        [rng.choice(np.flatnonzero(child == g), size=surplus[g], replace=False) for g in np.flatnonzero(surplus > 0)]
        or [np.empty(0, dtype=np.int64)]
    )
    child[movers] = rng.permutation(np.repeat(np.flatnonzero(surplus < 0), -surplus[surplus < 0]))
    return child


def open_path(cost: np.ndarray) -> list[int]:
    """The cheapest open path through every node of a symmetric cost matrix: exact (every order) up to
    EXACT_PATH_GROUPS nodes, the best nearest-neighbour path over every start, then 2-opt, above."""
    n = len(cost)
    if n <= 2:
        return list(range(n))
    if n <= EXACT_PATH_GROUPS:
        orders = _orders(n)
        return orders[int(np.argmin(cost[orders[:, :-1], orders[:, 1:]].sum(axis=1)))].tolist()
    c = cost.tolist()

    def edge(path: list[int], a: int, b: int) -> float:
        """Cost of the edge between positions a and b of the path; 0 past either end (the path is open)."""
        return c[path[a]][path[b]] if 0 <= a and b < n else 0.0

    starts = []
    for first in range(n):
        path, left = [first], set(range(n)) - {first}
        while left:
            path.append(min(left, key=lambda k: (c[path[-1]][k], k)))
            left.remove(path[-1])
        starts.append((_length(cost, path), path))
    path = min(starts)[1]
    improved = True
    while improved:
        improved = False
        for i, j in itertools.combinations(range(n), 2):
            # Reversing positions i..j replaces the edges into i and out of j.
            before = edge(path, i - 1, i) + edge(path, j, j + 1)
            after = (c[path[i - 1]][path[j]] if i else 0.0) + (c[path[i]][path[j + 1]] if j + 1 < n else 0.0)
            if after < before - 1e-12:
                path[i : j + 1] = path[i : j + 1][::-1]
                improved = True
    return path


def _length(cost: np.ndarray, path: list[int]) -> float:
    return float(cost[path[:-1], path[1:]].sum())


@functools.cache
def _orders(n: int) -> np.ndarray:
    """Every order of n nodes that starts at a lower index than it ends (the reverse is the same path)."""
    orders = np.array(list(itertools.permutations(range(n))), dtype=np.int64)
    return orders[orders[:, 0] < orders[:, -1]]


@dataclass
class _Search:
    """One D_PP: the candidate devices, the layer cuts, and the cost model scoring partitions."""

    cm: CostModel
    members: np.ndarray
    cuts: list[int]
    typical_bits: float

    def stages(self, labels: np.ndarray) -> tuple[float, Stages]:
        """The partition's groups along their cheapest path, in the better direction, and its step time."""
        k = len(self.cuts) - 1
        groups = [tuple(sorted(self.members[labels == g].tolist())) for g in range(k)]
        # Every pair of groups at once: routing weights by link class, then the cost model's class link matrices.
        speed = 1.0 / self.cm.prefix_seconds[self.members, -1]
        weights = np.zeros((k, self.cm.links.n_link_classes))
        np.add.at(weights, (labels, self.cm.links.link_class[self.members]), speed)
        weights /= weights.sum(axis=1, keepdims=True)
        per_bit = weights @ self.cm.links.class_seconds_per_bit @ weights.T
        lat = weights @ self.cm.links.class_lat @ weights.T
        sizes = np.bincount(labels, minlength=k)
        occupancy, transfer = self.cm.boundary_terms(self.typical_bits, per_bit, lat, np.minimum.outer(sizes, sizes))
        cost = self.cm.paced_seconds(occupancy) + transfer
        path = open_path(cost)
        best = (math.inf, ())
        for order in (path, path[::-1]):
            plan = tuple((self.cuts[s], self.cuts[s + 1], groups[g]) for s, g in enumerate(order))
            best = min(best, (self.cm.step_seconds(plan), plan), key=lambda x: x[0])
        return best

    def __post_init__(self) -> None:
        # DT-FM's pairwise cost of two devices, over the link classes of the candidates: the latency plus the bits
        # of one activation over the bandwidth.
        classes, self.member_class = np.unique(self.cm.links.link_class[self.members], return_inverse=True)
        pick = np.ix_(classes, classes)
        self.pair_cost = self.cm.links.class_lat[pick] + self.typical_bits * self.cm.links.class_seconds_per_bit[pick]
        values, counts = np.unique(self.pair_cost, return_counts=True)
        common_cost = values[np.argmax(counts)]
        # Classes of one device that see the commonest cost to every other class (standalone machines) are one class
        # for these costs: merged, a 1,024-node spot cluster has some 130 classes instead of 640.
        odd = self.pair_cost != common_cost
        np.fill_diagonal(odd, False)
        plain = (np.bincount(self.member_class) == 1) & ~odd.any(axis=1)
        if plain.sum() > 1:
            keep = np.flatnonzero(~plain)
            merged = np.full(len(classes), len(keep))
            merged[keep] = np.arange(len(keep))
            self.member_class = merged[self.member_class]
            self.pair_cost = np.pad(self.pair_cost[np.ix_(keep, keep)], (0, 1), constant_values=common_cost)
    def cyclic_round(self, labels: np.ndarray) -> np.ndarray:
        """One round of GCMA's cyclic partitioning on the pairwise costs, its cycles of moves made swaps (cycles of
        two groups). First moves are taken in the order of their gains as DT-FM's are (a device's mean cost to the
        rest of its group less its mean cost to the other group's members), SWAP_TRIES of them at most, each with the
        best move back from the other group; the first swap that lowers the groups' summed pairwise costs (exactly)
        is made. A device moves at most once a round, so groups keep their sizes. The round ends when no swap tried
        pays, every group has received a device, or after as many swaps as groups (DT-FM's bound on cycles). Devices
        of one link class are interchangeable for these costs, so the search runs on counts per (group, class)."""
        k, n_classes = len(self.cuts) - 1, len(self.pair_cost)
        counts = np.bincount(labels * n_classes + self.member_class, minlength=k * n_classes).reshape(k, n_classes)
        costs = counts @ self.pair_cost  # [g, c]: a class-c device's summed cost to every device of group g
        sizes = counts.sum(axis=1)[:, None]  # the same after every swap
        free = counts  # devices that have not moved this round
        self_cost = np.diag(self.pair_cost)
        # A device's cost to the rest of its group is its group's sum less its cost to itself; -inf: none left.
        own_bias = np.where(free > 0, -self_cost, -math.inf)
        received = np.zeros(k, dtype=bool)
        swaps: list[tuple[int, int, int, int]] = []  # class out of the first group, the group, class back, group
        for _ in range(k):
            leaving = costs + own_bias
            joining = costs / sizes
            # Each (group, class): its mean cost to the cheapest other group, the cheapest or else the second.
            cheapest, second = np.partition(joining, 1, axis=0)[:2]
            gains = (leaving / np.maximum(sizes - 1, 1) - np.where(joining == cheapest, second, cheapest)).ravel()
            # The best first moves in turn, until one has a move back that makes the swap pay.
            best = np.argpartition(-gains, SWAP_TRIES)[:SWAP_TRIES] if len(gains) > SWAP_TRIES else range(len(gains))
            for first in sorted(best, key=lambda g: -gains[g]):
                src, out = divmod(int(first), n_classes)
                to_other = joining[:, out].copy()
                to_other[src] = math.inf
                dst = int(np.argmin(to_other))
                # The move back's gains after the first move: the devices it moved meet or part.
                back = costs[dst] + self.pair_cost[out] + own_bias[dst] - costs[src] + self.pair_cost[out]
                ret = int(np.argmax(back))
                if leaving[src, out] - costs[dst, out] + back[ret] > 0:
                    break
            else:
                break
            costs[src] -= self.pair_cost[out]
            costs[dst] += self.pair_cost[out]
            costs[dst] -= self.pair_cost[ret]
            costs[src] += self.pair_cost[ret]
            for group, c in ((src, out), (dst, ret)):
                free[group, c] -= 1
                if not free[group, c]:
                    own_bias[group, c] = -math.inf
            received[[src, dst]] = True
            swaps.append((out, src, ret, dst))
            if received.all():
                break
        moves = [(c, a, b) for out, src, ret, dst in swaps for c, a, b in ((out, src, dst), (ret, dst, src))]
        moved = labels.copy()
        if moves:
            # The first devices of each (group, class) in index order move, as many as the swaps took from it.
            by_key = np.argsort(labels * n_classes + self.member_class, kind="stable")
            starts = np.searchsorted((labels * n_classes + self.member_class)[by_key], np.arange(k * n_classes))
            keys = np.array([a * n_classes + c for c, a, _ in moves])
            order = np.argsort(keys, kind="stable")
            rank = np.arange(len(keys)) - np.searchsorted(keys[order], keys[order])
            moved[by_key[starts[keys[order]] + rank]] = np.array([b for _, _, b in moves])[order]
        return moved

    def run(self, rng: np.random.Generator) -> tuple[float, Stages]:
        """GCMA: random balanced partitions, then offspring, each a crossover of two parents improved by one round
        of cyclic partitioning and scored once, that take the worse parent's place unless worse than both."""
        k = len(self.cuts) - 1
        population = [balanced_labels(len(self.members), k, rng) for _ in range(POPULATION if k > 1 else 1)]
        scores = [self.stages(labels)[0] for labels in population]
        for _ in range(OFFSPRING if k > 1 else 0):
            p1, p2 = rng.choice(len(population), size=2, replace=False)
            child = self.cyclic_round(crossover(population[p1], population[p2], k, rng))
            child_step = self.stages(child)[0]
            worse = p1 if scores[p1] >= scores[p2] else p2
            if child_step <= scores[worse]:
                population[worse], scores[worse] = child, child_step
        return self.stages(population[int(np.argmin(scores))])


def dtfm_plan(cm: CostModel, seed: int = 0) -> tuple[float, Stages]:
    """DT-FM's schedule for the cost model's nodes: the best step time over D_PP = 1, 2, 4, ... up to the layer
    count, and its stages (start, end, node indices)."""
    n_layers = cm.model.n_layers
    bits = cm.boundary_bits[:-1]
    typical_bits = float(np.median(bits)) if len(bits) else 0.0
    rng = np.random.default_rng(seed)
    best: tuple[float, Stages] = (math.inf, ())
    for n_stages in (2**p for p in range(n_layers.bit_length()) if 2**p <= n_layers):
        cuts = uniform_cuts(n_layers, n_stages)
        need = max(cm.stage_memory_bytes(cuts[s], cuts[s + 1], n_stages) for s in range(n_stages))
        members = np.array([i for i in cm.usable if cm.memory[i] >= need], dtype=np.int64)
        if len(members) < n_stages:
            continue
        found = _Search(cm, members, cuts, typical_bits).run(rng)
        best = min(best, found, key=lambda x: x[0])
    return best
