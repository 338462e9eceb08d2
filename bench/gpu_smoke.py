"""GPU smoke check (issue 29): a pipeline against train-local on the same GPU, exactness and speed.

Checks, each one JSON line with "check" and, for the exactness ones, "ok":
- exact-fp32 and exact-bf16: a 3-stage pipeline of node processes on --device against train-local on it, in fp32 and
  bf16. What the README promises, on one GPU model, torch build and driver with the deterministic settings a CUDA
  device gets (node.device.make_exact): final parameters bit for bit, and each step's loss up to the order of the
  float64 sum over microbatches (the coordinator adds them as they finish, train-local 0..M-1): LOSS_REL.
- exact-two-gpus (two or more CUDA GPUs of one model): a 2-stage pipeline, one node on cuda:0 and one on cuda:1,
  against train-local on cuda:0, held to the same promise.
- throughput (CUDA only, or --large): a llama of about 85M parameters in bf16, pipelined over two nodes (on cuda:0 and
  cuda:1 where there are two GPUs), and train-local: tokens/s of each, and each GPU's busy share during the
  pipeline's steps (nvidia-smi's utilization, sampled from the first step's commit to the last; null without
  nvidia-smi). A figure, not a check.

Exit codes: 0 every check held; 1 an exactness check failed; 3 skipped, no CUDA device (say --device cpu to run
the checks on the CPU: the comparison logic, with the CPU as the device). The defaults fit in about 8 minutes on one
H200 (not measured: no GPU was lent when this was written).

No GPU has run it yet. On the CPU (this version, --device cpu, defaults): exact-fp32 and exact-bf16 bit_equal,
max_abs_diff 0.0, loss_max_rel_diff 0.0, exit 0. With one bit of one train-local parameter flipped after training
(a local change, not kept; --steps 5): both checks bit_equal false, max_abs_diff 1.86e-9, exit 1. --large with
--large-set model.n_layers=2 d_model=64 n_heads=4 seq_len=64 train.microbatch_size=2 (140k parameters, 5 steps):
17,945.9 tokens/s pipelined over two CPU nodes, 18,205.5 in train-local, busy share null (no nvidia-smi).

Run: bench/gpu_smoke.sh [--device cuda] [--steps 20] [--large-steps 20] [--large] [--large-set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from geotrain.config import RunConfig, load_config
from geotrain.localnodes import LocalNodes
from geotrain.node.data import Corpus
from geotrain.node.device import DeviceError, describe, device_name, resolve_device, supports
from geotrain.node.local import train_local
from geotrain.protocol.auth import new_token
from geotrain.scheduler.service import CoordinatorProcess, fetch_model_state

EXIT_FAILED, EXIT_SKIPPED = 1, 3
LOSS_REL = 1e-12
"""How far a step's loss may differ, relative: the float64 mean of bit-equal microbatch losses in another order."""

_RUN = [
    "run.eval_every=0", "run.eval_microbatches=1", "scheduler.placement=uniform",
    "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=5",
]
EXACT = [*_RUN, "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=64",
         "train.microbatch_size=4", "train.microbatches=6", "train.inflight=3"]
LARGE = [*_RUN, "model.family=llama", "model.n_layers=12", "model.d_model=768", "model.n_heads=12",
         "model.seq_len=512", "train.microbatch_size=8", "train.microbatches=8", "train.inflight=4",
         "train.precision=bf16"]


@dataclass
class Trained:
    """A run's step losses, final parameters, tokens/s and each GPU's busy share during its steps."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    tokens_per_s: float
    busy_share: dict[str, float] | None = None


class BusySampler:
    """Samples the utilization of GPUs `indices` with nvidia-smi while `active()` holds (none, or no nvidia-smi:
    nothing is sampled, and the share is None)."""

    def __init__(self, indices: list[int], active: Callable[[], bool]) -> None:
        self.indices, self.active = indices, active
        self.samples: dict[str, list[float]] = {f"cuda:{i}": [] for i in indices}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BusySampler:
        if self.indices and shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        ids = ",".join(map(str, self.indices))
        query = ["nvidia-smi", f"--id={ids}", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.2):
            if self.active():
                out = subprocess.run(query, capture_output=True, text=True, timeout=10)
                lines = out.stdout.split()
                if out.returncode == 0 and len(lines) == len(self.indices) and all(v.isdigit() for v in lines):
                    for samples, value in zip(self.samples.values(), lines):
                        samples.append(int(value) / 100)

    def share(self) -> dict[str, float] | None:
        """Each GPU's mean sampled utilization, 0..1."""
        if not self.samples or not all(self.samples.values()):
            return None
        return {gpu: round(sum(s) / len(s), 3) for gpu, s in self.samples.items()}


def config(settings: list[str], steps: int, stages: int, *extra: str) -> RunConfig:
    """A run of `steps` steps on `stages` stages."""
    cfg = load_config(None, [*settings, f"run.steps={steps}", f"scheduler.stages={stages}", *extra])
    cfg.scheduler.min_nodes = stages
    cfg.data.fingerprint = Corpus.load(cfg.data).fingerprint
    return cfg


