"""Verified compute against adversarial stage holders: a live pipeline (a real coordinator, local node processes) in
which one node computes wrong through a hook this benchmark installs in that node's process only (never in the node's
own code), and an honest run that measures what verification costs.

Cases (--cases, default all):
- shift: the middle stage of three adds a small fixed direction to its output activations on every microbatch;
- shift_1_in_20: the same on 1 microbatch in 20;
- lazy: the middle stage returns zero parameter gradients (skips its parameters' backward);
- poison: a replica of the first of two stages adds a fixed direction to its parameter gradients, the gradient it
  takes to averaging, with compression.replica_robust = centered_clip;
- honest: no adversary, --honest-steps steps at verify.fraction = 0.05 (the README's) and the same run at
  verify.fraction = 0, --pairs times in alternating order: false alarms, the cost in tokens/s (each pair's, and
  their median: one pair's cost moves by several points with the machine's other load), and the verifiers' fetch
  and recompute milliseconds per check (ms_per_check; the fetch includes the wait for the target's apply).

One JSON line per case: the step whose work was caught and the step the run was at when the verdict came, steps rolled
back, whether the adversary was evicted, and the final max |diff| of the parameters against train-local (0.0: all its
work was undone and redone honestly). Adversarial cases run at --fraction (default 0.25) to keep them short; the
detection each fraction buys is in the README. Run under the CPU lock: python bench/verify.py [--steps 40]

This version (on the CPU a stage's worker hashes its commitments of a step in one batch at the commit, where it finds
the hashes' code and data in its caches, rather than a few after each task, whose compute evicted them; a small
tensor's digest never lets go of the GIL: its bytes are copied out and hashed in pieces under blake3's 2048-byte
release, and a microbatch's parameter gradients are streamed into one hash, not joined by torch.cat; the digests are
bit for bit those of before), under the CPU lock at 0.05, --pairs 5, three invocations: costs 6.6, 4.0, 8.2, 17.7,
9.2%, median 8.2% (e.g. 5,121.9 tokens/s against 5,576.9 off); 7.9, 7.7, 7.1, 3.7, 8.6%, median 7.7%; 6.5, 9.2,
10.5, 0.0, 3.7%, median 6.5%: under the 10% goal; 0 false alarms, nobody evicted, max |diff| 0.0 in each; 7.6 to 8.2
ms a check. On the merged head, whose local nodes share the bench's session (localnodes.py), off runs 6,420 to
6,767 tokens/s against 5,189 to 5,813 on the branch before it (the session, likely; one run): 3.8, 10.3, 6.8, 8.9, 5.8%, median 6.8%, 6.2 ms a check.
The version before: medians 10.7, 9.7, 9.3 and 9.8%. Adversaries at --steps 40 (shift_1_in_20: 120) and
0.25: every one caught (the work of steps 0, 21, 0, 1: shift, shift_1_in_20, lazy, poison), verdicts at steps 3, 24,
3, 4, as many rolled back, evicted, nobody else evicted, max |diff| 0.0.

Where the cost lies, measured in the nodes (thread CPU and wall time per call, one 300-step run at 0.05 each):
- before this version, the worker's hashes took 1.6 ms of CPU a step over the three nodes, 74 to 102 us a call of a
  few hashes: each call came after a task's compute and found the caches cold (outside the bench: one activation's
  digest 25 us after a microbatch's compute, 4.4 us in a loop; a step's 20 hashes at the middle stage 0.22 ms in one
  batch, 0.64 ms one task at a time). py-spy had also found them waiting to take back the GIL that blake3 (from 2048
  bytes), torch.cat and torch's numpy() let go of: a 2 KiB digest beside one busy thread took 80 to 800 us.
- batched at the commit they take 1.1 ms a step (0.25 to 0.47 ms a node, on the commit's path, in parallel);
- a check costs 1.3 to 3.2 ms of CPU for its recompute (1.1 ms in a quiet process: the forward and backward 0.5 ms,
  reloading the parameters and their checksum, a torch call or six per tensor, most of the rest) and 0.8 to 0.9 ms for
  its evidence's gRPC call (the target's server side not counted), at 0.6 checks a step;
- the rest (received, sent, keep, the commitments' report) some 0.3 ms a step.
Each of 3 nodes and the coordinator on 2 shared cores takes its share of a step, so this CPU is time. On a model whose
microbatches take longer than these 0.5 ms a stage, the hashes and calls cost the same and the recompute f of the
compute, so the share falls. What would cut the rest: the evidence over the raw tensor stream rather than a gRPC call
(protocol/tensorstream.py), a recompute that keeps the layout of the parameters it reloads and hashes them without a
torch call per tensor. The honest runs need limits.calls_per_s above the default 200 (TINY): at about 40 steps/s the
data head makes some 240 calls/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from exactness import local_reference  # a sibling: run as bench/verify.py
from geotrain.config import RunConfig, load_config
from geotrain.localnodes import LocalNodes, NodeProcess
from geotrain.node.data import Corpus
from geotrain.protocol.auth import new_token
from geotrain.scheduler.service import CoordinatorProcess, fetch_model_state
from tests.attackers import hooked_node

TINY = [
    "model.n_layers=3", "model.d_model=16", "model.n_heads=2", "model.seq_len=16", "train.microbatch_size=2",
    "train.microbatches=4", "train.inflight=4", "run.eval_every=0", "run.eval_microbatches=1",
    "scheduler.placement=uniform", "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=2.5",
    "profile.layer_repeats=1",
    # About 40 steps/s, each some 6 calls from the data head: over limits.calls_per_s's 200 once the burst is spent
    # (a StepApplied refused that way leaves the run waiting for it until the step times out).
    "limits.calls_per_s=1000",
]
ADVERSARY = "node-9"
HONEST_FRACTION = 0.05
_SHIFT = 1e-3  # the direction's size per coordinate: far below the activations' own spread


def _install(kind: str) -> None:
    """The adversary's hook, in its own process: wraps the stage's compute so it goes wrong as `kind` says."""
    from geotrain.node.stage import StageRuntime

    forward, backward = StageRuntime.forward, StageRuntime._backward

    def shifted(self, key, x, tokens=None):
        out = forward(self, key, x, tokens)
        step, microbatch = key
        corrupt = kind == "shift" or (step * self.cfg.train.microbatches + microbatch) % 20 == 7
        return out + _SHIFT if corrupt and not self.is_last else out

    def wrong_grads(self, key, pending, root, root_grad):
        honest = self.on_param_grads

        def hook(k, grads):
            for g in grads:
                if g is not None:
                    g.zero_() if kind == "lazy" else g.add_(_SHIFT * 100)
            if honest is not None:
                honest(k, grads)

        self.on_param_grads = hook
        try:
            return backward(self, key, pending, root, root_grad)
        finally:
            self.on_param_grads = honest

    if kind in ("shift", "shift_1_in_20"):
        StageRuntime.forward = shifted
    else:
        StageRuntime._backward = wrong_grads


def _start_adversary(kind: str, coordinator: str, token: str, log_dir: Path) -> NodeProcess:
    """The adversarial node: `geotrain join` in a process of its own with the hook installed first."""
    return hooked_node(_install, kind, ADVERSARY, coordinator, token, log_dir, log_dir / ADVERSARY)


def live(cfg: RunConfig, honest: int, kind: str | None, log_dir: Path, position: int = 1) -> dict:
    """Train cfg on `honest` honest nodes (node-1..) plus the adversary of `kind`, which registers after `position`
    of them (uniform placement gives the i-th node to register stage i, and a node beyond the stages to the first
    stage with the fewest nodes); returns what the run showed."""
    cfg.scheduler.min_nodes = honest + (kind is not None)
    cfg.data.fingerprint = Corpus.load(cfg.data).fingerprint
    token = new_token()
    events: list[tuple[str, dict]] = []
    host = CoordinatorProcess(cfg, token, "127.0.0.1:0", on_event=lambda k, d: events.append((k, d)))
    coordinator = host.coordinator
    address = f"127.0.0.1:{host.port}"
    nodes = LocalNodes(address, token, log_dir)
    host.server.start()
    procs = []
    try:
        for i in range(honest):
            nodes.start(node_id := f"node-{i + 1}")
            while node_id not in coordinator.members:
                time.sleep(0.05)
            if i + 1 == position and kind is not None:
                procs.append(_start_adversary(kind, address, token, log_dir))
                while ADVERSARY not in coordinator.members:
                    time.sleep(0.05)
        summary = coordinator.run()
        state = fetch_model_state(coordinator.plan, token, summary.steps, coordinator.key)
        status = coordinator.status()
        verdicts = [e for e in coordinator.store.events() if e[1] == "verdict"]
    finally:
        coordinator.stop_requested.set()
        coordinator.shutdown_nodes("benchmark over", grace_s=1.0)
        nodes.stop_all()
        for p in procs:
            p.terminate()
            p.wait(10)
        host.close()
    rollbacks = [d for k, d in events if k == "rollback"]
    return {
        "state": state, "tokens_per_s": summary.tokens_per_s, "rollbacks": rollbacks, "verdicts": verdicts,
        "evicted": [d["node_id"] for k, d in events if k == "evicted"], "verify": status.verify,
        "failures": coordinator.failures,
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def adversarial(kind: str, steps: int, fraction: float, log_dir: Path) -> dict:
    """One adversarial case's line."""
    # Three stages of one node and a spare, which takes the adversary's stage over; or two stages, the second of two
    # replicas, one the adversary.
    settings = [*TINY, f"run.steps={steps}", f"verify.fraction={fraction}", "scheduler.stages=3",
                "scheduler.replicas=1"]
    honest_nodes, position = 3, 1
    if kind == "poison":
        settings += ["compression.replica_robust=centered_clip", "scheduler.stages=2", "scheduler.replicas=2"]
        honest_nodes, position = 2, 2  # the adversary joins last: a replica of stage 0, beside node-1
    started = time.monotonic()
    run = live(load_config(None, settings), honest_nodes, kind, log_dir, position)
    diff = _max_diff(run["state"], local_reference(load_config(None, settings)))
    rollback = run["rollbacks"][0] if run["rollbacks"] else None
    # A verdict's detail begins "step N stage S microbatch M of NODE": N is the step whose work was found wrong.
    caught = next((int(v[3].split()[1]) for v in run["verdicts"] if v[2] == ADVERSARY), None)
    return {
        "case": kind, "fraction": fraction, "steps": steps, "caught": caught,
        "verdict_at_step": rollback["from"] if rollback else None,
        "steps_rolled_back": rollback["from"] - rollback["to"] if rollback else 0,
        "evicted": ADVERSARY in run["evicted"], "wrongly_evicted": [n for n in run["evicted"] if n != ADVERSARY],
        "checks": run["verify"].checks, "mismatches": run["verify"].mismatches,
        "max_abs_diff": diff, "wall_s": round(time.monotonic() - started, 1),
    }


