"""The node's stage holder: the plan it follows, the stage runtime it holds, layers kept for their new holders,
state loaded from a replica or the checkpoint and served to others, and who its neighbours are."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
import torch

from geotrain.config import RunConfig
from geotrain.node.data import Corpus, CoordinatorTokens, Tokens
from geotrain.node.dataplane import LinkShape
from geotrain.node.failures import StageFailure
from geotrain.node.handover import HeldStates, Snapshots, StateSnapshot
from geotrain.node.link import NodeError
from geotrain.node.reverse import ReverseReceiver
from geotrain.node.routing import ReplicaRouter
from geotrain.node.stage import StageRuntime
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import statestream
from geotrain.protocol.framing import FrameError

log = logging.getLogger(__name__)



def _unreachable(stage: pb.StageAssignment, position: int) -> bool:
    """Whether nobody can dial the stage's node at `position` (a plan without the flags: everybody can)."""
    return position < len(stage.unreachable) and stage.unreachable[position]


def _has_stage(plan: pb.Plan, runtime: StageRuntime) -> bool:
    """Whether `plan` has a stage of exactly the runtime's layers."""
    return any((s.layer_start, s.layer_end) == (runtime.start, runtime.end) for s in plan.stages)


def _keys(plan: pb.Plan) -> dict[str, bytes]:
    """Each plan node's public key, by node id."""
    return {n: k for s in plan.stages for n, k in zip(s.node_ids, s.public_keys)}


def _relayed_neighbours(plan: pb.Plan, node_id: str) -> dict[str, pb.RelayRoute]:
    """The route of each link of node_id's that runs through a relay, by the node at its other end."""
    return {r.b if r.a == node_id else r.a: r for r in plan.relays if node_id in (r.a, r.b)}


