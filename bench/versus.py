"""geotrain against the tools a user would otherwise pick, on the same links, model, data and tokens per step.

The links, model, data and target of bench/time_to_target.py (3 regions joined by 50 Mbit/s, 50 ms; a 2.7M-parameter
byte GPT; 3,072 tokens a step). Systems:
- geotrain (config none) and geotrain's best configuration (--best, a config of time_to_target.py's table): the
  default plan (the planner's choice of pipeline, data parallelism or hybrid), through time_to_target.py's own run.
- torch pipelining: `torch.distributed.pipelining`'s GPipe schedule over gloo, 3 ranks, one per region, each with
  the layers geotrain's uniform placement gives its stage (the same layers, built by the same model zoo and seed),
  the step's 6 microbatches as GPipe's microbatches (gradients averaged over them), the global gradient-norm clip
  through one all-reduce, and geotrain's AdamW and learning-rate schedule: the same training as geotrain's.
- hivemind: `hivemind.Optimizer` data parallelism, 3 peers (one per region) each with the whole model and 2 of the
  step's 6 microbatches, a global batch of all 6 (target_batch_size), gradients averaged by hivemind's all-reduce
  every global step; AdamW with the same schedule but no gradient clip (hivemind.Optimizer has no place for one);
  parameters are not averaged (they stay equal: same start, same averaged gradients), matchmaking_time 1 s.
In namespaces (root) every system crosses the same links: tbf shapes each region's link and the router delays every
packet between regions (a TUN device; there is no netem), so gloo's and libp2p's own ports see the latency too.
Without root torch pipelining and hivemind run on loopback, unshaped, and their lines say so.

One JSON line per system: system, links, tensor_transport (for geotrain measured by its nodes, as in
time_to_target.py's lines; torch pipelining's and hivemind's have one each), tokens_per_s (tokens trained per second
of the steps measured), seconds_to_target. geotrain's seconds_to_target is measured (its validation passes against
time_to_target's target); torch pipelining and hivemind run only --other-steps steps, and theirs is projected: the
steps geotrain (none) needed, each at the system's measured mean step time, said in "seconds_to_target_from": torch
pipelining trains exactly what geotrain none trains (its loss_first and loss_last are in the line to compare),
hivemind nearly (no clip). Run: sudo python bench/versus.py [--steps N] [--other-steps N] [--best int8] [--systems ...]

Measured in one run of this script (`--best rank8`, namespaces, 2 cores, the CPU lock held; torch and hivemind 20
steps each, projected at geotrain none's 100 steps): geotrain none 1,784.9 tokens/s, 168.4 s to target (100 steps);
geotrain rank8 3,534.9 tokens/s, 32.2 s (40 steps); torch pipelining 884.1 tokens/s, 347.5 s (3.475 s a step; its
losses are geotrain none's: 5.4921 at step 1, 3.2036 at step 20); hivemind 1,824.8 tokens/s, 168.3 s (1.683 s a
step), but its loss after 20 steps was 3.5329 against torch pipelining's 3.2036 (no clip, peers' shares of a global
step uneven), so its real time to target is longer. geotrain's best reaches the target 10.8x sooner than torch
pipelining, geotrain none 2.06x. (rank8 is a boundary-rank model: its capacity cost is in time_to_target.py's
val_loss_at_equal_tokens; an earlier run with int8, the same model as torch's, took 140.4 s, 2.7x sooner.)
Those figures predate tensor_transport; a short check since (--systems geotrain,torch_pipelining --steps 10
--other-steps 3, namespaces, lock held): geotrain none 1,501.7 tokens/s with "tensor_transport": "raw tensor
stream" (every byte its nodes sent, as they counted), torch pipelining 889.3 tokens/s over gloo.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

from geotrain.config import load_config

HERE = Path(__file__).resolve().parent
SYSTEMS = ("geotrain", "geotrain_best", "torch_pipelining", "hivemind")
TORCH_MASTER_PORT = 29500
READY_TIMEOUT_S = 120.0


def _time_to_target() -> ModuleType:
    """bench/time_to_target.py (its links, model, configurations and runs), imported by path: bench/ is not a
    package."""
    if "time_to_target" in sys.modules:
        return sys.modules["time_to_target"]
    spec = importlib.util.spec_from_file_location("time_to_target", HERE / "time_to_target.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["time_to_target"] = module  # dataclasses look their module up while the class body runs
    spec.loader.exec_module(module)
    return module


ttt = _time_to_target()


def worker_settings(steps: int) -> list[str]:
    """The settings of the run config torch pipelining and hivemind train: time_to_target's model and batch."""
    return [*ttt.MODEL, *ttt.TRAIN, f"run.steps={steps}"]


