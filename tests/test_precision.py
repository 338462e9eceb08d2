"""Mixed precision, recomputation and devices (issue 14), on the CPU: CPU autocast runs bf16 and fp16, so the
arithmetic of a GPU run is checked here; the few tests that need CUDA say so and skip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from geotrain.compression import get_codec
from geotrain.config import ConfigError, LossScale, TrainSection, load_config
from geotrain.node.device import COMPUTE_DTYPES, DeviceError, node_precision, resolve_device
from geotrain.node.stage import StageRuntime
from geotrain.scheduler.service import fetch_model_state
from geotrain.scheduler.status_cli import render_status
from geotrain.scheduler.stepdriver import current_loss_scale
from tests.conftest import local_cluster, one_compute_thread, run_cli

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Small enough that CPU bf16 (emulated without AVX512-BF16) stays quick: 2 blocks + embedding + head = 4 layers.
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "train.microbatch_size=2",
        "train.microbatches=3", "run.eval_every=0", "run.eval_microbatches=2", "data.max_bytes=200000"]


def _tiny(*overrides: str):
    return load_config(None, [*TINY, *overrides])


# -- the step decision ---------------------------------------------------------------------------------------------


def test_decide_without_loss_scaling_is_the_clip_factor():
    parts = [0.7, 1.9, 1e-9, 3.25]
    for precision in ("fp32", "bf16"):
        t = TrainSection(precision=precision)
        coef, skip, scale = t.decide(parts, t.initial_loss_scale())
        assert (coef, skip, scale) == (t.clip_coefficient_from(parts), False, LossScale(1.0, 0))


def test_fp16_overflow_skips_the_step_and_halves_the_scale_window_doubles_it():
    t = TrainSection(precision="fp16", loss_scale=1024.0, loss_scale_window=2)
    start = t.initial_loss_scale()
    assert start == LossScale(1024.0, 0)
    assert t.decide([1.0, math.inf], start) == (0.0, True, LossScale(512.0, 0))
    # Scaled parts: the factor clips the unscaled norm and divides the scale out (both exact in powers of two).
    coef, skip, after_one = t.decide([(3.0 * 1024) ** 2], start)
    assert not skip and coef == t.clip_coefficient(9.0) / 1024 and after_one == LossScale(1024.0, 1)
    assert t.decide([1.0], after_one)[2] == LossScale(2048.0, 0)
    assert t.decide([math.inf], LossScale(1.0, 0))[2] == LossScale(1.0, 0)  # never below 1


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("precision", "fp8", "train.precision must be one of fp32, bf16, fp16"),
        ("precision_fallback", "bf16", "train.precision_fallback must be refuse or fp32"),
        ("loss_scale", "1000", "train.loss_scale must be a power of two"),
        ("loss_scale", "0.5", "train.loss_scale must be in"),
    ],
)
def test_precision_settings_are_checked(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"train.{key}={value}"])


def test_precision_settings_travel_to_nodes():
    from geotrain.config import from_proto, to_proto

    cfg = load_config(None, ["train.precision=fp16", "train.recompute=true", "train.loss_scale=256",
                             "train.precision_fallback=fp32", "profile.memory_headroom_mib=64"])
    back = from_proto(to_proto(cfg))
    assert back.train == cfg.train and back.profile == cfg.profile


# -- a pipeline in one process: stages with the wire between them equal the whole model ----------------------------


def _through_the_wire(tensor: torch.Tensor, precision: str) -> torch.Tensor:
    """What the next stage receives: the tensor on the host in the run's wire dtype, through codec none."""
    wire = tensor.cpu().to(COMPUTE_DTYPES[precision])
    codec = get_codec("none")
    return codec.decode(codec.encode(wire), wire.shape, wire.dtype)


