"""Cost model: hand-computed step times, memory feasibility, the link matrices plans are priced with, and when a
plan's window is far enough from its estimate's to re-plan."""

import dataclasses
import math

import numpy as np
import pytest

from geotrain.config import AUTO_INFLIGHT, load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.costmodel import CodecRatio, CostModel, Link, ModelProfile, Network, NodeProfile, StepShape
from geotrain.scheduler.placement import window_changed

TINY = ModelProfile(
    layer_param_bytes=[100, 100],
    boundary_bytes=[1000, 0],
    layer_activation_bytes=[10, 10],
    layer_flops=[1.0, 1.0],
)
SLOW_NET = Network(intra_region=Link(bandwidth_bps=8000, latency_s=0.5))  # 1000 bytes/s


def node(name, seconds, memory=10**6, region="r"):
    return NodeProfile(node_id=name, region=region, layer_seconds=seconds, memory_bytes=memory)


def model_for(nodes, microbatches=4, codec_ratio=1.0, network=SLOW_NET):
    return CostModel(
        nodes=nodes, model=TINY, network=network,
        shape=StepShape(microbatches=microbatches, microbatch_size=1, codec_ratio=codec_ratio),
    )


def shape4(**kwargs):
    return StepShape(microbatches=4, microbatch_size=1, **kwargs)


def test_two_stage_pipeline_by_hand():
    cm = model_for([node("a", [0.5, 2.0]), node("b", [2.0, 0.5])])
    # Each stage 0.5 s per microbatch; the link (full duplex) is busy 1000 B / 1000 B/s = 1 s each way per
    # microbatch, the bottleneck; one microbatch's transfer there and back: 2 * (1 + 0.5) = 3 s.
    # T = (M-1) * 1 + (0.5 + 0.5) + 3 = 7.
    assert cm.step_seconds([(0, 1, [0]), (1, 2, [1])]) == pytest.approx(7.0)
    plan = cm.plan([(0, 1, [0]), (1, 2, [1])], {})
    assert plan.samples_per_s == pytest.approx(4 / 7)
    assert plan.stages[0].transfer_s == pytest.approx(4.0)
    # With 4 microbatches the fill and drain (0.5 + 0.5 + 3 s) outweighs the link's pace (3 * 1 s).
    assert plan.bottleneck.startswith("pipeline fill and drain")


def test_data_heads_window_paces_when_round_trip_is_long():
    stages = [(0, 1, [0]), (1, 2, [1])]
    nodes = [node("a", [0.5, 2.0]), node("b", [2.0, 0.5])]
    # Round trip: h = 0.5 + 0.5, x = 2 * (1 + 0.5) = 3, so 4 s. One microbatch in flight: one every 4 s, slower than
    # the link's 1 s; T = (M-1) * 4 + 4 = 16.
    one = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight=1))
    assert one.step_seconds(stages) == pytest.approx(16.0)
    assert one.plan(stages, {}).bottleneck.startswith("data heads' window: 1 microbatches in flight")
    # Four in flight: the whole step starts at once, and the window never holds one back: the unbounded step time.
    four = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight=4))
    assert four.step_seconds(stages) == pytest.approx(model_for(nodes).step_seconds(stages)) == pytest.approx(7.0)
    # Two data heads hold twice the window: the 4 microbatches go in two waves, one 4 s round trip after the first;
    # their all-reduce 2 * 1/2 * 800 / 8000 + 2 * 0.5 = 1.1.
    three = [*nodes, node("c", [0.5, 2.0])]
    cm = CostModel(nodes=three, model=TINY, network=SLOW_NET, shape=shape4(inflight=1))
    # Stage 0: c = 0.25, h = 0.5; the link term is unchanged (one pair at a time), 1 s.
    assert cm.step_seconds([(0, 1, [0, 2]), (1, 2, [1])]) == pytest.approx(4 + 4 + 1.1)
    with pytest.raises(ValueError, match="inflight"):
        CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight=0))


def test_codec_ratio_shrinks_the_bytes_term_only():
    cm = model_for([node("a", [1.0, 2.0]), node("b", [2.0, 1.0])], codec_ratio=0.5)
    # Link busy 0.5 s each way, so compute (1 s) paces; transfer 2 * (0.5 + 0.5) = 2 s; T = 3 * 1 + 2 + 2 = 7.
    assert cm.step_seconds([(0, 1, [0]), (1, 2, [1])]) == pytest.approx(7.0)
    assert model_for([node("a", [1.0, 2.0]), node("b", [2.0, 1.0])]).step_seconds(
        [(0, 1, [0]), (1, 2, [1])]
    ) == pytest.approx(3 * 1 + 2 + 3)


