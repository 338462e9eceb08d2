"""The model zoo: the families behind node/family.py's interface, chosen by model.family, and the byte-level GPT,
built as an ordered list of layers, so any contiguous range is a stage.

Layer 0 embeds bytes and positions, layers 1..n are transformer blocks, the last layer is the final norm and the
output head. Under model.boundary_rank = k the embedding is k wide, the blocks write k coordinates and read the
stream rebuilt with the fixed ones (node/family.py). Each layer is initialised from (seed, layer index) alone, so
a stage builds only its own layers and still matches the whole model built in one process.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from geotrain.config import ModelSection
from geotrain.node.family import call_layer, ModelFamily, on_meta, widen
from geotrain.node.llama import Llama

VOCAB = 256


class Embedding(nn.Module):
    """Token and position embeddings: (B, T) bytes -> (B, T, boundary width)."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, cfg.boundary_width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.boundary_width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # noqa: D102
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention; it writes the stream's first boundary-width
    coordinates (all of them without model.boundary_rank)."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.boundary_width)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.boundary_width)

    def forward(self, z: torch.Tensor, rest: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        x = widen(z, rest)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (h.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for h in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        z = z + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return z + self.out(F.gelu(self.fc(self.ln2(widen(z, rest)))))


class Head(nn.Module):
    """Final norm and projection to byte logits: (B, T, d) -> (B, T, 256)."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, VOCAB, bias=False)

    def forward(self, z: torch.Tensor, rest: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        return self.lm(self.ln(widen(z, rest)))


def _init_weights(module: nn.Module, n_layers: int) -> None:
    for name, p in module.named_parameters():
        if p.dim() == 1:
            continue  # biases and norm parameters keep their zero / one defaults
        std = 0.02
        if name.startswith(("proj.", "out.")):
            std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2: scale residual projections by depth
        nn.init.normal_(p, mean=0.0, std=std)


class ByteGPT(ModelFamily):
    """The byte-level GPT: the zero-setup default."""

    name = "byte-gpt"
    learned_positions = True
    fixed_tables = {"tok.weight": "tok", "pos.weight": "pos"}
    stream_writers = ("proj.weight", "proj.bias", "out.weight", "out.bias")

    def construct(self, cfg: ModelSection, index: int) -> nn.Module:  # noqa: D102
        return Embedding(cfg) if index == 0 else Head(cfg) if index == cfg.total_layers - 1 else Block(cfg)

    def initialise(self, layer: nn.Module, cfg: ModelSection, index: int, seed: int) -> None:  # noqa: D102
        _init_weights(layer, cfg.n_layers)


FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (ByteGPT(), Llama())}


def family_of(cfg: ModelSection) -> ModelFamily:
    """The family model.family names."""
    return FAMILIES[cfg.family]


def build_layer(cfg: ModelSection, index: int, seed: int) -> nn.Module:
    """Layer `index` of the model's layer list, initialised from (seed, index) (or read from model.init_from)."""
    return family_of(cfg).build_layer(cfg, index, seed)


class GPT(nn.Module):
    """The whole model; its state_dict keys are `layers.<i>.<param>`, the same names stages use."""

    def __init__(self, cfg: ModelSection, seed: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(build_layer(cfg, i, seed) for i in range(cfg.total_layers))
        self.fixed = family_of(cfg).fixed_embedding(cfg)

    @classmethod
    def from_state(cls, cfg: ModelSection, state: dict[str, torch.Tensor]) -> GPT:
        """The model holding `state`'s tensors; its layers are built on the meta device, so none is initialised
        only to be overwritten."""
        with on_meta():
            model = cls(cfg, seed=0)
        model.load_state_dict(state, strict=True, assign=True)
        return model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # noqa: D102
        rest = None if self.fixed is None else self.fixed(idx)
        x = self.layers[0](idx)
        for layer in self.layers[1:]:
            x = call_layer(layer, x, rest)
        return x


def load_gpt(path: str | Path, cfg: ModelSection) -> GPT:
    """Load a model saved with --save-final (a safetensors state_dict) for the given model config."""
    from safetensors.torch import load_file

    return GPT.from_state(cfg, load_file(str(path)))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
