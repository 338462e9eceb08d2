"""Node identity: a node id belongs to the key that first registered it, and every call about a member must be
signed by that member's key.

The unit tests check the signature on a call (a tampered field, a replay, a wrong key) and the coordinator's
binding of ids to keys. The cluster tests are attacks by a client that holds the run token against a live run: each
attack is made while a step is held in one phase (inside the coordinator's event callback, so the step cannot move
on while the forged calls arrive), and the run must still commit every step and end where train-local ends.
"""

from __future__ import annotations

import logging
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch

from geotrain.config import RunConfig, load_config
from geotrain.node.local import train_local
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import MD_KEY, MD_MAC, MD_NODE, MD_NONCE, MD_SIG, MD_TS, ServerAuth, auth_metadata, sign
from geotrain.protocol.identity import KEY_FILE, IdentityError, NodeKey
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.coordinator import Coordinator
from geotrain.scheduler.service import fetch_model_state, make_coordinator_server
from geotrain.scheduler.state import RunStore
from tests.attackers import FORGED_SQ_NORM, Attacker, forged_report, forged_tensors
from tests.conftest import (
    LocalCluster, expect_status, local_cluster, max_diff, one_compute_thread, run_cli, small_run,
)

TOKEN = "identity-test-token"
METHOD = "/geotrain.v1.Coordinator/GradNorm"


# -- the signature on a call ------------------------------------------------------------------------------------


def _signed(key: NodeKey, node_id: str = "node-1", method: str = METHOD) -> dict[str, str]:
    return dict(auth_metadata(TOKEN, method, node_id, key))


def test_a_signed_call_is_accepted_once():
    auth = ServerAuth(TOKEN)
    metadata = _signed(NodeKey.generate())
    assert auth.check(METHOD, metadata) is None
    assert auth.check(METHOD, metadata) == "replayed request rejected"


def test_a_tampered_field_fails_the_signature_even_with_a_valid_token_proof():
    # A token holder can make a valid MAC for any fields; the key's signature over the original fields then fails.
    auth = ServerAuth(TOKEN)
    for field, value in [(MD_NODE, "node-2"), (MD_TS, None), (MD_NONCE, "0" * 32)]:
        metadata = _signed(NodeKey.generate())
        metadata[field] = value if value is not None else f"{float(metadata[MD_TS]) + 1:.6f}"
        metadata[MD_MAC] = sign(TOKEN, METHOD, metadata[MD_NODE], metadata[MD_TS], metadata[MD_NONCE])
        assert auth.check(METHOD, metadata) == "bad key signature: the call is not signed by the key it presents"
    # Another method with the same fields: the MAC and the signature both cover it.
    assert "bad run-token proof" in auth.check("/geotrain.v1.Coordinator/StepApplied", _signed(NodeKey.generate()))


def test_a_signature_by_another_key_or_a_missing_half_is_refused():
    auth = ServerAuth(TOKEN)
    metadata = _signed(NodeKey.generate())
    metadata[MD_KEY] = NodeKey.generate().public.hex()  # claims a key that did not sign
    assert "bad key signature" in auth.check(METHOD, metadata)
    for missing in (MD_KEY, MD_SIG):
        metadata = _signed(NodeKey.generate())
        del metadata[missing]
        assert "bad key signature" in auth.check(METHOD, metadata)
    metadata = _signed(NodeKey.generate())
    metadata[MD_SIG] = "not hex"
    assert "bad key signature" in auth.check(METHOD, metadata)
    # An unsigned call passes the token check: which calls need a key is the handler's to say.
    assert auth.check(METHOD, dict(auth_metadata(TOKEN, METHOD, "node-1"))) is None


def test_a_node_key_is_created_once_and_kept_in_its_state_dir(tmp_path):
    key, created = NodeKey.load_or_create(tmp_path / "node")
    again, created_again = NodeKey.load_or_create(tmp_path / "node")
    assert created and not created_again and again.public == key.public
    assert stat.S_IMODE((tmp_path / "node" / KEY_FILE).stat().st_mode) == 0o600
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / KEY_FILE).write_text("not a key")
    with pytest.raises(IdentityError, match="is not a node key"):
        NodeKey.load_or_create(tmp_path / "bad")