def _train(cfg, bounds: list[tuple[int, int]], steps: int) -> tuple[list[float], dict[str, torch.Tensor], list]:
    """Train `steps` steps on random bytes with the model split at `bounds`, tensors crossing the wire between
    stages, the step decided as the coordinator decides it; returns every step's mean loss, the parameters and the
    stages."""
    stages = [StageRuntime(cfg, a, b) for a, b in bounds]
    t, scale = cfg.train, cfg.train.initial_loss_scale()
    gen = torch.Generator().manual_seed(7)
    losses = []
    for step in range(steps):
        step_losses = []
        for mb in range(t.microbatches):
            x = torch.randint(0, 256, (t.microbatch_size, cfg.model.seq_len), generator=gen)
            y = torch.randint(0, 256, (t.microbatch_size, cfg.model.seq_len), generator=gen)
            for s in stages:
                x = s.forward((step, mb), x)
                if not s.is_last:
                    assert x.dtype == COMPUTE_DTYPES[cfg.train.precision]
                    x = _through_the_wire(x, cfg.train.precision)
            loss, grad = stages[-1].loss_backward((step, mb), y)
            step_losses.append(loss.item())
            for s in reversed(stages[:-1]):
                grad = s.backward((step, mb), _through_the_wire(grad, cfg.train.precision))
        parts = []
        for s in stages:
            s.mean_gradients(step)
            parts += s.grad_sq_norm_parts()
        coef, skip, scale = t.decide(parts, scale)
        for s in stages:
            s.apply(step, coef, t.lr_at(step, cfg.run.steps), skip, scale.scale)
        losses.append(sum(step_losses) / len(step_losses))
    params = {name: p.detach().clone() for s in stages for name, p in s.named_state()}
    return losses, params, stages


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "overrides",
    [["train.precision=bf16"], ["train.precision=fp16"], ["train.precision=bf16", "train.recompute=true"]],
    ids=["bf16", "fp16", "bf16-recompute"],
)
def test_stages_in_reduced_precision_equal_the_whole_model_bit_for_bit(overrides):
    # Every layer boundary is rounded to the compute dtype, so cutting the model anywhere and sending the boundary
    # in that dtype changes no arithmetic: the same losses and parameters, not merely close ones.
    cfg = _tiny(*overrides)
    whole_losses, whole, _ = _train(cfg, [(0, 4)], 3)
    split_losses, split, _ = _train(cfg, [(0, 1), (1, 3), (3, 4)], 3)
    assert split_losses == whole_losses
    assert all(torch.equal(split[k], whole[k]) for k in whole)
    assert all(p.dtype == torch.float32 for p in whole.values())  # fp32 master weights


@pytest.mark.timeout(120)
def test_bf16_validation_loss_after_the_demos_steps_is_within_one_percent_of_fp32():
    from geotrain.node.local import train_local

    steps = load_config().run.steps
    val = {p: train_local(_tiny(f"train.precision={p}", f"run.steps={steps}"))[1]["val_loss"] for p in ("fp32", "bf16")}
    assert val["fp32"] < 4.5  # it learned: a byte model starts near ln(256) = 5.5
    assert abs(val["bf16"] - val["fp32"]) <= 0.01 * val["fp32"], val


@pytest.mark.timeout(60)
def test_recompute_changes_no_fp32_arithmetic():
    plain_losses, plain, _ = _train(_tiny(), [(0, 2), (2, 4)], 2)
    again_losses, again, _ = _train(_tiny("train.recompute=true"), [(0, 2), (2, 4)], 2)
    assert again_losses == plain_losses and all(torch.equal(again[k], plain[k]) for k in plain)


@pytest.mark.timeout(60)
def test_recompute_keeps_only_each_layers_input():
    cfg = _tiny("model.d_model=64", "model.n_heads=4")
    x = torch.randint(0, 256, (cfg.train.microbatch_size, cfg.model.seq_len))
    kept = {}
    for recompute in (False, True):
        stage = StageRuntime(_tiny("model.d_model=64", "model.n_heads=4", f"train.recompute={recompute}"), 0, 3)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved=saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage.forward((0, 0), x)
        kept[recompute] = sum(saved.values())
    hidden = cfg.train.microbatch_size * cfg.model.seq_len * cfg.model.d_model * 4
    assert kept[True] <= 3 * hidden < kept[False]


