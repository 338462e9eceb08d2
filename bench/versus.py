"""geotrain against the tools a user would otherwise pick, on the same links, model, data and tokens per step.

A cell is a model size and a link setting, each run of the bench one run of every system in it:
- models (time_to_target.SIZES): "small", the 2.7M-parameter byte GPT of time_to_target.py, 3,072 tokens a step;
  "large", a 50.7M-parameter byte GPT (16 blocks of width 512), 768 tokens a step, whose float32 gradients (203 MB)
  cost a replica far more than a step's activations at a stage boundary (1.6 MB each way);
- links: loopback (every process on 127.0.0.1, unshaped), or namespaces (root: time_to_target.py's 3 regions, tbf
  50 Mbit/s, the router delaying every packet between regions 50 ms one way, so gloo's and libp2p's ports see the
  same links as geotrain's).
Systems:
- geotrain (config none) and geotrain_best (--best: configs of time_to_target.py's table), the default plan (the
  planner's choice of pipeline, data parallelism or hybrid; its "stages", "nodes" and "stage_nodes" are in the
  line), a checkpoint only at the end.
- torch_gpipe and torch_1f1b: `torch.distributed.pipelining`'s ScheduleGPipe and Schedule1F1B over gloo, 3 ranks,
  one per region, each with the layers geotrain's uniform placement gives its stage (same model zoo, same seed), the
  step's 6 microbatches as the schedule's microbatches (gradients averaged over them), the global gradient-norm clip
  through one all-reduce, and geotrain's AdamW and learning-rate schedule: the same training as geotrain none's (the
  losses in their lines are equal).
- hivemind: `hivemind.Optimizer` data parallelism, 3 peers (one per region) each with the whole model and 2 of the
  step's 6 microbatches, a global batch of all 6 (target_batch_size), gradients averaged by hivemind's all-reduce
  every global step; AdamW with the same schedule but no gradient clip (hivemind.Optimizer has no place for one).
Every process a run starts is in the bench's session (a process group of its own, process_group=0): Linux gives
each session an equal share of the CPU, so processes in sessions of their own would have weighed unequally.

How each line's seconds_to_target is obtained (its "seconds_to_target_from" says so): steps_to_target x the mean
step seconds its run measured. Each system runs --pace-steps steps (PACE_STEPS: 20 for the small model, 6 for the
large; the campaign below gave the large loopback cell 12, its steps being short enough); its mean step: geotrain's
from one commit to the next (the coordinator's metrics.jsonl: the optimizer step and every control message counted,
the first step and any with a validation pass left out), torch's schedule.step plus the clip's all-reduce and the
optimizer (the first step left out), hivemind's global steps after its first. steps_to_target is that of the line's
math, from validation runs of time_to_target.py (STEPS_TO_TARGET, or --steps-to-target): geotrain none, both torch
schedules and hivemind train none's math, so theirs is none's (hivemind's true count is higher: no clip, and its
loss after 20 steps is above the others', so its projection favours it); rank8 and int8 their own. Validation
windows are a function of the step and these configs are exact, so their steps to target are the same on any links:
one loopback run serves both settings. For the large model no validation run fitted the lock, so its cell compares
by step seconds: between systems that train the same math the ratio of times to target is the ratio of step times,
whatever the steps. A run of every system took ~1.5 minutes for the small model on loopback, ~3.4 on namespaces,
3 to 5.5 for the large model on loopback at 12 steps (hivemind's steps vary most) and ~2.5 on namespaces (without
hivemind).
Each line also says what its measured steps cost the machine: cpu_busy, the share of both cores' time busy over
their wall-clock window (/proc/stat, sampled every 0.25 s: nodes, ranks, peers, coordinator and kernel alike, the
machine being quiet under the lock), and cpu_s_per_step, the core-seconds a step took (cpu_busy x cores x step_s),
no step being shorter than those over the cores.
--record FILE appends each run's line; the bench then prints the cell's lines over every run recorded (median and
spread), and a verdict: geotrain's default and its best against the best of the others (above 1: geotrain sooner).
Run: sudo python bench/versus.py [--size small|large] [--links loopback|namespaces] [--best rank8,int8]
[--pace-steps N] [--record FILE] [--summarize]

Measured on a 2-core machine, each run of a cell under the CPU lock, three runs a cell, the cells' runs interleaved
(round by round), geotrain at b108859 (the nodes' code that of fe8020e, where a stage adds each parameter's gradient
into its float64 sum as backward produces it; this version adds the CPU figures), the large loopback cell with
--pace-steps 12. Step seconds, median [runs]; seconds to the early target (2.8986: none's and every none-math
system's 100 steps, rank8's 40), median [spread]; cpu: cpu_busy and cpu_s_per_step, medians:
- small, loopback: geotrain none 0.3675 [0.3696, 0.3675, 0.3636] (3 stages), 36.8 s [36.4, 37.0], cpu 0.919 and
  0.676; rank8 0.2612 [0.275, 0.2607, 0.2612], 10.4 s [10.4, 11.0]; torch_gpipe 0.3846 [0.3889, 0.3846, 0.3799],
  38.5 s, cpu 0.82 and 0.631; torch_1f1b 0.368 [0.3727, 0.368, 0.3645], 36.8 s [36.4, 37.3], cpu 0.841 and 0.621;
  hivemind 1.8151 [1.9406, 1.6929, 1.8151], 181.5 s.
  {"verdict": {"model": "byte GPT 2.7M (6 blocks of width 192)",
    "links": "loopback: every process on 127.0.0.1, unshaped"}, "compared_by": "seconds_to_target_median",
    "best_other": "torch_1f1b", "geotrain_default_vs_best_other": 1.0, "geotrain_best": "rank8",
    "geotrain_best_vs_best_other": 3.54}
- small, namespaces: geotrain none 0.5986 [0.5986, 0.6009, 0.5867] (the whole model on r0n0, the coordinator's
  region, every run; nothing sent), 59.9 s [58.7, 60.1], cpu 0.526 and 0.63; rank8 0.4314 [0.4353, 0.427, 0.4314],
  17.3 s [17.1, 17.4]; torch_gpipe 2.7101, 271.0 s; torch_1f1b 3.1109, 311.1 s; hivemind 0.9105 [0.8919, 0.9105,
  0.9106], 91.0 s [89.2, 91.1], cpu 0.61 and 1.11.
  {"verdict": {"model": "byte GPT 2.7M (6 blocks of width 192)",
    "links": "namespaces: tbf 50 Mbit/s, router delay 50 ms one way"}, "compared_by": "seconds_to_target_median",
    "best_other": "hivemind", "geotrain_default_vs_best_other": 1.52, "geotrain_best": "rank8",
    "geotrain_best_vs_best_other": 5.26}
- large, loopback (compared by step seconds: no validation run of the large model fitted, and these systems train
  the same math): geotrain none 1.6295 [1.603, 1.6385, 1.6295] (3 stages), cpu 0.931 and 3.034; torch_gpipe 1.6231
  [1.6231, 1.6399, 1.5526], cpu 0.891 and 2.89; torch_1f1b 1.5621 [1.5621, 1.5802, 1.5467], cpu 0.91 and 2.844;
  hivemind 7.0243 [5.8876, 7.6327, 7.0243].
  {"verdict": {"model": "byte GPT 50.7M (16 blocks of width 512)",
    "links": "loopback: every process on 127.0.0.1, unshaped"}, "compared_by": "step_s_median",
    "best_other": "torch_1f1b", "geotrain_default_vs_best_other": 0.96, "geotrain_best": "none",
    "geotrain_best_vs_best_other": 0.96}
- large, namespaces: geotrain none 1.9411 [1.9411, 1.8595, 2.0584] (2 stages, r0n0 and r2n0, twice; 3 once: the
  2.0584), cpu 0.806 and 3.114; torch_gpipe 3.4597 [3.4197, 3.4597, 3.462], cpu 0.425 and 2.94; torch_1f1b 3.636
  [3.6567, 3.636, 3.6291]. hivemind's namespace figures are a lower bound on data parallelism (an earlier campaign's
  one run: 5.06 s a step, which cannot carry the large model's 203 MB of gradients over 50 Mbit/s; most of its
  global steps assembled no all-reduce group), so it is left out.
  {"verdict": {"model": "byte GPT 50.7M (16 blocks of width 512)",
    "links": "namespaces: tbf 50 Mbit/s, router delay 50 ms one way"}, "compared_by": "step_s_median",
    "best_other": "torch_gpipe", "geotrain_default_vs_best_other": 1.78, "geotrain_best": "none",
    "geotrain_best_vs_best_other": 1.78}
What the CPU figures bound. On loopback every system trains the same FLOPs on the same two cores, so a step can be no
shorter than its core-seconds over two: geotrain's large step no shorter than 1.517 s, at best 1.03x torch 1F1B's
1.562 even with no core ever idle (its three nodes and the coordinator keep them 93% busy, 1F1B's ranks 91%); its
small step no shorter than 0.338 s, at best 1.09x. No schedule of the same math comes near 2x there: that takes half
the core-seconds. geotrain's step costs 7% (large) and 9% (small) more core-seconds than 1F1B's: the float64
gradient sums that keep pipelines, replicas and train-local bit-identical (3.1% of all samples under perf against
torch's float32 accumulation's 1.3%), the parameters' checksum that every commit records (blake3, 0.8%), the
interpreter in three nodes and a coordinator (libpython 2.5% against 1.1%). Its busier cores make up for most of it:
level on the small model, 4% behind on the large (0.99x the campaign before). On the large namespaces cell 2x torch
GPipe would take 1.73 s a step: a 2-stage plan's own compute is already about that (each node 8 of the 16 blocks on
a core of its own, half of the 3.03 core-seconds, and the pipeline's fill and drain leave each core one of the 7
microbatch slots idle: 1.77 s; measured 1.86 and 1.94), and a 3-stage plan shares both cores among three
processes (1.52 s at full use) while its first activations and last gradients each cross two boundaries, part of the
machine waiting on them (a crossing: 50 ms plus 42 ms to serialize a microbatch's 262 KB at 50 Mbit/s; measured
2.06 s). On the small namespaces cell 2x hivemind at the late target would take 0.455 s a step
of exact training: one node computes it in 0.60 s, and splitting the model over two regions sends 2.4 MB of
activations each way a step (0.38 s at 50 Mbit/s) plus the crossings; rank8 steps in 0.43 s but never reaches the
late target (time_to_target.py), and int8 neither.
Where the loopback cells' time goes (perf -a over 12 s of steady state, 499 Hz, geotrain at fe8020e, 7fc3f06 before):
backward had handed a stage all of a microbatch's gradients at once (torch.autograd.grad), each added to its sum and
freed, and the allocator gave the next microbatch fresh pages, which the kernel faulted in and zeroed (clear_page
3.0% of all samples against torch's 0.75%); adding each gradient as backward produces it took clear_page to 0.05%
and the matrix multiplies' share of all samples from 71.1% to 76.7%, against torch 1F1B's 73.9%. CPU idle:
geotrain 6.3%, torch 1F1B 10.0%.
Previous campaigns, three runs a cell: at fe8020e small loopback 1.04x, small namespaces 1.64x, large loopback 0.99x,
large namespaces 1.75x; at 0a898e9 0.97x, 1.34x (1.42x at 08a7003), 0.97x, 1.60x; before that 0.99x, 1.21x, 0.88x,
1.56x.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

from geotrain.config import load_config

HERE = Path(__file__).resolve().parent
SYSTEMS = ("geotrain", "geotrain_best", "torch_gpipe", "torch_1f1b", "hivemind")
OTHERS = ("torch_gpipe", "torch_1f1b", "hivemind")
TORCH_SCHEDULES = {"torch_gpipe": "ScheduleGPipe", "torch_1f1b": "Schedule1F1B"}
TORCH_MASTER_PORT = 29500
READY_TIMEOUT_S = 120.0
# Steps each system runs to measure its pace: a large model's step takes seconds on 2 cores.
PACE_STEPS = {"small": 20, "large": 6}
# Validation passes' steps to time_to_target.py's TARGET_VAL_LOSS by config, a function of the config's math alone,
# the same on any links (see the docstring): none's 100 measured again on loopback (passes every 25 steps), rank8's
# 40 on namespaces (every 10; the loopback run crossed it by step 50), int8's in an older run. None for the large
# model: no validation run of it fitted the lock.
STEPS_TO_TARGET: dict[str, dict[str, int]] = {"small": {"none": 100, "rank8": 40, "rank32": 40, "int8": 100},
                                              "large": {}}


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


def worker_settings(steps: int, size: str = "small") -> list[str]:
    """The settings of the run config torch pipelining and hivemind train: time_to_target's model and batch."""
    return [*ttt.size_settings(size), f"run.steps={steps}"]


