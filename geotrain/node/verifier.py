"""Verified compute on the node: digests of the tensors a stage received and sent (its commitments), the evidence it
keeps for a verifier of the microbatches drawn for checks in its last few steps (parameters before the step, the
tensors received), and a verifier's recompute of one microbatch of another node's stage from that evidence.

The pipeline is bit-identical to one process on one device class, so an honest stage's work, recomputed from the
same parameters and inputs, gives the same bits: the coordinator (scheduler/verification.py) compares digests."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import blake3
import grpc
import numpy as np
import torch

from geotrain.node.device import COMPUTE_DTYPES, device_pool
from geotrain.node.stage import MicrobatchKey, StageRuntime
from geotrain.node.worker import VERIFY
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import FrameError

log = logging.getLogger(__name__)

_DIGEST_BYTES = 16
_GROUP_BYTES = 1 << 24
# blake3 lets go of the GIL to hash 2048 bytes or more in one call, and so do torch's numpy() and every torch op. A
# worker that lets go of it in a node whose receiving and sending threads want it waits to take it back, far longer
# than a small tensor's hash takes (a 2 KiB tensor's digest: some 5 us alone, 80 to 800 us beside one busy thread). A
# tensor up to _HELD_MAX bytes is copied out with the GIL held and hashed in pieces of _HELD_PIECE bytes, under that
# size; a larger one is hashed in place in one call, whose wait is small beside the hash.
_HELD_PIECE = 2047
_HELD_MAX = 1 << 16
# On the CPU the worker hashes a step's commitments in one batch at its commit, not a few after each task: each task's
# compute evicts the hashes' code and data from the caches, and a pass over the whole step finds them warm (a middle
# stage's 20 hashes of a step here: 0.22 ms of CPU in one batch, 0.64 ms a few at a time). The tensors wait for it
# (what was received is kept until the apply anyway); past this many bytes of them the worker hashes them at once.
PENDING_BYTES = 1 << 24
_EVIDENCE_DEADLINE_S = 60.0
# How long a request for evidence waits for its step's apply here: the apply comes at once after the order the
# verifier got it with, but a loaded node's worker may be on its last task; under the fetch's own deadline.
_SERVE_WAIT_S = 10.0
PARAMS_PREFIX = "params."


def digest(tensor: torch.Tensor) -> bytes:
    """A digest of a tensor's dtype, shape and bytes: equal digests are the same tensor bit for bit (every tensor a
    stage sends or receives has one, so it takes as few calls as it can, none that lets go of the GIL for a small
    tensor, and the header of a dtype and shape is made once)."""
    t = _host(tensor)
    return _hash([_header(t.dtype, t.shape), _part(t)])


@functools.lru_cache(maxsize=64)
def _header(dtype: torch.dtype, shape: torch.Size) -> bytes:
    return f"{dtype}{tuple(shape)}".encode()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself where it is a contiguous host tensor (the usual case: no torch call), else a host copy."""
    if not tensor.is_cpu or not tensor.is_contiguous():
        return tensor.detach().cpu().contiguous()
    return tensor


def _part(t: torch.Tensor) -> bytes | np.ndarray:
    """A contiguous host tensor's bytes: a small one's copied out with the GIL held (_HELD_MAX), a larger one's read
    through numpy without a copy."""
    size = t.nbytes
    if size <= _HELD_MAX:
        return ctypes.string_at(t.data_ptr(), size)
    if t.requires_grad or t.dtype not in _NUMPY_DTYPES:
        t = t.detach().view(-1).view(torch.uint8)
    return t.numpy().reshape(-1).view(np.uint8)


_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int8,
                           torch.uint8, torch.bool})


def _hash(parts: list[bytes | np.ndarray]) -> bytes:
    """blake3 of the parts' bytes in order: the small ones (bytes) joined and hashed in pieces under _HELD_PIECE, a
    large one in one call. blake3 hashes a stream: the digest is the same however the bytes are cut."""
    hasher = blake3.blake3()
    held: list[bytes] = []

    def hash_held() -> None:
        data = memoryview(b"".join(held))
        for at in range(0, len(data), _HELD_PIECE):
            hasher.update(data[at : at + _HELD_PIECE])
        held.clear()

    for part in parts:
        if isinstance(part, bytes):
            held.append(part)
        else:
            hash_held()
            hasher.update(part)
    hash_held()
    return hasher.digest(_DIGEST_BYTES)


@functools.lru_cache(maxsize=64)
def _shapes(shapes: tuple[torch.Size | None, ...]) -> bytes:
    return repr(list(shapes)).encode()