class StageHolder:
    """The Agent's plan, stage and state (a part of Agent)."""

    cfg: RunConfig | None
    corpus: Tokens | None  # the byte corpus read here, or a prepared data set's windows from the coordinator
    plan: pb.Plan | None
    stage_index: int
    runtime: StageRuntime | None
    state_epoch: int  # plan epoch whose LoadState this node completed
    held: HeldStates  # layers a new plan moved this node away from, served until taken over
    snapshots: Snapshots  # the states this node is sending, kept as they were while the stage moves on
    _loading: StageRuntime | None = None  # the runtime whose tensors a state load is overwriting
    router: ReplicaRouter
    _state_lock: threading.Lock  # parameters change only under it (apply, load) and are read under it
    _peer_regions: dict[str, str]  # from plans and probe orders: what the link emulator shapes by
    reverse_links: ReverseReceiver  # the streams this node opens to its senders when nobody can dial it
    _relay_line: str = ""  # what the owner was last told of this node's relays

    def _init_holder(self, state_dir: str) -> None:
        self.cfg = self.corpus = self.plan = self.runtime = None
        self.stage_index = -1
        self.state_epoch = 0
        self.held = HeldStates()
        self.snapshots = Snapshots(state_dir)
        self._state_lock = threading.Lock()
        self._peer_regions = {}

    def _apply_plan(self, plan: pb.Plan) -> None:
        assert self.cfg is not None
        index = next((s.index for s in plan.stages if self.node_id in s.node_ids), -1)
        stage = plan.stages[index] if index >= 0 else None
        with self._state_lock:
            self.held.release_except(plan.steps_done)  # copies of another step can help no one take over
            layers = (stage.layer_start, stage.layer_end) if stage is not None else None
            if self.runtime is not None and (self.runtime.start, self.runtime.end) == layers:
                self.runtime.reset_step()  # the new epoch redoes the uncommitted step from scratch
            else:
                if self.runtime is not None and self.runtime is not self._loading and _has_stage(plan, self.runtime):
                    # Whoever takes these layers over may still fetch them from here. Layers the plan splits anew
                    # load from a checkpoint the coordinator writes before it sends the plan (scheduler.recovery
                    # sources): a copy of them would only have this node hold two stages, which it is not planned
                    # for.
                    self.held.keep(self.runtime, plan.steps_done)
                # Step 0 is each layer's initialisation from the seed; later steps come with a LoadState order,
                # unless this node still holds the layers at the committed step from an earlier plan. Layers that a
                # load will fill are not initialised first, and serve nothing until it has (state_snapshot).
                self._loading = None
                self.runtime = None if layers is None else self.held.take(layers, plan.steps_done)
                if self.runtime is None and layers is not None:
                    self.runtime = self._new_runtime(*layers, to_load=plan.steps_done > 0)
                    if plan.steps_done > 0:
                        self._loading = self.runtime
            if self.runtime is not None:
                self.runtime.set_loss_scale(plan.loss_scale)
                alone = len(stage.node_ids) == 1 and self.runtime.sync is None  # no replica's sums to add first
                self.runtime.mean_at = self.cfg.train.microbatches if alone else 0
            self.plan, self.stage_index = plan, index
            for s in plan.stages:
                self._peer_regions.update(zip(s.node_ids, s.regions))
            self._head = None
            self.router.reset()
            self._drop_parked()
        peers = {n for s in plan.stages if abs(s.index - index) == 1 for n in s.node_ids}
        self.dataplane.reset_links(peers)
        self.dataplane.deadlines.follow(plan)
        self._follow_reverse_links(plan, index)
        if stage is not None and index + 1 < len(plan.stages):
            # Each pair is probed by its upstream end only: two probes at once, one each way, skew each other. A
            # probe dials: a node nobody can dial is not probed.
            after = plan.stages[index + 1]
            self.profiler.neighbours(
                {n: a for i, (n, a) in enumerate(zip(after.node_ids, after.addresses)) if not _unreachable(after, i)}
            )
        where = f"stage {index} layers [{stage.layer_start}, {stage.layer_end})" if stage else "spare"
        if stage is None and self.node_id in plan.excluded:
            log.warning("the planner leaves this node out: %s", plan.excluded[self.node_id][:500])
        if stage is not None and stage.hierarchical_allreduce:
            where += ", replicas averaging region by region"
        if stage is not None and len(stage.node_ids) > 1 and self.cfg.compression.diloco:
            where += f", {self.cfg.compression.inexact_replicas}"
        log.info("plan epoch %d: %s", plan.epoch, where)
        self._heartbeat()  # tells the coordinator this epoch is in place

    def _neighbours(self, plan: pb.Plan, index: int) -> list[tuple[pb.StageAssignment, int]]:
        """(stage, position) of every node of the stages next to stage `index` (none for a spare): who sends to it."""
        return [(s, i) for s in plan.stages if index >= 0 and abs(s.index - index) == 1 for i in range(len(s.node_ids))]

    def _follow_reverse_links(self, plan: pb.Plan, index: int) -> None:
        """Links of the plan whose receiver nobody can dial run over a stream the receiver opens: this node sends to
        such neighbours over the streams they open, and if it is such a node, it opens one to each neighbour."""
        neighbours = self._neighbours(plan, index)
        routes = _relayed_neighbours(plan, self.node_id)
        self.dataplane.set_reversed(
            {s.node_ids[i] for s, i in neighbours if _unreachable(s, i) and s.node_ids[i] not in routes},
            routes,
        )
        stage = plan.stages[index] if index >= 0 else None
        if stage is None or not _unreachable(stage, list(stage.node_ids).index(self.node_id)):
            self.reverse_links.follow({})
            return
        stranded = [s.node_ids[i] for s, i in neighbours if _unreachable(s, i) and s.node_ids[i] not in routes]
        if stranded:
            log.error("neither this node nor %s can be dialled, and the plan names no relay for them",
                      ", ".join(stranded))
        senders = {s.node_ids[i]: (s.addresses[i], s.public_keys[i]) for s, i in neighbours if not _unreachable(s, i)}
        keys = _keys(plan)
        relayed: dict[str, dict[str, bytes]] = {}
        for peer, route in routes.items():
            senders[route.relay_id] = (route.relay_address, route.relay_key)
            relayed.setdefault(route.relay_id, {})[peer] = keys.get(peer, b"")
        self.reverse_links.follow(senders, relayed)
        line = "; ".join(f"links with {peer} go through relay {route.relay_id}" for peer, route in sorted(routes.items()))
        if line and line != self._relay_line:
            self.on_reachability(f"not reachable from outside: {line}")
        self._relay_line = line

    def reverse_receiver(self, signer: bytes | None) -> str | None:
        """The node id of the neighbour nobody can dial, whose key is `signer`, that this node's plan sends to."""
        plan = self.plan
        if plan is None or not signer:
            return None
        relayed_to = {n for r in plan.relays if r.relay_id == self.node_id for n in (r.a, r.b)}
        return next(
            (s.node_ids[i] for s in plan.stages for i in range(len(s.node_ids))
             if (s.node_ids[i] in relayed_to or (abs(s.index - self.stage_index) == 1 and self.stage_index >= 0))
             and _unreachable(s, i) and i < len(s.public_keys) and s.public_keys[i] == signer),
            None,
        )

    def check_tensor_stream(self, signer: bytes | None) -> None:
        """Raise FrameError unless the run sends tensors over raw streams and `signer` is the key of a node of the
        stages next to this one in the current plan (the nodes that send it tensors)."""
        plan, cfg = self.plan, self.cfg
        if cfg is not None and cfg.transport.tensor_stream != "tcp":
            raise FrameError(
                grpc.StatusCode.FAILED_PRECONDITION, "this run sends tensors by calls (transport.tensor_stream)"
            )
        neighbours = self._neighbours(plan, self.stage_index) if plan is not None else []
        if not signer or signer not in {s.public_keys[i] for s, i in neighbours if i < len(s.public_keys)}:
            raise FrameError(
                grpc.StatusCode.PERMISSION_DENIED, "tensor streams open only to this node's neighbours in its plan"
            )

    def relay_sender(self, signer: bytes | None, receiver: str) -> str | None:
        """The node id of the sender, signed by key `signer`, whose tensors the current plan has this node relay to
        node `receiver`; None when it has none."""
        plan = self.plan
        if plan is None or not signer:
            return None
        keys = _keys(plan)
        return next(
            (sender for r in plan.relays if r.relay_id == self.node_id and receiver in (r.a, r.b)
             for sender in ((r.b,) if receiver == r.a else (r.a,)) if keys.get(sender) == signer),
            None,
        )

    def _new_runtime(self, start: int, end: int, to_load: bool = False) -> StageRuntime:
        """Layers [start, end) from their initialisation (to_load: uninitialised, for a state load), on this node's
        device in its precision."""
        assert self.cfg is not None
        return StageRuntime(self.cfg, start, end, self.device, self.precision, to_load)

    def _load_state(self, order: pb.LoadState) -> None:
        """Take over the stage's committed state from a live replica or the coordinator's checkpoint."""
        runtime = self.runtime
        assert runtime is not None and self.cfg is not None
        started = time.monotonic()
        if order.steps_done == 0:
            # A rollback to the very start: the state is each layer's initialisation from the seed.
            with self._state_lock:
                self.runtime = self._new_runtime(runtime.start, runtime.end)
                self.runtime.set_loss_scale(runtime.loss_scale)
            self.state_epoch = order.plan_epoch
            self._heartbeat()
            return
        source = order.source_address or "the coordinator's checkpoint"
        with self._state_lock:
            self.snapshots.preserve(runtime)  # its tensors are about to be overwritten
            self._loading = runtime  # and until they are whole, it serves no state (state_snapshot)
        try:
            state = self._fetch_state(order, runtime)
            with self._state_lock:
                runtime.load_full_state(state, order.steps_done)
                checksum = runtime.checksum()
        except (grpc.RpcError, FrameError, ValueError, LookupError) as e:
            with self._state_lock:
                # The state arrived into the runtime's own tensors: what came of it before the failure is no step's.
                if self.runtime is runtime:
                    self.runtime = None
                    self.runtime = self._new_runtime(runtime.start, runtime.end)
                    self.runtime.set_loss_scale(runtime.loss_scale)
            detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
            raise StageFailure(
                pb.FAILURE_REASON_STATE, f"cannot load the state after {order.steps_done} steps from {source}: {detail}"
            ) from e
        finally:
            self._loading = None
        if order.expected_checksum and checksum != order.expected_checksum:
            raise StageFailure(
                pb.FAILURE_REASON_STATE, f"state loaded for step {order.steps_done} from {source} fails its checksum"
            )
        self.state_epoch = order.plan_epoch
        log.info(
            "loaded state after %d steps from %s in %.2fs",
            order.steps_done, order.source_address or "the coordinator's checkpoint", time.monotonic() - started,
        )
        self._heartbeat()

    def _fetch_state(self, order: pb.LoadState, runtime: StageRuntime) -> dict[str, torch.Tensor]:
        """The runtime's layers after order.steps_done steps, from the order's source node or the checkpoint, each
        tensor checked against the runtime's own and written into it (its parameters) or into a new tensor of its
        shape (the optimizer's state) as its chunks arrive."""
        assert self.cfg is not None
        expected = StateExpectation(runtime)
        sched = self.cfg.scheduler
        deadline = framing.state_deadline_s(expected.nbytes, sched.state_link_mbps * 1e6 / 8, sched.state_deadline_floor_s)
        sink = framing.TensorSink(expected)
        if order.source_address:
            request = pb.FetchStateRequest(steps_done=order.steps_done, layer_start=runtime.start, layer_end=runtime.end)
            chunks = statestream.fetch_state(
                order.source_address, self.options.token, self.node_id, self.key, self.options.tls, request, deadline
            )
            framing.receive_state(chunks, sink)
            return sink.tensors
        request = pb.FetchCheckpointRequest(layer_start=runtime.start, layer_end=runtime.end, steps_done=order.steps_done)
        framing.receive_state(self.coordinator.FetchCheckpoint(request, timeout=deadline), sink)
        return sink.tensors

    def _upload_state(self, order: pb.UploadState) -> None:
        """Send the coordinator the state it asked for: it cannot dial this node to fetch it. The snapshot is taken
        here, on the worker, between steps; it travels from the sender pool, as it stood then."""
        layers = (order.layer_start, order.layer_end)
        snapshot = self.state_snapshot(order.steps_done, layers)
        first = pb.StateUpload(node_id=self.node_id, request=order.request)

        def uploads() -> Iterator[pb.StateUpload]:
            if snapshot is None:
                first.error = f"this node holds no layers [{layers[0]}, {layers[1]}) after {order.steps_done} steps"
                yield first
                return
            try:
                for i, chunk in enumerate(framing.state_stream(snapshot.sources())):
                    upload = first if i == 0 else pb.StateUpload()
                    upload.chunk.CopyFrom(chunk)
                    yield upload
            finally:
                self.snapshots.close(snapshot)

        assert self.cfg is not None
        sched = self.cfg.scheduler
        nbytes = snapshot.nbytes if snapshot else 0
        deadline = framing.state_deadline_s(nbytes, sched.state_link_mbps * 1e6 / 8, sched.state_deadline_floor_s)

        def send() -> pb.Ack:
            try:
                return self.coordinator.UploadState(uploads(), timeout=deadline)
            finally:  # the call may end before it read the stream
                if snapshot is not None:
                    self.snapshots.close(snapshot)

        self._send(send, "state upload")

    def state_snapshot(self, steps_done: int, layers: tuple[int, int] | None = None) -> StateSnapshot | None:
        """A snapshot of the parameters and optimizer state of `layers` (None: the current stage's) after steps_done
        steps, from the current stage or one a newer plan moved this node away from, to send and then close
        (snapshots.close); None if not held. It costs no copy until the stage changes (node.handover)."""
        with self._state_lock:
            runtime = self.runtime
            if layers is not None and (runtime is None or (runtime.start, runtime.end) != layers):
                runtime = self.held.get(layers, steps_done)
            if runtime is None or runtime is self._loading or runtime.applied_step + 1 != steps_done:
                return None
            return self.snapshots.open(runtime)

    def close_snapshot(self, snapshot: StateSnapshot) -> None:
        """A snapshot's transfer ended (sent, failed or cancelled)."""
        self.snapshots.close(snapshot)

    def may_read_state(self, signer: bytes | None) -> bool:
        """Whether `signer` is the coordinator's key or a node's in the plan this node runs (which the coordinator
        makes every state source run before it sends a node to load from it)."""
        plan = self.plan
        return bool(signer) and plan is not None and (
            signer == plan.coordinator_key or any(signer in s.public_keys for s in plan.stages)
        )

    def _peer(self, stage_index: int) -> tuple[str, str]:
        """(node id, address) of the replica of `stage_index` expected to finish a microbatch first."""
        assert self.plan is not None
        stage = self.plan.stages[stage_index]
        node_id = self.router.pick(list(stage.node_ids))
        return node_id, stage.addresses[list(stage.node_ids).index(node_id)]

    def _address_of(self, node_id: str) -> str:
        """Address of a node of the plan."""
        assert self.plan is not None
        for stage in self.plan.stages:
            if node_id in stage.node_ids:
                return stage.addresses[list(stage.node_ids).index(node_id)]
        raise KeyError(node_id)

    def _link_shape(self, peer: str) -> tuple[str, LinkShape] | None:
        """The emulated link to peer: the node's own flags, else the run config's region matrix."""
        if self.options.bandwidth_mbps or self.options.latency_ms:
            return "egress", LinkShape(self.options.bandwidth_mbps * 1e6, self.options.latency_ms / 1e3)
        if self.cfg is None or not self.cfg.emulation.links:
            return None
        region = self._peer_regions.get(peer)
        if region is None:  # not a peer of a plan or a probe (the coordinator): its region is unknown, unshaped
            return None
        shape = self.cfg.emulation.link(self.options.region, region)
        return (region, LinkShape(shape[0] * 1e6, shape[1] / 1e3)) if shape else None

    def _load_corpus(self) -> None:
        assert self.cfg is not None
        if self.cfg.data.prepared:
            # The coordinator serves the windows and checks them against the fingerprint this node joined with.
            self.corpus = CoordinatorTokens(self.coordinator, lambda: self.node_id, self.cfg)
            return
        corpus = Corpus.load(self.cfg.data)
        if self.cfg.data.fingerprint and corpus.fingerprint != self.cfg.data.fingerprint:
            raise NodeError(
                "this node's corpus differs from the coordinator's (another Python version's stdlib?): "
                "set data.paths in the run config to files every node has"
            )
        self.corpus = corpus


