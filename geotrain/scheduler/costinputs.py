"""What the cost model (scheduler/costmodel.py) prices from: each node's measured profile, the model's, the links
between nodes and what the codecs leave of a boundary's bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from geotrain import memory

FP32_BYTES = memory.FP32_BYTES


@dataclass(kw_only=True)
class NodeProfile:
    """What one node measured about itself."""

    node_id: str
    """Unique id of the node."""
    region: str
    """Region name; links between regions come from the Network."""
    layer_seconds: list[float]
    """Seconds of forward + backward per layer for ONE microbatch on this node."""
    memory_bytes: int
    """Accelerator (or host) memory the node's process may hold in all (0: none)."""
    baseline_bytes: int = 0
    """What the process holds before it builds a layer (interpreter, torch, gRPC, data): a stage gets the rest."""
    unfit: str = ""
    """Why the node can hold no stage at all, where it found out itself (e.g. out of memory profiling a layer)."""
    unreachable: bool = False
    """Nobody can dial it (behind NAT): its links with another such node go through a relay."""
    device_class: str = ""
    """What it computes on (scheduler.profiles.device_class): replicas of a stage share one (scheduler.planner)."""
    coordinator_rtt_s: float = 0.0
    """Round trip to the coordinator as the node probed it (0: not measured): a data head waits one a step."""

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("node_id must be non-empty")
        if not self.region:
            raise ValueError(f"node {self.node_id}: region must be non-empty")
        if not self.layer_seconds or not all(math.isfinite(t) and t > 0 for t in self.layer_seconds):
            raise ValueError(f"node {self.node_id}: layer_seconds must be non-empty, finite and > 0")
        if self.memory_bytes < 0 or self.baseline_bytes < 0:
            raise ValueError(f"node {self.node_id}: memory_bytes and baseline_bytes must be >= 0")
        if not (math.isfinite(self.coordinator_rtt_s) and self.coordinator_rtt_s >= 0):
            raise ValueError(f"node {self.node_id}: coordinator_rtt_s must be finite and >= 0")

    @property
    def room_bytes(self) -> int:
        """Memory a stage may take on this node: its memory less its baseline (negative: none)."""
        return 0 if self.unfit else self.memory_bytes - self.baseline_bytes


