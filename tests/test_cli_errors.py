"""Every error a new user can hit on the command line: one line on stderr, the documented exit code, no traceback;
internal bugs keep their traceback under their own exit code. Also what keeps `--help` fast: no torch at start-up."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, free_ports, geotrain_env, run_cli
from geotrain.cli import EXIT_FAILED, EXIT_INTERNAL, EXIT_USAGE, main
from geotrain.config import ConfigError, RunConfig, build_config, load_config, saved_model_config
from geotrain.protocol import probe
from geotrain.protocol.auth import RefusalLog, peer_host
from geotrain.protocol.tls import TlsFiles, init_run_tls
from geotrain.protocol.transport import make_server
from geotrain.scheduler.service import CoordinatorProcess
from geotrain.scheduler.state import RunStore

TOKEN = "the-right-token"


def one_line_error(result: subprocess.CompletedProcess, code: int, text: str) -> None:
    """The command exited with `code` and said exactly one (non-blank) line on stderr, containing `text`."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, result.stderr
    assert len(lines) == 1, result.stderr
    assert text in lines[0], lines[0]


def python_cli(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `code` (which may patch geotrain first), then the CLI's main(args), in a fresh interpreter."""
    script = f"import sys\n{code}\nfrom geotrain.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=geotrain_env(), cwd=REPO
    )


@pytest.fixture(scope="module")
def closed_port() -> Iterator[int]:
    """A port bound (so nothing else takes it) but not listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def run_tls(tmp_path_factory) -> dict[str, Path]:
    """This run's TLS files and another run's."""
    base = tmp_path_factory.mktemp("tls")
    dirs = {"ours": base / "ours", "other": base / "other"}
    for d in dirs.values():
        init_run_tls(d)
    return dirs


@pytest.fixture(scope="module")
def coordinator() -> Iterator[str]:
    """A live plaintext coordinator (in this process, waiting for nodes); yields its address."""
    cfg = load_config(None, ["scheduler.min_nodes=100"])
    process = CoordinatorProcess(cfg, TOKEN, "127.0.0.1:0")
    process.server.start()
    try:
        yield f"127.0.0.1:{process.port}"
    finally:
        process.close()


@pytest.fixture(scope="module")
def tls_server(run_tls) -> Iterator[str]:
    """A gRPC server speaking the run's TLS (no services: the TLS checks never get further); yields its address."""
    server, port = make_server(TOKEN, "127.0.0.1:0", tls=TlsFiles.load(run_tls["ours"]))
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


