"""Using a trained model: `geotrain export` writes a Hugging Face directory that transformers loads with geotrain's
logits (llama as LlamaForCausalLM, byte-gpt as GPT2LMHeadModel, the byte tokenizer as byte-level BPE), and
`geotrain generate` continues a prompt; every bad checkpoint, tokenizer or --out is one line and exit 2."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from geotrain.cli import EXIT_INTERRUPTED, EXIT_USAGE
from geotrain.commands.model import save_final
from geotrain.config import DATA_METADATA_KEY, MODEL_METADATA_KEY, ConfigError, RunConfig, load_config
from geotrain.node.export import export
from geotrain.node.generate import generate
from geotrain.node.local import train_local
from geotrain.node.saved import read_saved_file
from geotrain.node.tokenizer import ByteTokenizer, choose_tokenizer
from tests.conftest import as_set_flags, run_cli
from tests.test_cli_errors import one_line_error, python_cli

transformers = pytest.importorskip("transformers")

# A small llama on the byte corpus (its vocabulary wider than the bytes), trained a few steps.
LLAMA = [
    "model.family=llama", "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
    "model.mlp_width=48", "model.vocab_size=300", "model.seq_len=16", "model.tie_embeddings=true",
]
BYTE_GPT = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"]
SHORT = [
    "run.steps=3", "run.eval_every=0", "run.eval_microbatches=1", "train.microbatches=2", "train.microbatch_size=4",
    "data.max_bytes=200000",
]
TEXT = "def f(x):\n   ré"  # 16 bytes, é two of them


def train(settings: list[str], path: Path) -> RunConfig:
    """Train in this process and save as --save-final does; returns the run config."""
    cfg = load_config(None, [*settings, *SHORT])
    runtime, _ = train_local(cfg)
    save_final(str(path), {name: p.detach() for name, p in runtime.named_state()}, cfg, io.StringIO())
    return cfg


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "model.safetensors"
    train(LLAMA, path)
    return path


def byte_ids(text: str) -> torch.Tensor:
    return torch.tensor([list(text.encode())])


def hf_logits(directory: Path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(x).logits


# Under model.boundary_rank the export is the same network at full width (no tied head: it cannot start as a k-wide
# embedding).
RANKED_LLAMA = [*(s for s in LLAMA if not s.startswith("model.tie_embeddings")), "model.boundary_rank=8"]


@pytest.mark.parametrize("settings, architecture", [
    (LLAMA, "LlamaForCausalLM"), (BYTE_GPT, "GPT2LMHeadModel"), (RANKED_LLAMA, "LlamaForCausalLM"),
    ([*BYTE_GPT, "model.boundary_rank=8"], "GPT2LMHeadModel"),
])
def test_export_loads_in_transformers_with_geotrains_logits(settings, architecture, tmp_path):
    cfg = train(settings, tmp_path / "model.safetensors")
    saved = read_saved_file(tmp_path / "model.safetensors")
    assert saved.model == cfg.model and saved.data == dataclasses.asdict(cfg.data)
    files = export(saved, ByteTokenizer(), tmp_path / "hf")
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]
    x = byte_ids(TEXT)
    with torch.no_grad():
        ours = saved.build()(x)
    theirs = hf_logits(tmp_path / "hf", x)
    assert ours.shape == (1, 16, cfg.model.vocab)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer(TEXT)["input_ids"] == list(TEXT.encode())
    assert tokenizer.decode(list(TEXT.encode())) == TEXT


def test_greedy_generation_equals_transformers_and_sampling_follows_the_seed(saved_llama, tmp_path):
    saved = read_saved_file(saved_llama)
    export(saved, ByteTokenizer(), tmp_path / "hf")
    model = saved.build()
    prompt = list(b"import ")
    settings = {"seq_len": 16, "vocab": 300, "seed": 0}
    greedy = generate(model, prompt, max_new_tokens=9, temperature=0, **settings)  # 16 tokens: no sliding yet
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert greedy == expected[0, len(prompt):].tolist()
    # Past seq_len the window slides: 40 new tokens from a 16-token context.
    assert len(generate(model, prompt, max_new_tokens=40, temperature=0, **settings)) == 40
    first, again = (generate(model, prompt, max_new_tokens=30, temperature=2.0, **settings) for _ in range(2))
    other = generate(model, prompt, max_new_tokens=30, temperature=2.0, **{**settings, "seed": 1})
    assert first == again and first != other
    bytes_only = generate(model, prompt, max_new_tokens=200, temperature=5.0, **{**settings, "vocab": 256})
    assert max(bytes_only) < 256  # the llama's ids 256..299 have no byte to print


def test_the_recorded_prepared_tokenizer_is_the_default(saved_llama, tmp_path):
    from tokenizers import Tokenizer, models

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(prepared / "tokenizer.json"))
    chosen = choose_tokenizer(None, {"prepared": str(prepared)}, vocab=300)
    assert chosen.vocab_size == 300 and chosen.name == "the run's data.prepared tokenizer"
    assert isinstance(choose_tokenizer(None, {"paths": []}, vocab=300), ByteTokenizer)
    with pytest.raises(ConfigError, match=r"its vocabulary \(300 tokens\) exceeds the model's \(299\)"):
        choose_tokenizer(None, {"prepared": str(prepared)}, vocab=299)
    # Exported as it is, into an --out that exists and is empty.
    (tmp_path / "hf").mkdir()
    export(read_saved_file(saved_llama), chosen, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (prepared / "tokenizer.json").read_text()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.convert_tokens_to_ids(["w7", "w299"]) == [7, 299]


# -- through the command line ---------------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_cli_round_trip_and_generate(tmp_path):
    model = tmp_path / "model.safetensors"
    trained = run_cli("train-local", "--save-final", str(model), *as_set_flags([*LLAMA, *SHORT]))
    assert trained.returncode == 0, trained.stderr
    exported = run_cli("export", "--checkpoint", str(model), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    assert "exported the llama model" in exported.stdout
    x = byte_ids(TEXT)
    with torch.no_grad():
        ours = read_saved_file(model).build()(x)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", x), ours, rtol=0, atol=1e-5)
    prompt = "def main("
    result = run_cli("generate", "--checkpoint", str(model), "--prompt", prompt, "--max-new-tokens", "40")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(prompt) and len(result.stdout.rstrip("\n")) > len(prompt)
    greedy = run_cli("generate", "--checkpoint", str(model), "--prompt", prompt, "--temperature", "0")
    ids = generate(
        read_saved_file(model).build(), list(prompt.encode()), max_new_tokens=200, seq_len=16, vocab=256,
        temperature=0, seed=0,
    )
    # Compared line by line: the pipe's text mode reads a generated "\r" as a line break.
    assert greedy.stdout.splitlines() == (prompt + ByteTokenizer().decode(ids) + "\n").splitlines()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_two_node_run_exports_from_its_final_model_and_its_checkpoint(tmp_path):
    settings = [*LLAMA, *SHORT, "run.steps=4", "scheduler.checkpoint_every=2", "scheduler.placement=uniform"]
    final, state = tmp_path / "final.safetensors", tmp_path / "state"
    demo = run_cli(
        "demo", "--nodes", "2", "--http", "off", "--save-final", str(final), "--state-dir", str(state),
        *as_set_flags(settings), timeout=240,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "stage 1: layers 2-3" in demo.stdout
    for source, out in ((final, tmp_path / "hf"), (state, tmp_path / "hf-checkpoint")):
        result = run_cli("export", "--checkpoint", str(source), "--out", str(out))
        assert result.returncode == 0, result.stderr
    # The checkpoint of the last step (4, a multiple of checkpoint_every) holds the final model exactly.
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf-checkpoint" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = byte_ids(TEXT)
    with torch.no_grad():
        ours = read_saved_file(final).build()(x)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", x), ours, rtol=0, atol=1e-5)
    result = run_cli("generate", "--checkpoint", str(state), "--prompt", "import", "--max-new-tokens", "20")
    assert result.returncode == 0 and len(result.stdout.rstrip("\n")) > len("import"), result.stderr
    stage_file = next((state / "checkpoints").glob("step-00000004/stage-*.safetensors"))
    stage_file.write_bytes(stage_file.read_bytes()[:-100])
    result = run_cli("export", "--checkpoint", str(state), "--out", str(tmp_path / "never-written"))
    one_line_error(result, EXIT_USAGE, "its latest checkpoint is truncated or unreadable")
    assert not (tmp_path / "never-written").exists()


@pytest.fixture(scope="module")
def bad_inputs(saved_llama, tmp_path_factory) -> dict[str, Path]:
    """One of each thing `--checkpoint`, `--tokenizer` and `--out` must refuse."""
    from tokenizers import Tokenizer, models

    base = tmp_path_factory.mktemp("bad")
    whole = saved_llama.read_bytes()
    (base / "truncated.safetensors").write_bytes(whole[: len(whole) - 1000])
    save_file({"w": torch.zeros(2)}, str(base / "foreign.safetensors"))
    model = {**dataclasses.asdict(load_config(None, LLAMA).model), "d_model": 64}  # the tensors are 32 wide
    metadata = {MODEL_METADATA_KEY: json.dumps(model), DATA_METADATA_KEY: "{}"}
    save_file(load_file(saved_llama), str(base / "mismatch.safetensors"), metadata=metadata)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0")).save(str(base / "wide.json"))
    (base / "full").mkdir()
    (base / "full" / "keep.txt").write_text("someone's files")
    (base / "plain-dir").mkdir()
    return {"base": base, "model": saved_llama}


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "command, checkpoint, extra, text",
    [
        ("generate", "missing.safetensors", [], "missing.safetensors: no such file"),
        ("export", "truncated.safetensors", [], "truncated.safetensors is truncated or not a safetensors file"),
        ("generate", "foreign.safetensors", [], "is not a model saved by geotrain: its metadata records no [model]"),
        ("export", "mismatch.safetensors", [], "recorded [model] section: layers.0.embed_tokens.weight is [300, 32]"),
        ("generate", "plain-dir", [], "a directory without run.sqlite, so not a coordinator's --state-dir"),
        ("generate", "MODEL", ["--tokenizer", "wide.json"], "its vocabulary (400 tokens) exceeds the model's (300)"),
        ("generate", "MODEL", ["--tokenizer", "missing.json"], "--tokenizer"),
        ("generate", "MODEL", ["--max-new-tokens", "0"], "--max-new-tokens: expected an integer from 1"),
        ("generate", "MODEL", ["--temperature", "nan"], "--temperature: expected a number >= 0"),
        ("export", "MODEL", ["--out", "full"], "exists and is not empty"),
    ],
)
def test_bad_input_is_one_line_exit_2(bad_inputs, command, checkpoint, extra, text):
    base = bad_inputs["base"]
    source = bad_inputs["model"] if checkpoint == "MODEL" else base / checkpoint
    args = [a if a.startswith("--") else str(base / a) for a in extra]
    if command == "generate":
        args += ["--prompt", "x"]
    elif "--out" not in extra:
        args += ["--out", str(base / "never-written")]
    one_line_error(run_cli(command, "--checkpoint", str(source), *args), EXIT_USAGE, text)
    assert not (base / "never-written").exists()
    assert (base / "full" / "keep.txt").read_text() == "someone's files"


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_interrupted_export_leaves_no_out_dir(saved_llama, tmp_path):
    # Interrupted while the weights are written: after the temporary directory exists, before the rename. By then
    # the checkpoint was read and checked against the model's layers, built on the meta device without their
    # initialisers, so torch's compiler (2 s of CPU) was never loaded.
    compiler_loaded = tmp_path.parent / f"{tmp_path.name}-compiler"
    patch = (
        "import safetensors.torch as st\n"
        "def interrupted(*args, **kwargs):\n"
        f"    open({str(compiler_loaded)!r}, 'w').write(str('torch._dynamo' in sys.modules))\n"
        "    raise KeyboardInterrupt\n"
        "st.save_file = interrupted"
    )
    result = python_cli(patch, "export", "--checkpoint", str(saved_llama), "--out", str(tmp_path / "hf"))
    one_line_error(result, EXIT_INTERRUPTED, "interrupted")
    assert list(tmp_path.iterdir()) == []  # neither --out nor the temporary directory beside it
    assert compiler_loaded.read_text() == "False"
