"""How a replica group's parts are reduced, in place of hivemind's float32 weighted mean: presummed float64 parts
added exactly (so the mean does not depend on the order parts arrive), or aggregated by CenteredClip
(compression.replica_robust = "centered_clip": Gorbunov et al. 2021, "Secure Distributed Training at Scale", as
BTARD does per part), so that a replica sending an outlying gradient moves the result by at most its share of the
clip radius, and is flagged. node/averaging.py runs them; hivemind keeps its reducer (partition.py) apart likewise."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AllreduceException
from hivemind.averaging.partition import TensorPartReducer


class SumAccumulator:
    """Takes the place of TensorPartReducer's float32 accumulator, which rounds every addition in the order parts
    arrive. Parts here are replicas' float64 sums of float32 gradients (weight x mean), or integers: adding them in
    float64 is exact wherever each replica's own sums were (node.stage), so the total does not depend on the order.
    With `mean` it is divided by the total weight and rounded to float32 once, as train-local rounds its mean;
    without, the exact sum is returned in the parts' dtype, and each member's own part plus its delta (the others'
    exact sum) is that sum again."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, mean: bool) -> None:
        self.total = torch.zeros(shape, dtype=torch.float64)
        self.dtype = dtype
        self.mean = mean

    def add_(self, part: torch.Tensor, alpha: float) -> None:  # noqa: ARG002 - the weight is already in the part
        if part.dtype != self.dtype:  # a wider part would be cut back to this dtype, differently from its sender
            raise AllreduceException(f"a part of dtype {part.dtype} in an all-reduce of {self.dtype}")
        self.total.add_(part)

    def div_(self, denominator: float) -> torch.Tensor:
        if not self.mean:
            return self.total.to(self.dtype)
        # On the float32 grid, so that each replica's x + (average - x) rounds back to these bits
        # (allreduce.round_to_float32).
        return self.total.div_(denominator).float().double()


class PresummedReducer(TensorPartReducer):
    """hivemind's reducer (waiting, part order, failed senders) with SumAccumulator for its arithmetic."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, dtype: torch.dtype, mean: bool) -> None:
        self.dtype, self.mean = dtype, mean  # before hivemind's __init__, which makes the first accumulator
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:  # noqa: D102
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = SumAccumulator(self.part_shapes[self.current_part_index], self.dtype, self.mean)


class PresummedRunner(AllReduceRunner):
    """AllReduceRunner whose reducer sums presummed parts exactly (SumAccumulator)."""

    def __init__(self, mean: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        dtype = kwargs["tensors"][0].dtype  # a job's tensors share one dtype (Job)
        unused, self.tensor_part_reducer = self.tensor_part_reducer, PresummedReducer(
            self.tensor_part_reducer.part_shapes, self.tensor_part_reducer.num_senders, dtype, mean
        )
        unused.finished.set()  # it never takes a part: finalising it would warn that parts were missing


# Iterations of CenteredClip: each moves the estimate by at most the clip radius; from the median these are plenty.
CLIP_ITERATIONS = 20


def centered_clip(values: Sequence[torch.Tensor], radius: float) -> tuple[torch.Tensor, list[int]]:
    """CenteredClip of `values` (one tensor per replica, each counted once): from their coordinate-wise median,
    repeat v <- v + mean_i clip(x_i - v, radius), where clip scales a difference longer than `radius` (an L2 norm)
    down to it. Returns v and the indices of the values still farther than `radius` from it (the clipped)."""
    stacked = torch.stack(list(values))
    v = stacked.median(dim=0).values
    for _ in range(CLIP_ITERATIONS):
        diff = stacked - v
        norms = diff.flatten(1).norm(dim=1)
        scale = torch.clamp(radius / torch.clamp(norms, min=1e-300), max=1.0).view(-1, *([1] * (stacked.dim() - 1)))
        v = v + (scale * diff).mean(dim=0)
    norms = (stacked - v).flatten(1).norm(dim=1)
    return v, [i for i, n in enumerate(norms.tolist()) if n > radius]


class ClipAccumulator:
    """Takes the place of the reducer's accumulator under CenteredClip: keeps each sender's part (replicas' float64
    sums, weight x mean) and, once all are in, returns a robust estimate of their mean on the float32 grid (as
    SumAccumulator's mean), noting which senders it clipped.

    A sender's weight (its microbatch count) is its own claim, which nothing here can check: CenteredClip counts
    every replica that computed a microbatch once, so that a replica claiming a huge weight pulls no harder than
    the others. When it clips no one, every replica's mean lies within the radius of its estimate, and so does
    their weighted mean, which is returned instead: the exact mean of an honest step (as the summing reducer's),
    and one that a liar about its weight can move at most the radius from the robust estimate."""

    def __init__(self, shape: torch.Size, clip_rms: float, clipped: set[int]) -> None:
        self.shape = shape
        self.radius = clip_rms * max(1, shape.numel()) ** 0.5
        self.parts: list[tuple[int, torch.Tensor, float]] = []
        self.clipped = clipped

    def add_(self, sender_part: tuple[int, torch.Tensor], alpha: float) -> None:
        sender, part = sender_part
        self.parts.append((sender, part, alpha))

    def div_(self, _denominator: float) -> torch.Tensor:
        counted = [(sender, part, weight) for sender, part, weight in self.parts if weight > 0]
        # A NaN or an infinity would make the median and every distance NaN: such a part or weight is left out, and
        # flagged.
        self.clipped.update(sender for sender, part, weight in counted
                            if not (math.isfinite(weight) and bool(torch.isfinite(part).all())))
        counted = [c for c in counted if c[0] not in self.clipped]
        if not counted:  # no replica computed a microbatch: the mean of nothing, as the summing reducer gives
            return torch.zeros(self.shape, dtype=torch.float64)
        estimate, clipped = centered_clip([part / weight for _, part, weight in counted], self.radius)
        if clipped:
            self.clipped.update(counted[i][0] for i in clipped)
            return estimate.float().double()
        return (sum(part for _, part, _ in counted) / sum(weight for _, _, weight in counted)).float().double()


class ClipReducer(TensorPartReducer):
    """hivemind's reducer with ClipAccumulator: each part travels to the accumulator with its sender's index."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, clip_rms: float) -> None:
        self.clip_rms = clip_rms
        self.clipped: set[int] = set()  # sender indices clipped in any part
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:  # noqa: D102
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = ClipAccumulator(self.part_shapes[self.current_part_index], self.clip_rms, self.clipped)

    async def accumulate_part(  # noqa: D102
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        return await super().accumulate_part(sender_index, part_index, (sender_index, tensor_part), weight)


class ClipRunner(AllReduceRunner):
    """AllReduceRunner whose reducer aggregates presummed parts by CenteredClip (ClipReducer)."""

    def __init__(self, clip_rms: float, **kwargs) -> None:
        super().__init__(**kwargs)
        unused, self.tensor_part_reducer = self.tensor_part_reducer, ClipReducer(
            self.tensor_part_reducer.part_shapes, self.tensor_part_reducer.num_senders, clip_rms
        )
        unused.finished.set()

    def clipped_peers(self) -> list[str]:
        """The groupmates (base58) whose parts this peer's reducer clipped."""
        return [self.ordered_peer_ids[i].to_base58() for i in sorted(self.tensor_part_reducer.clipped)]