# -- refused before anything starts: exit 2 --------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, text",
    [
        (["demo", "--slowdowns", "x"], "--slowdowns: expected factors >= 1"),
        (["demo", "--nodes", "0"], "--nodes must be at least 1"),
        (["demo", "--chaos", "sometimes"], "--chaos takes kill-every="),
        (["demo", "--uplink", "inf"], "--uplink takes MBPS or MBPS/MS"),
        (["join", "--coordinator", "127.0.0.1:1", "--token", TOKEN, "--slowdown", "nan"], "--slowdown: expected"),
        (["join", "--coordinator", "no-port", "--token", TOKEN], "--coordinator takes HOST:PORT"),
        (["join", "--coordinator", "127.0.0.1:1"], "a run token is required"),
        (["join", "--coordinator", "127.0.0.1:1", "--token", TOKEN, "--listen", "127.0.0.1:99999"], "--listen"),
        (["train-local", "--set", "train.grad_clip=nan"], "train.grad_clip must be in"),
        (["train-local", "--set", "nosuchkey"], "--set takes section.key=value"),
        (["train-local", "--config", "/nonexistent/run.toml"], "cannot read config file"),
        (["coordinator", "--token", TOKEN, "--listen", "127.0.0.1:0", "--tls-dir", "/nonexistent"], "does not exist"),
        (["coordinator", "--token", TOKEN, "--listen", "127.0.0.1:0", "--http", "localhost"], "--http"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, text):
    one_line_error(run_cli(*args), EXIT_USAGE, text)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_taken_listen_port_is_one_line_exit_2():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_cli("coordinator", "--token", TOKEN, "--listen", f"127.0.0.1:{port}")
    one_line_error(result, EXIT_USAGE, f"cannot listen on 127.0.0.1:{port}: the port is in use")


@pytest.mark.timeout(30)
def test_fixed_ports_are_checked_before_anything_starts(capsys, monkeypatch):
    # In this process: each refusal comes before the command imports or starts anything.
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")  # what main sets for gRPC's C core, undone after the test
    join = ["join", "--coordinator", "127.0.0.1:1", "--token", TOKEN, "--listen", "127.0.0.1:0"]
    coordinator = ["coordinator", "--token", TOKEN]
    free, other = free_ports(2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        cases = [
            ([*join, "--dht-port", "65536"], "argument --dht-port: expected"),
            ([*join, "--dht-port", str(taken)], f"--dht-port: cannot listen on 127.0.0.1:{taken}: the port is in use"),
            ([*join, "--tensor-port", str(free), "--dht-port", str(free)], f"--dht-port {free} is --tensor-port's port"),
            ([*coordinator, "--listen", "127.0.0.1:0", "--dht-port", str(taken)], "the port is in use"),
            # Advertised elsewhere, the DHT listens on every interface: a port taken on one of them is taken.
            ([*coordinator, "--listen", f"127.0.0.1:{other}", "--advertise", "10.1.0.2", "--dht-port", str(taken)],
             f"--dht-port: cannot listen on 0.0.0.0:{taken}: the port is in use"),
            ([*coordinator, "--listen", f"127.0.0.1:{free}", "--dht-port", str(free)], f"--dht-port {free} is --listen's"),
        ]
        for args, text in cases:
            capsys.readouterr()
            try:
                code = main(args)
            except SystemExit as e:  # argparse's way out
                code = e.code
            err = capsys.readouterr().err
            lines = [line for line in err.splitlines() if line.strip()]
            assert code == EXIT_USAGE and len(lines) == 1 and text in lines[0], (args, code, err)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_tls_init_never_overwrites(run_tls):
    one_line_error(run_cli("tls", "init", str(run_tls["ours"])), EXIT_USAGE, "a run's TLS files are never replaced")


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_resume_with_another_model_names_the_keys(tmp_path):
    store = RunStore(tmp_path / "state" / "run.sqlite")
    store.put("run_id", "a-run")  # what a coordinator that started the run wrote
    store.adopt_model(dataclasses.asdict(load_config().model), check=False)
    store.close()
    result = run_cli(
        "coordinator", "--token", TOKEN, "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"), "--resume",
        "--set", "model.n_layers=6", "--set", "model.d_model=64",
    )
    one_line_error(result, EXIT_USAGE, "model.d_model 128 there, 64 here, model.n_layers 4 there, 6 here")


def test_resume_records_the_model_and_compares_it(tmp_path):
    store = RunStore(tmp_path / "run.sqlite")
    model = dataclasses.asdict(load_config().model)
    assert store.adopt_model(model, check=True) == []  # a run saved before models were recorded resumes
    assert store.adopt_model({**model, "seq_len": 32}, check=True) == [("seq_len", 64, 32)]
    assert store.adopt_model({**model, "seq_len": 32}, check=False) == []  # a new run replaces it
    assert store.adopt_model({**model, "seq_len": 32}, check=True) == []
    store.close()


def _main_says(capsys, args: list[str]) -> tuple[int, list[str]]:
    """main(args) in this process: its exit code and the non-blank lines it wrote on stderr."""
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as e:  # argparse's way out
        code = e.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.timeout(30)
def test_resume_without_a_run_to_resume_is_refused_in_one_line(capsys, monkeypatch, tmp_path):
    # Without the check, the first started a new run and waited for nodes as if resumed.
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")
    coordinator = ["coordinator", "--token", TOKEN, "--listen", "127.0.0.1:0", "--resume"]
    code, lines = _main_says(capsys, coordinator)
    assert code == EXIT_USAGE and lines == ["geotrain: error: --resume continues the run held in --state-dir: name "
                                            "that directory"]
    code, lines = _main_says(capsys, [*coordinator, "--state-dir", str(tmp_path / "new")])
    assert code == EXIT_USAGE and len(lines) == 1 and "holds no run" in lines[0], lines
    assert not (tmp_path / "new").exists()  # the refusal leaves nothing behind
    RunStore(tmp_path / "empty" / "run.sqlite").close()  # a store some earlier command made, with no run in it
    code, lines = _main_says(capsys, [*coordinator, "--state-dir", str(tmp_path / "empty")])
    assert code == EXIT_USAGE and len(lines) == 1 and "holds no run" in lines[0], lines
    code, lines = _main_says(capsys, ["stop", "--coordinator", "127.0.0.1:1", "--token", TOKEN, "--state-dir",
                                      str(tmp_path / "empty")])
    assert code == EXIT_USAGE and len(lines) == 1 and "holds no coordinator key (node.key)" in lines[0], lines


@pytest.mark.timeout(60)
def test_train_local_computes_with_the_nodes_thread_count_unless_told(capsys, tmp_path):
    # The README's bit-equality with the demo's nodes (one thread each) must hold without OMP_NUM_THREADS.
    import torch

    before = torch.get_num_threads()
    tiny = ["--steps", "1", "--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "run.eval_every=0",
            "--set", "run.eval_microbatches=1", "--set", "train.microbatches=1"]
    try:
        torch.set_num_threads(2)
        assert main(["train-local", *tiny]) == 0 and torch.get_num_threads() == 1
        assert main(["train-local", *tiny, "--threads", "2"]) == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(30)
def test_a_binary_config_file_is_one_line(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    code, lines = _main_says(capsys, ["train-local", "--config", str(config)])
    assert code == EXIT_USAGE and lines == [f"geotrain: error: {config} is not a text file (not UTF-8): a run config "
                                            "is TOML text"], lines


@pytest.mark.timeout(60)
def test_only_the_owner_ends_the_run_a_token_holder_cannot(capsys, tmp_path):
    # Every volunteer holds the token: the Stop call must be signed by the coordinator's own key, kept in its
    # state dir.
    import grpc

    from geotrain.protocol.identity import NodeKey
    from geotrain.scheduler.service import stop_run

    process = CoordinatorProcess(load_config(None, ["scheduler.min_nodes=100"]), TOKEN, "127.0.0.1:0",
                                 state_dir=tmp_path)
    process.server.start()
    address = f"127.0.0.1:{process.port}"
    try:
        with pytest.raises(grpc.RpcError) as err:
            stop_run(address, TOKEN, NodeKey.generate(), "a volunteer's wish")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "only the run owner" in err.value.details()
        assert process.coordinator.ended_by_owner is None and not process.coordinator.stop_requested.is_set()
        code, lines = _main_says(capsys, ["stop", "--coordinator", address, "--token", TOKEN, "--state-dir",
                                          str(tmp_path), "--reason", "upgrading the model"])
        assert code == 0 and lines == []
        assert process.coordinator.ended_by_owner == "upgrading the model"
        assert process.coordinator.stop_requested.is_set()
    finally:
        process.close()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_join_where_another_server_answers_says_it_is_not_a_coordinator(tmp_path):
    # gRPC's own words were "Failed parsing HTTP/2 ... frame type 79", after --give-up-after of retries.
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        result = run_cli("join", "--coordinator", address, "--token", TOKEN, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    one_line_error(result, EXIT_FAILED, f"something answers at {address}, but that is not a geotrain coordinator")


# -- failed while talking to others: exit 1 ---------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_unreachable_coordinator_is_one_line_exit_1(closed_port):
    address = f"127.0.0.1:{closed_port}"
    one_line_error(run_cli("status", "--coordinator", address, "--token", TOKEN), EXIT_FAILED, "cannot get status")
    result = run_cli("join", "--coordinator", address, "--token", TOKEN, "--give-up-after", "0.5")
    one_line_error(result, EXIT_FAILED, f"coordinator {address} unreachable")


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_wrong_token_is_one_line_and_logged_once(coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="geotrain.protocol.auth")
    result = run_cli("join", "--coordinator", coordinator, "--token", "a-wrong-token")
    one_line_error(result, EXIT_FAILED, "the coordinator refused the run token")
    assert re.fullmatch(r"device cpu .*: [\d.]+ GiB usable, [\d.]+ TFLOP/s fp32 matmul\n", result.stdout), result.stdout
    one_line_error(
        run_cli("status", "--coordinator", coordinator, "--token", "a-wrong-token"), EXIT_FAILED, "UNAUTHENTICATED"
    )
    refusals = [r.getMessage() for r in caplog.records if r.name == "geotrain.protocol.auth"]
    assert len(refusals) == 1, refusals  # the status call within the minute is not logged again
    assert "refused /geotrain.v1.Coordinator/Register from 127.0.0.1" in refusals[0]


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_tls_mismatch_is_said_at_once_both_ways(coordinator, tls_server, run_tls):
    # Without the check, each of these retried for --give-up-after (60 s by default) and said "Socket closed".
    flags = ["--token", TOKEN, "--give-up-after", "60"]
    result = run_cli("join", "--coordinator", tls_server, *flags, timeout=30)
    one_line_error(result, EXIT_FAILED, f"the coordinator {tls_server} speaks TLS: pass the run's --tls-dir")
    result = run_cli("join", "--coordinator", coordinator, "--tls-dir", str(run_tls["ours"]), *flags, timeout=30)
    one_line_error(result, EXIT_FAILED, f"the coordinator {coordinator} does not speak TLS: leave out --tls-dir")
    result = run_cli("join", "--coordinator", tls_server, "--tls-dir", str(run_tls["other"]), *flags, timeout=30)
    one_line_error(result, EXIT_FAILED, "presents a certificate the run's CA did not sign")
    result = run_cli("status", "--coordinator", tls_server, "--token", TOKEN)
    one_line_error(result, EXIT_FAILED, f"the coordinator {tls_server} speaks TLS")


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_protocol_version_mismatch_is_one_line(coordinator):
    patch = "import geotrain.protocol.version as v\nv.PROTOCOL_VERSION = 999"
    result = python_cli(patch, "join", "--coordinator", coordinator, "--token", TOKEN)
    one_line_error(result, EXIT_FAILED, "REJECT_REASON_PROTOCOL_VERSION")


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_demo_whose_nodes_all_fail_ends_in_one_line():
    # Nodes that cannot start (here: a flag their parser refuses) left the demo's coordinator waiting forever.
    patch = (
        "import geotrain.commands.demo as demo\n"
        "demo.per_node_flags = lambda args: {f'node-{i + 1}': ['--slowdown', '0.5'] for i in range(args.nodes)}"
    )
    result = python_cli(patch, "demo", "--nodes", "2", "--http", "off", timeout=100)
    one_line_error(result, EXIT_FAILED, "every local node exited with an error; node-1's last words")
    assert "--slowdown: expected a number >= 1" in result.stderr


# -- internal bugs keep their traceback ------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_internal_error_keeps_its_traceback_and_exit_code():
    # A ValueError from a bug used to read as a usage error (exit 2, one line, no traceback).
    patch = (
        "import geotrain.commands.tools as tools\ndef broken(args):\n    raise ValueError('a bug')\n"
        "tools.cmd_tls_init = broken"
    )
    result = python_cli(patch, "tls", "init", "somewhere")
    assert result.returncode == EXIT_INTERNAL, result.stderr
    assert "Traceback" in result.stderr and "ValueError: a bug" in result.stderr
    assert "internal error" in result.stderr.strip().splitlines()[-1]


# -- config values -------------------------------------------------------------------------------------------------


def _float_fields() -> list[tuple[str, str]]:
    sections = typing.get_type_hints(RunConfig)
    return [
        (name, f.name)
        for name, cls in sections.items()
        for f, hint in ((f, typing.get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls))
        if hint is float
    ]


@pytest.mark.parametrize("section, key", _float_fields())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_field_refuses_non_finite_values(section, key, value):
    with pytest.raises(ConfigError, match=f"{section}.{key} must"):
        build_config({section: {key: value}})


def test_non_finite_emulated_link_is_refused():
    with pytest.raises(ConfigError, match="finite"):
        build_config({"emulation": {"links": ["eu-us=nan/50"]}})


def test_torch_free_copies_match_their_sources():
    # config keeps its own copies so that `plan` and `--help` need not import torch (protocol.framing, node.model).
    from geotrain.node.model import VOCAB

    field = next(f for f in dataclasses.fields(load_config().profile) if f.name == "probe_bytes")
    assert field.metadata["hi"] == probe.MAX_PROBE_BYTES
    assert load_config().model.vocab == VOCAB


# -- auth refusal log ----------------------------------------------------------------------------------------------


def test_refusals_are_logged_once_per_host_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="geotrain.protocol.auth")
    refusals = RefusalLog(interval_s=60.0)
    assert refusals.refused("ipv4:10.0.0.1:5000", "/m", "n", "bad proof", now=0.0)
    assert not refusals.refused("ipv4:10.0.0.1:5001", "/m", "n", "bad proof", now=59.0)  # another connection
    assert refusals.refused("ipv4:10.0.0.2:5000", "/m", "n", "bad proof", now=59.0)
    assert refusals.refused("ipv4:10.0.0.1:5002", "/m", "n", "bad proof", now=60.5)
    assert len(caplog.records) == 3
    assert peer_host("ipv6:[::1]:443") == "::1"


# -- start-up cost and saved models --------------------------------------------------------------------------------

_HEAVY = ("torch", "hivemind")


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_light_commands_do_not_import_torch(tmp_path, closed_port):
    # Loading torch took 3-8 s on every `geotrain --help`; these commands need none of it.
    commands = [
        ["--help"],
        *([name, "--help"] for name in (
            "coordinator", "join", "demo", "train-local", "plan", "status", "tls", "data", "tokenizer",
            "generate", "export",
        )),
        ["tokenizer", "train", "--input", str(tmp_path / "none.txt"), "--out", str(tmp_path / "tok.json")],
        ["plan", "--cluster", "deploy/clusters/four-regions-wan.yaml"],
        ["status", "--coordinator", f"127.0.0.1:{closed_port}", "--token", TOKEN],
        ["tls", "init", str(tmp_path / "tls")],
    ]
    script = (
        "import contextlib, io, json, sys\nfrom geotrain.cli import main\n"
        "loaded = {}\n"
        f"for args in {commands!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n            main(args)\n        except SystemExit:\n            pass\n"
        f"    loaded[' '.join(args)] = [m for m in {_HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=geotrain_env(), cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert len(loaded) == len(commands)
    assert all(not heavy for heavy in loaded.values()), loaded


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_saved_model_records_its_config(tmp_path):
    import torch
    from safetensors.torch import load_file

    from geotrain.node.model import load_gpt

    path = tmp_path / "model.safetensors"
    result = run_cli(
        "train-local", "--steps", "1", "--set", "model.n_layers=1", "--set", "model.d_model=32",
        "--set", "model.n_heads=2", "--set", "run.eval_microbatches=1", "--save-final", str(path),
    )
    assert result.returncode == 0, result.stderr
    model = saved_model_config(path)
    assert dataclasses.asdict(model) == {**dataclasses.asdict(load_config().model), "n_layers": 1, "d_model": 32,
                                         "n_heads": 2}
    saved = load_file(str(path))
    loaded = load_gpt(str(path), model).state_dict()  # the config came from the file alone
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_node_exits_1_in_one_line_when_the_run_is_aborted(tmp_path):
    from geotrain.protocol.auth import new_token
    from geotrain.localnodes import LocalNodes
    from tests.conftest import wait_until

    token = new_token()
    cfg = load_config(None, ["scheduler.min_nodes=2"])  # the run waits for a second node that never comes
    process = CoordinatorProcess(cfg, token, "127.0.0.1:0")
    process.server.start()
    nodes = LocalNodes(f"127.0.0.1:{process.port}", token, tmp_path)
    try:
        node = nodes.start("node-1")
        wait_until(lambda: "node-1" in process.coordinator.members, 60, "node-1 to register")
        process.coordinator.shutdown_nodes("run aborted: stopped by its owner", aborted=True)
        assert node.wait(60) == EXIT_FAILED
    finally:
        nodes.stop_all()
        process.close()
    log = (tmp_path / "node-1.log").read_text()
    assert "geotrain: the coordinator ended the run: run aborted: stopped by its owner" in log
    assert "Traceback" not in log
