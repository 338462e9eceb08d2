"""Bad input from the network: each gets a clear gRPC status, and the node keeps serving correctly.

A 3-stage run is held right after its plan is in place; the middle stage's node is attacked; then the run trains
and must end exactly where training in one process ends, so the rejected requests changed nothing.
"""

from __future__ import annotations

import threading
import grpc
import pytest
import torch

from geotrain.node.local import train_local
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import auth_metadata
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.transport import make_channel
from geotrain.scheduler.service import fetch_model_state
from tests.conftest import expect_status, local_cluster, message_chunks, tensor_chunks

FORWARD = "/geotrain.v1.Stage/Forward"

pytestmark = pytest.mark.cluster  # every test here starts a coordinator and nodes


@pytest.mark.timeout(120)
def test_bad_requests_are_rejected_and_change_nothing(small_config, tmp_path):
    cfg = small_config
    plan_ready, attacks_done = threading.Event(), threading.Event()

    def hold_after_plan(kind: str, _data: dict) -> None:
        if kind == "plan":
            plan_ready.set()
            attacks_done.wait(60)

    with local_cluster(cfg, 3, tmp_path, on_event=hold_after_plan) as cluster:
        assert plan_ready.wait(60)
        plan = cluster.coordinator.plan
        middle = plan.stages[1]
        address = middle.addresses[0]
        # The requests come from stage 0's node, signed with its key (in its --state-dir), which the middle stage
        # accepts tensors from: every check after the sender's is reached.
        sender = plan.stages[0].node_ids[0]
        key, _ = NodeKey.load_or_create(tmp_path / sender)
        good_channel = make_channel(address, cluster.token, lambda: sender, key=key)
        stub = rpc.StageStub(good_channel)
        shape = (cfg.train.microbatch_size, cfg.model.seq_len, cfg.model.d_model)
        activation = torch.randn(shape)
        # An evaluation forward is a correct request that leaves training state alone.
        ref = pb.MicrobatchRef(plan_epoch=plan.epoch, step=0, microbatch=0, path=[sender], eval=True)

        def forward(chunks):
            return stub.Forward(iter(chunks), timeout=10)

        # Wrong token.
        bad_stub = rpc.StageStub(make_channel(address, "not-the-token", lambda: "tester"))
        expect_status(grpc.StatusCode.UNAUTHENTICATED, "wrong token", lambda: bad_stub.Forward(iter(tensor_chunks(activation, ref)), timeout=10))
        # Replayed request: the same proof twice.
        raw = rpc.StageStub(grpc.insecure_channel(address))
        proof = auth_metadata(cluster.token, FORWARD, sender, key)
        raw.Forward(iter(tensor_chunks(activation, ref)), metadata=proof, timeout=10)
        expect_status(grpc.StatusCode.UNAUTHENTICATED, "replayed", lambda: raw.Forward(iter(tensor_chunks(activation, ref)), metadata=proof, timeout=10))
        # Wrong protocol version, at the coordinator: a typed reject reason.
        coordinator = rpc.CoordinatorStub(make_channel(f"127.0.0.1:{cluster.port}", cluster.token, lambda: ""))
        reply = coordinator.Register(pb.RegisterRequest(protocol_version=999, address="127.0.0.1:1"), timeout=10)
        assert not reply.accepted and reply.reason == pb.REJECT_REASON_PROTOCOL_VERSION
        assert "protocol" in reply.message
        # Tensor of the wrong shape, of the wrong dtype.
        wrong = torch.randn(shape[0], shape[1], shape[2] + 1)
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, "expected shape", lambda: forward(tensor_chunks(wrong, ref)))
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, "expected float32",
                      lambda: forward(tensor_chunks(activation.half(), ref)))
        # A frame that claims far more bytes than any activation.
        expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the limit",
                      lambda: forward(tensor_chunks(activation, ref, payload_bytes=8 << 30)))
        # A truncated chunk stream.
        expect_status(grpc.StatusCode.DATA_LOSS, "truncated", lambda: forward(tensor_chunks(activation, ref)[:-1]))
        # Garbage bytes: a corrupted payload, NaNs, and bytes that are not even a protobuf message.
        corrupted = tensor_chunks(activation, ref)
        corrupted[1] = pb.TensorChunk(data=bytes(len(corrupted[1].data)))
        expect_status(grpc.StatusCode.DATA_LOSS, "checksum", lambda: forward(corrupted))
        # Random bytes that do not even fill the tensor the header announces.
        noise = bytes(torch.randint(0, 256, (activation.numel() * 4 - 3,), dtype=torch.uint8))
        header = framing.make_header("", torch.float32, shape, pb.CODEC_NONE, noise)
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, "cannot decode",
                      lambda: forward(message_chunks(header, noise, ref)))
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, "NaN",
                      lambda: forward(tensor_chunks(torch.full(shape, float("nan")), ref)))
        garbage = grpc.insecure_channel(address).stream_unary(FORWARD, request_serializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            garbage(iter([b"\xff\x00garbage\x17" * 10]), metadata=auth_metadata(cluster.token, FORWARD, "x"), timeout=10)
        assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
        # A stale plan epoch and a path that does not fit the stage.
        stale = pb.MicrobatchRef(plan_epoch=plan.epoch + 7, step=0, microbatch=0, path=ref.path, eval=True)
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, "plan epoch", lambda: forward(tensor_chunks(activation, stale)))
        # After all that, a correct request is served.
        assert forward(tensor_chunks(activation, ref)) == pb.Ack()

        attacks_done.set()
        summary = cluster.wait(90)
        assert summary.steps == cfg.run.steps
        state = fetch_model_state(plan, cluster.token, summary.steps, cluster.coordinator.key)
        good_channel.close()

    runtime, _ = train_local(cfg)
    reference = dict(runtime.named_state())
    assert state.keys() == reference.keys()
    assert max((state[k] - reference[k]).abs().max().item() for k in state) <= 1e-4
