"""`geotrain join` (serve a stage of a run) and `geotrain train-local` (the same run in one process), each with its
parser."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from geotrain.commands.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Subcommands,
    UsageError,
    add_coordinator_address,
    add_run_outputs,
    add_tls_option,
    check_fixed_ports,
    check_resolvable,
    check_writable_file,
    checked_listen,
    device_or_usage,
    install_signal_handlers,
    int_arg,
    number_arg,
    parse_size,
    print_summary,
    progress_stream,
    run_config,
    run_token,
    tls_files,
    torch_threads,
)
from geotrain.commands.model import save_final
from geotrain.runconfig import corpus_fingerprint


def cmd_join(args: argparse.Namespace) -> int:
    """geotrain join."""
    token, tls = run_token(args), tls_files(args)
    check_resolvable(args.coordinator, "--coordinator")
    listen = checked_listen(args.listen, "--listen")
    check_fixed_ports(listen, {"--tensor-port": args.tensor_port, "--dht-port": args.dht_port})
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
    announce_device(args.device, args.max_memory)
    try:
        agent = Agent(options)
    except IdentityError as e:
        raise UsageError(f"--state-dir: {e}") from None
    agent.on_reachability = lambda line: print(line, flush=True)
    interrupted = threading.Event()
    install_signal_handlers(lambda: (interrupted.set(), agent.stop()))
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


def add_join(commands: Subcommands) -> None:
    """`geotrain join`'s parser."""
    p = commands.add(
        "join", "Join a run as a node: serve a pipeline stage for the coordinator.",
        "geotrain join --coordinator coordinator.example.org:7000 --token $TOKEN",
    )
    add_coordinator_address(p)
    p.add_argument("--listen", default="0.0.0.0:0", help="host:port for peers to reach this node (default any port)")
    p.add_argument("--advertise", default="", help="host:port peers should dial, if not the listen address")
    p.add_argument("--tensor-port", type=int_arg(0, 65535), default=0,
                   help="port of the raw tensor stream on the listen host and the advertised one (default any free "
                   "port), opened when the run says transport.tensor_stream = \"tcp\" (its default); neighbours that "
                   "cannot reach it send by gRPC calls")
    p.add_argument("--dht-port", type=int_arg(0, 65535), default=0,
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
        "--slowdown", type=number_arg(1.0), default=1.0, help="emulate a slower machine: compute takes F times as long"
    )
    p.add_argument(
        "--bandwidth-mbps", type=number_arg(0.0), default=0.0, help="emulate this egress bandwidth to every peer"
    )
    p.add_argument("--latency-ms", type=number_arg(0.0), default=0.0, help="emulate this one-way latency to every peer")
    p.add_argument(
        "--give-up-after", type=number_arg(0.0, above=True), default=1800.0, metavar="SECONDS",
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
    add_tls_option(p)
    p.set_defaults(func=cmd_join)


def announce_device(spec: str, max_memory: int = 0) -> None:
    """Print the device a node will compute on, its usable memory and a measured speed, before it registers (on
    stdout: stderr is for what went wrong, one line of it)."""
    from geotrain.node.device import describe, matmul_flops
    from geotrain.node.profiler import available_memory_bytes, host_turn

    device = device_or_usage(spec)
    with host_turn():  # nodes starting together on one machine time it in turn, as they time their layers
        flops = matmul_flops(device)
    print(
        f"device {describe(device)}: {available_memory_bytes(device, cap_bytes=max_memory) / 2**30:.1f} GiB usable, "
        f"{flops / 1e12:.2f} TFLOP/s fp32 matmul",
        flush=True,
    )


def cmd_train_local(args: argparse.Namespace) -> int:
    """geotrain train-local."""
    cfg = run_config(args, **{"run.steps": args.steps})
    check_writable_file(args.save_final, "--save-final")
    from geotrain.node.local import train_local  # torch: only once the arguments are known good

    # train_local reads the corpus again (a second or so), but cannot say what is wrong with it.
    corpus_fingerprint(cfg.data, cfg.model)
    import torch

    # The nodes' thread count, not every core's: torch sums some gradients in per-thread chunks, so only the same
    # count computes the same bits.
    torch.set_num_threads(args.threads)
    out = progress_stream(args.json)

    def progress(r: dict[str, Any]) -> None:
        val = f"  val {r['val_loss']:.4f} ({r['val_bits_per_byte']:.3f} bits/byte)" if "val_loss" in r else ""
        print(f"step {r['step'] + 1:>4}/{cfg.run.steps}  loss {r['loss']:.4f}{val}  {r['seconds']:.2f}s", file=out,
              flush=True)

    runtime, summary = train_local(cfg, progress, device_or_usage(args.device))
    if args.save_final:
        save_final(args.save_final, {name: p.detach() for name, p in runtime.named_state()}, cfg, out)
    print_summary(summary, args.json)
    return EXIT_OK


def add_train_local(commands: Subcommands) -> None:
    """`geotrain train-local`'s parser."""
    p = commands.add(
        "train-local", "Train the same run in one process: the reference the pipeline must match.",
        "geotrain train-local --config run.toml --json", config=True,
    )
    p.add_argument("--steps", type=int, help="same as --set run.steps=N")
    p.add_argument(
        "--threads", type=int_arg(1, 4096), default=1, metavar="N",
        help="compute threads (default 1, as the demo's local nodes compute): torch sums some gradients in "
        "per-thread chunks, so the pipeline equals train-local to the bit only at its nodes' thread count "
        "(a `geotrain join` uses OMP_NUM_THREADS, else every core)",
    )
    p.add_argument(
        "--device", default="cpu", help="auto, cpu, cuda, cuda:N or mps (default cpu: the exactness reference)"
    )
    add_run_outputs(p)
    p.set_defaults(func=cmd_train_local)