def test_replicas_share_by_speed_and_average_gradients():
    cm = model_for([node("fast", [0.5, 0.5]), node("slow", [1.5, 1.5])])
    # t = 1 and 3: c = 1 / (1 + 1/3) = 0.75, h = 2 * 0.75 = 1.5.
    # All-reduce: 2 (n-1)/n * 200 B * 8 / 8000 + 2 * 0.5 = 0.2 + 1 = 1.2. A lone stage fills nothing: its two
    # replicas start together, T = (4 - 2) * 0.75 + 1.5 + 1.2 (fast does 3 microbatches in 3 s, slow 1 in 3 s).
    assert cm.step_seconds([(0, 2, [0, 1])]) == pytest.approx(2 * 0.75 + 1.5 + 1.2)


def test_parallel_pairs_divide_link_occupancy():
    fast_net = Network(intra_region=Link(bandwidth_bps=8e9, latency_s=0.0))
    nodes = [node(f"n{i}", [1.0, 1.0]) for i in range(4)]
    slow = Network(intra_region=Link(bandwidth_bps=4000, latency_s=0.5))  # 500 bytes/s: 2 s each way
    one = model_for(nodes[:2], network=slow)
    two = model_for(nodes, network=slow)
    assert one.step_seconds([(0, 1, [0]), (1, 2, [1])]) == pytest.approx(3 * 2 + 2 + 2 * (2 + 0.5))
    # Two pairs: link occupancy 2 / 2 = 1 > compute 0.5; plus all-reduce 2*(1/2)*800/4000 + 2*0.5 = 1.2.
    assert two.step_seconds([(0, 1, [0, 1]), (1, 2, [2, 3])]) == pytest.approx(3 * 1.0 + 2 + 5 + 1.2)
    assert model_for(nodes, network=fast_net).step_seconds([(0, 2, [0, 1, 2, 3])]) < 5


def test_memory_infeasible_plan_is_infinite_and_small_node_unusable():
    # Stage of both layers, 50 parameters: training costs 24 B each + 20 B of activations (min(M=4, S=1)
    # microbatches) + the largest tensor's gradient in float64 (a whole 100 B layer: its shapes are not known, 200 B)
    # = 1420 B; serving a snapshot of its state costs 28 B each + 100 B = 1500 B, the peak.
    cm = model_for([node("big", [1.0, 1.0], memory=1500), node("small", [1.0, 1.0], memory=1499)])
    assert cm.stage_memory_bytes(0, 2, 1) == 1500
    assert cm.step_seconds([(0, 2, [0])]) < math.inf
    assert cm.step_seconds([(0, 2, [1])]) == math.inf
    tiny = model_for([node("tiny", [1.0, 1.0], memory=100)])
    assert tiny.usable == []