# -- workers: one process per rank or peer, started by the bench in a region (or on loopback) -------------------------


def torch_rank(rank: int, master: str, schedule_name: str, settings: list[str]) -> None:
    """Rank `rank` of the pipeline under `schedule_name` (of torch.distributed.pipelining); the last rank prints
    {"seconds": [...], "losses": [...], "window": [start, end]} (window: the wall-clock span of the steps after the
    first, seconds since the epoch)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

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
    schedule = getattr(pipelining, schedule_name)(stage, n_microbatches=t.microbatches, loss_fn=loss_fn)
    seconds, losses, window = [], [], [0.0, 0.0]
    for step in range(steps):
        batches = [corpus.batch(seed=cfg.run.seed, step=step, microbatch=mb, size=t.microbatch_size,
                                seq_len=cfg.model.seq_len) for mb in range(t.microbatches)]
        began = time.monotonic()
        if step == 1:
            window[0] = time.time()  # the steps measured start: the first is left out (run_system)
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
    window[1] = time.time()
    if rank == world - 1:
        print(json.dumps({"seconds": seconds, "losses": losses, "window": window}), flush=True)
    dist.destroy_process_group()


def hivemind_peer(rank: int, listen_ip: str, settings: list[str], initial_peers: list[str]) -> None:
    """Peer `rank` of hivemind data parallelism; prints its visible addresses as the first line, then, on rank 0,
    {"epochs": E, "seconds": S, "losses": [...], "window": [start, end]} for the global steps after the first (window:
    their wall-clock span, seconds since the epoch)."""
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
        # A chunk may take seconds to arrive on 2 shared cores (the large model's 203 MB): past next_chunk_timeout
        # (matchmaking_time by default) hivemind drops the sender's part and the peers fall out of step.
        matchmaking_time=1.0, next_chunk_timeout=60.0, averaging_timeout=600.0, average_state_every=10**9,
        verbose=False,
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
                first_epoch_at, first_epoch, window_start = time.monotonic(), optimizer.local_epoch, time.time()
    if rank == 0:
        print(json.dumps({"epochs": optimizer.local_epoch - first_epoch, "seconds": time.monotonic() - first_epoch_at,
                          "losses": losses, "window": [window_start, time.time()]}), flush=True)
    optimizer.shutdown()
    dht.shutdown()


def _whole(runtime, x):
    """The whole model's logits of x (the runtime holds every layer)."""
    for i in range(runtime.start, runtime.end):
        x = runtime.layers[str(i)](x)
    return x


