"""`geotrain train-local`: the same run in one process, the reference the pipeline must equal."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from geotrain.config import LossScale, RunConfig
from geotrain.node.data import Tokens, local_tokens
from geotrain.node.device import make_exact, peak_memory_bytes
from geotrain.node.model import loss_fn
from geotrain.node.stage import StageRuntime


def _batch(
    cfg: RunConfig, corpus: Tokens, step: int, mb: int, validation: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return corpus.batch(
        seed=cfg.run.seed, step=step, microbatch=mb, size=cfg.train.microbatch_size, seq_len=cfg.model.seq_len,
        validation=validation,
    )


def _validation_loss(cfg: RunConfig, corpus: Tokens, runtime: StageRuntime, step: int) -> float:
    losses = []
    for mb in range(cfg.run.eval_microbatches):
        x, y = _batch(cfg, corpus, step, mb, validation=True)
        losses.append(loss_fn(runtime.evaluate(x), y.to(runtime.device)).item())
    return sum(losses) / len(losses)


def _train_step(
    cfg: RunConfig, corpus: Tokens, runtime: StageRuntime, step: int, scale: LossScale
) -> tuple[float, LossScale]:
    """Every microbatch's forward and backward, the mean gradient, the pipeline's decision and the apply; returns
    the step's mean loss and the next step's loss scale."""
    t = cfg.train
    step_losses = []
    for mb in range(t.microbatches):
        x, y = _batch(cfg, corpus, step, mb)
        runtime.forward((step, mb), x)
        step_losses.append(runtime.loss_backward((step, mb), y)[0])  # read once the step is queued
    runtime.mean_gradients(step)
    coef, skip, scale = t.decide(runtime.grad_sq_norm_parts(), scale)
    runtime.apply(step, coef, t.lr_at(step, cfg.run.steps), skip, scale.scale)
    return sum(loss.item() for loss in step_losses) / len(step_losses), scale


def train_local(
    cfg: RunConfig, on_step: Callable[[dict[str, Any]], None] | None = None, device: torch.device | None = None
) -> tuple[StageRuntime, dict[str, Any]]:
    """Train the whole model as one stage with the pipeline's exact step rule (train.precision on `device`, the
    CPU by default); returns it and the run summary."""
    started = time.monotonic()
    corpus = local_tokens(cfg)
    make_exact(device or torch.device("cpu"))
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers, device)
    scale = cfg.train.initial_loss_scale()
    losses: list[float] = []
    val_loss = None
    train_started = time.monotonic()
    for step in range(cfg.run.steps):
        t0 = time.monotonic()
        loss, scale = _train_step(cfg, corpus, runtime, step, scale)
        losses.append(loss)
        record: dict[str, Any] = {"step": step, "loss": loss, "seconds": time.monotonic() - t0}
        if step == cfg.run.steps - 1 or (cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0):
            val_loss = record["val_loss"] = _validation_loss(cfg, corpus, runtime, step)
            record["val_bits_per_byte"] = corpus.bits_per_byte(val_loss)
        if on_step is not None:
            on_step(record)
    train_s = time.monotonic() - train_started
    summary = {
        "steps": cfg.run.steps,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "val_loss": val_loss,
        "val_bits_per_byte": None if val_loss is None else corpus.bits_per_byte(val_loss),
        "tokens_per_s": cfg.tokens_per_step * cfg.run.steps / train_s,
        "wall_s": time.monotonic() - started,
        "device": str(runtime.device),
        "precision": runtime.precision,
        "peak_memory_bytes": peak_memory_bytes(runtime.device),
        "nodes": 1,
        "stages": 1,
    }
    return runtime, summary