def test_state_is_counted_per_parameter_whatever_the_dtype_of_the_profile():
    # Stages keep fp32 weights, gradients, float64 sums and AdamW's fp32 moments: a parameter costs the same
    # whether the profile counts it in 2 or 4 bytes; the largest tensor is counted in fp32 either way.
    gpt = {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab": 100, "microbatch_size": 1}
    fp32, half = ModelProfile.gpt(**gpt), ModelProfile.gpt(**gpt, bytes_per_value=2)
    assert fp32.param_counts == half.param_counts and fp32.largest_tensor_bytes == half.largest_tensor_bytes
    nodes = [node("n", [1.0] * 4)]
    full = CostModel(nodes=nodes, model=fp32, network=SLOW_NET, shape=shape4())
    halved = CostModel(nodes=nodes, model=dataclasses.replace(half, layer_activation_bytes=fp32.layer_activation_bytes),
                       network=SLOW_NET, shape=shape4())
    assert full.stage_memory_bytes(0, 4, 1) == halved.stage_memory_bytes(0, 4, 1)


def test_memory_terms_by_hand():
    from geotrain.memory import serving_bytes_per_param, training_bytes_per_param

    # 4 weight + 4 gradient + 8 float64 sum + 8 AdamW; DiLoCo's anchor and velocity 8 more.
    assert (training_bytes_per_param(False), training_bytes_per_param(True)) == (24, 32)
    # After the commit (no sums): 4 + 4 + 8, and the snapshot of weights and moments 12 (DiLoCo's slots in both).
    assert (serving_bytes_per_param(False), serving_bytes_per_param(True)) == (28, 44)
    # One layer of 25 parameters in 4 shapes, the largest 10 values: training 25 x 24 + 1000 B of activations for one
    # microbatch + 80 B (the largest tensor's gradient in float64) beats serving 25 x 28 + 40 B; a baseline of 300 B
    # comes on top.
    model = ModelProfile(layer_param_bytes=[100], boundary_bytes=[0], layer_activation_bytes=[1000], layer_flops=[1.0],
                         layer_param_shapes=[[(10,), (5,), (5,), (5,)]])
    nodes = [NodeProfile(node_id="n", region="r", layer_seconds=[1.0], memory_bytes=1980, baseline_bytes=300)]
    cm = CostModel(nodes=nodes, model=model, network=SLOW_NET, shape=shape4())
    assert cm.stage_memory_bytes(0, 1, 1) == 25 * 24 + 1000 + 80 == 1680
    assert cm.usable == [0]  # 1980 - 300 = 1680 fits exactly
    assert cm.plan([(0, 1, [0])], {}).node_memory_bytes == {"n": 1980}  # unbounded search: min(M, S) = 1 in flight
    diloco = CostModel(nodes=nodes, model=model, network=SLOW_NET, shape=shape4(diloco=True))
    assert diloco.stage_memory_bytes(0, 1, 1) == 25 * 32 + 1000 + 80 and diloco.usable == []


def test_gpt_profile_shape_and_size():
    m = ModelProfile.gpt(n_layers=24, d_model=2048, n_heads=16, seq_len=1024, vocab=50257, microbatch_size=1)
    assert m.n_layers == 26
    assert 1.3e9 < sum(m.layer_param_bytes) / 4 < 1.5e9
    assert m.boundary_bytes[0] == 1024 * 2048 * 4 and m.boundary_bytes[-1] == 0
    assert [4 * sum(math.prod(shape) for shape in layer) for layer in m.layer_param_shapes] == m.layer_param_bytes


def test_link_matrices_by_hand():
    # Regions x, y, z: a (x) has a 20 Mbit/s uplink, b (x) and c (y) a measured link between them, d and e (y)
    # nothing special, f (z) only the default inter-region link.
    net = Network(
        intra_region=Link(bandwidth_bps=1e9, latency_s=0.001),
        inter_region={("y", "x"): Link(bandwidth_bps=1e8, latency_s=0.05)},
        default_inter_region=Link(bandwidth_bps=1e7, latency_s=0.1),
        node_bandwidth_bps={"a": 2e7},
        pair_overrides={("c", "b"): Link(bandwidth_bps=5e7, latency_s=0.04)},
    )
    regions = {"a": "x", "b": "x", "c": "y", "d": "y", "e": "y", "f": "z"}
    nodes = [node(name, [1.0, 1.0], region=region) for name, region in regions.items()]
    cm = CostModel(nodes=nodes, model=TINY, network=net,
                   shape=shape4(codec_ratio=CodecRatio(intra_region=1.0, inter_region=0.5)))
    # d and e see the same links, so they share a class; a (capped), b and c (measured) get classes of their own.
    assert cm.links.link_class.tolist() == [0, 1, 2, 3, 3, 4]
    g, m, w = 1e9, 1e8, 1e7
    bandwidth = [  # a    b    c    d    e    f
        [2e7, 2e7, 2e7, 2e7, 2e7, w],  # a: its cap everywhere but towards z, which is slower still
        [2e7, g, 5e7, m, m, w],  # b: the measured link to c
        [2e7, 5e7, g, g, g, w],
        [2e7, m, g, g, g, w],
        [2e7, m, g, g, g, w],
        [w, w, w, w, w, g],
    ]
    latency = [
        [1e-3, 1e-3, 0.05, 0.05, 0.05, 0.1],
        [1e-3, 1e-3, 0.04, 0.05, 0.05, 0.1],
        [0.05, 0.04, 1e-3, 1e-3, 1e-3, 0.1],
        [0.05, 0.05, 1e-3, 1e-3, 1e-3, 0.1],
        [0.05, 0.05, 1e-3, 1e-3, 1e-3, 0.1],
        [0.1, 0.1, 0.1, 0.1, 0.1, 1e-3],
    ]
    per_node = np.ix_(cm.links.link_class, cm.links.link_class)
    np.testing.assert_array_equal(cm.links.class_bw[per_node], bandwidth)
    np.testing.assert_array_equal(cm.links.class_lat[per_node], latency)
    # The inter-region codec ratio halves the bits of links between regions only.
    inter = np.not_equal.outer(list(regions.values()), list(regions.values()))
    np.testing.assert_allclose(cm.links.class_seconds_per_bit[per_node], np.where(inter, 0.5, 1.0) / np.array(bandwidth))
    # Without a default, a region pair nobody listed is an error naming it.
    with pytest.raises(ValueError, match="no link between regions 'x' and 'z'"):
        CostModel(nodes=nodes, model=TINY, network=Network(intra_region=net.intra_region, inter_region=net.inter_region),
                  shape=shape4())
    with pytest.raises(ValueError):
        Link(bandwidth_bps=0, latency_s=0)


def test_hierarchical_allreduce_by_hand():
    # Two regions of two replicas each; layer 0 holds 1600 bits of parameters, layer 1 8 bits.
    net = Network(
        intra_region=Link(bandwidth_bps=8000, latency_s=0.01),
        default_inter_region=Link(bandwidth_bps=800, latency_s=0.1),
    )
    uneven_layers = ModelProfile(
        layer_param_bytes=[200, 1], boundary_bytes=[10, 0], layer_activation_bytes=[1, 1], layer_flops=[1.0, 1.0]
    )
    nodes = [node("a1", [1, 1], region="a"), node("a2", [1, 1], region="a"),
             node("b1", [1, 1], region="b"), node("b2", [1, 1], region="b")]

    def cost_model(members, **kwargs):
        return CostModel(nodes=members, model=uneven_layers, network=net, shape=shape4(**kwargs))

    idx = np.arange(4)
    flat = 2 * 3 / 4 * 1600 / 800 + 2 * 0.1  # every replica sends 3/2 of the parameters over the slow link: 3.2 s
    # In-region all-reduce 2 * 1/2 * 1600 / 8000 + 2 * 0.01 = 0.22 s, twice (average, then share the shards); the
    # two shards of 800 bits cross in a pair each: 2 * 1/2 * 800 / 800 + 2 * 0.1 = 1.2 s.
    hierarchical = 2 * 0.22 + 1.2
    auto = cost_model(nodes)
    assert auto.sync_seconds(idx, 0, 1) == pytest.approx(hierarchical)
    assert auto.hierarchical_allreduce(idx, 0, 1)
    plan = auto.plan([(0, 1, list(idx)), (1, 2, [0])], {})
    assert plan.stages[0].hierarchical_allreduce and plan.stages[0].allreduce_s == pytest.approx(1.64)
    forced_flat = cost_model(nodes, allreduce="flat")
    assert forced_flat.sync_seconds(idx, 0, 1) == pytest.approx(flat)
    assert not forced_flat.hierarchical_allreduce(idx, 0, 1)
    # A region of one replica handles both shards: its link carries twice the share.
    uneven = [*nodes[:3], node("c1", [1, 1], region="c")]
    across = 2 * 2 / 3 * 1600 / 800 + 2 * 0.1
    assert cost_model(uneven).sync_seconds(idx, 0, 1) == pytest.approx(min(2 * 0.22 + across, flat))
    # 8 bits: the extra rounds' latency makes the flat all-reduce cheaper, and auto keeps it; arrays of ranges too.
    small = 2 * 3 / 4 * 8 / 800 + 0.2
    assert auto.sync_seconds(idx, np.array([0, 1]), np.array([1, 2])) == pytest.approx([hierarchical, small])
    assert not auto.hierarchical_allreduce(idx, 1, 2)
    # One region, or one replica per region: nothing to do hierarchically, even when asked.
    forced = cost_model(uneven, allreduce="hierarchical")
    assert forced.sync_seconds(np.array([0, 2, 3]), 0, 1) == pytest.approx(2 * 2 / 3 * 1600 / 800 + 0.2)
    assert forced.sync_seconds(idx, 1, 2) > auto.sync_seconds(idx, 1, 2)
    ranges = forced.sync_seconds(idx, np.array([0, 1]), np.array([1, 2]))
    assert ranges[1] == pytest.approx(forced.sync_seconds(idx, 1, 2)) and ranges[1] > small
    with pytest.raises(ValueError, match="allreduce"):
        cost_model(nodes, allreduce="ring")


def test_low_rank_replica_averaging_pays_two_rounds_of_factors():
    shaped = ModelProfile(
        layer_param_bytes=[4 * (64 * 32 + 32), 4 * 8],
        boundary_bytes=[10, 0],
        layer_activation_bytes=[1, 1],
        layer_flops=[1.0, 1.0],
        layer_param_shapes=[[(64, 32), (32,)], [(2, 4)]],
    )
    assert shaped.replica_sync_bytes(None) == [shaped.layer_param_bytes]
    # Rank 2: the 64 x 32 matrix sends 2 x 64 values, then 2 x 32; the bias and the 2 x 4 matrix (2 x 6 >= 8) go raw.
    assert shaped.replica_sync_bytes(2) == [[4 * (128 + 32), 4 * 8], [4 * 64, 0]]
    nodes = [node("a", [1, 1]), node("b", [1, 1])]
    cm = CostModel(nodes=nodes, model=shaped, network=SLOW_NET, shape=shape4(replica_rank=2))
    # Two all-reduces between two replicas: each 2 * 1/2 * bits / 8000 + 2 * 0.5.
    both = (4 * (128 + 32 + 8) * 8 + 4 * 64 * 8) / 8000 + 2 * 2 * 0.5
    assert cm.sync_seconds(np.arange(2), 0, 2) == pytest.approx(both)
    with pytest.raises(ValueError, match="parameter shapes"):
        CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(replica_rank=2))
    with pytest.raises(ValueError, match="replica_rank"):
        CostModel(nodes=nodes, model=shaped, network=SLOW_NET, shape=shape4(replica_rank=0))


