"""`geotrain coordinator`, `geotrain stop` and `geotrain status`: each one's parser beside it, and the checks of a
coordinator's flags before its run starts (scheduler.runstart serves it)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sqlite3
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geotrain.commands.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    CommandFailed,
    Subcommands,
    UsageError,
    add_coordinator_address,
    add_http_options,
    add_metrics_option,
    add_run_outputs,
    add_tls_option,
    check_fixed_ports,
    check_resolvable,
    check_writable_file,
    checked_listen,
    install_signal_handlers,
    int_arg,
    model_metadata,
    print_summary,
    progress_stream,
    run_config,
    run_token,
    tls_files,
)
from geotrain.config import RunConfig


def advertised_host(host: str) -> str:
    """The coordinator's --advertise: a host alone (its DHT's port is its own, chosen when it starts)."""
    import ipaddress

    if ":" in host:  # a port, unless the whole is an IPv6 address
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError(f"--advertise takes a HOST without a port, got {host!r}") from None
    return host


def check_state_dir(cfg: RunConfig, state_dir: str | None, resume: bool) -> None:
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


def serve_coordinator(
    given: RunConfig,
    token: str,
    listen: str,
    args: argparse.Namespace,
    state_dir: str | None,
    preload: list[str],
    on_listening: Callable[[int, threading.Event], None] | None = None,
    stop_reason: Callable[[], str | None] = lambda: None,
    advertise: str = "",
    dht_port: int = 0,
    pause_on_stop: bool = False,
) -> int:
    """Check a coordinator's flags, then serve its run until it ends (scheduler.runstart); shared by `coordinator`
    and `demo` (given: the run config its file and flags give; preload: what the forkserver the DHT process is forked
    from imports, unless the command started it already; stop_reason: why the command set stop_requested itself, if
    it did; pause_on_stop: a signal pauses the run, leaving the nodes to wait for --resume, instead of ending it)."""
    out = progress_stream(args.json)
    tls = tls_files(args)
    listen = checked_listen(listen, "--listen")
    # Where the replicas' DHT will listen (service.dht_listen_maddr): every interface when advertised elsewhere.
    check_fixed_ports(f"0.0.0.0:{listen.rpartition(':')[2]}" if advertise else listen, {"--dht-port": dht_port})
    http_listen = checked_listen(args.http, "--http") if args.http != "off" else None
    check_writable_file(args.save_final, "--save-final")
    check_state_dir(given, state_dir, args.resume)
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the tensorboard package: pip install 'geotrain[tensorboard]'")
    # Imported once the arguments are known good: torch takes seconds to load, a mistyped flag should not.
    from geotrain.runconfig import fingerprinted
    from geotrain.scheduler.runstart import RunEnd, RunHooks, RunStart, StatusPageFailed, serve_run

    # The coordinator reads the corpus once to pin its fingerprint: every node must train on the same bytes.
    cfg = fingerprinted(given)

    def listening(port: int, stop: threading.Event) -> None:
        install_signal_handlers(stop.set)
        print(f"coordinator listening on {listen.rsplit(':', 1)[0]}:{port}", file=out, flush=True)
        if on_listening is not None:
            on_listening(port, stop)

    start = RunStart(
        cfg=cfg, token=token, listen=listen, state_dir=state_dir, resume=args.resume, tls=tls, advertise=advertise,
        dht_port=dht_port, tensorboard=args.tensorboard or "", http_listen=http_listen,
        http_host=args.http.rsplit(":", 1)[0], http_token=args.http_token, http_linger_s=args.http_linger,
        save_final=Path(args.save_final) if args.save_final else None, model_metadata=model_metadata(cfg),
        preload=preload, pause_on_stop=pause_on_stop,
    )
    hooks = RunHooks(
        say=lambda line: print(line, file=out, flush=True),
        warn=lambda line: print(f"geotrain: {line}", file=sys.stderr, flush=True),
        finished=lambda summary: print_summary(summary.as_dict(), args.json),
        on_event=ProgressPrinter(out), listening=listening, stop_reason=stop_reason,
    )
    try:
        end = serve_run(start, hooks)
    except StatusPageFailed as e:
        raise UsageError(f"--http: cannot listen on {args.http}: {e}") from None
    return {RunEnd.COMPLETE: EXIT_OK, RunEnd.FAILED: EXIT_FAILED, RunEnd.INTERRUPTED: EXIT_INTERRUPTED}[end]


def cmd_coordinator(args: argparse.Namespace) -> int:
    """geotrain coordinator."""
    given = run_config(args, **{"scheduler.min_nodes": args.min_nodes})
    # Its forkserver imports nothing: this command forks no node, and the DHT process (once a plan has replicas) and
    # the status page's process import what they need.
    # Without a state dir nothing can resume the run: a stop ends it for every node.
    return serve_coordinator(
        given, run_token(args), args.listen, args, args.state_dir, [], advertise=advertised_host(args.advertise),
        dht_port=args.dht_port, pause_on_stop=bool(args.state_dir),
    )


def add_coordinator(commands: Subcommands) -> None:
    """`geotrain coordinator`'s parser."""
    p = commands.add(
        "coordinator", "Run the coordinator that admits nodes and drives training.",
        "geotrain coordinator --config run.toml --listen 0.0.0.0:7000 --token $TOKEN", config=True,
    )
    p.add_argument("--listen", default="0.0.0.0:7000", help="host:port to serve on (default 0.0.0.0:7000)")
    p.add_argument("--token", help="run token (or set GEOTRAIN_TOKEN)")
    p.add_argument("--advertise", default="", metavar="HOST",
                   help="address or name nodes reach this machine at, if not the listen host (behind a relay or NAT); "
                   "the replicas' DHT listens on every interface and is announced there")
    p.add_argument("--dht-port", type=int_arg(0, 65535), default=0,
                   help="TCP port of the hivemind DHT that stage replicas find each other through (default any free "
                   "port, chosen when a plan first has replicas): open it to the nodes as you open --listen's")
    p.add_argument("--min-nodes", type=int, help="same as --set scheduler.min_nodes=N")
    p.add_argument("--state-dir", help="directory for run state (SQLite) and checkpoints")
    p.add_argument("--resume", action="store_true", help="continue the run held in --state-dir")
    add_tls_option(p)
    add_http_options(p, "off")
    add_metrics_option(p)
    add_run_outputs(p)
    p.set_defaults(func=cmd_coordinator)


