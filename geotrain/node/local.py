"""`geotrain train-local`: the same run in one process, the reference the pipeline must equal."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from geotrain.config import RunConfig
from geotrain.node.data import local_tokens
from geotrain.node.device import make_exact, peak_memory_bytes
from geotrain.node.model import loss_fn
from geotrain.node.stage import StageRuntime


def train_local(
    cfg: RunConfig, on_step: Callable[[dict[str, Any]], None] | None = None, device: torch.device | None = None
) -> tuple[StageRuntime, dict[str, Any]]:
    """Train the whole model as one stage with the pipeline's exact step rule (train.precision on `device`, the
    CPU by default); returns it and the run summary."""
    started = time.monotonic()
    corpus = local_tokens(cfg)
    make_exact(device or torch.device("cpu"))
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers, device)
    t = cfg.train
    scale = t.initial_loss_scale()

    def batch(step: int, mb: int, validation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return corpus.batch(
            seed=cfg.run.seed, step=step, microbatch=mb, size=t.microbatch_size, seq_len=cfg.model.seq_len,
            validation=validation,
        )

    def evaluate(step: int) -> float:
        losses = []
        for mb in range(cfg.run.eval_microbatches):
            x, y = batch(step, mb, validation=True)
            losses.append(loss_fn(runtime.evaluate(x), y.to(runtime.device)).item())
        return sum(losses) / len(losses)

    losses: list[float] = []
    val_loss = None
    train_started = time.monotonic()
    for step in range(cfg.run.steps):
        t0 = time.monotonic()
        step_losses = []
        for mb in range(t.microbatches):
            x, y = batch(step, mb)
            runtime.forward((step, mb), x)
            step_losses.append(runtime.loss_backward((step, mb), y)[0])  # read once the step is queued
        runtime.mean_gradients(step)
        coef, skip, scale = t.decide(runtime.grad_sq_norm_parts(), scale)
        runtime.apply(step, coef, t.lr_at(step, cfg.run.steps), skip, scale.scale)
        losses.append(sum(loss.item() for loss in step_losses) / len(step_losses))
        record: dict[str, Any] = {"step": step, "loss": losses[-1], "seconds": time.monotonic() - t0}
        if step == cfg.run.steps - 1 or (cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0):
            val_loss = record["val_loss"] = evaluate(step)
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
