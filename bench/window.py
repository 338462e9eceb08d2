"""The data heads' window live: tokens/s and peak memory of a 3-stage run over slow links at fixed windows and auto.

Three stages in three regions joined by 50 Mbit/s, 50 ms links, as bench/time_to_target.py builds them (its helpers):
the namespace WAN of deploy/wan/netwan.py where this runs as root (tbf rate limits, the router delays every packet
between regions), else `geotrain demo --uplink 50/50` (every node's traffic through one emulated 50 Mbit/s, 50 ms
uplink); each line says which, key "links". The model is time_to_target's byte GPT (6 blocks of width 192), with
MICROBATCHES microbatches of MICROBATCH_SIZE x 64 bytes a step: small microbatches, so that a microbatch's round trip
(four crossings of 50 ms, each way of two links) is long against the pace (a microbatch's 98 KB of activations take
16 ms on a link), the regime where the window decides how busy the links are.

One JSON line per window (train.inflight: 1, 4, 16 and auto): window, links, tokens_per_s (the run's mean over its
committed steps), peak_memory_bytes (the most one node held, from the nodes' heartbeats: resident memory on the CPU),
inflight (the window the plan ran with: auto's own choice), estimated_step_s (the cost model's step time for the plan).
Run: sudo python bench/window.py [--windows 1,4,16,auto] [--steps N] [--links namespaces|emulator]

Measured on a shared 2-core machine, namespaces, under the CPU lock; the run of this version, 24 steps, all four
windows in one invocation (`--steps 24`):
  {"window": "1", "tokens_per_s": 258.5, "peak_memory_bytes": 474189824, "inflight": 1, "estimated_step_s": 22.485}
  {"window": "4", "tokens_per_s": 903.8, "peak_memory_bytes": 497696768, "inflight": 4, "estimated_step_s": 6.012}
  {"window": "16", "tokens_per_s": 1572.1, "peak_memory_bytes": 555999232, "inflight": 16, "estimated_step_s": 3.862}
  {"window": "auto", "tokens_per_s": 1476.4, "peak_memory_bytes": 542789632, "inflight": 12, "estimated_step_s": 3.376}
(each line also has "links": "namespaces: tbf 50 Mbit/s, router delay 50 ms one way"). auto is 1.63x window 4 and
0.939 of window 16, the best fixed window. Its window: 3 in the plan made as the last node joined (no profiles yet),
10 before step 1 once they came in (replan's check of a plan before its first step), 12 after step 1 once the data
heads' round trip was measured (scheduler.calibration's cost per crossing), and 12 to the end. Its steps after the
first took 4.07 s (mean), window 16's 3.80 s; its first 6.68 s, window 16's 5.94 s. The run before it, with a window
also lowered when in-run times moved the need down: auto 1,549.3 tokens/s (0.939 of window 16's 1,650.3; window 4
930.2, window 1 254.7): 3, 10, 14 and, after step 17, 11, at which its steps took 4.05 s against 3.77 s at 14, so a
window above its need now stays (placement.window_changed).

How auto got there (earlier versions, same links):
- At first the plan's window came only after its first step, at one microbatch per stage: 8 steps, window 4: 1,061,
  16: 1,622, auto 1,393 tokens/s (0.86 of 16), the gap being that first step; 24 steps, auto 0.976 of 16.
- With in-run calibration and the tensor stream relayed (the runs above sent tensors over gRPC), 24 steps: window 4
  903.9, 16 1,778.1, auto 1,214.9 at 9 in flight (0.68 of 16): calibrated, slower compute lengthened the pace and
  auto's window shrank, and a two-sided re-plan rule kept a window up to a quarter below its need. Raised whenever
  more than 5% short: 1,500.4 at 11 (0.84). Window 11 fixed ran 1,409.3 against 1,564.6 at 16 (its steps 4.25 s
  against 3.8 s), while the model priced 11 enough: the round trip in the namespace WAN was longer than the cost
  model's (a rate limiter's queue, encoding, framing). The data heads now report their shortest microbatch round trip,
  and calibration prices the excess per boundary crossing: auto then chose 13-14, its steps as fast as window 16's
  after the first, which at 3 in flight took 11.2-11.6 s against 5.9-6.5 s at 16; the plan is now checked against the
  profiles before that step.
- With 8 x 64-byte microbatches (the pace a 63 ms link): auto 1,668 (at 3 all along), 4: 1,853, 16: 2,226.
"""

from __future__ import annotations

import argparse
import json

from time_to_target import LINKS, MODEL, STAGES, default_links, links_label, names_in, run_summary

MICROBATCHES = 48
MICROBATCH_SIZE = 2
WINDOWS = ("1", "4", "16", "auto")  # values of train.inflight
STEPS = 24  # the first step runs before the round trip is measured (see above): 8 steps weigh it 3x as much


def settings(window: str, steps: int) -> list[str]:
    """Every --set of the run at this window."""
    return [
        *MODEL, f"train.microbatches={MICROBATCHES}", f"train.microbatch_size={MICROBATCH_SIZE}",
        f"train.inflight={window}",
        f"run.steps={steps}", "run.eval_every=0", f"scheduler.stages={STAGES}", "scheduler.placement=uniform",
    ]


def figures(window: str, summary: dict, links: str) -> dict:
    """The JSON line of one run."""
    return {
        "window": window,
        "links": links_label(links),
        "tokens_per_s": round(summary["tokens_per_s"], 1),
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "inflight": summary["inflight"],
        "estimated_step_s": summary["estimated_step_s"] and round(summary["estimated_step_s"], 3),
    }


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=names_in(WINDOWS, "window(s)"), default=list(WINDOWS),
                   help=f"comma-separated, of {', '.join(WINDOWS)} (default all)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps per run (default {STEPS})")
    p.add_argument("--links", choices=LINKS, help="namespaces (needs root) or emulator (default: namespaces if root)")
    return p


def main() -> None:
    """Run each window and print one JSON line each."""
    args = parser().parse_args()
    links = args.links or default_links()
    for window in args.windows:
        summary = run_summary(settings(window, args.steps), args.steps, links)
        print(json.dumps(figures(window, summary, links)), flush=True)


if __name__ == "__main__":
    main()