@pytest.mark.timeout(60)
def test_fp16_overflow_skips_the_step_on_every_stage():
    # A scale of 2**40 overflows fp16's backward at once: the step is skipped, nothing changes but the scale.
    cfg = _tiny("train.precision=fp16", f"train.loss_scale={2.0 ** 40}")
    initial = {name: p.detach().clone() for name, p in StageRuntime(cfg, 0, 4).named_state()}
    _, params, stages = _train(cfg, [(0, 2), (2, 4)], 1)
    assert all(torch.equal(params[k], initial[k]) for k in initial)
    assert all(s.loss_scale == 2.0**39 and s.applied_step == 0 and not s.optimizer.state for s in stages)


def test_bf16_halves_the_bytes_codec_none_sends():
    shape = (8, 64, 128)
    none = get_codec("none")
    fp32 = len(none.encode(torch.randn(shape)))
    bf16 = len(none.encode(torch.randn(shape).to(torch.bfloat16)))
    assert bf16 == fp32 // 2


def test_a_loss_scale_from_the_wire_is_checked():
    stage = StageRuntime(_tiny("train.precision=fp16"), 0, 4)
    for bad in (math.inf, math.nan, 3.0, 0.5, -2.0):
        with pytest.raises(ValueError, match="not a finite power of two"):
            stage.set_loss_scale(bad)
    with pytest.raises(ValueError, match="in a bf16 run"):
        StageRuntime(_tiny("train.precision=bf16"), 0, 4).set_loss_scale(1024.0)


# -- devices --------------------------------------------------------------------------------------------------------


def test_device_choice():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert resolve_device("auto") == torch.device("cpu")
    for spec in ("tpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(DeviceError, match="is not a device"):
            resolve_device(spec)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA device is available"):
            resolve_device("cuda:0")


def test_a_device_without_the_precision_falls_back_only_as_the_run_says(monkeypatch):
    import geotrain.node.device as device

    monkeypatch.setattr(device, "supports", lambda dev, precision: precision == "fp32")
    cpu = torch.device("cpu")
    assert node_precision(cpu, TrainSection(precision="bf16", precision_fallback="fp32")) == "fp32"
    with pytest.raises(DeviceError, match="cannot compute in train.precision = 'bf16'.*'refuse'"):
        node_precision(cpu, TrainSection(precision="bf16"))


@pytest.mark.timeout(60)
def test_a_fallback_fp32_stage_takes_and_sends_the_runs_wire_dtype():
    cfg = _tiny("train.precision=bf16", "train.precision_fallback=fp32")
    fallback = StageRuntime(cfg, 1, 4, precision="fp32")
    x = torch.randn(cfg.train.microbatch_size, cfg.model.seq_len, cfg.model.d_model).to(torch.bfloat16)
    fallback.forward((0, 0), x)
    loss, grad = fallback.loss_backward((0, 0), torch.zeros(x.shape[:2], dtype=torch.long))
    assert math.isfinite(loss.item()) and grad.dtype == torch.float32  # stepflow casts it to bf16 for the wire


@pytest.mark.timeout(60)
def test_join_on_a_device_that_is_not_there_is_one_line_and_exit_2():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    result = run_cli("join", "--coordinator", "127.0.0.1:1", "--token", "t", "--device", "cuda")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"geotrain: error: --device cuda: no CUDA device is available (torch {torch.__version__}, built without CUDA)"
    ]


@needs_cuda
@pytest.mark.timeout(120)
def test_stages_on_cuda_in_bf16_equal_the_whole_model_on_cuda():
    cfg = _tiny("train.precision=bf16")
    device = torch.device("cuda")

    def on_cuda(bounds):
        return [StageRuntime(cfg, a, b, device) for a, b in bounds]

    whole, split = on_cuda([(0, 4)]), on_cuda([(0, 2), (2, 4)])
    x = torch.randint(0, 256, (cfg.train.microbatch_size, cfg.model.seq_len))
    out = whole[0].evaluate(x)
    mid = _through_the_wire(split[0].evaluate(x), "bf16")
    assert torch.equal(split[1].evaluate(mid).cpu(), out.cpu())


