"""Low-communication replica averaging (compression.replica_sync = "diloco"): DiLoCo's outer step.

Replicas of a stage train apart: each applies its own microbatches' gradients with AdamW (the inner optimizer) and
averages nothing, so between syncs they serve microbatches with parameters that differ. Every H steps
(replica_sync_every) they all-reduce their pseudo-gradient, the anchor (the parameters of the last sync) minus
their parameters, and each takes the same outer step from the anchor with Nesterov momentum (Douillard et al. 2023,
"DiLoCo"; lr 0.7, momentum 0.9 as there): the new anchor, which becomes every replica's parameters. A sync moves
one copy of the parameters, as integers (Wire, below), so a stage averages about 4H times fewer bytes per step than
with every_step.

Chosen over SPARTA (a random slice averaged every step: replicas never share a state the coordinator can check)
and SparseLoCo (top-k of an error-feedback buffer per replica: sparse parts that hivemind's all-reduce cannot add
exactly, so replicas would hold different results): DiLoCo's dense mean goes through the all-reduce the stage
already uses, exactly, so every replica holds the same anchor, bit for bit, and the coordinator checks it each step
(StageRuntime.checksum covers the anchor under diloco).

Wire. A codec would round each replica's result differently, so the pseudo-gradient is not encoded but put on a grid
every replica shares, as int16 integers: a first, tiny all-reduce averages each tensor's largest absolute value over
the replicas (a float32 mean, the same bits everywhere); `replicas` times it bounds every replica's values, and the
grid's step maps that bound to the largest integer that `replicas` of them can add to in int16 (grid_steps). The
all-reduce then adds integers, exactly in any order, so every replica holds the same sum, in a quarter of float64's
bytes each way; each value is rounded once, by at most half a step: with two replicas about 1/16,000 of the
tensor's largest value (to_grid). A stage averaging every step sends float64 gradients, so a sync every H steps
averages about 4H times fewer bytes a step.

When. The sync of step s (s a multiple of H) all-reduces at s's commit, like gradient averaging: a replica that
dies mid-sync fails the plan epoch, the survivors redo step s without it, and nothing was applied (the averaged
pseudo-gradient waits here until s's apply, which every replica of the decided step takes). At s's apply the outer
step comes first, then s's inner step with the replica's own gradient, computed before the sync: the sync's
communication overlaps one step of compute, as in DiLoCo with eager updates (Kale et al. 2025). A stage with one
replica averages nothing: at its sync steps the anchor becomes its parameters and no outer step is taken.

Bound. Between syncs a replica is k <= H inner steps from the anchor, and one AdamW step moves a value by at most
lr x (c + weight_decay x |value|), c = max(1, (1 - beta1) / sqrt(1 - beta2)) (Kingma and Ba 2015, section 2.1;
decoupled weight decay adds the second term): two replicas differ by at most twice the sum of those over the k
steps (drift_bound).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# A sync's pseudo-gradients cross the wire as integers of this dtype (the docstring's Wire).
WIRE_DTYPE = torch.int16

# full_state() names: the anchor and the outer momentum of each parameter, `sync.<slot>.<param name>`.
ANCHOR, MOMENTUM = "anchor", "momentum"


class OuterSync:
    """A replica's DiLoCo state: the anchor, the outer momentum, and an averaged pseudo-gradient waiting for its
    step's apply."""

    def __init__(self, params: Sequence[torch.Tensor], every: int, lr: float, momentum: float) -> None:
        if every < 1:
            raise ValueError(f"replica_sync_every must be >= 1, got {every}")
        self.every, self.lr, self.momentum = every, lr, momentum
        self.anchor = [p.detach().clone() for p in params]
        self.velocity = [torch.zeros_like(p) for p in params]
        # (step, the replicas' mean pseudo-gradient, or None where the stage had one replica): applied at that step.
        self._pending: tuple[int, list[torch.Tensor] | None] | None = None

    def due(self, step: int) -> bool:
        """Whether step `step`'s commit syncs the replicas (H inner steps since the last sync)."""
        return step > 0 and step % self.every == 0

    def pseudo_gradient(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Anchor minus parameters, float64 on the host: what the replicas' all-reduce averages (as presummed parts
        of weight 1, added exactly). Moved in their own dtype and widened on the host: MPS has no float64."""
        return [a.detach().cpu().double() - p.detach().cpu().double() for a, p in zip(self.anchor, params, strict=True)]

    def stage(self, step: int, averaged: list[torch.Tensor] | None) -> None:
        """Keep the replicas' mean pseudo-gradient (None: this replica was alone) for step `step`'s apply. It
        outlives a new plan epoch: a step redone commits, and so stages, again; a decided step that a restarted
        coordinator completes is applied without another commit, with this sync."""
        self._pending = (step, averaged)

    @torch.no_grad()
    def apply_pending(self, step: int, params: Sequence[torch.Tensor]) -> bool:
        """Take the outer step staged for `step`, if any: the anchor moves by Nesterov momentum on the averaged
        pseudo-gradient and the parameters become the new anchor (alone: the anchor becomes the parameters).
        Returns whether a sync was applied."""
        if self._pending is None or self._pending[0] != step:
            return False
        _, averaged = self._pending
        self._pending = None
        if averaged is None:
            for anchor, p in zip(self.anchor, params, strict=True):
                anchor.copy_(p)
            return True
        for anchor, velocity, delta, p in zip(self.anchor, self.velocity, averaged, params, strict=True):
            delta = delta.to(anchor.dtype).to(anchor.device)  # rounded on the host: MPS has no float64
            velocity.mul_(self.momentum).add_(delta)
            anchor.sub_(delta.add(velocity, alpha=self.momentum), alpha=self.lr)
            p.copy_(anchor)
        return True

    def named_state(self, names: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
        """The anchor and outer momentum under `sync.<slot>.<param name>`: what a replica that joins needs."""
        return [(f"sync.{ANCHOR}.{n}", a) for n, a in zip(names, self.anchor, strict=True)] + [
            (f"sync.{MOMENTUM}.{n}", v) for n, v in zip(names, self.velocity, strict=True)
        ]

    @torch.no_grad()
    def load(self, names: Sequence[str], state: dict[str, torch.Tensor]) -> None:
        """Take over the anchor and outer momentum from a replica's or a checkpoint's state; ValueError if missing."""
        for slot, tensors in ((ANCHOR, self.anchor), (MOMENTUM, self.velocity)):
            for name, t in zip(names, tensors, strict=True):
                key = f"sync.{slot}.{name}"
                if key not in state or state[key].shape != t.shape:
                    raise ValueError(f"state has no {key} of shape {tuple(t.shape)}")
                t.copy_(state[key])
        self._pending = None


def largest_values(pseudo: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest absolute value, float64: what the replicas average to agree on their grid."""
    return torch.tensor([float(p.abs().max()) if p.numel() else 0.0 for p in pseudo], dtype=torch.float64)