# -- the coordinator binds ids to keys ---------------------------------------------------------------------------


def _register(c: Coordinator, key: NodeKey, node_id: str, address: str) -> pb.RegisterReply:
    request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address=address,
                                 public_key=key.public)
    return c.register(request, key.public)


def test_an_id_belongs_to_the_first_key_even_after_a_coordinator_restart(tmp_path):
    owner, impostor = NodeKey.generate(), NodeKey.generate()
    store = RunStore(tmp_path / "run.sqlite")
    c = Coordinator(load_config(None, []), store=store)
    assert _register(c, owner, "node-1", "127.0.0.1:1").accepted
    reply = _register(c, impostor, "node-1", "127.0.0.1:2")
    assert (reply.accepted, reply.reason) == (False, pb.REJECT_REASON_IDENTITY)
    assert "belongs to another key" in reply.message
    # A registration signed by another key than the one it carries.
    request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, address="127.0.0.1:3", public_key=owner.public)
    assert c.register(request, impostor.public).reason == pb.REJECT_REASON_IDENTITY
    assert c.register(request, b"").reason == pb.REJECT_REASON_IDENTITY
    store.close()
    # A restarted coordinator remembers whose the id is; the owner, restarted elsewhere, comes back as itself.
    store = RunStore(tmp_path / "run.sqlite")
    c = Coordinator(load_config(None, []), store=store)
    assert _register(c, impostor, "node-1", "127.0.0.1:2").reason == pb.REJECT_REASON_IDENTITY
    # An id it assigns is none that an earlier incarnation gave out.
    assert _register(c, impostor, "", "127.0.0.1:4").node_id != "node-1"
    assert _register(c, owner, "node-1", "127.0.0.1:5").accepted
    store.close()


def test_repeated_offences_evict_a_member_and_its_key_stays_out():
    key = NodeKey.generate()
    c = Coordinator(load_config(None, ["scheduler.max_offences=3"]))
    assert _register(c, key, "mallory", "127.0.0.1:1").accepted
    c.authorize("mallory", key.public)
    for _ in range(2):
        c.refused("mallory", "a forged report")
    assert c.members["mallory"].alive
    c.refused("mallory", "the third forged report")
    assert not c.members["mallory"].alive
    kinds = [(kind, node, detail) for _, kind, node, detail in c.store.events()]
    assert ("evicted", "mallory", "3 refused reports; the last: the third forged report") in kinds
    for node_id in ("mallory", "mallory-2"):  # its id, and any other id with its key
        assert _register(c, key, node_id, "127.0.0.1:2").reason == pb.REJECT_REASON_EVICTED


def test_calls_about_a_member_need_its_key():
    key, other = NodeKey.generate(), NodeKey.generate()
    c = Coordinator(load_config(None, []))
    assert _register(c, key, "node-1", "127.0.0.1:1").accepted
    c.authorize("node-1", key.public)
    for signer in (other.public, None):
        with pytest.raises(PermissionError, match="must be signed by that node's key"):
            c.authorize("node-1", signer)
    c.authorize("stranger", other.public)  # an unknown id: answered as about no member


@contextmanager
def _served(c: Coordinator) -> Iterator[Attacker]:
    """c behind its gRPC service on 127.0.0.1 (no run, no DHT); yields a token holder's stubs to it."""
    server, port = make_coordinator_server(c, TOKEN, "127.0.0.1:0")
    server.start()
    attacker = Attacker(f"127.0.0.1:{port}", TOKEN)
    try:
        yield attacker
    finally:
        attacker.close()
        server.stop(1.0).wait(5)


