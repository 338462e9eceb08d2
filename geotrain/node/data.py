"""Where a node's tokens come from: the byte corpus every node reads itself (the default), or a prepared data set,
read in this process by train-local and fetched a microbatch at a time from the coordinator by pipeline nodes.

Samples of a microbatch are a pure function of (run seed, step, microbatch id) (geotrain.dataset.window_starts), so
any node (the data head, the last stage that needs the targets, a node redoing a microbatch after a failure) gets
the same tokens.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from geotrain.config import DataSection, RunConfig
from geotrain.dataset import PreparedDataset, bits_per_byte, window_starts
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.transport import call_with_retry

# Seconds a node waits for a microbatch's windows from the coordinator.
_WINDOWS_DEADLINE_S = 30.0


class Tokens(Protocol):
    """A source of microbatches: the byte corpus, a prepared data set here, or the coordinator's windows."""

    def batch(
        self, *, seed: int, step: int, microbatch: int, size: int, seq_len: int, validation: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (size, seq_len) int64, for one microbatch."""
        ...


class WindowsRefused(RuntimeError):
    """The coordinator's windows are not the run's (another data set) or not the shape asked for."""


def _inputs_and_targets(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(windows)
    return t[:, :-1], t[:, 1:]


def corpus_files(paths: list[str]) -> list[Path]:
    """The files of the corpus in a stable order; default: the Python standard library's own source."""
    if not paths:
        # os.walk and a sort of part tuples give Path.rglob's sorted order at a fifteenth of its cost; every node and
        # train-local read the default corpus at start.
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        found: list[tuple[str, ...]] = []
        for root, dirs, names in os.walk(stdlib):
            dirs[:] = [d for d in dirs if d != "site-packages"]
            parent = Path(root).relative_to(stdlib).parts
            found.extend((*parent, name) for name in names if name.endswith(".py"))
        return [stdlib.joinpath(*parts) for parts in sorted(found)]
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
        starts = window_starts(
            seed=seed, step=step, microbatch=microbatch, size=size, seq_len=seq_len, length=len(data),
            validation=validation,
        )
        return _inputs_and_targets(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64))

    def bits_per_byte(self, loss: float) -> float:
        """A loss in nats per byte as bits per byte."""
        return bits_per_byte(loss, 1, 1)


@dataclass
class PreparedTokens:
    """A prepared data set read in this process (train-local)."""

    dataset: PreparedDataset

    def batch(
        self, *, seed: int, step: int, microbatch: int, size: int, seq_len: int, validation: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (size, seq_len) int64, for one microbatch."""
        return _inputs_and_targets(
            self.dataset.windows(
                seed=seed, step=step, microbatch=microbatch, size=size, seq_len=seq_len, validation=validation
            )
        )

    def bits_per_byte(self, loss: float) -> float:
        """A validation loss in nats per token as bits per byte of the validation text."""
        return self.dataset.bits_per_byte(loss)


def local_tokens(cfg: RunConfig) -> Corpus | PreparedTokens:
    """The run's data read in this process: the prepared data set if the config names one, else the byte corpus."""
    if cfg.data.prepared:
        return PreparedTokens(PreparedDataset.open(cfg.data.prepared))
    return Corpus.load(cfg.data)


class CoordinatorTokens:
    """A prepared data set's windows fetched from the coordinator a microbatch at a time. The current step's are
    kept: the data head and the last stage of a one-stage plan, or a microbatch issued again, ask once."""

    def __init__(self, coordinator: rpc.CoordinatorStub, node_id: Callable[[], str], cfg: RunConfig) -> None:
        self._coordinator = coordinator
        self._node_id = node_id
        self._cfg = cfg
        self._lock = threading.Lock()
        self._kept: dict[tuple[int, bool, int], np.ndarray] = {}

    def batch(
        self, *, seed: int, step: int, microbatch: int, size: int, seq_len: int, validation: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (size, seq_len) int64, for one microbatch of the run (its seed)."""
        key = (step, validation, microbatch)
        with self._lock:
            windows = self._kept.get(key)
        if windows is None:
            windows = self._fetch(step, microbatch, validation, size, seq_len)
            with self._lock:
                self._kept = {k: v for k, v in self._kept.items() if k[0] >= step}
                self._kept[key] = windows
        return _inputs_and_targets(windows.copy())

    def _fetch(self, step: int, microbatch: int, validation: bool, size: int, seq_len: int) -> np.ndarray:
        request = pb.WindowsRequest(node_id=self._node_id(), step=step, microbatch=microbatch, validation=validation)
        reply = call_with_retry(lambda: self._coordinator.Windows(request, timeout=_WINDOWS_DEADLINE_S))
        return check_windows(reply, self._cfg, size, seq_len)


def check_windows(reply: pb.WindowsReply, cfg: RunConfig, size: int, seq_len: int) -> np.ndarray:
    """The reply's windows as (size, seq_len + 1) int64; WindowsRefused unless they are the run's data set's, of
    that shape, with every id inside the model's vocabulary."""
    if reply.fingerprint != cfg.data.fingerprint:
        raise WindowsRefused(
            f"the coordinator serves data set {reply.fingerprint[:12]}, this node joined a run on "
            f"{cfg.data.fingerprint[:12]}"
        )
    if (reply.rows, reply.cols) != (size, seq_len + 1) or len(reply.tokens) != size * (seq_len + 1) * 4:
        raise WindowsRefused(
            f"windows of {reply.rows} x {reply.cols} in {len(reply.tokens)} bytes, expected {size} x {seq_len + 1}"
        )
    windows = np.frombuffer(reply.tokens, dtype="<u4").reshape(size, seq_len + 1)
    if windows.size and int(windows.max()) >= cfg.model.vocab:
        raise WindowsRefused(f"token id {int(windows.max())} outside the model's {cfg.model.vocab}")
    return windows.astype(np.int64)