def _levels(replicas: int) -> int:
    """The largest integer one replica may send: `replicas` of them add up within WIRE_DTYPE."""
    return torch.iinfo(WIRE_DTYPE).max // replicas


def grid_steps(mean_largest: torch.Tensor, replicas: int) -> torch.Tensor:
    """Each tensor's grid step, from the replicas' mean of its largest absolute value: no replica's largest exceeds
    `replicas` times that mean, and that maps to _levels(replicas). A tensor nobody moved gets step 1."""
    steps = mean_largest * replicas / _levels(replicas)
    return torch.where(steps > 0, steps, torch.ones_like(steps))


def to_grid(pseudo: Sequence[torch.Tensor], steps: torch.Tensor, replicas: int) -> list[torch.Tensor]:
    """This replica's pseudo-gradient as integers on the shared grid (rounded to nearest; clamped, which only a
    float32-rounded mean below the true one can call for, by one unit at most)."""
    levels = _levels(replicas)
    return [(p / float(step)).round_().clamp_(-levels, levels).to(WIRE_DTYPE) for p, step in zip(pseudo, steps, strict=True)]


def from_grid(sums: Sequence[torch.Tensor], steps: torch.Tensor, replicas: int) -> list[torch.Tensor]:
    """The replicas' mean pseudo-gradient, float64, from their integer sums: the same bits on every replica."""
    return [s.double() * float(step) / replicas for s, step in zip(sums, steps, strict=True)]


def adam_step_bound(beta1: float, beta2: float) -> float:
    """The most one Adam step moves a value, per unit of learning rate (Kingma and Ba 2015, section 2.1)."""
    return max(1.0, (1 - beta1) / math.sqrt(1 - beta2))


def drift_bound(lrs: Sequence[float], beta1: float, beta2: float, weight_decay: float, max_abs: float) -> float:
    """The most two replicas' values can differ after the inner steps with learning rates `lrs` from one anchor,
    where no value exceeds max_abs in size. Adam's bound is reached on the first step after a sync (its update is
    then lr exactly), so each float32 step may also round by up to one unit in the last place of max_abs."""
    per_lr = adam_step_bound(beta1, beta2) + weight_decay * max_abs
    rounding = math.ldexp(torch.finfo(torch.float32).eps, math.frexp(max_abs)[1] - 1)  # float32's ulp at max_abs
    return 2 * math.fsum(lr * per_lr + rounding for lr in lrs)
