"""Validation on the node: a data head's validation microbatches, their forward through the stage, and the last
stage's loss reported to the coordinator (no backward, no state change)."""

from __future__ import annotations

import torch

from geotrain.node.model import loss_fn
from geotrain.protocol import geotrain_pb2 as pb


class Evaluation:
    """The Agent's validation forwards (a part of Agent)."""

    def _evaluate(self, order: pb.Evaluate) -> None:
        runtime = self.runtime
        assert runtime is not None
        for microbatch in order.microbatches:
            x, _ = self._batch(order.step, microbatch, validation=True)
            outputs = runtime.evaluate(x)
            if runtime.is_last:
                self._eval_done(order.step, microbatch, outputs)
            else:
                self._forward_to_next(self._ref(order.step, microbatch, [self.node_id], eval=True), outputs)

    def _eval_done(self, step: int, microbatch: int, logits: torch.Tensor) -> None:
        assert self.plan is not None
        _, y = self._batch(step, microbatch, validation=True)
        loss = loss_fn(logits, y.to(logits.device)).item()
        request = pb.EvalDoneRequest(
            node_id=self.node_id, step=step, microbatch=microbatch, loss=loss, plan_epoch=self.plan.epoch
        )
        self._report(self.coordinator.EvalDone, request)

    def _eval_forward(self, ref: pb.MicrobatchRef, x: torch.Tensor, tokens: torch.Tensor | None) -> None:
        """A validation microbatch's activations from the stage before: on to the next stage, or scored here."""
        runtime = self.runtime
        assert runtime is not None
        outputs = runtime.evaluate(x, tokens)
        if runtime.is_last:
            self._eval_done(ref.step, ref.microbatch, outputs)
        else:
            self._forward_to_next(self._ref(ref.step, ref.microbatch, [*ref.path, self.node_id], eval=True), outputs)