# -- over gRPC: a 3-stage pipeline equals train-local in the same precision -----------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "precision, overrides, skipped",
    # fp16 from a scale of 2**18: this model's scaled gradients overflow in the first two steps, whose Inf gradients
    # cross the wire (allowed only backward in fp16 runs) and make every stage skip them; then it trains.
    [("bf16", [], 0), ("fp16", [f"train.loss_scale={2.0 ** 18}"], 2)],
    ids=["bf16", "fp16-overflow-then-steps"],
)
def test_three_stage_pipeline_equals_train_local_in_reduced_precision(tmp_path: Path, precision, overrides, skipped):
    from geotrain.node.local import train_local

    cfg = _tiny(f"train.precision={precision}", *overrides, "run.steps=4", "scheduler.placement=uniform",
                "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=5")
    losses: list[float] = []

    def on_event(kind: str, data: dict) -> None:
        if kind == "step":
            losses.append(data["record"].loss)

    cpu = {f"node-{i}": ["--device", "cpu"] for i in (1, 2, 3)}
    with local_cluster(cfg, 3, tmp_path, on_event=on_event, node_args=cpu) as cluster:
        summary = cluster.wait(200)
        pipeline = fetch_model_state(cluster.coordinator.plan, cluster.token, summary.steps, cluster.coordinator.key)
        profiles = [m.profile for m in cluster.coordinator.membership.alive()]
        status = cluster.coordinator.status()
        scale = current_loss_scale(cfg, cluster.coordinator.store)
    assert summary.stages == 3
    assert all(p.device == "cpu" and p.precision == precision for p in profiles)
    assert all(n.device.startswith("cpu (") and n.precision == precision for n in status.nodes)
    assert "DEVICE" in render_status(status) and f"{status.nodes[0].device} {precision}" in render_status(status)
    local_losses: list[float] = []
    with one_compute_thread():
        runtime, _ = train_local(cfg, lambda r: local_losses.append(r["loss"]))
    # Same arithmetic, same order (the float64 gradient sums are order-free): equal, not merely close.
    assert losses == local_losses
    assert scale.scale == runtime.loss_scale == cfg.train.initial_loss_scale().scale / 2**skipped
    local = dict(runtime.named_state())
    assert pipeline.keys() == local.keys()
    assert all(torch.equal(pipeline[k], local[k].detach()) for k in local)


# -- the planner's memory model ---------------------------------------------------------------------------------------


def _cost_model(**shape):
    from geotrain.scheduler.costmodel import CostModel, Link, ModelProfile, Network, NodeProfile, StepShape

    compute_bytes = shape.get("compute_bytes", 4)
    model = ModelProfile.gpt(n_layers=4, d_model=256, n_heads=4, seq_len=256, vocab=256, microbatch_size=8,
                             compute_bytes=compute_bytes)
    node = NodeProfile(node_id="n", region="r", layer_seconds=[0.01] * 6, memory_bytes=1 << 40)
    network = Network(intra_region=Link(bandwidth_bps=1e9, latency_s=1e-3))
    return CostModel(nodes=[node], model=model, network=network, shape=StepShape(microbatches=8, microbatch_size=8,
                                                                                  **shape)), model


