"""What a stage replica holds in memory, term by term: the one model the coordinator's planner places by
(scheduler/costmodel.py) and a node checks its own room against (node/profiler.py), so both say the same.

A replica of a stage with P parameters (node/stage.py, node/holder.py) peaks in one of two phases:
    training   P x (4 fp32 weights + 4 the mean gradient it commits, in buffers kept from step to step
                    + 8 float64 gradient sums + 8 AdamW moments [+ 8 DiLoCo's fp32 anchor and outer velocity])
               + the activations of the microbatches in flight, as the node measured them in its precision:
                 autocast's 16-bit weight copies are among each microbatch's saved tensors, so they count there, once
               + the largest parameter tensor twice more: its float32 gradient widened to float64 as it is added
                 into its sum
    serving    after the commit (the sums freed, the mean's buffers kept) a copy of its state for a checkpoint or a
               new replica: P x (4 + 4 + 8 [+ 8]) + P x (4 + 8 [+ 8]) the snapshot + the largest tensor (its bytes
               being framed)
and the process's own baseline (interpreter, torch, gRPC, the data, and what timing the layers left allocated: measured
by the node once it has profiled, before it builds its stage) comes on top of the larger phase.
"""

from __future__ import annotations

import numpy as np

FP32_BYTES = 4
FLOAT64_BYTES = 8  # node/stage.py sums every microbatch's gradient in float64: exact in any order
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32 whatever the compute precision
DILOCO_SLOTS = 2  # node/diloco.py: the anchor and the outer step's velocity, fp32

Bytes = float | np.ndarray


def training_bytes_per_param(diloco: bool) -> int:
    """Bytes a parameter costs while microbatches run: weight, gradient, float64 sum, AdamW (and DiLoCo) state."""
    return FP32_BYTES * (2 + ADAMW_MOMENTS + (DILOCO_SLOTS if diloco else 0)) + FLOAT64_BYTES


def snapshot_bytes_per_param(diloco: bool) -> int:
    """Bytes a parameter's share of a state snapshot costs: the weight, AdamW's moments (and DiLoCo's slots)."""
    return FP32_BYTES * (1 + ADAMW_MOMENTS + (DILOCO_SLOTS if diloco else 0))


def serving_bytes_per_param(diloco: bool) -> int:
    """Bytes a parameter costs while the replica serves its state: its state after the commit and the snapshot."""
    return FP32_BYTES * (2 + ADAMW_MOMENTS + (DILOCO_SLOTS if diloco else 0)) + snapshot_bytes_per_param(diloco)


def training_bytes(params: Bytes, activations: Bytes, largest_tensor: Bytes, *, diloco: bool) -> Bytes:
    """Bytes of a replica beyond the process's baseline while it trains: `params` parameters, `activations` bytes kept
    for the microbatches in flight, `largest_tensor` bytes of its largest parameter tensor (numbers or arrays)."""
    return params * training_bytes_per_param(diloco) + activations + largest_tensor * (FLOAT64_BYTES // FP32_BYTES)


def stage_bytes(params: Bytes, activations: Bytes, largest_tensor: Bytes, *, diloco: bool) -> Bytes:
    """Peak bytes of a replica beyond the process's baseline: the larger of training (training_bytes) and serving a
    snapshot of its state."""
    serving = params * serving_bytes_per_param(diloco) + largest_tensor
    return np.maximum(training_bytes(params, activations, largest_tensor, diloco=diloco), serving)
