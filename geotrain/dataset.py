"""Token data sets prepared by `geotrain data prepare`, and the sampling rule every reader shares.

A prepared data set is a directory: `manifest.json` (format, token counts and UTF-8 bytes per split, sha256 per
shard, the tokenizer's sha256 and vocabulary), token shards (`train-NNNNN.bin`, `val-NNNNN.bin`: raw little-endian
uint16 or uint32 ids, read through numpy memmaps, so a data set larger than memory works) and the tokenizer it was
made with (`tokenizer.json`). The coordinator reads it; nodes get a microbatch's windows from the coordinator.

Samples of a microbatch are a pure function of (run seed, step, microbatch id): `window_starts` is the one rule, for
the byte corpus (node/data.py) and for prepared data alike, so recomputation after a failure gets the same tokens.
numpy only: the coordinator (scheduler/) and train-local (node/) both import this.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT = 1
DTYPES = ("uint16", "uint32")
SPLITS = ("train", "val")

# Salts keep the train and validation streams independent of each other.
_TRAIN, _VAL = 0, 1


class DatasetError(ValueError):
    """A prepared data set is missing, malformed or does not fit the run; the message says which and why."""


def window_starts(
    *, seed: int, step: int, microbatch: int, size: int, seq_len: int, length: int, validation: bool
) -> np.ndarray:
    """Where each of a microbatch's `size` windows of seq_len + 1 tokens starts in a split of `length` tokens."""
    rng = np.random.default_rng([seed, _VAL if validation else _TRAIN, step, microbatch])
    return rng.integers(0, length - seq_len - 1, size=size)


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every token id."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def sha256_file(path: Path) -> str:
    """sha256 of a file, read a few MiB at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


class TokenSplit:
    """One split's shards as one sequence of token ids, read through memmaps."""

    def __init__(self, shards: list[np.ndarray]) -> None:
        self._shards = [s for s in shards if len(s)]
        self._ends = np.cumsum([len(s) for s in self._shards], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) as int64, across shard boundaries."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        shard = int(np.searchsorted(self._ends, start, side="right"))
        while done < count:
            begin = int(self._ends[shard - 1]) if shard else 0
            piece = self._shards[shard][start + done - begin : start + count - begin]
            out[done : done + len(piece)] = piece
            done += len(piece)
            shard += 1
        return out


