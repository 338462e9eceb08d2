"""What a stage replica holds in memory, term by term: the one model the coordinator's planner places by
(scheduler/costmodel.py) and a node checks its own room against (node/profiler.py), so both say the same.

A replica of a stage with P parameters (node/stage.py, node/holder.py) peaks while it trains:
    P x (4 fp32 weights + 4 the gradient of the microbatch in backward, later the mean it commits
         + 8 float64 gradient sums + 8 AdamW moments [+ 8 DiLoCo's fp32 anchor and outer velocity])
    + the activations of the microbatches in flight, as the node measured them in its precision:
      autocast's 16-bit weight copies are among each microbatch's saved tensors, so they count there, once
    + the largest parameter tensor twice more: its float32 gradient widened to float64 as it is added into its sum
and the process's own baseline (interpreter, torch, gRPC, the data, and what timing the layers left allocated: measured
by the node once it has profiled, before it builds its stage) comes on top. Serving its state (a checkpoint, a new
replica) costs no copy of it: a snapshot reads the stage's own tensors and keeps what it has not sent in a file once
the stage changes (node/handover.py), so a transfer holds a few chunks (handover.transfer_memory_bytes), less than the
float64 sums the commit freed.
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


def stage_bytes(params: Bytes, activations: Bytes, largest_tensor: Bytes, *, diloco: bool) -> Bytes:
    """Peak bytes of a replica beyond the process's baseline (while it trains): `params` parameters, `activations`
    bytes kept for the microbatches in flight, `largest_tensor` bytes of its largest parameter tensor (numbers or
    arrays)."""
    return params * training_bytes_per_param(diloco) + activations + largest_tensor * (FLOAT64_BYTES // FP32_BYTES)
