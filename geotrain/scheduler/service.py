"""The Coordinator gRPC service (thin: translate RPCs to Coordinator calls) and the state download for --save-final."""

from __future__ import annotations

import logging

import grpc
import torch

from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.transport import TlsFiles, make_channel, make_server
from geotrain.scheduler.coordinator import Coordinator

log = logging.getLogger(__name__)

COORDINATOR_ID = "coordinator"
_FETCH_DEADLINE_S = 300.0


class CoordinatorServicer(rpc.CoordinatorServicer):
    """Serves the Coordinator service for one Coordinator."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    def Register(self, request, context):  # noqa: D102, N802
        return self.c.register(request)

    def Heartbeat(self, request, context):  # noqa: D102, N802
        return self.c.heartbeat(request)

    def Orders(self, request, context):  # noqa: D102, N802
        try:
            yield from self.c.order_stream(request.node_id, context.is_active)
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {request.node_id}: register first")

    def MicrobatchDone(self, request, context):  # noqa: D102, N802
        self.c.microbatch_done(request)
        return pb.Ack()

    def EvalDone(self, request, context):  # noqa: D102, N802
        self.c.eval_done(request)
        return pb.Ack()

    def GradNorm(self, request, context):  # noqa: D102, N802
        self.c.grad_norm(request)
        return pb.Ack()

    def StepApplied(self, request, context):  # noqa: D102, N802
        self.c.step_applied(request)
        return pb.Ack()

    def Status(self, request, context):  # noqa: D102, N802
        return self.c.status()


def make_coordinator_server(
    coordinator: Coordinator, token: str, listen: str, tls: TlsFiles | None = None
) -> tuple[grpc.Server, int]:
    """A server for `coordinator` bound to `listen` (not yet started); returns it and its port."""
    server, port = make_server(token, listen, max_workers=64, tls=tls)
    rpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
    return server, port


def fetch_model_state(plan: pb.Plan, token: str, steps_done: int, tls: TlsFiles | None = None) -> dict[str, torch.Tensor]:
    """The whole model's parameters, downloaded stage by stage from one replica each."""
    state: dict[str, torch.Tensor] = {}
    for stage in plan.stages:
        channel = make_channel(stage.addresses[0], token, lambda: COORDINATOR_ID, tls)
        try:
            stream = rpc.StageStub(channel).FetchState(pb.FetchStateRequest(step=steps_done), timeout=_FETCH_DEADLINE_S)
            for received in framing.read_tensors(stream):
                state[received.header.name] = framing.raw_tensor(received.header, received.payload)
        finally:
            channel.close()
    return state
