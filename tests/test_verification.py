"""Verified compute in this process: the cross-check of both ends' digests, a verifier's recompute from a target's
evidence (one that matches, one of a target that shifted its activations), checks told with the apply and reported
with the GradNorm, disputes (settled against the target and against a false accuser), the status's counts, and the
rollback a verdict orders (to the newest checkpoint at or before the guilty node's first planned step)."""

from __future__ import annotations

import random
import threading
import time
from concurrent import futures

import pytest
import torch

from geotrain.config import load_config
from geotrain.node.data import Corpus
from geotrain.node.stage import StageRuntime
from geotrain.node import verifier
from geotrain.node.verifier import Evidence, recompute, wire_form
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.identity import NodeKey
from geotrain.scheduler.checkpoint import CheckpointStore, StageState
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.errors import ReportRefused
from geotrain.scheduler.membership import Member
from geotrain.scheduler.service import fetch_model_state
from geotrain.scheduler.status import render
from geotrain.scheduler.verification import Check, Verdict, Verification, compare, cross_check, device_class
from tests.conftest import local_cluster, max_diff, one_compute_thread, train_local_state

pytestmark = pytest.mark.timeout(60)

STEP, MICROBATCH = 3, 1


def _config(*extra: str):
    return load_config(None, [
        "model.n_layers=3", "model.d_model=16", "model.n_heads=2", "model.seq_len=16", "train.microbatch_size=2",
        "verify.fraction=0.5", *extra,
    ])


def _commitment(mb: int, **digests: bytes) -> pb.MicrobatchCommitment:
    return pb.MicrobatchCommitment(microbatch=mb, **digests)


def test_cross_check_names_the_hop_whose_ends_disagree() -> None:
    paths = {0: ["a", "b", "c"], 1: ["a", "b", "c"]}
    honest = {
        "a": {mb: _commitment(mb, sent=b"x%d" % mb, received_grad=b"g%d" % mb) for mb in paths},
        "b": {mb: _commitment(mb, received=b"x%d" % mb, sent=b"y%d" % mb, received_grad=b"h%d" % mb,
                              sent_grad=b"g%d" % mb) for mb in paths},
        "c": {mb: _commitment(mb, received=b"y%d" % mb, sent_grad=b"h%d" % mb) for mb in paths},
    }
    before = {"a": "pa", "b": "pb", "c": "pc"}
    assert cross_check(paths, honest, before, dict(before)) == []

    lying = {n: dict(c) for n, c in honest.items()}
    lying["b"][1] = _commitment(1, received=b"x1", sent=b"OTHER", received_grad=b"h1", sent_grad=b"g1")
    found = cross_check(paths, lying, before, {})
    assert [(d.microbatch, d.nodes, d.what) for d in found] == [(1, ("b", "c"), "activations b -> c")]

    del lying["c"][0]
    assert (0, ("c",), "no commitment") in [(d.microbatch, d.nodes, d.what) for d in cross_check(paths, lying, before, {})]
    # Parameters other than the ones the run recorded for the stage after the step before.
    found = cross_check(paths, honest, before, {**before, "b": "recorded"})
    assert [d.nodes for d in found] == [("b",)]


