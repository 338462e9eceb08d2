"""`geotrain demo`: a coordinator and local node processes on this machine, and its parser."""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geotrain.commands.common import (
    Subcommands,
    UsageError,
    add_http_options,
    add_metrics_option,
    add_run_outputs,
    add_tls_option,
    device_or_usage,
    is_number,
    progress_stream,
    run_config,
    torch_threads,
)
from geotrain.commands.coordinator import serve_coordinator

if TYPE_CHECKING:
    from geotrain.localnodes import LocalNodes


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
    cfg = run_config(args, **forced)
    if cfg.scheduler.stages > cfg.model.total_layers:
        raise UsageError(f"--stages {cfg.scheduler.stages} exceeds the model's {cfg.model.total_layers} layers")
    try:
        chaos = Chaos.parse(args.chaos) if args.chaos else None
    except ValueError as e:  # parse's way of naming what is wrong
        raise UsageError(str(e)) from None
    device_or_usage(args.device)  # a device this machine lacks: one line now, not from each node later
    torch_threads()
    start_forkserver()
    token = os.environ.get(TOKEN_ENV) or new_token()
    work_dir = Path(tempfile.mkdtemp(prefix="geotrain-demo-"))
    # Checkpoints let a stage that lost every node come back.
    state_dir = args.state_dir or str(work_dir / "state")
    nodes: LocalNodes | None = None
    failed: list[str] = []  # why the demo stopped its own coordinator

    def launch(port: int, stop: threading.Event) -> None:
        nonlocal nodes
        # The nodes' keys live with the run's state, so that `demo --resume` brings the same nodes back.
        nodes = LocalNodes(f"127.0.0.1:{port}", token, work_dir, per_node_flags(args), Path(state_dir) / "nodes")
        for i in range(args.nodes):
            nodes.start(f"node-{i + 1}")
        out = progress_stream(args.json)
        print(f"started {args.nodes} local nodes (logs and state in {work_dir})", file=out, flush=True)
        if chaos is not None:
            chaos.start(nodes, out)
        threading.Thread(target=watch_nodes, args=(nodes, stop, failed), name="node-watch", daemon=True).start()

    try:
        return serve_coordinator(
            cfg, token, "127.0.0.1:0", args, state_dir, NODE_PRELOAD, on_listening=launch,
            stop_reason=lambda: failed[0] if failed else None,
        )
    finally:
        if chaos is not None:
            chaos.stop()
        if nodes is not None:
            nodes.stop_all()


def watch_nodes(nodes: LocalNodes, stop: threading.Event, failed: list[str]) -> None:
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


def per_node_flags(args: argparse.Namespace) -> dict[str, list[str]]:
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


def slowdowns_arg(value: str) -> str:
    """Check a --slowdowns value: comma-separated factors, each at least 1."""
    if not all(is_number(v, 1.0) for v in value.split(",") if v) or not value.strip(","):
        raise argparse.ArgumentTypeError(f"expected factors >= 1 separated by commas, e.g. 1,3, got {value!r}")
    return value


def uplink_arg(value: str) -> str:
    """Check an --uplink value: Mbit/s, optionally /one-way ms, both positive numbers (the latency may be 0)."""
    mbps, _, ms = value.partition("/")
    if not (is_number(mbps, 0.0, above=True) and (not ms or is_number(ms, 0.0))):
        raise argparse.ArgumentTypeError(f"--uplink takes MBPS or MBPS/MS, e.g. 20/50, got {value!r}")
    return value


def add_demo(commands: Subcommands) -> None:
    """`geotrain demo`'s parser."""
    p = commands.add(
        "demo", "Train the default model on this machine: a coordinator and local node processes.",
        "geotrain demo --nodes 3 --steps 30", config=True,
    )
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
        "--slowdowns", metavar="1,3", type=slowdowns_arg,
        help="give the local nodes these --slowdown factors in turn (unequal machines)",
    )
    p.add_argument(
        "--uplink", metavar="MBPS[/MS]", type=uplink_arg,
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
    add_tls_option(p)
    add_http_options(p, "127.0.0.1:0")
    add_metrics_option(p)
    add_run_outputs(p)
    p.set_defaults(func=cmd_demo)
