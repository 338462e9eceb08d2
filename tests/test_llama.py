"""The model families: byte-gpt's numerics unchanged behind the interface, and the llama family equal to transformers'
LlamaForCausalLM, read from a Hugging Face-format directory one stage at a time, with one clear error per bad input."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from geotrain.config import ConfigError, RunConfig, from_proto, load_config, to_proto
from geotrain.node.llama import INDEX_FILE, Checkpoint, Llama, hf_config, hf_names
from geotrain.node.model import ByteGPT, build_layer, family_of
from geotrain.node.stage import StageRuntime
from tests.conftest import as_set_flags, max_diff, run_cli

LLAMA = [
    "model.family=llama", "model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
    "model.mlp_width=96", "model.vocab_size=320", "model.rope_base=5000", "model.seq_len=16",
]
STAGES = [(0, 2), (2, 4), (4, 6)]  # the 6 layers (embedding, 4 blocks, head) as 3 stages


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A small random LlamaForCausalLM saved in shards of a few tensors each, and the model itself."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # transformers starts norms at one, which would not show a norm read wrongly
    directory = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(directory, max_shard_size="40KB")
    return directory, model


def llama_config(directory, *extra: str) -> RunConfig:
    return load_config(None, [*LLAMA, f"model.init_from={directory}", *extra])


def chain(layers, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def tokens(cfg: RunConfig, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, cfg.model.vocab, (batch, cfg.model.seq_len), generator=torch.Generator().manual_seed(3))


def copy_of(hf_model, tmp_path):
    directory = tmp_path / "llama"
    shutil.copytree(hf_model[0], directory)
    return directory


def shard_of(directory, tensor: str) -> str:
    return json.loads((directory / INDEX_FILE).read_text())["weight_map"][tensor]


def test_logits_equal_transformers_whole_and_stage_by_stage(hf_model):
    directory, model = hf_model
    cfg = llama_config(directory)
    x = tokens(cfg)
    with torch.no_grad():
        expected = model(x).logits
        whole = chain([build_layer(cfg.model, i, cfg.run.seed) for i in range(cfg.model.total_layers)], x)
        staged = x
        for start, end in STAGES:
            staged = StageRuntime(cfg, start, end).evaluate(staged)
    assert whole.shape == (2, cfg.model.seq_len, 320)
    torch.testing.assert_close(whole, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(staged, expected, rtol=0, atol=1e-5)


def test_first_step_loss_equals_transformers(hf_model, tmp_path):
    from geotrain.node.data import Corpus
    from geotrain.node.local import train_local

    directory, model = hf_model
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 100)  # byte ids are token ids: the vocabulary (320) holds them all
    cfg = llama_config(
        directory, f"data.paths={text}", "run.steps=1", "train.microbatches=2", "train.microbatch_size=3",
        "run.eval_microbatches=1",
    )
    _, summary = train_local(cfg)
    corpus = Corpus.load(cfg.data)
    losses = []
    with torch.no_grad():
        for mb in range(cfg.train.microbatches):
            x, y = corpus.batch(seed=cfg.run.seed, step=0, microbatch=mb, size=3, seq_len=cfg.model.seq_len)
            # transformers shifts the labels itself: the window x + y's last token predicts exactly y from x.
            window = torch.cat([x, y[:, -1:]], dim=1)
            losses.append(model(input_ids=window, labels=window).loss.item())
    assert summary["loss_first"] == pytest.approx(sum(losses) / len(losses), rel=0, abs=1e-5)


def test_a_stage_reads_only_its_own_layers(hf_model, tmp_path):
    directory = copy_of(hf_model, tmp_path)
    cfg = llama_config(directory)
    head_shard = shard_of(directory, "lm_head.weight")
    (directory / head_shard).unlink()
    first = StageRuntime(cfg, *STAGES[0])  # builds: none of its tensors is in the missing shard
    whole = llama_config(hf_model[0])
    x = tokens(cfg)
    torch.testing.assert_close(first.evaluate(x), StageRuntime(whole, *STAGES[0]).evaluate(x), rtol=0, atol=0)
    with pytest.raises(ConfigError) as missing:
        StageRuntime(cfg, *STAGES[2])
    assert str(missing.value) == f"model.init_from {directory}: {head_shard} is missing"
    with pytest.raises(ConfigError, match=f"{head_shard} is missing"):
        family_of(cfg.model).check(cfg.model)  # the whole-model check a coordinator can make up front


def test_config_mismatch_names_every_differing_key_in_one_line(hf_model):
    directory, _ = hf_model
    cfg = llama_config(directory, "model.n_layers=3", "model.rope_base=10000", "model.tie_embeddings=true")
    expected = (
        f"model.init_from {directory}: config.json does not match the run config: model.n_layers 4 there, 3 here, "
        "model.rope_base 5000.0 there, 10000.0 here, model.tie_embeddings False there, True here"
    )
    for attempt in (lambda: build_layer(cfg.model, 1, 0), lambda: family_of(cfg.model).check(cfg.model)):
        with pytest.raises(ConfigError) as error:
            attempt()
        assert str(error.value) == expected


def test_truncated_or_absent_safetensors_give_one_clear_error(hf_model, tmp_path):
    directory = copy_of(hf_model, tmp_path)
    cfg = llama_config(directory)
    shard = directory / shard_of(directory, "model.embed_tokens.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ConfigError) as truncated:
        build_layer(cfg.model, 0, 0)
    message = str(truncated.value)
    assert message.startswith(f"model.init_from {directory}: {shard.name} is truncated or not a safetensors file")
    assert "\n" not in message
    build_layer(cfg.model, 1, 0)  # the other shards are whole
    for path in directory.glob("*.safetensors*"):
        path.unlink()
    with pytest.raises(ConfigError, match="no safetensors files"):
        build_layer(cfg.model, 1, 0)


def test_unsharded_and_tied_checkpoints_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    assert not (tmp_path / INDEX_FILE).exists()
    cfg = load_config(None, [
        "model.family=llama", "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64",
        "model.vocab_size=300", "model.norm_eps=1e-6", "model.tie_embeddings=true", "model.seq_len=8",
        f"model.init_from={tmp_path}",
    ])
    layers = [build_layer(cfg.model, i, 0) for i in range(cfg.model.total_layers)]
    # Tied at the start only: the head is its own parameter, a copy of the embedding.
    assert layers[-1].lm_head.weight.data_ptr() != layers[0].embed_tokens.weight.data_ptr()
    torch.testing.assert_close(layers[-1].lm_head.weight, layers[0].embed_tokens.weight, rtol=0, atol=0)
    x = tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(chain(layers, x), model(x).logits, rtol=0, atol=1e-5)


def test_seeded_llama_is_a_pure_function_of_seed_and_index():
    cfg = load_config(None, [*LLAMA, "model.tie_embeddings=true"]).model
    first, again = build_layer(cfg, 2, 7), build_layer(cfg, 2, 7)
    other_seed = build_layer(cfg, 2, 8)
    for a, b, c in zip(first.parameters(), again.parameters(), other_seed.parameters()):
        assert torch.equal(a, b)
        if a.dim() > 1:
            assert not torch.equal(a, c)
    head, embedding = build_layer(cfg, cfg.total_layers - 1, 7), build_layer(cfg, 0, 7)
    assert torch.equal(head.lm_head.weight, embedding.embed_tokens.weight)


def test_seeded_llama_matches_transformers_given_its_weights(tmp_path):
    """The way out (export): geotrain's own weights, named by hf_names, with hf_config, are a LlamaForCausalLM."""
    transformers = pytest.importorskip("transformers")
    cfg = load_config(None, LLAMA).model
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg)))
    assert Checkpoint(tmp_path).differences(cfg) == []
    layers = [build_layer(cfg, i, 5) for i in range(cfg.total_layers)]
    state = {hf_names(cfg, i)[name]: p for i, layer in enumerate(layers) for name, p in layer.state_dict().items()}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(cfg))).eval()
    model.load_state_dict(state, strict=True)
    x = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(chain(layers, x), model(x).logits, rtol=0, atol=1e-5)


