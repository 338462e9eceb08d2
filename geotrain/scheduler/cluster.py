"""cluster.yaml: the nodes and links `geotrain plan` plans for, loaded into NodeProfiles and a Network.

Format (bandwidth in Mbit/s with *_mbps keys or Gbit/s with *_gbps keys, latency in ms, memory in GB = 1e9 bytes):

    efficiency: 0.4                 # optional: sustained fraction of a device's peak TFLOP/s (default 0.4)
    coordinator_region: us-east     # optional: where the coordinator runs; each step waits once for a data head's
                                    # round trip to it (twice its link's latency), unpriced without this key
    intra_region: {bandwidth_gbps: 10, latency_ms: 0.5}
    inter_region_default: {bandwidth_mbps: 300, latency_ms: 150}     # optional
    inter_region:
      - {regions: [us-east, eu-west], bandwidth_mbps: 900, latency_ms: 75}
    nodes:
      - {name: a100, region: us-east, device: A100-80G, count: 4}     # count expands to a100-0 .. a100-3
      - {name: laptop, region: eu-west, tflops: 1.0, memory_gb: 16, uplink_mbps: 50}
      - {name: probe, region: eu-west, layer_seconds: [0.01, 0.2, 0.3], memory_gb: 8}
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from geotrain.scheduler.costmodel import Link, ModelProfile, Network, NodeProfile

logger = logging.getLogger(__name__)

# Published peak dense fp16/bf16 tensor TFLOP/s and memory in GB (CPU and Apple: fp32, approximate), from the
# vendors' data sheets as collected in the project's scenarios/devices.json. Sustained training reaches 30-50%.
DEVICES: dict[str, tuple[float, float]] = {
    "H100-SXM": (989, 80),
    "A100-80G": (312, 80),
    "A100-40G": (312, 40),
    "V100-32G": (125, 32),
    "A10G": (125, 24),
    "L4": (121, 24),
    "T4": (65, 16),
    "RTX-4090": (165, 24),
    "RTX-3090": (71, 24),
    "RTX-3060": (25, 12),
    "Apple-M2-Pro-GPU": (6.8, 16),
    "laptop-CPU-8-core": (1.0, 16),
}

DEFAULT_EFFICIENCY = 0.4
_GB = 1e9
_TOP_KEYS = {"coordinator_region", "efficiency", "intra_region", "inter_region", "inter_region_default", "nodes"}
_LINK_KEYS = {"bandwidth_mbps", "bandwidth_gbps", "latency_ms"}
_NODE_KEYS = {"name", "region", "device", "tflops", "layer_seconds", "memory_gb", "count", "uplink_mbps", "uplink_gbps"}


@dataclass(kw_only=True)
class Cluster:
    """Nodes and network of a cluster file."""

    nodes: list[NodeProfile]
    """One profile per node, counts expanded."""
    network: Network
    """Links between the nodes."""


def layer_seconds_from_tflops(model: ModelProfile, tflops: float, efficiency: float) -> list[float]:
    """Per-layer fwd+bwd seconds of one microbatch on a device with this peak, at this sustained fraction."""
    if not (tflops > 0 and 0 < efficiency <= 1):
        raise ValueError(f"tflops must be > 0 and efficiency in (0, 1], got {tflops}, {efficiency}")
    rate = tflops * 1e12 * efficiency
    # A layer with no FLOPs still costs a kernel launch; keep every time positive.
    return [max(f / rate, 1e-6) for f in model.layer_flops]


def load_cluster(path: str | Path, model: ModelProfile) -> Cluster:
    """Read and validate a cluster.yaml."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    return parse_cluster(data, model)


def _check_keys(where: str, data: object, allowed: set[str]) -> Mapping:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    return data