def test_auto_window_is_the_round_trip_over_the_pace_within_memory():
    stages = [(0, 1, [0]), (1, 2, [1])]
    nodes = [node("a", [0.5, 2.0]), node("b", [2.0, 0.5])]
    # Round trip 4 s over the link's pace of 1 s with one data head: 4 in flight keep the unbounded step time, 7 s.
    plan = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight="auto")).plan(stages, {})
    assert plan.inflight == 4 and plan.step_seconds == pytest.approx(7.0)
    # A stage-0 replica (25 parameters) trains in 24 B each + its 100 B layer's gradient in float64 + 100 B per
    # microbatch in flight, and serves its state in 28 B each + 100 B = 800 B: with 1025 bytes, 2 fit, so the window is
    # 2 and paces: microbatches 2 and 3 start a 4 s round trip after 0 and 1, later than the link's 3 * 1 s would have
    # them: T = 4 + 4 = 8, and the stage reports 1000 bytes, node a as much (its baseline is 0).
    acts = dataclasses.replace(TINY, layer_activation_bytes=[100, 100])
    tight = [node("a", [0.5, 2.0], memory=1025), node("b", [2.0, 0.5])]
    plan = CostModel(nodes=tight, model=acts, network=SLOW_NET, shape=shape4(inflight="auto")).plan(stages, {})
    assert plan.inflight == 2 and plan.step_seconds == pytest.approx(8.0)
    assert plan.stages[0].memory_bytes == 1000 and plan.node_memory_bytes["a"] == 1000
    # A fixed window is the plan's window; unbounded has none.
    assert CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight=3)).plan(stages, {}).inflight == 3
    assert model_for(nodes).plan(stages, {}).inflight is None
    with pytest.raises(ValueError, match="inflight"):
        shape4(inflight="some")