def digest_all(tensors: Sequence[torch.Tensor | None]) -> bytes:
    """One digest of tensors in order (None, a parameter without gradient, counts as itself): blake3 of their shapes,
    then of each dtype's run of bytes, the dtype named at the run's start and again every _GROUP_BYTES. Every
    microbatch's parameter gradients, dozens of small tensors, are hashed: their bytes are copied out one by one
    with no torch call (one copy into one buffer, torch.cat, lets go of the GIL; see _HELD_PIECE)."""
    parts = [_shapes(tuple(None if t is None else t.shape for t in tensors))]
    run: torch.dtype | None = None  # the dtype of the run under way (None: a None ended it)
    size = 0
    for t in tensors:
        if t is None:
            run = None
            continue
        if t.dtype != run or size >= _GROUP_BYTES:
            parts.append(str(t.dtype).encode())
            run, size = t.dtype, 0
        parts.append(_part(_host(t)))
        size += t.nbytes
    return _hash(parts)


def hashes_off_worker(device: torch.device) -> bool:
    """Whether a stage on `device` hands its parameter gradients' hashing to another thread (Evidence.watch): on an
    accelerator the worker would wait for each backward to finish; on the CPU they are finished, and the hand-off
    (a task, a future, a thread woken on a few shared cores) costs more than the hash."""
    return device.type != "cpu"


def wire_form(runtime: StageRuntime, tensor: torch.Tensor) -> torch.Tensor:
    """A stage's output as it goes to the codec (node/stepflow._send_tensor): on the host, in the run's compute dtype."""
    return runtime.copies.to_host(tensor).to(COMPUTE_DTYPES[runtime.cfg.train.precision])


@dataclass
class _StepEvidence:
    epoch: int
    checksum: Callable[[], str] | None = None  # of the parameters the step is computed with (last_checksum)
    received: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (microbatch, direction) -> tensor
    commitments: dict[int, pb.MicrobatchCommitment] = field(default_factory=dict)
    grad_digests: dict[int, futures.Future] = field(default_factory=dict)  # microbatch -> its param_grads, hashing off
    kept: frozenset[int] = frozenset()  # the microbatches drawn for checks (keep), whose evidence is served
    params: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # host copies before the step (flat_params)
    settled: bool = False  # keep() is done: what is kept of the step is known


