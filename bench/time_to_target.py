"""Time to a target loss over slow links: each way to send fewer bytes, judged by when it reaches the loss that
exact training reaches, not by its bytes.

Three regions of one node each (two for the replica configurations) under the planner's default plan (the replica
configurations: three stages of even layers), joined by 50 Mbit/s, 50 ms links: the namespace WAN of
deploy/wan/netwan.py where this runs as root (tbf rate limits, and the router delays every packet between regions),
else `geotrain demo --uplink 50/50` (every node's traffic through one emulated 50 Mbit/s, 50 ms uplink), or with
--links loopback `geotrain demo` unshaped; each line says which, key "links". The model (--size, SIZES) is a byte
GPT of 2.7M parameters (6 blocks of width 192), or one of 50.7M (bench/versus.py's large); every configuration
trains the same steps on the same tokens per step, with a validation pass every EVAL_EVERY steps (--eval-every).

The target is TARGET_VAL_LOSS: the validation loss the uncompressed run (config none) reached at step TARGET_STEP
(120 of 150) on this bench's links, measured once and fixed here, so every configuration chases the same number.
Each validation pass samples its windows anew by step (the same windows for every configuration at a step), so the
curve is noisy: none's run went below its step-120 figure first at step 100 (2.818).
That target is early: a constrained configuration (boundary_rank, top-k) that learns fast at first and then stalls
reaches it sooner than exact training. --late sets the late target instead: none runs first (at least 1,000 steps),
and the target is its validation loss at the first pass at or after 90% of the run (late_target); each
configuration's steps and seconds to it and its val_loss_at_equal_tokens at the end of the long run tell whether
its bytes saved are worth the capacity it costs (--target with that figure runs the others in later invocations).

One JSON line per configuration: config, links, steps_to_target and seconds_to_target (the first validation pass at
or below the target, and the training seconds of the committed steps until then; null if the run never got there),
boundary_bytes_per_token (activation and gradient bytes on the wire across every stage boundary per token trained,
from the nodes' own link counters; they also count the validation passes' activations, forward only, 12,288 tokens a
pass, so codec none shows 3,679 where training alone sends 3,072 and headers), averaging_bytes_per_step (replica
averaging's bytes per step as the run reports them; 0 with one replica per stage, which averages nothing),
val_loss_at_equal_tokens (the last validation pass: every configuration trains the same tokens), tokens_per_s,
tensor_transport (what carried the activations and gradients, measured: the share of their bytes the nodes counted
as sent over raw tensor streams, the rest by gRPC calls).

Configurations (CONFIGS): none, int8, auto, rank8 and rank32 (`model.boundary_rank`), and 2 replicas per stage
averaging every step or DiLoCo-style every REPLICA_SYNC_EVERY steps (`compression.replica_sync`). The WAN places a
stage's two replicas in different regions, so on namespaces their averaging crosses the shaped links too; the
emulator shapes geotrain's data plane but not hivemind's traffic. averaging_bytes_per_step counts only the
all-reduces' messages (no DHT traffic, no state downloads): every_step sends float64 gradients every step, diloco a
sync of int16 pseudo-gradients, a quarter of float64's bytes, at steps H, 2H, ... (node.diloco): over N steps
4N / floor((N - 1) / H) times fewer bytes a step, 44x for 100 steps at H = 10.
Run: sudo python bench/time_to_target.py [--configs none,int8,auto] [--steps N] [--links namespaces|emulator|loopback]
[--size small|large] [--late | --target LOSS] [--eval-every N]

Measured on a 2-core machine, namespaces, 150 steps: none 100 steps, 171.1 s to target, 3,673 B/token, 2.7557 at
equal tokens; rank8 40 steps, 32.5 s (5.3x sooner), 153 B/token (24x fewer), 2.4764; rank32 40 steps, 41.2 s, 611
B/token, 2.4952. Earlier, loaded: int8 100 steps, 140.4 s, 973 B/token, 2.7538; auto 150 steps, 237.4 s, 1,198
B/token, 2.8888 (its top-k costs loss). Replicas, namespaces, 100 steps (loaded): replicas_every_step 100 steps,
606.5 s to target, 44.5 MB averaged a step, 2.8405 at equal tokens; replicas_diloco 100 steps, 186.8 s (3.2x
sooner), 1.0 MB a step (44x fewer), 2.8808 (1.4% above every_step); with plain averaging as the outer step
(replica_sync_lr=1, replica_sync_momentum=0) 2.8801, no better: DiLoCo's 0.7 and 0.9 stay. Before the int16 grid
(float64 syncs, emulator): 4.0 MB a step (11x, H times fewer: the count was right, the scheme sent a full float64
copy), 3.0114. Under diloco which replica trains on which microbatch follows measured timings, so its loss differs
from run to run; one run each does not tell the grid's share of the change.
The late target (`--late --configs none --steps 1000 --eval-every 25 --links loopback`, then int8 and rank8 with
--target 1.9745, each in a lock hold of its own), a 2-core machine, the CPU lock held, geotrain at 53944ed (AdamW
fused: its rounding is not the per-tensor loop's, so this none's curve is not the last version's, whose target was
1.9459 and whose final loss 1.9343):
  {"config": "none", "model": "byte GPT 2.7M (6 blocks of width 192)",
    "links": "loopback: every process on 127.0.0.1, unshaped", "target_val_loss": 1.9745, "steps_to_target": 800,
    "seconds_to_target": 300.6, "boundary_bytes_per_token": 3310.7, "averaging_bytes_per_step": 0,
    "val_loss_at_equal_tokens": 1.9567, "tokens": 3072000, "tokens_per_s": 8203.7,
    "tensor_transport": "raw tensor stream"}
  {"config": "int8", "model": "byte GPT 2.7M (6 blocks of width 192)",
    "links": "loopback: every process on 127.0.0.1, unshaped", "target_val_loss": 1.9745, "steps_to_target": null,
    "seconds_to_target": null, "boundary_bytes_per_token": 880.4, "averaging_bytes_per_step": 0,
    "val_loss_at_equal_tokens": 1.9876, "tokens": 3072000, "tokens_per_s": 7976.7,
    "tensor_transport": "raw tensor stream"}
  {"config": "rank8", "model": "byte GPT 2.7M (6 blocks of width 192)",
    "links": "loopback: every process on 127.0.0.1, unshaped", "target_val_loss": 1.9745, "steps_to_target": null,
    "seconds_to_target": null, "boundary_bytes_per_token": 137.8, "averaging_bytes_per_step": 0,
    "val_loss_at_equal_tokens": 2.1219, "tokens": 3072000, "tokens_per_s": 9835.6,
    "tensor_transport": "raw tensor stream"}
none's target is its pass at step 900; it first passed below it at step 800 (1.9682; 1.9745 at 900, 1.9567 at 1000:
its curve is noisy at this scale). int8 tracks none early (2.7564 at step 100 against 2.7486, 2.2264 at 500 against
2.1924) and never reaches the target: its best pass 1.9798 at step 800, 1.9876 at the end, 1.6% above none. rank8 is
ahead early (2.8306 at step 50 against 3.0845, 2.5092 at 100 against 2.7486), level by step 500 (2.2022 against
2.1924), and never reaches it either (best 2.0893 at step 800, 2.1219 at the end, 8.4% above none). The previous
version's runs counted averaging bytes with one node a stage (178 and 584 KB a step); these count none.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
LINK_MBPS = 50.0
LATENCY_MS = 50.0
STAGES = 3
# A byte GPT of 2.7M parameters; 6 microbatches of 8 x 64 bytes (3,072 tokens) a step, all in flight at once.
MODEL = ["model.n_layers=6", "model.d_model=192", "model.n_heads=6", "model.seq_len=64"]
TRAIN = ["train.microbatches=6", "train.microbatch_size=8", "train.inflight=6"]
# A byte GPT of 50.7M parameters, whose float32 gradients (203 MB) dwarf a step's activations at a boundary (1.6 MB
# each way); 6 microbatches of 2 x 64 bytes (768 tokens) a step: on 2 cores a step takes seconds, not minutes.
LARGE_MODEL = ["model.n_layers=16", "model.d_model=512", "model.n_heads=8", "model.seq_len=64"]
LARGE_TRAIN = ["train.microbatches=6", "train.microbatch_size=2", "train.inflight=6"]
SIZES = {"small": "byte GPT 2.7M (6 blocks of width 192)", "large": "byte GPT 50.7M (16 blocks of width 512)"}
STEPS = 150
EVAL_EVERY = 10
# Each pass samples its windows anew (a function of the step): 4 microbatches (32 windows) gave passes +-0.2 apart
# around the trend, more than a codec's effect; 24 (192 windows, 12,288 tokens) cost ~8 s a pass.
EVAL_MICROBATCHES = 24
TARGET_STEP = 120
TARGET_VAL_LOSS = 2.8986  # the none run's val loss at TARGET_STEP, measured on namespaces (below)
REPLICA_SYNC_EVERY = 10


@dataclass(frozen=True)
class Config:
    """One configuration of the table: its settings and how many replicas serve each stage."""

    settings: tuple[str, ...]
    replicas: int = 1


CONFIGS = {
    "none": Config(()),
    "int8": Config(("compression.activations=int8", "compression.activation_grads=int8")),
    "auto": Config(("compression.activations=auto", "compression.activation_grads=auto")),
    "rank8": Config(("model.boundary_rank=8",)),
    "rank32": Config(("model.boundary_rank=32",)),
    "replicas_every_step": Config(("compression.replica_sync=every_step",), replicas=2),
    "replicas_diloco": Config(
        ("compression.replica_sync=diloco", f"compression.replica_sync_every={REPLICA_SYNC_EVERY}"), replicas=2
    ),
}
LINKS = ("namespaces", "emulator", "loopback")


def size_settings(size: str) -> list[str]:
    """The model and step settings of a size of SIZES (read when called, so a test can shrink them)."""
    return {"small": [*MODEL, *TRAIN], "large": [*LARGE_MODEL, *LARGE_TRAIN]}[size]


def run_settings(config: Config, steps: int, size: str = "small", eval_every: int | None = None) -> list[str]:
    """Every --set of one run of `config`: the default plan (the planner chooses the layout), but the replica
    configurations' STAGES stages of even layers; a checkpoint only at the end (what bench/versus.py compares it
    with writes none, and the namespace runs have no state dir of their own)."""
    layout = [f"scheduler.stages={STAGES}", "scheduler.placement=uniform"] if config.replicas > 1 else []
    every = EVAL_EVERY if eval_every is None else eval_every
    return [
        *size_settings(size), f"run.steps={steps}", f"run.eval_every={every}",
        f"run.eval_microbatches={EVAL_MICROBATCHES}", "scheduler.checkpoint_every=0", *layout, *config.settings,
    ]


def load_script(path: Path) -> ModuleType:
    """A script of this repository imported by path (bench/ and deploy/ are not packages), as its file's stem."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while the class body runs
    spec.loader.exec_module(module)
    return module