def _number(where: str, key: str, value: object, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}.{key} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{where}.{key} must be {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def _bps(where: str, data: Mapping, prefix: str) -> float | None:
    mbps, gbps = data.get(f"{prefix}_mbps"), data.get(f"{prefix}_gbps")
    if mbps is not None and gbps is not None:
        raise ValueError(f"{where}: give {prefix}_mbps or {prefix}_gbps, not both")
    if mbps is not None:
        return _number(where, f"{prefix}_mbps", mbps) * 1e6
    if gbps is not None:
        return _number(where, f"{prefix}_gbps", gbps) * 1e9
    return None


def _link(where: str, data: object, extra: set[str] = frozenset()) -> Link:
    data = _check_keys(where, data, _LINK_KEYS | extra)
    bps = _bps(where, data, "bandwidth")
    if bps is None:
        raise ValueError(f"{where}: missing key 'bandwidth_mbps' or 'bandwidth_gbps'")
    if "latency_ms" not in data:
        raise ValueError(f"{where}: missing key 'latency_ms'")
    return Link(bandwidth_bps=bps, latency_s=_number(where, "latency_ms", data["latency_ms"], positive=False) / 1e3)


def _nodes(entry: object, pos: int, model: ModelProfile, efficiency: float) -> tuple[list[NodeProfile], float | None]:
    where = f"nodes[{pos}]"
    entry = _check_keys(where, entry, _NODE_KEYS)
    for key in ("name", "region"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"{where}: missing or empty key {key!r}")
    where = f"nodes[{pos}] ({entry['name']})"
    sources = [k for k in ("device", "tflops", "layer_seconds") if k in entry]
    if len(sources) > 1 and sources != ["device", "tflops"]:
        raise ValueError(f"{where}: give one of 'device', 'tflops', 'layer_seconds', not {sources}")
    memory_gb = None
    if "device" in entry:
        if entry["device"] not in DEVICES:
            raise ValueError(f"{where}.device: unknown device {entry['device']!r} (known: {', '.join(DEVICES)})")
        tflops, memory_gb = DEVICES[entry["device"]]
    if "tflops" in entry:
        tflops = _number(where, "tflops", entry["tflops"])
    if "layer_seconds" in entry:
        times = entry["layer_seconds"]
        if not isinstance(times, list) or len(times) != model.n_layers:
            raise ValueError(f"{where}.layer_seconds must list {model.n_layers} numbers, one per layer")
        seconds = [_number(where, "layer_seconds", t) for t in times]
    elif sources:
        seconds = layer_seconds_from_tflops(model, tflops, efficiency)
    else:
        raise ValueError(f"{where}: missing key 'device', 'tflops' or 'layer_seconds'")
    if "memory_gb" in entry:
        memory_gb = _number(where, "memory_gb", entry["memory_gb"], positive=False)  # 0: a node with no room
    if memory_gb is None:
        raise ValueError(f"{where}: missing key 'memory_gb'")
    count = entry.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{where}.count must be an integer >= 1, got {count!r}")
    names = [entry["name"]] if count == 1 else [f"{entry['name']}-{k}" for k in range(count)]
    nodes = [
        NodeProfile(node_id=n, region=entry["region"], layer_seconds=list(seconds), memory_bytes=int(memory_gb * _GB))
        for n in names
    ]
    return nodes, _bps(where, entry, "uplink")


def parse_cluster(data: object, model: ModelProfile) -> Cluster:
    """Validate a parsed cluster.yaml; ValueError names the bad key."""
    data = _check_keys("cluster", data, _TOP_KEYS)
    efficiency = _number("cluster", "efficiency", data.get("efficiency", DEFAULT_EFFICIENCY))
    if efficiency > 1:
        raise ValueError(f"cluster.efficiency must be in (0, 1], got {efficiency}")
    if "intra_region" not in data:
        raise ValueError("cluster: missing key 'intra_region'")
    intra = _link("intra_region", data["intra_region"])
    default = _link("inter_region_default", data["inter_region_default"]) if "inter_region_default" in data else None
    pairs: dict[tuple[str, str], Link] = {}
    entries = data.get("inter_region", [])
    if not isinstance(entries, list):
        raise ValueError("cluster.inter_region must be a list")
    for k, entry in enumerate(entries):
        where = f"inter_region[{k}]"
        link = _link(where, entry, {"regions"})
        regions = entry.get("regions")
        if not (isinstance(regions, list) and len(regions) == 2 and all(isinstance(r, str) for r in regions)):
            raise ValueError(f"{where}.regions must be a list of two region names")
        pairs[tuple(regions)] = link
    if not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise ValueError("cluster: missing key 'nodes' (a non-empty list)")
    nodes: list[NodeProfile] = []
    uplinks: dict[str, float] = {}
    for pos, entry in enumerate(data["nodes"]):
        expanded, uplink = _nodes(entry, pos, model, efficiency)
        nodes.extend(expanded)
        if uplink is not None:
            uplinks.update(dict.fromkeys((n.node_id for n in expanded), uplink))
    seen: set[str] = set()
    for n in nodes:
        if n.node_id in seen:
            raise ValueError(f"nodes: duplicate node name {n.node_id!r}")
        seen.add(n.node_id)
    network = Network(intra_region=intra, inter_region=pairs, default_inter_region=default, node_bandwidth_bps=uplinks)
    regions = sorted({n.region for n in nodes})
    for a in regions:
        for b in regions:
            if a < b:
                try:
                    network.region_link(a, b)
                except ValueError as exc:
                    raise ValueError(f"inter_region: {exc} (add it or set inter_region_default)") from None
    if "coordinator_region" in data:
        nodes = _with_coordinator(nodes, network, data["coordinator_region"])
    logger.debug("cluster: %d nodes in %d regions", len(nodes), len(regions))
    return Cluster(nodes=nodes, network=network)


def _with_coordinator(nodes: list[NodeProfile], network: Network, region: object) -> list[NodeProfile]:
    """The nodes with their round trip to a coordinator in `region` (which may hold no node): what a live node's probe
    of the coordinator measures, here twice the one-way latency of the link between their regions."""
    if not isinstance(region, str) or not region:
        raise ValueError(f"cluster.coordinator_region must be a region name, got {region!r}")
    try:
        return [
            dataclasses.replace(n, coordinator_rtt_s=2 * network.region_link(n.region, region).latency_s)
            for n in nodes
        ]
    except ValueError as exc:
        raise ValueError(f"coordinator_region: {exc} (add it or set inter_region_default)") from None