@dataclass(kw_only=True)
class ModelProfile:
    """Per-layer sizes of the model, for one microbatch."""

    layer_param_bytes: list[int]
    """Parameter bytes of each layer, in the training dtype."""
    boundary_bytes: list[int]
    """Activation bytes leaving layer i for one microbatch; the gradient coming back is the same size."""
    layer_activation_bytes: list[int]
    """Activation bytes layer i keeps for backward, per microbatch."""
    layer_flops: list[float]
    """Forward + backward FLOPs of layer i per microbatch."""
    bytes_per_value: int = 4
    """Bytes per value of parameters, gradients and activations (4: fp32, 2: fp16/bf16)."""
    layer_param_shapes: list[list[tuple[int, ...]]] | None = None
    """Shapes of each layer's parameter tensors, where known: low-rank replica averaging needs them."""

    def __post_init__(self) -> None:
        n = len(self.layer_param_bytes)
        if n == 0:
            raise ValueError("model needs at least one layer")
        for name in ("boundary_bytes", "layer_activation_bytes", "layer_flops"):
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries, layer_param_bytes has {n}")
            if any(v < 0 for v in values):
                raise ValueError(f"{name} must be >= 0")
        if any(v < 0 for v in self.layer_param_bytes):
            raise ValueError("layer_param_bytes must be >= 0")
        if self.bytes_per_value not in (2, 4):
            raise ValueError(f"bytes_per_value must be 2 or 4, got {self.bytes_per_value}")
        if self.layer_param_shapes is not None and len(self.layer_param_shapes) != n:
            raise ValueError(f"layer_param_shapes has {len(self.layer_param_shapes)} entries, the model has {n} layers")

    def replica_sync_bytes(self, rank: int | None, wire_bytes: int | None = None) -> list[list[int]]:
        """Bytes each layer puts into each all-reduce round when replicas average, at wire_bytes per value (None: the
        training dtype's): one round of the raw gradients (rank None), or PowerSGD's two (node.lowrank): the left
        factors with the tensors too small to gain from a low-rank form, then the right factors. A tensor is a
        rows x (the rest) matrix and goes low-rank when rank x (rows + cols) < rows x cols
        (compression.PowerSgdCodec's rule)."""
        per_value = wire_bytes or self.bytes_per_value
        if rank is None:
            return [[p * per_value // self.bytes_per_value for p in self.layer_param_bytes]]
        if self.layer_param_shapes is None:
            raise ValueError("low-rank replica averaging needs the model's parameter shapes")
        factor_bytes = wire_bytes or FP32_BYTES
        rounds: list[list[int]] = [[], []]
        for shapes in self.layer_param_shapes:
            left = right = 0
            for shape in shapes:
                rows, cols = shape[0], math.prod(shape[1:])
                r = min(rank, rows, cols)
                if r * (rows + cols) < rows * cols:
                    left, right = left + r * rows * factor_bytes, right + r * cols * factor_bytes
                else:
                    left += rows * cols * per_value
            rounds[0].append(left)
            rounds[1].append(right)
        return rounds

    @property
    def n_layers(self) -> int:
        """Number of layers (embedding and head included)."""
        return len(self.layer_param_bytes)

    @property
    def param_counts(self) -> list[float]:
        """Parameters of each layer (its parameter bytes over bytes_per_value)."""
        return [p / self.bytes_per_value for p in self.layer_param_bytes]

    @property
    def largest_tensor_bytes(self) -> list[int]:
        """Bytes of each layer's largest parameter tensor in fp32, as stages keep it (the whole layer where its
        shapes are not known)."""
        if self.layer_param_shapes is None:
            return [int(p * FP32_BYTES) for p in self.param_counts]
        return [max((math.prod(s) for s in shapes), default=0) * FP32_BYTES for shapes in self.layer_param_shapes]

    @classmethod
    def gpt(
        cls,
        *,
        n_layers: int,
        d_model: int,
        n_heads: int,
        seq_len: int,
        vocab: int,
        microbatch_size: int,
        bytes_per_value: int = 4,
        compute_bytes: int | None = None,
        boundary_rank: int = 0,
    ) -> ModelProfile:
        """Analytic profile of a GPT: layers [embedding, block x n_layers, head (untied)]; activations in
        compute_bytes per value (autocast's dtype; default: bytes_per_value); under boundary_rank (model.boundary_rank,
        0 = off) a boundary carries that many values per token instead of d_model. Under autocast (compute_bytes
        below 4) each microbatch keeps the 16-bit copies of the weights its matmuls saved, with its activations."""
        if min(n_layers, d_model, n_heads, seq_len, vocab, microbatch_size) <= 0:
            raise ValueError("GPT dimensions and microbatch_size must be > 0")
        if not 0 <= boundary_rank <= d_model:
            raise ValueError(f"boundary_rank must be in [0, d_model], got {boundary_rank}")
        b, s, d, v, bpv = microbatch_size, seq_len, d_model, vocab, bytes_per_value
        abv = compute_bytes or bpv
        hidden = b * s * d * abv
        boundary = b * s * (boundary_rank or d) * abv
        # Block: attention (4d^2) + MLP (8d^2) weights, biases and two layer norms.
        block_params = 12 * d * d + 13 * d
        # Forward matmuls 24 b s d^2 + attention scores 4 b s^2 d; backward is twice the forward.
        block_flops = 3.0 * b * (24 * s * d * d + 4 * s * s * d)
        # Korthikanti et al. 2022: 34 s b h + 5 a s^2 b bytes at 2 bytes per value, without recompute.
        block_act = int(b * (17 * s * d + 2.5 * n_heads * s * s) * abv)
        head_act = 2 * b * s * v * abv
        if compute_bytes is not None and compute_bytes < FP32_BYTES:
            block_act += (12 * d * d) * abv  # the matmuls' weights, cast once per microbatch and saved for backward
            head_act += v * d * abv
        return cls(
            layer_param_bytes=[(v * d + s * d) * bpv] + [block_params * bpv] * n_layers + [(v * d + 2 * d) * bpv],
            boundary_bytes=[boundary] * (n_layers + 1) + [0],
            layer_activation_bytes=[hidden] + [block_act] * n_layers + [head_act],
            layer_flops=[3.0 * b * s * d] + [block_flops] * n_layers + [3.0 * 2 * b * s * d * v],
            bytes_per_value=bpv,
            layer_param_shapes=[[(v, d), (s, d)]]
            + [[(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)] + [(d,)] * 4] * n_layers
            + [[(v, d), (d,), (d,)]],
        )


@dataclass(kw_only=True)
class Link:
    """One direction-independent network path."""

    bandwidth_bps: float
    """Bits per second."""
    latency_s: float
    """One-way latency in seconds."""

    def __post_init__(self) -> None:
        if not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise ValueError(f"bandwidth_bps must be finite and > 0, got {self.bandwidth_bps}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s}")


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


@dataclass(kw_only=True)
class Network:
    """Links between nodes: a region matrix, per-node access caps and measured per-pair overrides."""

    intra_region: Link
    """Link between two nodes of the same region."""
    inter_region: dict[tuple[str, str], Link] = field(default_factory=dict)
    """Link between two regions, keyed by the unordered pair (either order works)."""
    default_inter_region: Link | None = None
    """Link for region pairs missing from inter_region; None makes a missing pair an error."""
    node_bandwidth_bps: dict[str, float] = field(default_factory=dict)
    """Access-link cap of a node (a volunteer's uplink): a pair gets at most the smaller cap."""
    pair_overrides: dict[tuple[str, str], Link] = field(default_factory=dict)
    """Measured links between two nodes (unordered), replacing everything above."""

    def __post_init__(self) -> None:
        self.inter_region = {_pair(*k): v for k, v in self.inter_region.items()}
        self.pair_overrides = {_pair(*k): v for k, v in self.pair_overrides.items()}
        for node, bps in self.node_bandwidth_bps.items():
            if not bps > 0:
                raise ValueError(f"node_bandwidth_bps[{node}] must be > 0")

    def region_link(self, region_a: str, region_b: str) -> Link:
        """Link between two regions (intra_region when they are the same)."""
        if region_a == region_b:
            return self.intra_region
        link = self.inter_region.get(_pair(region_a, region_b), self.default_inter_region)
        if link is None:
            raise ValueError(f"no link between regions {region_a!r} and {region_b!r}")
        return link


@dataclass(frozen=True, kw_only=True)
class CodecRatio:
    """Compressed size / raw size of activations and their gradients, per link kind."""

    intra_region: float = 1.0
    """Ratio on links inside a region."""
    inter_region: float = 1.0
    """Ratio on links between regions (where a lossy codec pays off most)."""

    def __post_init__(self) -> None:
        for name in ("intra_region", "inter_region"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"codec ratio {name} must be in (0, 1], got {getattr(self, name)}")

    @classmethod
    def of(cls, value: float | CodecRatio) -> CodecRatio:
        """A single float applies to every link."""
        if isinstance(value, CodecRatio):
            return value
        return cls(intra_region=float(value), inter_region=float(value))
