"""The llama family: RMSNorm, rotary position embeddings, a SwiGLU MLP and grouped-query attention, written as a
layer list like the byte GPT's (layer 0 embeds token ids, layers 1..n are blocks, the last is the final norm and
the lm head), and Hugging Face-format checkpoints read one layer's tensors at a time.

Parameter names follow transformers' LlamaForCausalLM (`self_attn.q_proj`, `mlp.gate_proj`, ...), so layer i's
tensors map to the checkpoint's by a prefix (`hf_names`) and the numerics follow it operation by operation.

Tied embeddings: layer 0 and the head usually sit on different stages, and sharing one weight across stages would
need its gradient summed between them every step. So `tie_embeddings` ties at the start only: the head starts as a
copy of the embedding (the checkpoint's `model.embed_tokens.weight`, or layer 0's initialisation from the seed) and
the two train apart, as two parameters, on whichever stages hold them; a model trained so is exported untied.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from geotrain.config import ConfigError, ModelSection
from geotrain.node.family import check_index, ModelFamily, on_meta, widen

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
_INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32 as transformers does."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq_len, head_dim) of the rotary embedding of positions 0..seq_len-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with rotary positions; n_kv_heads key/value heads serve groups of query heads."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim, self.base = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.rope_base
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.boundary_width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = (z.to(x.dtype) for z in rotary(t, self.head_dim, self.base, x.device))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        group = self.n_heads // self.kv_heads
        # Query head h reads key/value head h // group, as transformers' repeat_kv arranges them.
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(att.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.boundary_width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: attention, then the MLP, each added to the residual stream (to its first
    boundary-width coordinates: see node/family.py on model.boundary_rank)."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, z: torch.Tensor, rest: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        z = z + self.self_attn(self.input_layernorm(widen(z, rest)))
        return z + self.mlp(self.post_attention_layernorm(widen(z, rest)))


class Embedding(nn.Module):
    """Token embeddings: (B, T) ids -> (B, T, boundary width); positions enter in each block's attention."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.boundary_width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.embed_tokens(idx)


class Head(nn.Module):
    """Final norm and the lm head: (B, T, d) -> (B, T, vocab)."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, z: torch.Tensor, rest: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        return self.lm_head(self.norm(widen(z, rest)))


class Llama(ModelFamily):
    """The llama family, initialised from the seed or read from `model.init_from`."""

    name = "llama"
    learned_positions = False
    fixed_tables = {"embed_tokens.weight": "tok"}
    stream_writers = ("self_attn.o_proj.weight", "mlp.down_proj.weight")

    def construct(self, cfg: ModelSection, index: int) -> nn.Module:  # noqa: D102
        return Embedding(cfg) if index == 0 else Head(cfg) if index == cfg.total_layers - 1 else Block(cfg)

    def initialise(self, layer: nn.Module, cfg: ModelSection, index: int, seed: int) -> None:  # noqa: D102
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() > 1:  # norm scales keep their ones
                    nn.init.normal_(p, mean=0.0, std=_INIT_STD)
            if isinstance(layer, Head) and cfg.tie_embeddings:
                layer.lm_head.weight.copy_(self.build_layer(cfg, 0, seed).embed_tokens.weight)

    def build_layer(self, cfg: ModelSection, index: int, seed: int) -> nn.Module:
        """Layer `index`: from the checkpoint in model.init_from when there is one, else from (seed, index)."""
        if not cfg.init_from:
            return super().build_layer(cfg, index, seed)
        check_index(cfg, index)
        checkpoint = Checkpoint(cfg.init_from)
        checkpoint.check_config(cfg)
        names = hf_names(cfg, index)
        with on_meta():
            layer = self.construct(cfg, index)
        shapes = dict(self.layer_params(cfg, index))
        state = checkpoint.read({ours: (theirs, shapes[ours]) for ours, theirs in names.items()}, cfg)
        layer.load_state_dict(state, strict=True, assign=True)
        return layer

    def check(self, cfg: ModelSection) -> None:
        """With model.init_from: its config.json matches the run config, and every tensor of the model is there."""
        if not cfg.init_from:
            return
        checkpoint = Checkpoint(cfg.init_from)
        checkpoint.check_config(cfg)
        checkpoint.check_files()
        for index in range(cfg.total_layers):
            for theirs in hf_names(cfg, index).values():
                checkpoint.locate(theirs, cfg)


def hf_names(cfg: ModelSection, index: int) -> dict[str, str]:
    """Layer `index`'s parameter names -> the names transformers' LlamaForCausalLM gives the same tensors."""
    check_index(cfg, index)
    if index == 0:
        prefix = "model."
    elif index == cfg.total_layers - 1:
        return {"norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
    else:
        prefix = f"model.layers.{index - 1}."
    return {name: prefix + name for name, _ in Llama().layer_params(cfg, index)}


def hf_config(cfg: ModelSection) -> dict[str, object]:
    """The config.json of this model for transformers' LlamaForCausalLM (the head saved untied: see above)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_hidden, "vocab_size": cfg.vocab,
        "rope_theta": cfg.rope_base, "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": False,
        "max_position_embeddings": cfg.seq_len, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }


def _rope_setting(hf: dict) -> tuple[float | None, str]:
    """(theta, rope type) of a config.json: transformers 5 nests them in rope_parameters, 4.x has rope_theta and
    rope_scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return theta, params.get("rope_type", params.get("type", "default"))


class Checkpoint:
    """A Hugging Face-format directory: config.json and one safetensors file or several with an index, whose
    tensors are read by name, lazily, from the files that hold them."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.where = f"model.init_from {directory}"
        try:
            self.hf_config = json.loads((self.dir / CONFIG_FILE).read_text())
        except OSError as e:
            raise ConfigError(f"{self.where}: cannot read {CONFIG_FILE}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{self.where}: {CONFIG_FILE} is not valid JSON: {e}") from None
        if not isinstance(self.hf_config, dict):
            raise ConfigError(f"{self.where}: {CONFIG_FILE} is not a JSON object")
        self._weight_map: dict[str, str] | None = None

    def differences(self, cfg: ModelSection) -> list[str]:
        """`key X there, Y here` for every setting in which config.json and the run config describe different
        models, the settings this family cannot build included."""
        hf = self.hf_config
        theta, rope_type = _rope_setting(hf)
        heads = hf.get("num_attention_heads")
        ours = [
            ("model.n_layers", hf.get("num_hidden_layers"), cfg.n_layers),
            ("model.d_model", hf.get("hidden_size"), cfg.d_model),
            ("model.n_heads", heads, cfg.n_heads),
            ("model.n_kv_heads", hf.get("num_key_value_heads") or heads, cfg.kv_heads),
            ("model.mlp_width", hf.get("intermediate_size"), cfg.mlp_hidden),
            ("model.vocab_size", hf.get("vocab_size"), cfg.vocab),
            ("model.rope_base", theta, cfg.rope_base),
            ("model.norm_eps", hf.get("rms_norm_eps"), cfg.norm_eps),
            ("model.tie_embeddings", hf.get("tie_word_embeddings", False), cfg.tie_embeddings),
            # What geotrain's llama has no key for: a checkpoint that needs another value cannot be built.
            ("model_type", hf.get("model_type"), "llama"),
            ("head_dim", hf.get("head_dim", cfg.head_dim), cfg.head_dim),
            ("hidden_act", hf.get("hidden_act", "silu"), "silu"),
            ("attention_bias", hf.get("attention_bias", False), False),
            ("mlp_bias", hf.get("mlp_bias", False), False),
            ("rope_type", rope_type, "default"),
        ]
        return [f"{key} {theirs} there, {mine} here" for key, theirs, mine in ours if theirs != mine]

    def check_config(self, cfg: ModelSection) -> None:
        """Raise ConfigError naming every setting in which config.json differs from the run config."""
        differing = self.differences(cfg)
        if differing:
            raise ConfigError(f"{self.where}: {CONFIG_FILE} does not match the run config: {', '.join(differing)}")

    def _open(self, file: str):
        from safetensors import SafetensorError, safe_open

        path = self.dir / file
        if not path.is_file():
            raise ConfigError(f"{self.where}: {file} is missing")
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{self.where}: {file} is truncated or not a safetensors file ({e})") from None

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> the file holding it: from the index of a sharded checkpoint, else from the headers of
        the directory's safetensors files."""
        if self._weight_map is not None:
            return self._weight_map
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{self.where}: {INDEX_FILE} has no readable weight_map ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConfigError(f"{self.where}: {INDEX_FILE}'s weight_map must map tensor names to file names")
            if any(Path(v).name != v for v in weight_map.values()):
                raise ConfigError(f"{self.where}: {INDEX_FILE} names files outside the directory")
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise ConfigError(f"{self.where}: no safetensors files (model.safetensors or {INDEX_FILE})")
            weight_map = {}
            for file in files:
                with self._open(file) as f:
                    weight_map.update(dict.fromkeys(f.keys(), file))
        self._weight_map = weight_map
        return weight_map

    def check_files(self) -> None:
        """Raise ConfigError unless every file of the checkpoint is there and whole (its header and length)."""
        for file in sorted(set(self.weight_map().values())):
            with self._open(file):
                pass

    def locate(self, name: str, cfg: ModelSection) -> tuple[str, str]:
        """(tensor name, file) of a transformers parameter name; a tied head reads the embedding."""
        weight_map = self.weight_map()
        if name not in weight_map and name == "lm_head.weight" and cfg.tie_embeddings:
            name = "model.embed_tokens.weight"
        if name not in weight_map:
            raise ConfigError(f"{self.where}: the checkpoint has no tensor {name}")
        return name, weight_map[name]

    def read(self, wanted: dict[str, tuple[str, tuple[int, ...]]], cfg: ModelSection) -> dict[str, torch.Tensor]:
        """{our name: (transformers name, shape)} -> {our name: float32 tensor}, opening only the files that hold
        those tensors."""
        by_file: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
        for ours, (theirs, shape) in wanted.items():
            name, file = self.locate(theirs, cfg)
            by_file.setdefault(file, []).append((ours, name, shape))
        state: dict[str, torch.Tensor] = {}
        for file, entries in by_file.items():
            with self._open(file) as f:
                for ours, name, shape in entries:
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != shape:
                        raise ConfigError(
                            f"{self.where}: tensor {name} in {file} has shape {list(tensor.shape)}, "
                            f"the run config needs {list(shape)}"
                        )
                    if not tensor.is_floating_point():
                        raise ConfigError(f"{self.where}: tensor {name} in {file} is {tensor.dtype}, not a float")
                    # Checkpoints are often bf16; stages keep float32 master weights.
                    state[ours] = tensor.to(torch.float32)
        log.debug("read %d tensors of %s from %s", len(state), self.dir, ", ".join(by_file))
        return state