def test_a_running_plan_is_priced_at_its_own_window():
    # The plan was made with 1 microbatch in flight (before profiles priced it); its estimate is the window's 16 s
    # (test_data_heads_window_paces_when_round_trip_is_long), while "auto" would now choose 4 and 7 s.
    stages = [(0, 1, [0]), (1, 2, [1])]
    nodes = [node("a", [0.5, 2.0]), node("b", [2.0, 0.5])]
    running = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight="auto")).plan(stages, {}, 1)
    assert (running.inflight, running.chosen_inflight) == (1, 4)
    assert running.step_seconds == pytest.approx(16.0)


def test_the_live_all_reduce_is_priced_at_the_bytes_it_sends():
    # A run's replicas all-reduce float64 sums (8 bytes a value, twice fp32's), or int16 under diloco.
    assert StepShape.from_config(load_config(None, []), param_shapes_known=True).sync_bytes_per_value == 8
    diloco = load_config(None, ["compression.replica_sync=diloco"])
    assert StepShape.from_config(diloco, param_shapes_known=True).sync_bytes_per_value == 2
    assert TINY.replica_sync_bytes(None, 8) == [[200, 200]]
    nodes = [node("a", [1, 1]), node("b", [1, 1])]
    seconds = {
        wire: CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(sync_bytes_per_value=wire))
        .sync_seconds(np.arange(2), 0, 2)
        for wire in (None, 8)
    }
    # Two replicas: 2 * 1/2 * bits / 8000 + 2 * 0.5.
    assert seconds[None] == pytest.approx(200 * 8 / 8000 + 1) and seconds[8] == pytest.approx(400 * 8 / 8000 + 1)
    with pytest.raises(ValueError, match="sync_bytes_per_value"):
        shape4(sync_bytes_per_value=3)


