"""model.boundary_rank: a stage boundary carries k values per token, and the stage after it rebuilds the residual
stream from them and the token ids exactly, wherever the model is cut."""

from __future__ import annotations

import pytest
import torch

from geotrain.config import from_proto, load_config, to_proto
from geotrain.node.model import GPT, family_of
from geotrain.node.profiler import profile_layers
from geotrain.node.stage import StageRuntime
from geotrain.scheduler.costmodel import CostModel, Link, ModelProfile, Network, NodeProfile, StepShape

RANK = 8
TINY = ["model.n_layers=3", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "train.microbatch_size=2"]


def _config(family: str, rank: int = RANK):
    return load_config(None, [*TINY, f"model.family={family}", f"model.boundary_rank={rank}"])


def _microbatch(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shape = (cfg.train.microbatch_size, cfg.model.seq_len)
    return torch.randint(0, cfg.model.vocab, shape, generator=gen), torch.randint(0, cfg.model.vocab, shape, generator=gen)


def _gradients(runtime: StageRuntime) -> dict[str, torch.Tensor]:
    runtime.mean_gradients(0)
    return {name: p.grad.clone() for name, p in runtime.named_state()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["byte-gpt", "llama"])
def test_a_cut_at_any_layer_boundary_computes_the_whole_model_bit_for_bit(family):
    cfg = _config(family)
    total = cfg.model.total_layers
    tokens, targets = _microbatch(cfg)
    whole = StageRuntime(cfg, 0, total)
    whole.forward((0, 0), tokens)
    whole_loss = whole.loss_backward((0, 0), targets)[0].item()
    expected = _gradients(whole)
    for cut in range(1, total):
        first, second = StageRuntime(cfg, 0, cut), StageRuntime(cfg, cut, total)
        boundary = first.forward((0, 0), tokens)
        # The boundary is the k coordinates the blocks write; the next stage gets the rest from the token ids.
        assert boundary.shape == (*tokens.shape, RANK) and second.needs_tokens
        second.forward((0, 0), boundary.clone(), tokens)
        loss, grad = second.loss_backward((0, 0), targets)
        assert grad.shape == boundary.shape
        first.backward((0, 0), grad)
        assert loss.item() == whole_loss
        split = {**_gradients(first), **_gradients(second)}
        assert split.keys() == expected.keys()
        assert all(torch.equal(split[name], expected[name]) for name in expected), f"cut at {cut}"


def test_nodes_get_the_rank_with_the_run_config():
    cfg = _config("llama")
    assert from_proto(to_proto(cfg)).model == cfg.model and cfg.model.boundary_width == RANK


@pytest.mark.timeout(60)
def test_a_stage_refuses_activations_without_their_token_ids():
    cfg = _config("byte-gpt")
    tokens, _ = _microbatch(cfg)
    first, second = StageRuntime(cfg, 0, 2), StageRuntime(cfg, 2, cfg.model.total_layers)
    boundary = first.forward((0, 0), tokens)
    with pytest.raises(ValueError, match="needs the microbatch's token ids"):
        second.evaluate(boundary)
    with pytest.raises(ValueError, match="token ids of shape"):
        second.evaluate(boundary, tokens[:1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["byte-gpt", "llama"])
def test_the_blocks_leave_the_fixed_coordinates_as_the_tokens_give_them(family):
    # The whole stream at every layer boundary: its last d - k coordinates are the fixed embedding of the tokens,
    # whatever the trained weights (here far from their initialisation), so the boundary needs only the first k.
    cfg = _config(family)
    model = GPT(cfg.model, cfg.run.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    tokens, _ = _microbatch(cfg)
    streams = []
    for layer in model.layers[1:]:
        # Every layer after the first reads the stream rebuilt from its input and the fixed coordinates.
        layer.register_forward_pre_hook(lambda _m, args: streams.append(torch.cat((args[0], args[1]), dim=-1)))
    model(tokens)
    fixed = family_of(cfg.model).fixed_embedding(cfg.model)(tokens)
    assert fixed.shape == (*tokens.shape, cfg.model.d_model - RANK) and len(streams) == cfg.model.total_layers - 1
    assert all(torch.equal(stream[..., RANK:], fixed) for stream in streams)
    # And the first k coordinates change from layer to layer: the blocks write there.
    assert all(not torch.equal(a[..., :RANK], b[..., :RANK]) for a, b in zip(streams, streams[1:]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["byte-gpt", "llama"])
def test_a_rank_of_the_full_width_is_the_model_without_the_option(family):
    off, full = _config(family, 0), _config(family, 32)
    tokens, _ = _microbatch(off)
    a, b = GPT(off.model, off.run.seed), GPT(full.model, full.run.seed)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert torch.equal(a(tokens), b(tokens))


@pytest.mark.timeout(60)
def test_a_saved_model_rebuilds_the_fixed_coordinates_without_the_run_seed():
    cfg = _config("byte-gpt")
    tokens, _ = _microbatch(cfg)
    model = GPT(cfg.model, cfg.run.seed)
    loaded = GPT.from_state(cfg.model, model.state_dict())
    assert torch.equal(loaded(tokens), model(tokens))


def test_the_cost_model_prices_a_boundary_by_the_rank():
    dims = dict(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab=256, microbatch_size=2)
    off, ranked = ModelProfile.gpt(**dims), ModelProfile.gpt(**dims, boundary_rank=16)
    assert off.boundary_bytes[:-1] == [8 * b for b in ranked.boundary_bytes[:-1]]  # hidden / k = 128 / 16
    assert ranked.boundary_bytes[0] == 2 * 64 * 16 * 4 and ranked.boundary_bytes[-1] == 0
    with pytest.raises(ValueError, match="boundary_rank"):
        ModelProfile.gpt(**dims, boundary_rank=129)
    # Over a slow link (50 Mbit/s) the same two-stage plan is faster by the boundary's bytes.
    nodes = [NodeProfile(node_id=n, region="r", layer_seconds=[0.001] * 6, memory_bytes=10**10) for n in "ab"]
    network = Network(intra_region=Link(bandwidth_bps=50e6, latency_s=0.05))
    shape = StepShape(microbatches=4, microbatch_size=2)
    stages = [(0, 3, [0]), (3, 6, [1])]
    dense_s, ranked_s = (
        CostModel(nodes=nodes, model=profile, network=network, shape=shape).step_seconds(stages)
        for profile in (off, ranked)
    )
    assert ranked_s < dense_s


@pytest.mark.timeout(60)
def test_a_node_measures_the_rank_wide_boundary():
    cfg = _config("byte-gpt")
    off = profile_layers(_config("byte-gpt", 0), slowdown=1.0, repeats=1)
    ranked = profile_layers(cfg, slowdown=1.0, repeats=1)
    width = cfg.model.d_model // RANK
    assert ranked.boundary_bytes[-1] == 0 and ranked.boundary_bytes[0] == 2 * 16 * RANK * 4
    assert off.boundary_bytes == [width * b for b in ranked.boundary_bytes]