# -- the bench: start the workers in the regions, collect their lines --------------------------------------------------


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
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's group: hivemind's p2pd and helpers with it
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
            # A process group of its own (killpg ends its forks), in this session: Linux gives each session an
            # equal share of the CPU, so workers in sessions of their own would take more than the bench's rivals.
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, process_group=0)
        self._local.append(proc)
        return proc

    def label(self) -> str:
        """What a line's "links" says of these places."""
        return ttt.links_label("namespaces" if self.wan is not None else "loopback")


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


def run_torch(links: str, settings: list[str], timeout_s: float, schedule: str = "ScheduleGPipe") -> dict:
    """Measured step times and losses of the pipeline under `schedule` training the run config of `settings`."""
    with Places(links) as places:
        master = f"{places.ip(0)}:{TORCH_MASTER_PORT}"
        ranks = [places.start(r, f"torch-{r}", ["torch-rank", str(r), master, schedule, json.dumps(settings)])
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


# What carries each other system's tensors: its only transport, fixed by how the workers are built.
TRANSPORTS = {"torch_gpipe": "gloo TCP (torch.distributed)", "torch_1f1b": "gloo TCP (torch.distributed)",
              "hivemind": "hivemind all-reduce over libp2p"}


class CpuMeter:
    """The machine's CPU, sampled from /proc/stat by a thread of its own while the bench runs: how busy every core
    was over a span of wall-clock time (a run's measured steps), whoever used it (nodes, ranks, peers, coordinator,
    kernel). The bench runs under the CPU lock, so what is busy is the system measured."""

    INTERVAL_S = 0.25

    def __init__(self, stat: Path = Path("/proc/stat")) -> None:
        self._stat = stat
        self.cores = 0  # the cores the aggregate line sums (its cpuN lines)
        self._samples: list[tuple[float, int, int]] = []  # (time.time(), busy jiffies, all jiffies)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def __enter__(self) -> CpuMeter:
        if self._stat.exists():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def sample(self) -> None:
        """Take one sample: the aggregate line's jiffies, idle and iowait counted as not busy."""
        lines = self._stat.read_text().splitlines()
        self.cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        fields = [int(x) for x in lines[0].split()[1:]]
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user's)
        self._samples.append((time.time(), total - fields[3] - fields[4], total))

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.INTERVAL_S):
                return

    def busy(self, start: float, end: float) -> float | None:
        """The share of all cores' time that was busy between the first and the last sample within [start, end];
        None with fewer than two samples there."""
        inside = [s for s in self._samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])