def test_family_interface_describes_the_layers_it_builds():
    for settings in ([], LLAMA):
        cfg = load_config(None, settings).model
        family = family_of(cfg)
        for i in range(cfg.total_layers):
            layer = build_layer(cfg, i, 0)
            assert family.layer_params(cfg, i) == [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
            assert family.state_names(cfg, i) == [f"layers.{i}.{n}" for n, _ in layer.named_parameters()]
            # A layer built for a state load is the same layer less its initial values: all its state is parameters.
            empty = family.empty_layer(cfg, i, torch.device("cpu"))
            assert not list(layer.buffers()) and not list(empty.buffers())
            assert [(n, p.shape, p.dtype) for n, p in empty.named_parameters()] == \
                [(n, p.shape, p.dtype) for n, p in layer.named_parameters()]
        hidden = build_layer(cfg, 0, 0)(torch.zeros(3, cfg.seq_len, dtype=torch.long))
        assert tuple(hidden.shape) == family.boundary_shape(cfg, 3)
        assert family.vocab(cfg) == (256 if not settings else 320)
    assert isinstance(family_of(load_config(None, []).model), ByteGPT)
    assert isinstance(family_of(load_config(None, LLAMA).model), Llama)


# Today's byte GPT (model.py before the family interface), seed 7: each layer's parameter sum and its output's
# first three values and absolute sum on fixed bytes. Initialisation is bit-exact; the outputs allow float noise.
BYTE_GPT_GOLDEN = [
    (1.3689354859919831, [0.0254965, -0.0212894, 0.0600806], 10.747704128501937),
    (63.681675606642045, [-0.0471022, -0.0043705, 0.110753], 48.37230081693269),
    (62.76459309416532, [-0.0056331, -0.0825149, 0.2345392], 74.03118265792727),
    (33.252620303511776, [0.1387708, 0.0130464, -0.0922305], 346.4526032035574),
]


def test_byte_gpt_numerics_are_unchanged():
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=8"]).model
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(5))
    for i, (param_sum, head, abs_sum) in enumerate(BYTE_GPT_GOLDEN):
        layer = build_layer(cfg, i, 7)
        assert sum(p.double().sum().item() for p in layer.parameters()) == param_sum
        with torch.no_grad():
            x = layer(x)
        assert x.flatten()[:3].tolist() == pytest.approx(head, abs=1e-6)
        assert x.double().abs().sum().item() == pytest.approx(abs_sum, rel=1e-5)