@pytest.mark.timeout(30)
def test_windows_for_a_member_need_its_key():
    key = NodeKey.generate()
    c = Coordinator(load_config(None, []))
    assert _register(c, key, "node-1", "127.0.0.1:1").accepted
    with _served(c) as a:
        request = pb.WindowsRequest(node_id="node-1", step=0, microbatch=0)
        for signer in (a.outsider, None):
            expect_status(grpc.StatusCode.PERMISSION_DENIED, "signed by that node's key",
                          lambda: a.coordinator(signer, "node-1").Windows(request, timeout=10))
        # Its own key gets as far as the data set (this run has none: it reads the byte corpus).
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, "trains on the byte corpus",
                      lambda: a.coordinator(key, "node-1").Windows(request, timeout=10))


@pytest.mark.timeout(30)
def test_clip_events_are_written_off_the_event_loop(monkeypatch):
    keys = {n: NodeKey.generate() for n in ("a", "b", "c")}
    c = Coordinator(load_config(None, []))
    for i, (node_id, key) in enumerate(keys.items()):
        assert _register(c, key, node_id, f"127.0.0.1:{i + 1}").accepted
    c.planning.plan = pb.Plan(epoch=1, stages=[
        pb.StageAssignment(index=0, node_ids=list(keys), peer_ids=[f"peer-{n}" for n in keys])
    ])
    writers: dict[str, str] = {}  # event kind -> the thread that wrote it
    event = c.store.event
    monkeypatch.setattr(c.store, "event", lambda kind, *args: (writers.setdefault(kind, threading.current_thread().name),
                                                                event(kind, *args)))
    with _served(c) as a:
        for reporter in ("a", "c"):
            request = pb.GradNormRequest(node_id=reporter, step=c.step, sq_norm=1.0, clipped_peers=["peer-b"])
            a.coordinator(keys[reporter], reporter).GradNorm(request, timeout=10)
    assert [node for _, kind, node, _ in c.store.events() if kind == "clipped"] == ["b"]
    # The loop's thread is "coordinator-grpc"; SQLite is written by the pool beside it.
    assert writers["clipped"].startswith("coordinator-grpc-blocking"), writers


# -- attacks on a live run ----------------------------------------------------------------------------------------


def _config() -> RunConfig:
    # Two stages of one node each; whoever else registers is a spare, never planned in.
    return small_run("run.steps=4", "scheduler.stages=2", "scheduler.replicas=1", "scheduler.max_offences=3",
                     "scheduler.step_timeout_s=60")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """train-local's final parameters for _config()."""
    with one_compute_thread():
        runtime, _ = train_local(_config())
    return {name: p.detach().clone() for name, p in runtime.named_state()}


class Attack(Attacker):
    """What an attack sees: the live cluster held in a phase of step 1, and a token holder's stubs to it."""

    def __init__(self, cluster: LocalCluster, log_dir: Path) -> None:
        super().__init__(f"127.0.0.1:{cluster.port}", cluster.token)
        self.cluster = cluster
        self.log_dir = log_dir

    @property
    def plan(self) -> pb.Plan:
        return self.cluster.coordinator.plan

    def key_of(self, node_id: str) -> NodeKey:
        """A node's own key, from its --state-dir (for the tests that replay what a real member signed)."""
        return NodeKey.load_or_create(self.log_dir / node_id)[0]


