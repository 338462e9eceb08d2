"""The model-family interface: all that stages, the profiler and the planner may know about a model.

A family is an architecture written as an ordered list of layers, so any contiguous range is a stage: layer 0 reads
token ids (B, T), every layer up to the last passes hidden states (B, T, d_model) on, and the last returns logits
(B, T, vocab). Each layer is built from (config, seed, layer index) alone, so a stage builds only its own layers and
still matches the whole model built in one process. The families themselves live in node/model.py (byte-gpt, and
the registry) and node/llama.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from geotrain.config import ModelSection


def check_index(cfg: ModelSection, index: int) -> None:
    """Raise ValueError unless `index` names a layer of the model."""
    last = cfg.total_layers - 1
    if not 0 <= index <= last:
        raise ValueError(f"layer index {index} outside 0..{last}")


class ModelFamily(ABC):
    """One architecture as a list of layers: how to build and initialise each, and the shapes it exchanges."""

    name: ClassVar[str]

    @abstractmethod
    def construct(self, cfg: ModelSection, index: int) -> nn.Module:
        """Layer `index` with torch's default initialisation, on the current default device."""

    @abstractmethod
    def initialise(self, layer: nn.Module, cfg: ModelSection, index: int, seed: int) -> None:
        """Give a constructed layer this family's initial weights; called with the RNG seeded from (seed, index)."""

    def build_layer(self, cfg: ModelSection, index: int, seed: int) -> nn.Module:
        """Layer `index` of the model's layer list, initialised from (seed, index)."""
        check_index(cfg, index)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 100_003 + index)
            layer = self.construct(cfg, index)
            self.initialise(layer, cfg, index, seed)
        return layer

    def check(self, cfg: ModelSection) -> None:
        """Raise ConfigError if the model cannot be built as configured (say, its checkpoint does not match)."""

    def vocab(self, cfg: ModelSection) -> int:
        """Token ids layer 0 reads and the last layer scores."""
        return cfg.vocab

    def boundary_shape(self, cfg: ModelSection, batch: int) -> tuple[int, int, int]:
        """Shape of the hidden states passed between layers (and so between stages) for `batch` samples."""
        return (batch, cfg.seq_len, cfg.d_model)

    def layer_params(self, cfg: ModelSection, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name in the layer's state dict, shape) of each parameter of layer `index`, without allocating them."""
        check_index(cfg, index)
        with torch.device("meta"):
            layer = self.construct(cfg, index)
        return [(name, tuple(p.shape)) for name, p in layer.named_parameters()]

    def param_shapes(self, cfg: ModelSection) -> list[list[tuple[int, ...]]]:
        """Shapes of every layer's parameters, in layer order, as the planner's per-layer inputs."""
        return [[shape for _, shape in self.layer_params(cfg, i)] for i in range(cfg.total_layers)]

    def state_names(self, cfg: ModelSection, index: int) -> list[str]:
        """Keys of layer `index` in a whole-model state dict (`layers.<i>.<param>`, as stages and checkpoints use)."""
        return [f"layers.{index}.{name}" for name, _ in self.layer_params(cfg, index)]