def _netwan() -> ModuleType:
    return sys.modules.get("netwan") or load_script(REPO / "deploy" / "wan" / "netwan.py")


def default_links() -> str:
    """namespaces where this process can build them (root, iproute2), else the in-process link emulator."""
    netwan = _netwan()
    try:
        netwan.check_environment()
    except netwan.WanError:
        return "emulator"
    return "namespaces"


def links_label(links: str) -> str:
    """What a line's "links" says."""
    if links == "loopback":
        return "loopback: every process on 127.0.0.1, unshaped"
    if links == "namespaces":
        return f"namespaces: tbf {LINK_MBPS:g} Mbit/s, router delay {LATENCY_MS:g} ms one way"
    return f"emulator: each node's uplink {LINK_MBPS:g} Mbit/s, {LATENCY_MS:g} ms one way"


def new_wan(netwan: ModuleType, replicas: int, log_dir: Path):
    """A fresh WAN of STAGES regions with `replicas` nodes each, delay in the router (so any process sees it)."""
    spec = netwan.WanSpec(regions=STAGES, nodes_per_region=replicas, link_mbps=LINK_MBPS, latency_ms=LATENCY_MS,
                          delay="router")
    return netwan.Wan(spec, log_dir)


def train(config: Config, steps: int, links: str, timeout_s: float = 3600.0, size: str = "small",
          eval_every: int | None = None) -> dict:
    """One run of `config`; its --json summary."""
    return run_summary(run_settings(config, steps, size, eval_every), steps, links, config.replicas, timeout_s)


