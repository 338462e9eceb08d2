"""`geotrain export`: a trained model as a Hugging Face-format directory (config.json, model.safetensors, and the
tokenizer as tokenizer.json) that transformers' AutoModelForCausalLM and AutoTokenizer load.

llama exports as LlamaForCausalLM (node/llama.py's names, the inverse of model.init_from). byte-gpt exports as
GPT2LMHeadModel, which is the same network: pre-norm LayerNorm blocks (eps 1e-5) with biases, learned positions,
erf GELU (GPT-2's activation_function "gelu"; "gelu_new" would be the tanh one), a 4 d MLP, and its head untied and
without a bias (tie_word_embeddings false); GPT-2's Conv1D holds a Linear's weight transposed.

The directory is written under a temporary name beside --out and renamed into place once every file is whole, so an
interrupted export leaves no --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from geotrain.config import ConfigError, ModelSection
from geotrain.durable import fsync
from geotrain.node.llama import CONFIG_FILE, hf_config, hf_names
from geotrain.node.model import family_of
from geotrain.node.saved import SavedModel
from geotrain.node.tokenizer import TOKENIZER_FILE, Tokenizer, tokenizer_config

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# byte-gpt block parameter -> (GPT-2 name under transformer.h.<i>., whether GPT-2's Conv1D holds it transposed)
_GPT2_BLOCK = {
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "qkv.weight": ("attn.c_attn.weight", True), "qkv.bias": ("attn.c_attn.bias", False),
    "proj.weight": ("attn.c_proj.weight", True), "proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "fc.weight": ("mlp.c_fc.weight", True), "fc.bias": ("mlp.c_fc.bias", False),
    "out.weight": ("mlp.c_proj.weight", True), "out.bias": ("mlp.c_proj.bias", False),
}
_GPT2_ENDS = {
    "tok.weight": "transformer.wte.weight", "pos.weight": "transformer.wpe.weight",
    "ln.weight": "transformer.ln_f.weight", "ln.bias": "transformer.ln_f.bias", "lm.weight": "lm_head.weight",
}


def gpt2_config(cfg: ModelSection) -> dict[str, Any]:
    """The config.json of a byte-gpt model for transformers' GPT2LMHeadModel."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab,
        "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_inner": cfg.mlp_hidden, "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
        # GPT-2's defaults name token 50256, which a byte vocabulary does not have.
        "bos_token_id": None, "eos_token_id": None,
    }


def hf_model(saved: SavedModel) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors by transformers' names) of a saved model; one trained under model.boundary_rank as the
    same network written at full width (ModelFamily.dense_state)."""
    state = family_of(saved.model).dense_state(saved.model, saved.state)
    cfg = dataclasses.replace(saved.model, boundary_rank=0)
    if cfg.family == "llama":
        tensors = {
            theirs: state[f"layers.{i}.{ours}"]
            for i in range(cfg.total_layers)
            for ours, theirs in hf_names(cfg, i).items()
        }
        return {**hf_config(cfg), "torch_dtype": "float32"}, tensors
    tensors = {}
    for name, tensor in state.items():
        _, index, param = name.split(".", 2)
        if 0 < int(index) < cfg.total_layers - 1:
            theirs, transposed = _GPT2_BLOCK[param]
            tensors[f"transformer.h.{int(index) - 1}.{theirs}"] = tensor.t() if transposed else tensor
        else:
            tensors[_GPT2_ENDS[param]] = tensor
    return {**gpt2_config(cfg), "torch_dtype": "float32"}, tensors


def check_out(out: Path) -> None:
    """ConfigError unless --out can be created: absent, or an empty directory."""
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")


def export(saved: SavedModel, tokenizer: Tokenizer, out: Path) -> list[str]:
    """Write the Hugging Face-format directory `out`; returns the names of the files written."""
    from safetensors.torch import save_file

    check_out(out)
    config, tensors = hf_model(saved)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover: the pid is ours
    tmp.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        texts = {
            CONFIG_FILE: json.dumps(config, indent=2),
            TOKENIZER_FILE: tokenizer.hf_json(),
            TOKENIZER_CONFIG_FILE: json.dumps(tokenizer_config(saved.model.seq_len), indent=2),
        }
        for name, text in texts.items():
            (tmp / name).write_text(text)
        for path in tmp.iterdir():
            fsync(path)
        fsync(tmp)
        os.replace(tmp, out)  # an empty --out directory is replaced whole
        fsync(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(p.name for p in out.iterdir())
