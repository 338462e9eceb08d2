"""TLS with the run's files: a coordinator and nodes train over it, and whoever lacks the files is refused."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from geotrain.cli import build_parser
from geotrain.commands.demo import per_node_flags
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import ClientAuth, new_token
from geotrain.protocol.tls import CA_FILE, CERT_FILE, KEY_FILE, RUN_TLS_NAME, TlsFiles, init_run_tls
from geotrain.protocol.transport import make_channel, make_server
from geotrain.localnodes import LocalNodes
from tests.conftest import REPO, SMALL_RUN, as_set_flags, geotrain_env, run_cli

TOKEN = new_token()


def _run_files(directory: Path) -> TlsFiles:
    init_run_tls(directory)
    return TlsFiles.load(directory)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> TlsFiles:
    """The run's files."""
    return _run_files(tmp_path_factory.mktemp("run-a"))


@pytest.fixture(scope="module")
def run_b(tmp_path_factory) -> TlsFiles:
    """Another run's files: another CA, another certificate."""
    return _run_files(tmp_path_factory.mktemp("run-b"))


class _Status(rpc.CoordinatorServicer):
    def Status(self, request, context):  # noqa: N802
        return pb.StatusReply(state="served")


@contextmanager
def _serving(server: grpc.Server) -> Iterator[None]:
    """Serve Status on `server` while inside; always stop it."""
    rpc.add_CoordinatorServicer_to_server(_Status(), server)
    server.start()
    try:
        yield
    finally:
        server.stop(grace=None)


@pytest.fixture
def tls_server(run_a) -> Iterator[str]:
    """The address of a server with run A's TLS that answers Status."""
    server, port = make_server(TOKEN, "127.0.0.1:0", tls=run_a)
    with _serving(server):
        yield f"127.0.0.1:{port}"


def _call_status(channel: grpc.Channel) -> pb.StatusReply:
    try:
        return rpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=5)
    finally:
        channel.close()


def _refused(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _call_status(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()


def _secure(address: str, creds: grpc.ChannelCredentials) -> grpc.Channel:
    """A token-signing channel with these credentials, expecting the run name as make_channel does."""
    channel = grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", RUN_TLS_NAME)])
    return grpc.intercept_channel(channel, ClientAuth(TOKEN, lambda: "tester"))


@pytest.mark.timeout(30)
def test_the_run_files_reach_a_server_dialled_by_ip(tls_server, run_a):
    # 127.0.0.1 is in no certificate: only the run name makes this work, as it must for any advertised address.
    assert _call_status(make_channel(tls_server, TOKEN, lambda: "tester", run_a)).state == "served"


@pytest.mark.timeout(30)
def test_another_runs_files_are_refused(tls_server, run_b):
    _refused(make_channel(tls_server, TOKEN, lambda: "tester", run_b))


@pytest.mark.timeout(30)
def test_the_server_refuses_a_client_without_the_run_certificate(tls_server, run_a, run_b):
    # Both clients trust the run CA, so only the server's check of the client can refuse them.
    _refused(_secure(tls_server, grpc.ssl_channel_credentials(root_certificates=run_a.ca)))
    _refused(_secure(tls_server, grpc.ssl_channel_credentials(run_a.ca, run_b.key, run_b.cert)))


@pytest.mark.timeout(30)
def test_a_client_refuses_a_server_its_ca_did_not_sign(run_a, run_b):
    # An impostor that would take any client: only the client's own check of the server can refuse it.
    impostor = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = impostor.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(run_b.key, run_b.cert)]))
    with _serving(impostor):
        _refused(make_channel(f"127.0.0.1:{port}", TOKEN, lambda: "tester", run_a))


@pytest.mark.timeout(30)
def test_plaintext_and_tls_do_not_mix(tls_server, run_a):
    _refused(make_channel(tls_server, TOKEN, lambda: "tester"))
    server, port = make_server(TOKEN, "127.0.0.1:0")
    with _serving(server):
        _refused(make_channel(f"127.0.0.1:{port}", TOKEN, lambda: "tester", run_a))


