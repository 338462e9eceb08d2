"""The byte corpus and the sampling rule every node shares.

Samples of a microbatch are a pure function of (run seed, step, microbatch id), so any node (the data head, the
last stage that needs the targets, a node redoing a microbatch after a failure) recomputes the same bytes.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from geotrain.config import DataSection

# Salts keep the train and validation streams independent of each other.
_TRAIN, _VAL = 0, 1


def corpus_files(paths: list[str]) -> list[Path]:
    """The files of the corpus in a stable order; default: the Python standard library's own source."""
    if not paths:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    files: list[Path] = []
    for pattern in paths:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        files.extend(Path(m) for m in matches if Path(m).is_file())
    if not files:
        raise ValueError(f"data.paths {paths} match no files")
    return files


@dataclass
class Corpus:
    """The corpus bytes split into a training part and a held-out validation tail."""

    train: np.ndarray
    val: np.ndarray
    fingerprint: str

    @classmethod
    def load(cls, cfg: DataSection) -> Corpus:
        """Read the corpus as the config describes it."""
        chunks, total = [], 0
        for path in corpus_files(cfg.paths):
            data = path.read_bytes()[: cfg.max_bytes - total]
            chunks.append(data)
            total += len(data)
            if total >= cfg.max_bytes:
                break
        raw = b"".join(chunks)
        split = int(len(raw) * (1 - cfg.val_fraction))
        arr = np.frombuffer(raw, dtype=np.uint8)
        return cls(train=arr[:split], val=arr[split:], fingerprint=hashlib.sha256(raw).hexdigest())

    def batch(
        self, *, seed: int, step: int, microbatch: int, size: int, seq_len: int, validation: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, each (size, seq_len) int64, for one microbatch."""
        data = self.val if validation else self.train
        if len(data) <= seq_len + 1:
            raise ValueError(f"corpus split of {len(data)} bytes is too small for seq_len {seq_len}")
        rng = np.random.default_rng([seed, _VAL if validation else _TRAIN, step, microbatch])
        starts = rng.integers(0, len(data) - seq_len - 1, size=size)
        windows = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(windows)
        return t[:, :-1], t[:, 1:]
