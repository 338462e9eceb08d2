"""The `geotrain` command: thin dispatch to the scheduler (coordinator, plan, demo), the node (join) and the
protocol (tls)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import signal
import sqlite3
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from geotrain import __version__
from geotrain.config import DATA_METADATA_KEY, MODEL_METADATA_KEY, ConfigError, RunConfig, load_config

if TYPE_CHECKING:
    from geotrain.node.saved import SavedModel
    from geotrain.protocol.tls import TlsFiles
    from geotrain.localnodes import LocalNodes

log = logging.getLogger("geotrain")

# Exit codes (README, "Exit codes"). A service manager restarts on any of them but 0.
EXIT_OK = 0
EXIT_FAILED = 1  # the run or the command failed: run aborted, token refused, coordinator unreachable or incompatible
EXIT_USAGE = 2  # refused before starting: a bad flag, config value, file or address
EXIT_INTERNAL = 70  # a bug in geotrain (sysexits' EX_SOFTWARE): the traceback is printed, to be reported
EXIT_INTERRUPTED = 130  # stopped by SIGINT or SIGTERM

EXAMPLES = {
    "coordinator": "geotrain coordinator --config run.toml --listen 0.0.0.0:7000 --token $TOKEN",
    "join": "geotrain join --coordinator coordinator.example.org:7000 --token $TOKEN",
    "demo": "geotrain demo --nodes 3 --steps 30",
    "train-local": "geotrain train-local --config run.toml --json",
    "plan": "geotrain plan --cluster deploy/clusters/four-regions-wan.yaml --set model.n_layers=24",
    "status": "geotrain status --coordinator coordinator.example.org:7000 --token $TOKEN --watch",
    "stop": "geotrain stop --coordinator coordinator.example.org:7000 --token $TOKEN --state-dir run-state",
    "tls": "geotrain tls init run-tls",
    "data": "geotrain data prepare --input 'corpus/**/*.txt' --tokenizer tok.json --out data/",
    "tokenizer": "geotrain tokenizer train --input 'corpus/**/*.txt' --vocab 8192 --out tok.json",
    "generate": 'geotrain generate --checkpoint model.safetensors --prompt "def main(" --max-new-tokens 200',
    "export": "geotrain export --checkpoint model.safetensors --out hf-model",
}


class UsageError(Exception):
    """A command-line problem: one line to stderr, exit code 2."""


class CommandFailed(Exception):
    """The command ran and failed for a reason outside geotrain (a peer, the network): one line, exit code 1."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse's own print the usage first, several lines)."""

    def error(self, message: str) -> NoReturn:  # noqa: D102
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _config(args: argparse.Namespace, **forced: Any) -> RunConfig:
    overrides = list(args.set or []) + [f"{k}={v}" for k, v in forced.items() if v is not None]
    return load_config(args.config, overrides)


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    """The run's TLS files named by --tls-dir, checked; None (plaintext) without it."""
    from geotrain.protocol.tls import TlsFiles

    if not args.tls_dir:
        return None
    try:
        return TlsFiles.load(args.tls_dir)
    except ValueError as e:  # load's way of naming a missing or mismatched file
        raise UsageError(str(e)) from None


def _token(args: argparse.Namespace) -> str:
    """The run token from --token or GEOTRAIN_TOKEN."""
    from geotrain.protocol.auth import resolve_token

    try:
        return resolve_token(args.token)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _listen(listen: str, flag: str) -> str:
    """A listen address checked (bindable, not taken) and its host resolved to an IP address, before anything
    starts."""
    from geotrain.protocol.transport import ListenError, check_listen

    try:
        return check_listen(listen)
    except ListenError as e:
        raise UsageError(f"{flag}: {e}") from None


def _fixed_ports(listen: str, ports: dict[str, int]) -> None:
    """Refuse the fixed ports other flags give beside a checked --listen address, on its host: one taken, or one
    that two flags share (each would take it from the other once they start). Port 0 picks a free one."""
    host, _, listen_port = listen.rpartition(":")
    claimed = {int(listen_port): "--listen"} if int(listen_port) else {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in claimed:
            raise UsageError(f"{flag} {port} is {claimed[port]}'s port too: give each its own")
        _listen(f"{host}:{port}", flag)
        claimed[port] = flag


def _resolvable(address: str, flag: str) -> None:
    """Refuse an address that is not HOST:PORT; fail when its host has no address (a typo, or no network)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag} takes HOST:PORT, got {address!r}")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise CommandFailed(f"{flag} {address}: cannot resolve {host}: {e.strerror}") from None


def _advertised_host(host: str) -> str:
    """The coordinator's --advertise: a host alone (its DHT's port is its own, chosen when it starts)."""
    import ipaddress

    if ":" in host:  # a port, unless the whole is an IPv6 address
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError(f"--advertise takes a HOST without a port, got {host!r}") from None
    return host


def _corpus_fingerprint(cfg: RunConfig) -> str:
    """Read the run's corpus (or prepared data set) and return its fingerprint; refuse one whose files are missing or
    whose splits are too short for a sample (training would fail at its first batch), and a prepared data set whose
    shards changed or whose tokenizer has more tokens than the model."""
    if cfg.data.prepared:
        from geotrain.dataset import DatasetError, PreparedDataset

        try:
            dataset = PreparedDataset.open(cfg.data.prepared, verify=True)
            if cfg.model.family == "byte-gpt" and dataset.vocab_size > cfg.model.vocab:
                # model.vocab_size is a llama key: advising it alone leads to the byte GPT refusing it.
                raise UsageError(
                    f"data.prepared: the tokenizer of {dataset.directory} has {dataset.vocab_size} tokens, and the "
                    f"byte GPT (the default model.family) reads bytes: set model.family = \"llama\" and "
                    f"model.vocab_size = {dataset.vocab_size}"
                )
            dataset.check_fits(vocab=cfg.model.vocab, seq_len=cfg.model.seq_len)
        except DatasetError as e:
            raise UsageError(f"data.prepared: {e}") from None
        return dataset.fingerprint
    from geotrain.node.data import Corpus

    try:
        corpus = Corpus.load(cfg.data)
    except ValueError as e:  # load's way of saying that data.paths match no files
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"data.paths: cannot read {e.filename}: {e.strerror}") from None
    shortest = min(len(corpus.train), len(corpus.val))
    if shortest <= cfg.model.seq_len + 1:
        raise UsageError(
            f"data: the corpus splits into {len(corpus.train)} training and {len(corpus.val)} validation bytes; "
            f"each needs more than model.seq_len + 1 ({cfg.model.seq_len + 1})"
        )
    return corpus.fingerprint


def _writable_file(path: str | None, flag: str) -> None:
    """Refuse an output file that could not be written, before a run spends hours to produce it."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create {parent}: {e.strerror}") from None
    if Path(path).is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: not a writable file path")


