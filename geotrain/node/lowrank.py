"""PowerSGD as the replicas' gradient averaging (compression.replica_grads = "powersgd[:rank=R]").

Kept apart from node.averaging, which imports hivemind: this is plain torch over any all-reduce that averages
float64 tensors exactly alike on every replica. All of it runs on the host, whatever device the gradients live on:
hivemind averages host tensors, the shared random factors are made there, and MPS has no float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from geotrain.compression import PowerSgdCodec

AllReduce = Callable[[int, list[torch.Tensor]], None]
"""all_reduce(round, tensors): replace float64 tensors in place by their weighted mean over the group."""


# What is left of a column after projecting out the others, relative to its norm, below which it was dependent.
_DEPENDENT = 1e-9


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    # Exactly rounded (math.fsum), so the result does not depend on how a platform orders a reduction.
    return math.fsum((a * b).tolist())


def orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """The columns of p (float64) orthonormalised by Gram-Schmidt, run twice for accuracy; a column that depends
    on the ones before it (all but rounding noise of it projected away) comes out zero. Built from correctly
    rounded elementwise operations and exactly rounded dot products only, so any hardware computes the same bits
    from the same p (LAPACK's QR need not)."""
    columns: list[torch.Tensor] = []
    for j in range(p.shape[1]):
        v = p[:, j].clone()
        before = math.sqrt(_dot(v, v))
        for _ in range(2):
            for u in columns:
                v = v - u * _dot(u, v)
        norm = math.sqrt(_dot(v, v))
        columns.append(v / norm if norm > _DEPENDENT * before else torch.zeros_like(v))
    return torch.stack(columns, 1)


class LowRankAveraging:
    """PowerSGD (Vogels et al., NeurIPS 2019) as the replicas' gradient averaging.

    For each gradient matrix M (rows = first dimension), replica i adds its error feedback e_i, computes
    P_i = (M_i + e_i) Q with the group's shared Q, and the group all-reduces the P_i (round 0, together with the
    tensors too small to gain from a low-rank form, which are averaged whole); every replica orthonormalises the
    mean to P^, computes Q_i = (M_i + e_i)^T P^, and the group all-reduces the Q_i (round 1). Every replica's
    gradient becomes P^ mean(Q)^T and its error feedback (M_i + e_i) - P^ Q_i^T; mean(Q) warm-starts the next step.
    The wire carries rank x (rows + cols) values per matrix instead of rows x cols.

    Replicas stay bit-identical: both means come out of the all-reduce alike on every replica (float64 copies,
    as with uncompressed averaging), and what is computed from them afterwards (the orthonormalisation, the rank-R
    product) uses only operations every platform rounds alike. Error feedback and Q start afresh with a new plan
    epoch: the group, the stage's layers, and the step being redone may all have changed."""

    def __init__(self, codec: PowerSgdCodec) -> None:
        self.codec = codec
        self._epoch: int | None = None
        self._residuals: dict[int, torch.Tensor] = {}
        self._q: dict[int, torch.Tensor] = {}

    def average(self, epoch: int, grads: Sequence[torch.Tensor], all_reduce: AllReduce) -> None:
        """Replace `grads` in place by the group's low-rank mean gradient."""
        if epoch != self._epoch:
            self._epoch, self._residuals, self._q = epoch, {}, {}
        forms = {i: self.codec.matrix(tuple(g.shape)) for i, g in enumerate(grads)}
        matrices = {i: form for i, form in forms.items() if form is not None}
        whole = [i for i, form in forms.items() if form is None]
        acc: dict[int, torch.Tensor] = {}
        # Moved to the host in their own dtype, widened there: a device may have no float64 (MPS).
        host = [g.detach().cpu().double() for g in grads]
        for i, (rows, cols, rank) in matrices.items():
            m = host[i].view(rows, cols)
            residual = self._residuals.get(i)
            acc[i] = m + residual if residual is not None else m
            if i not in self._q:
                seed = torch.Generator().manual_seed(rows * cols)
                self._q[i] = torch.randn(cols, rank, generator=seed, dtype=torch.float64)
        p = {i: acc[i] @ self._q[i] for i in matrices}
        whole_values = [host[i] for i in whole]
        all_reduce(0, [p[i] for i in matrices] + whole_values)
        p_hat = {i: orthonormal_columns(p[i]) for i in matrices}
        q_local = {i: acc[i].T @ p_hat[i] for i in matrices}
        q_mean = {i: q.clone() for i, q in q_local.items()}
        all_reduce(1, list(q_mean.values()))
        for i, (rows, cols, rank) in matrices.items():
            approx = torch.zeros(rows, cols, dtype=torch.float64)
            for j in range(rank):  # rank-1 terms in a fixed order: elementwise products and sums round alike
                approx = approx + p_hat[i][:, j : j + 1] * q_mean[i][:, j]
            grads[i].copy_(approx.to(grads[i].dtype).view(grads[i].shape))  # rounded on the host
            self._residuals[i] = acc[i] - p_hat[i] @ q_local[i].T  # local: it may round as this platform likes
            # A zero column would stay zero from the warm start on; a fresh random Q replaces it next step.
            if bool((q_mean[i].abs().amax(0) > 0).all()):
                self._q[i] = q_mean[i]
            else:
                del self._q[i]
        for i, averaged in zip(whole, whole_values):
            grads[i].copy_(averaged.to(grads[i].dtype))