def _run_target(
    cfg, shift: float = 0.0, drawn: tuple[int, ...] = (MICROBATCH,), off_worker: bool = False, apply: bool = True
):
    """A middle stage computing one microbatch as the pipeline does (node/stepflow.py), committing to it, then told
    at the apply that `drawn` microbatches are checked (unless not `apply`: the stage, the evidence and the drawn
    microbatches come back to apply later); returns the evidence it kept and the microbatch's tokens and targets.
    `off_worker`: its parameter gradients are hashed as on an accelerator (verifier.hashes_off_worker)."""
    corpus = Corpus.load(cfg.data)
    batch = corpus.batch(seed=cfg.run.seed, step=STEP, microbatch=MICROBATCH, size=cfg.train.microbatch_size,
                         seq_len=cfg.model.seq_len)
    first = StageRuntime(cfg, 0, 1)
    target = StageRuntime(cfg, 1, 2)
    evidence = Evidence(cfg.verify.keep_steps)
    key = (STEP, MICROBATCH)
    x = first.forward(key, batch[0])
    with futures.ThreadPoolExecutor(1, thread_name_prefix="hash") as pool:  # the node's sender threads
        evidence.watch(1, STEP, target, pool if off_worker else None)
        evidence.received(1, STEP, MICROBATCH, "forward", x)
        out = wire_form(target, target.forward(key, x)) + shift
        evidence.sent(1, STEP, MICROBATCH, "forward", out)
        grad = torch.randn_like(out, generator=torch.Generator().manual_seed(7))
        evidence.received(1, STEP, MICROBATCH, "backward", grad)
        evidence.sent(1, STEP, MICROBATCH, "backward", wire_form(target, target.backward(key, grad)))
    evidence.commitments(1, STEP)  # the commit reports them; the microbatch is drawn with the apply
    if not apply:
        return evidence, batch, target
    evidence.keep(1, STEP, target, drawn)
    return evidence, batch


def _verify(cfg, evidence: Evidence, batch) -> tuple[str, pb.MicrobatchCommitment, pb.VerifyReport]:
    params, [committed] = evidence.commitments(1, STEP)
    served = dict(evidence.serve(STEP, MICROBATCH))
    checksum, digests = recompute(StageRuntime(cfg, 1, 2), served, (STEP, MICROBATCH), batch, None)
    return params, committed, pb.VerifyReport(node_id="v", check=1, params_checksum=checksum, digests=digests)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_a_digest_is_of_the_bytes_whatever_the_dtype_layout_or_autograd(dtype) -> None:
    x = (torch.arange(24) % 7).to(dtype).reshape(4, 6)
    same = [x.clone(), x.t().contiguous().t(), x.float().requires_grad_(True).to(dtype)]
    assert all(verifier.digest(t) == verifier.digest(x) for t in same)
    flipped = x.clone()
    flipped.view(-1)[5] += 1
    assert verifier.digest(flipped) != verifier.digest(x) and verifier.digest(x.reshape(6, 4)) != verifier.digest(x)
    assert verifier.digest_all([x, None, same[2]]) == verifier.digest_all([same[0], None, x])
    assert verifier.digest_all([x, None, x]) not in (verifier.digest_all([x, x, None]), verifier.digest_all([flipped, None, x]))


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 4096, 20000])
def test_a_digest_is_blake3_of_its_header_and_bytes_however_they_are_cut(size) -> None:
    """Small tensors are copied out and hashed in pieces (the GIL held), large ones in one call: either way a digest is
    blake3 of the dtype and shape, then of the bytes, as nodes of one protocol version must agree; one bit anywhere,
    the last one included, changes it."""
    x = torch.randn(size, generator=torch.Generator().manual_seed(size))  # 4 bytes each: 2 KiB, 80 KiB for the last
    grads = [x, None, x.double(), x.half(), x.half()]
    raw = [t.numpy().tobytes() for t in (x, x.double(), x.half(), x.half())]

    def blake3(*parts: bytes) -> bytes:
        return verifier.blake3.blake3(b"".join(parts)).digest(16)

    assert verifier.digest(x) == blake3(f"torch.float32({size},)".encode(), raw[0])
    shapes = repr([None if t is None else t.shape for t in grads]).encode()
    expected = blake3(shapes, b"torch.float32", raw[0], b"torch.float64", raw[1], b"torch.float16", raw[2], raw[3])
    assert verifier.digest_all(grads) == expected
    if size:
        flipped = x.clone()
        flipped.view(torch.int32)[-1] ^= 1
        assert verifier.digest(flipped) != verifier.digest(x)
        assert verifier.digest_all([flipped, *grads[1:]]) != expected


def test_an_honest_stage_recomputed_elsewhere_gives_the_same_bits() -> None:
    cfg = _config()
    with one_compute_thread():
        evidence, batch = _run_target(cfg)
        params, committed, report = _verify(cfg, evidence, batch)
    assert committed.sent and committed.received_grad and committed.param_grads and committed.sent_grad
    assert compare(committed, params, report) == ""
    assert evidence.serve(STEP, MICROBATCH + 1) is None  # nothing kept of a microbatch the stage did not compute


