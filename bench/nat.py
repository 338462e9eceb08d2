"""A node behind NAT: tokens/s of a 3-stage run over 50 Mbit/s namespace links, all nodes reachable, then with the
middle stage's node in a home network (nftables drops what comes in), so that its neighbours send to it over the
connections it opens (reversed links), then with the last two stages' nodes behind NAT, so that the link between
them goes through the first stage's node (relayed).

Three regions of deploy/wan/netwan.py, one node each, 50 Mbit/s and --latency-ms one way between regions; the nodes
join one by one, so stage k runs in region k. One JSON line per topology: topology, tokens_per_s (the run's mean),
relayed_bytes (payload the relays forwarded, as their last heartbeats said), ratio_to_direct (tokens/s over the
all-reachable run's) and predicted_ratio (the cost model's step time for the all-reachable plan over this one's, each
as its coordinator estimated it from the nodes' measurements). Needs root and nftables.
Run: sudo python bench/nat.py [--steps N] [--latency-ms MS]

Measured on a shared 2-core machine, 20 ms, --steps 30, three runs, the last after the relay's replay checks (the
10-step runs before gave reversed 1.009x, then 0.868x: too few steps to tell anything from one sample):

    {"topology": "direct", "tokens_per_s": 3600.6, "relayed_bytes": 0, "ratio_to_direct": 1.0, "predicted_ratio": 1.0}
    {"topology": "reversed", "tokens_per_s": 3880.7, "relayed_bytes": 0, "ratio_to_direct": 1.078, "predicted_ratio": 1.009}
    {"topology": "relayed", "tokens_per_s": 2871.0, "relayed_bytes": 125829120, "ratio_to_direct": 0.797, "predicted_ratio": 0.749}

    {"topology": "direct", "tokens_per_s": 3493.6, "relayed_bytes": 0, "ratio_to_direct": 1.0, "predicted_ratio": 1.0}
    {"topology": "reversed", "tokens_per_s": 3895.4, "relayed_bytes": 0, "ratio_to_direct": 1.115, "predicted_ratio": 1.022}
    {"topology": "relayed", "tokens_per_s": 2838.4, "relayed_bytes": 125829120, "ratio_to_direct": 0.812, "predicted_ratio": 0.71}

    {"topology": "direct", "tokens_per_s": 3389.1, "relayed_bytes": 0, "ratio_to_direct": 1.0, "predicted_ratio": 1.0}
    {"topology": "reversed", "tokens_per_s": 3628.6, "relayed_bytes": 0, "ratio_to_direct": 1.071, "predicted_ratio": 0.738}
    {"topology": "relayed", "tokens_per_s": 2704.5, "relayed_bytes": 125304832, "ratio_to_direct": 0.798, "predicted_ratio": 0.763}

Reversed links are not slower than direct ones but 7-12% faster. The likely reason is the order tensors go in: a
Reverse stream sends them one after another, while a direct link's concurrent Forward calls share the link and all
finish late. With the direct calls made to write their chunks one call at a time per peer (an experiment, one run, not
kept), direct gave 3,800.4 tokens/s and reversed 0.994x of it. Relayed runs are 5-14% faster than the cost model
predicts. The predicted ratios move from run to run with the link measurements the nodes report (reversed: 0.738 once).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = {"direct": (), "reversed": (1,), "relayed": (1, 2)}  # topology -> regions behind NAT
LINK_MBPS = 50.0


def _netwan():
    """deploy/wan/netwan.py, imported by path: deploy/ is not a package."""
    spec = importlib.util.spec_from_file_location("netwan", REPO / "deploy" / "wan" / "netwan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["netwan"] = module  # dataclasses look their module up while the class body runs
    spec.loader.exec_module(module)
    return module


def run(netwan, behind_nat: tuple[int, ...], steps: int, latency_ms: float) -> dict:
    """The --json summary of one run across a fresh WAN."""
    settings = ["scheduler.placement=uniform", "run.eval_every=0", "train.microbatches=8", "train.inflight=8",
                f"run.steps={steps}"]
    spec = netwan.WanSpec(regions=3, link_mbps=LINK_MBPS, latency_ms=latency_ms, behind_nat=behind_nat)
    with netwan.Wan(spec, Path(tempfile.mkdtemp(prefix="bench-nat-"))) as wan:
        wan.build()
        coordinator = wan.start_coordinator(["--json", *(arg for s in settings for arg in ("--set", s))])
        wan.join_in_order(coordinator)
        log = wan.log_dir / "coordinator.log"
        if coordinator.wait(600) != 0:
            raise RuntimeError(f"the run failed:\n{log.read_text()[-3000:]}")
        return json.loads(next(line for line in reversed(log.read_text().splitlines()) if line.startswith("{")))


def main() -> None:
    """Run each topology and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="one-way delay between regions (default 20)")
    args = parser.parse_args()
    netwan = _netwan()
    netwan.check_environment()
    netwan.check_nftables()
    direct = None
    for topology, behind_nat in TOPOLOGIES.items():
        summary = run(netwan, behind_nat, args.steps, args.latency_ms)
        direct = direct or summary
        predicted = (direct["estimated_step_s"] / summary["estimated_step_s"]
                     if direct["estimated_step_s"] and summary["estimated_step_s"] else None)
        print(json.dumps({"topology": topology, "tokens_per_s": round(summary["tokens_per_s"], 1),
                          "relayed_bytes": summary["relayed_bytes"],
                          "ratio_to_direct": round(summary["tokens_per_s"] / direct["tokens_per_s"], 3),
                          "predicted_ratio": round(predicted, 3) if predicted else None}), flush=True)


if __name__ == "__main__":
    main()
