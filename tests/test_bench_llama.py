"""bench/llama.py's own logic: both models see the same bytes, split in the same place; the byte GPT it picks is the
closest in size; the equal-time comparison reads the validation curve right. (The benchmark itself is not run.)"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from geotrain.config import ModelSection, load_config
from geotrain.dataset import PreparedDataset
from geotrain.node.data import Corpus
from geotrain.prepare import load_tokenizer
from geotrain.scheduler.state import StepRecord
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)

_spec = importlib.util.spec_from_file_location("bench_llama", REPO / "bench" / "llama.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)


def _sources(directory: Path) -> list[Path]:
    """Source files of varied text, one of them not UTF-8, the last too large for the cap the tests use."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    words = "def return self import class lambda yield naïve café".split()
    texts = [(" ".join(rng.choice(words, size=60 + 13 * i)) + "\n").encode() for i in range(12)]
    texts[3] = "# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n".encode("latin-1")
    texts.append(b"x = 1\n" * 10_000)
    paths = []
    for i, text in enumerate(texts):
        paths.append(directory / f"m{i:02d}.py")
        paths[-1].write_bytes(text)
    return paths


def test_both_models_see_the_same_bytes_split_in_the_same_place(tmp_path):
    sources = _sources(tmp_path / "src")
    total = bench.copy_corpus(sources, 40_000, tmp_path / "corpus")
    kept = [p.read_bytes() for i, p in enumerate(sources[:-1]) if i != 3]
    assert [p.read_bytes() for p in sorted((tmp_path / "corpus").iterdir())] == kept
    assert total == sum(map(len, kept))

    data = bench.same_bytes(tmp_path / "corpus", total, 300, tmp_path)
    byte_corpus = Corpus.load(load_config(None, data.byte_data).data)
    text = b"".join(kept)
    assert byte_corpus.train.tobytes() + byte_corpus.val.tobytes() == text
    val_text = byte_corpus.val.tobytes()
    assert text.endswith(val_text) and any(val_text == b"".join(kept[i:]) for i in range(1, len(kept)))

    prepared = PreparedDataset.open(data.prepared)
    tokenizer = load_tokenizer(data.prepared / "tokenizer.json")
    val_ids = prepared.val.read(0, len(prepared.val)).tolist()
    assert tokenizer.decode(val_ids).encode() == val_text  # the separators between documents are skipped
    assert data.vocab == prepared.vocab_size
    assert data.bytes_per_token == pytest.approx(len(byte_corpus.train) / len(prepared.train))


@pytest.mark.parametrize("total", [10_007, 123_457, 7_999_991, 31_525_224])
def test_byte_val_fraction_splits_at_the_exact_byte(total):
    for val_bytes in (1, 17, total // 20, total // 20 + 1, total // 3):
        fraction = bench.byte_val_fraction(total, val_bytes)
        assert total - int(total * (1 - fraction)) == val_bytes


def test_the_byte_gpt_is_the_closest_in_size():
    llama = ModelSection(family="llama", n_layers=8, d_model=384, n_heads=6, seq_len=128, vocab_size=8192)
    gpt = bench.closest_gpt(llama)
    assert (gpt.family, gpt.d_model, gpt.n_heads, gpt.seq_len) == ("byte-gpt", 384, 6, 128)
    target = bench.params(llama)
    assert 19_000_000 < target < 22_000_000  # the "about 20M"
    for other in (gpt.n_layers - 1, gpt.n_layers + 1):
        farther = ModelSection(n_layers=other, d_model=384, n_heads=6, seq_len=128)
        assert abs(bench.params(farther) - target) > abs(bench.params(gpt) - target)


def test_params_counts_every_tensor():
    model = ModelSection(n_layers=1, d_model=8, n_heads=2, seq_len=4)
    # embedding: tokens and positions; a block: two layer norms, qkv and projection, the MLP; head: norm, unembedding
    block = 2 * 2 * 8 + (8 * 24 + 24) + (8 * 8 + 8) + (8 * 32 + 32) + (32 * 8 + 8)
    assert bench.params(model) == (256 * 8 + 4 * 8) + block + (2 * 8 + 8 * 256)


def _record(step: int, seconds: float, val_loss: float | None) -> StepRecord:
    return StepRecord(step=step, loss=0.0, val_loss=val_loss, tokens_per_s=0.0, seconds=seconds, plan_epoch=1)


def test_the_comparison_reads_bits_per_byte_at_equal_training_time():
    records = [_record(0, 1.0, None), _record(1, 1.0, 2 * math.log(2)), _record(2, 2.0, None),
               _record(3, 2.0, math.log(2))]
    curve = bench.bits_curve(records, lambda loss: loss / math.log(2))
    assert curve == [(2.0, 2.0), (6.0, 1.0)]
    assert bench.bits_at(curve, 1.5) is None  # before the first validation
    assert bench.bits_at(curve, 2.0) == 2.0
    assert bench.bits_at(curve, 5.0) == pytest.approx(1.25)
    assert bench.bits_at(curve, 6.0) == 1.0
