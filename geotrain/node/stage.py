"""A pipeline stage's compute: forward, backward, exactly-once gradient accumulation and the optimizer step.

Pure torch, no networking: the agent feeds it tensors and ships what it returns. `train-local` runs the same class
holding every layer, which is what makes the pipeline equal to single-process training.

Microbatches reach a stage in any order and are split among its replicas, while train-local takes them 0..M-1;
float32 accumulation in arrival order made runs drift from train-local over hundreds of steps. So each microbatch's
float32 gradient is added into a float64 sum: a float32 value has 24 significant bits, so such sums are exact, hence
the same in any order and over any split among replicas, as long as one element's contributions span fewer than 29 -
log2(microbatches) binary orders of magnitude; beyond that a sum rounds in its 53rd bit, which changes the float32
mean only when it lies that close to a float32 rounding boundary. The mean is rounded to float32 once, after the
division. On the CPU both take one pass over memory each where the C kernels of node/_gradsums.c were built, the
same bits as torch's ops. Each gradient is added as backward produces it (a hook after its accumulation) and freed
at once, so a microbatch's gradients are never alive together. The mean leaves its squares (exact in float64) in the
sums it no longer needs, and the gradient norm adds them up: the norm the commit waits for costs one pass over them.
A stage held alone (mean_at) takes the mean in the pass that adds its last microbatch.

Under bf16 or fp16 (train.precision) layers compute in autocast over float32 parameters and AdamW state, and every
layer's output but the model's last is rounded to the compute dtype: any layer boundary may be a stage boundary,
where activations and their gradients travel in that dtype, so rounding at every one makes a pipeline compute
what train-local computes, however the model is split. fp16 multiplies the loss by the coordinator's loss scale
before backward; the clip factor of `apply` divides it out again.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from geotrain.config import RunConfig
from geotrain.node.device import COMPUTE_DTYPES, HostCopies, HostTensor, autocast
from geotrain.node.diloco import OuterSync
from geotrain.node.family import call_layer
from geotrain.node.model import build_layer, family_of, loss_fn
from geotrain.protocol import framing

try:
    # One pass over memory for the float64 sums and their mean (setup.py builds it where a C compiler is found).
    from geotrain.node import _gradsums
except ImportError:
    _gradsums = None

MicrobatchKey = tuple[int, int]  # (step, microbatch id)
_FUSED_ADAMW_DEVICES = ("cpu", "cuda")


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
    averaged: bool = False  # the mean taken as the last microbatch was added (StageRuntime.mean_at)
    broken: bool = False  # a backward failed partway: the sums may hold part of a microbatch


class _Once:
    """fn's result, computed by its first caller; a caller on another thread meanwhile waits for it."""

    def __init__(self, fn: Callable[[], str]) -> None:
        self._fn, self._lock, self._result = fn, threading.Lock(), None

    def __call__(self) -> str:
        with self._lock:
            if self._result is None:
                self._result = self._fn()
            return self._result


def _fits_kernels(doubles: torch.Tensor, floats: torch.Tensor) -> bool:
    """Whether _gradsums' kernels take these tensors (built, contiguous float64 and float32 host memory)."""
    return (
        _gradsums is not None and doubles.device.type == floats.device.type == "cpu"
        and doubles.dtype == torch.float64 and floats.dtype == torch.float32
        and doubles.is_contiguous() and floats.is_contiguous()
    )


def _accumulate(total: torch.Tensor, grad: torch.Tensor | None, first: bool) -> None:
    """total = grad (`first`: total's contents are not read) or total + grad, in float64, exactly as torch's
    zeros_like(total).add_(grad) and total.add_(grad); a None grad (a parameter the microbatch did not use) adds
    nothing."""
    if grad is None:
        if first:
            total.zero_()
        return
    if _fits_kernels(total, grad):
        _gradsums.accumulate(total.numpy(), grad.detach().numpy(), first)
        return
    if first:
        total.zero_()
    total.add_(grad)