def with_cpu(line: dict, window: list[float] | None, meter: CpuMeter) -> dict:
    """The line with the CPU its measured steps kept busy: cpu_busy (the share of every core's time over their
    wall-clock window) and cpu_s_per_step (core-seconds a step: what a system's step costs the machine, idle cores
    not counted; a step can be no shorter than it divided by the cores)."""
    busy = meter.busy(*window) if window else None
    return {**line, "cpu_busy": None if busy is None else round(busy, 3),
            "cpu_s_per_step": None if busy is None else round(busy * meter.cores * line["step_s"], 3)}


def pace_line(system: str, step_seconds: list[float], size: str, links_label: str) -> dict:
    """What every line says: the system, model and links, and its pace over the steps measured."""
    mean_s = sum(step_seconds) / len(step_seconds)
    return {"system": system, "model": ttt.SIZES[size], "links": links_label, "step_s": round(mean_s, 4),
            "steps_measured": len(step_seconds), "tokens_per_s": round(ttt.tokens_per_step(size) / mean_s, 1)}


def geotrain_line(system: str, config: str, steps: int, links: str, size: str, meter: CpuMeter) -> dict:
    """The line of one geotrain run of `config` under the default plan, its pace from commit to commit."""
    summary = ttt.train(ttt.CONFIGS[config], steps, links, size=size, eval_every=0)
    line = {**pace_line(system, summary["step_s"], size, ttt.links_label(links)), "config": config,
            "tensor_transport": ttt.tensor_transport(summary), "stages": summary["stages"], "nodes": summary["nodes"],
            "stage_nodes": summary["stage_nodes"],
            "averaging_bytes_per_step": round(summary["averaging_bytes"] / summary["steps"])}
    return with_cpu(line, summary["step_window"], meter)


