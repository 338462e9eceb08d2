"""StepShape: validation, the run config's mapping, and one cost formula shared by the planner and the cost model."""

import dataclasses
import math
import random

import pytest

from geotrain.config import load_config
from geotrain.scheduler.costmodel import (
    DILOCO_WIRE_BYTES,
    EXACT_SUM_BYTES,
    CodecRatio,
    CostModel,
    Link,
    ModelProfile,
    Network,
    NodeProfile,
    StepShape,
)
from geotrain.scheduler.planner import Planner, PlannerConfig

MODEL = ModelProfile.gpt(n_layers=4, d_model=256, n_heads=4, seq_len=128, vocab=4000, microbatch_size=2)
NET = Network(
    intra_region=Link(bandwidth_bps=10e9, latency_s=1e-4),
    inter_region={("east", "west"): Link(bandwidth_bps=2e8, latency_s=0.05)},
    default_inter_region=Link(bandwidth_bps=5e7, latency_s=0.1),
)


@pytest.mark.parametrize(
    ("field", "value"),
    [("microbatches", 0), ("microbatch_size", 0), ("inflight", 0), ("allreduce", "ring"), ("replica_rank", 0),
     ("codec_ratio", 0.0), ("codec_ratio", 1.5), ("averaging_round_s", -0.1), ("commit_s", math.inf),
     ("commit_s", math.nan), ("crossing_s", -0.1)],
)
def test_shape_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match="codec ratio" if field == "codec_ratio" else field):
        StepShape(**{"microbatches": 4, "microbatch_size": 2, field: value})


def test_shape_is_frozen_and_takes_one_codec_ratio_for_every_link():
    shape = StepShape(microbatches=4, microbatch_size=2, codec_ratio=0.25)
    assert shape.codec_ratio == CodecRatio(intra_region=0.25, inter_region=0.25)
    assert shape == StepShape(microbatches=4, microbatch_size=2, codec_ratio=CodecRatio.of(0.25))
    assert hash(shape) == hash(StepShape(microbatches=4, microbatch_size=2, codec_ratio=0.25))
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.microbatches = 8


def test_from_config_maps_every_field():
    cfg = load_config(None, [
        "train.microbatches=6", "train.microbatch_size=3", "train.inflight=2", "scheduler.allreduce=hierarchical",
        "compression.replica_grads=powersgd:rank=8", "compression.activations=int8", "train.precision=bf16",
        "train.recompute=true",
    ])
    expected = dict(microbatches=6, microbatch_size=3, codec_ratio=CodecRatio(), inflight=2, allreduce="hierarchical",
                    replica_rank=8, compute_bytes=2, recompute=True, replica_sync_every=1, diloco=False,
                    sync_bytes_per_value=EXACT_SUM_BYTES, averaging_round_s=0.0, commit_s=0.0,
                    crossing_s=0.0)
    # A field added to StepShape must be added here, and to from_config.
    assert {f.name for f in dataclasses.fields(StepShape)} == set(expected)
    assert StepShape.from_config(cfg, param_shapes_known=True) == StepShape(**expected)
    # The fixed costs a run measured (scheduler.calibration) come with the config's fields.
    measured = StepShape.from_config(
        cfg, param_shapes_known=True, averaging_round_s=0.2, commit_s=0.03, crossing_s=0.01
    )
    assert measured == StepShape(**{**expected, "averaging_round_s": 0.2, "commit_s": 0.03, "crossing_s": 0.01})
    # Without the parameter shapes PowerSGD's factors cannot be sized: replicas are priced averaging raw gradients.
    assert StepShape.from_config(cfg, param_shapes_known=False) == StepShape(**{**expected, "replica_rank": None})
    diloco = load_config(None, ["compression.replica_sync=diloco", "compression.replica_sync_every=16"])
    diloco_shape = StepShape.from_config(diloco, param_shapes_known=True)
    assert (diloco_shape.replica_sync_every, diloco_shape.sync_bytes_per_value) == (16, DILOCO_WIRE_BYTES)
    assert diloco_shape.diloco


def nodes(seed, n=9):
    # Layer times proportional to FLOPs (one speed per node) route microbatches alike over every layer range, so the
    # planner's speed-weighted links are exactly the cost model's; memory fits every stage.
    rng = random.Random(seed)
    speeds = [(rng.choice(["east", "west", "south"]), rng.choice([1, 2, 5]) * 1e12) for _ in range(n)]
    return [
        NodeProfile(node_id=f"n{i}", region=region, layer_seconds=[f / speed for f in MODEL.layer_flops],
                    memory_bytes=10**12)
        for i, (region, speed) in enumerate(speeds)
    ]


SHAPES = [
    StepShape(microbatches=8, microbatch_size=2),
    StepShape(microbatches=8, microbatch_size=2, inflight=1, allreduce="flat"),
    StepShape(microbatches=16, microbatch_size=2, codec_ratio=CodecRatio(intra_region=0.5, inter_region=0.25),
              allreduce="hierarchical", replica_rank=4),
    StepShape(microbatches=1, microbatch_size=2, inflight=2),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(4))
def test_planner_prices_a_split_as_the_cost_model_does(shape, seed):
    cm = CostModel(nodes=nodes(seed), model=MODEL, network=NET, shape=shape)
    order = random.Random(seed).sample(range(9), 9)
    for n_stages in (1, 2, 3):
        groups = [order[s::n_stages] for s in range(n_stages)]
        stages, estimate = Planner(cm, PlannerConfig()).splitter.split_layers(groups)
        assert estimate == pytest.approx(cm.step_seconds(stages), rel=1e-9)
        if shape.inflight == 1 and n_stages > 1:
            # The window paces this step: a planner that left it out would price the split lower.
            unbounded = CostModel(nodes=cm.nodes, model=MODEL, network=NET, shape=dataclasses.replace(shape, inflight=None))
            assert cm.step_seconds(stages) > unbounded.step_seconds(stages)


def test_planner_keeps_exactly_the_members_the_cost_model_says_fit():
    # As many stages as layers fixes every stage's range; in each group one member has exactly the memory the cost
    # model says the stage needs and one a byte less.
    shape = StepShape(microbatches=8, microbatch_size=2)
    probe = CostModel(nodes=nodes(0, 1), model=MODEL, network=NET, shape=shape)
    n_stages = MODEL.n_layers
    need = [int(probe.stage_memory_bytes(s, s + 1, n_stages)) for s in range(n_stages)]
    members = []
    for s in range(n_stages):
        for k, memory in enumerate((10**12, need[s], need[s] - 1)):
            members.append(NodeProfile(node_id=f"s{s}m{k}", region="east", layer_seconds=probe.nodes[0].layer_seconds,
                                       memory_bytes=memory))
    cm = CostModel(nodes=members, model=MODEL, network=NET, shape=shape)
    groups = [[3 * s, 3 * s + 1, 3 * s + 2] for s in range(n_stages)]
    stages, _ = Planner(cm, PlannerConfig()).splitter.split_layers(groups)
    assert [(a, b) for a, b, _ in stages] == [(s, s + 1) for s in range(n_stages)]
    assert [list(kept) for _, _, kept in stages] == [[3 * s, 3 * s + 1] for s in range(n_stages)]
    assert cm.feasible(stages) and not cm.feasible([(a, b, [*kept, kept[0] + 2]) for a, b, kept in stages])
