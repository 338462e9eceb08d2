"""The compression policy: codec choice, hysteresis, link and compute estimates, config checks, per-link state."""

from __future__ import annotations

import grpc
import pytest
import torch

from geotrain.compression import CodecError, get_codec
from geotrain.compression.policy import (
    CodecPolicy,
    LinkEstimate,
    LinkEstimator,
    StageTimer,
    check_spec,
    choose,
)
from geotrain.config import ConfigError, load_config
from geotrain.node.dataplane import DataPlane
from geotrain.node.servicer import check_activation_header
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import FrameError

SHAPE = (8, 64, 128)  # the default activations: 256 KiB of float32
RAW = 8 * 64 * 128 * 4


def test_choose_takes_the_least_lossy_codec_that_fits():
    assert choose([0.4, 0.2, 0.1, 0.05], current=0, compute_s=0.15, margin=0.25) == 2
    assert choose([0.4, 0.2, 0.1, 0.05], current=0, compute_s=1.0, margin=0.25) == 0


def test_choose_takes_the_most_compressing_codec_when_none_fits():
    assert choose([0.4, 0.2, 0.1], current=0, compute_s=0.01, margin=0.25) == 2


def test_choose_relaxes_only_with_margin_to_spare():
    times = [0.4, 0.2, 0.1]
    # fp16 would fit (0.2 <= 0.21) but not with 25% to spare: keep int8.
    assert choose(times, current=2, compute_s=0.21, margin=0.25) == 2
    assert choose(times, current=2, compute_s=0.3, margin=0.25) == 1
    # A codec that still fits is kept even if it fits only just.
    assert choose(times, current=1, compute_s=0.2, margin=0.25) == 1


def test_link_estimator_single_size_folds_latency_in():
    est = LinkEstimator()
    assert est.estimate() is None
    est.observe("none", 1000, 0.5)
    assert est.estimate() == LinkEstimate(2000.0, 0.0)