def test_only_the_microbatches_drawn_with_the_apply_are_kept_for_verifiers() -> None:
    """Commitments are made for every microbatch; the draw comes with the step's apply, after they were sent, and
    only then does the stage copy its parameters: a step with nothing of its own drawn keeps nothing."""
    cfg = _config()
    with one_compute_thread():
        kept, _ = _run_target(cfg)
        dropped, _ = _run_target(cfg, drawn=(MICROBATCH + 1,))  # another stage's replica computed that one
    served = dict(kept.serve(STEP, MICROBATCH))
    assert {"received", "received_grad"} < served.keys() and any(n.startswith(verifier.PARAMS_PREFIX) for n in served)
    assert dropped.serve(STEP, MICROBATCH) is None and dropped.serve(STEP, MICROBATCH + 1) is None
    assert dropped.commitments(1, STEP) == ("", [])  # applied: its commitments went with its commit report


def test_a_verifier_asking_before_the_apply_is_served_once_the_stage_applied() -> None:
    """A verifier learns of its check with the step's apply, as its target does, and may ask for the evidence before
    the target's apply kept it: the request waits for the apply (a step it has no evidence of is refused at once)."""
    cfg = _config()
    with one_compute_thread():
        evidence, _, target = _run_target(cfg, apply=False)
    with futures.ThreadPoolExecutor(1) as pool:
        served = pool.submit(evidence.serve, STEP, MICROBATCH, 30.0)
        time.sleep(0.2)
        assert not served.done()  # the step's apply has not said what is kept
        assert evidence.serve(STEP + 1, MICROBATCH, 30.0) is None
        evidence.keep(1, STEP, target, (MICROBATCH,))
        assert {"received", "received_grad"} < dict(served.result(10)).keys()


def test_evidence_goes_as_one_flat_tensor_per_dtype_and_must_fit_the_stage() -> None:
    """A check's parameters travel flattened (a message per parameter costs more than the recompute's own work);
    ones that do not fill the verifier's stage exactly are no evidence, and the check says so."""
    cfg = _config()
    with one_compute_thread():
        evidence, batch = _run_target(cfg)
    served = dict(evidence.serve(STEP, MICROBATCH))
    assert sorted(served) == [verifier.PARAMS_PREFIX + "torch.float32", "received", "received_grad"]
    short = {**served, verifier.PARAMS_PREFIX + "torch.float32": served[verifier.PARAMS_PREFIX + "torch.float32"][1:]}
    with pytest.raises(ValueError, match="do not hold"):
        recompute(StageRuntime(cfg, 1, 2), short, (STEP, MICROBATCH), batch, None)
    longer = {**served, verifier.PARAMS_PREFIX + "torch.float64": torch.zeros(1, dtype=torch.float64)}
    with pytest.raises(ValueError, match="more parameters"):
        recompute(StageRuntime(cfg, 1, 2), longer, (STEP, MICROBATCH), batch, None)


def test_a_check_is_awaited_only_once_issued() -> None:
    """Checks are drawn before the apply that tells their targets; a report is taken only for an issued one."""
    verification = Verification(1.0, random.Random(0))
    plan = pb.Plan(epoch=1)
    plan.stages.add(index=0, layer_start=0, layer_end=1, node_ids=["a"], addresses=["127.0.0.1:1"])
    classes = {"a": "cpu|x|2.5.1|fp32", "b": "cpu|x|2.5.1|fp32"}
    [check] = verification.draw_checks(0, plan, {0: ["a"]}, {"a": {0: _commitment(0)}}, {}, classes)
    report = pb.VerifyReport(node_id="b", check=check.id, digests=_commitment(0))
    with pytest.raises(ReportRefused):
        verification.report(report)
    verification.issue([check])
    assert verification.report(report) is None and verification.counts.checks == 1


