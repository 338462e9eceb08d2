"""The commands that make a run's files, and plan one: `geotrain tls init`, `geotrain data prepare`,
`geotrain tokenizer train` and `geotrain plan`, each with its parser."""

from __future__ import annotations

import argparse

from geotrain.commands.common import EXIT_OK, Subcommands, UsageError, run_config, stop_on_sigterm


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


def add_tls(commands: Subcommands) -> None:
    """`geotrain tls`'s parser."""
    p = commands.add(
        "tls", "Make a run's TLS files: a run CA, and the certificate and key every participant shares.",
        "geotrain tls init run-tls",
    )
    actions = p.add_subparsers(dest="tls_command", required=True, metavar="ACTION")
    summary = "Write a new run CA, and the run's certificate and key, as ca.pem, cert.pem and key.pem."
    init = actions.add_parser("init", help=summary, description=summary)
    init.add_argument("dir", metavar="DIR", help="where to write them (created if missing; never overwritten)")
    init.set_defaults(func=cmd_tls_init)


def add_text_inputs(p: argparse.ArgumentParser) -> None:
    """--input and --text-field, of the commands that read text files."""
    p.add_argument(
        "--input", action="append", required=True, metavar="GLOB",
        help="text files: .txt (one document a file), .jsonl (one a line), .parquet (one a row); repeatable",
    )
    p.add_argument(
        "--text-field", default="text", metavar="NAME", help="the .jsonl field or .parquet column of the text"
    )


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """geotrain data prepare."""
    from geotrain.dataset import DatasetError
    from geotrain.prepare import prepare

    stop_on_sigterm()
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


def add_data(commands: Subcommands) -> None:
    """`geotrain data`'s parser."""
    p = commands.add(
        "data", "Prepare a data set once on the coordinator's host: tokens in memory-mapped shards.",
        "geotrain data prepare --input 'corpus/**/*.txt' --tokenizer tok.json --out data/",
    )
    actions = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    summary = "Tokenize text files into DIR (manifest.json, token shards, tokenizer.json) for data.prepared."
    prep = actions.add_parser("prepare", help=summary, description=summary)
    add_text_inputs(prep)
    prep.add_argument("--tokenizer", required=True, metavar="FILE", help="a tokenizer.json (any Hugging Face one)")
    prep.add_argument("--out", required=True, metavar="DIR", help="where to write it (must not exist, or be empty)")
    prep.add_argument(
        "--val-fraction", type=float, default=0.05, metavar="F",
        help="tokens held out for validation, whole documents from the end (default 0.05)",
    )
    prep.set_defaults(func=cmd_data_prepare)


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    """geotrain tokenizer train."""
    from geotrain.dataset import DatasetError
    from geotrain.prepare import train_tokenizer

    if not 257 <= args.vocab <= 1 << 24:
        raise UsageError(
            f"--vocab must be in [257, {1 << 24}] (the 256 bytes and a separator at least), got {args.vocab}"
        )
    stop_on_sigterm()
    try:
        vocab = train_tokenizer(args.input, args.vocab, args.out, args.text_field)
    except DatasetError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror}") from None
    print(f"trained a BPE tokenizer of {vocab} tokens into {args.out}", flush=True)
    return EXIT_OK


def add_tokenizer(commands: Subcommands) -> None:
    """`geotrain tokenizer`'s parser."""
    p = commands.add(
        "tokenizer", "Train a tokenizer for data prepare, for those without one.",
        "geotrain tokenizer train --input 'corpus/**/*.txt' --vocab 8192 --out tok.json",
    )
    actions = p.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    summary = "Train a byte-level BPE tokenizer (Hugging Face tokenizers) on text files and write it as JSON."
    train = actions.add_parser("train", help=summary, description=summary)
    add_text_inputs(train)
    train.add_argument("--vocab", type=int, default=8192, help="vocabulary size at most (default 8192)")
    train.add_argument("--out", required=True, metavar="FILE", help="the tokenizer.json to write")
    train.set_defaults(func=cmd_tokenizer_train)


def cmd_plan(args: argparse.Namespace) -> int:
    """geotrain plan."""
    from geotrain.scheduler.plan_cli import run_plan

    cfg = run_config(args)
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


def add_plan(commands: Subcommands) -> None:
    """`geotrain plan`'s parser."""
    p = commands.add(
        "plan", "Plan stages for a described cluster and print the estimated step time.",
        "geotrain plan --cluster deploy/clusters/four-regions-wan.yaml --set model.n_layers=24", config=True,
    )
    p.add_argument("--cluster", required=True, help="cluster YAML: nodes, regions, links")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)