@dataclass
class PreparedDataset:
    """A prepared data set opened for sampling: its splits, vocabulary, byte counts and fingerprint."""

    directory: Path
    manifest: dict
    fingerprint: str  # sha256 of manifest.json, which holds every shard's and the tokenizer's sha256
    train: TokenSplit
    val: TokenSplit

    @classmethod
    def open(cls, directory: str | Path, *, verify: bool = False) -> PreparedDataset:
        """Open the data set `geotrain data prepare` wrote to `directory`; with verify, check every shard's sha256
        (and the tokenizer's) against the manifest. DatasetError names what is wrong."""
        directory = Path(directory)
        try:
            raw = (directory / MANIFEST).read_bytes()
        except OSError as e:
            raise DatasetError(f"{directory} is no prepared data set: cannot read {MANIFEST}: {e.strerror}") from None
        try:
            manifest = json.loads(raw)
            _check_manifest(manifest)
        except (ValueError, TypeError, KeyError) as e:
            raise DatasetError(f"{directory / MANIFEST} is malformed: {e}") from None
        splits = {}
        for split in SPLITS:
            shards = []
            for shard in manifest["splits"][split]["shards"]:
                path = directory / shard["file"]
                try:
                    size = path.stat().st_size
                except OSError as e:
                    raise DatasetError(f"cannot read shard {path}: {e.strerror}") from None
                width = np.dtype(manifest["dtype"]).itemsize
                if size != shard["tokens"] * width:
                    raise DatasetError(f"shard {path} holds {size} bytes, the manifest says {shard['tokens'] * width}")
                if verify and sha256_file(path) != shard["sha256"]:
                    raise DatasetError(f"shard {path} fails its sha256: the data set changed after it was prepared")
                shards.append(np.memmap(path, dtype=np.dtype(manifest["dtype"]).newbyteorder("<"), mode="r")
                              if size else np.empty(0, dtype=manifest["dtype"]))
            splits[split] = TokenSplit(shards)
        if verify:
            tokenizer = directory / TOKENIZER
            try:
                digest = sha256_file(tokenizer)
            except OSError as e:
                raise DatasetError(f"cannot read {tokenizer}: {e.strerror}") from None
            if digest != manifest["tokenizer"]["sha256"]:
                raise DatasetError(f"{tokenizer} is not the tokenizer the data set was prepared with")
        fingerprint = hashlib.sha256(raw).hexdigest()
        return cls(directory, manifest, fingerprint, splits["train"], splits["val"])

    @property
    def vocab_size(self) -> int:
        """Token ids of the tokenizer: the model's vocabulary must hold at least this many."""
        return int(self.manifest["tokenizer"]["vocab_size"])

    def check_fits(self, *, vocab: int, seq_len: int) -> None:
        """DatasetError unless a model of `vocab` token ids can read every token and each split holds a window."""
        if vocab < self.vocab_size:
            raise DatasetError(
                f"the tokenizer of {self.directory} has {self.vocab_size} tokens, more than model.vocab_size "
                f"({vocab}): set model.vocab_size to at least {self.vocab_size}"
            )
        for name, split in (("training", self.train), ("validation", self.val)):
            if len(split) <= seq_len + 1:
                raise DatasetError(
                    f"{self.directory}'s {name} split holds {len(split)} tokens; it needs more than model.seq_len + 1 "
                    f"({seq_len + 1})"
                )

    def windows(
        self, *, seed: int, step: int, microbatch: int, size: int, seq_len: int, validation: bool = False
    ) -> np.ndarray:
        """A microbatch's windows: (size, seq_len + 1) int64 token ids, inputs then the next token's targets."""
        split = self.val if validation else self.train
        starts = window_starts(
            seed=seed, step=step, microbatch=microbatch, size=size, seq_len=seq_len, length=len(split),
            validation=validation,
        )
        return np.stack([split.read(int(s), seq_len + 1) for s in starts])

    def bits_per_byte(self, loss: float) -> float:
        """A validation loss in nats per token as bits per UTF-8 byte of the validation text."""
        val = self.manifest["splits"]["val"]
        return bits_per_byte(loss, val["tokens"], val["bytes"])


def bits_per_byte(loss: float, tokens: int, text_bytes: int) -> float:
    """Nats per token over `tokens` tokens that encode `text_bytes` bytes, as bits per byte: comparable between a
    byte model (one token per byte: loss / ln 2) and a BPE one."""
    return loss * tokens / text_bytes / math.log(2)


def _check_manifest(m: dict) -> None:
    """ValueError (or KeyError, TypeError) naming the first thing a manifest lacks."""
    if m.get("format") != FORMAT:
        raise ValueError(f"format {m.get('format')!r}, this geotrain reads format {FORMAT}")
    if m["dtype"] not in DTYPES:
        raise ValueError(f"dtype {m['dtype']!r} is not one of {', '.join(DTYPES)}")
    vocab = m["tokenizer"]["vocab_size"]
    if not isinstance(vocab, int) or not 0 < vocab <= np.iinfo(m["dtype"]).max + 1:
        raise ValueError(f"tokenizer.vocab_size {vocab!r} does not fit {m['dtype']}")
    for split in SPLITS:
        s = m["splits"][split]
        if not all(isinstance(s[k], int) and s[k] >= 0 for k in ("tokens", "bytes")):
            raise ValueError(f"splits.{split} needs non-negative integer tokens and bytes")
        if s["tokens"] and not s["bytes"]:
            raise ValueError(f"splits.{split} holds tokens but no text bytes")
        shards = s["shards"]
        for shard in shards:
            name = shard["file"]
            if not isinstance(name, str) or Path(name).name != name or name in (MANIFEST, TOKENIZER):
                raise ValueError(f"shard file {name!r} is not a plain file name of the data set")
        if sum(shard["tokens"] for shard in shards) != s["tokens"]:
            raise ValueError(f"splits.{split}: its shards do not add up to {s['tokens']} tokens")