# -- workers: one process per rank or peer, started by the bench in a region (or on loopback) -------------------------


def torch_rank(rank: int, master: str, settings: list[str]) -> None:
    """Rank `rank` of the GPipe pipeline; the last rank prints {"seconds": [...], "losses": [...]}."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from geotrain.node.data import local_tokens
    from geotrain.node.model import loss_fn
    from geotrain.node.stage import StageRuntime
    from geotrain.scheduler.placement import split_layers

    torch.set_num_threads(1)
    cfg = load_config(None, settings)
    steps, t = cfg.run.steps, cfg.train
    world = ttt.STAGES
    start, end = split_layers(cfg.model.total_layers, world)[rank]
    runtime = StageRuntime(cfg, start, end)
    module = nn.Sequential(*(runtime.layers[str(i)] for i in range(start, end)))
    corpus = local_tokens(cfg)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    # scale_grads (the default) divides the summed gradients by the microbatches: geotrain's mean over them.
    schedule = ScheduleGPipe(stage, n_microbatches=t.microbatches, loss_fn=loss_fn)
    seconds, losses = [], []
    for step in range(steps):
        batches = [corpus.batch(seed=cfg.run.seed, step=step, microbatch=mb, size=t.microbatch_size,
                                seq_len=cfg.model.seq_len) for mb in range(t.microbatches)]
        began = time.monotonic()
        if rank == 0:
            schedule.step(torch.cat([x for x, _ in batches]))
        elif rank == world - 1:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=torch.cat([y for _, y in batches]), losses=step_losses)
            losses.append(sum(loss.item() for loss in step_losses) / len(step_losses))
        else:
            schedule.step()
        sq_norm = torch.tensor([sum(p.grad.double().pow(2).sum().item() for p in module.parameters())])
        dist.all_reduce(sq_norm)
        runtime.apply(step, t.clip_coefficient(sq_norm.item()), t.lr_at(step, steps))
        seconds.append(time.monotonic() - began)
    if rank == world - 1:
        print(json.dumps({"seconds": seconds, "losses": losses}), flush=True)
    dist.destroy_process_group()


def hivemind_peer(rank: int, listen_ip: str, settings: list[str], initial_peers: list[str]) -> None:
    """Peer `rank` of hivemind data parallelism; prints its visible addresses as the first line, then, on rank 0,
    {"epochs": E, "seconds": S, "losses": [...]} for the global steps after the first."""
    import hivemind
    import torch

    from geotrain.node.data import local_tokens
    from geotrain.node.model import loss_fn
    from geotrain.node.stage import StageRuntime

    torch.set_num_threads(1)
    cfg = load_config(None, settings)
    steps, t = cfg.run.steps, cfg.train
    peers = ttt.STAGES
    mine = [mb for mb in range(t.microbatches) if mb % peers == rank]
    runtime = StageRuntime(cfg, 0, cfg.model.total_layers)
    corpus = local_tokens(cfg)
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{listen_ip}/tcp/0"], initial_peers=initial_peers, start=True)
    print(json.dumps([str(a) for a in dht.get_visible_maddrs()]), flush=True)
    optimizer = hivemind.Optimizer(
        dht=dht, run_id="versus", params=runtime.layers.parameters(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2),
                                                   weight_decay=t.weight_decay),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: t.lr_at(epoch, steps) / t.lr),
        batch_size_per_step=len(mine) * t.microbatch_size, target_batch_size=t.microbatches * t.microbatch_size,
        matchmaking_time=1.0, averaging_timeout=60.0, average_state_every=10**9, verbose=False,
    )
    first_epoch_at, losses = None, []
    while optimizer.local_epoch < steps:
        epoch = optimizer.local_epoch
        optimizer.zero_grad()
        step_losses = []
        for mb in mine:
            x, y = corpus.batch(seed=cfg.run.seed, step=epoch, microbatch=mb, size=t.microbatch_size,
                                seq_len=cfg.model.seq_len)
            loss = loss_fn(_whole(runtime, x), y) / len(mine)
            loss.backward()
            step_losses.append(loss.item() * len(mine))
        optimizer.step()
        if optimizer.local_epoch != epoch:
            losses.append(sum(step_losses) / len(step_losses))
            if first_epoch_at is None:
                first_epoch_at, first_epoch = time.monotonic(), optimizer.local_epoch
    if rank == 0:
        print(json.dumps({"epochs": optimizer.local_epoch - first_epoch, "seconds": time.monotonic() - first_epoch_at,
                          "losses": losses}), flush=True)
    optimizer.shutdown()
    dht.shutdown()


def _whole(runtime, x):
    """The whole model's logits of x (the runtime holds every layer)."""
    for i in range(runtime.start, runtime.end):
        x = runtime.layers[str(i)](x)
    return x


