"""The model-family interface: all that stages, the profiler and the planner may know about a model.

A family is an architecture written as an ordered list of layers, so any contiguous range is a stage: layer 0 reads
token ids (B, T), every layer up to the last passes hidden states (B, T, d_model; k under model.boundary_rank) on,
and the last returns logits (B, T, vocab). Each layer is built from (config, seed, layer index) alone, so a stage
builds only its own layers and still matches the whole model built in one process. The families themselves live in
node/model.py (byte-gpt, and the registry) and node/llama.py.

model.boundary_rank = k: every block writes into the first k coordinates of the residual stream only (its attention
and MLP output projections have k rows), and the other d_model - k coordinates hold a fixed, untrained embedding of
the token (and, for byte-gpt, its position). So layers pass on z (B, T, k), a stage boundary carries k values per
token, and a layer rebuilds the stream as x = [z ; fixed(tokens)] (`widen`) from the microbatch's token ids, which
every node can recompute from (seed, step, microbatch id). train-local runs the very same layers, so a pipeline
computes what it computes, however the model is cut.

Why this form. Protocol Models' subspace networks (Ramasinghe et al., Pluralis, 2025) fix one orthonormal basis U
(d x k) shared by all layers, keep the output projections' weights inside span(U) by projecting them after every
optimizer step, and add back a high-rank embedding "shift" that every stage recomputes from the token ids. Here that
constraint is the parameterisation: the projections have k rows and U is the first k coordinate axes. The weights
cannot leave the subspace, AdamW stays as it is, and the reconstruction is a concatenation: exact in every precision,
with no d x k matmul (any fixed orthonormal U is this model up to a rotation of the weights that read the stream,
except LayerNorm's per-coordinate gains). The fixed coordinates are not trained, as the paper's shift is not: every
stage uses them, and training them would need their gradient summed across stages every step. They come from a
constant seed, so they are a function of [model] alone and a saved model needs no run seed. The trained embedding
(k wide, layer 0) gets its gradient back through the boundaries like any activation. Residual bottlenecks (learned
down and up projections at the stage boundaries) were not chosen: they depend on where the stages are cut, which a
re-plan changes, and they are lossy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from geotrain.config import ModelSection

_FIXED_SEED = 0x5EED  # the fixed coordinates depend on [model] alone (see the module's note)
_FIXED_STD = 0.02  # as the trained embeddings start


def check_index(cfg: ModelSection, index: int) -> None:
    """Raise ValueError unless `index` names a layer of the model."""
    last = cfg.total_layers - 1
    if not 0 <= index <= last:
        raise ValueError(f"layer index {index} outside 0..{last}")


class FixedEmbedding(nn.Module):
    """The residual stream's d_model - k fixed coordinates under model.boundary_rank = k: a table per token id and,
    where the family has learned positions, per position; buffers, never trained nor saved."""

    def __init__(self, vocab: int, positions: int, width: int) -> None:
        super().__init__()
        # On the CPU whatever the default device (a model built on meta still gets real tables), from one generator.
        gen = torch.Generator().manual_seed(_FIXED_SEED)
        tok = torch.randn(vocab, width, generator=gen, device="cpu") * _FIXED_STD
        self.register_buffer("tok", tok, persistent=False)
        pos = torch.randn(positions, width, generator=gen, device="cpu") * _FIXED_STD if positions else None
        self.register_buffer("pos", pos, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # noqa: D102
        rest = F.embedding(idx, self.tok)
        return rest if self.pos is None else rest + self.pos[: idx.shape[1]]


def widen(z: torch.Tensor, rest: torch.Tensor | None) -> torch.Tensor:
    """The residual stream from a layer's input: z itself, or under model.boundary_rank its k coordinates followed
    by the fixed ones."""
    return z if rest is None else torch.cat((z, rest.to(z.dtype)), dim=-1)


def call_layer(layer: nn.Module, x: torch.Tensor, rest: torch.Tensor | None) -> torch.Tensor:
    """Run one layer: layers after the first take the fixed coordinates too under model.boundary_rank (rest, None
    for layer 0 and without the option)."""
    return layer(x) if rest is None else layer(x, rest)


class _SkipMetaFills(TorchFunctionMode):
    """Skips in-place ops on meta tensors, which have no data to change: a layer built on the meta device (for its
    parameters' shapes, or to take a saved state) still runs its initialisers, and torch's meta kernels for random
    fills import torch._dynamo: about 2 s of CPU in a process that never trains (`geotrain export`, `generate`,
    `plan`, the coordinator)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target, name = args[0] if args else kwargs.get("tensor"), getattr(func, "__name__", "")  # init.* pass tensor=
        if isinstance(target, torch.Tensor) and target.is_meta and name.endswith("_") and not name.startswith("_"):
            return target  # normal_, uniform_, zero_, fill_, ...: in place, so the result is the tensor itself
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Construct modules on the meta device, their initialisers skipped."""
    with _SkipMetaFills(), torch.device("meta"):
        yield


class ModelFamily(ABC):
    """One architecture as a list of layers: how to build and initialise each, and the shapes it exchanges."""

    name: ClassVar[str]
    learned_positions: ClassVar[bool]  # layer 0 embeds positions (else they enter in the blocks' attention)
    # Under model.boundary_rank: layer 0's tables -> the fixed table holding the stream's other coordinates, and the
    # blocks' parameters that write the stream (their rows are its first coordinates).
    fixed_tables: ClassVar[dict[str, str]]
    stream_writers: ClassVar[tuple[str, ...]]

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

    def empty_layer(self, cfg: ModelSection, index: int, device: torch.device) -> nn.Module:
        """Layer `index` on `device` with uninitialised parameters, for a saved state to be loaded into: a returning
        node skips drawing hundreds of millions of initial values only to overwrite them. Layers hold no buffers (a
        buffer would stay uninitialised too: test_llama checks)."""
        check_index(cfg, index)
        with on_meta():
            layer = self.construct(cfg, index)
        return layer.to_empty(device=device)

    def check(self, cfg: ModelSection) -> None:
        """Raise ConfigError if the model cannot be built as configured (say, its checkpoint does not match)."""

    def vocab(self, cfg: ModelSection) -> int:
        """Token ids layer 0 reads and the last layer scores."""
        return cfg.vocab

    def boundary_shape(self, cfg: ModelSection, batch: int) -> tuple[int, int, int]:
        """Shape of the hidden states passed between layers (and so between stages) for `batch` samples."""
        return (batch, cfg.seq_len, cfg.boundary_width)

    def fixed_embedding(self, cfg: ModelSection) -> FixedEmbedding | None:
        """The fixed coordinates every layer after the first rebuilds the stream with (see the module's note); None
        when the stream is the boundary (model.boundary_rank off, or d_model)."""
        if cfg.boundary_width == cfg.d_model:
            return None
        positions = cfg.seq_len if self.learned_positions else 0
        return FixedEmbedding(self.vocab(cfg), positions, cfg.d_model - cfg.boundary_width)

    def dense_state(self, cfg: ModelSection, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole-model state as the same network without model.boundary_rank (for export): layer 0's tables
        followed by the fixed ones, the writers' rows followed by zero rows, which add nothing to the fixed
        coordinates."""
        fixed = self.fixed_embedding(cfg)
        if fixed is None:
            return dict(state)
        dense = {}
        for name, tensor in state.items():
            _, index, param = name.split(".", 2)
            if index == "0" and param in self.fixed_tables:
                tensor = torch.cat((tensor, getattr(fixed, self.fixed_tables[param]).to(tensor.dtype)), dim=1)
            elif index != "0" and param in self.stream_writers:
                tensor = torch.cat((tensor, tensor.new_zeros(cfg.d_model - tensor.shape[0], *tensor.shape[1:])))
            dense[name] = tensor
        return dense

    def layer_params(self, cfg: ModelSection, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name in the layer's state dict, shape) of each parameter of layer `index`, without allocating them."""
        check_index(cfg, index)
        with on_meta():
            layer = self.construct(cfg, index)
        return [(name, tuple(p.shape)) for name, p in layer.named_parameters()]

    def param_shapes(self, cfg: ModelSection) -> list[list[tuple[int, ...]]]:
        """Shapes of every layer's parameters, in layer order, as the planner's per-layer inputs."""
        return [[shape for _, shape in self.layer_params(cfg, i)] for i in range(cfg.total_layers)]

    def state_names(self, cfg: ModelSection, index: int) -> list[str]:
        """Keys of layer `index` in a whole-model state dict (`layers.<i>.<param>`, as stages and checkpoints use)."""
        return [f"layers.{index}.{name}" for name, _ in self.layer_params(cfg, index)]