@pytest.mark.parametrize("off_worker", [True, False])
def test_a_stages_parameter_gradients_are_hashed_off_its_worker_on_an_accelerator(monkeypatch, off_worker) -> None:
    """On a GPU, hashing each microbatch's parameter gradients on the worker would make it wait for every backward
    and hash on the compute thread: the worker only starts their copies to the host, a sender thread hashes them,
    and the step's commitments wait for that digest. On the CPU the worker hashes them itself: handing them to
    another thread costs more there than the hash."""
    threads: list[str] = []
    digest_all = verifier.digest_all

    def recorded(tensors):  # noqa: ANN001, ANN202
        if len(tensors) > 1:  # a microbatch's parameter gradients (an activation's digest() comes here too)
            threads.append(threading.current_thread().name)
        return digest_all(tensors)

    monkeypatch.setattr(verifier, "digest_all", recorded)
    cfg = _config()
    with one_compute_thread():
        evidence, _ = _run_target(cfg, off_worker=off_worker)
    _, [committed] = evidence.commitments(1, STEP)
    assert len(threads) == 1 and committed.param_grads
    assert threads[0].startswith("hash") if off_worker else threads[0] == threading.current_thread().name
    assert verifier.hashes_off_worker(torch.device("cuda")) and not verifier.hashes_off_worker(torch.device("cpu"))


def test_a_cpu_stage_hashes_what_its_tasks_received_and_counted_at_the_commit(monkeypatch) -> None:
    """Neither the tensor a task computes with, nor the parameter gradients it counts, nor what it sends is hashed
    before the task's result is sent (a neighbour would wait for the hash): the worker hashes them in one batch at
    the commit (hash_pending), or after a task once PENDING_BYTES of them wait."""
    hashed: list[str] = []
    monkeypatch.setattr(verifier, "digest", lambda t, f=verifier.digest: hashed.append("one") or f(t))
    monkeypatch.setattr(verifier, "digest_all", lambda ts, f=verifier.digest_all: hashed.append("all") or f(ts))
    cfg = _config()
    target, evidence, key = StageRuntime(cfg, 1, 2), Evidence(2), (STEP, MICROBATCH)
    x = torch.randn(cfg.train.microbatch_size, cfg.model.seq_len, cfg.model.d_model)
    with one_compute_thread():
        evidence.watch(1, STEP, target, None)
        evidence.received(1, STEP, MICROBATCH, "forward", x)
        grad = torch.ones_like(target.forward(key, x))
        evidence.received(1, STEP, MICROBATCH, "backward", grad)
        target.backward(key, grad)
    evidence.hash_pending(verifier.PENDING_BYTES)  # after a task: a few KiB wait for the commit
    assert hashed == []
    evidence.hash_pending(1)  # as after a task once that many bytes wait
    assert sorted(hashed) == ["all", "one", "one"]
    evidence.sent(1, STEP, MICROBATCH, "forward", x)  # as a sender thread commits to a tensor it sends
    assert len(hashed) == 3
    _, [committed] = evidence.commitments(1, STEP)
    assert committed.received == committed.sent == verifier.digest(x) and committed.received_grad
    assert committed.param_grads
    hashed.clear()
    Evidence(2, torch.device("cuda")).received(1, STEP, MICROBATCH, "forward", x)  # an accelerator's worker
    assert hashed == ["one"]  # hands hashes off: the servicer's thread hashes what it receives


def test_a_stage_that_shifts_its_activations_is_found_by_the_recompute() -> None:
    cfg = _config()
    with one_compute_thread():
        evidence, batch = _run_target(cfg, shift=1e-3)
        params, committed, report = _verify(cfg, evidence, batch)
    assert compare(committed, params, report) == "sent differ"
    # Evidence other than what was committed to: the parameters served are not the committed ones.
    assert "parameters" in compare(committed, "another checksum", report)


def _check(verification: Verification, target: str = "t") -> Check:
    committed = _commitment(MICROBATCH, sent=b"s", param_grads=b"p")
    check = Check(id=1, step=STEP, stage=1, microbatch=MICROBATCH, layers=(1, 2), target=target,
                  target_address="127.0.0.1:9", committed=committed, params="ck", verifier="v1",
                  candidates=("v1", "v2"))
    verification.pending[check.id] = check
    verification._load[check.verifier] += 1  # given to it, as draw_checks would
    return check