def test_link_estimator_fits_latency_from_two_sizes():
    est = LinkEstimator()
    bandwidth, latency = 2.5e6, 0.05
    for _ in range(20):
        est.observe("none", RAW, latency + RAW / bandwidth)
        est.observe("int8", RAW // 4, latency + RAW / 4 / bandwidth)
    got = est.estimate()
    assert got is not None
    assert got.bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert got.latency_s == pytest.approx(latency, rel=1e-6)


def test_stage_timer_sums_forward_and_backward():
    timer = StageTimer()
    assert timer.per_microbatch() is None
    timer.observe("backward", 0.02)
    assert timer.per_microbatch() is None
    timer.observe("forward", 0.01)
    assert timer.per_microbatch() == pytest.approx(0.03)


def test_fixed_policy_ignores_measurements():
    policy = CodecPolicy("activations", "int8")
    slow = LinkEstimate(1.0, 0.0)
    assert policy.codec("p", SHAPE, torch.float32, slow, 1e-3).name == get_codec("int8").name
    assert policy.accepted_ids == {get_codec("int8").codec_id}


def _drive(policy: CodecPolicy, bytes_per_s: float, compute_s: float, calls: int = 20) -> str:
    for _ in range(calls):
        codec = policy.codec("peer", SHAPE, torch.float32, LinkEstimate(bytes_per_s, 0.05), compute_s)
    return codec.name


def test_auto_compresses_a_slow_link_and_relaxes_on_a_fast_one():
    policy = CodecPolicy("activations", "auto", dwell=4)
    assert policy.codec("peer", SHAPE, torch.float32, None, None).name == "none"  # nothing measured yet
    assert _drive(policy, 2.5e6, 0.04) == "int8:block=64"  # 20 Mbit/s: int8 (28 ms) fits in 40 ms, fp16 does not
    assert _drive(policy, 2.5e6, 0.06) == "int8:block=64"  # fp16 (52 ms) would fit, not with 25% to spare
    assert _drive(policy, 2.5e6, 0.08) == "fp16"  # 52 ms fits with room
    assert _drive(policy, 1e9, 0.03) == "none"  # a fast link sends raw
    assert policy.accepted_ids == {get_codec(s).codec_id for s in ("none", "fp16", "int8", "topk:0.1")}


@pytest.mark.parametrize("kind", ["activations", "activation_grads"])
@pytest.mark.parametrize("compute_s", [0.01, 0.05, 0.1])
def test_auto_compresses_the_demos_emulated_link_both_ways(kind, compute_s):
    # test_compression_e2e's eu-us link, 20 Mbit/s and 50 ms: 256 KiB raw take 105 ms, longer than a stage computes.
    assert _drive(CodecPolicy(kind, "auto", dwell=1), 2.5e6, compute_s) != "none"


def test_auto_takes_the_last_rung_when_nothing_fits():
    policy = CodecPolicy("activation_grads", "auto", dwell=1)
    assert _drive(policy, 1e3, 0.01) == "topk:0.1"
    assert get_codec("int4").codec_id not in policy.accepted_ids


def test_auto_waits_for_the_new_codec_to_be_measured():
    policy = CodecPolicy("activations", "auto", dwell=8)
    names = [policy.codec("p", SHAPE, torch.float32, LinkEstimate(2.5e6, 0.0), 0.04).name for _ in range(12)]
    assert names[:7] == ["none"] * 7 and set(names[7:]) == {"int8:block=64"}


def test_policies_are_per_link():
    policy = CodecPolicy("activations", "auto", dwell=1)
    assert policy.codec("slow", SHAPE, torch.float32, LinkEstimate(2.5e6, 0.05), 0.04).name == "int8:block=64"
    assert policy.codec("fast", SHAPE, torch.float32, LinkEstimate(1e9, 0.0), 0.04).name == "none"


@pytest.mark.parametrize("kind", ["activations", "activation_grads"])
def test_check_spec_accepts_auto_and_codecs(kind):
    check_spec(kind, "auto")
    check_spec(kind, "topk:0.1")


def test_check_spec_rejects_unknown_codecs_and_auto_for_replicas():
    with pytest.raises(CodecError, match="unknown codec"):
        check_spec("activations", "zip")
    with pytest.raises(CodecError, match="not available for replica_grads"):
        check_spec("replica_grads", "auto")


def test_config_takes_auto_and_rejects_lossy_replica_averaging():
    cfg = load_config(None, ["compression.activations=auto", "compression.activation_grads=auto"])
    assert cfg.compression.activations == "auto"
    with pytest.raises(ConfigError, match="compression.replica_grads must be 'none'"):
        load_config(None, ["compression.replica_grads=fp16"])
    with pytest.raises(ConfigError, match="compression.activations: unknown codec"):
        load_config(None, ["compression.activations=zip"])


def _header(codec: str) -> pb.TensorHeader:
    payload = get_codec(codec).encode(torch.ones(SHAPE), get_codec(codec).new_state())
    return framing.make_header("", torch.float32, SHAPE, get_codec(codec).codec_id, payload)


def test_receiver_accepts_any_codec_of_the_ladder_and_nothing_else():
    policy = CodecPolicy("activations", "auto")
    for codec in ("none", "fp16", "int8", "topk:0.1"):
        check_activation_header(_header(codec), list(SHAPE), pb.DTYPE_FLOAT32, policy.accepted_ids, 1 << 30)
    with pytest.raises(FrameError) as err:
        check_activation_header(_header("int4"), list(SHAPE), pb.DTYPE_FLOAT32, policy.accepted_ids, 1 << 30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "CODEC_INT4" in str(err.value)


def test_codec_state_survives_replan_for_links_that_remain():
    plane = DataPlane("token", lambda: "me")
    powersgd = get_codec("powersgd:rank=2")
    for peer in ("stays", "goes"):
        plane.encode(peer, f"{peer}:1", "forward", powersgd, torch.randn(16, 64))
    kept = plane._codec_states[("stays", "stays:1", "forward")]
    assert kept[1].q is not None  # the warm start of the next encode on this link
    plane.reset_links({"stays"})
    assert plane._codec_states == {("stays", "stays:1", "forward"): kept}
    # A new codec on the link starts with fresh state instead of another codec's residual.
    plane.encode("stays", "stays:1", "forward", get_codec("int8"), torch.randn(64))
    assert plane._codec_states[("stays", "stays:1", "forward")] == ("int8:block=64", None)
    plane.close()


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_microbatch_is_not_biased_by_the_previous_ones_residual(direction):
    plane = DataPlane("token", lambda: "me")
    topk = get_codec("topk:0.1")
    g = torch.Generator().manual_seed(3)
    first, second = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    plane.encode("peer", "peer:1", direction, topk, first)
    sent = topk.decode(plane.encode("peer", "peer:1", direction, topk, second).payload, SHAPE, torch.float32)
    # Exactly what the second microbatch alone encodes to: nothing of the first one's unsent 90%.
    assert torch.equal(sent, topk.decode(topk.encode(second), SHAPE, torch.float32))
    plane.close()
