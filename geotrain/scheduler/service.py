"""The Coordinator gRPC service (thin: translate RPCs to Coordinator calls) and the state download for --save-final."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import grpc
import torch

from geotrain.config import RunConfig
from geotrain.lifetime import tie_children_to_this_process

from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.probe import serve_probe
from geotrain.protocol.transport import TlsFiles, make_channel, make_server
from geotrain.scheduler.checkpoint import CheckpointStore
from geotrain.scheduler.coordinator import Coordinator, EventSink
from geotrain.scheduler.state import RunStore

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

    def ReportFailure(self, request, context):  # noqa: D102, N802
        self.c.report_failure(request)
        return pb.Ack()

    def FetchCheckpoint(self, request, context):  # noqa: D102, N802
        state = self.c.checkpoint_state(request.layer_start, request.layer_end, request.steps_done)
        if not state:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint holds layers "
                          f"[{request.layer_start}, {request.layer_end}) after {request.steps_done} steps")
        yield from framing.state_chunks(state.items())

    def ReportProfile(self, request, context):  # noqa: D102, N802
        try:
            self.c.report_profile(request)
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {request.node_id}: register first")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad profile from {request.node_id}: {e}")
        return pb.Ack()

    def Probe(self, request_iterator, context):  # noqa: D102, N802
        return serve_probe(request_iterator, context)


def make_coordinator_server(
    coordinator: Coordinator, token: str, listen: str, tls: TlsFiles | None = None
) -> tuple[grpc.Server, int]:
    """A server for `coordinator` bound to `listen` (not yet started); returns it and its port."""
    server, port = make_server(token, listen, max_workers=64, tls=tls)
    rpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
    return server, port


def fetch_stage_state(
    address: str, token: str, steps_done: int, tls: TlsFiles | None = None
) -> dict[str, torch.Tensor]:
    """A stage's parameters and optimizer state after `steps_done` steps, downloaded from a node serving it."""
    channel = make_channel(address, token, lambda: COORDINATOR_ID, tls)
    try:
        stream = rpc.StageStub(channel).FetchState(pb.FetchStateRequest(steps_done=steps_done), timeout=_FETCH_DEADLINE_S)
        return framing.read_state(stream)
    finally:
        channel.close()


def fetch_model_state(plan: pb.Plan, token: str, steps_done: int, tls: TlsFiles | None = None) -> dict[str, torch.Tensor]:
    """The whole model's parameters (no optimizer state), stage by stage from one replica each."""
    state: dict[str, torch.Tensor] = {}
    for stage in plan.stages:
        tensors = fetch_stage_state(stage.addresses[0], token, steps_done, tls)
        state.update({k: v for k, v in tensors.items() if k.startswith("layers.")})
    return state


class CoordinatorProcess:
    """A coordinator with everything it runs on: run state, checkpoints, the hivemind DHT replicas bootstrap from,
    and its gRPC server (bound, not yet started). close() releases all of it."""

    def __init__(
        self,
        cfg: RunConfig,
        token: str,
        listen: str,
        *,
        state_dir: str | Path | None = None,
        resume: bool = False,
        on_event: EventSink | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        from hivemind import DHT

        self.store = RunStore(Path(state_dir) / "run.sqlite") if state_dir else RunStore()
        committed = self.store.committed_steps()
        if committed and not resume:
            self.store.close()
            raise ValueError(f"{state_dir} holds a run at step {committed}: pass --resume to continue it")
        if not self.store.get("run_id"):
            self.store.put("run_id", secrets.token_hex(8))
        checkpoints = (
            CheckpointStore(Path(state_dir) / "checkpoints", cfg.scheduler.keep_checkpoints) if state_dir else None
        )
        # Started before any gRPC object: hivemind forks its DHT process, and a fork while gRPC threads run breaks it.
        host = listen.rsplit(":", 1)[0]
        tie_children_to_this_process()  # the DHT process and its p2pd must not outlive a killed coordinator
        self.dht = DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)
        self.coordinator = Coordinator(
            cfg,
            store=self.store,
            checkpoints=checkpoints,
            fetch_state=lambda address, steps_done: fetch_stage_state(address, token, steps_done, tls),
            dht_peers=[str(m) for m in self.dht.get_visible_maddrs()],
            run_id=self.store.get("run_id", ""),
            on_event=on_event,
        )
        self.server, self.port = make_coordinator_server(self.coordinator, token, listen, tls)

    def close(self) -> None:
        """Stop the server and the DHT, and close the run state."""
        self.server.stop(grace=1.0).wait(3.0)
        self.dht.shutdown()
        self.store.close()
