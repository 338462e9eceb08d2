"""The `geotrain` command: the parser of every subcommand, built from the parts that sit beside each command
(geotrain.commands), and the dispatch to them with one-line errors and exit codes (README, "Exit codes")."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import NoReturn

from geotrain import __version__
from geotrain.commands import coordinator, demo, model, node, tools
from geotrain.commands.common import (
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CommandFailed,
    Parser,
    Subcommands,
    UsageError,
)
from geotrain.config import ConfigError

__all__ = [
    "EXIT_FAILED", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_USAGE", "CommandFailed", "UsageError",
    "build_parser", "main", "run",
]

# The subcommands in the order `geotrain --help` lists them.
_SUBCOMMANDS = (
    coordinator.add_coordinator, coordinator.add_stop, node.add_join, demo.add_demo, node.add_train_local,
    tools.add_plan, coordinator.add_status, model.add_generate, model.add_export, tools.add_tls, tools.add_data,
    tools.add_tokenizer,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = Parser(
        prog="geotrain",
        description="Train one model across heterogeneous computers joined over the internet.",
        epilog="Quick start: geotrain demo",
    )
    parser.add_argument("--version", action="version", version=f"geotrain {__version__}")
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="default: warning for demo, info otherwise"
    )
    commands = Subcommands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    for add in _SUBCOMMANDS:
        add(commands)
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
