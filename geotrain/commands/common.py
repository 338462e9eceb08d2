"""What every `geotrain` subcommand shares: exit codes, one-line errors, the subcommand table's parts (the run
config flags, shared options, argument types) and the checks of flags every command makes the same way."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from geotrain.config import DATA_METADATA_KEY, MODEL_METADATA_KEY, RunConfig, load_config

if TYPE_CHECKING:
    from geotrain.protocol.tls import TlsFiles

log = logging.getLogger("geotrain")

# Exit codes (README, "Exit codes"). A service manager restarts on any of them but 0.
EXIT_OK = 0
EXIT_FAILED = 1  # the run or the command failed: run aborted, token refused, coordinator unreachable or incompatible
EXIT_USAGE = 2  # refused before starting: a bad flag, config value, file or address
EXIT_INTERNAL = 70  # a bug in geotrain (sysexits' EX_SOFTWARE): the traceback is printed, to be reported
EXIT_INTERRUPTED = 130  # stopped by SIGINT or SIGTERM


class UsageError(Exception):
    """A command-line problem: one line to stderr, exit code 2."""


class CommandFailed(Exception):
    """The command ran and failed for a reason outside geotrain (a peer, the network): one line, exit code 1."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse's own print the usage first, several lines)."""

    def error(self, message: str) -> NoReturn:  # noqa: D102
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_config(args: argparse.Namespace, **forced: Any) -> RunConfig:
    """The run config --config and --set give, with the command's own `forced` values (None: not forced) last."""
    overrides = list(args.set or []) + [f"{k}={v}" for k, v in forced.items() if v is not None]
    return load_config(args.config, overrides)


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The run's TLS files named by --tls-dir, checked; None (plaintext) without it."""
    from geotrain.protocol.tls import TlsFiles

    if not args.tls_dir:
        return None
    try:
        return TlsFiles.load(args.tls_dir)
    except ValueError as e:  # load's way of naming a missing or mismatched file
        raise UsageError(str(e)) from None


def run_token(args: argparse.Namespace) -> str:
    """The run token from --token or GEOTRAIN_TOKEN."""
    from geotrain.protocol.auth import resolve_token

    try:
        return resolve_token(args.token)
    except ValueError as e:
        raise UsageError(str(e)) from None


def checked_listen(listen: str, flag: str) -> str:
    """A listen address checked (bindable, not taken) and its host resolved to an IP address, before anything
    starts."""
    from geotrain.protocol.transport import ListenError, check_listen

    try:
        return check_listen(listen)
    except ListenError as e:
        raise UsageError(f"{flag}: {e}") from None


