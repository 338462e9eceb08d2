"""Planner benchmark: geotrain's planner against DT-FM's scheduler, simple strategies and the compute bound.

Prints one JSON line per (scenario, nodes, strategy): scenario, nodes, multi_region, strategy, samples_per_s,
ratio_to_bound, plan_seconds, replica_grads, microbatches. Nothing else goes to stdout. Run: python bench/planner.py
[--replica-rank R] [--scenarios a,b] [--sizes 16,64] [--strategies dtfm,uniform] [--microbatches-per-node K].

Model: GPT with 24 blocks, d_model 2048, 16 heads, seq 1024, vocab 50257 (1.42B parameters, head untied),
microbatches of 1 sequence, 16 microbatches per node per step (the global batch grows with the cluster;
--microbatches-per-node sets another).
Devices sustain 40% of their published peak (geotrain.scheduler.cluster.DEVICES). Those peaks are fp16/bf16 tensor
core figures, so the nodes that run at them train in mixed precision: activations, their gradients and the
gradients replicas average are 16-bit on the wire (bytes_per_value=2), and each parameter still costs 16 bytes of
memory (fp32 master copy and moments). The live system trains in fp32 (bytes_per_value=4); nothing here changes it.
The data heads' window (train.inflight) is left unbounded: the bench plans the global batch as one pipeline fill,
as the issue's goals are stated.

Strategies, all scored by the same CostModel:
- uniform: equal layer counts per stage, nodes in join order (a seeded shuffle) dealt round-robin to stages.
- proportional: the same node deal, layer cuts proportional to each stage's total compute (links ignored).
- uniform_fixed_stages, proportional_fixed_stages: the same, at the stage count geotrain's plan chose (DT-FM's
  baselines keep the stage count fixed).
- dtfm: DT-FM's scheduler (bench/dtfm.py, whose docstring names what it simplifies): balanced data-parallel groups
  searched by its genetic algorithm, the pipeline order as the cheapest open path over the groups, equal layers.
- geotrain: geotrain.scheduler.planner.
- bound: the compute bound, every node's full-model speed summed, no communication.
uniform and proportional get every stage count from 1 to the layer count and keep the one the cost model likes
best, and drop a node whose memory cannot hold its stage: the most generous honest reading of them.
--strategies names which of them run (empty: geotrain and bound only, e.g. --sizes 4096 --strategies "").

Measured (issue 19, part 4; all 36 scenario x size pairs, every strategy, raw averaging, one run under the CPU lock
on 2 December; dtfm at DT-FM's own budget, GCMA(population_size=100, trails=4900) per D_PP, see bench/dtfm.py). That
run found geotrain 0.03% below dtfm in dtfm_regional 16 (41.444 samples/s against 41.455); the planner then also
chained the regions by the links that pace the step, and four_regions_wan, dtfm_two_universities and dtfm_regional
were planned again (every strategy but dtfm, whose lines are the run's; sizes 16-1024 and 4,096), so their geotrain
figures below are from that second run:
- samples/s, geotrain over dtfm: 1.06-1.12 homogeneous_datacenter, 1.01-1.16 mixed_one_region, 1.06-1.41
  four_regions_wan, 3.86-7.12 volunteers_worldwide, 1.00-1.45 dtfm_datacenter (64: the same samples/s), 1.11-1.24
  dtfm_spot, 1.14-1.42 dtfm_two_universities, 1.006-1.40 dtfm_regional, 1.23-1.97 dtfm_worldwide; min 1.000, median
  1.174, max 7.12; the median over the 20 multi-region pairs is 1.40. geotrain is at or above every other strategy in
  all 36 pairs. At the full budget dtfm gains most where its old search was short (four_regions_wan 64: 169.4
  against 89.2 before, dtfm_worldwide 16: 27.5 against 20.6, dtfm_regional 16: 41.46 against 36.40); geotrain's
  samples/s are those of the earlier runs or above (volunteers_worldwide 64: 12.10 against 11.69, dtfm_regional 16:
  41.69 against 41.44).
- plan time, geotrain over dtfm: 0.008-0.077, median 0.022, a tenth or less in every pair. The worst is
  volunteers_worldwide 64 (5.46 s against 70.5 s), then 0.062 at volunteers_worldwide 256 (4.16 s against 67.5 s);
  by scenario the largest ratio is 0.021 homogeneous_datacenter, 0.051 mixed_one_region, 0.025 four_regions_wan,
  0.077 volunteers_worldwide, 0.033 dtfm_datacenter, 0.027 dtfm_spot, 0.025 dtfm_two_universities, 0.058
  dtfm_regional, 0.044 dtfm_worldwide. dtfm plans a pair in 31.5-148.7 s (dtfm_spot 1024 the longest), geotrain in
  0.31-5.46 s.
- 4,096 nodes (--sizes 4096 --strategies ""; the three re-planned scenarios from the second run): every scenario
  plans in 2.1-7.2 s, dtfm_spot 7.20 s, volunteers_worldwide 6.30 s, dtfm_regional 4.05 s, mixed_one_region 3.22 s.
How the plan time came down (earlier runs, dtfm at a budget of 465 scorings per D_PP): 0.13-3.0x dtfm's at first;
0.12-2.3x once the cost model read the default link and the few class pairs that differ from it; 0.09-1.39x (median
0.375) with memos in the cost model and the planner and a stage-count sweep that stops where it stops paying. Then
the planner's local search went on from its last improving node move instead of rescanning from the first node every
pass: volunteers_worldwide 64, 64 nodes in 7-9 stages where single nodes move, scored some 24,000 plans in 7.4 s, and
now plans in 5.5 s.

Replica averaging: raw gradients by default, flat or hierarchical per stage, whichever the cost model prices lower
(hierarchical: average inside each instance or region, all-reduce one shard per replica across them, share the
shards again; node.averaging). --replica-rank R prices PowerSGD factors of rank R instead
(compression.replica_grads = "powersgd:rank=R"); every line names its replica_grads. PowerSGD's local work (two
thin matmuls per matrix, the Gram-Schmidt of P) is not in the cost model.

Where raw averaging caps dtfm_datacenter and dtfm_spot (M = 16 x nodes, so the bound's step is 2.775 s at every
size; V100: a block 6.70 ms, the head 12.65 ms per microbatch; 16-bit gradients: a block 0.806 Gbit, the head
1.647 Gbit; the fill is at least one node's whole-model time, 0.173 s; 0.8 of the bound needs T <= 3.469 s):
- dtfm_datacenter: stages of whole 8-GPU instances cannot balance 24 blocks and the head (an instance holds at most
  3 blocks faster than 3.35 ms per microbatch), so the pace is about 3.0 s, and a stage spanning 2 or more instances
  all-reduces hierarchically: at least 2 x 2 (7/8) P / 100 Gbit/s in the instances and 2 (m-1)/m P/8 / 3.125 Gbit/s
  across, 0.43 s for 7 blocks over 2 instances, 0.59 s over 8.
- dtfm_spot: a standalone GPU alone in its stage puts 26.8 ms per microbatch on a single pair (33.6 Mbit at 1.25
  Gbit/s), a pace of >= (M-1) x 26.8 ms; sharing a stage puts that stage's all-reduce on 1.25 Gbit/s, >= 0.806 / 1.25
  = 0.64 s, with no instance to share it; leaving all of them out forgoes half the compute. So at most 2.77 / (2.77 +
  0.17 + 0.64) = 0.77 of the bound.
PowerSGD at rank 4 shrinks a block's averaging from 0.806 Gbit to about 1/300 of it, and plain data parallelism
over every node becomes the best plan in both.

So no one setting meets both of the issue's goals, "0.8 of the bound in every single-region scenario" and "1.5x the
better simple strategy in every multi-region one". Whatever makes averaging cheap enough for the first (PowerSGD, or
a larger batch per step) makes data parallelism good, and the simple strategies, which may pick one stage, get it
too: at rank 4 they reach 0.895 of the bound in dtfm_two_universities and 0.802 in dtfm_regional at every size, so
1.5x of them would be above the bound. With --microbatches-per-node 128, dtfm_spot reaches 0.75 and the
multi-region scenarios fall to 1.04-1.17x.

Network figures of the DT-FM scenarios (datacenter, spot, two universities, regional, worldwide) are DT-FM's
(Yuan et al., "Decentralized Training of Foundation Models in Heterogeneous Environments", NeurIPS 2022), copied
into bench/scenarios/dtfm.json; they are run on V100-32G nodes, scaled to each size keeping the group shapes.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import numpy as np
from dtfm import dtfm_plan, uniform_cuts

from geotrain.scheduler.cluster import DEVICES, layer_seconds_from_tflops
from geotrain.scheduler.costmodel import CostModel, Link, ModelProfile, Network, NodeProfile, StepShape
from geotrain.scheduler.planner import plan

logger = logging.getLogger(__name__)

SIZES = (16, 64, 256, 1024)
SEED = 0
EFFICIENCY = 0.4
MICROBATCHES_PER_NODE = 16
MODEL = dict(n_layers=24, d_model=2048, n_heads=16, seq_len=1024, vocab=50257, microbatch_size=1, bytes_per_value=2)
DTFM = json.loads((Path(__file__).parent / "scenarios" / "dtfm.json").read_text())
MIXED_GPUS = ["A100-80G", "A100-40G", "V100-32G", "A10G", "L4", "T4", "RTX-4090"]
VOLUNTEER_DEVICES = ["RTX-4090", "RTX-3090", "RTX-3090", "RTX-3060", "RTX-3060", "Apple-M2-Pro-GPU", "laptop-CPU-8-core"]
VOLUNTEER_UPLINK_MBPS = [20, 50, 100, 200, 500]
WAN_REGIONS = ["Virginia", "Oregon", "Ireland", "Tokyo"]

STRATEGIES = ("uniform", "proportional", "uniform_fixed_stages", "proportional_fixed_stages", "dtfm")
Scenario = Callable[[int, ModelProfile], tuple[list[NodeProfile], Network]]


def _link(figures: dict) -> Link:
    return Link(bandwidth_bps=figures["bandwidth_gbps"] * 1e9, latency_s=figures["delay_ms"] / 1e3)


def _aws_pairs(regions: list[str]) -> dict[tuple[str, str], Link]:
    pairs = {}
    for key, figures in DTFM["aws_region_pairs"].items():
        a, b = key.split("-")
        if a in regions and b in regions:
            pairs[(a, b)] = _link(figures)
    return pairs


def _node(name: str, region: str, device: str, model: ModelProfile) -> NodeProfile:
    tflops, memory_gb = DEVICES[device]
    return NodeProfile(
        node_id=name,
        region=region,
        layer_seconds=layer_seconds_from_tflops(model, tflops, EFFICIENCY),
        memory_bytes=int(memory_gb * 1e9),
    )


def _spread(n: int, regions: list[str], devices: list[str], model: ModelProfile) -> list[NodeProfile]:
    rng = random.Random(SEED)
    return [_node(f"n{i:04d}", regions[i % len(regions)], rng.choice(devices), model) for i in range(n)]


def homogeneous_datacenter(n: int, model: ModelProfile) -> tuple[list[NodeProfile], Network]:
    """A100-80G nodes on a 100 Gbit/s fabric."""
    return _spread(n, ["dc"], ["A100-80G"], model), Network(intra_region=Link(bandwidth_bps=100e9, latency_s=1e-5))


def mixed_one_region(n: int, model: ModelProfile) -> tuple[list[NodeProfile], Network]:
    """Seven GPU kinds in one cloud region on 25 Gbit/s."""
    return _spread(n, ["us-east-1"], MIXED_GPUS, model), Network(intra_region=Link(bandwidth_bps=25e9, latency_s=2e-4))


def four_regions_wan(n: int, model: ModelProfile) -> tuple[list[NodeProfile], Network]:
    """The mixed GPUs spread over four AWS regions, with DT-FM's measured region-pair links."""
    net = Network(intra_region=Link(bandwidth_bps=10e9, latency_s=1e-3), inter_region=_aws_pairs(WAN_REGIONS))
    return _spread(n, WAN_REGIONS, MIXED_GPUS, model), net