def _self_signed_without_the_run_name(directory: Path) -> None:
    """Replace the run's files by a consistent set whose certificate names another host."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elsewhere.example.org")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(1))
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (directory / CA_FILE).write_bytes(pem)
    (directory / CERT_FILE).write_bytes(pem)
    (directory / KEY_FILE).write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


@pytest.mark.cluster
@pytest.mark.timeout(30)
def test_bad_run_files_are_refused_with_the_reason(tmp_path, run_b):
    init_run_tls(tmp_path / "run")
    with pytest.raises(ValueError, match="already holds ca.pem, cert.pem, key.pem"):
        init_run_tls(tmp_path / "run")
    assert (tmp_path / "run" / KEY_FILE).stat().st_mode & 0o777 == 0o600

    with pytest.raises(ValueError, match="does not exist"):
        TlsFiles.load(tmp_path / "nowhere")
    spoilers = {
        f"has no {KEY_FILE}": lambda d: (d / KEY_FILE).unlink(),
        f"{KEY_FILE} is not the key of": lambda d: (d / KEY_FILE).write_bytes(run_b.key),
        f"{CERT_FILE} is not signed by": lambda d: (d / CA_FILE).write_bytes(run_b.ca),
        "is not a PEM certificate": lambda d: (d / CERT_FILE).write_text("hello"),
        f"does not name {RUN_TLS_NAME}": _self_signed_without_the_run_name,
    }
    for i, (message, spoil) in enumerate(spoilers.items()):
        init_run_tls(tmp_path / f"spoilt-{i}")
        spoil(tmp_path / f"spoilt-{i}")
        with pytest.raises(ValueError, match=message):
            TlsFiles.load(tmp_path / f"spoilt-{i}")

    no_key = tmp_path / "spoilt-0"
    result = run_cli("join", "--coordinator", "127.0.0.1:1", "--token", TOKEN, "--tls-dir", str(no_key))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"geotrain: error: TLS directory {no_key} has no {KEY_FILE} (make one with `geotrain tls init DIR`)"
    ]


@pytest.mark.timeout(30)
def test_demo_gives_its_nodes_the_tls_dir():
    args = build_parser().parse_args(["demo", "--nodes", "2", "--tls-dir", "run-tls"])
    tls = ["--tls-dir", "run-tls", "--device", "cpu"]  # the demo computes on the CPU unless told otherwise
    assert per_node_flags(args) == {"node-1": tls, "node-2": tls}


def _wait_serving(address: str, tls: TlsFiles, proc: subprocess.Popen, timeout: float) -> None:
    """Readiness probe: return once the coordinator answers Status over TLS."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _call_status(make_channel(address, TOKEN, lambda: "tester", tls))
            return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline or proc.poll() is not None:
                raise
        time.sleep(0.2)


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_coordinator_and_nodes_train_over_tls(tmp_path):
    tls_dir = tmp_path / "run-tls"
    assert run_cli("tls", "init", str(tls_dir)).returncode == 0
    tls = TlsFiles.load(tls_dir)
    settings = [*SMALL_RUN, "run.steps=2", "scheduler.stages=2", "scheduler.heartbeat_timeout_s=10"]
    coordinator = subprocess.Popen(
        [
            sys.executable, "-m", "geotrain", "coordinator", "--listen", "127.0.0.1:0", "--token", TOKEN,
            "--min-nodes", "2", "--tls-dir", str(tls_dir), "--save-final", str(tmp_path / "final.safetensors"),
            "--json", *as_set_flags(settings),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=geotrain_env(), cwd=REPO,
        process_group=0,  # its hivemind DHT fork dies with it when the test kills the group
    )
    nodes = None
    try:
        for line in coordinator.stdout:
            if m := re.match(r"coordinator listening on (\S+)$", line):
                address = m.group(1)
                break
        else:
            pytest.fail(f"the coordinator exited with {coordinator.wait()} before listening")
        # Two stages: activations and gradients cross between the nodes; --save-final has the coordinator dial them.
        nodes = LocalNodes(address, TOKEN, tmp_path, {n: ["--tls-dir", str(tls_dir)] for n in ("node-1", "node-2")})
        _wait_serving(address, tls, coordinator, timeout=60)
        _refused(make_channel(address, TOKEN, lambda: "tester"))
        status = run_cli("status", "--coordinator", address, "--token", TOKEN, "--tls-dir", str(tls_dir), "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["nodes"] == [], status.stderr
        assert run_cli("status", "--coordinator", address, "--token", TOKEN, "--json").returncode == 1
        for node_id in ("node-1", "node-2"):
            nodes.start(node_id)
        out, _ = coordinator.communicate(timeout=120)
    finally:
        if coordinator.poll() is None:
            os.killpg(coordinator.pid, signal.SIGKILL)
            coordinator.wait()
        if nodes is not None:
            nodes.stop_all()
    assert coordinator.returncode == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["steps"], summary["nodes"], summary["stages"]) == (2, 2, 2)
    assert (tmp_path / "final.safetensors").stat().st_size > 0
    # Activations and gradients crossed over the raw tensor streams, under TLS too.
    for sender, receiver in (("node-1", "node-2"), ("node-2", "node-1")):
        log = (tmp_path / f"{sender}.log").read_text()
        assert f"tensors to {receiver} go over a raw tensor stream (TLS)" in log, log[-3000:]
