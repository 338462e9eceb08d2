"""A llama on BPE tokens against the byte GPT of about its size on the same bytes (#15): which learns more per second.

Both models train on the same text: whole files of the byte corpus's default (Python's standard library source, in
its order, UTF-8 files only) up to --max-bytes, copied into one directory. The llama reads them as a prepared data
set (a byte-level BPE tokenizer of --vocab tokens trained on them with `geotrain tokenizer train`'s code, then `data
prepare`'s); the byte GPT reads the same files as its byte corpus, its data.val_fraction chosen so that its
validation tail is exactly the text of the prepared set's validation documents. The byte GPT has the llama's width,
heads and seq_len and the block count that brings its parameters closest to the llama's. Each model trains in its
own `geotrain demo --nodes 3` (a coordinator and three node processes, one compute thread each, one stage each) with
the same batch shape, validating every --eval-every steps.

One JSON line per model: family, params, vocab, tokens_per_s, val_loss and val_bits_per_byte (the last validation),
then steps, train_s (the steps' summed times: start-up, validation and checkpoints excluded) and bytes_per_s (text
bytes trained on per second). Then one line that compares them at equal training time: the validation bits per byte
each had reached after the shorter run's train_s (the longer run's validations interpolated), and which model learned
more per second (the lower of the two).

Measured on a quiet 2-core machine, defaults (300 steps, 7.9 MB of text, 32 windows of 128 tokens a step): the llama
(8 blocks, 20.5M parameters, 8,192-token BPE) 801 tokens/s, 2,964 text bytes/s, validation 5.787 nats a token, 2.495
bits a byte after 1,534 s; the byte GPT (11 blocks, 19.8M parameters) 775 tokens/s (= bytes/s), 2.667 nats, 3.848
bits a byte after 1,586 s, 3.948 at the llama's 1,534 s. The llama learns more per second: at about the same tokens
per second each of its tokens carries 3.7 bytes of text. Both models are far from converged; the llama's training
loss (4.10 at step 300) is well below its validation loss, which is of held-out files.

Run: flock /tmp/geotrain-cpu.lock python bench/llama.py [--steps 300] [--d-model 384 --llama-layers 8 --vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geotrain.config import DataSection, ModelSection, load_config
from geotrain.dataset import PreparedDataset, bits_per_byte
from geotrain.node.data import Corpus, corpus_files
from geotrain.node.model import family_of
from geotrain.prepare import prepare, train_tokenizer
from geotrain.scheduler.state import RunStore, StepRecord

NODES = 3
CORPUS_GLOB = "*.txt"


@dataclass(frozen=True)
class SameBytes:
    """The text both models train on: the prepared set (llama) and the byte corpus settings (byte GPT) over it."""

    prepared: Path
    byte_data: list[str]  # data.* settings that make the byte corpus these files, split where the prepared set is
    vocab: int
    bytes_per_token: float  # of the prepared set's training split


def copy_corpus(sources: list[Path], max_bytes: int, out: Path) -> int:
    """Copy whole UTF-8 files of `sources`, in order, into `out` as NNNNN.txt until the next would pass max_bytes
    (the byte corpus would cut it, the prepared set could not); returns the bytes copied."""
    out.mkdir(parents=True)
    total = copied = 0
    for source in sources:
        data = source.read_bytes()
        if total + len(data) > max_bytes:
            break
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # data prepare cannot read it, and the byte GPT must see no byte the llama does not
        (out / f"{copied:05d}.txt").write_bytes(data)  # zero-padded: the glob's sorted order is the copy order
        total += len(data)
        copied += 1
    return total


def byte_val_fraction(total: int, val_bytes: int) -> float:
    """The data.val_fraction whose split (the byte corpus's int(total * (1 - f))) leaves exactly val_bytes."""
    fraction = val_bytes / total
    # Rounding can leave the product a hair off an integer: step by one ulp until the split lands on the byte.
    while int(total * (1 - fraction)) > total - val_bytes:
        fraction = math.nextafter(fraction, 1.0)
    while int(total * (1 - fraction)) < total - val_bytes:
        fraction = math.nextafter(fraction, 0.0)
    return fraction


def same_bytes(corpus: Path, total: int, vocab: int, work: Path) -> SameBytes:
    """Train the tokenizer on the corpus, prepare it, and the byte corpus settings whose split matches; checks that
    the byte corpus holds out exactly the prepared set's validation text."""
    files = [str(corpus / CORPUS_GLOB)]
    train_tokenizer(files, vocab, work / "tokenizer.json")
    dataset = PreparedDataset.open(prepare(files, work / "tokenizer.json", work / "prepared").directory)
    splits = dataset.manifest["splits"]
    if splits["train"]["bytes"] + splits["val"]["bytes"] != total:
        raise RuntimeError(f"the prepared set holds {splits} bytes of text, the corpus {total}")
    data = DataSection(paths=files, max_bytes=max(total, 10_000),
                       val_fraction=byte_val_fraction(total, splits["val"]["bytes"]))
    if len(Corpus.load(data).val) != splits["val"]["bytes"]:
        raise RuntimeError("the byte corpus's validation split is not the prepared set's")
    return SameBytes(
        prepared=dataset.directory,
        byte_data=[
            f"data.paths={files[0]}", f"data.max_bytes={data.max_bytes}", f"data.val_fraction={data.val_fraction!r}"
        ],
        vocab=dataset.vocab_size,
        bytes_per_token=splits["train"]["bytes"] / splits["train"]["tokens"],
    )


def params(model: ModelSection) -> int:
    """Parameters of the model (shapes only, nothing allocated)."""
    return sum(math.prod(shape) for layer in family_of(model).param_shapes(model) for shape in layer)


def closest_gpt(llama: ModelSection) -> ModelSection:
    """The byte GPT of the llama's width, heads and seq_len with the block count whose parameters come closest."""
    target = params(llama)

    def gpt(n_layers: int) -> ModelSection:
        return ModelSection(n_layers=n_layers, d_model=llama.d_model, n_heads=llama.n_heads, seq_len=llama.seq_len)

    return min((gpt(n) for n in range(1, 4 * llama.n_layers + 1)), key=lambda m: abs(params(m) - target))


def model_settings(model: ModelSection) -> list[str]:
    """--set values for the [model] section's fields that differ from their defaults."""
    defaults = ModelSection()
    return [f"model.{k}={getattr(model, k)}" for k in ("family", "n_layers", "d_model", "n_heads", "seq_len",
                                                     "vocab_size") if getattr(model, k) != getattr(defaults, k)]


def bits_curve(records: list[StepRecord], to_bits: Callable[[float], float]) -> list[tuple[float, float]]:
    """(training seconds so far, validation bits per byte) after each step that validated."""
    curve, seconds = [], 0.0
    for record in records:
        seconds += record.seconds
        if record.val_loss is not None:
            curve.append((seconds, to_bits(record.val_loss)))
    return curve


def bits_at(curve: list[tuple[float, float]], seconds: float) -> float | None:
    """Validation bits per byte at `seconds` of training, linear between validations; None before the first."""
    if not curve or seconds < curve[0][0]:
        return None
    times = [t for t, _ in curve]
    return float(np.interp(seconds, times, [b for _, b in curve]))


def train(name: str, settings: list[str], args: argparse.Namespace, work: Path) -> tuple[dict, list[StepRecord]]:
    """One `geotrain demo` run; its --json summary and its committed steps (from its run state)."""
    state = work / f"{name}-state"
    out, log = work / f"{name}.out", work / f"{name}.log"
    cmd = [
        sys.executable, "-m", "geotrain", "demo", "--nodes", str(NODES), "--steps", str(args.steps), "--json",
        "--http", "off", "--state-dir", str(state),
        "--set", f"run.eval_every={args.eval_every}", "--set", f"run.eval_microbatches={args.eval_microbatches}",
        "--set", f"train.microbatches={args.microbatches}", "--set", f"train.microbatch_size={args.microbatch_size}",
        "--set", "scheduler.checkpoint_every=0", "--set", f"scheduler.step_timeout_s={args.step_timeout_s}",
        *[a for s in settings for a in ("--set", s)],
    ]
    with out.open("wb") as stdout, log.open("wb") as stderr:
        done = subprocess.run(cmd, stdout=stdout, stderr=stderr)
    if done.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise SystemExit(f"{name} run failed (exit {done.returncode}): {' | '.join(tail)}")
    summary = json.loads(out.read_text().strip().splitlines()[-1])
    store = RunStore(state / "run.sqlite")
    try:
        return summary, store.steps()
    finally:
        store.close()


def main() -> None:
    """Prepare the shared bytes, train both models, print one JSON line each and the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per model (default 300)")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between validations (default 25)")
    parser.add_argument("--eval-microbatches", type=int, default=4, help="validation microbatches (default 4)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    parser.add_argument("--microbatch-size", type=int, default=8, help="samples per microbatch (default 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample, both models (default 128)")
    parser.add_argument("--d-model", type=int, default=384, help="width, both models (default 384)")
    parser.add_argument("--n-heads", type=int, default=6, help="attention heads, both models (default 6)")
    parser.add_argument("--llama-layers", type=int, default=8, help="llama blocks (default 8: about 20M parameters)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary at most (default 8192)")
    parser.add_argument("--max-bytes", type=int, default=load_config().data.max_bytes,
                        help="corpus bytes at most, whole files (default: data.max_bytes's default)")
    parser.add_argument("--step-timeout-s", type=float, default=600.0, help="scheduler.step_timeout_s (default 600)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="geotrain-bench-llama-") as tmp:
        work = Path(tmp)
        total = copy_corpus(corpus_files([]), args.max_bytes, work / "corpus")
        data = same_bytes(work / "corpus", total, args.vocab, work)
        llama = ModelSection(family="llama", n_layers=args.llama_layers, d_model=args.d_model, n_heads=args.n_heads,
                             seq_len=args.seq_len, vocab_size=data.vocab)
        runs = [
            (llama, [f"data.prepared={data.prepared}"], data.vocab, data.bytes_per_token,
             PreparedDataset.open(data.prepared).bits_per_byte),
            (closest_gpt(llama), data.byte_data, 256, 1.0, lambda loss: bits_per_byte(loss, 1, 1)),
        ]
        curves = {}
        for model, settings, vocab, bytes_per_token, to_bits in runs:
            summary, records = train(model.family, [*model_settings(model), *settings], args, work)
            train_s = sum(r.seconds for r in records)
            curves[model.family] = (train_s, bits_curve(records, to_bits))
            print(json.dumps({
                "family": model.family, "params": params(model), "vocab": vocab,
                "tokens_per_s": summary["tokens_per_s"], "val_loss": summary["val_loss"],
                "val_bits_per_byte": summary["val_bits_per_byte"], "steps": summary["steps"],
                "n_layers": model.n_layers, "train_s": train_s,
                "bytes_per_s": summary["tokens_per_s"] * bytes_per_token,
            }), flush=True)
        seconds = min(train_s for train_s, _ in curves.values())
        at = {family: bits_at(curve, seconds) for family, (_, curve) in curves.items()}
        known = {f: b for f, b in at.items() if b is not None}
        print(json.dumps({
            "compare_at_train_s": seconds, "val_bits_per_byte_at": at, "corpus_bytes": total,
            "learns_more_per_second": min(known, key=known.get) if len(known) == len(at) else None,
        }), flush=True)


if __name__ == "__main__":
    main()