def local(cfg: RunConfig, device: torch.device) -> Trained:
    """train-local on `device` (one CPU thread on the CPU, as the node processes compute)."""
    losses: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runtime, summary = train_local(cfg, lambda r: losses.append(r["loss"]), device)
    finally:
        torch.set_num_threads(threads)
    params = {name: p.detach().cpu().clone() for name, p in runtime.named_state()}
    return Trained(losses, params, summary["tokens_per_s"])


def pipeline(cfg: RunConfig, devices: list[str], log_dir: Path) -> Trained:
    """The run on one node process per device in `devices` (one stage each)."""
    token = new_token()
    host = CoordinatorProcess(cfg, token, "127.0.0.1:0")
    coordinator = host.coordinator
    flags = {f"node-{i + 1}": ["--device", d] for i, d in enumerate(devices)}
    nodes = LocalNodes(f"127.0.0.1:{host.port}", token, log_dir, flags)
    host.server.start()
    gpus = sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})
    try:
        for node_id in flags:
            nodes.start(node_id)
        with BusySampler(gpus, lambda: 1 <= coordinator.step < cfg.run.steps) as sampler:  # after the first commit
            summary = coordinator.run()
        losses = [record.loss for record in coordinator.store.steps()]
        params = fetch_model_state(coordinator.plan, token, summary.steps, coordinator.key)
        return Trained(losses, params, summary.tokens_per_s, sampler.share())
    finally:
        coordinator.stop_requested.set()
        coordinator.shutdown_nodes("gpu smoke over", grace_s=1.0)
        nodes.stop_all()
        host.close()


def compare(reference: Trained, pipelined: Trained) -> dict:
    """How the pipeline's run differs from train-local's, and whether that is within the README's promise: every
    parameter bit for bit, every step's loss within LOSS_REL."""
    names = sorted(reference.params)
    same_names = names == sorted(pipelined.params)
    bit_equal = same_names and all(torch.equal(reference.params[n], pipelined.params[n]) for n in names)
    diff = max((float((reference.params[n].double() - pipelined.params[n].double()).abs().max()) for n in names
                if same_names), default=float("inf"))
    if len(reference.losses) == len(pipelined.losses) and reference.losses:
        loss_rel = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(reference.losses, pipelined.losses))
    else:
        loss_rel = float("inf")
    return {"bit_equal": bit_equal, "max_abs_diff": diff, "loss_max_rel_diff": loss_rel,
            "ok": bit_equal and loss_rel <= LOSS_REL}


def exact_check(name: str, settings: list[str], devices: list[str], steps: int, log_dir: Path) -> dict:
    """One exactness check: the pipeline on `devices` against train-local on the first of them."""
    started = time.monotonic()
    pipelined = pipeline(config(settings, steps, len(devices)), devices, log_dir)
    reference = local(config(settings, steps, len(devices)), torch.device(devices[0]))
    return {"check": name, "devices": devices, "steps": steps, **compare(reference, pipelined),
            "wall_s": round(time.monotonic() - started, 1)}


def throughput(devices: list[str], steps: int, log_dir: Path, overrides: list[str]) -> dict:
    """The large model's tokens/s pipelined and in train-local, and each GPU's busy share in the pipeline's steps."""
    pipelined = pipeline(config(LARGE, steps, len(devices), *overrides), devices, log_dir)
    reference = local(config(LARGE, steps, 1, *overrides), torch.device(devices[0]))
    params = sum(t.numel() for t in reference.params.values())
    return {"check": "throughput", "devices": devices, "steps": steps, "params": params,
            "pipeline_tokens_per_s": round(pipelined.tokens_per_s, 1),
            "train_local_tokens_per_s": round(reference.tokens_per_s, 1),
            "pipeline_gpu_busy_share": pipelined.busy_share}


def main() -> int:
    """Run the checks that this machine can, one JSON line each; the exit code says how they went."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the checks' logic on the CPU)")
    parser.add_argument("--steps", type=int, default=20, help="steps of each exactness run")
    parser.add_argument("--large-steps", type=int, default=20, help="steps of the throughput runs")
    parser.add_argument("--large", action="store_true", help="run the throughput check on a CPU too (slow)")
    parser.add_argument("--large-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the throughput run's model (e.g. a small one, to try the check on a CPU)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        print(f"gpu_smoke: skipped: {e}", file=sys.stderr)
        print(json.dumps({"skipped": str(e)}))
        return EXIT_SKIPPED
    print(json.dumps({"device": describe(device), "torch": torch.__version__, "cuda": torch.version.cuda}), flush=True)
    spec = str(device)
    checks = [("exact-fp32", EXACT, [spec] * 3)]
    if supports(device, "bf16"):
        checks.append(("exact-bf16", [*EXACT, "train.precision=bf16"], [spec] * 3))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    two = ["cuda:0", "cuda:1"]
    if gpus >= 2 and device_name(torch.device(two[0])) == device_name(torch.device(two[1])):
        checks.append(("exact-two-gpus", EXACT, two))
    failed = False
    with tempfile.TemporaryDirectory(prefix="geotrain-gpu-smoke-") as tmp:
        for name, settings, devices in checks:
            result = exact_check(name, settings, devices, args.steps, Path(tmp))
            failed |= not result["ok"]
            print(json.dumps(result), flush=True)
        if device.type == "cuda" or args.large:
            devices = two if gpus >= 2 else [spec] * 2
            print(json.dumps(throughput(devices, args.large_steps, Path(tmp), args.large_set)), flush=True)
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