@contextmanager
def attacked_run(
    tmp_path: Path, reference: dict[str, torch.Tensor], phase: str, attack: Callable[[Attack], None]
) -> Iterator[LocalCluster]:
    """A live 2-node run attacked once, while step 1 is held in `phase`; then it must commit every step and end
    with train-local's parameters. Yields the finished cluster; re-raises what the attack raised."""
    cfg = _config()
    ready = threading.Event()
    running: list[LocalCluster] = []
    outcome: dict[str, BaseException | bool] = {}

    def on_event(kind: str, data: dict) -> None:
        if kind != "phase" or (data["step"], data["phase"]) != (1, phase) or outcome:
            return
        ready.wait(30)
        attacker = Attack(running[0], tmp_path)
        try:
            attack(attacker)
            outcome["done"] = True
        except BaseException as e:  # handed to the test below, not to the coordinator's run loop
            outcome["error"] = e
        finally:
            attacker.close()

    with local_cluster(cfg, 2, tmp_path, on_event=on_event) as cluster:
        running.append(cluster)
        ready.set()
        summary = cluster.wait(150)
        if "error" in outcome:
            raise outcome["error"]
        assert outcome == {"done": True}
        assert summary.steps == cfg.run.steps
        assert [r.step for r in cluster.coordinator.store.steps()] == list(range(cfg.run.steps))
        state = fetch_model_state(cluster.coordinator.plan, cluster.token, summary.steps, cluster.coordinator.key)
        assert max_diff(state, reference) <= 1e-4
        yield cluster


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_id_takeover_and_order_stream_theft_are_refused(tmp_path, reference, caplog):
    caplog.set_level(logging.WARNING, logger="geotrain.protocol.auth")
    victim = "node-1"

    def attack(a: Attack) -> None:
        # A second `geotrain join` under a member's id, with a key of its own: one line, exit 1.
        result = run_cli("join", "--coordinator", a.address, "--token", a.cluster.token, "--node-id", victim,
                         "--state-dir", str(a.log_dir / "impostor"), "--listen", "127.0.0.1:0",
                         "--device", "cpu", timeout=60)
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"geotrain: coordinator rejected this node (REJECT_REASON_IDENTITY): node id {victim} belongs to another "
            "key (the node that first registered it); a node keeps its key in its --state-dir: join with that "
            "directory, or under another --node-id"
        ]
        stub = a.coordinator(a.outsider, victim)
        # The same over the wire, also carrying the victim's public key (which plans publish) but signed by another.
        for public_key in (a.outsider.public, a.key_of(victim).public):
            reply = a.register(victim, a.outsider, public_key)
            assert (reply.accepted, reply.reason) == (False, pb.REJECT_REASON_IDENTITY)
        # The victim's order stream, its heartbeat, its failure reports and the checkpoint are not the outsider's.
        denied = grpc.StatusCode.PERMISSION_DENIED
        expect_status(denied, "signed by that node's key",
                      lambda: next(stub.Orders(pb.OrdersRequest(node_id=victim), timeout=10)))
        expect_status(denied, "signed by that node's key",
                      lambda: stub.Heartbeat(pb.HeartbeatRequest(node_id=victim), timeout=10))
        other = next(n for s in a.plan.stages for n in s.node_ids if n != victim)
        expect_status(denied, "signed by that node's key",
                      lambda: stub.ReportFailure(pb.FailureReport(node_id=victim, peer=other), timeout=10))
        expect_status(denied, "only to a member ordered to load them",
                      lambda: next(stub.FetchCheckpoint(pb.FetchCheckpointRequest(layer_end=1), timeout=10)))
        # Unsigned, with the token only.
        unsigned = a.coordinator(None, victim)
        expect_status(denied, "signed by that node's key",
                      lambda: next(unsigned.Orders(pb.OrdersRequest(node_id=victim), timeout=10)))

    with attacked_run(tmp_path, reference, "dispatched", attack) as cluster:
        kinds = [(kind, node) for _, kind, node, _ in cluster.coordinator.store.events()]
    assert ("rejoin", victim) not in kinds
    # Three refused registrations and five refused calls from one host: one log line a minute.
    refusals = [r.getMessage() for r in caplog.records if r.name == "geotrain.protocol.auth"]
    assert len(refusals) == 1 and "belongs to another key" in refusals[0], refusals


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_forged_reports_and_tensors_are_refused_and_a_member_forging_reports_is_evicted(tmp_path, reference):
    def forge_reports(a: Attack) -> None:
        c = a.cluster.coordinator
        progress = c.driver.progress
        step, epoch = progress.step, progress.plan_epoch
        head = progress.issued[0]
        loss, path = progress.done[0]
        applier = sorted(progress.appliers)[0]
        forged = [(method, forged_report(method, node_id, step, epoch, path))
                  for node_id in (head, applier) for method in ("MicrobatchDone", "GradNorm", "StepApplied")]
        # A token holder with its own key, claiming the members' ids.
        outsider = a.coordinator(a.outsider, head)
        for method, request in forged:
            expect_status(grpc.StatusCode.PERMISSION_DENIED, "signed by that node's key",
                          lambda: getattr(outsider, method)(request, timeout=10))
        # A registered member (a spare) reporting what is not its own, under its own id, then under another's.
        mallory = NodeKey.generate()
        stub = a.coordinator(mallory, "mallory")
        assert a.register("mallory", mallory).accepted
        own = forged_report("MicrobatchDone", "mallory", step, epoch, ["mallory", *path[1:]], loss)
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, "was not issued to it",
                      lambda: stub.MicrobatchDone(own, timeout=10))
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, "serves no stage",
                      lambda: stub.GradNorm(forged_report("GradNorm", "mallory", step, epoch), timeout=10))
        assert c.members["mallory"].alive
        expect_status(grpc.StatusCode.PERMISSION_DENIED, "signed by that node's key",
                      lambda: stub.StepApplied(forged_report("StepApplied", applier, step, epoch), timeout=10))
        # Its third offence evicted it, and its key cannot come back.
        assert not c.members["mallory"].alive
        reply = a.register("mallory", mallory)
        assert (reply.accepted, reply.reason) == (False, pb.REJECT_REASON_EVICTED)
        # Nothing forged reached the step: the head's report and the plan's norms are the members' own (a stage held
        # alone reports its norm as soon as it has counted the step's microbatches, so some may be in already).
        assert progress.done[0] == (loss, path) and not progress.checksums
        assert set(progress.norms) <= progress.appliers and FORGED_SQ_NORM not in progress.norms.values()

    def forge_tensors(a: Attack) -> None:
        cfg = a.cluster.coordinator.cfg
        shape = (cfg.train.microbatch_size, cfg.model.seq_len, cfg.model.d_model)
        forged = forged_tensors(a.plan, a.cluster.coordinator.driver.progress.step, shape)
        denied = grpc.StatusCode.PERMISSION_DENIED
        # Activations to the last stage and gradients to the first, claiming the plan's own sender, signed by
        # another key, or by none.
        for key in (a.outsider, None):
            for method, (address, sender, chunks) in forged.items():
                expect_status(denied, f"{method.lower()} from {sender} is not signed by {sender}'s key",
                              lambda: getattr(a.stage(address, key, sender), method)(iter(chunks), timeout=10))
        address, last, chunks = forged["Backward"]
        first = a.plan.stages[0].node_ids[0]
        # The last stage's real key, resending a gradient the first stage already has: not one it waits for.
        expect_status(denied, "has its gradient",
                      lambda: a.stage(address, a.key_of(last), last).Backward(iter(chunks), timeout=10))
        # The first stage's key cannot send gradients: it is not the next stage's node on the path.
        expect_status(denied, f"backward from {last} is not signed by {last}'s key",
                      lambda: a.stage(address, a.key_of(first), last).Backward(iter(chunks), timeout=10))
        # The first stage's real key, replaying activations of step 0, which the second stage applied.
        address, _, old = forged_tensors(a.plan, 0, shape)["Forward"]
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, "step 0, this node applied step 0",
                      lambda: a.stage(address, a.key_of(first), first).Forward(iter(old), timeout=10))

    def attack(a: Attack) -> None:
        forge_reports(a)
        forge_tensors(a)

    with attacked_run(tmp_path, reference, "microbatches_done", attack) as cluster:
        events = [(kind, node, detail) for _, kind, node, detail in cluster.coordinator.store.events()]
    evictions = [(node, detail) for kind, node, detail in events if kind == "evicted"]
    assert len(evictions) == 1 and evictions[0][0] == "mallory"
    assert evictions[0][1].startswith("3 refused reports; the last: a call about node")
