"""Node profiles on the coordinator: check what nodes report, and turn the reports into the planner's inputs.

Nodes measure per-layer time, boundary and parameter bytes, memory, and their links (node/profiler.py); the
coordinator keeps the latest report of each member and builds NodeProfile, ModelProfile and Network from them, so
the planner works from measured numbers without any model code.
"""

from __future__ import annotations

import logging
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Protocol

from geotrain.config import PRECISIONS, RunConfig
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.probe import COORDINATOR_PEER
from geotrain.scheduler.costmodel import Link, ModelProfile, Network, NodeProfile

log = logging.getLogger(__name__)

DEFAULT_INTRA_REGION = Link(bandwidth_bps=1e9, latency_s=0.5e-3)
"""Link inside a region when no pair there was measured: a datacenter LAN."""
DEFAULT_INTER_REGION = Link(bandwidth_bps=100e6, latency_s=0.05)
"""Link between regions when no pair between any regions was measured: ordinary internet."""
_FP32_BYTES = 4  # stages train in fp32


class Profiled(Protocol):
    """A member as planner_inputs reads it (scheduler.coordinator.Member fits)."""

    node_id: str
    region: str
    profile: pb.NodeProfileReport | None

    @property
    def unreachable(self) -> bool:
        """Nobody can dial it (the coordinator's dial-back at registration)."""


_DEVICE = re.compile(r"cpu|mps|cuda:\d{1,4}")
_MAX_NAME = 200
_MAX_BUILD = 100
_MAX_REASON = 500
# What a profile may claim. Numbers outside these are no hardware's; inside them the planner's arithmetic stays finite
# (a 5e-324 bit/s link once made a step last longer than any float, and the coordinator failed at its next commit).
LAYER_SECONDS = (1e-7, 1e5)
"""A layer's forward and backward of one microbatch, in seconds."""
BANDWIDTH_BPS = (1e3, 1e13)
"""A link's bandwidth, in bits per second: a kilobit to ten terabits."""
RTT_S = (0.0, 600.0)
"""A link's round trip, in seconds."""
COPY_BYTES_PER_S = (0.0, 1e13)
"""Host-device copy speed, in bytes per second (0: nothing is copied)."""
MAX_BYTES = 1 << 50
"""Memory, and any one layer's parameter, boundary or activation bytes: a pebibyte."""
_MAX_LINKS = 10_000
_MAX_PEER = 64
_MAX_DIM = 1 << 31
_MAX_TENSORS_PER_LAYER = 1000


def _in_range(what: str, value: float, bounds: tuple[float, float], unit: str) -> None:
    """ValueError naming `what` unless lo <= value <= hi (NaN is never in range)."""
    lo, hi = bounds
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be in [{lo:g}, {hi:g}] {unit}, got {value!r}")


def check_report(report: pb.NodeProfileReport, total_layers: int) -> None:
    """Raise ValueError, with one reason, unless a report describes every layer of the model with finite numbers
    that some hardware could measure."""
    if not report.node_id:
        raise ValueError("node_id is empty")
    for name in ("layer_seconds", "boundary_bytes", "param_bytes", "activation_bytes"):
        if len(getattr(report, name)) != total_layers:
            raise ValueError(f"{name} has {len(getattr(report, name))} entries, the model has {total_layers} layers")
    for layer, seconds in enumerate(report.layer_seconds):
        _in_range(f"layer_seconds[{layer}]", seconds, LAYER_SECONDS, "s")
    for name in ("boundary_bytes", "param_bytes", "activation_bytes"):
        for layer, nbytes in enumerate(getattr(report, name)):
            _in_range(f"{name}[{layer}]", nbytes, (0, MAX_BYTES), "bytes")
    if report.param_shapes and len(report.param_shapes) != total_layers:
        raise ValueError(f"param_shapes has {len(report.param_shapes)} entries, the model has {total_layers} layers")
    for layer, shapes in enumerate(report.param_shapes):
        if len(shapes.tensors) > _MAX_TENSORS_PER_LAYER:
            raise ValueError(f"layer {layer} lists more than {_MAX_TENSORS_PER_LAYER} parameter tensors")
        if any(not shape.dims or 0 in shape.dims or max(shape.dims) > _MAX_DIM for shape in shapes.tensors):
            raise ValueError(f"layer {layer} has a parameter shape without dimensions, or with a zero or huge one")
    # 0 is a node with no room: it reaches the planner, which leaves it out and says why.
    _in_range("memory_bytes", report.memory_bytes, (0, MAX_BYTES), "bytes")
    _in_range("baseline_bytes", report.baseline_bytes, (0, MAX_BYTES), "bytes")
    if len(report.unfit) > _MAX_REASON or not report.unfit.isprintable():
        raise ValueError(f"unfit must be printable and at most {_MAX_REASON} characters")
    if not _DEVICE.fullmatch(report.device):
        raise ValueError(f"device must be cpu, mps or cuda:N, got {report.device[:40]!r}")
    if len(report.device_name) > _MAX_NAME or not report.device_name.isprintable():
        raise ValueError(f"device_name must be printable and at most {_MAX_NAME} characters")
    if len(report.torch_build) > _MAX_BUILD or not report.torch_build.isprintable():
        raise ValueError(f"torch_build must be printable and at most {_MAX_BUILD} characters")
    if report.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {report.precision[:40]!r}")
    _in_range("copy_bytes_per_s", report.copy_bytes_per_s, COPY_BYTES_PER_S, "bytes/s")
    if len(report.links) > _MAX_LINKS:
        raise ValueError(f"more than {_MAX_LINKS} link probes")
    for link in report.links:
        if not link.peer or len(link.peer) > _MAX_PEER:
            raise ValueError(f"a link probe's peer must be 1-{_MAX_PEER} characters")
        _in_range(f"bandwidth to {link.peer}", link.bandwidth_bps, BANDWIDTH_BPS, "bit/s")
        _in_range(f"round trip to {link.peer}", link.rtt_s, RTT_S, "s")


