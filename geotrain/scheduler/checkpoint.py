"""Checkpoints on the coordinator: per-stage safetensors files plus a manifest written last.

A checkpoint is written into a temporary directory, every file fsynced, the manifest written to a temporary name,
fsynced and renamed, then the directory renamed into place and its parent fsynced. A directory without its
manifest is not a checkpoint: a crash at any point leaves the previous complete one as the latest.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from geotrain.durable import fsync
from geotrain.protocol import framing

log = logging.getLogger(__name__)

_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"
CHECKPOINTS_DIR = "checkpoints"
"""Where a coordinator's --state-dir keeps its checkpoints."""
CHECKPOINT_VERSION = 2
"""The manifest's format: 2 records each stage's checksum over its parameters in name order (stage_checksum); 1 (a
manifest without a version) in the stage's own order, layer by layer, which `--resume` converts (geotrain.upgrade)."""


@dataclass(frozen=True)
class StageState:
    """One stage's parameters and optimizer state at a step, with its parameter checksum."""

    layer_start: int
    layer_end: int
    checksum: str
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint."""

    path: Path
    steps_done: int
    plan_epoch: int
    stages: list[dict]
    version: int


def stage_checksum(state: dict[str, torch.Tensor], diloco: bool) -> str:
    """The checksum a stage's replicas report (node.stage: framing.parameters_checksum) of a state as transfers and
    checkpoints hold it: over its parameters (`layers.…`), or under diloco over its anchor (`sync.anchor.layers.…`)
    under the parameters' names."""
    prefix = "sync.anchor." if diloco else ""
    return framing.parameters_checksum(
        (name.removeprefix(prefix), t) for name, t in state.items() if name.startswith(prefix + "layers.")
    )


def layer_of(name: str) -> int:
    """The layer index of a state name (`layers.<i>.…`, `optim.layers.<i>.…` or `sync.<slot>.layers.<i>.…`)."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


class CheckpointStore:
    """The checkpoints of one run under `root`, keeping the newest `keep`."""

    def __init__(self, root: str | Path, keep: int) -> None:
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def write(
        self, steps_done: int, plan_epoch: int, stages: list[StageState], before_manifest: Callable[[], None] | None = None
    ) -> Manifest:
        """Write a complete checkpoint; `before_manifest` is a fault-injection point for tests."""
        tmp = self.root / f".step-{steps_done:08d}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        entries = []
        for stage in stages:
            name = f"stage-{stage.layer_start:04d}-{stage.layer_end:04d}.safetensors"
            save_file({k: v.contiguous() for k, v in stage.tensors.items()}, str(tmp / name))
            fsync(tmp / name)
            entries.append(
                {"layer_start": stage.layer_start, "layer_end": stage.layer_end, "file": name, "checksum": stage.checksum}
            )
        if before_manifest is not None:
            before_manifest()
        manifest = {
            "version": CHECKPOINT_VERSION, "steps_done": steps_done, "plan_epoch": plan_epoch, "stages": entries,
            "written_at": time.time(),
        }
        _write_manifest(tmp, manifest)
        final = self.root / f"step-{steps_done:08d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync(self.root)
        self._prune()
        log.info("checkpoint of step %d written to %s", steps_done, final)
        return Manifest(final, steps_done, plan_epoch, entries, CHECKPOINT_VERSION)

    def complete(self) -> list[Manifest]:
        """Every complete checkpoint, oldest first."""
        found = []
        for path in sorted(self.root.iterdir()):
            if _DIR.match(path.name) and (path / MANIFEST).is_file():
                data = json.loads((path / MANIFEST).read_text())
                found.append(
                    Manifest(path, data["steps_done"], data["plan_epoch"], data["stages"], data.get("version", 1))
                )
        return found

    def latest(self, at_most: int | None = None) -> Manifest | None:
        """The newest complete checkpoint, optionally no later than `at_most` steps."""
        usable = [m for m in self.complete() if at_most is None or m.steps_done <= at_most]
        return usable[-1] if usable else None

    def load_layers(self, manifest: Manifest, layer_start: int, layer_end: int) -> dict[str, torch.Tensor]:
        """Parameters and optimizer state of layers [layer_start, layer_end) from a checkpoint."""
        state: dict[str, torch.Tensor] = {}
        for entry in manifest.stages:
            if entry["layer_end"] <= layer_start or entry["layer_start"] >= layer_end:
                continue
            for name, tensor in load_file(str(manifest.path / entry["file"])).items():
                if layer_start <= layer_of(name) < layer_end:
                    state[name] = tensor
        return state

    def checksum(self, manifest: Manifest, layer_start: int, layer_end: int, diloco: bool) -> str:
        """The checksum a node that loads layers [layer_start, layer_end) from this checkpoint must find: the one
        recorded for a stage of exactly this range, else computed from the checkpoint's tensors (layers the plan
        moved), which were checked against the recorded ones when it was written (scheduler.recovery)."""
        for entry in manifest.stages:
            if (entry["layer_start"], entry["layer_end"]) == (layer_start, layer_end) and entry["checksum"]:
                return entry["checksum"]
        return stage_checksum(self.load_layers(manifest, layer_start, layer_end), diloco)

    def convert(self, manifest: Manifest, checksums: dict[tuple[int, int], str]) -> None:
        """Record `checksums` (layer range -> stage_checksum) in an older checkpoint's manifest, which becomes
        CHECKPOINT_VERSION's; the caller checked the stage files they are computed from (geotrain.upgrade)."""
        data = json.loads((manifest.path / MANIFEST).read_text())
        for entry in data["stages"]:
            entry["checksum"] = checksums.get((entry["layer_start"], entry["layer_end"]), entry["checksum"])
        data["version"] = CHECKPOINT_VERSION
        _write_manifest(manifest.path, data)

    def _prune(self) -> None:
        complete = self.complete()
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old.path, ignore_errors=True)
        for partial in self.root.glob(".step-*.tmp-*"):
            if not partial.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(partial, ignore_errors=True)


def _write_manifest(directory: Path, manifest: dict) -> None:
    """Write a checkpoint's manifest whole or not at all: to a temporary name, fsynced, renamed, the rename fsynced."""
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    fsync(tmp)
    os.replace(tmp, directory / MANIFEST)
    fsync(directory)
