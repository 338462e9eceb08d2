"""Checks of an incoming tensor before its payload is read, which the servicer calls (through StageHandler) as
petals' handler calls block_functions: the node's current plan expects it, from the node that signed it, with the
shape, dtype and codec the plan allows."""

from __future__ import annotations

import grpc

from geotrain.compression.policy import CodecPolicy
from geotrain.config import RunConfig
from geotrain.node.model import family_of
from geotrain.node.servicer import WIRE_DTYPES, check_activation_header
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import FrameError


def sender_of(direction: str, ref: pb.MicrobatchRef, stage_index: int) -> tuple[str, int]:
    """Who sends a tensor that passed check_incoming's path checks, and their stage: activations come from the
    path's last node, gradients from the next stage's node on it."""
    if direction == "forward":
        return ref.path[-1], stage_index - 1
    return ref.path[stage_index + 1], stage_index + 1



def plan_key(plan: pb.Plan, stage: int, node_id: str) -> bytes | None:
    """The public key the plan gives node_id as a node of `stage`; None when it serves no such stage."""
    assignment = plan.stages[stage]
    for n, key in zip(assignment.node_ids, assignment.public_keys):
        if n == node_id:
            return key
    return None


class IncomingChecks:
    """The StageHandler's checks of incoming tensors (a part of Agent)."""

    _policies: dict[str, CodecPolicy]  # traffic kind -> its codec policy, from the run config
    # The plan and run config the shape below was computed for, and the shape their tensors have on the wire.
    _boundary: tuple[pb.Plan, RunConfig, list[int]] | None = None

    def _boundary_shape(self, plan: pb.Plan) -> list[int]:
        """The shape every activation and gradient has on the wire under `plan`: the run's model and microbatch size
        decide it, so it is computed once per plan (and config), not for each tensor."""
        cfg, known = self.cfg, self._boundary
        if known is None or known[0] is not plan or known[1] is not cfg:
            shape = list(family_of(cfg.model).boundary_shape(cfg.model, cfg.train.microbatch_size))
            known = self._boundary = (plan, cfg, shape)
        return known[2]

    def check_incoming(
        self, direction: str, ref: pb.MicrobatchRef, header: pb.TensorHeader, signer: bytes | None
    ) -> None:
        """Raise FrameError unless this node's current plan expects this tensor, from the node that signed it: the
        path's last node for activations; for gradients, the node this one sent the microbatch's activations to."""
        plan, runtime, cfg = self.plan, self.runtime, self.cfg
        if plan is None or runtime is None or cfg is None:
            raise FrameError(grpc.StatusCode.UNAVAILABLE, "this node has no stage yet")
        if ref.plan_epoch != plan.epoch:
            raise FrameError(
                grpc.StatusCode.FAILED_PRECONDITION, f"plan epoch {ref.plan_epoch}, this node runs epoch {plan.epoch}"
            )
        # A step's tensors come after this node applied the step before (validation: after the step it scores), so
        # an older one is a replay, by a relay for instance, of a tensor its sender signed once. A training step
        # starts while its nodes apply the one before, no earlier: its tensors wait for that apply (StepFlow), and
        # none may come from further ahead.
        if ref.step < runtime.applied_step + (0 if ref.eval else 1) or (
            not ref.eval and ref.step > runtime.applied_step + 2
        ):
            raise FrameError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {ref.step}{' (validation)' if ref.eval else ''}, this node applied step {runtime.applied_step}",
            )
        if direction == "forward":
            if runtime.is_first:
                raise FrameError(grpc.StatusCode.FAILED_PRECONDITION, "the first stage takes no activations")
            if len(ref.path) != self.stage_index or ref.path[-1] not in plan.stages[self.stage_index - 1].node_ids:
                raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "activation path does not lead to this stage")
            kind = "activations"
        else:
            if runtime.is_last:
                raise FrameError(grpc.StatusCode.FAILED_PRECONDITION, "the last stage takes no gradients")
            if len(ref.path) != len(plan.stages) or ref.path[self.stage_index] != self.node_id:
                raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, "gradient path does not pass through this node")
            kind = "activation_grads"
        sender, sender_stage = sender_of(direction, ref, self.stage_index)
        if signer is None or signer != plan_key(plan, sender_stage, sender):
            raise FrameError(
                grpc.StatusCode.PERMISSION_DENIED, f"{direction} from {sender} is not signed by {sender}'s key"
            )
        if direction == "backward" and not self.router.awaits(sender, ref.step, ref.microbatch):
            raise FrameError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this node sent step {ref.step} microbatch {ref.microbatch} to no {sender}, or has its gradient",
            )
        check_activation_header(
            header, self._boundary_shape(plan), WIRE_DTYPES[cfg.train.precision], self._policies[kind].accepted_ids,
            self.options.max_tensor_bytes,
        )

    def may_overflow(self, direction: str) -> bool:
        """fp16: a scaled gradient that overflowed flows on as Inf or NaN, and the step's gradient norm then makes
        every stage skip the step; anything else non-finite is refused."""
        return direction == "backward" and self.cfg is not None and self.cfg.train.precision == "fp16"