def other_line(system: str, step_seconds: list[float], losses: list[float], size: str, links_label: str) -> dict:
    """The line of one run of torch pipelining or hivemind: its pace, and its losses to compare with geotrain's."""
    return {**pace_line(system, step_seconds, size, links_label), "tensor_transport": TRANSPORTS[system],
            "loss_first": round(losses[0], 4) if losses else None,
            "loss_last": round(losses[-1], 4) if losses else None}


def math_of(line: dict) -> str:
    """The configuration whose steps to target a line's system takes: its own for geotrain, none's for the others
    (they train none's math)."""
    return line.get("config", "none")


def with_target(line: dict, steps_to_target: dict[str, int]) -> dict:
    """The line with its time to target: the steps its math needs times its mean step seconds."""
    steps = steps_to_target.get(math_of(line))
    return {**line, "steps_to_target": steps,
            "seconds_to_target": None if steps is None else round(steps * line["step_s"], 1),
            "seconds_to_target_from": f"{math_of(line)}'s steps_to_target x this run's mean step seconds"}


def cell_lines(records: list[dict], steps_to_target: dict[str, int]) -> list[dict]:
    """One line per system (and geotrain configuration) of the runs in `records` (one cell: a model and links): the
    median and spread of its time to target, then a verdict line comparing geotrain with the best of the others."""
    groups: dict[tuple[str, str | None], list[dict]] = {}
    for line in records:
        groups.setdefault((line["system"], line.get("config")), []).append(line)
    out = []
    for (system, config), runs in groups.items():
        paces = [r["step_s"] for r in runs]
        steps = steps_to_target.get(math_of(runs[0]))
        seconds = [round(steps * p, 1) for p in paces] if steps is not None else []
        out.append({
            "system": system, **({"config": config} if config else {}), "model": runs[0]["model"],
            "links": runs[0]["links"], "tensor_transport": " / ".join(sorted({r["tensor_transport"] for r in runs})),
            "runs": len(runs), "step_s_median": round(statistics.median(paces), 4), "step_s_runs": paces,
            "steps_to_target": steps,
            "seconds_to_target_median": round(statistics.median(seconds), 1) if seconds else None,
            "seconds_to_target_spread": [min(seconds), max(seconds)] if seconds else None,
            **{f"{key}_median": _median_of(runs, key) for key in ("cpu_busy", "cpu_s_per_step")},
        })
    return [*out, verdict(out)]


