"""`geotrain plan`: load a cluster file, plan the pipeline, print the plan as a table or one JSON object."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from typing import TextIO

import yaml

from geotrain.scheduler.cluster import load_cluster
from geotrain.scheduler.costmodel import CodecRatio, ModelProfile, Plan, StepShape
from geotrain.scheduler.planner import PlannerConfig, plan

logger = logging.getLogger(__name__)

_GIB = 2**30


def run_plan(
    cluster_path: str,
    model: Mapping[str, int],
    microbatches: int,
    microbatch_size: int,
    as_json: bool = False,
    out: TextIO | None = None,
    *,
    stages: int | None = None,
    inflight: int | str | None = None,
    codec_ratio: float | CodecRatio = 1.0,
    allreduce: str = "auto",
    replica_rank: int | None = None,
    compute_bytes: int = 4,
    recompute: bool = False,
    replica_sync_every: int = 1,
    diloco: bool = False,
    err: TextIO | None = None,
) -> int:
    """Plan for cluster_path and print it; model holds ModelProfile.gpt's n_layers, d_model, n_heads, seq_len,
    vocab (and optionally bytes_per_value and boundary_rank); inflight is the data heads' window (None: unbounded;
    "auto": the plan's own); allreduce and replica_rank say how replicas average (scheduler.allreduce, PowerSGD's
    rank or None); compute_bytes (2 under bf16/fp16) and recompute are the run's precision and recomputation,
    replica_sync_every the steps between replica averagings and diloco whether replicas keep its anchor and velocity
    (StepShape); returns 0, or 2 after printing the error
    for a bad cluster or model. out and err default to sys.stdout and sys.stderr as they are at the call."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        profile = ModelProfile.gpt(**model, microbatch_size=microbatch_size, compute_bytes=compute_bytes)
        cluster = load_cluster(cluster_path, profile)
        shape = StepShape(
            microbatches=microbatches,
            microbatch_size=microbatch_size,
            codec_ratio=CodecRatio.of(codec_ratio),
            inflight=inflight,
            allreduce=allreduce,
            replica_rank=replica_rank,
            compute_bytes=compute_bytes,
            recompute=recompute,
            replica_sync_every=replica_sync_every,
            diloco=diloco,
        )
        result = plan(
            nodes=cluster.nodes, model=profile, network=cluster.network, shape=shape, config=PlannerConfig(stages=stages)
        )
    except (OSError, ValueError, yaml.YAMLError) as exc:  # a missing or malformed cluster, or no feasible plan
        err.write(f"geotrain plan: {' '.join(str(exc).split())}\n")
        return 2
    write_plan(result, as_json=as_json, out=out)
    return 0


def write_plan(result: Plan, *, as_json: bool, out: TextIO) -> None:
    """Print a plan: one JSON object, or a table with throughput, compute bound and bottleneck."""
    if as_json:
        out.write(json.dumps(result.to_dict(), sort_keys=True) + "\n")
        return
    rows = [("stage", "layers", "replicas", "compute s/step", "transfer s/step", "all-reduce s", "mem GiB", "nodes")]
    for k, st in enumerate(result.stages):
        shown = ", ".join(st.node_ids[:4]) + (f" +{len(st.node_ids) - 4} more" if len(st.node_ids) > 4 else "")
        rows.append(
            (
                str(k),
                f"{st.start}-{st.end - 1}",
                str(len(st.node_ids)),
                f"{st.compute_s:.3f}",
                f"{st.transfer_s:.3f}" if k < len(result.stages) - 1 else "-",
                f"{st.allreduce_s:.3f}" + (" (by region)" if st.hierarchical_allreduce else ""),
                f"{st.memory_bytes / _GIB:.1f}",
                shown,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() + "\n")
    ratio = result.samples_per_s / result.compute_bound_samples_per_s
    out.write(
        f"\nstep: {result.step_seconds:.3f} s for {result.microbatches} microbatches x {result.microbatch_size}"
        f" samples\nthroughput: {result.samples_per_s:.2f} samples/s"
        f"\ncompute bound: {result.compute_bound_samples_per_s:.2f} samples/s ({100 * ratio:.0f}% reached)"
        f"\nbottleneck: {result.bottleneck}\n"
        + (f"window: {result.inflight} microbatches in flight per data head\n" if result.inflight else "")
    )
    if result.layout_steps:
        best = "; ".join(f"{layout} {seconds:.3f} s" for layout, seconds in result.layout_steps.items())
        out.write(f"layout: {result.layout}, by the estimated step of the best plan of each layout: {best}\n")
    if result.excluded:
        out.write(f"\nleft out ({len(result.excluded)}):\n")
        for node_id, reason in result.excluded.items():
            out.write(f"  {node_id}: {reason}\n")
