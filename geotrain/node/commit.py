"""The end of a step on the node: the commit (the step's gradients averaged with the stage's replicas, their norm
reported with verification's commitments and this node's checks done as a verifier), the apply the coordinator
decides (with the checks this node is to do), and joining the replicas' hivemind DHT that averaging runs over."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from geotrain.lifetime import tie_children_to_this_process
from geotrain.node.failures import StageFailure
from geotrain.node.link import RPC_DEADLINE_S
from geotrain.node.lowrank import LowRankAveraging
from geotrain.node.stage import StageRuntime
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.transport import call_with_retry

log = logging.getLogger(__name__)

# Bounds on the coordinator's JoinAveraging order (it names its own DHT's few listen addresses).
_MAX_DHT_PEERS = 32
_MAX_MULTIADDR_CHARS = 512
_DHT_ATTEMPTS = 3
# How long one attempt waits for its DHT process to be ready: a healthy one is up in seconds (its p2p daemon, a
# bootstrap ping of 3 s at most), and three attempts fit in the coordinator's default 60 s wait for replicas' peers.
_DHT_READY_S = 15.0


class StepCommit:
    """The Agent's commit and apply of a step, and its replica averaging (a part of Agent)."""

    _norm_reported: tuple[int, int]  # (plan epoch, step) of the last GradNorm this node sent
    _low_rank: LowRankAveraging | None  # replicas average PowerSGD factors (replica_grads)
    _dht: object
    averager: object  # ReplicaAverager once the DHT is up
    _averaging_joined: bool  # set on the coordinator's JoinAveraging; cleared when every attempt failed
    _averaging_ready: threading.Event
    stopped: threading.Event  # set when the node stops serving

    def _init_commit(self) -> None:
        self._norm_reported = (0, -1)
        self._low_rank = None
        self._dht = None
        self.averager = None
        self._averaging_joined = False
        self._averaging_ready = threading.Event()

    def _commit(self, order: pb.CommitStep) -> None:
        """Average the step's gradients with the stage's other replicas, then report their squared norm."""
        runtime, plan = self.runtime, self.plan
        assert runtime is not None and plan is not None
        if order.plan_epoch != plan.epoch:
            return
        if self._norm_reported == (plan.epoch, order.step):
            return  # reported as the stage counted its last microbatch (StepFlow._counted)
        stage = plan.stages[self.stage_index]
        task_s = self.take_task_s(plan.epoch)
        averaging_s = 0.0
        if self._norm_parts is not None and self._norm_parts[:2] == (plan.epoch, order.step):
            parts = self._norm_parts[2]  # averaged as the stage counted its last microbatch (StepFlow._counted)
        else:
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
            self._norm_parts = (plan.epoch, order.step, parts)  # StepFlow._counted's task, if queued, finds them
        head = self._head
        round_trip_s = head.shortest_round_trip_s if head is not None and head.step == order.step else math.inf
        params_before, commitments = self.evidence.commitments(plan.epoch, order.step) if self.evidence else ("", [])
        request = pb.GradNormRequest(
            node_id=self.node_id, step=order.step, sq_norm=math.fsum(parts), sq_norm_parts=parts, plan_epoch=plan.epoch,
            clipped_peers=self.averager.take_clipped() if self.averager is not None else [],
            compute_s_per_microbatch=sum(task_s.values()), forward_s_per_microbatch=task_s.get("forward", 0.0),
            averaging_s=averaging_s,
            round_trip_s=round_trip_s if math.isfinite(round_trip_s) else 0.0,
            params_before=params_before, commitments=commitments, reports=self.take_reports(),
        )
        self._norm_reported = (plan.epoch, order.step)
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
        self._release_parked()  # the next step's first activations, if they came before this order
        self._head = None
        for check in order.checks:  # this node's spot checks: their targets keep the evidence as they apply
            if check.verifier == self.node_id:
                self._verify(check.order)

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
        """Join the run's hivemind DHT, through which replicas of a stage average their gradients. A few attempts,
        each waiting _DHT_READY_S for its process: bootstrapping pings the coordinator's DHT with a 3 s deadline, which
        a loaded machine can miss, and the DHT's process, forked while gRPC's threads run here, can inherit a lock one
        of them held and die before it is ready."""
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
                log.warning(
                    "cannot join the replicas' hivemind DHT (attempt %d of %d): %s", attempt, _DHT_ATTEMPTS, why
                )
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
