"""A coordinator's state dir written by an older geotrain, brought up to date when its run resumes (`--resume`).

Version 2 checkpoints recorded each stage's checksum by sha256 over its parameters in name order; version 3's is
blake3 over the same bytes (framing.parameters_checksum). Checkpoints before version 2 (scheduler.checkpoint) recorded
it over its parameters in the stage's own order: layer by layer, each layer's parameters as its module lists them. A
stage's checksum is now over them in name order, so a node loading such a stage found another checksum than the
recorded one, refused the state, and the run re-planned without end. The old order needs the model's code, which the
coordinator does not have; the command that resumes has it. Each stage file is first checked against the checksum
recorded when it was written, in the old order, and only a file that passes gets its checksum in the new order: a
checksum computed from a file alone would vouch for whatever the file now holds.

It sits at the top of the package: it reads the coordinator's checkpoints with the node's model families.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from geotrain.config import ModelSection, RunConfig
from geotrain.node.model import family_of
from geotrain.scheduler.checkpoint import CHECKPOINT_VERSION, CHECKPOINTS_DIR, CheckpointStore, stage_checksum
from geotrain.scheduler.state import STORE_FILE, RunStore

log = logging.getLogger(__name__)


class UpgradeError(Exception):
    """A state dir that cannot be brought up to date: its message names the file and what to do."""


def layer_order_checksum(
    state: dict[str, torch.Tensor], model: ModelSection, layer_start: int, layer_end: int, diloco: bool
) -> str:
    """A stage's checksum as checkpoints before version 2 recorded it: sha256 over each parameter's name and bytes,
    layer by layer in the order its module lists them; under diloco over the anchor (`sync.anchor.…`), named as the
    parameters. KeyError for a parameter the state lacks."""
    family, prefix = family_of(model), "sync.anchor." if diloco else ""
    digest = hashlib.sha256()
    for index in range(layer_start, layer_end):
        for name in family.state_names(model, index):
            digest.update(name.encode())
            digest.update(state[prefix + name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def recorded_checksum(
    version: int, state: dict[str, torch.Tensor], model: ModelSection, layer_start: int, layer_end: int, diloco: bool
) -> str | None:
    """A stage's checksum as a checkpoint of manifest format `version` (< CHECKPOINT_VERSION) recorded it; None
    where the state lacks a parameter the model has."""
    if version >= 2:
        return stage_checksum(state, diloco, hashlib.sha256)
    try:
        return layer_order_checksum(state, model, layer_start, layer_end, diloco)
    except KeyError:
        return None


def upgrade_checkpoints(state_dir: str | Path, cfg: RunConfig) -> int:
    """Bring the checkpoints in a coordinator's state dir to CHECKPOINT_VERSION, with the stage checksums its
    committed steps recorded; returns how many it converted. UpgradeError names a stage file that fails the checksum
    recorded for it. The step records change first: a conversion cut short leaves manifests to convert again, whose
    files still pass their recorded checksums, and records already converted stay so."""
    diloco = cfg.compression.diloco
    checkpoints = CheckpointStore(Path(state_dir) / CHECKPOINTS_DIR, cfg.scheduler.keep_checkpoints)
    converted, renamed = [], {}
    for manifest in (m for m in checkpoints.complete() if m.version < CHECKPOINT_VERSION):
        checksums = {}
        for entry in manifest.stages:
            if not entry["checksum"]:
                continue  # none recorded: a node loading it finds its checksum computed from the file (checkpoint.py)
            span = (entry["layer_start"], entry["layer_end"])
            state = checkpoints.load_layers(manifest, *span)
            intact = recorded_checksum(manifest.version, state, cfg.model, *span, diloco) == entry["checksum"]
            if not intact:
                raise UpgradeError(
                    f"{manifest.path / entry['file']} does not match the checksum recorded when it was written "
                    f"(changed since, or the run had another compression.replica_sync): move {manifest.path} out "
                    f"of {state_dir} to resume from an older checkpoint"
                )
            checksums[span] = renamed[entry["checksum"]] = stage_checksum(state, diloco)
        converted.append((manifest, checksums))
    if not converted:
        return 0
    store = RunStore(Path(state_dir) / STORE_FILE)
    try:
        store.rename_checksums(renamed)
    finally:
        store.close()
    for manifest, checksums in converted:
        checkpoints.convert(manifest, checksums)
    log.info("converted %d checkpoint(s) in %s to version %d", len(converted), state_dir, CHECKPOINT_VERSION)
    return len(converted)