def volunteers(n: int, model: ModelProfile) -> tuple[list[NodeProfile], Network]:
    """Consumer GPUs and laptops in eight regions, each behind a 20-500 Mbit/s uplink."""
    regions = list(DTFM["scenarios"]["worldwide"]["regions"])
    nodes = _spread(n, regions, VOLUNTEER_DEVICES, model)
    rng = random.Random(SEED + 1)
    uplinks = {node.node_id: rng.choice(VOLUNTEER_UPLINK_MBPS) * 1e6 for node in nodes}
    net = Network(
        intra_region=Link(bandwidth_bps=1e9, latency_s=0.02),
        inter_region=_aws_pairs(regions),
        node_bandwidth_bps=uplinks,
    )
    return nodes, net


def _v100s(n: int, region_of: Callable[[int], str], model: ModelProfile) -> list[NodeProfile]:
    return [_node(f"n{i:04d}", region_of(i), "V100-32G", model) for i in range(n)]


def dtfm_datacenter(n: int, model: ModelProfile) -> tuple[list[NodeProfile], Network]:
    """DT-FM case 1: instances of 8 GPUs, 100 Gbit/s inside, 3.125 Gbit/s between."""
    sc = DTFM["scenarios"]["datacenter"]
    net = Network(intra_region=_link(sc["intra_group"]), default_inter_region=_link(sc["inter_group"]))
    return _v100s(n, lambda i: f"instance{i // 8:03d}", model), net