def test_a_plan_whose_window_is_below_its_estimates_need_is_replanned():
    # The plan's window came from the profiles it had; links measured since give the estimate another (4, above).
    stages = [(0, 1, [0]), (1, 2, [1])]
    nodes = [node("a", [0.5, 2.0]), node("b", [2.0, 0.5])]
    estimate = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight="auto")).plan(stages, {})
    auto = load_config(None, [])
    assert estimate.inflight == 4 and auto.train.inflight == AUTO_INFLIGHT
    assert window_changed(auto, pb.Plan(inflight=3), estimate)  # a quarter short: the links idle
    assert not window_changed(auto, pb.Plan(inflight=4), estimate)
    # Above the need a window costs memory only, and memory holds it: it stays.
    assert not window_changed(auto, pb.Plan(inflight=8), estimate)
    # A window a twentieth short or less stays: a need just above a whole number rounds up, and in-run measurements
    # that move the need across 2.0 and back do not flip the plan between 2 and 3.
    assert estimate.window_need == pytest.approx(4.0)
    near = dataclasses.replace(estimate, chosen_inflight=3, window_need=2.01)
    assert not window_changed(auto, pb.Plan(inflight=2), near)
    assert window_changed(auto, pb.Plan(inflight=2), dataclasses.replace(near, window_need=2.6))
    below = dataclasses.replace(estimate, chosen_inflight=2, window_need=1.9)  # and back under 2.0
    assert not window_changed(auto, pb.Plan(inflight=3), below)
    # A window memory lowered is kept to, however close the need.
    assert window_changed(auto, pb.Plan(inflight=3), dataclasses.replace(below, chosen_inflight=1))
    # A fixed window stays, and so does any window before profiles price the plan.
    assert not window_changed(load_config(None, ["train.inflight=3"]), pb.Plan(inflight=3), estimate)
    assert not window_changed(auto, pb.Plan(inflight=3), None)


def test_a_link_between_two_nodes_nobody_can_dial_is_priced_through_a_relay():
    stages = [(0, 1, [0]), (1, 2, [1])]
    a, b = node("a", [0.5, 2.0]), node("b", [2.0, 0.5])
    behind = [NodeProfile(node_id=n.node_id, region=n.region, layer_seconds=n.layer_seconds,
                          memory_bytes=n.memory_bytes, unreachable=True) for n in (a, b)]
    # One end behind NAT runs over a reversed link, as fast as a direct one: 7 s as by hand above.
    assert model_for([behind[0], b]).step_seconds(stages) == pytest.approx(7.0)
    # Both: the relay receives and sends every byte, so the link is busy 2 s each way per microbatch and its latency
    # is paid once per hop: T = (M-1) * 2 + (0.5 + 0.5) + 2 * (2 + 2 * 0.5) = 13.
    assert model_for(behind).step_seconds(stages) == pytest.approx(13.0)


def test_a_sync_every_h_steps_is_priced_once_per_h_steps():
    cms = {h: CostModel(nodes=[node("a", [0.5, 0.5]), node("b", [0.5, 0.5])], model=TINY,
                        network=SLOW_NET, shape=shape4(replica_sync_every=h)) for h in (1, 32)}
    seconds = {h: cm.sync_seconds(np.arange(2), 0, 2) for h, cm in cms.items()}
    assert seconds[1] > 0 and seconds[32] == pytest.approx(seconds[1] / 32)
    with pytest.raises(ValueError, match="replica_sync_every"):
        shape4(replica_sync_every=0)