def check_fixed_ports(listen: str, ports: dict[str, int]) -> None:
    """Refuse the fixed ports other flags give beside a checked --listen address, on its host: one taken, or one
    that two flags share (each would take it from the other once they start). Port 0 picks a free one."""
    host, _, listen_port = listen.rpartition(":")
    claimed = {int(listen_port): "--listen"} if int(listen_port) else {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in claimed:
            raise UsageError(f"{flag} {port} is {claimed[port]}'s port too: give each its own")
        checked_listen(f"{host}:{port}", flag)
        claimed[port] = flag


def check_resolvable(address: str, flag: str) -> None:
    """Refuse an address that is not HOST:PORT; fail when its host has no address (a typo, or no network)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag} takes HOST:PORT, got {address!r}")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise CommandFailed(f"{flag} {address}: cannot resolve {host}: {e.strerror}") from None


def check_writable_file(path: str | None, flag: str) -> None:
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


def progress_stream(as_json: bool):
    """Where progress goes: stdout, or stderr when stdout is reserved for the JSON line."""
    return sys.stderr if as_json else sys.stdout


def install_signal_handlers(stop: Callable[[], None]) -> None:
    """SIGINT and SIGTERM call `stop` (with a warning), for a command that ends its work itself."""
    def handler(signum: int, _frame: Any) -> None:
        log.warning("%s received, shutting down", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def model_metadata(cfg: RunConfig) -> dict[str, str]:
    """A saved model's header metadata: its [model] section, so it loads without the run config, and its [data]
    section, where generate and export find the run's tokenizer."""
    return {
        MODEL_METADATA_KEY: json.dumps(dataclasses.asdict(cfg.model)),
        DATA_METADATA_KEY: json.dumps(dataclasses.asdict(cfg.data)),
    }


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    """A finished run's last line, and its JSON line on stdout under --json."""
    out = progress_stream(as_json)
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


def torch_threads() -> None:
    """Let OMP_NUM_THREADS cap torch: processes sharing a small machine otherwise oversubscribe it."""
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def device_or_usage(spec: str):
    """The torch device --device names; UsageError (exit 2) when this machine has none such."""
    from geotrain.node.device import DeviceError, resolve_device

    try:
        return resolve_device(spec)
    except DeviceError as e:
        raise UsageError(str(e)) from None


def stop_on_sigterm() -> None:
    """SIGTERM ends the command as Ctrl+C does, so its cleanup runs (a half-written output is removed)."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def is_number(text: str, at_least: float, above: bool = False) -> bool:
    """Whether text is a finite number >= at_least (> at_least with `above`)."""
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and (value > at_least if above else value >= at_least)


def number_arg(at_least: float, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= at_least (> at_least with `above`)."""

    def parse(text: str) -> float:
        if not is_number(text, at_least, above):
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


def int_arg(at_least: int, at_most: int) -> Callable[[str], int]:
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


class Subcommands:
    """Adds each subcommand's parser to the `geotrain` parser: its summary, example and (with config=True) the run
    config flags --config and --set."""

    def __init__(self, sub: argparse._SubParsersAction) -> None:
        self._sub = sub
        self._config = Parser(add_help=False)
        self._config.add_argument("--config", help="run config TOML file (defaults otherwise)")
        self._config.add_argument(
            "--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value"
        )

    def add(self, name: str, summary: str, example: str, *, config: bool = False) -> argparse.ArgumentParser:
        """The parser of subcommand `name`."""
        return self._sub.add_parser(
            name,
            parents=[self._config] if config else [],
            help=summary,
            description=summary,
            epilog=f"example:\n  {example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )


def add_coordinator_address(p: argparse.ArgumentParser) -> None:
    """--coordinator and --token, of the commands that call a coordinator."""
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--token", help="run token (or set GEOTRAIN_TOKEN)")


def add_run_outputs(p: argparse.ArgumentParser) -> None:
    """--save-final and --json, of the commands that train."""
    p.add_argument("--save-final", metavar="PATH", help="write the trained model as a safetensors file")
    p.add_argument("--json", action="store_true", help="end stdout with one JSON line of run figures")


def add_tls_option(p: argparse.ArgumentParser) -> None:
    """--tls-dir, of the commands that talk to a run."""
    p.add_argument(
        "--tls-dir", metavar="DIR", help="the run's TLS files from `geotrain tls init DIR` (default: plaintext)"
    )


def add_metrics_option(p: argparse.ArgumentParser) -> None:
    """--tensorboard, of the commands that run a coordinator."""
    p.add_argument(
        "--tensorboard", metavar="DIR",
        help="write TensorBoard event files here: losses, tokens/s, step time, each node's forward, backward, "
        "averaging and idle share, bytes on each link, failures (needs pip install 'geotrain[tensorboard]'); the "
        "same figures go to metrics.jsonl in --state-dir always",
    )


def add_http_options(p: argparse.ArgumentParser, default: str) -> None:
    """The status page's flags, of the commands that run a coordinator."""
    p.add_argument(
        "--http",
        default=default,
        metavar="HOST:PORT",
        help=f"serve the status page, /api/status and /metrics (port 0: any free; off: none; default {default})",
    )
    p.add_argument(
        "--http-linger",
        type=number_arg(0.0),
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