# -- the bench: start the workers in the regions, collect their lines ---------------------------------------------------


class Places:
    """Where the workers of one system run: rank r in region r of a fresh namespace WAN, or all on loopback."""

    def __init__(self, links: str) -> None:
        self.links = links
        self.log_dir = Path(tempfile.mkdtemp(prefix="bench-versus-"))  # each worker's stderr, as name.log
        self.wan = None
        self._local: list[subprocess.Popen] = []

    def __enter__(self) -> Places:
        if self.links == "namespaces":
            self.wan = ttt.new_wan(ttt._netwan(), 1, self.log_dir)
            self.wan.build()
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._local:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's session: hivemind's p2pd and helpers with it
            except ProcessLookupError:
                pass
            proc.wait()
        if self.wan is not None:
            self.wan.close()

    def ip(self, rank: int) -> str:
        """The address rank `rank` listens on."""
        return self.wan.region_ip(rank) if self.wan is not None else "127.0.0.1"

    def start(self, rank: int, name: str, args: list[str]) -> subprocess.Popen:
        """This file's worker `args` as rank `rank`, with one compute thread; stdout piped."""
        cmd = [sys.executable, str(Path(__file__).resolve()), *args]
        if self.wan is not None:
            # gloo picks its interface by the host name; the region's own is its link to the others.
            return self.wan.spawn(rank, name, ["env", "GLOO_SOCKET_IFNAME=wan", *cmd], pipe=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        self._local.append(proc)
        return proc

    def label(self) -> str:
        """What a line's "links" says of these places."""
        return ttt.links_label("namespaces") if self.wan is not None else "loopback: no emulation (namespaces need root)"


def _result(proc: subprocess.Popen, timeout_s: float, what: str) -> dict:
    """The first JSON object proc prints on a line of its own. Read as it comes, not at the end of its output: the
    processes hivemind forks hold the pipe open a while after the worker exits."""
    found: list[dict] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(b"{"):
                found.append(json.loads(line))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        raise RuntimeError(f"{what} printed no result within {timeout_s:g}s (exit code {proc.poll()})")
    return found[0]


def run_torch(links: str, settings: list[str], timeout_s: float) -> dict:
    """Measured step times and losses of the GPipe pipeline training the run config of `settings`."""
    with Places(links) as places:
        master = f"{places.ip(0)}:{TORCH_MASTER_PORT}"
        ranks = [places.start(r, f"torch-{r}", ["torch-rank", str(r), master, json.dumps(settings)])
                 for r in range(ttt.STAGES)]
        result = _result(ranks[-1], timeout_s, "the last torch pipelining rank")
        result["links"] = places.label()
        return result


def run_hivemind(links: str, settings: list[str], timeout_s: float) -> dict:
    """Global steps, their seconds and losses of hivemind data parallelism training the run config of `settings`,
    as its first peer saw them."""
    with Places(links) as places:
        first = places.start(0, "hivemind-0", ["hivemind-peer", "0", places.ip(0), json.dumps(settings)])
        line = first.stdout.readline()
        if not line:
            raise RuntimeError("the first hivemind peer ended before it printed its addresses")
        maddrs = json.loads(line)
        for rank in range(1, ttt.STAGES):
            places.start(rank, f"hivemind-{rank}",
                         ["hivemind-peer", str(rank), places.ip(rank), json.dumps(settings), *maddrs])
        result = _result(first, timeout_s, "the first hivemind peer")
        result["links"] = places.label()
        return result


def geotrain_line(system: str, config: str, steps: int, links: str, target: float) -> tuple[dict, dict]:
    """(JSON line, time_to_target figures) of one geotrain run of `config`."""
    summary = ttt.train(ttt.CONFIGS[config], steps, links)
    fig = ttt.figures(config, ttt.CONFIGS[config], summary, links, target)
    return {"system": system, "config": config, "links": fig["links"], "tokens_per_s": fig["tokens_per_s"],
            "seconds_to_target": fig["seconds_to_target"], "steps_to_target": fig["steps_to_target"],
            "target_val_loss": target, "tensor_transport": fig["tensor_transport"]}, fig


# What carries each other system's tensors: its only transport, fixed by how the workers are built.
TRANSPORTS = {"torch_pipelining": "gloo TCP (torch.distributed)", "hivemind": "hivemind all-reduce over libp2p"}


def projected_line(system: str, step_seconds: list[float], losses: list[float], links_label: str,
                   reference_steps: int | None, reference: str) -> dict:
    """A line for a system that ran a few steps: its pace, and its time to target at geotrain's steps."""
    mean_s = sum(step_seconds) / len(step_seconds)
    tokens_per_step = ttt.tokens_per_step()
    return {
        "system": system, "links": links_label, "tensor_transport": TRANSPORTS[system],
        "tokens_per_s": round(tokens_per_step / mean_s, 1),
        "seconds_to_target": None if reference_steps is None else round(reference_steps * mean_s, 1),
        "seconds_to_target_from": f"{reference}'s steps_to_target ({reference_steps}) x this system's mean step "
                                  f"seconds ({mean_s:.3f}) over {len(step_seconds)} steps",
        "loss_first": round(losses[0], 4) if losses else None, "loss_last": round(losses[-1], 4) if losses else None,
    }


def parser() -> argparse.ArgumentParser:
    """The bench's command line (the workers' subcommands are parsed by worker())."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", type=ttt.names_in(SYSTEMS, "system(s)"), default=list(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--best", choices=list(ttt.CONFIGS), default="int8",
                   help="the configuration of time_to_target.py's table that is geotrain's best (default int8)")
    p.add_argument("--steps", type=int, default=ttt.STEPS, help=f"geotrain's steps per run (default {ttt.STEPS})")
    p.add_argument("--other-steps", type=int, default=20,
                   help="steps torch pipelining and hivemind run, to measure their pace (default 20)")
    p.add_argument("--target", type=float, default=ttt.TARGET_VAL_LOSS, help="target validation loss")
    p.add_argument("--links", choices=ttt.LINKS, help="namespaces (needs root) or emulator (default: namespaces if root)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each system's run may take")
    p.add_argument("--reference-steps", type=int,
                   help="geotrain none's steps_to_target (time_to_target.py's line), when --systems leaves it out")
    return p


def worker(argv: list[str]) -> None:
    """The workers' subcommands (SETTINGS: the run config's settings as a JSON list): torch-rank RANK MASTER
    SETTINGS; hivemind-peer RANK IP SETTINGS [INITIAL_PEER...]."""
    kind, rank, where, settings, *peers = argv
    if kind == "torch-rank":
        torch_rank(int(rank), where, json.loads(settings))
    else:
        hivemind_peer(int(rank), where, json.loads(settings), peers)


def main() -> None:
    """Run each chosen system and print one JSON line each."""
    if sys.argv[1:2] and sys.argv[1] in ("torch-rank", "hivemind-peer"):
        worker(sys.argv[1:])
        return
    args = parser().parse_args()
    links = args.links or ttt.default_links()
    reference_steps = args.reference_steps  # geotrain none's steps to target, the others' projection
    if "geotrain" in args.systems:
        line, fig = geotrain_line("geotrain", "none", args.steps, links, args.target)
        reference_steps = fig["steps_to_target"]
        print(json.dumps(line), flush=True)
    if "geotrain_best" in args.systems:
        line, _ = geotrain_line("geotrain_best", args.best, args.steps, links, args.target)
        print(json.dumps(line), flush=True)
    reference = "geotrain none" if reference_steps is not None else "no geotrain none run reaching the target"
    if "torch_pipelining" in args.systems:
        result = run_torch(links, worker_settings(args.other_steps), args.timeout)
        print(json.dumps(projected_line("torch_pipelining", result["seconds"], result["losses"], result["links"],
                                        reference_steps, reference)), flush=True)
    if "hivemind" in args.systems:
        result = run_hivemind(links, worker_settings(args.other_steps), args.timeout)
        seconds = [result["seconds"] / result["epochs"]] * result["epochs"]
        print(json.dumps(projected_line("hivemind", seconds, result["losses"], result["links"], reference_steps,
                                        reference)), flush=True)


if __name__ == "__main__":
    main()