def device_class(report: pb.NodeProfileReport) -> str:
    """What a node computes on, as far as its bits go: device type (not its index), device model, torch build and
    precision. Replicas of a stage must report equal parameter checksums, and AdamW steps on different kernels or
    hardware may round differently (FMA contraction, reduction order), so the planner keeps each stage's replicas to
    one class."""
    kind = report.device.split(":", 1)[0]
    return "|".join((kind, report.device_name, report.torch_build, report.precision))


def measured_link(probe: pb.LinkProbe | None) -> dict[str, float]:
    """LinkStatus fields (bandwidth_mbps, one-way latency_ms) of a probe; zeros say "not measured"."""
    if probe is None:
        return {"bandwidth_mbps": 0.0, "latency_ms": 0.0}
    return {"bandwidth_mbps": probe.bandwidth_bps / 1e6, "latency_ms": probe.rtt_s / 2 * 1e3}


def model_profile(report: pb.NodeProfileReport, cfg: RunConfig) -> ModelProfile:
    """The model's per-layer sizes as a node measured them (every node runs the same shapes)."""
    tokens = cfg.train.microbatch_size * cfg.model.seq_len
    return ModelProfile(
        layer_param_bytes=list(report.param_bytes),
        boundary_bytes=list(report.boundary_bytes),
        layer_activation_bytes=list(report.activation_bytes),
        # Not measured, and planning from measured times never reads it: the 6 x parameters x tokens rule.
        layer_flops=[6.0 * p / _FP32_BYTES * tokens for p in report.param_bytes],
        bytes_per_value=_FP32_BYTES,
        layer_param_shapes=[[tuple(s.dims) for s in layer.tensors] for layer in report.param_shapes] or None,
    )


def _pair_links(members: Sequence[Profiled]) -> dict[tuple[str, str], Link]:
    """Measured node pairs (sorted ids), both directions folded into one symmetric link."""
    ids = {m.node_id for m in members}
    seen: dict[tuple[str, str], list[pb.LinkProbe]] = defaultdict(list)
    for m in members:
        assert m.profile is not None
        for probe in m.profile.links:
            if probe.peer in ids and probe.peer != m.node_id:
                seen[tuple(sorted((m.node_id, probe.peer)))].append(probe)
    # Activations go one way and gradients the other, so a step pays 1/bw of each direction: the harmonic mean.
    return {
        pair: Link(
            bandwidth_bps=len(probes) / sum(1 / p.bandwidth_bps for p in probes),
            latency_s=statistics.fmean(p.rtt_s for p in probes) / 2,
        )
        for pair, probes in seen.items()
    }


def _median_link(links: list[Link]) -> Link:
    return Link(
        bandwidth_bps=statistics.median(link.bandwidth_bps for link in links),
        latency_s=statistics.median(link.latency_s for link in links),
    )


def measured_network(
    members: Sequence[Profiled],
    *,
    intra_default: Link = DEFAULT_INTRA_REGION,
    inter_default: Link = DEFAULT_INTER_REGION,
) -> Network:
    """Measured pairs as overrides; region links the median of the pairs measured between (or inside) regions."""
    region = {m.node_id: m.region for m in members}
    pairs = _pair_links(members)
    by_regions: dict[tuple[str, str], list[Link]] = defaultdict(list)
    for (a, b), link in pairs.items():
        by_regions[tuple(sorted((region[a], region[b])))].append(link)
    intra = [link for (ra, rb), links in by_regions.items() if ra == rb for link in links]
    inter = {pair: _median_link(links) for pair, links in by_regions.items() if pair[0] != pair[1]}
    return Network(
        intra_region=_median_link(intra) if intra else intra_default,
        inter_region=inter,
        default_inter_region=_median_link(list(inter.values())) if inter else inter_default,
        pair_overrides=pairs,
    )


def planner_inputs(
    members: Sequence[Profiled], cfg: RunConfig, scale: Callable[[str], float] = lambda node_id: 1.0
) -> tuple[list[NodeProfile], ModelProfile, Network]:
    """The planner's nodes, model and network from the members that have reported a profile (the others are left
    out), each node's layer times times scale(node id) (scheduler.calibration: in-run over profiled); ValueError when
    none has."""
    profiled = [m for m in members if m.profile is not None]
    if not profiled:
        raise ValueError("no node has reported a profile yet")
    nodes = [
        NodeProfile(
            node_id=m.node_id,
            region=m.region,
            layer_seconds=[t * scale(m.node_id) for t in m.profile.layer_seconds],
            memory_bytes=m.profile.memory_bytes,
            baseline_bytes=m.profile.baseline_bytes,
            unfit=m.profile.unfit,
            unreachable=m.unreachable,
            device_class=device_class(m.profile),
            coordinator_rtt_s=next((p.rtt_s for p in m.profile.links if p.peer == COORDINATOR_PEER), 0.0),
        )
        for m in profiled
    ]
    # The model's sizes from a node that measured every layer (one that could not hold a layer filled some in).
    sizes = next((m.profile for m in profiled if not m.profile.unfit), profiled[0].profile)
    return nodes, model_profile(sizes, cfg), measured_network(profiled)
