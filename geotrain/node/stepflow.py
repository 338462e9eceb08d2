"""The node's part in a step: the data head's window of microbatches, forward and backward on incoming tensors,
evaluation, and the commit (replica averaging, gradient norms) and apply that end a step."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from geotrain.compression.policy import CodecPolicy
from geotrain.config import MAX_INFLIGHT
from geotrain.lifetime import tie_children_to_this_process
from geotrain.node.device import COMPUTE_DTYPES, HostTensor
from geotrain.node.failures import StageFailure
from geotrain.node.link import RPC_DEADLINE_S
from geotrain.node.lowrank import LowRankAveraging
from geotrain.node.model import family_of, loss_fn
from geotrain.node.servicer import WIRE_DTYPES, check_activation_header
from geotrain.node.stage import StageRuntime
from geotrain.node.verifier import Evidence
from geotrain.node.worker import BACKWARD, EVAL, FORWARD
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import FrameError
from geotrain.protocol.transport import call_with_retry

log = logging.getLogger(__name__)

# Bounds on the coordinator's JoinAveraging order (it names its own DHT's few listen addresses).
_MAX_DHT_PEERS = 32
_MAX_MULTIADDR_CHARS = 512
_DHT_ATTEMPTS = 3
# How long one attempt waits for its DHT process to be ready: a healthy one is up in seconds (its p2p daemon, a
# bootstrap ping of 3 s at most), and three attempts fit in the coordinator's default 60 s wait for replicas' peers.
_DHT_READY_S = 15.0


def _sender(direction: str, ref: pb.MicrobatchRef, stage_index: int) -> tuple[str, int]:
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
    """The Agent's compute in a step, as the StageHandler the servicer hands tensors to (a part of Agent)."""

    _head: _HeadState | None
    _policies: dict[str, CodecPolicy]  # traffic kind -> its codec policy, from the run config
    _low_rank: LowRankAveraging | None  # replicas average PowerSGD factors (replica_grads)
    _dht: object
    averager: object  # ReplicaAverager once the DHT is up
    _averaging_joined: bool
    _averaging_ready: threading.Event
    stopped: threading.Event  # set when the node stops serving
    evidence: Evidence | None  # what verifiers may ask of this node's recent steps (cfg.verifying), and commitments

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
            self._microbatch_done(step, microbatch, path, loss.item())
        else:
            self._forward_to_next(self._ref(step, microbatch, path), outputs)

    def _begin_evidence(self, step: int) -> None:
        """Commit to the parameters this step is computed with, and to each microbatch's parameter gradients."""
        runtime, plan = self.runtime, self.plan
        if self.evidence is None or runtime is None or plan is None:
            return
        self.evidence.watch(plan.epoch, step, runtime, self._sender)

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
        # an older one is a replay, by a relay for instance, of a tensor its sender signed once.
        if ref.step < runtime.applied_step + (0 if ref.eval else 1):
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
        sender, sender_stage = _sender(direction, ref, self.stage_index)
        if signer is None or signer != plan_key(plan, sender_stage, sender):
            raise FrameError(
                grpc.StatusCode.PERMISSION_DENIED, f"{direction} from {sender} is not signed by {sender}'s key"
            )
        if direction == "backward" and not self.router.awaits(sender, ref.step, ref.microbatch):
            raise FrameError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this node sent step {ref.step} microbatch {ref.microbatch} to no {sender}, or has its gradient",
            )
        shape = list(family_of(cfg.model).boundary_shape(cfg.model, cfg.train.microbatch_size))
        check_activation_header(
            header, shape, WIRE_DTYPES[cfg.train.precision], self._policies[kind].accepted_ids,
            self.options.max_tensor_bytes,
        )

    def may_overflow(self, direction: str) -> bool:
        """fp16: a scaled gradient that overflowed flows on as Inf or NaN, and the step's gradient norm then makes
        every stage skip the step; anything else non-finite is refused."""
        return direction == "backward" and self.cfg is not None and self.cfg.train.precision == "fp16"

    def accept(self, direction: str, ref: pb.MicrobatchRef, tensor: torch.Tensor, wire_bytes: int) -> None:
        """Queue the compute for a validated incoming tensor."""
        sender, _ = _sender(direction, ref, self.stage_index)
        self.dataplane.count_received(sender, tensor.numel() * tensor.element_size(), wire_bytes)
        if self.evidence is not None and not ref.eval:
            self.evidence.received(ref.plan_epoch, ref.step, ref.microbatch, direction, tensor)
        if direction == "forward":
            self._submit(EVAL if ref.eval else FORWARD, lambda: self._on_forward(ref, tensor), ref.plan_epoch)
        else:
            self.router.returned(sender, ref.step, ref.microbatch)
            self._submit(BACKWARD, lambda: self._on_backward(ref, tensor), ref.plan_epoch)

    def _on_forward(self, ref: pb.MicrobatchRef, x: torch.Tensor) -> None:
        runtime = self.runtime
        assert runtime is not None
        key = (ref.step, ref.microbatch)
        path = [*ref.path, self.node_id]
        # Under model.boundary_rank the stage rebuilds the stream from the tokens, which it gets as the last stage
        # gets its targets.
        tokens = self._batch(ref.step, ref.microbatch, ref.eval)[0] if runtime.needs_tokens else None
        if ref.eval:
            outputs = runtime.evaluate(x, tokens)
            if runtime.is_last:
                self._eval_done(ref.step, ref.microbatch, outputs)
            else:
                self._forward_to_next(self._ref(ref.step, ref.microbatch, path, eval=True), outputs)
            return
        self._begin_evidence(ref.step)
        if runtime.is_last:
            runtime.forward(key, x, tokens)
            self.time_rest_as("backward")
            _, y = self._batch(ref.step, ref.microbatch)
            loss, grad = runtime.loss_backward(key, y)
            self.throughput.tick()
            self._backward_to_previous(self._ref(ref.step, ref.microbatch, path), grad, loss)
        else:
            self._forward_to_next(self._ref(ref.step, ref.microbatch, path), runtime.forward(key, x, tokens))

    def _on_backward(self, ref: pb.MicrobatchRef, grad: torch.Tensor) -> None:
        runtime = self.runtime
        assert runtime is not None
        grad_in = runtime.backward((ref.step, ref.microbatch), grad)
        self.throughput.tick()
        if runtime.is_first:
            self._microbatch_done(ref.step, ref.microbatch, list(ref.path), ref.loss)
        else:
            self._backward_to_previous(ref, grad_in)

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

    def _commit(self, order: pb.CommitStep) -> None:
        """Average the step's gradients with the stage's other replicas, then report their squared norm."""
        runtime, plan = self.runtime, self.plan
        assert runtime is not None and plan is not None
        if order.plan_epoch != plan.epoch:
            return
        stage = plan.stages[self.stage_index]
        task_s = self.take_task_s(plan.epoch)
        averaging_s = 0.0
        if runtime.sync is not None:
            runtime.mean_gradients(order.step)  # this replica's own: under diloco replicas average no gradients
            if runtime.sync.due(order.step):
                averaging_s = self._sync_replicas(runtime, plan, stage, order.step)
        elif len(stage.node_ids) == 1:
            runtime.mean_gradients(order.step)
        else:
            averaging_s = self._with_replicas(
                stage, lambda: self._average_with_replicas(runtime, plan, stage, order.step)
            )
        parts = runtime.grad_sq_norm_parts()
        head = self._head
        round_trip_s = head.shortest_round_trip_s if head is not None and head.step == order.step else math.inf
        params_before, commitments = self.evidence.commitments(plan.epoch, order.step) if self.evidence else ("", [])
        request = pb.GradNormRequest(
            node_id=self.node_id, step=order.step, sq_norm=math.fsum(parts), sq_norm_parts=parts, plan_epoch=plan.epoch,
            clipped_peers=self.averager.take_clipped() if self.averager is not None else [],
            compute_s_per_microbatch=sum(task_s.values()), forward_s_per_microbatch=task_s.get("forward", 0.0),
            averaging_s=averaging_s,
            round_trip_s=round_trip_s if math.isfinite(round_trip_s) else 0.0,
            params_before=params_before, commitments=commitments,
        )
        self._report(self.coordinator.GradNorm, request)

    def _with_replicas(self, stage: pb.StageAssignment, average: Callable[[], None]) -> float:
        """Run `average` once this node can average with its stage's replicas, and return the seconds it took;
        StageFailure if it cannot or fails (the plan epoch is abandoned, and the survivors redo the step)."""
        if not self._averaging_ready.wait(RPC_DEADLINE_S) or self.averager is None:
            raise StageFailure(pb.FAILURE_REASON_AVERAGING, "replica averaging is not available on this node")
        # diloco's syncs as well as gradient averaging: replicas nobody can dial take part as clients.
        self.averager.clients = frozenset(p for p, behind in zip(stage.peer_ids, stage.unreachable) if behind)
        started = time.monotonic()
        try:
            average()
        except Exception as e:
            why = f"averaging with the stage's replicas failed: {e!r}"
            raise StageFailure(pb.FAILURE_REASON_AVERAGING, why) from e
        return time.monotonic() - started

    def _sync_replicas(self, runtime: StageRuntime, plan: pb.Plan, stage: pb.StageAssignment, step: int) -> float:
        """diloco: average the replicas' pseudo-gradients and keep the mean for this step's apply (node.diloco); a
        stage with one replica averages nothing. Returns the seconds the averaging took."""
        assert runtime.sync is not None
        if len(stage.node_ids) == 1:
            runtime.sync.stage(step, None)
            return 0.0
        pseudo = runtime.sync.pseudo_gradient(runtime.parameters())
        replicas = len(stage.peer_ids)

        def average() -> None:
            from geotrain.node.allreduce import replica_all_reduce
            from geotrain.node.averaging import Job, group_id
            from geotrain.node.diloco import from_grid, grid_steps, largest_values, to_grid

            def gid(round_: int, part: str) -> bytes:
                return group_id(self.run_id, stage.index, step, plan.epoch, round_, part)

            all_reduce = replica_all_reduce(self.averager, list(stage.peer_ids), list(stage.regions), 1.0, gid,
                                            hierarchical=stage.hierarchical_allreduce, presummed=True)
            largest = largest_values(pseudo)
            all_reduce(0, [largest])  # their mean over the replicas, the same float32 bits on every replica
            steps = grid_steps(largest, replicas)
            sums = to_grid(pseudo, steps, replicas)
            # One flat group: integers need no site-by-site float64 phases, and a sync comes once every H steps.
            self.averager.average_all([Job(gid(1, ""), list(stage.peer_ids), sums, 1.0, presummed="sum")])
            pseudo[:] = from_grid(sums, steps, replicas)  # every replica counts once, as DiLoCo's mean over workers

        seconds = self._with_replicas(stage, average)
        runtime.sync.stage(step, pseudo)
        log.info("step %d: replicas of stage %d synced (%s)", step, stage.index, self.cfg.compression.inexact_replicas)
        return seconds

    def _average_with_replicas(
        self, runtime: StageRuntime, plan: pb.Plan, stage: pb.StageAssignment, step: int
    ) -> None:
        """Replace the step's gradients by their weighted mean over the stage's replicas."""
        from geotrain.node.allreduce import replica_all_reduce
        from geotrain.node.averaging import group_id

        assert self.averager is not None
        all_reduce = replica_all_reduce(
            self.averager,
            list(stage.peer_ids),
            list(stage.regions),
            float(runtime.counted(step)),
            lambda round_, part: group_id(self.run_id, stage.index, step, plan.epoch, round_, part),
            hierarchical=stage.hierarchical_allreduce,
            presummed=self._low_rank is None,
            clip_rms=self.cfg.compression.replica_clip,
        )
        if self._low_rank is not None:
            runtime.mean_gradients(step)
            self._low_rank.average(plan.epoch, runtime.gradients(), all_reduce)
            return
        # The replicas' float64 sums, added exactly by the all-reduce: the mean train-local computes. hivemind
        # returns deltas; x64 + delta lies close enough to the reducer's float32 mean that all_reduce rounds it back
        # to exactly that on every replica, so replicas stay bit-identical.
        runtime.mean_gradients(step, lambda sums: all_reduce(0, sums))

    def _apply(self, order: pb.ApplyStep) -> None:
        runtime, plan = self.runtime, self.plan
        assert runtime is not None
        if self.evidence is not None and plan is not None:  # before the apply writes the parameters checked
            drawn = [c.microbatch for c in order.checks if c.stage == self.stage_index]
            self.evidence.keep(plan.epoch, order.step, runtime, drawn)
        with self._state_lock:
            self.snapshots.preserve(runtime)  # a transfer of the committed state goes on as it was (node.handover)
            runtime.apply(order.step, order.clip_coef, order.lr, order.skip, order.loss_scale)
            checksum = runtime.checksum_later()
            self.held.release_except(order.step + 1)  # the run committed past every copy kept from older plans
        self._head = None

        def report() -> None:  # on a sender thread: hashing the parameters' host copies keeps no compute waiting
            try:
                digest = checksum()
            except Exception as e:  # what the apply task would have failed with, had it hashed
                self._task_failed(e)
                return
            request = pb.StepAppliedRequest(node_id=self.node_id, step=order.step, checksum=digest)
            # Called here, not queued through _report: a stretched task's held sends are the worker's alone.
            call_with_retry(lambda: self.coordinator.StepApplied(request, timeout=RPC_DEADLINE_S))

        self._send(report, "the checksum of the applied step")

    def _join_averaging(self, initial_peers: list[str]) -> None:
        """Start joining the run's hivemind DHT when the coordinator makes this node a replica: once, or again after
        every attempt failed (the coordinator asks again with its next plan)."""
        if self._averaging_joined:
            return
        if not 0 < len(initial_peers) <= _MAX_DHT_PEERS or any(len(p) > _MAX_MULTIADDR_CHARS for p in initial_peers):
            log.warning("ignoring a JoinAveraging order with %d malformed peer addresses", len(initial_peers))
            return
        self._averaging_joined = True
        threading.Thread(target=self._start_averaging, args=(initial_peers,), name="dht", daemon=True).start()

    def _start_averaging(self, initial_peers: list[str]) -> None:
        """Join the run's hivemind DHT, through which replicas of a stage average their gradients. A few attempts:
        bootstrapping pings the coordinator's DHT with a 3 s deadline, which a loaded machine can miss, and hivemind
        forks the DHT's process from this one while gRPC's threads run here: a lock one of them held is taken for good
        in the child (gRPC skips its fork handlers then), which has died of it before it was ready ("Mutex::Fer with
        pending CondVar queueing"). An attempt waits _DHT_READY_S for its process, then the next forks another."""
        from hivemind import DHT

        from geotrain.node.averaging import ReplicaAverager, dht_maddrs

        listen, announce = dht_maddrs(
            self.address.rsplit(":", 1)[0].strip("[]"), bool(self.options.advertise), self.options.dht_port
        )
        tie_children_to_this_process()  # the DHT process and its p2pd must not outlive a killed node
        for attempt in range(1, _DHT_ATTEMPTS + 1):
            try:
                # Behind NAT, hivemind's client mode: the node dials out and serves nothing others would have to dial.
                dht = DHT(initial_peers=initial_peers, host_maddrs=listen, announce_maddrs=announce, start=True,
                          await_ready=False, client_mode=self.behind_nat)
                try:
                    dht.wait_until_ready(_DHT_READY_S)
                    self.averager = ReplicaAverager(dht)
                except BaseException:
                    dht.shutdown()  # the next attempt starts its own
                    raise
                self._dht = dht
                break
            except Exception as e:  # hivemind raises what its daemon or its bootstrap met: nothing narrower to catch
                why = str(e) or f"{type(e).__name__} (not ready within {_DHT_READY_S:g} s)"
                log.warning("cannot join the replicas' hivemind DHT (attempt %d of %d): %s", attempt, _DHT_ATTEMPTS, why)
                if attempt < _DHT_ATTEMPTS and self.stopped.wait(attempt):
                    return
        else:
            log.error("this node cannot serve as a stage replica: hivemind's DHT did not start; the coordinator "
                      "will ask again with its next plan")
            self._averaging_joined = False
            self._averaging_ready.set()  # settled: a commit that needs averaging fails at once, not after a wait
            return
        self._averaging_ready.set()
        self._heartbeat()