def run_summary(settings: list[str], steps: int, links: str, replicas: int = 1, timeout_s: float = 3600.0) -> dict:
    """The --json summary of a run of these --set settings on STAGES regions of `replicas` nodes each, over
    `links` (LINKS), with "step_s" added: its steps' seconds from commit to commit (commit_spans), and
    "step_window": the first one's start and the last one's end (seconds since the epoch; None without any)."""
    flags = [arg for s in settings for arg in ("--set", s)]
    state_dir = Path(tempfile.mkdtemp(prefix="bench-ttt-state-"))  # for its metrics.jsonl
    if links != "namespaces":
        # demo's --stages outranks --set: the settings' own, or 0 (the planner chooses).
        stages = next((s.split("=", 1)[1] for s in settings if s.startswith("scheduler.stages=")), "0")
        uplink = ["--uplink", f"{LINK_MBPS:g}/{LATENCY_MS:g}"] if links == "emulator" else []
        cmd = [sys.executable, "-m", "geotrain", "demo", "--nodes", str(STAGES * replicas), "--stages", stages,
               "--steps", str(steps), *uplink, "--http", "off", "--state-dir", str(state_dir), "--json", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"the run failed:\n{done.stderr[-3000:]}")
        summary = json.loads(done.stdout.strip().splitlines()[-1])
    else:
        netwan = _netwan()
        with new_wan(netwan, replicas, Path(tempfile.mkdtemp(prefix="bench-ttt-"))) as wan:
            wan.build()
            coordinator = wan.start_coordinator(["--json", "--state-dir", str(state_dir), *flags])
            wan.join_in_order(coordinator)
            log = wan.log_dir / "coordinator.log"
            if coordinator.wait(timeout_s) != 0:
                raise RuntimeError(f"the run failed:\n{log.read_text()[-3000:]}")
            summary = json.loads(next(line for line in reversed(log.read_text().splitlines()) if line.startswith("{")))
    spans = commit_spans((state_dir / "metrics.jsonl").read_text().splitlines())
    summary["step_s"] = [end - start for start, end in spans]
    summary["step_window"] = [spans[0][0], spans[-1][1]] if spans else None
    return summary