def test_stage_memory_counts_precision_and_recomputation():
    fp32, model = _cost_model()
    bf16, bf16_model = _cost_model(compute_bytes=2)
    recompute, _ = _cost_model(recompute=True)
    params = sum(model.layer_param_bytes[1:5]) / 4
    largest = max(model.largest_tensor_bytes[1:5])
    need = {name: cm.stage_memory_bytes(1, 5, 4) for name, cm in
            (("fp32", fp32), ("bf16", bf16), ("recompute", recompute))}
    # fp32: weight, gradient, float64 sum and AdamW's two moments, 24 bytes a parameter, the largest tensor's
    # gradient widened to float64, plus 4 microbatches' activations.
    assert need["fp32"] == 24 * params + 2 * largest + 4 * sum(model.layer_activation_bytes[1:5])
    # bf16: the same fp32 state, and activations of half the bytes with autocast's 2-byte weight copies among them
    # (each microbatch's: counted once, there).
    copies = 2 * sum(math.prod(shape) for layer in model.layer_param_shapes[1:5] for shape in layer if len(shape) == 2)
    assert sum(bf16_model.layer_activation_bytes[1:5]) == sum(model.layer_activation_bytes[1:5]) / 2 + copies
    assert need["bf16"] == 24 * params + 2 * largest + 4 * sum(bf16_model.layer_activation_bytes[1:5])
    # Recomputation: each layer's input per microbatch in flight, and one layer's activations at a time.
    inputs = sum(model.boundary_bytes[0:4])
    assert need["recompute"] == 24 * params + 2 * largest + 4 * inputs + max(model.layer_activation_bytes[1:5])
    assert need["recompute"] < need["bf16"] < need["fp32"]


def test_plan_gives_the_gpu_node_the_bulk_and_leaves_out_a_node_without_memory(tmp_path, capsys):
    from geotrain.cli import main

    # Times as nodes measure them: a GPU box 10x faster than two CPU laptops per layer; one node with 50 MB, less
    # than any one layer of this model needs.
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        "intra_region: {bandwidth_gbps: 1, latency_ms: 1}\n"
        "nodes:\n"
        "  - {name: gpu, region: home, layer_seconds: [0.0004, 0.002, 0.002, 0.002, 0.002, 0.0008], memory_gb: 24}\n"
        "  - {name: laptop, region: home, layer_seconds: [0.004, 0.02, 0.02, 0.02, 0.02, 0.008], memory_gb: 16,"
        " count: 2}\n"
        "  - {name: tiny, region: home, layer_seconds: [0.0004, 0.002, 0.002, 0.002, 0.002, 0.0008], memory_gb: 0.05}\n"
    )
    settings = ["model.d_model=512", "model.n_heads=8", "model.seq_len=256", "train.microbatch_size=8",
                "train.precision=bf16"]
    assert main(["plan", "--cluster", str(cluster), *[a for s in settings for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "tiny: memory: has 0.05 GiB beyond its baseline, the smallest stage needs" in out
    assert main(["plan", "--cluster", str(cluster), "--json", *[a for s in settings for a in ("--set", s)]]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    layers = {n: st["end"] - st["start"] for st in plan["stages"] for n in st["node_ids"]}
    assert layers["gpu"] >= 4 and sum(layers.values()) == 6, layers
    assert plan["excluded"]["tiny"].startswith("memory:")


def test_activations_travel_in_the_runs_compute_dtype():
    from geotrain.node.servicer import WIRE_DTYPES, check_activation_header
    from geotrain.protocol import geotrain_pb2 as pb
    from geotrain.protocol.framing import FrameError

    shape = [2, 3, 4]
    fp32 = pb.TensorHeader(dtype=pb.DTYPE_FLOAT32, shape=shape, codec=pb.CODEC_NONE, payload_bytes=96)
    with pytest.raises(FrameError, match="expected bfloat16 activations, got float32"):
        check_activation_header(fp32, shape, WIRE_DTYPES["bf16"], {pb.CODEC_NONE}, 1 << 20)
    bf16 = pb.TensorHeader(dtype=pb.DTYPE_BFLOAT16, shape=shape, codec=pb.CODEC_NONE, payload_bytes=48)
    check_activation_header(bf16, shape, WIRE_DTYPES["bf16"], {pb.CODEC_NONE}, 1 << 20)
    with pytest.raises(FrameError, match="expected float32 activations, got bfloat16"):
        check_activation_header(bf16, shape, WIRE_DTYPES["fp32"], {pb.CODEC_NONE}, 1 << 20)