def _median_of(runs: list[dict], key: str) -> float | None:
    """The median of `key` over the runs, None unless every run has it (runs recorded before the bench measured it
    have not)."""
    values = [r.get(key) for r in runs]
    return None if None in values else round(statistics.median(values), 3)


def verdict(lines: list[dict]) -> dict:
    """geotrain's default (config none) and its best configuration against the best of the others, by median time
    to target (ratios above 1: geotrain sooner); without steps to target, by median step seconds among the lines that
    train none's math (for those the ratio of times to target is that of their step times, whatever the steps)."""
    key = "seconds_to_target_median"
    if not all(line[key] is not None for line in lines):
        key = "step_s_median"
        lines = [line for line in lines if math_of(line) == "none"]
    others = [line for line in lines if line["system"] in OTHERS]
    ours = [line for line in lines if line["system"] not in OTHERS]
    if not others or not ours:
        return {"verdict": "needs geotrain and another system"}
    best_other = min(others, key=lambda line: line[key])
    default = next((line for line in ours if line["system"] == "geotrain"), None)
    best = min(ours, key=lambda line: line[key])

    def ratio(line: dict | None) -> float | None:
        return None if line is None else round(best_other[key] / line[key], 2)

    return {"verdict": {"model": best_other["model"], "links": best_other["links"]}, "compared_by": key,
            "best_other": best_other["system"], "geotrain_default_vs_best_other": ratio(default),
            "geotrain_best": best.get("config"), "geotrain_best_vs_best_other": ratio(best)}