def cmd_stop(args: argparse.Namespace) -> int:
    """geotrain stop."""
    from geotrain.protocol.identity import KEY_FILE

    token, tls = run_token(args), tls_files(args)
    check_resolvable(args.coordinator, "--coordinator")
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
        raise CommandFailed(
            f"the coordinator at {args.coordinator} did not stop the run: {e.code().name}: {e.details()}"
        ) from None
    print(f"the coordinator at {args.coordinator} ends the run", flush=True)
    return EXIT_OK


def add_stop(commands: Subcommands) -> None:
    """`geotrain stop`'s parser."""
    p = commands.add(
        "stop", "End a run for every node (stopping the coordinator's process only pauses it).",
        "geotrain stop --coordinator coordinator.example.org:7000 --token $TOKEN --state-dir run-state",
    )
    add_coordinator_address(p)
    p.add_argument(
        "--state-dir", required=True,
        help="the coordinator's --state-dir (or a copy of its node.key): only a call signed with the coordinator's "
        "own key ends the run, since every volunteer holds the token",
    )
    p.add_argument("--reason", default="the run owner stopped the run", help="what every node is told")
    add_tls_option(p)
    p.set_defaults(func=cmd_stop)


def cmd_status(args: argparse.Namespace) -> int:
    """geotrain status."""
    from geotrain.scheduler.status_cli import run_status

    check_resolvable(args.coordinator, "--coordinator")
    return run_status(args.coordinator, run_token(args), as_json=args.json, watch=args.watch, tls=tls_files(args))


def add_status(commands: Subcommands) -> None:
    """`geotrain status`'s parser."""
    p = commands.add(
        "status", "Show a running coordinator's nodes, plan, progress and events.",
        "geotrain status --coordinator coordinator.example.org:7000 --token $TOKEN --watch",
    )
    add_coordinator_address(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (the same as the page's /api/status)")
    p.add_argument("--watch", action="store_true", help="refresh in place every second until Ctrl+C")
    add_tls_option(p)
    p.set_defaults(func=cmd_status)