def commit_spans(metrics_lines: list[str]) -> list[tuple[float, float]]:
    """Each step's span from the commit before it to its own (metrics.jsonl's "time", seconds since the epoch), so
    the optimizer's step counts as it does in torch pipelining's; steps after a failure and those that ran a
    validation pass (written after it) left out, and the first (no commit before it, the nodes still warming up)."""
    steps = [json.loads(line) for line in metrics_lines]
    return [
        (before["time"], after["time"]) for before, after in zip(steps, steps[1:])
        if before["kind"] == after["kind"] == "step" and after["val_loss"] is None
    ]


def to_target(summary: dict, target: float) -> tuple[int | None, float | None]:
    """(steps, training seconds) of the first validation pass at or below `target`; (None, None) if none was."""
    for steps, val_loss, seconds in summary["validation"]:
        if val_loss <= target:
            return steps, seconds
    return None, None


def late_target(summary: dict, steps: int) -> float:
    """The validation loss of the first pass at or after 90% of a run of `steps` steps: the issue's late target."""
    return round(next(val_loss for done, val_loss, _ in summary["validation"] if done >= 0.9 * steps), 4)


def tokens_per_step(size: str = "small") -> int:
    """Tokens one step of a size of SIZES trains on."""
    from geotrain.config import load_config

    return load_config(None, size_settings(size)).tokens_per_step


