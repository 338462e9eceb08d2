"""The run's figures where people who train models look: a JSON line per committed step and per failure in the
state dir (metrics.jsonl, always, so a run can be plotted afterwards), and the same as TensorBoard scalars under
`--tensorboard DIR` (the optional `tensorboard` package, imported only then)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from geotrain.scheduler.calibration import StepTimings
from geotrain.scheduler.state import StepRecord

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class TensorBoardMissing(RuntimeError):
    """--tensorboard was given, and the tensorboard package is not installed."""


def tensorboard_writer(directory: str) -> Any:
    """A TensorBoard event writer for `directory`; TensorBoardMissing without the package."""
    try:
        import tensorboard  # noqa: F401  (torch's writer needs it, and says so less plainly)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TensorBoardMissing(
            "--tensorboard needs the tensorboard package: pip install 'geotrain[tensorboard]'"
        ) from None
    return SummaryWriter(log_dir=directory)


def node_shares(
    step_s: float, timings: StepTimings | None, microbatches: Mapping[str, int]
) -> dict[str, dict[str, float]]:
    """Each node's share of the step's seconds spent in forward and in backward (of the microbatches that went
    through it, as it measured them), averaging with its replicas, and idle (the rest: waiting on neighbours, the
    network and the coordinator)."""
    if timings is None or step_s <= 0:
        return {}
    shares: dict[str, dict[str, float]] = {}
    for node_id, per_microbatch in sorted(timings.compute_s.items()):
        through = microbatches.get(node_id, 0) / step_s
        compute = min(1.0, per_microbatch * through)
        forward = min(compute, timings.forward_s.get(node_id, 0.0) * through)
        averaging = min(1.0 - compute, timings.averaging_s.get(node_id, 0.0) / step_s)
        shares[node_id] = {
            "forward": forward, "backward": compute - forward, "averaging": averaging,
            "idle": 1.0 - compute - averaging,
        }
    return shares


class RunMetrics:
    """Writes the figures of each committed step and failure: JSON lines to `jsonl` (None: none), and scalars to a
    TensorBoard writer (None: none)."""

    def __init__(self, jsonl: Path | None, tensorboard: Any = None) -> None:
        self._file: TextIO | None = jsonl.open("a", encoding="utf-8") if jsonl is not None else None
        self._tensorboard = tensorboard
        self.failures = 0

    def step(
        self,
        record: StepRecord,
        timings: StepTimings | None,
        microbatches: Mapping[str, int],
        links: Mapping[tuple[str, str], int],
        val_bits_per_byte: float | None,
    ) -> None:
        """A committed step: its loss (and validation loss), tokens/s, seconds, each node's shares (node_shares),
        the wire bytes each link carried so far (sender, receiver) -> bytes, and the failures so far."""
        steps_done = record.step + 1
        shares = node_shares(record.seconds, timings, microbatches)
        line: dict[str, Any] = {
            "kind": "step", "step": steps_done, "time": time.time(), "loss": record.loss,
            "val_loss": record.val_loss, "val_bits_per_byte": val_bits_per_byte,
            "tokens_per_s": record.tokens_per_s, "step_s": record.seconds, "plan_epoch": record.plan_epoch,
            "failures": self.failures, "nodes": shares,
            "link_bytes": {f"{a}->{b}": n for (a, b), n in sorted(links.items())},
        }
        self._write(line)
        scalars = {
            "train/loss": record.loss, "speed/tokens_per_s": record.tokens_per_s, "speed/step_s": record.seconds,
            "run/failures": float(self.failures),
        }
        if record.val_loss is not None:
            scalars["validation/loss"] = record.val_loss
        if val_bits_per_byte is not None:
            scalars["validation/bits_per_byte"] = val_bits_per_byte
        for node_id, parts in shares.items():
            scalars.update({f"node/{node_id}/{part}_share": value for part, value in parts.items()})
        scalars.update({f"link/{a}->{b}/wire_bytes": float(n) for (a, b), n in links.items()})
        self._scalars(scalars, steps_done)

    def failure(self, step: int, why: str) -> None:
        """A failed step (it runs again under a new plan epoch)."""
        self.failures += 1
        self._write({"kind": "failure", "step": step, "time": time.time(), "why": why, "failures": self.failures})
        self._scalars({"run/failures": float(self.failures)}, step)

    def close(self) -> None:
        """Flush and close what it writes to."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def _write(self, line: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def _scalars(self, scalars: Mapping[str, float], step: int) -> None:
        if self._tensorboard is None:
            return
        for tag, value in scalars.items():
            self._tensorboard.add_scalar(tag, value, step)
        self._tensorboard.flush()