class StateExpectation:
    """What a stage's incoming state must be (a framing.Expectation), from the runtime that takes it: each of its
    parameters (`layers.<i>.…`, written into the parameter itself), AdamW's moments of each (`optim.<param>.<slot>`,
    its shape and dtype; the step count a scalar) and under diloco its anchor and outer momentum
    (`sync.<slot>.<param>`). Nothing else, and nothing of another shape or dtype, whatever its size."""

    def __init__(self, runtime: StageRuntime) -> None:
        self._params = {name: p.detach() for name, p in runtime.named_state()}
        self._layers = (runtime.start, runtime.end)
        copies = 3 + (2 if runtime.sync is not None else 0)
        self.nbytes = copies * sum(p.numel() * p.element_size() for p in self._params.values())
        """The bytes of such a state (its scalars aside)."""

    def __call__(self, header: pb.TensorHeader) -> torch.Tensor:  # noqa: D102
        name, shape = header.name, tuple(header.shape)
        dtype = framing.WIRE_TO_TORCH[header.dtype]
        if name.startswith("optim."):
            param, _, slot = name.removeprefix("optim.").rpartition(".")
        elif name.startswith("sync."):
            slot, _, param = name.removeprefix("sync.").partition(".")
        else:
            param, slot = name, ""
        p = self._params.get(param)
        if p is None:
            raise FrameError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"state tensor {name} is no parameter's of layers [{self._layers[0]}, {self._layers[1]})",
            )
        if slot == "step" and name.startswith("optim."):  # AdamW's step count, a float scalar on the host
            want: tuple[tuple[int, ...], torch.dtype] = ((), torch.float32)
        else:
            want = (tuple(p.shape), p.dtype)
        if (shape, dtype) != want:
            raise FrameError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"state tensor {name} of shape {list(shape)} {dtype} where this stage has {list(want[0])} {want[1]}",
            )
        if not slot and p.is_contiguous():
            return p  # the parameter itself: load_full_state's copy into it is then none
        return torch.empty(shape, dtype=dtype, device=p.device if shape else "cpu")