class Evidence:
    """A stage holder's commitments for each step, and what it keeps for verifiers of its last `keep_steps` steps
    with checks drawn (thread-safe: tensors arrive on the servicer's threads, compute runs on the worker, verifiers
    read from theirs). Commitments are made for every microbatch; which ones are checked is told with the step's
    apply, after they were sent, so only then are the parameters copied and the other microbatches' inputs dropped."""

    def __init__(self, keep_steps: int, device: torch.device = torch.device("cpu")) -> None:
        self.keep_steps = keep_steps
        self._later = not hashes_off_worker(device)  # the worker hashes what comes and goes (hash_pending)
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # notified as each step's apply settles what it keeps
        self._steps: OrderedDict[int, _StepEvidence] = OrderedDict()
        # (its step's entry, microbatch, commitment field, its tensors) received, sent or counted, for hash_pending
        self._pending: list[tuple[_StepEvidence, int, str, Sequence[torch.Tensor | None]]] = []
        self._pending_bytes = 0

    def _entry(self, epoch: int, step: int) -> _StepEvidence:
        entry = self._steps.get(step)
        if entry is None or entry.epoch != epoch:  # a new plan epoch redoes the step from scratch
            entry = self._steps[step] = _StepEvidence(epoch)
            self._steps.move_to_end(step)
            while len(self._steps) > self.keep_steps:
                self._steps.popitem(last=False)
        return entry

    def watch(self, epoch: int, step: int, runtime: StageRuntime, pool: futures.Executor | None) -> None:
        """Once per step, on the worker before its first microbatch: take the checksum of the parameters the stage
        computes `step` with, and commit to each microbatch's parameter gradients as the stage counts them. With a
        `pool` (hashes_off_worker: an accelerator) their copies to the host start behind the backward that made them
        and a thread of `pool` hashes them, so the worker neither waits for each backward nor hashes; without, the
        worker hashes them with the step's other commitments (hash_pending), as a hand-off to another thread costs a
        CPU more than the hash."""
        with self._lock:
            entry = self._entry(epoch, step)
            if entry.checksum is not None:
                return
            entry.checksum = runtime.last_checksum()

        def counted(key: MicrobatchKey, grads: Sequence[torch.Tensor | None]) -> None:
            if pool is None:
                with self._lock:
                    self._defer(self._entry(epoch, key[0]), key[1], "param_grads", grads)
                return
            copies = [None if g is None else runtime.copies.to_host_async(g) for g in grads]
            hashed = pool.submit(lambda: digest_all([None if c is None else c.wait() for c in copies]))
            self.param_grads(epoch, key[0], key[1], hashed)

        runtime.on_param_grads = counted

    def _commitment(self, entry: _StepEvidence, microbatch: int) -> pb.MicrobatchCommitment:
        commitment = entry.commitments.get(microbatch)
        if commitment is None:  # made once per microbatch, not once per tensor as setdefault's default would be
            commitment = entry.commitments[microbatch] = pb.MicrobatchCommitment(microbatch=microbatch)
        return commitment

    def received(self, epoch: int, step: int, microbatch: int, direction: str, tensor: torch.Tensor) -> None:
        """A decoded tensor this stage accepted: activations (forward) or a gradient (backward); on the CPU the
        worker hashes it later (hash_pending), not before the task that computes with it starts."""
        with self._lock:
            self._entry(epoch, step).received[(microbatch, direction)] = tensor
        self._unhashed(epoch, step, microbatch, "received" if direction == "forward" else "received_grad", tensor)

    def sent(self, epoch: int, step: int, microbatch: int, direction: str, tensor: torch.Tensor) -> None:
        """A tensor this stage sends, as it goes to the codec (on a sender thread); on the CPU the worker hashes it
        later (hash_pending), not in the send's way."""
        self._unhashed(epoch, step, microbatch, "sent" if direction == "forward" else "sent_grad", tensor)

    def _unhashed(self, epoch: int, step: int, microbatch: int, name: str, tensor: torch.Tensor) -> None:
        """A tensor this stage received or sent: hashed at once where the worker hands hashes off (hashes_off_worker),
        else by the worker later (hash_pending)."""
        value = None if self._later else digest(tensor)
        with self._lock:
            entry = self._entry(epoch, step)
            commitment = self._commitment(entry, microbatch)
            if value is None:
                self._defer(entry, microbatch, name, [tensor])
            else:
                setattr(commitment, name, value)

    def _defer(self, entry: _StepEvidence, microbatch: int, name: str, tensors: Sequence[torch.Tensor | None]) -> None:
        """Leave a commitment's tensors to hash_pending (call under the lock)."""
        self._pending.append((entry, microbatch, name, tensors))
        self._pending_bytes += sum(t.nbytes for t in tensors if t is not None)

    def hash_pending(self, up_to: int = 0) -> None:
        """Hash what was received, sent and counted since the last call, unless it is under `up_to` bytes: on
        the worker, once a task's results are on their way (no neighbour waits for the hash), with PENDING_BYTES,
        and at the commit, with 0 (commitments())."""
        with self._lock:
            if not self._pending or self._pending_bytes < up_to:
                return
            work, self._pending, self._pending_bytes = self._pending, [], 0
        done = [
            (entry, mb, name, digest_all(tensors) if name == "param_grads" else digest(tensors[0]))
            for entry, mb, name, tensors in work
        ]
        with self._lock:
            for entry, mb, name, value in done:
                setattr(self._commitment(entry, mb), name, value)

    def param_grads(self, epoch: int, step: int, microbatch: int, hashed: futures.Future) -> None:
        """The hashing under way (digest_all, off the worker) of the parameter gradients of a microbatch this stage
        counted."""
        with self._lock:
            entry = self._entry(epoch, step)
            self._commitment(entry, microbatch)
            entry.grad_digests[microbatch] = hashed

    def commitments(self, epoch: int, step: int) -> tuple[str, list[pb.MicrobatchCommitment]]:
        """The parameter checksum the step was computed with and each microbatch's digests, for the commit report
        (once every digest is done; on the worker, as hash_pending)."""
        self.hash_pending()
        with self._lock:
            entry = self._steps.get(step)
            if entry is None or entry.epoch != epoch:
                return "", []
            hashing = dict(entry.grad_digests)
        done = {microbatch: hashed.result() for microbatch, hashed in hashing.items()}
        checksum = entry.checksum() if entry.checksum is not None else ""
        with self._lock:
            for microbatch, value in done.items():
                entry.commitments[microbatch].param_grads = value
                entry.grad_digests.pop(microbatch, None)
            return checksum, [entry.commitments[m] for m in sorted(entry.commitments)]

    def keep(self, epoch: int, step: int, runtime: StageRuntime, drawn: Collection[int]) -> None:
        """At the step's apply (on the worker, before it writes the parameters): keep the parameters the step was
        computed with and the tensors received of its `drawn` microbatches, for their verifiers; drop the rest."""
        with self._lock:
            entry = self._steps.get(step)
            if entry is None or entry.epoch != epoch:
                return
            kept = frozenset(drawn) & entry.commitments.keys()
            if not kept:
                del self._steps[step]
                self._settled.notify_all()
                return
            entry.received = {key: t for key, t in entry.received.items() if key[0] in kept}
        params = flat_params(runtime)
        with self._lock:
            entry.params, entry.kept, entry.settled = params, kept, True
            self._settled.notify_all()

    def serve(self, step: int, microbatch: int, wait_s: float = 0.0) -> list[tuple[str, torch.Tensor]] | None:
        """The evidence of one microbatch: parameters before the step and what was received; None if not kept. A
        verifier learns of its check with the step's apply, as the target does: a step not applied yet here is
        waited for, up to `wait_s`."""

        def settled() -> bool:
            entry = self._steps.get(step)
            return entry is None or entry.settled

        with self._lock:
            self._settled.wait_for(settled, wait_s)
            entry = self._steps.get(step)
            if entry is None or microbatch not in entry.kept:
                return None
            items = list(entry.params)
            for (mb, direction), tensor in entry.received.items():
                if mb == microbatch:
                    items.append(("received" if direction == "forward" else "received_grad", tensor))
            return items