def _accumulated_mean(
    total: torch.Tensor, grad: torch.Tensor | None, first: bool, count: int, out: torch.Tensor
) -> torch.Tensor:
    """_accumulate(total, grad, first), then _rounded_mean(total, count, out): in one pass where _gradsums' kernels
    take the tensors."""
    if grad is not None and _fits_kernels(total, grad) and _fits_kernels(total, out):
        _gradsums.accumulate_mean_squares(total.numpy(), grad.detach().numpy(), out.numpy(), first, count)
        return out
    _accumulate(total, grad, first)
    return _rounded_mean(total, count, out)


def _rounded_mean(total: torch.Tensor, count: int, out: torch.Tensor) -> torch.Tensor:
    """out = total / count rounded to out's dtype (count 0 or 1: total itself, rounded), out on total's device, as
    torch's total.div_(count).to(dtype) computes it; total then holds that mean's squares in float64 (exact, as a
    float32's square has 48 significant bits), what the gradient norm adds up. Returns out."""
    if _fits_kernels(total, out):
        _gradsums.mean_squares(out.numpy(), total.numpy(), max(count, 1))
        return out
    if count > 1:
        total.div_(count)
    out.copy_(total)
    total.copy_(out).mul_(total)
    return out


_MEAN_ALIGN_BYTES = 64  # a cache line, and an AVX-512 vector