def _report(node: str, check: int, sent: bytes) -> pb.VerifyReport:
    digests = _commitment(MICROBATCH, sent=sent, param_grads=b"p")
    return pb.VerifyReport(node_id=node, check=check, params_checksum="ck", digests=digests, seconds=0.5)


@pytest.mark.parametrize("second_finds", [b"s", b"wrong"])
def test_a_dispute_is_settled_by_a_second_verifier(second_finds: bytes) -> None:
    verification = Verification(0.5, random.Random(0))
    _check(verification)
    with pytest.raises(ReportRefused):
        verification.report(_report("v2", 1, b"s"))  # not its check
    dispute = verification.report(_report("v1", 1, b"wrong"))
    assert dispute is not None and dispute.verifier == "v2" and dispute.accuser == "v1"
    assert verification.report(_report("v2", dispute.id, second_finds)) is None
    [verdict] = verification.take_verdicts()
    # The second verifier agreeing with the target convicts the accuser; agreeing with the accuser, the target.
    assert verdict.guilty == ("v1" if second_finds == b"s" else "t")
    assert verdict.why.startswith(f"step {STEP} stage 1 microbatch {MICROBATCH} of t")
    counts = verification.counts
    assert (counts.checks, counts.mismatches, counts.seconds) == (2, 1 if second_finds == b"s" else 2, 1.0)


def test_a_check_goes_to_its_verifier_with_the_apply() -> None:
    verification = Verification(0.5, random.Random(0))
    draw = _check(verification).draw()
    assert (draw.stage, draw.microbatch, draw.verifier) == (1, MICROBATCH, "v1")
    assert (draw.order.check, draw.order.step, draw.order.target, draw.order.target_address) == (
        1, STEP, "t", "127.0.0.1:9"
    )


def test_a_verifiers_reports_ride_on_its_grad_norm() -> None:
    """A verifier reports its checks with its next GradNorm, not in a call of their own; a report that is not the
    sender's refuses the GradNorm; one sent again (its answer lost), or more than the checks the sender was ever given
    (a coordinator restarted since), are dropped: an honest node's GradNorm is not refused for them."""
    coordinator = Coordinator(_config())
    verification = coordinator.driver.verification
    assert verification is not None
    _check(verification)

    def grad_norm(node: str, *reports: pb.VerifyReport) -> pb.GradNormRequest:
        return pb.GradNormRequest(node_id=node, step=STEP, reports=reports)

    with pytest.raises(ReportRefused, match="not its own"):
        coordinator.grad_norm(grad_norm("v2", _report("v1", 1, b"s")))
    coordinator.grad_norm(grad_norm("v1", _report("v1", 1, b"s"), _report("v1", 2, b"s")))  # unread
    assert verification.counts.checks == 0 and 1 in verification.pending
    coordinator.grad_norm(grad_norm("v1", _report("v1", 1, b"s")))
    coordinator.grad_norm(grad_norm("v1", _report("v1", 1, b"s")))  # the same GradNorm again
    assert verification.counts.checks == 1 and not verification.pending


def test_status_shows_the_checks_and_their_cost() -> None:
    cfg = _config()
    coordinator = Coordinator(cfg)
    verification = coordinator.driver.verification
    assert verification is not None
    _check(verification)
    coordinator.grad_norm(pb.GradNormRequest(node_id="v1", step=STEP, reports=[_report("v1", 1, b"s")]))
    reply = coordinator.status()
    assert (reply.verify.checks, reply.verify.mismatches, reply.verify.seconds) == (1, 0, 0.5)
    assert not render(coordinator.snapshot()).verify.evicted