def _check_state_dir(cfg: RunConfig, state_dir: str | None, resume: bool) -> None:
    """Refuse a state dir that holds a run unless resuming, and a resume whose [model] differs from the saved
    run's (its checkpoints cannot load: the run would wait forever); record this run's [model] otherwise, and bring
    the checkpoints of an older geotrain up to date."""
    from geotrain.scheduler.state import STORE_FILE, RunStore

    if not state_dir:
        if resume:
            raise UsageError("--resume continues the run held in --state-dir: name that directory")
        return
    if resume and not (Path(state_dir) / STORE_FILE).is_file():
        raise UsageError(f"--resume: {state_dir} holds no run (no {STORE_FILE}): start one without --resume")
    try:
        store = RunStore(Path(state_dir) / STORE_FILE)
    except (OSError, sqlite3.Error) as e:
        raise UsageError(f"--state-dir {state_dir}: {e}") from None
    try:
        committed = store.committed_steps()
        if resume and not store.get("run_id"):
            raise UsageError(f"--resume: {state_dir} holds no run: start one without --resume")
        if committed and not resume:
            raise UsageError(f"{state_dir} holds a run at step {committed}: pass --resume to continue it")
        differing = store.adopt_model(dataclasses.asdict(cfg.model), check=resume)
    finally:
        store.close()
    if differing:
        raise UsageError(
            f"--resume: the run in {state_dir} was started with another [model]: "
            + ", ".join(f"model.{key} {saved} there, {ours} here" for key, saved, ours in differing)
        )
    if resume:
        from geotrain.upgrade import UpgradeError, upgrade_checkpoints

        try:
            upgrade_checkpoints(state_dir, cfg)
        except UpgradeError as e:
            raise UsageError(f"--resume: {e}") from None


def _out(as_json: bool):
    """Where progress goes: stdout, or stderr when stdout is reserved for the JSON line."""
    return sys.stderr if as_json else sys.stdout