def test_measured_fixed_costs_are_priced_per_round_and_per_step():
    # A run measured 0.2 s per hivemind round beyond the bytes, and 0.05 s of commit per step (scheduler.calibration).
    nodes = [node("a", [1, 1]), node("b", [1, 1])]
    both = [(0, 1, [0, 1]), (1, 2, [0])]
    plain = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4())
    measured = CostModel(nodes=nodes, model=TINY, network=SLOW_NET,
                         shape=shape4(averaging_round_s=0.2, commit_s=0.05))
    pair = np.arange(2)
    assert measured.sync_seconds(pair, 0, 1) == pytest.approx(plain.sync_seconds(pair, 0, 1) + 0.2)
    assert measured.sync_seconds(np.array([0]), 0, 1) == 0.0  # one replica averages with nobody
    assert measured.step_seconds(both) == pytest.approx(plain.step_seconds(both) + 0.2 + 0.05)
    rounds = [s.allreduce_rounds for s in measured.plan(both, {}).stages]
    assert rounds == [1, 0]
    # PowerSGD's two rounds pay it twice; a hierarchical all-reduce runs three rounds.
    shaped = ModelProfile(layer_param_bytes=[400, 400], boundary_bytes=[10, 0], layer_activation_bytes=[1, 1],
                          layer_flops=[1.0, 1.0], layer_param_shapes=[[(10, 10)], [(10, 10)]])
    low_rank = {s: CostModel(nodes=nodes, model=shaped, network=SLOW_NET,
                             shape=shape4(replica_rank=1, averaging_round_s=s)) for s in (0.0, 0.2)}
    assert low_rank[0.2].sync_seconds(pair, 0, 1) == pytest.approx(low_rank[0.0].sync_seconds(pair, 0, 1) + 0.4)
    assert low_rank[0.2].plan(both, {}).stages[0].allreduce_rounds == 2
    regions = [node("a1", [1, 1], region="a"), node("a2", [1, 1], region="a"), node("b1", [1, 1], region="b")]
    net = Network(intra_region=Link(bandwidth_bps=8000, latency_s=0.01),
                  default_inter_region=Link(bandwidth_bps=800, latency_s=0.1))
    forced = {s: CostModel(nodes=regions, model=TINY, network=net,
                           shape=shape4(allreduce="hierarchical", averaging_round_s=s)) for s in (0.0, 0.2)}
    trio = np.arange(3)
    assert forced[0.2].sync_seconds(trio, 0, 1) == pytest.approx(forced[0.0].sync_seconds(trio, 0, 1) + 3 * 0.2)
    assert forced[0.2].plan([(0, 1, [0, 1, 2]), (1, 2, [0])], {}).stages[0].allreduce_rounds == 3


def test_a_measured_crossing_cost_lengthens_the_round_trip_and_the_window_it_needs():
    # By hand (test_auto_window_is_the_round_trip_over_the_pace_within_memory): a 4 s round trip over a 1 s pace,
    # 4 in flight, 7 s a step. A run measured 0.25 s a crossing beyond bytes and latency: two crossings a round
    # trip (activations there, gradients back), so 4.5 s; the fill is as long, T = 3 * 1 + 4.5 = 7.5; 4.5 in flight.
    stages = [(0, 1, [0]), (1, 2, [1])]
    nodes = [node("a", [0.5, 2.0]), node("b", [2.0, 0.5])]
    plain = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight="auto")).plan(stages, {})
    assert plain.round_trip_s == pytest.approx(4.0)
    crossing = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(inflight="auto", crossing_s=0.25))
    plan = crossing.plan(stages, {})
    assert plan.round_trip_s == pytest.approx(4.5) and plan.step_seconds == pytest.approx(7.5)
    assert plan.window_need == pytest.approx(4.5) and plan.inflight == 4  # M = 4: the whole step is in flight
    # A single stage crosses no boundary.
    alone = CostModel(nodes=nodes, model=TINY, network=SLOW_NET, shape=shape4(crossing_s=0.25))
    assert alone.step_seconds([(0, 2, [0])]) == pytest.approx(model_for(nodes).step_seconds([(0, 2, [0])]))