def parse_steps(text: str) -> dict[str, int]:
    """--steps-to-target: CONFIG=STEPS,..."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(p) != 2 or p[0] not in ttt.CONFIGS or not p[1].isdigit() for p in pairs):
        raise argparse.ArgumentTypeError(f"expected CONFIG=STEPS,... with configs of {', '.join(ttt.CONFIGS)}")
    return {name: int(steps) for name, steps in pairs}


def parser() -> argparse.ArgumentParser:
    """The bench's command line (the workers' subcommands are parsed by worker())."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", type=ttt.names_in(SYSTEMS, "system(s)"), default=list(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--best", type=ttt.names_in(ttt.CONFIGS, "configuration(s)"), default=["rank8"],
                   help="the configurations of time_to_target.py's table that are geotrain's best (default rank8)")
    p.add_argument("--size", choices=list(ttt.SIZES), default="small", help="the model (default small)")
    p.add_argument("--links", choices=("loopback", "namespaces"),
                   help="loopback, or namespaces (needs root; the default where it can build them)")
    p.add_argument("--pace-steps", type=int, help="steps each system runs (default: small 20, large 6)")
    p.add_argument("--steps-to-target", type=parse_steps, default={},
                   help="CONFIG=STEPS,...: validation steps to the target, over the size's STEPS_TO_TARGET")
    p.add_argument("--record", type=Path,
                   help="append each run's line to this JSONL file, then print the cell's medians over it")
    p.add_argument("--summarize", action="store_true", help="run nothing: print the cell's medians of --record")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each system's run may take")
    return p


def worker(argv: list[str]) -> None:
    """The workers' subcommands (SETTINGS: the run config's settings as a JSON list): torch-rank RANK MASTER
    SCHEDULE SETTINGS; hivemind-peer RANK IP SETTINGS [INITIAL_PEER...]."""
    if argv[0] == "torch-rank":
        _, rank, master, schedule, settings = argv
        torch_rank(int(rank), master, schedule, json.loads(settings))
    else:
        _, rank, ip, settings, *peers = argv
        hivemind_peer(int(rank), ip, json.loads(settings), peers)


def run_system(
    system: str, config: str | None, args: argparse.Namespace, links: str, steps: int, meter: CpuMeter
) -> dict:
    """One run of a system; its line without the target."""
    if config is not None:
        return geotrain_line(system, config, steps, links, args.size, meter)
    settings = worker_settings(steps, args.size)
    if system in TORCH_SCHEDULES:
        result = run_torch(links, settings, args.timeout, TORCH_SCHEDULES[system])
        # The first step (gloo's connections, the first allocations) left out, as geotrain's first commit is.
        line = other_line(system, result["seconds"][1:], result["losses"], args.size, result["links"])
    else:
        result = run_hivemind(links, settings, args.timeout)
        seconds = [result["seconds"] / result["epochs"]] * result["epochs"]  # its global steps after the first
        line = other_line(system, seconds, result["losses"], args.size, result["links"])
    return with_cpu(line, result["window"], meter)


def main() -> None:
    """Run each chosen system once and print its line; with --record, then the cell's medians."""
    if sys.argv[1:2] and sys.argv[1] in ("torch-rank", "hivemind-peer"):
        worker(sys.argv[1:])
        return
    args = parser().parse_args()
    links = args.links or ("namespaces" if ttt.default_links() == "namespaces" else "loopback")
    steps_to_target = {**STEPS_TO_TARGET[args.size], **args.steps_to_target}
    steps = args.pace_steps or PACE_STEPS[args.size]
    runs = [("geotrain", "none")] if "geotrain" in args.systems else []
    runs += [("geotrain_best", c) for c in args.best] if "geotrain_best" in args.systems else []
    runs += [(s, None) for s in OTHERS if s in args.systems]
    with CpuMeter() as meter:
        for system, config in [] if args.summarize else runs:
            try:
                line = with_target(run_system(system, config, args, links, steps, meter), steps_to_target)
            except (RuntimeError, subprocess.SubprocessError) as e:  # one system's failed run: the others still run
                print(json.dumps({"system": system, "config": config, "model": ttt.SIZES[args.size],
                                  "links": ttt.links_label(links), "failed": str(e)[-500:]}), flush=True)
                continue
            print(json.dumps(line), flush=True)
            if args.record:
                with args.record.open("a") as f:
                    f.write(json.dumps(line) + "\n")
    if args.record:
        cell = (ttt.SIZES[args.size], ttt.links_label(links))
        records = [json.loads(x) for x in args.record.read_text().splitlines() if x.strip()]
        for line in cell_lines([r for r in records if (r["model"], r["links"]) == cell], steps_to_target):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