def test_init_from_gives_the_shape_the_run_config_leaves_unset_and_refuses_only_real_conflicts(tmp_path):
    # A LlamaConfig as transformers saves it: its intermediate size and norm epsilon are not geotrain's defaults,
    # which the run config then had to repeat by hand.
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=20000.0, tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    cfg = load_config(None, ["model.family=llama", f"model.init_from={tmp_path}", "model.seq_len=16"])
    model = cfg.model
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.mlp_hidden) == (3, 48, 6, 2, 80)
    assert (model.vocab, model.norm_eps, model.rope_base, model.tie_embeddings) == (300, 1e-6, 20000.0, True)
    Checkpoint(tmp_path).check_config(model)  # what a node checks before it reads a tensor
    assert from_proto(to_proto(cfg)).model == model  # the nodes get the shape, and need not read config.json
    # What the run config sets stays, and a value the checkpoint contradicts is refused, by name.
    cfg = load_config(None, ["model.family=llama", f"model.init_from={tmp_path}", "model.n_layers=2"])
    assert cfg.model.n_layers == 2 and cfg.model.mlp_hidden == 80
    assert Checkpoint(tmp_path).differences(cfg.model) == ["model.n_layers 3 there, 2 here"]
    with pytest.raises(ConfigError, match="cannot read config.json .* for the model.n_layers, model.d_model"):
        load_config(None, ["model.family=llama", f"model.init_from={tmp_path / 'absent'}"])


def test_llama_settings_travel_to_nodes_and_byte_gpt_refuses_them():
    cfg = load_config(None, [*LLAMA, "model.tie_embeddings=true", "model.init_from=/ckpt", "model.norm_eps=1e-6"])
    assert from_proto(to_proto(cfg)).model == cfg.model
    assert cfg.model.kv_heads == 2 and cfg.model.mlp_hidden == 96
    assert load_config(None, ["model.family=llama", "model.d_model=96", "model.n_heads=4"]).model.mlp_hidden == 256
    with pytest.raises(ConfigError, match="model.init_from applies to model.family = 'llama' only"):
        load_config(None, ["model.init_from=/ckpt"])
    with pytest.raises(ConfigError, match=r"model.n_kv_heads must divide model.n_heads \(4\), got 3"):
        load_config(None, [*LLAMA, "model.n_kv_heads=3"])


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_three_llama_stages_on_a_prepared_data_set_equal_train_local(tmp_path):
    """Nodes fetch each microbatch's windows of a BPE-tokenized data set from the coordinator (they have no copy):
    the pipeline of a seeded llama (grouped-query attention, a head that starts as a copy of the embedding two stages
    away) equals train-local reading the same data set, and validation is reported in bits per byte too."""
    import re

    from geotrain import prepare
    from geotrain.dataset import PreparedDataset
    from tests.test_data import write_text_corpus
    write_text_corpus(tmp_path / "text", 12)
    prepare.train_tokenizer([str(tmp_path / "text" / "*.txt")], 300, tmp_path / "tok.json")
    prepare.prepare([str(tmp_path / "text" / "*.txt")], tmp_path / "tok.json", tmp_path / "data", val_fraction=0.25)
    dataset = PreparedDataset.open(tmp_path / "data")
    settings = [
        "model.family=llama", f"model.vocab_size={dataset.vocab_size}", "model.n_layers=2", "model.d_model=64",
        "model.n_heads=4", "model.n_kv_heads=2", "model.tie_embeddings=true", "model.seq_len=32",
        f"data.prepared={tmp_path / 'data'}",
        "run.steps=4", "train.microbatches=4", "train.inflight=2", "run.eval_every=0", "run.eval_microbatches=2",
        "scheduler.placement=uniform",
    ]
    # As a run owner would: `geotrain demo`, whose output says the validation loss in bits per byte too.
    overrides = as_set_flags(settings)
    demo = run_cli("demo", "--nodes", "3", "--save-final", str(tmp_path / "pipe.safetensors"), *overrides)
    assert demo.returncode == 0, demo.stderr[-3000:]
    local = run_cli("train-local", "--save-final", str(tmp_path / "local.safetensors"), *overrides)
    assert local.returncode == 0, local.stderr[-3000:]
    assert max_diff(load_file(tmp_path / "pipe.safetensors"), load_file(tmp_path / "local.safetensors")) <= 1e-4
    assert "stage 2: layers 3-3" in demo.stdout
    val_loss, bits = map(float, re.search(r"validation ([\d.]+) \(([\d.]+) bits/byte\)", demo.stdout).groups())
    assert bits == pytest.approx(dataset.bits_per_byte(val_loss), abs=2e-3)
    assert 0 < bits < val_loss / math.log(2)  # more than one byte a token: fewer bits a byte than nats a token
