"""A trained model read back on CPU for `geotrain generate` and `export`: a --save-final file (its [model] and
[data] sections recorded in the safetensors metadata) or a checkpoint's parameters with the [model] section the run
recorded. Files are untrusted input: every tensor is checked against the recorded [model] section before use."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from geotrain.config import DATA_METADATA_KEY, MODEL_METADATA_KEY, ConfigError, ModelSection, build_config
from geotrain.node.model import GPT, family_of

_LISTED = 3  # differing tensors named in an error; more are counted


@dataclass(frozen=True)
class SavedModel:
    """A whole model's parameters (`layers.<i>.<param>`, float32) and the sections of the run that trained it."""

    model: ModelSection
    state: dict[str, torch.Tensor]
    data: dict[str, Any]
    """The run's [data] section as recorded; empty when the source records none (a checkpoint)."""
    where: str

    @classmethod
    def checked(cls, model: Any, state: dict[str, torch.Tensor], data: Any, where: str) -> SavedModel:
        """A SavedModel from a recorded [model] section (a dict) and tensors; ConfigError unless they agree."""
        if not isinstance(model, dict):
            raise ConfigError(f"{where}: the recorded [model] section is not a table")
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the recorded [data] section is not a table")
        try:
            section = build_config({"model": model}).model
        except ConfigError as e:
            raise ConfigError(f"{where}: the recorded [model] section is invalid: {e}") from None
        # The trained weights are all here: the checkpoint the run started from (model.init_from) is not read again.
        section = dataclasses.replace(section, init_from="")
        _check_tensors(section, state, where)
        return cls(section, state, data, where)

    def build(self) -> GPT:
        """The whole model in one process, holding these tensors, in eval mode."""
        return GPT.from_state(self.model, self.state).eval()


def _check_tensors(model: ModelSection, state: dict[str, torch.Tensor], where: str) -> None:
    """ConfigError naming what differs unless `state` holds exactly the model's parameters, float32, of their shapes."""
    family = family_of(model)
    expected = {
        f"layers.{i}.{name}": shape for i in range(model.total_layers) for name, shape in family.layer_params(model, i)
    }
    problems = [f"{name} missing" for name in expected if name not in state]
    problems += [f"{name} unexpected" for name in state if name not in expected]
    problems += [
        f"{name} is {list(state[name].shape)} {state[name].dtype}, not {list(shape)} float32"
        for name, shape in expected.items()
        if name in state and (tuple(state[name].shape) != shape or state[name].dtype != torch.float32)
    ]
    if problems:
        more = f" and {len(problems) - _LISTED} more" if len(problems) > _LISTED else ""
        raise ConfigError(
            f"{where}: its tensors do not match its recorded [model] section: {', '.join(problems[:_LISTED])}{more}"
        )


def read_saved_file(path: str | Path) -> SavedModel:
    """A model written by --save-final; ConfigError for a missing, truncated or foreign file."""
    from safetensors import SafetensorError, safe_open

    where = str(path)
    if not Path(path).is_file():
        raise ConfigError(f"{where}: no such file (a --save-final file or a coordinator's --state-dir)")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            if MODEL_METADATA_KEY not in metadata:
                raise ConfigError(
                    f"{where} is not a model saved by geotrain: its metadata records no [model] section "
                    f"({MODEL_METADATA_KEY!r}; write one with --save-final)"
                )
            state = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{where} is truncated or not a safetensors file ({e})") from None
    try:
        model = json.loads(metadata[MODEL_METADATA_KEY])
        data = json.loads(metadata.get(DATA_METADATA_KEY, "{}"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: its recorded run sections are not valid JSON: {e}") from None
    return SavedModel.checked(model, state, data, where)