class StageRuntime:
    """Layers [start, end) of the model with their optimizer."""

    def __init__(
        self, cfg: RunConfig, start: int, end: int, device: torch.device | None = None, precision: str | None = None,
        to_load: bool = False,
    ) -> None:
        """to_load: the parameters are left uninitialised, for load_full_state to fill (a node taking over a stage
        after step 0); nothing may read them before it has."""
        total = cfg.model.total_layers
        if not 0 <= start < end <= total:
            raise ValueError(f"stage layers [{start}, {end}) outside the model's 0..{total}")
        self.cfg = cfg
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == total
        self.device = device or torch.device("cpu")
        self.precision = precision or cfg.train.precision
        self.compute_dtype = COMPUTE_DTYPES[self.precision]
        self.copies = HostCopies(self.device)
        # The exact float64 gradient sums; MPS has no float64, so there they live on the host.
        self._sums_device = torch.device("cpu") if self.device.type == "mps" else self.device
        self.loss_scale = cfg.train.initial_loss_scale().scale  # the coordinator's, from the plan and each apply
        family = family_of(cfg.model)
        self.layers = nn.ModuleDict(
            {str(i): family.empty_layer(cfg.model, i, self.device) for i in range(start, end)} if to_load else
            {str(i): build_layer(cfg.model, i, cfg.run.seed) for i in range(start, end)}
        ).to(self.device)
        fixed = family.fixed_embedding(cfg.model)
        self.fixed = None if fixed is None else fixed.to(self.device)
        t = cfg.train
        # Fused where torch has the kernel: one pass over each parameter's memory, where the per-tensor loop takes a
        # dozen (a third of the time on a CPU stage of 17M parameters). Every stage and train-local build it alike,
        # so a run stays exact; other devices keep the loop, not foreach, whose temporaries would double the state.
        fused = self.device.type in _FUSED_ADAMW_DEVICES
        self.optimizer = torch.optim.AdamW(
            self.layers.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
            **({"fused": True} if fused else {"foreach": False}),
        )
        c = cfg.compression
        # compression.replica_sync = "diloco": the anchor and outer step of node.diloco (None: exact averaging).
        self.sync = OuterSync(self.parameters(), c.replica_sync_every, c.replica_sync_lr, c.replica_sync_momentum) \
            if c.diloco else None
        self.applied_step = -1  # last optimizer step applied
        self._snapshot: list[HostTensor] = []  # checksum_later's copies, which a write to the parameters waits for
        self._checksum: Callable[[], str] | None = None  # checksum_later's last, forgotten at a write (last_checksum)
        self.grads: StepGradients | None = None
        # The count of microbatches at which the stage takes its mean as it adds the last of them, in the same pass
        # over the sums (0: when mean_gradients is called): a node sets it for a stage it holds alone, whose sums no
        # replica's are added to first.
        self.mean_at = 0
        # The last mean's squares, each with the gradient it squared and that gradient's version: a gradient written
        # since (PowerSGD's averaging writes them) is squared again.
        self._squares: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        # Where each parameter's mean gradient is written, step after step (_mean_out); empty until the first mean.
        self._means: list[torch.Tensor] = []
        self._pending: dict[MicrobatchKey, _Pending] = {}
        # Sees each counted microbatch's parameter gradients (verification's commitments, node/verifier.py).
        self.on_param_grads: Callable[[MicrobatchKey, Sequence[torch.Tensor | None]], None] | None = None

    # -- forward / backward -------------------------------------------------------------------------------------

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """An incoming activation on the device; a node computing in fp32 (a fallback in a bf16 or fp16 run) takes
        the run's dtype in float32."""
        x = self.copies.to_device(x)
        return x.float() if self.precision == "fp32" and x.is_floating_point() else x

    @property
    def needs_tokens(self) -> bool:
        """Whether forward needs the microbatch's token ids besides its activations (model.boundary_rank, on a stage
        other than the first, which reads them anyway)."""
        return self.fixed is not None and not self.is_first

    def _fixed_coordinates(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor | None:
        """The fixed coordinates of the microbatch's stream (None without model.boundary_rank); x is the tokens on
        the first stage."""
        if self.fixed is None:
            return None
        if self.is_first:
            tokens = x
        elif tokens is None:
            raise ValueError("model.boundary_rank: this stage needs the microbatch's token ids")
        expected = (x.shape[0], x.shape[1])
        if tuple(tokens.shape) != expected:
            raise ValueError(f"token ids of shape {tuple(tokens.shape)} for activations of {tuple(x.shape)}")
        return self.fixed(self.copies.to_device(tokens))

    def _run(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        x = self._input(x)
        rest = self._fixed_coordinates(x, tokens)
        recompute = self.cfg.train.recompute and torch.is_grad_enabled()
        last = self.cfg.model.total_layers - 1
        with autocast(self.device, self.precision):
            for i in range(self.start, self.end):
                layer, layer_rest = self.layers[str(i)], None if i == 0 else rest
                if recompute:
                    x = checkpoint(call_layer, layer, x, layer_rest, use_reentrant=False)
                else:
                    x = call_layer(layer, x, layer_rest)
                if self.precision != "fp32":
                    # Every boundary in the compute dtype (see the module's note); the logits in float32 for the loss.
                    x = x.float() if i == last else x.to(self.compute_dtype)
        return x

    def forward(self, key: MicrobatchKey, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run the stage and keep what backward needs; x is bytes on the first stage, activations elsewhere, where
        a model.boundary_rank model also needs the microbatch's tokens (`needs_tokens`). The outputs stay on the
        stage's device."""
        inputs = x if self.is_first else self._input(x).detach().requires_grad_(True)
        outputs = self._run(inputs, tokens)
        self._pending[key] = _Pending(inputs, outputs)
        return outputs.detach()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Forward without keeping anything."""
        return self._run(x, tokens)

    def loss_backward(self, key: MicrobatchKey, targets: torch.Tensor) -> tuple[HostTensor, torch.Tensor | None]:
        """Last stage: loss of a forwarded microbatch, then backward; returns (loss, gradient for the previous stage).
        The loss comes as a copy on its way to the host, started before backward is queued: reading it (`item()`)
        waits for that copy alone, so the device never idles while the host asks for a number."""
        pending = self._pending.pop(key)
        loss = loss_fn(pending.outputs, self.copies.to_device(targets))
        root = loss if self.loss_scale == 1.0 else loss * self.loss_scale
        value = self.copies.to_host_async(loss.detach())
        return value, self._backward(key, pending, root, None)

    def backward(self, key: MicrobatchKey, grad_outputs: torch.Tensor) -> torch.Tensor | None:
        """Backward of a forwarded microbatch; returns the gradient for the previous stage (None on the first)."""
        pending = self._pending.pop(key)
        return self._backward(key, pending, pending.outputs, self.copies.to_device(grad_outputs))

    def _backward(
        self, key: MicrobatchKey, pending: _Pending, root: torch.Tensor, root_grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        step, microbatch = key
        if self.grads is None or self.grads.step != step:
            self._start_step(step)
        self._check_whole(step)
        if microbatch in self.grads.counted:
            # Already counted (a re-issued microbatch): pass the input gradient on, leave parameters alone.
            if self.is_first:
                return None
            (grad_in,) = torch.autograd.grad(root, pending.inputs, root_grad)
            return grad_in
        params = self.parameters()
        first = not self.grads.sums
        if first:
            self.grads.sums = [torch.empty_like(p, dtype=torch.float64, device=self._sums_device) for p in params]
        sums, count = self.grads.sums, len(self.grads.counted) + 1
        last = count == self.mean_at
        kept: list[torch.Tensor | None] | None = None if self.on_param_grads is None else [None] * len(params)
        added = [False] * len(params)

        def add(i: int, p: torch.Tensor) -> None:
            # Each gradient is added as backward produces it and freed at once, as torch's own accumulation frees
            # each microbatch's: the next one reuses its memory, where taking them all at the end kept a stage's
            # gradients alive together and every microbatch faulted them in afresh. Where the mean is taken here it
            # takes the gradient's place.
            g, p.grad = p.grad, None
            if kept is not None:
                kept[i] = g
            g = None if g is None else g.to(self._sums_device)
            if last:
                p.grad = _accumulated_mean(sums[i], g, first, count, self._mean_out(i, sums[i])).to(p.device)
            else:
                _accumulate(sums[i], g, first)
            added[i] = True

        hooks = [p.register_post_accumulate_grad_hook(functools.partial(add, i)) for i, p in enumerate(params)]
        try:
            torch.autograd.backward(root, root_grad, inputs=params if self.is_first else [*params, pending.inputs])
        except BaseException:
            self.grads.broken = True
            raise
        finally:
            for hook in hooks:
                hook.remove()
        for i, p in enumerate(params):
            if not added[i]:  # a parameter this microbatch did not reach (its grad is None): it adds nothing
                add(i, p)
        if kept is not None:
            self.on_param_grads(key, kept)
        if last:
            self._keep_squares(params, sums)
            self.grads.sums, self.grads.averaged = [], True
        self.grads.counted.add(microbatch)
        return None if self.is_first else pending.inputs.grad

    def reset_step(self) -> None:
        """Drop every uncommitted gradient and kept activation: a new plan epoch redoes the step from scratch (and a
        runtime kept for a stage's new holder trains no more: its mean buffers go too)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.grads = None
        self._means = []
        self._squares = []
        self._pending.clear()

    def _start_step(self, step: int) -> None:
        if step <= self.applied_step:
            raise ValueError(f"gradients for step {step}, but step {self.applied_step} is already applied")
        self.optimizer.zero_grad(set_to_none=True)
        self.grads = StepGradients(step=step)
        self._squares = []
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
        self._check_whole(step)
        if count and self.grads.averaged and reduce is None:
            return count  # taken with the last microbatch's sum
        params = self.parameters()
        if count and not self.grads.sums:
            raise ValueError(f"step {step}'s gradients are already averaged")
        sums = self.grads.sums if count else [
            torch.zeros_like(p, dtype=torch.float64, device=self._sums_device) for p in params
        ]
        if reduce is not None:
            sums = [total.cpu() for total in sums]  # hivemind averages host tensors (on the CPU: these very ones)
            reduce(sums)  # in place: a failed all-reduce fails the plan epoch, which redoes the step from scratch
        for i, (p, total) in enumerate(zip(params, sums)):
            # rounded where the sums live: MPS has no float64
            p.grad = _rounded_mean(total, count if reduce is None else 1, self._mean_out(i, total)).to(p.device)
        self._keep_squares(params, sums)
        if count:
            self.grads.sums = []  # the float64 sums cost twice the gradients: keep them no longer than needed
        return count

    def _mean_out(self, i: int, total: torch.Tensor) -> torch.Tensor:
        """Where parameter i's mean gradient is written, beside its sum `total`: the same memory step after step. A
        new tensor each step came from pages the kernel faulted in and zeroed as the mean first wrote them."""
        if not self._means or self._means[i].device != total.device:
            self._means = self._mean_buffers(total.device)
        return self._means[i]

    def _mean_buffers(self, device: torch.device) -> list[torch.Tensor]:
        """A tensor for each parameter's mean, each a view of one allocation per dtype: one block outside the
        allocator's heaps. Kept one by one among the step's passing tensors, they left a node of bench/scale.py 25%
        above its planned peak (4.64 GB against 3.72; in one block, the same stage's node peaked at 3.34). Each view
        starts on a 64-byte boundary."""
        params = self.parameters()
        views: list[torch.Tensor | None] = [None] * len(params)
        for dtype in {p.dtype for p in params}:
            mine = [k for k, p in enumerate(params) if p.dtype == dtype]
            align = max(1, _MEAN_ALIGN_BYTES // dtype.itemsize)
            starts, at = [], 0
            for k in mine:
                starts.append(at)
                at += -(-params[k].numel() // align) * align
            flat = torch.empty(at, dtype=dtype, device=device)
            for k, start in zip(mine, starts, strict=True):
                views[k] = flat[start : start + params[k].numel()].view(params[k].shape)
        return views

    def _check_whole(self, step: int) -> None:
        """ValueError where a backward of `step` failed partway: the node's failure report has the coordinator redo
        the step in a new plan epoch, which resets it (reset_step); nothing of it may be counted or averaged before."""
        if self.grads is not None and self.grads.step == step and self.grads.broken:
            raise ValueError(f"a backward of step {step} failed partway: its gradient sums are incomplete")

    def _keep_squares(self, params: list[torch.Tensor], squares: list[torch.Tensor]) -> None:
        """Keep the squares a mean left in the sums for grad_sq_norm_parts, where its own would be summed (the
        reduce's host copies of a GPU's sums are not)."""
        self._squares = [
            (total, p.grad, p.grad._version) for p, total in zip(params, squares) if total.device == self._sums_device
        ]

    def gradients(self) -> list[torch.Tensor]:
        """The gradient tensors, in parameter order (after mean_gradients every parameter has one)."""
        return [p.grad for p in self.parameters()]

    def grad_sq_norm_parts(self) -> list[float]:
        """Squared L2 norm of each gradient tensor, in parameter order: the parts of the global norm
        (TrainSection.decide adds everyone's parts exactly); inf for a tensor with an Inf or NaN (an fp16 overflow),
        so a report says the same in every replica and compares equal to itself."""
        kept = {id(g): (total, version) for total, g, version in self._squares}
        self._squares = []
        squares = []
        for g in self.gradients():
            total, version = kept.get(id(g), (None, -1))
            squares.append((total if version == g._version else g.to(self._sums_device).double().pow(2)).sum())
        parts = torch.stack(squares).cpu().tolist() if squares else []  # one copy to the host, not one per tensor
        return [part if math.isfinite(part) else math.inf for part in parts]

    def apply(self, step: int, clip_coef: float, lr: float, skip: bool = False, loss_scale: float = 0.0) -> None:
        """Scale gradients by clip_coef and take the optimizer step (none when `skip`: an fp16 overflow); the steps
        after it scale their loss by loss_scale. Under diloco a replica sync staged for this step comes first."""
        if step != self.applied_step + 1:
            raise ValueError(f"apply step {step} after step {self.applied_step}")
        self.set_loss_scale(loss_scale)
        self._writes_after_snapshot()
        self._squares = []
        if self.sync is not None:
            self.sync.apply_pending(step, self.parameters())
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            self.applied_step = step
            self.grads = None
            return
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

    def set_loss_scale(self, scale: float) -> None:
        """Scale the loss of the next steps by `scale` (the coordinator's: from a plan or an apply; 0, the wire's
        unset value, is 1); ValueError unless it is a finite power of two >= 1 (1 unless the run is fp16), which
        scales and unscales exactly."""
        scale = scale or 1.0
        if not (math.isfinite(scale) and scale >= 1.0 and math.frexp(scale)[0] == 0.5):
            raise ValueError(f"loss scale {scale!r} is not a finite power of two >= 1")
        if self.cfg.train.precision != "fp16" and scale != 1.0:
            raise ValueError(f"loss scale {scale!r} in a {self.cfg.train.precision} run")
        self.loss_scale = scale

    def checksum(self) -> str:
        """The parameters' checksum (framing.parameters_checksum): replicas that applied the same steps agree bit for
        bit. Under diloco, the anchor's: replicas train apart between syncs, and share the anchor bit for bit."""
        return self._take_checksum()()

    def checksum_later(self) -> Callable[[], str]:
        """checksum(), computed by the function returned, which another thread may call: on an accelerator the
        parameters' copies to the host start now, after the work queued so far (the step just applied) and beside
        the next step's compute, and the hash waits for them, not the device's queue; on the CPU the hash is taken by
        its first caller (the apply's report, on a sender thread, while the next step's compute reads the
        parameters), and the next write to the parameters waits for it. Kept for last_checksum."""
        self._checksum = self._take_checksum()
        return self._checksum

    def last_checksum(self) -> Callable[[], str]:
        """checksum_later()'s last function if nothing wrote the parameters since but apply or a load (which forget
        it), else a new one: what verification commits to as the parameters a step is computed with, without hashing
        them a second time after the apply that made them."""
        return self._checksum or self.checksum_later()

    def _take_checksum(self) -> Callable[[], str]:
        names = [name for name, _ in self.named_state()]
        tensors = self.sync.anchor if self.sync is not None else self.parameters()
        if self.device.type == "cpu":
            return _Once(lambda: framing.parameters_checksum(zip(names, tensors, strict=True)))
        copies = self._snapshot = [self.copies.to_host_async(t.detach()) for t in tensors]
        return lambda: framing.parameters_checksum((n, c.wait()) for n, c in zip(names, copies, strict=True))

    def _writes_after_snapshot(self) -> None:
        """Before any write to the parameters: order the device's next writes to them after checksum_later's copies
        of them (on the CPU, after its hash), and forget their checksum."""
        for copy in self._snapshot:
            copy.before_writes()
        self._snapshot = []
        if isinstance(self._checksum, _Once):
            self._checksum()  # taken here if nobody asked for it yet, else waited for
        self._checksum = None

    def load_parameters(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite the parameters with `state`'s (whole-model names, named_state's); ValueError, before any write,
        if it lacks one or one differs in shape or dtype."""
        named = self.named_state()
        for name, p in named:
            if name not in state or state[name].shape != p.shape or state[name].dtype != p.dtype:
                raise ValueError(f"state has no {name} of shape {tuple(p.shape)} and dtype {p.dtype}")
        self._writes_after_snapshot()
        with torch.no_grad():
            for name, p in named:
                p.copy_(state[name])

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters under their whole-model names (`layers.<i>.<param>`)."""
        return [(f"layers.{name}", p) for name, p in self.layers.named_parameters()]

    def full_state(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and AdamW state (`optim.<param name>.<slot>`), and under diloco the anchor and outer momentum
        (`sync.<slot>.<param name>`): what a new replica needs to continue."""
        items = list(self.named_state())
        for name, p in self.named_state():
            for slot, value in sorted(self.optimizer.state.get(p, {}).items()):
                items.append((f"optim.{name}.{slot}", value))
        if self.sync is not None:
            items += self.sync.named_state([name for name, _ in self.named_state()])
        return items

    def load_full_state(self, state: dict[str, torch.Tensor], steps_done: int) -> None:
        """Take over parameters and optimizer state at steps_done; raises ValueError if state does not fit."""
        self._writes_after_snapshot()
        fused = bool(self.optimizer.defaults["fused"])
        with torch.no_grad():
            for name, p in self.named_state():
                if name not in state or state[name].shape != p.shape:
                    raise ValueError(f"state has no {name} of shape {tuple(p.shape)}")
                p.copy_(state[name])
                slots = {
                    # AdamW keeps its step count on the host unless fused (or capturable).
                    # The state's tensors become the optimizer's: a state transfer allocates them for it
                    # (node.holder.StateExpectation), and a copy would hold the stage's moments twice.
                    k.rsplit(".", 1)[1]: v.to(self.device if v.dim() or fused else "cpu")
                    for k, v in state.items()
                    if k.startswith(f"optim.{name}.")
                }
                self.optimizer.state[p] = slots
            if self.sync is not None:
                self.sync.load([name for name, _ in self.named_state()], state)
        self.reset_step()
        self.applied_step = steps_done - 1