def dtfm_spot(n: int, model: ModelProfile) -> tuple[list[NodeProfile], Network]:
    """DT-FM case 2: half the GPUs in 4-GPU spot instances, half standalone, 1.25 Gbit/s between machines."""
    sc = DTFM["scenarios"]["spot"]
    net = Network(intra_region=_link(sc["intra_group"]), default_inter_region=_link(sc["inter_group"]))
    return _v100s(n, lambda i: f"spot{i // 4:03d}" if i < n // 2 else f"single{i:04d}", model), net


def _dtfm_regions(name: str, pairs: dict[tuple[str, str], Link]) -> Scenario:
    sc = DTFM["scenarios"][name]
    regions = list(sc["regions"])

    def build(n: int, model: ModelProfile) -> tuple[list[NodeProfile], Network]:
        net = Network(intra_region=_link(sc["intra_region"]), inter_region=pairs)
        return _v100s(n, lambda i: regions[i * len(regions) // n], model), net

    build.__doc__ = f"DT-FM case {name}: {', '.join(regions)}."
    return build


def _regional_pairs() -> dict[tuple[str, str], Link]:
    return {tuple(k.split("-")): _link(v) for k, v in DTFM["scenarios"]["regional"]["inter_region_pairs"].items()}


SCENARIOS: dict[str, tuple[Scenario, bool]] = {
    "homogeneous_datacenter": (homogeneous_datacenter, False),
    "mixed_one_region": (mixed_one_region, False),
    "four_regions_wan": (four_regions_wan, True),
    "volunteers_worldwide": (volunteers, True),
    "dtfm_datacenter": (dtfm_datacenter, False),
    "dtfm_spot": (dtfm_spot, False),
    "dtfm_two_universities": (_dtfm_regions("two_universities", _aws_pairs(["Ohio", "Virginia"])), True),
    "dtfm_regional": (_dtfm_regions("regional", _regional_pairs()), True),
    "dtfm_worldwide": (_dtfm_regions("worldwide", _aws_pairs(list(DTFM["scenarios"]["worldwide"]["regions"]))), True),
}


def _uniform_cuts(cm: CostModel, n_stages: int, _groups: list[list[int]]) -> list[int]:
    return uniform_cuts(cm.model.n_layers, n_stages)


def _proportional_cuts(cm: CostModel, n_stages: int, groups: list[list[int]]) -> list[int]:
    rates = np.array([np.sum(1.0 / cm.prefix_seconds[g, -1]) for g in groups])
    work = np.cumsum(cm.model.layer_flops) / np.sum(cm.model.layer_flops)
    targets = np.cumsum(rates) / rates.sum()
    cuts = [0]
    for s in range(n_stages - 1):
        # Leave at least one layer for each stage still to come.
        lo, hi = cuts[-1] + 1, cm.model.n_layers - (n_stages - 1 - s)
        cuts.append(int(np.clip(np.argmin(np.abs(work - targets[s])) + 1, lo, hi)))
    return cuts + [cm.model.n_layers]


def simple_strategy(cm: CostModel, cuts_for: Callable, stage_counts: Iterable[int]) -> float:
    """Best step time over the given stage counts of a round-robin deal of shuffled nodes with the given layer cuts."""
    order = list(range(len(cm.nodes)))
    random.Random(SEED).shuffle(order)
    best = float("inf")
    for n_stages in stage_counts:
        groups = [order[s::n_stages] for s in range(n_stages)]
        cuts = cuts_for(cm, n_stages, groups)
        stages = []
        for s, g in enumerate(groups):
            need = cm.stage_memory_bytes(cuts[s], cuts[s + 1], n_stages)
            stages.append((cuts[s], cuts[s + 1], [i for i in g if cm.memory[i] >= need]))
        best = min(best, cm.step_seconds(stages))
    return best


def _timed(f: Callable, *args, **kwargs) -> tuple:
    """f's result and the seconds it took."""
    t0 = time.perf_counter()
    result = f(*args, **kwargs)
    return result, time.perf_counter() - t0


def run(replica_rank: int | None, strategies: Collection[str]) -> None:
    """Run every scenario, size and strategy; one JSON line each. replica_rank: replicas average PowerSGD factors of
    that rank (compression.replica_grads = "powersgd:rank=R"), None: raw gradients. geotrain plans always (the
    fixed-stage strategies take its stage count); the others run where named in strategies."""
    replica_grads = "none" if replica_rank is None else f"powersgd:rank={replica_rank}"
    for name, (build, multi_region) in SCENARIOS.items():
        for n in SIZES:
            model = ModelProfile.gpt(**MODEL)
            nodes, network = build(n, model)
            shape = StepShape(
                microbatches=MICROBATCHES_PER_NODE * n, microbatch_size=MODEL["microbatch_size"], replica_rank=replica_rank
            )
            cm = CostModel(nodes=nodes, model=model, network=network, shape=shape)
            bound = cm.compute_bound(cm.usable)
            samples_per_step = shape.microbatches * shape.microbatch_size
            every_count = range(1, min(cm.model.n_layers, len(cm.nodes)) + 1)
            steps = {}
            ours, seconds = _timed(plan, nodes=nodes, model=model, network=network, shape=shape)
            own_count = [len(ours.stages)]
            for strategy, cuts_for, counts in (
                ("uniform", _uniform_cuts, every_count),
                ("proportional", _proportional_cuts, every_count),
                ("uniform_fixed_stages", _uniform_cuts, own_count),
                ("proportional_fixed_stages", _proportional_cuts, own_count),
            ):
                if strategy in strategies:
                    steps[strategy] = _timed(simple_strategy, cm, cuts_for, counts)
            if "dtfm" in strategies:
                # A cost model of its own, as the planner builds one: neither starts from the other's memos.
                (step, _), dtfm_seconds = _timed(
                    lambda: dtfm_plan(CostModel(nodes=nodes, model=model, network=network, shape=shape), SEED)
                )
                steps["dtfm"] = (step, dtfm_seconds)
            steps["geotrain"] = (ours.step_seconds, seconds)
            results = {k: (samples_per_step / step, seconds) for k, (step, seconds) in steps.items()}
            results["bound"] = (bound, 0.0)
            for strategy, (samples_per_s, seconds) in results.items():
                line = dict(
                    scenario=name,
                    nodes=n,
                    multi_region=multi_region,
                    strategy=strategy,
                    samples_per_s=round(samples_per_s, 3),
                    ratio_to_bound=round(samples_per_s / bound, 4),
                    plan_seconds=round(seconds, 3),
                    replica_grads=replica_grads,
                    microbatches=shape.microbatches,
                )
                sys.stdout.write(json.dumps(line) + "\n")
                sys.stdout.flush()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--replica-rank", type=int, default=None, help="replicas average PowerSGD factors of this rank (default: raw)"
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated scenario names")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated node counts")
    parser.add_argument(
        "--microbatches-per-node",
        type=int,
        default=MICROBATCHES_PER_NODE,
        help=f"global batch in microbatches per node (default {MICROBATCHES_PER_NODE})",
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated strategies besides geotrain and bound (empty: none)"
    )
    args = parser.parse_args()
    strategies = {s for s in args.strategies.split(",") if s}
    if strategies - set(STRATEGIES):
        parser.error(f"unknown strategies: {', '.join(sorted(strategies - set(STRATEGIES)))}")
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    SCENARIOS = {k: SCENARIOS[k] for k in args.scenarios.split(",")}
    SIZES = tuple(int(x) for x in args.sizes.split(","))
    MICROBATCHES_PER_NODE = args.microbatches_per_node
    run(args.replica_rank, strategies)
