"""bench/dtfm.py, DT-FM's scheduler as the planner benchmark's peer: balanced partitions stay balanced through the
genetic algorithm's crossover and its cyclic-partitioning round, the round lowers the groups' pairwise costs, the
pipeline path is the cheapest, and on two regions joined by a slow link the search finds DT-FM's answer (each
data-parallel group inside a region, the pipeline crossing the slow link once). (The benchmark itself is not run.)"""

from __future__ import annotations

import importlib.util
import itertools
import sys

import numpy as np
import pytest

from geotrain.scheduler.costmodel import CostModel, Link, ModelProfile, Network, NodeProfile, StepShape
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)

_spec = importlib.util.spec_from_file_location("bench_dtfm", REPO / "bench" / "dtfm.py")
dtfm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = dtfm  # dataclasses look their module up there
_spec.loader.exec_module(dtfm)


@pytest.mark.parametrize(("n", "k"), [(16, 4), (10, 3), (7, 7), (5, 1)])
def test_balanced_partition_and_crossover_keep_group_sizes(n, k):
    rng = np.random.default_rng(n * k)
    sizes = np.bincount(dtfm.balanced_labels(n, k, rng), minlength=k)
    assert sizes.sum() == n and sizes.max() - sizes.min() <= 1
    for _ in range(20):
        p1, p2 = dtfm.balanced_labels(n, k, rng), dtfm.balanced_labels(n, k, rng)
        child = dtfm.crossover(p1, p2, k, rng)
        assert np.array_equal(np.bincount(child, minlength=k), np.bincount(p2, minlength=k))
        # Five points come from the first parent; the rebalancing moves at most as many items again.
        assert np.sum(child != p2) <= 2 * dtfm.CROSSOVER_POINTS
        assert np.array_equal(dtfm.crossover(p1, p1, k, rng), p1)


def _path_length(cost, path):
    return sum(cost[a, b] for a, b in zip(path[:-1], path[1:]))


@pytest.mark.parametrize("seed", range(4))
def test_open_path_is_the_cheapest(seed):
    rng = np.random.default_rng(seed)
    points = rng.random((dtfm.EXACT_PATH_GROUPS, 2))
    cost = np.linalg.norm(points[:, None] - points[None], axis=-1)
    best = min(_path_length(cost, p) for p in itertools.permutations(range(len(cost))))
    path = dtfm.open_path(cost)
    assert sorted(path) == list(range(len(cost)))
    assert _path_length(cost, path) == pytest.approx(best)


def test_open_path_above_exact_size_finds_a_line():
    # Points on a line, shuffled: the cheapest open path visits them in order, its length the line's span.
    rng = np.random.default_rng(0)
    x = rng.permutation(np.arange(16, dtype=float) ** 1.5)
    cost = np.abs(x[:, None] - x[None])
    path = dtfm.open_path(cost)
    assert sorted(path) == list(range(16))
    assert _path_length(cost, path) == pytest.approx(x.max() - x.min())


def _two_regions(n_nodes, regions=("east", "west")):
    model = ModelProfile.gpt(n_layers=4, d_model=512, n_heads=8, seq_len=256, vocab=8000, microbatch_size=2)
    nodes = [
        NodeProfile(
            node_id=f"n{i}",
            region=regions[i % len(regions)],
            layer_seconds=[f / 4e12 for f in model.layer_flops],
            memory_bytes=8 * 10**9,
        )
        for i in range(n_nodes)
    ]
    network = Network(
        intra_region=Link(bandwidth_bps=10e9, latency_s=1e-4),
        inter_region={pair: Link(bandwidth_bps=2e8, latency_s=0.05) for pair in itertools.combinations(regions, 2)},
    )
    return CostModel(nodes=nodes, model=model, network=network, shape=StepShape(microbatches=32, microbatch_size=2))


def _pair_cost_inside_groups(search, labels):
    cost = search.pair_cost[np.ix_(search.member_class, search.member_class)]
    return float(np.sum(cost * (labels[:, None] == labels[None, :])) - np.trace(cost))


@pytest.mark.parametrize(("n", "k"), [(24, 4), (25, 3), (12, 6)])
def test_cyclic_round_keeps_sizes_and_lowers_pair_costs(n, k):
    cm = _two_regions(n, regions=("east", "west", "north"))
    search = dtfm._Search(cm, np.arange(n), dtfm.uniform_cuts(4, min(k, 4)) if k <= 4 else list(range(k + 1)), 1e6)
    rng = np.random.default_rng(n)
    lowered = 0
    for _ in range(10):
        labels = dtfm.balanced_labels(n, k, rng)
        moved = search.cyclic_round(labels)
        assert np.array_equal(np.bincount(moved, minlength=k), np.bincount(labels, minlength=k))
        before, after = _pair_cost_inside_groups(search, labels), _pair_cost_inside_groups(search, moved)
        assert after <= before
        lowered += after < before
        # At most as many swaps as groups: each moves two devices.
        assert np.sum(moved != labels) <= 2 * k
    assert lowered >= 5  # random groups mix regions; a round moves devices towards their own region's group


def test_two_regions_give_one_group_per_region_and_one_crossing(monkeypatch):
    # A smaller budget than DT-FM's finds this answer too, in a fraction of the time.
    monkeypatch.setattr(dtfm, "POPULATION", 16)
    monkeypatch.setattr(dtfm, "OFFSPRING", 64)
    cm = _two_regions(8)
    nodes, model = cm.nodes, cm.model
    step, stages = dtfm.dtfm_plan(cm, seed=0)
    assert step == cm.step_seconds(stages)
    regions = [{nodes[i].region for i in group} for _, _, group in stages]
    assert len(stages) >= 2 and all(len(r) == 1 for r in regions)
    assert sum(a != b for a, b in zip(regions[:-1], regions[1:])) == 1
    sizes = [len(group) for _, _, group in stages]
    assert max(sizes) - min(sizes) <= 1
    assert [a for a, _, _ in stages] + [stages[-1][1]] == dtfm.uniform_cuts(model.n_layers, len(stages))