def honest(steps: int, log_dir: Path, fraction: float = HONEST_FRACTION, pairs: int = 3) -> dict:
    """The honest line: false alarms at `fraction`, and tokens/s with and without verification, in `pairs` pairs of
    runs whose order alternates (on, off; off, on; ...), so that what drifts over the bench's minutes (other load on
    the machine) falls on both; the cost is the median of the pairs' costs."""

    def config(f: float) -> RunConfig:  # a fresh one per run: live() fills in its nodes and corpus
        return load_config(None, [*TINY, f"run.steps={steps}", f"verify.fraction={f}"])

    reference = local_reference(config(fraction))
    tokens_per_s, costs, checks, check_s, false_alarms, evicted, diff = [], [], 0, 0.0, 0, [], 0.0
    for i in range(pairs):
        runs = {f: live(config(f), 3, None, log_dir) for f in ((fraction, 0.0) if i % 2 == 0 else (0.0, fraction))}
        on, off = runs[fraction], runs[0.0]
        checks += on["verify"].checks
        check_s += on["verify"].seconds
        false_alarms += on["verify"].mismatches + on["verify"].commitments_refused
        evicted += on["evicted"] + off["evicted"]
        diff = max(diff, _max_diff(on["state"], reference))
        tokens_per_s.append([round(on["tokens_per_s"], 1), round(off["tokens_per_s"], 1)])
        costs.append(round(1 - on["tokens_per_s"] / off["tokens_per_s"], 4))
    return {
        "case": "honest", "fraction": fraction, "steps": steps, "pairs": pairs, "checks": checks,
        "ms_per_check": round(1000 * check_s / checks, 2) if checks else None, "false_alarms": false_alarms,
        "evicted": evicted, "max_abs_diff": diff, "tokens_per_s_on_off": tokens_per_s,
        "costs": costs, "cost": statistics.median(costs),
    }


def main() -> None:
    """Run each case and print its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="shift,shift_1_in_20,lazy,poison,honest")
    parser.add_argument("--steps", type=int, default=40, help="steps of each adversarial case")
    parser.add_argument("--honest-steps", type=int, default=300)
    parser.add_argument("--honest-fraction", type=float, default=HONEST_FRACTION,
                        help="the honest run's verify.fraction (1e-6: commitments with next to no check drawn)")
    parser.add_argument("--pairs", type=int, default=3, help="honest: pairs of runs with and without verification")
    parser.add_argument("--fraction", type=float, default=0.25, help="verify.fraction of the adversarial cases")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING if os.environ.get("VERIFY_BENCH_LOG") else logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="geotrain-verify-") as tmp:
        for case in args.cases.split(","):
            log_dir = Path(tmp) / case
            log_dir.mkdir()
            if case == "honest":
                line = honest(args.honest_steps, log_dir, args.honest_fraction, args.pairs)
            else:
                steps = args.steps * 3 if case == "shift_1_in_20" else args.steps
                line = adversarial(case, steps, args.fraction, log_dir)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