def _install_signal_handlers(stop: Callable[[], None]) -> None:
    def handler(signum: int, _frame: Any) -> None:
        log.warning("%s received, shutting down", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


class ProgressPrinter:
    """Prints the coordinator's events as progress lines."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "join":
            self._line(f"{data['node_id']} joined from {data['address']} ({data['region'] or 'local'})")
        elif kind == "dead":
            self._line(f"{data['node_id']} is gone")
        elif kind == "plan":
            plan = data["plan"]
            self._line(f"plan epoch {plan.epoch}: {len(plan.stages)} stage(s)")
            for s in plan.stages:
                self._line(f"  stage {s.index}: layers {s.layer_start}-{s.layer_end - 1} on {', '.join(s.node_ids)}")
        elif kind == "step":
            r = data["record"]
            val = "" if r.val_loss is None else f"  val {r.val_loss:.4f} ({data['val_bits_per_byte']:.3f} bits/byte)"
            self._line(
                f"step {r.step + 1:>4}/{data['of']}  loss {r.loss:.4f}{val}  "
                f"{r.tokens_per_s:,.0f} tokens/s  {r.seconds:.2f}s"
            )

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def _model_metadata(cfg: RunConfig) -> dict[str, str]:
    """A saved model's header metadata: its [model] section, so it loads without the run config, and its [data]
    section, where generate and export find the run's tokenizer."""
    return {
        MODEL_METADATA_KEY: json.dumps(dataclasses.asdict(cfg.model)),
        DATA_METADATA_KEY: json.dumps(dataclasses.asdict(cfg.data)),
    }


def _save_final(path: str, state: dict[str, Any], cfg: RunConfig, out) -> None:
    """Write train-local's model as safetensors with _model_metadata."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata=_model_metadata(cfg))
    except OSError as e:
        raise CommandFailed(f"cannot write the final model to {path}: {e.strerror}") from None
    print(f"saved the final model to {path}", file=out, flush=True)


def _finish(summary: dict[str, Any], as_json: bool) -> None:
    out = _out(as_json)
    val = "" if summary["val_loss"] is None else (
        f", validation {summary['val_loss']:.4f} ({summary['val_bits_per_byte']:.3f} bits/byte)"
    )
    print(
        f"done: {summary['steps']} steps, loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}{val}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['wall_s']:.1f}s on {summary['nodes']} node(s) "
        f"in {summary['stages']} stage(s)",
        file=out,
        flush=True,
    )
    if as_json:
        print(json.dumps(summary), flush=True)


# -- commands -------------------------------------------------------------------------------------------------------


def _run_coordinator(
    cfg: RunConfig,
    token: str,
    listen: str,
    args: argparse.Namespace,
    preload: list[str],
    on_listening: Callable[[int, threading.Event], None] | None = None,
    stop_reason: Callable[[], str | None] = lambda: None,
    advertise: str = "",
    dht_port: int = 0,
    pause_on_stop: bool = False,
) -> int:
    """Serve a coordinator until its run ends; shared by `coordinator` and `demo` (preload: what the forkserver the
    DHT process is forked from imports, unless the command started it already; stop_reason: why the command set
    stop_requested itself, if it did; pause_on_stop: a signal pauses the run, leaving the nodes to wait for
    --resume, instead of ending it for them)."""
    out = _out(args.json)
    tls = _tls(args)
    listen = _listen(listen, "--listen")
    # Where the replicas' DHT will listen (service.dht_listen_maddr): every interface when advertised elsewhere.
    _fixed_ports(f"0.0.0.0:{listen.rpartition(':')[2]}" if advertise else listen, {"--dht-port": dht_port})
    http_listen = _listen(args.http, "--http") if args.http != "off" else None
    _writable_file(args.save_final, "--save-final")
    _check_state_dir(cfg, args.state_dir, args.resume)
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the tensorboard package: pip install 'geotrain[tensorboard]'")
    # Imported once the arguments are known good: torch takes seconds to load, a mistyped flag should not.
    import grpc

    from geotrain.lifetime import start_forkserver
    from geotrain.scheduler.coordinator import RunAborted
    from geotrain.scheduler.http import StatusPageProcess
    from geotrain.scheduler.service import CoordinatorProcess

    start_forkserver(preload)
    # The coordinator reads the corpus once to pin its fingerprint: every node must train on the same bytes.
    cfg.data.fingerprint = _corpus_fingerprint(cfg)
    process = CoordinatorProcess(
        cfg, token, listen, state_dir=args.state_dir, resume=args.resume, on_event=ProgressPrinter(out), tls=tls,
        advertise=advertise, dht_port=dht_port, tensorboard=args.tensorboard or "",
    )
    coordinator = process.coordinator
    http = StatusPageProcess(coordinator.status, http_listen, args.http_token) if http_listen is not None else None
    _install_signal_handlers(coordinator.stop_requested.set)
    print(f"coordinator listening on {listen.rsplit(':', 1)[0]}:{process.port}", file=out, flush=True)
    try:
        if on_listening is not None:
            on_listening(process.port, coordinator.stop_requested)
        process.server.start()
        if http is not None:
            try:
                http_port = http.start()
            except OSError as e:
                raise UsageError(f"--http: cannot listen on {args.http}: {e.strerror}") from None
            print(f"status page at http://{args.http.rsplit(':', 1)[0]}:{http_port}/", file=out, flush=True)
        try:
            summary = coordinator.run()
        except RunAborted as e:
            why = stop_reason()
            if coordinator.ended_by_owner is not None:
                ended = f"the run owner ended the run: {coordinator.ended_by_owner}"
                print(f"geotrain: {ended}", file=sys.stderr, flush=True)
                coordinator.shutdown_nodes(ended)  # not a failure of the nodes: they exit 0
                return EXIT_INTERRUPTED
            if pause_on_stop and why is None and coordinator.stop_requested.is_set():
                # The nodes keep their state and wait for this coordinator to come back (link.py).
                print(
                    f"geotrain: coordinator stopped; the run is paused, its nodes wait for `geotrain coordinator "
                    f"--resume --state-dir {args.state_dir}` (`geotrain stop` ends the run for them)",
                    file=sys.stderr, flush=True,
                )
                return EXIT_INTERRUPTED
            print(f"geotrain: {why or f'run aborted: {e}'}", file=sys.stderr, flush=True)
            coordinator.shutdown_nodes(f"run aborted: {why or e}", aborted=True)
            return EXIT_INTERRUPTED if coordinator.stop_requested.is_set() and why is None else EXIT_FAILED
        if args.save_final:
            final = Path(args.save_final)
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                coordinator.save_model(final, summary.steps, _model_metadata(cfg))
            except (LookupError, grpc.RpcError, OSError) as e:
                why = e.strerror if isinstance(e, OSError) and e.strerror else e
                print(f"geotrain: cannot save the final model: {why}", file=sys.stderr, flush=True)
                coordinator.shutdown_nodes("run complete")
                return EXIT_FAILED
            print(f"saved the final model to {final}", file=out, flush=True)
        coordinator.shutdown_nodes("run complete")
        _finish(summary.as_dict(), args.json)
        return EXIT_OK
    finally:
        if http is not None:
            if http.serving:
                # Keep the page up a while after the run ends so a watcher sees how it ended; Ctrl+C cuts it short.
                coordinator.stop_requested.wait(args.http_linger)
            http.stop()
        process.close()


def cmd_coordinator(args: argparse.Namespace) -> int:
    """geotrain coordinator."""
    cfg = _config(args, **{"scheduler.min_nodes": args.min_nodes})
    # Its forkserver imports nothing: this command forks no node, and the DHT process (once a plan has replicas) and
    # the status page's process import what they need.
    # Without a state dir nothing can resume the run: a stop ends it for every node.
    return _run_coordinator(
        cfg, _token(args), args.listen, args, [], advertise=_advertised_host(args.advertise), dht_port=args.dht_port,
        pause_on_stop=bool(args.state_dir),
    )


def cmd_stop(args: argparse.Namespace) -> int:
    """geotrain stop."""
    from geotrain.protocol.identity import KEY_FILE

    token, tls = _token(args), _tls(args)
    _resolvable(args.coordinator, "--coordinator")
    if not (Path(args.state_dir) / KEY_FILE).is_file():
        raise UsageError(f"--state-dir {args.state_dir} holds no coordinator key ({KEY_FILE}): name the directory "
                         "the coordinator was started with")
    import grpc

    from geotrain.protocol.identity import IdentityError, NodeKey
    from geotrain.scheduler.service import stop_run

    try:
        key = NodeKey.load_or_create(args.state_dir)[0]
    except IdentityError as e:
        raise UsageError(f"--state-dir: {e}") from None
    try:
        stop_run(args.coordinator, token, key, args.reason, tls)
    except grpc.RpcError as e:
        raise CommandFailed(f"the coordinator at {args.coordinator} did not stop the run: {e.code().name}: {e.details()}") from None
    print(f"the coordinator at {args.coordinator} ends the run", flush=True)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """geotrain status."""
    from geotrain.scheduler.status_cli import run_status

    _resolvable(args.coordinator, "--coordinator")
    return run_status(args.coordinator, _token(args), as_json=args.json, watch=args.watch, tls=_tls(args))


def cmd_join(args: argparse.Namespace) -> int:
    """geotrain join."""
    token, tls = _token(args), _tls(args)
    _resolvable(args.coordinator, "--coordinator")
    listen = _listen(args.listen, "--listen")
    _fixed_ports(listen, {"--tensor-port": args.tensor_port, "--dht-port": args.dht_port})
    # Imported once the arguments are known good: torch takes seconds to load, a mistyped flag should not.
    from geotrain.node.agent import Agent, NodeError, NodeOptions
    from geotrain.node.progress import ProgressReporter
    from geotrain.protocol.identity import IdentityError

    options = NodeOptions(
        coordinator=args.coordinator,
        token=token,
        listen=listen,
        tensor_port=args.tensor_port,
        dht_port=args.dht_port,
        advertise=args.advertise,
        node_id=args.node_id,
        region=args.region,
        slowdown=args.slowdown,
        bandwidth_mbps=args.bandwidth_mbps,
        latency_ms=args.latency_ms,
        tls=tls,
        give_up_after_s=args.give_up_after,
        device=args.device,
        state_dir=args.state_dir,
        max_memory_bytes=args.max_memory,
    )
    torch_threads()  # torch may have been imported before this process had OMP_NUM_THREADS (a local node is forked)
    _announce_device(args.device, args.max_memory)
    try:
        agent = Agent(options)
    except IdentityError as e:
        raise UsageError(f"--state-dir: {e}") from None
    agent.on_reachability = lambda line: print(line, flush=True)
    interrupted = threading.Event()
    _install_signal_handlers(lambda: (interrupted.set(), agent.stop()))
    progress = ProgressReporter(agent, sys.stderr)
    progress.start()
    try:
        agent.run()
    except NodeError as e:
        print(f"geotrain: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        progress.stop()
    return EXIT_INTERRUPTED if interrupted.is_set() else EXIT_OK


def _device(spec: str):
    """The torch device --device names; UsageError (exit 2) when this machine has none such."""
    from geotrain.node.device import DeviceError, resolve_device

    try:
        return resolve_device(spec)
    except DeviceError as e:
        raise UsageError(str(e)) from None


def _announce_device(spec: str, max_memory: int = 0) -> None:
    """Print the device a node will compute on, its usable memory and a measured speed, before it registers (on
    stdout: stderr is for what went wrong, one line of it)."""
    from geotrain.node.device import describe, matmul_flops
    from geotrain.node.profiler import available_memory_bytes, host_turn

    device = _device(spec)
    with host_turn():  # nodes starting together on one machine time it in turn, as they time their layers
        flops = matmul_flops(device)
    print(
        f"device {describe(device)}: {available_memory_bytes(device, cap_bytes=max_memory) / 2**30:.1f} GiB usable, "
        f"{flops / 1e12:.2f} TFLOP/s fp32 matmul",
        flush=True,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """geotrain demo."""
    from geotrain.protocol.auth import TOKEN_ENV, new_token
    from geotrain.lifetime import NODE_PRELOAD, start_forkserver
    from geotrain.localnodes import Chaos, LocalNodes

    if args.nodes < 1:
        raise UsageError(f"--nodes must be at least 1, got {args.nodes}")
    stages = args.nodes if args.stages is None else args.stages
    if stages > args.nodes:
        raise UsageError(f"--stages {stages} needs at least {stages} nodes, --nodes is {args.nodes}")
    forced: dict[str, Any] = {"run.steps": args.steps, "scheduler.min_nodes": args.nodes, "scheduler.stages": stages}
    if 0 < stages < args.nodes and not any(s.startswith("scheduler.placement=") for s in args.set or []):
        # Fewer stages than nodes asks for replicas: every node serves, layers split evenly, unless told otherwise.
        forced["scheduler.placement"] = "uniform"
    cfg = _config(args, **forced)
    if cfg.scheduler.stages > cfg.model.total_layers:
        raise UsageError(f"--stages {cfg.scheduler.stages} exceeds the model's {cfg.model.total_layers} layers")
    try:
        chaos = Chaos.parse(args.chaos) if args.chaos else None
    except ValueError as e:  # parse's way of naming what is wrong
        raise UsageError(str(e)) from None
    _device(args.device)  # a device this machine lacks: one line now, not from each node later
    torch_threads()
    start_forkserver()
    token = os.environ.get(TOKEN_ENV) or new_token()
    work_dir = Path(tempfile.mkdtemp(prefix="geotrain-demo-"))
    if not args.state_dir:
        args.state_dir = str(work_dir / "state")  # checkpoints let a stage that lost every node come back
    nodes: LocalNodes | None = None
    failed: list[str] = []  # why the demo stopped its own coordinator

    def launch(port: int, stop: threading.Event) -> None:
        nonlocal nodes
        # The nodes' keys live with the run's state, so that `demo --resume` brings the same nodes back.
        nodes = LocalNodes(
            f"127.0.0.1:{port}", token, work_dir, _per_node_flags(args), Path(args.state_dir) / "nodes"
        )
        for i in range(args.nodes):
            nodes.start(f"node-{i + 1}")
        print(f"started {args.nodes} local nodes (logs and state in {work_dir})", file=_out(args.json), flush=True)
        if chaos is not None:
            chaos.start(nodes, _out(args.json))
        threading.Thread(target=_watch_nodes, args=(nodes, stop, failed), name="node-watch", daemon=True).start()

    try:
        return _run_coordinator(
            cfg, token, "127.0.0.1:0", args, NODE_PRELOAD, on_listening=launch,
            stop_reason=lambda: failed[0] if failed else None,
        )
    finally:
        if chaos is not None:
            chaos.stop()
        if nodes is not None:
            nodes.stop_all()


def _watch_nodes(nodes: LocalNodes, stop: threading.Event, failed: list[str]) -> None:
    """Stop the demo's coordinator (appending why to `failed`) once every local node has exited with an error: it
    would otherwise wait for them forever. Nodes the chaos monkey SIGKILLed do not count: they come back."""
    while not stop.wait(0.5):
        procs = dict(nodes.procs)
        if procs and all(p.poll() is not None and p.returncode > 0 for p in procs.values()):
            node_id = sorted(procs)[0]
            log_file = nodes.log_dir / f"{node_id}.log"
            lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
            failed.append(
                f"every local node exited with an error; {node_id}'s last words ({log_file}): "
                + (lines[-1] if lines else "none")
            )
            stop.set()
            return


def _per_node_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """`join` flags of each local node from --regions and --slowdowns, given to the nodes in turn: regions let
    [emulation] links shape the hops between local nodes, slowdowns make them as unequal as real machines; and
    --uplink and --tls-dir, given to every node: one emulated uplink that all of a node's traffic shares, as a home
    or VM link, and the run's TLS files."""
    flags: dict[str, list[str]] = {f"node-{i + 1}": [] for i in range(args.nodes)}
    for option, values in (("--region", args.regions), ("--slowdown", args.slowdowns)):
        listed = [v for v in (values or "").split(",") if v]
        for i, node_id in enumerate(flags):
            if listed:
                flags[node_id] += [option, listed[i % len(listed)]]
    if args.uplink:
        mbps, _, ms = args.uplink.partition("/")
        for node_flags in flags.values():
            node_flags += ["--bandwidth-mbps", mbps, "--latency-ms", ms or "0"]
    if args.tls_dir:
        for node_flags in flags.values():
            node_flags += ["--tls-dir", args.tls_dir]
    for node_flags in flags.values():
        node_flags += ["--device", args.device]
    return flags


def _is_number(text: str, at_least: float, above: bool = False) -> bool:
    """Whether text is a finite number >= at_least (> at_least with `above`)."""
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and (value > at_least if above else value >= at_least)


def _number(at_least: float, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= at_least (> at_least with `above`)."""

    def parse(text: str) -> float:
        if not _is_number(text, at_least, above):
            raise argparse.ArgumentTypeError(f"expected a number {'>' if above else '>='} {at_least:g}, got {text!r}")
        return float(text)

    return parse


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30,
               "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """An argparse type: bytes from a size such as 12GiB, 800MiB, 16GB or 12G (K, M, G, T alone are binary, as
    systemd and docker read them); more than 0."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS or not (size := int(float(match.group(1)) * _SIZE_UNITS[unit])):
        raise argparse.ArgumentTypeError(f"expected a size such as 12GiB, 800MiB or 16GB, got {text!r}")
    return size


def _count(at_least: int, at_most: int) -> Callable[[str], int]:
    """An argparse type: an integer in [at_least, at_most]."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or not at_least <= value <= at_most:
            raise argparse.ArgumentTypeError(f"expected an integer from {at_least} to {at_most}, got {text!r}")
        return value

    return parse


def _slowdowns(value: str) -> str:
    """Check a --slowdowns value: comma-separated factors, each at least 1."""
    if not all(_is_number(v, 1.0) for v in value.split(",") if v) or not value.strip(","):
        raise argparse.ArgumentTypeError(f"expected factors >= 1 separated by commas, e.g. 1,3, got {value!r}")
    return value


def _uplink(value: str) -> str:
    """Check an --uplink value: Mbit/s, optionally /one-way ms, both positive numbers (the latency may be 0)."""
    mbps, _, ms = value.partition("/")
    if not (_is_number(mbps, 0.0, above=True) and (not ms or _is_number(ms, 0.0))):
        raise argparse.ArgumentTypeError(f"--uplink takes MBPS or MBPS/MS, e.g. 20/50, got {value!r}")
    return value


def torch_threads() -> None:
    """Let OMP_NUM_THREADS cap torch: processes sharing a small machine otherwise oversubscribe it."""
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def cmd_train_local(args: argparse.Namespace) -> int:
    """geotrain train-local."""
    cfg = _config(args, **{"run.steps": args.steps})
    _writable_file(args.save_final, "--save-final")
    from geotrain.node.local import train_local  # torch: only once the arguments are known good

    _corpus_fingerprint(cfg)  # train_local reads it again (a second or so), but cannot say what is wrong with it
    import torch

    # The nodes' thread count, not every core's: torch sums some gradients in per-thread chunks, so only the same
    # count computes the same bits.
    torch.set_num_threads(args.threads)
    out = _out(args.json)

    def progress(r: dict[str, Any]) -> None:
        val = f"  val {r['val_loss']:.4f} ({r['val_bits_per_byte']:.3f} bits/byte)" if "val_loss" in r else ""
        print(f"step {r['step'] + 1:>4}/{cfg.run.steps}  loss {r['loss']:.4f}{val}  {r['seconds']:.2f}s", file=out,
              flush=True)

    runtime, summary = train_local(cfg, progress, _device(args.device))
    if args.save_final:
        _save_final(args.save_final, {name: p.detach() for name, p in runtime.named_state()}, cfg, out)
    _finish(summary, args.json)
    return EXIT_OK


def _stop_on_sigterm() -> None:
    """SIGTERM ends the command as Ctrl+C does, so its cleanup runs (a half-written output is removed)."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """geotrain data prepare."""
    from geotrain.dataset import DatasetError
    from geotrain.prepare import prepare

    _stop_on_sigterm()
    try:
        result = prepare(
            args.input, args.tokenizer, args.out, text_field=args.text_field, val_fraction=args.val_fraction
        )
    except DatasetError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror}") from None
    print(
        f"prepared {result.documents} documents into {result.directory}: {result.train_tokens} training and "
        f"{result.val_tokens} validation tokens (fingerprint {result.fingerprint[:12]}); "
        f"train on it with --set data.prepared={result.directory}",
        flush=True,
    )
    return EXIT_OK


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    """geotrain tokenizer train."""
    from geotrain.dataset import DatasetError
    from geotrain.prepare import train_tokenizer

    if not 257 <= args.vocab <= 1 << 24:
        raise UsageError(
            f"--vocab must be in [257, {1 << 24}] (the 256 bytes and a separator at least), got {args.vocab}"
        )
    _stop_on_sigterm()
    try:
        vocab = train_tokenizer(args.input, args.vocab, args.out, args.text_field)
    except DatasetError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror}") from None
    print(f"trained a BPE tokenizer of {vocab} tokens into {args.out}", flush=True)
    return EXIT_OK


def _saved_model(path: str) -> SavedModel:
    """The model --checkpoint names: a --save-final file, or the latest complete checkpoint of a coordinator's
    --state-dir with the [model] section its run store recorded."""
    from geotrain.scheduler.state import STORE_FILE, recorded_model

    source = Path(path)
    if not source.exists():
        raise UsageError(f"--checkpoint {path}: no such file or directory")
    if source.is_dir() and not (source / STORE_FILE).is_file():
        raise UsageError(f"--checkpoint {path}: a directory without {STORE_FILE}, so not a coordinator's --state-dir")
    # torch (seconds of CPU) only once --checkpoint names something that may hold a model.
    from safetensors import SafetensorError

    from geotrain.node.saved import SavedModel, read_saved_file
    from geotrain.scheduler.checkpoint import CHECKPOINTS_DIR, CheckpointStore

    if not source.is_dir():
        return read_saved_file(path)
    try:
        model = recorded_model(source / STORE_FILE)
    except (sqlite3.Error, ValueError) as e:
        raise UsageError(f"--checkpoint {path}: cannot read its {STORE_FILE}: {e}") from None
    if model is None:
        raise UsageError(f"--checkpoint {path}: its {STORE_FILE} records no [model] section")
    if not (source / CHECKPOINTS_DIR).is_dir():
        raise UsageError(f"--checkpoint {path}: the state dir holds no checkpoint")
    store = CheckpointStore(source / CHECKPOINTS_DIR, keep=1)  # keep matters to writing only
    try:
        manifest = store.latest()
        if manifest is None:
            raise UsageError(f"--checkpoint {path}: the state dir holds no complete checkpoint")
        state = store.load_layers(manifest, 0, max(entry["layer_end"] for entry in manifest.stages))
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--checkpoint {path}: its latest checkpoint is truncated or unreadable ({e})") from None
    parameters = {name: t for name, t in state.items() if name.startswith("layers.")}  # not the optimizer's state
    return SavedModel.checked(model, parameters, {}, f"--checkpoint {manifest.path}")


def cmd_generate(args: argparse.Namespace) -> int:
    """geotrain generate."""
    if not args.prompt:
        raise UsageError("--prompt must not be empty: the model continues a text")
    saved = _saved_model(args.checkpoint)
    from geotrain.node.generate import generate
    from geotrain.node.tokenizer import choose_tokenizer

    tokenizer = choose_tokenizer(args.tokenizer, saved.data, saved.model.vocab)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise UsageError(f"--prompt {args.prompt!r} encodes to no token with {tokenizer.name}")
    torch_threads()
    ids = generate(
        saved.build(), prompt, max_new_tokens=args.max_new_tokens, seq_len=saved.model.seq_len,
        vocab=tokenizer.vocab_size, temperature=args.temperature, seed=args.seed,
    )
    print(args.prompt + tokenizer.decode(ids), flush=True)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """geotrain export."""
    from geotrain.node.export import check_out, export
    from geotrain.node.tokenizer import choose_tokenizer

    out = Path(args.out)
    check_out(out)  # before reading the model, which may take a while
    _stop_on_sigterm()
    saved = _saved_model(args.checkpoint)
    tokenizer = choose_tokenizer(args.tokenizer, saved.data, saved.model.vocab)
    try:
        files = export(saved, tokenizer, out)
    except OSError as e:
        raise CommandFailed(f"cannot write {out}: {e.strerror or e}") from None
    print(f"exported the {saved.model.family} model to {out} ({', '.join(files)}); tokenizer: {tokenizer.name}")
    return EXIT_OK


def cmd_tls_init(args: argparse.Namespace) -> int:
    """geotrain tls init."""
    from geotrain.protocol.tls import KEY_FILE, init_run_tls

    try:
        init_run_tls(args.dir)
    except ValueError as e:  # init_run_tls's way of refusing to overwrite a run's files
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write TLS files to {args.dir}: {e.strerror}") from None
    print(
        f"wrote a new run CA, certificate and key to {args.dir}: give the directory to the coordinator and every "
        f"node (--tls-dir); {KEY_FILE} is as secret as the run token",
        flush=True,
    )
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """geotrain plan."""
    from geotrain.scheduler.plan_cli import run_plan

    cfg = _config(args)
    m = cfg.model
    model = {
        "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "seq_len": m.seq_len, "vocab": m.vocab,
        "boundary_rank": m.boundary_rank,
    }
    return run_plan(
        args.cluster, model, cfg.train.microbatches, cfg.train.microbatch_size, as_json=args.json,
        stages=cfg.scheduler.stages or None, inflight=cfg.train.inflight or "auto", allreduce=cfg.scheduler.allreduce,
        replica_rank=cfg.compression.replica_rank, compute_bytes=4 if cfg.train.precision == "fp32" else 2,
        recompute=cfg.train.recompute,
        replica_sync_every=cfg.compression.replica_sync_every if cfg.compression.diloco else 1,
        diloco=cfg.compression.diloco,
    )


# -- parser ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = _Parser(
        prog="geotrain",
        description="Train one model across heterogeneous computers joined over the internet.",
        epilog="Quick start: geotrain demo",
    )
    parser.add_argument("--version", action="version", version=f"geotrain {__version__}")
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="default: warning for demo, info otherwise"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    common = _Parser(add_help=False)
    common.add_argument("--config", help="run config TOML file (defaults otherwise)")
    common.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")

    def add(name: str, summary: str, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            parents=parents,
            help=summary,
            description=summary,
            epilog=f"example:\n  {EXAMPLES[name]}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    def run_outputs(p: argparse.ArgumentParser) -> None:
        p.add_argument("--save-final", metavar="PATH", help="write the trained model as a safetensors file")
        p.add_argument("--json", action="store_true", help="end stdout with one JSON line of run figures")

    def tls_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--tls-dir", metavar="DIR", help="the run's TLS files from `geotrain tls init DIR` (default: plaintext)"
        )

    def metrics_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--tensorboard", metavar="DIR",
            help="write TensorBoard event files here: losses, tokens/s, step time, each node's forward, backward, "
            "averaging and idle share, bytes on each link, failures (needs pip install 'geotrain[tensorboard]'); the "
            "same figures go to metrics.jsonl in --state-dir always",
        )

    def http_options(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument(
            "--http",
            default=default,
            metavar="HOST:PORT",
            help=f"serve the status page, /api/status and /metrics (port 0: any free; off: none; default {default})",
        )
        p.add_argument(
            "--http-linger",
            type=_number(0.0),
            default=0.0,
            metavar="SECONDS",
            help="keep the status page up this long after the run ends (default 0)",
        )
        p.add_argument(
            "--http-token",
            metavar="TOKEN",
            help="serve the page and its data only with ?token=TOKEN or an 'Authorization: Bearer TOKEN' header "
            "(default: anyone who can reach --http)",
        )

    p = add("coordinator", "Run the coordinator that admits nodes and drives training.", [common])
    p.add_argument("--listen", default="0.0.0.0:7000", help="host:port to serve on (default 0.0.0.0:7000)")
    p.add_argument("--token", help="run token (or set GEOTRAIN_TOKEN)")
    p.add_argument("--advertise", default="", metavar="HOST",
                   help="address or name nodes reach this machine at, if not the listen host (behind a relay or NAT); "
                   "the replicas' DHT listens on every interface and is announced there")
    p.add_argument("--dht-port", type=_count(0, 65535), default=0,
                   help="TCP port of the hivemind DHT that stage replicas find each other through (default any free "
                   "port, chosen when a plan first has replicas): open it to the nodes as you open --listen's")
    p.add_argument("--min-nodes", type=int, help="same as --set scheduler.min_nodes=N")
    p.add_argument("--state-dir", help="directory for run state (SQLite) and checkpoints")
    p.add_argument("--resume", action="store_true", help="continue the run held in --state-dir")
    tls_option(p)
    http_options(p, "off")
    metrics_option(p)
    run_outputs(p)
    p.set_defaults(func=cmd_coordinator)

    p = add("stop", "End a run for every node (stopping the coordinator's process only pauses it).", [])
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--token", help="run token (or set GEOTRAIN_TOKEN)")
    p.add_argument(
        "--state-dir", required=True,
        help="the coordinator's --state-dir (or a copy of its node.key): only a call signed with the coordinator's "
        "own key ends the run, since every volunteer holds the token",
    )
    p.add_argument("--reason", default="the run owner stopped the run", help="what every node is told")
    tls_option(p)
    p.set_defaults(func=cmd_stop)

    p = add("join", "Join a run as a node: serve a pipeline stage for the coordinator.", [])
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--token", help="run token (or set GEOTRAIN_TOKEN)")
    p.add_argument("--listen", default="0.0.0.0:0", help="host:port for peers to reach this node (default any port)")
    p.add_argument("--advertise", default="", help="host:port peers should dial, if not the listen address")
    p.add_argument("--tensor-port", type=_count(0, 65535), default=0,
                   help="port of the raw tensor stream on the listen host and the advertised one (default any free "
                   "port), opened when the run says transport.tensor_stream = \"tcp\" (its default); neighbours that "
                   "cannot reach it send by gRPC calls")
    p.add_argument("--dht-port", type=_count(0, 65535), default=0,
                   help="TCP port of this node's hivemind DHT, through which it averages with its stage's other "
                   "replicas (default any free port); with --advertise, it listens on every interface and announces "
                   "the advertised host with this port")
    p.add_argument("--node-id", default="", help="stable identity (default: assigned by the coordinator)")
    p.add_argument(
        "--state-dir", default="",
        help="directory for this node's key (node.key, created on first join): the id belongs to the key, so a node "
        "restarted with the same directory keeps its id (default: a key in memory, a new identity on restart)",
    )
    p.add_argument("--region", default="", help="region label used by the planner")
    p.add_argument(
        "--slowdown", type=_number(1.0), default=1.0, help="emulate a slower machine: compute takes F times as long"
    )
    p.add_argument("--bandwidth-mbps", type=_number(0.0), default=0.0, help="emulate this egress bandwidth to every peer")
    p.add_argument("--latency-ms", type=_number(0.0), default=0.0, help="emulate this one-way latency to every peer")
    p.add_argument(
        "--give-up-after", type=_number(0.0, above=True), default=1800.0, metavar="SECONDS",
        help="exit (code 1) when the coordinator has been unreachable this long (default 1800: 30 min); until then "
        "a stopped coordinator pauses the run, and this node keeps its state and rejoins it once resumed",
    )
    p.add_argument(
        "--device", default="auto",
        help="where the stage computes: auto (CUDA, then MPS, then the CPU), cpu, cuda, cuda:N or mps (default auto); "
        "one node per GPU: start one join per device with --device cuda:N",
    )
    p.add_argument(
        "--max-memory", type=parse_size, default=0, metavar="SIZE",
        help="the most memory this node may hold in all, e.g. 12GiB (on its GPU, or on the host for the CPU), beside "
        "free memory and a cgroup limit, which the node reads itself; the planner gives it no stage beyond that",
    )
    tls_option(p)
    p.set_defaults(func=cmd_join)

    p = add("demo", "Train the default model on this machine: a coordinator and local node processes.", [common])
    p.add_argument("--nodes", type=int, default=3, help="local node processes (default 3)")
    p.add_argument(
        "--stages", type=int,
        help="pipeline stages (default: one per node, layers placed by measured speed; fewer: every node serves and "
        "stages get replicas; 0: the planner chooses everything)",
    )
    p.add_argument("--steps", type=int, help="same as --set run.steps=N")
    p.add_argument(
        "--state-dir", help="directory for run state, checkpoints and the nodes' keys (default: a temporary one)"
    )
    p.add_argument("--resume", action="store_true", help="continue the run held in --state-dir")
    p.add_argument(
        "--regions", metavar="eu,us", help="give the local nodes these regions in turn (for emulation.links)"
    )
    p.add_argument(
        "--slowdowns", metavar="1,3", type=_slowdowns, help="give the local nodes these --slowdown factors in turn (unequal machines)"
    )
    p.add_argument(
        "--uplink", metavar="MBPS[/MS]", type=_uplink,
        help="give every local node an emulated uplink of this bandwidth (and one-way latency) for all its traffic",
    )
    p.add_argument(
        "--chaos", metavar="kill-every=20s[,down=5s][,seed=N]",
        help="SIGKILL a random node now and then and restart it after a delay, to watch fault tolerance",
    )
    p.add_argument(
        "--device", default="cpu",
        help="where every local node computes: cpu (default: the exactness reference), auto, cuda, cuda:N or mps",
    )
    tls_option(p)
    http_options(p, "127.0.0.1:0")
    metrics_option(p)
    run_outputs(p)
    p.set_defaults(func=cmd_demo)

    p = add("train-local", "Train the same run in one process: the reference the pipeline must match.", [common])
    p.add_argument("--steps", type=int, help="same as --set run.steps=N")
    p.add_argument(
        "--threads", type=_count(1, 4096), default=1, metavar="N",
        help="compute threads (default 1, as the demo's local nodes compute): torch sums some gradients in "
        "per-thread chunks, so the pipeline equals train-local to the bit only at its nodes' thread count "
        "(a `geotrain join` uses OMP_NUM_THREADS, else every core)",
    )
    p.add_argument(
        "--device", default="cpu", help="auto, cpu, cuda, cuda:N or mps (default cpu: the exactness reference)"
    )
    run_outputs(p)
    p.set_defaults(func=cmd_train_local)

    p = add("plan", "Plan stages for a described cluster and print the estimated step time.", [common])
    p.add_argument("--cluster", required=True, help="cluster YAML: nodes, regions, links")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)

    p = add("status", "Show a running coordinator's nodes, plan, progress and events.", [])
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--token", help="run token (or set GEOTRAIN_TOKEN)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the same as the page's /api/status)")
    p.add_argument("--watch", action="store_true", help="refresh in place every second until Ctrl+C")
    tls_option(p)
    p.set_defaults(func=cmd_status)

    def checkpoint_options(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--checkpoint", required=True, metavar="PATH",
            help="a model written by --save-final, or a coordinator's --state-dir (its latest complete checkpoint)",
        )
        p.add_argument(
            "--tokenizer", metavar="TOKENIZER_JSON",
            help="a tokenizer.json (default: the run's data.prepared tokenizer if the saved model records one, "
            "else bytes: ids 0..255 are UTF-8 bytes)",
        )

    p = add("generate", "Continue a prompt with a trained model, on this machine's CPU.", [])
    checkpoint_options(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument(
        "--max-new-tokens", type=_count(1, 1 << 20), default=200, metavar="N",
        help="tokens to add (default 200); the model sees the last model.seq_len tokens, sliding along",
    )
    p.add_argument(
        "--temperature", type=_number(0.0), default=0.8, metavar="T",
        help="sample from softmax(logits / T) (default 0.8); 0: always the likeliest token",
    )
    p.add_argument("--seed", type=_count(0, 2**63 - 1), default=0, help="seed of the sampling (default 0)")
    p.set_defaults(func=cmd_generate)

    p = add(
        "export",
        "Write a trained model as a Hugging Face directory that transformers' AutoModelForCausalLM loads.",
        [],
    )
    checkpoint_options(p)
    p.add_argument(
        "--out", required=True, metavar="DIR",
        help="the directory to create (absent, or empty): config.json, model.safetensors (llama as LlamaForCausalLM, "
        "byte-gpt as GPT2LMHeadModel), tokenizer.json (the byte tokenizer as byte-level BPE) and tokenizer_config.json",
    )
    p.set_defaults(func=cmd_export)

    p = add("tls", "Make a run's TLS files: a run CA, and the certificate and key every participant shares.", [])
    actions = p.add_subparsers(dest="tls_command", required=True, metavar="ACTION")
    summary = "Write a new run CA, and the run's certificate and key, as ca.pem, cert.pem and key.pem."
    init = actions.add_parser("init", help=summary, description=summary)
    init.add_argument("dir", metavar="DIR", help="where to write them (created if missing; never overwritten)")
    init.set_defaults(func=cmd_tls_init)

    def text_inputs(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--input", action="append", required=True, metavar="GLOB",
            help="text files: .txt (one document a file), .jsonl (one a line), .parquet (one a row); repeatable",
        )
        p.add_argument(
            "--text-field", default="text", metavar="NAME", help="the .jsonl field or .parquet column of the text"
        )

    p = add("data", "Prepare a data set once on the coordinator's host: tokens in memory-mapped shards.", [])
    actions = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    summary = "Tokenize text files into DIR (manifest.json, token shards, tokenizer.json) for data.prepared."
    prep = actions.add_parser("prepare", help=summary, description=summary)
    text_inputs(prep)
    prep.add_argument("--tokenizer", required=True, metavar="FILE", help="a tokenizer.json (any Hugging Face one)")
    prep.add_argument("--out", required=True, metavar="DIR", help="where to write it (must not exist, or be empty)")
    prep.add_argument(
        "--val-fraction", type=float, default=0.05, metavar="F",
        help="tokens held out for validation, whole documents from the end (default 0.05)",
    )
    prep.set_defaults(func=cmd_data_prepare)

    p = add("tokenizer", "Train a tokenizer for data prepare, for those without one.", [])
    actions = p.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    summary = "Train a byte-level BPE tokenizer (Hugging Face tokenizers) on text files and write it as JSON."
    train = actions.add_parser("train", help=summary, description=summary)
    text_inputs(train)
    train.add_argument("--vocab", type=int, default=8192, help="vocabulary size at most (default 8192)")
    train.add_argument("--out", required=True, metavar="FILE", help="the tokenizer.json to write")
    train.set_defaults(func=cmd_tokenizer_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `geotrain` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, (args.log_level or ("warning" if args.command == "demo" else "info")).upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.log_level != "debug":
        # gRPC's C core logs its own lines (bind and TLS handshake failures) beside the one-line errors said here.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        return args.func(args)
    except (ConfigError, UsageError) as e:
        print(f"geotrain: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except CommandFailed as e:
        print(f"geotrain: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("geotrain: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception:
        traceback.print_exc()
        print(
            f"geotrain: internal error (exit code {EXIT_INTERNAL}): a bug in geotrain {__version__}; please report it "
            "with the traceback above",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERNAL


def run() -> NoReturn:
    """The `geotrain` console script: main(), then exit without unloading modules. Every command has closed what it
    opened by now, and unloading torch and hivemind (their threads, a DHT's leftovers) takes seconds at every exit."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
