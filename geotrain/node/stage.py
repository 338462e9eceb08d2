"""A pipeline stage's compute: forward, backward, exactly-once gradient accumulation and the optimizer step.

Pure torch, no networking: the agent feeds it tensors and ships what it returns. `train-local` runs the same class
holding every layer, which is what makes the pipeline equal to single-process training.

Microbatches reach a stage in any order and are split among its replicas, while train-local takes them 0..M-1;
float32 accumulation in arrival order made runs drift from train-local over hundreds of steps. So each
microbatch's float32 gradient is added into a float64 sum: a float32 value has 24 significant bits, so such sums
are exact, hence the same in any order and over any split among replicas, as long as one element's contributions
span fewer than 29 - log2(microbatches) binary orders of magnitude; beyond that a sum rounds in its 53rd bit, which
changes the float32 mean only when it lies that close to a float32 rounding boundary. The mean is rounded to
float32 once, after the division.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from geotrain.config import RunConfig
from geotrain.node.model import build_layer, loss_fn

MicrobatchKey = tuple[int, int]  # (step, microbatch id)


@dataclass
class _Pending:
    """What a forward keeps for the matching backward."""

    inputs: torch.Tensor
    outputs: torch.Tensor


@dataclass
class StepGradients:
    """Which microbatches of a step this stage has counted, and their parameter gradients summed in float64."""

    step: int
    counted: set[int] = field(default_factory=set)
    sums: list[torch.Tensor] = field(default_factory=list)  # per parameter; empty until a microbatch is counted


class StageRuntime:
    """Layers [start, end) of the model with their optimizer."""

    def __init__(self, cfg: RunConfig, start: int, end: int) -> None:
        total = cfg.model.total_layers
        if not 0 <= start < end <= total:
            raise ValueError(f"stage layers [{start}, {end}) outside the model's 0..{total}")
        self.cfg = cfg
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == total
        self.layers = nn.ModuleDict({str(i): build_layer(cfg.model, i, cfg.run.seed) for i in range(start, end)})
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            self.layers.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, foreach=False
        )
        self.applied_step = -1  # last optimizer step applied
        self.grads: StepGradients | None = None
        self._pending: dict[MicrobatchKey, _Pending] = {}

    # -- forward / backward -------------------------------------------------------------------------------------

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.start, self.end):
            x = self.layers[str(i)](x)
        return x

    def forward(self, key: MicrobatchKey, x: torch.Tensor) -> torch.Tensor:
        """Run the stage and keep what backward needs; x is bytes on the first stage, activations elsewhere."""
        inputs = x if self.is_first else x.detach().requires_grad_(True)
        outputs = self._run(inputs)
        self._pending[key] = _Pending(inputs, outputs)
        return outputs.detach()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Forward without keeping anything."""
        return self._run(x)

    def loss_backward(self, key: MicrobatchKey, targets: torch.Tensor) -> tuple[float, torch.Tensor | None]:
        """Last stage: loss of a forwarded microbatch, then backward; returns (loss, gradient for the previous stage)."""
        pending = self._pending.pop(key)
        loss = loss_fn(pending.outputs, targets)
        return loss.item(), self._backward(key, pending, loss, None)

    def backward(self, key: MicrobatchKey, grad_outputs: torch.Tensor) -> torch.Tensor | None:
        """Backward of a forwarded microbatch; returns the gradient for the previous stage (None on the first)."""
        pending = self._pending.pop(key)
        return self._backward(key, pending, pending.outputs, grad_outputs)

    def _backward(
        self, key: MicrobatchKey, pending: _Pending, root: torch.Tensor, root_grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        step, microbatch = key
        if self.grads is None or self.grads.step != step:
            self._start_step(step)
        if microbatch in self.grads.counted:
            # Already counted (a re-issued microbatch): pass the input gradient on, leave parameters alone.
            if self.is_first:
                return None
            (grad_in,) = torch.autograd.grad(root, pending.inputs, root_grad)
            return grad_in
        params = self.parameters()
        wrt = params if self.is_first else [*params, pending.inputs]
        grads = torch.autograd.grad(root, wrt, root_grad, allow_unused=True)
        if not self.grads.sums:
            self.grads.sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        for total, g in zip(self.grads.sums, grads):
            if g is not None:
                total.add_(g)
        self.grads.counted.add(microbatch)
        return None if self.is_first else grads[-1]

    def reset_step(self) -> None:
        """Drop every uncommitted gradient and kept activation: a new plan epoch redoes the step from scratch."""
        self.optimizer.zero_grad(set_to_none=True)
        self.grads = None
        self._pending.clear()

    def _start_step(self, step: int) -> None:
        if step <= self.applied_step:
            raise ValueError(f"gradients for step {step}, but step {self.applied_step} is already applied")
        self.optimizer.zero_grad(set_to_none=True)
        self.grads = StepGradients(step=step)
        # Microbatches of an older step can no longer be backpropagated.
        self._pending = {k: v for k, v in self._pending.items() if k[0] >= step}

    # -- commit -------------------------------------------------------------------------------------------------

    def counted(self, step: int) -> int:
        """Microbatches of `step` counted in the gradients."""
        return len(self.grads.counted) if self.grads is not None and self.grads.step == step else 0

    def parameters(self) -> list[torch.Tensor]:
        """The stage's parameters in a fixed order."""
        return list(self.layers.parameters())

    def mean_gradients(self, step: int, reduce: Callable[[list[torch.Tensor]], None] | None = None) -> int:
        """Set every parameter's gradient to the float32 rounding of a float64 mean and return the microbatches
        counted: the mean of this stage's sums, or what `reduce` leaves in place of the sums (the mean over every
        replica's microbatches)."""
        count = self.counted(step)
        params = self.parameters()
        if count and not self.grads.sums:
            raise ValueError(f"step {step}'s gradients are already averaged")
        sums = self.grads.sums if count else [torch.zeros_like(p, dtype=torch.float64) for p in params]
        if reduce is not None:
            reduce(sums)  # in place: a failed all-reduce fails the plan epoch, which redoes the step from scratch
        elif count:
            for total in sums:
                total.div_(count)
        for p, mean in zip(params, sums):
            p.grad = mean.to(p.dtype)
        if count:
            self.grads.sums = []  # the float64 sums cost twice the gradients: keep them no longer than needed
        return count

    def gradients(self) -> list[torch.Tensor]:
        """The gradient tensors, in parameter order (after mean_gradients every parameter has one)."""
        return [p.grad for p in self.parameters()]

    def grad_sq_norm_parts(self) -> list[float]:
        """Squared L2 norm of each gradient tensor, in parameter order: the parts of the global norm
        (TrainConfig.clip_coefficient_from adds everyone's parts exactly)."""
        return [float(g.double().pow(2).sum()) for g in self.gradients()]

    def apply(self, step: int, clip_coef: float, lr: float) -> None:
        """Scale gradients by clip_coef and take the optimizer step."""
        if step != self.applied_step + 1:
            raise ValueError(f"apply step {step} after step {self.applied_step}")
        with torch.no_grad():
            for p in self.parameters():
                if p.grad is not None and clip_coef != 1.0:
                    p.grad.mul_(clip_coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.applied_step = step
        self.grads = None

    def checksum(self) -> str:
        """sha256 of the parameters' bytes: replicas that applied the same steps agree bit for bit."""
        h = hashlib.sha256()
        for name, p in self.named_state():
            h.update(name.encode())
            h.update(p.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters under their whole-model names (`layers.<i>.<param>`)."""
        return [(f"layers.{name}", p) for name, p in self.layers.named_parameters()]

    def full_state(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and AdamW state (`optim.<param name>.<slot>`): what a new replica needs to continue."""
        items = list(self.named_state())
        for name, p in self.named_state():
            for slot, value in sorted(self.optimizer.state.get(p, {}).items()):
                items.append((f"optim.{name}.{slot}", value))
        return items

    def load_full_state(self, state: dict[str, torch.Tensor], steps_done: int) -> None:
        """Take over parameters and optimizer state at steps_done; raises ValueError if state does not fit."""
        with torch.no_grad():
            for name, p in self.named_state():
                if name not in state or state[name].shape != p.shape:
                    raise ValueError(f"state has no {name} of shape {tuple(p.shape)}")
                p.copy_(state[name])
                slots = {k.rsplit(".", 1)[1]: v.clone() for k, v in state.items() if k.startswith(f"optim.{name}.")}
                self.optimizer.state[p] = slots
        self.reset_step()
        self.applied_step = steps_done - 1