def test_draws_give_each_target_a_verifier_of_its_device_class() -> None:
    verification = Verification(1.0, random.Random(0))
    plan = pb.Plan(epoch=1)
    for i, node in enumerate(["a", "b"]):
        plan.stages.add(index=i, layer_start=i, layer_end=i + 1, node_ids=[node], addresses=[f"127.0.0.1:{i + 1}"])
    paths = {0: ["a", "b"]}
    commitments = {"a": {0: _commitment(0, sent=b"x")}, "b": {0: _commitment(0, received=b"x")}}
    classes = {"a": "cpu|x|2.5.1|fp32", "b": "cpu|x|2.5.1|fp32", "c": "cuda|y|2.5.1+cu124|fp32",
               "d": "cpu|x|2.4.0|fp32"}
    checks = verification.draw_checks(0, plan, paths, commitments, {}, classes)
    assert [(c.target, c.verifier, c.target_address) for c in checks] == [("a", "b", "127.0.0.1:1"),
                                                                         ("b", "a", "127.0.0.1:2")]
    assert Verification(0.0).draw_checks(0, plan, paths, commitments, {}, classes) == []


def test_a_verifier_shares_its_targets_torch_build_as_replicas_do():
    """The class a verifier must share with its target is the planner's (scheduler.profiles.device_class): another
    torch build may pick other kernels and round otherwise, and its verdict would accuse an honest node."""

    def member(build: str) -> Member:
        m = Member("a", "127.0.0.1:1", "r", 0.0, 0.0)
        m.profile = pb.NodeProfileReport(device="cuda:1", device_name="NVIDIA H100 80GB HBM3, 132 SMs",
                                         torch_build=build, precision="bf16")
        return m

    assert device_class(Member("a", "127.0.0.1:1", "r", 0.0, 0.0)) is None  # no profile yet
    assert device_class(member("2.5.1+cu124 cuda 12.4")) != device_class(member("2.5.1+cu121 cuda 12.1"))


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_live_pipeline_checks_every_microbatch_with_its_apply_and_grad_norms(tmp_path) -> None:
    """Three node processes at verify.fraction = 1: each check reaches its verifier with the step's ApplyStep, its
    evidence is served once the target applied the step, and its report comes back with the verifier's next GradNorm
    (the last step's go unreported); an honest run has every recompute agree and ends where train-local does."""
    cfg = _config("verify.fraction=1.0", "run.steps=6", "run.eval_every=0", "train.microbatches=2",
                  "scheduler.placement=uniform", "profile.layer_repeats=1")
    with local_cluster(cfg, 3, tmp_path, in_order=True) as cluster:
        summary = cluster.wait(90)
        state = fetch_model_state(cluster.coordinator.plan, cluster.token, summary.steps, cluster.coordinator.key)
        verify = cluster.coordinator.status().verify
    assert len(cluster.coordinator.plan.stages) == 3
    # At least a step's checks (3 stages x 2 microbatches) came back with a later step's GradNorms.
    assert verify.checks >= 6 and (verify.mismatches, verify.unserved, verify.evicted) == (0, 0, 0)
    assert max_diff(state, train_local_state(cfg)) == 0.0


def test_a_verdict_evicts_and_rolls_back_to_the_checkpoint_before_the_first_planned_step(tmp_path) -> None:
    cfg = _config("run.steps=20")
    checkpoints = CheckpointStore(tmp_path, keep=10)
    for steps_done in (2, 4, 6):
        state = StageState(0, 3, "", {"layers.0.w": torch.zeros(2)})
        checkpoints.write(steps_done, 1, [state])
    coordinator = Coordinator(cfg, checkpoints=checkpoints)
    key = NodeKey.generate()
    now = time.monotonic()
    coordinator.membership.members["bad"] = Member("bad", "127.0.0.1:9", "local", now, now, public_key=key.public)
    verification = coordinator.driver.verification
    verification.planned(5, ["bad", "good"])
    verification.planned(7, ["bad"])  # a later plan: the first step it was planned on stays 5
    verification.verdicts.append(Verdict("bad", "step 6 ...", 6))
    coordinator.step = 8
    coordinator._settle_verdicts()
    assert coordinator.step == 4  # the newest checkpoint at or before step 5
    assert not coordinator.members["bad"].alive and coordinator.store.evicted(key.public)
    assert coordinator.planning.dirty and verification.counts.evicted == 1
    kinds = [e[1] for e in coordinator.store.events()]
    assert "verdict" in kinds and "rollback" in kinds