def flat_params(runtime: StageRuntime) -> list[tuple[str, torch.Tensor]]:
    """Host copies of a stage's parameters, those of one dtype flattened into one tensor named after it: a check's
    evidence goes in a few messages, not one per parameter (unflat_params reads it back)."""
    params = [p.detach() for _, p in runtime.named_state()]
    dtypes = dict.fromkeys(p.dtype for p in params)
    flat = {dtype: torch.cat([p.reshape(-1) for p in params if p.dtype == dtype]) for dtype in dtypes}
    return [(PARAMS_PREFIX + str(dtype), t.to("cpu", copy=True)) for dtype, t in flat.items()]


def unflat_params(runtime: StageRuntime, evidence: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters of `runtime`'s stage, by name, from the evidence's flat_params; ValueError unless they fill
    them exactly."""
    flats = {name: t for name, t in evidence.items() if name.startswith(PARAMS_PREFIX)}
    taken = dict.fromkeys(flats, 0)
    state = {}
    for name, p in runtime.named_state():
        key = PARAMS_PREFIX + str(p.dtype)
        flat, at = flats.get(key), taken.get(key, 0)
        if flat is None or flat.dtype != p.dtype or flat.dim() != 1 or at + p.numel() > flat.numel():
            raise ValueError(f"the evidence's parameters do not hold {name}")
        state[name], taken[key] = flat[at : at + p.numel()].view(p.shape), at + p.numel()
    if any(taken[key] != flat.numel() for key, flat in flats.items()):
        raise ValueError("the evidence holds more parameters than the stage has")
    return state


def recompute(
    runtime: StageRuntime, evidence: dict[str, torch.Tensor], key: MicrobatchKey,
    batch: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor | None,
) -> tuple[str, pb.MicrobatchCommitment]:
    """Load the served parameters into `runtime` (a stage of the same layers) and redo one microbatch's forward and
    backward from the served inputs; returns the served parameters' checksum and the digests of everything, as the
    target committed them. ValueError if the evidence lacks a tensor the stage needs."""
    step, microbatch = key
    runtime.load_parameters(unflat_params(runtime, evidence))
    checksum = runtime.checksum()
    runtime.reset_step()
    runtime.applied_step = step - 1
    grads: list[bytes] = []
    runtime.on_param_grads = lambda _key, g: grads.append(digest_all(g))
    digests = pb.MicrobatchCommitment(microbatch=microbatch)
    x, y = batch
    if not runtime.is_first:
        if "received" not in evidence:
            raise ValueError("the evidence has no activations received")
        x = evidence["received"]
        digests.received = digest(x)
    outputs = runtime.forward(key, x, tokens)
    if runtime.is_last:
        _, grad_in = runtime.loss_backward(key, y)
    else:
        if "received_grad" not in evidence:
            raise ValueError("the evidence has no gradient received")
        digests.sent = digest(wire_form(runtime, outputs))
        digests.received_grad = digest(evidence["received_grad"])
        grad_in = runtime.backward(key, evidence["received_grad"])
    if grad_in is not None:
        digests.sent_grad = digest(wire_form(runtime, grad_in))
    if grads:
        digests.param_grads = grads[0]
    runtime.reset_step()
    return checksum, digests


class VerifierPart:
    """The Agent's part as a verifier (a part of Agent): a check, told with the step's apply, has its evidence
    fetched on a thread of its own, over the channel the data plane keeps to the target; its recompute runs on the
    worker at the lowest priority, when no training task waits, so that checks fill the pipeline's idle time rather
    than compete with its compute; its report goes with the node's next GradNorm, with no call of its own."""

    _verify_pool: futures.ThreadPoolExecutor
    _verify_stages: dict[tuple[int, int], StageRuntime]  # layer range -> the runtime checks of that range reuse
    _reports: list[pb.VerifyReport]  # checks done, for the next GradNorm
    _reports_lock: threading.Lock

    def _init_verifier(self, device: torch.device) -> None:
        self._verify_pool = device_pool(device, 1, "verify")  # a check recomputes a microbatch on the node's GPU
        self._verify_stages = {}
        self._reports = []
        self._reports_lock = threading.Lock()

    def _verify(self, order: pb.VerifyOrder) -> None:
        """Queue a spot check the coordinator ordered."""
        self._verify_pool.submit(self._fetch_check, order)

    def _done(self, report: pb.VerifyReport, started: float) -> None:
        """A check's report, which goes with this node's next GradNorm (take_reports)."""
        report.seconds = time.monotonic() - started
        with self._reports_lock:
            self._reports.append(report)

    def take_reports(self) -> list[pb.VerifyReport]:
        """The checks done since the last call, for the GradNorm being sent."""
        with self._reports_lock:
            reports, self._reports = self._reports, []
        return reports

    def _fetch_check(self, order: pb.VerifyOrder) -> None:
        started = time.monotonic()
        report = pb.VerifyReport(node_id=self.node_id, check=order.check)
        try:
            evidence = self._fetch_evidence(order)
        except (grpc.RpcError, FrameError, ValueError) as e:
            report.error = (e.details() if isinstance(e, grpc.RpcError) else str(e))[:500] or type(e).__name__
            self._done(report, started)
            return
        except Exception:  # this node's own failure must not pass as the target's
            log.exception("check %d: fetching its evidence failed on this node", order.check)
            return
        fetch_s = time.monotonic() - started
        self._submit(VERIFY, lambda: self._run_check(order, evidence, report, fetch_s))

    def _run_check(
        self, order: pb.VerifyOrder, evidence: dict[str, torch.Tensor], report: pb.VerifyReport, fetch_s: float
    ) -> None:
        """The recompute, on the worker; its report's seconds are the fetch's and the recompute's, not the wait."""
        started = time.monotonic() - fetch_s
        try:
            runtime = self._check_stage(order.layer_start, order.layer_end)
            batch = self._batch(order.step, order.microbatch)
            tokens = batch[0] if runtime.needs_tokens else None
            checksum, digests = recompute(runtime, evidence, (order.step, order.microbatch), batch, tokens)
            report.params_checksum = checksum
            report.digests.CopyFrom(digests)
        except ValueError as e:
            report.error = str(e)[:500] or type(e).__name__
        except Exception:  # a verifier's own failure (out of memory, a bug) must not pass as the target's
            log.exception("check %d failed on this node", order.check)
            return
        self._done(report, started)

    def _check_stage(self, start: int, end: int) -> StageRuntime:
        runtime = self._verify_stages.get((start, end))
        if runtime is None:
            self._verify_stages.clear()  # one range at a time: a verifier holds no more than one extra stage
            runtime = self._verify_stages[(start, end)] = StageRuntime(self.cfg, start, end, self.device, self.precision)
        return runtime

    def _fetch_evidence(self, order: pb.VerifyOrder) -> dict[str, torch.Tensor]:
        request = pb.FetchEvidenceRequest(step=order.step, microbatch=order.microbatch)
        stream = self.dataplane.stub(order.target_address).FetchEvidence(request, timeout=_EVIDENCE_DEADLINE_S)
        return framing.read_state(stream, self.options.max_tensor_bytes)

    def evidence_snapshot(self, step: int, microbatch: int) -> list[tuple[str, torch.Tensor]] | None:
        """What this node kept of a microbatch for a verifier (the servicer's FetchEvidence), once it applied the
        step (its verifier may ask first: both learn of the check with the apply)."""
        if self.evidence is None:
            return None
        return self.evidence.serve(step, microbatch, _SERVE_WAIT_S)
