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

This version (a check told to its verifier with the step's ApplyStep and reported with the verifier's next GradNorm, no
order or Verified call of its own; on the CPU what a stage receives, sends and counts hashed by its worker once the
task's result is on its way; digest() without a copy or a header made per call), under the CPU lock at 0.05, --pairs 5
three times: 0 false alarms, nobody evicted, max |diff| 0.0 in each; costs 10.0, 12.4, 6.1, 7.3, 10.9%, median 10.0%
(e.g. 4,691.2 tokens/s against 5,214.0 off); 6.4, 13.0, 7.0, 21.9, 10.2%, median 10.2% (its last pairs beside a test
run outside the lock); 10.1, 16.1, 13.8, 10.5, 10.4%, median 10.5%: at the 10% goal, not under it; 7.9 to 8.6 ms a
check. A fourth run beside other load measured nothing (costs -15.5 to 14.4%). Adversaries at --steps 40 (shift_1_in_20:
120) and 0.25: every one caught (the work of steps 0, 6, 0, 0; shift, shift_1_in_20, lazy, poison), verdicts a step
later than before (at steps 3, 9, 3, 3, as many rolled back: a report waits for its verifier's next GradNorm), evicted,
nobody else evicted, max |diff| 0.0.

On the way: the apply and GradNorm change alone cost 11.5, 11.4, 7.6, 8.5, 10.3%, median 10.3%; with the hashes moved to
the worker 11.5, 13.0, 9.1, 11.4, 12.8%, median 11.5%, on a machine whose runs without verification were 9% faster
(5,429 tokens/s against 4,980): both spent 3.0 ms a step, the last version 2.5 to 3.4. Running a check's recompute right
after its verifier's GradNorm (the workers then wait for the coordinator's decision) measured no better (median 11.1%);
not kept. The version before: medians 13.0% (--pairs 3) and 13.7% (--pairs 5), the commitments alone (--honest-fraction
1e-6) 4.9%.

Where the rest goes: CPU, more than waits. Per-thread CPU seconds (/proc) over two pairs of 300-step runs of the version
that recomputed after the GradNorm (startup included): the nodes spent 12.6 s with verification and 11.25 s without, the
coordinator's process 4.2 to 4.4 s either way: the nodes' workers 0.9 s more (a check's recompute is some 1.1 ms on this
model, twice a microbatch's forward and backward at a stage: it loads and hashes the parameters served, then hashes all
it computed; and the 40-odd hashes a step), the threads that receive tensors 0.4 s, the evidence's gRPC calls (the
verifier's thread, the target's handler and server thread, a client thread per call) some 0.25 s. Each of 3 nodes and
the coordinator on 2 shared cores takes its share of the step, so that CPU is time: 2.5 to 3.4 ms of a 24 to 25 ms step
here, at 0.6 checks a step. On a model whose microbatches take longer than these 0.5 ms a stage, the hashes and calls
cost the same and the recompute f of the compute, so the share falls. What would cut the rest: the evidence over the raw
tensor stream rather than a gRPC call (protocol/tensorstream.py), a recompute that neither accumulates float64 sums nor
reloads the runtime (node/stage.py). The honest runs need limits.calls_per_s above the default 200 (TINY): at about 40
steps/s the data head makes some 240 calls/s.

The next version (digests read a tensor's bytes through numpy), under the lock, --pairs 5: costs 17.9, 14.7, 10.7, 9.8,
10.2%, median 10.7% (e.g. 4,390.3 tokens/s against 4,914.4 off; 949 checks at 8.79 ms); 8.5, 9.7, 6.5, 11.8, 12.5%,
median 9.7% (877 checks at 8.25 ms); beside other load (its runs without verification from 3,680 to 5,152 tokens/s) 0.4,
15.8, 17.2, 9.3, 4.6%, median 9.3%: not clearly under the goal; 0 false alarms, nobody evicted, max |diff| 0.0 in each;
the adversaries caught (the work of steps 1, 1, 0, 0), verdicts at steps 4, 4, 3, 3, evicted, max |diff| 0.0. Where the
cost lies, measured on the way (300-step runs, interleaved, under the lock): the commitments alone (verify.fraction
1e-6: every hash and report, no check) cost some two thirds of what the checks and commitments together did (means of
four runs each: 4,321 tokens/s, and 4,117 at 0.05, against 4,788 off), so the commitments (hashes, their bookkeeping,
their reports) are the larger part, and the checks the smaller. In the nodes, timed per call: hash_pending's wall time
is some 3 times its CPU time (the worker descheduled on shared cores), and its CPU 3 to 7 times that of the same hashes
in a quiet process; the coordinator's verification (cross-check, draw, commitments, reports) some 0.2 ms a step. Tried,
measured no better, not kept: hashing in the worker's idle time (a task at VERIFY priority) rather than after each task
(means 4,542 against 4,571 tokens/s inline, three runs each). Next: the commitments' Python per microbatch (some 40
hashes a step, each with its bookkeeping), and the evidence's gRPC call.
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
