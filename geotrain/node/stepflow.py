"""The node's microbatch dataflow in a step: the data head's window of microbatches, forward and backward on
incoming tensors, and sending each result on. Checking incoming tensors is node/incoming.py, validation
node/evaluation.py, the commit and apply that end a step node/commit.py."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from geotrain.compression.policy import CodecPolicy
from geotrain.config import MAX_INFLIGHT
from geotrain.node.device import COMPUTE_DTYPES, HostTensor
from geotrain.node.incoming import sender_of
from geotrain.node.routing import ReplicaRouter
from geotrain.node.verifier import PENDING_BYTES, Evidence, hashes_off_worker
from geotrain.node.worker import BACKWARD, CONTROL, EVAL, FORWARD
from geotrain.protocol import geotrain_pb2 as pb


@dataclass
class _HeadState:
    """A data head's share of the current step."""

    epoch: int
    step: int
    waiting: deque[int]
    in_flight: set[int] = field(default_factory=set)
    started: dict[int, float] = field(default_factory=dict)  # microbatch -> when its forward started (monotonic)
    shortest_round_trip_s: float = math.inf


class StepFlow:
    """The Agent's microbatch dataflow in a step: the data head's window, forward and backward on incoming tensors
    (the StageHandler's accept), and what each sends on (a part of Agent)."""

    _head: _HeadState | None
    _policies: dict[str, CodecPolicy]  # traffic kind -> its codec policy, from the run config
    # The compute of tensors of the step after the one this node is yet to apply: (priority, task, plan epoch)
    _parked: list[tuple[int, Callable[[], None], int]]
    _parked_lock: threading.Lock
    # (plan epoch, step, its gradients' squared norm parts): a stage held by this node alone takes their norm as soon
    # as it has counted the step's every microbatch, before the coordinator's commit
    _norm_parts: tuple[int, int, list[float]] | None
    evidence: Evidence | None  # what verifiers may ask of this node's recent steps (cfg.verifying), and commitments

    def _init_stepflow(self) -> None:
        self._head = None
        self._policies = {}
        self.router = ReplicaRouter()
        self.evidence = None
        self._parked, self._parked_lock = [], threading.Lock()
        self._norm_parts = None

    def _start_step(self, start: pb.StartStep) -> None:
        assert self.cfg is not None and self.plan is not None
        self._head = _HeadState(epoch=self.plan.epoch, step=start.step, waiting=deque(start.microbatches))
        # The plan's window (the coordinator's under train.inflight = "auto"), kept within config's bounds.
        window = min(max(self.plan.inflight, 1), MAX_INFLIGHT)
        for _ in range(min(window, len(start.microbatches))):
            self._launch_next()

    def _launch_next(self) -> None:
        head = self._head
        if head is None or not head.waiting:
            return
        microbatch = head.waiting.popleft()
        head.in_flight.add(microbatch)
        self._submit(FORWARD, lambda: self._head_forward(head.step, microbatch), head.epoch)

    def _batch(self, step: int, microbatch: int, validation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.cfg is not None and self.corpus is not None
        return self.corpus.batch(
            seed=self.cfg.run.seed,
            step=step,
            microbatch=microbatch,
            size=self.cfg.train.microbatch_size,
            seq_len=self.cfg.model.seq_len,
            validation=validation,
        )

    def _ref(self, step: int, microbatch: int, path: list[str], **extra) -> pb.MicrobatchRef:
        assert self.plan is not None
        return pb.MicrobatchRef(plan_epoch=self.plan.epoch, step=step, microbatch=microbatch, path=path, **extra)

    def _forward_to_next(self, ref: pb.MicrobatchRef, outputs: torch.Tensor) -> None:
        peer, address = self._peer(self.stage_index + 1)
        if not ref.eval:
            self.router.sent(peer, ref.step, ref.microbatch)
        self._send_tensor("activations", peer, address, "forward", ref, outputs)

    def _backward_to_previous(self, ref: pb.MicrobatchRef, grad: torch.Tensor, loss: HostTensor | None = None) -> None:
        """Send a gradient back along the microbatch's path; the last stage's `loss` goes with it, read once the
        gradient's copy has started (the sender reads it, not the worker)."""
        peer = ref.path[self.stage_index - 1]
        self._send_tensor("activation_grads", peer, self._address_of(peer), "backward", ref, grad, loss)

    def _send_tensor(
        self, kind: str, peer: str, address: str, direction: str, ref: pb.MicrobatchRef, tensor: torch.Tensor,
        loss: HostTensor | None = None,
    ) -> None:
        """Start the tensor's copy to the host and hand its encoding and sending to a sender thread: the worker goes
        on to its next task while the copy overlaps that task's compute. A link's encodes still run in the order the
        worker produced its tensors (its turns): a codec's state (PowerSGD's warm start) and auto's choice see them
        in that order, whatever order the sender threads run in. A training microbatch's tensor is committed to as it
        goes to the codec (node/verifier.py)."""
        assert self.runtime is not None and self.cfg is not None
        host = self.runtime.copies.to_host_async(tensor)
        turn = self.dataplane.take_turn(peer, address, direction)
        wire_dtype = COMPUTE_DTYPES[self.cfg.train.precision]

        def send() -> None:
            try:
                with self.dataplane.in_turn(turn):
                    on_host = host.wait().to(wire_dtype)
                    if self.evidence is not None and not ref.eval:
                        self.evidence.sent(ref.plan_epoch, ref.step, ref.microbatch, direction, on_host)
                    if loss is not None:
                        ref.loss = loss.item()
                    estimate, compute_s = self.dataplane.estimate(peer), self.compute.per_microbatch()
                    codec = self._policies[kind].codec(peer, on_host.shape, on_host.dtype, estimate, compute_s)
                    encoded = self.dataplane.encode(peer, address, direction, codec, on_host)
            except Exception as e:  # what the worker's task would have failed with, had it encoded
                self._task_failed(e)
                return
            self.dataplane.send(peer, address, direction, ref, encoded)

        self._send(send, f"{direction} to {peer}", peer, ref.plan_epoch)

    def _head_forward(self, step: int, microbatch: int) -> None:
        runtime = self.runtime
        assert runtime is not None
        if self._head is not None and self._head.step == step:
            self._head.started[microbatch] = time.monotonic()
        x, y = self._batch(step, microbatch)
        self._begin_evidence(step)
        outputs = runtime.forward((step, microbatch), x)
        path = [self.node_id]
        if runtime.is_last:
            loss, _ = runtime.loss_backward((step, microbatch), y)
            self.throughput.tick()
            self._counted(step)
            self._microbatch_done(step, microbatch, path, loss.item())
        else:
            self._forward_to_next(self._ref(step, microbatch, path), outputs)

    def _begin_evidence(self, step: int) -> None:
        """Commit to the parameters this step is computed with, and to each microbatch's parameter gradients."""
        runtime, plan = self.runtime, self.plan
        if self.evidence is None or runtime is None or plan is None:
            return
        self.evidence.watch(plan.epoch, step, runtime, self._sender if hashes_off_worker(runtime.device) else None)

    def _hash_evidence(self) -> None:
        """Commit to what the tasks received, sent and counted once they hold PENDING_BYTES, after a task's result is
        on its way (no neighbour waits for it); the rest at the commit."""
        if self.evidence is not None:
            self.evidence.hash_pending(PENDING_BYTES)

    def _microbatch_done(self, step: int, microbatch: int, path: list[str], loss: float) -> None:
        assert self.cfg is not None and self.plan is not None
        request = pb.MicrobatchDoneRequest(
            node_id=self.node_id,
            step=step,
            microbatch=microbatch,
            path=path,
            loss=loss,
            tokens=self.cfg.train.microbatch_size * self.cfg.model.seq_len,
            plan_epoch=self.plan.epoch,
        )
        self._report(self.coordinator.MicrobatchDone, request)
        head = self._head
        if head is not None and head.step == step:
            head.in_flight.discard(microbatch)
            if microbatch in head.started:
                round_trip = time.monotonic() - head.started.pop(microbatch)
                head.shortest_round_trip_s = min(head.shortest_round_trip_s, round_trip)
            self._launch_next()

    def accept(self, direction: str, ref: pb.MicrobatchRef, tensor: torch.Tensor, wire_bytes: int) -> None:
        """Queue the compute for a validated incoming tensor."""
        sender, _ = sender_of(direction, ref, self.stage_index)
        self.dataplane.count_received(sender, tensor.numel() * tensor.element_size(), wire_bytes)
        if self.evidence is not None and not ref.eval:
            self.evidence.received(ref.plan_epoch, ref.step, ref.microbatch, direction, tensor)
        if direction == "forward":
            self._submit_in_step_order(ref, EVAL if ref.eval else FORWARD, lambda: self._on_forward(ref, tensor))
        else:
            self.router.returned(sender, ref.step, ref.microbatch)
            self._submit(BACKWARD, lambda: self._on_backward(ref, tensor), ref.plan_epoch)

    def _submit_in_step_order(self, ref: pb.MicrobatchRef, priority: int, task: Callable[[], None]) -> None:
        """Queue a forward's compute, or park it until this node applied the step before it: the coordinator starts
        a step while its nodes apply the one before, so a neighbour's first activations may come before the order to
        apply (IncomingChecks refuses steps further ahead). Gradients need no parking: they answer this node's own
        activations, sent after the apply."""
        with self._parked_lock:
            runtime = self.runtime
            if not ref.eval and runtime is not None and ref.step > runtime.applied_step + 1:
                self._parked.append((priority, task, ref.plan_epoch))
                return
        self._submit(priority, task, ref.plan_epoch)

    def _release_parked(self) -> None:
        """Queue what waited for the step just applied (called after runtime.apply: a forward parked before it is
        here, one checked after it was queued at once)."""
        with self._parked_lock:
            parked, self._parked = self._parked, []
        for priority, task, epoch in parked:
            self._submit(priority, task, epoch)

    def _drop_parked(self) -> None:
        """Forget what waited for an apply: a new plan epoch redoes the step from scratch."""
        with self._parked_lock:
            self._parked = []

    def _on_forward(self, ref: pb.MicrobatchRef, x: torch.Tensor) -> None:
        runtime = self.runtime
        assert runtime is not None
        key = (ref.step, ref.microbatch)
        path = [*ref.path, self.node_id]
        # Under model.boundary_rank the stage rebuilds the stream from the tokens, which it gets as the last stage
        # gets its targets.
        tokens = self._batch(ref.step, ref.microbatch, ref.eval)[0] if runtime.needs_tokens else None
        if ref.eval:
            self._eval_forward(ref, x, tokens)
            return
        self._begin_evidence(ref.step)
        if runtime.is_last:
            runtime.forward(key, x, tokens)
            self.time_rest_as("backward")
            _, y = self._batch(ref.step, ref.microbatch)
            loss, grad = runtime.loss_backward(key, y)
            self.throughput.tick()
            self._backward_to_previous(self._ref(ref.step, ref.microbatch, path), grad, loss)
            self._counted(ref.step)
        else:
            self._forward_to_next(self._ref(ref.step, ref.microbatch, path), runtime.forward(key, x, tokens))
        self._hash_evidence()

    def _on_backward(self, ref: pb.MicrobatchRef, grad: torch.Tensor) -> None:
        runtime = self.runtime
        assert runtime is not None
        grad_in = runtime.backward((ref.step, ref.microbatch), grad)
        self.throughput.tick()
        self._counted(ref.step)
        if runtime.is_first:
            self._microbatch_done(ref.step, ref.microbatch, list(ref.path), ref.loss)
        else:
            self._backward_to_previous(ref, grad_in)
        self._hash_evidence()

    def _counted(self, step: int) -> None:
        """After a microbatch's backward: once a stage this node holds alone has counted every microbatch of the
        step (and so taken their mean with the last one's sum: StageRuntime.mean_at), take the gradients' norm and
        report it at once (a task of its own, after the backward's timing), while the data head may still finish its
        last backward: the coordinator's commit order then finds the norm in, a round trip sooner. Under
        verification the report waits for the order: its commitments cover the gradients this node sends, hashed on
        their way out."""
        runtime, plan = self.runtime, self.plan
        assert runtime is not None and plan is not None
        if not runtime.mean_at or runtime.counted(step) != runtime.mean_at:
            return
        epoch = plan.epoch

        def report_norm() -> None:
            done = self._norm_parts is not None and self._norm_parts[:2] == (epoch, step)
            if runtime is self.runtime and not done:
                self._norm_parts = (epoch, step, runtime.grad_sq_norm_parts())
                if self.evidence is None:
                    self._commit(pb.CommitStep(step=step, plan_epoch=epoch))

        self._submit(CONTROL, report_norm, epoch)