def figures(name: str, config: Config, summary: dict, links: str, target: float, size: str = "small") -> dict:
    """The JSON line of one run."""
    steps_to_target, seconds_to_target = to_target(summary, target)
    tokens = summary["steps"] * tokens_per_step(size)
    return {
        "config": name,
        "model": SIZES[size],
        "links": links_label(links),
        "target_val_loss": target,
        "steps_to_target": steps_to_target,
        "seconds_to_target": None if seconds_to_target is None else round(seconds_to_target, 1),
        "boundary_bytes_per_token": round(summary["wire_bytes"] / tokens, 1),
        "averaging_bytes_per_step": round(summary["averaging_bytes"] / summary["steps"]),
        "val_loss_at_equal_tokens": round(summary["val_loss"], 4),
        "tokens": tokens,
        "tokens_per_s": round(summary["tokens_per_s"], 1),
        "tensor_transport": tensor_transport(summary),
    }


def tensor_transport(summary: dict) -> str:
    """What carried the run's activations and gradients, from the nodes' own counters (the summary's stream_bytes
    of wire_bytes), not from the run's settings: a stream port no relay forwards sends them by gRPC calls."""
    wire, streamed = summary["wire_bytes"], summary["stream_bytes"]
    if not wire:
        return "none sent"
    if streamed == wire:
        return "raw tensor stream"
    if not streamed:
        return "gRPC calls"
    return f"raw tensor stream {streamed / wire:.1%} of bytes, gRPC calls the rest"


def names_in(table: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names of `table`'s entries (`what` they are, in its error)."""
    choices = list(table)

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or '(none)'}; "
                                              f"choose from {', '.join(choices)}")
        return names

    return parse


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=names_in(CONFIGS, "configuration(s)"), default=["none", "int8", "auto"],
                   help=f"comma-separated, of {', '.join(CONFIGS)} (default none,int8,auto)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps per run (default {STEPS})")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target", type=float, default=TARGET_VAL_LOSS,
                        help=f"target validation loss (default {TARGET_VAL_LOSS}: none's at step {TARGET_STEP})")
    target.add_argument("--late", action="store_true",
                        help="the target is none's validation loss at 90%% of this run (none runs first)")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY, help=f"steps between validation passes "
                   f"(default {EVAL_EVERY}; the late target's pass is the first at or after 90%% of --steps)")
    p.add_argument("--size", choices=list(SIZES), default="small", help="the model (default small)")
    p.add_argument("--links", choices=LINKS,
                   help="namespaces (needs root), emulator or loopback (default: namespaces if root, else emulator)")
    return p


def main() -> None:
    """Run each chosen configuration and print one JSON line each."""
    args = parser().parse_args()
    links = args.links or default_links()
    names = ["none", *(n for n in args.configs if n != "none")] if args.late else args.configs
    target = args.target
    for name in names:
        summary = train(CONFIGS[name], args.steps, links, size=args.size, eval_every=args.eval_every)
        print(json.dumps({"config": name, "summary": summary}), file=sys.stderr, flush=True)  # for other targets
        if args.late and name == "none":
            target = late_target(summary, args.steps)
        print(json.dumps(figures(name, CONFIGS[name], summary, links, target, args.size)), flush=True)


if __name__ == "__main__":
    main()
