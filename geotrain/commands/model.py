"""`geotrain generate` and `geotrain export`: a trained model (a --save-final file, or a state dir's latest
checkpoint) continuing a prompt or written for transformers, each with its parser."""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geotrain.commands.common import (
    EXIT_OK,
    CommandFailed,
    Subcommands,
    UsageError,
    int_arg,
    model_metadata,
    number_arg,
    stop_on_sigterm,
    torch_threads,
)
from geotrain.config import RunConfig

if TYPE_CHECKING:
    from geotrain.node.saved import SavedModel


def save_final(path: str, state: dict[str, Any], cfg: RunConfig, out) -> None:
    """Write train-local's model as safetensors with _model_metadata."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata=model_metadata(cfg))
    except OSError as e:
        raise CommandFailed(f"cannot write the final model to {path}: {e.strerror}") from None
    print(f"saved the final model to {path}", file=out, flush=True)


def saved_model(path: str) -> SavedModel:
    """The model --checkpoint names: a --save-final file, or the latest complete checkpoint of a coordinator's
    --state-dir with the [model] section its run store recorded."""
    from geotrain.scheduler.state import STORE_FILE, recorded_model

    source = Path(path)
    if not source.exists():
        raise UsageError(f"--checkpoint {path}: no such file or directory")
    if source.is_dir() and not (source / STORE_FILE).is_file():
        raise UsageError(f"--checkpoint {path}: a directory without {STORE_FILE}, so not a coordinator's --state-dir")
    # torch (seconds of CPU) only once --checkpoint names something that may hold a model.
    from safetensors import SafetensorError

    from geotrain.node.saved import SavedModel, read_saved_file
    from geotrain.scheduler.checkpoint import CHECKPOINTS_DIR, CheckpointStore

    if not source.is_dir():
        return read_saved_file(path)
    try:
        model = recorded_model(source / STORE_FILE)
    except (sqlite3.Error, ValueError) as e:
        raise UsageError(f"--checkpoint {path}: cannot read its {STORE_FILE}: {e}") from None
    if model is None:
        raise UsageError(f"--checkpoint {path}: its {STORE_FILE} records no [model] section")
    if not (source / CHECKPOINTS_DIR).is_dir():
        raise UsageError(f"--checkpoint {path}: the state dir holds no checkpoint")
    store = CheckpointStore(source / CHECKPOINTS_DIR, keep=1)  # keep matters to writing only
    try:
        manifest = store.latest()
        if manifest is None:
            raise UsageError(f"--checkpoint {path}: the state dir holds no complete checkpoint")
        state = store.load_layers(manifest, 0, max(entry["layer_end"] for entry in manifest.stages))
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--checkpoint {path}: its latest checkpoint is truncated or unreadable ({e})") from None
    parameters = {name: t for name, t in state.items() if name.startswith("layers.")}  # not the optimizer's state
    return SavedModel.checked(model, parameters, {}, f"--checkpoint {manifest.path}")


def add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    """--checkpoint and --tokenizer, of the commands that read a trained model."""
    p.add_argument(
        "--checkpoint", required=True, metavar="PATH",
        help="a model written by --save-final, or a coordinator's --state-dir (its latest complete checkpoint)",
    )
    p.add_argument(
        "--tokenizer", metavar="TOKENIZER_JSON",
        help="a tokenizer.json (default: the run's data.prepared tokenizer if the saved model records one, "
        "else bytes: ids 0..255 are UTF-8 bytes)",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    """geotrain generate."""
    if not args.prompt:
        raise UsageError("--prompt must not be empty: the model continues a text")
    saved = saved_model(args.checkpoint)
    from geotrain.node.generate import generate
    from geotrain.node.tokenizer import choose_tokenizer

    tokenizer = choose_tokenizer(args.tokenizer, saved.data, saved.model.vocab)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise UsageError(f"--prompt {args.prompt!r} encodes to no token with {tokenizer.name}")
    torch_threads()
    ids = generate(
        saved.build(), prompt, max_new_tokens=args.max_new_tokens, seq_len=saved.model.seq_len,
        vocab=tokenizer.vocab_size, temperature=args.temperature, seed=args.seed,
    )
    print(args.prompt + tokenizer.decode(ids), flush=True)
    return EXIT_OK


def add_generate(commands: Subcommands) -> None:
    """`geotrain generate`'s parser."""
    p = commands.add(
        "generate", "Continue a prompt with a trained model, on this machine's CPU.",
        "geotrain generate --checkpoint model.safetensors --prompt \"def main(\" --max-new-tokens 200",
    )
    add_checkpoint_options(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument(
        "--max-new-tokens", type=int_arg(1, 1 << 20), default=200, metavar="N",
        help="tokens to add (default 200); the model sees the last model.seq_len tokens, sliding along",
    )
    p.add_argument(
        "--temperature", type=number_arg(0.0), default=0.8, metavar="T",
        help="sample from softmax(logits / T) (default 0.8); 0: always the likeliest token",
    )
    p.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0, help="seed of the sampling (default 0)")
    p.set_defaults(func=cmd_generate)


def cmd_export(args: argparse.Namespace) -> int:
    """geotrain export."""
    from geotrain.node.export import check_out, export
    from geotrain.node.tokenizer import choose_tokenizer

    out = Path(args.out)
    check_out(out)  # before reading the model, which may take a while
    stop_on_sigterm()
    saved = saved_model(args.checkpoint)
    tokenizer = choose_tokenizer(args.tokenizer, saved.data, saved.model.vocab)
    try:
        files = export(saved, tokenizer, out)
    except OSError as e:
        raise CommandFailed(f"cannot write {out}: {e.strerror or e}") from None
    print(f"exported the {saved.model.family} model to {out} ({', '.join(files)}); tokenizer: {tokenizer.name}")
    return EXIT_OK


def add_export(commands: Subcommands) -> None:
    """`geotrain export`'s parser."""
    p = commands.add(
        "export", "Write a trained model as a Hugging Face directory that transformers' AutoModelForCausalLM loads.",
        "geotrain export --checkpoint model.safetensors --out hf-model",
    )
    add_checkpoint_options(p)
    p.add_argument(
        "--out", required=True, metavar="DIR",
        help="the directory to create (absent, or empty): config.json, model.safetensors (llama as LlamaForCausalLM, "
        "byte-gpt as GPT2LMHeadModel), tokenizer.json (the byte tokenizer as byte-level BPE) and tokenizer_config.json",
    )
    p.set_defaults(func=cmd_export)
