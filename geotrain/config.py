"""The run configuration: one TOML file of sections parsed into validating dataclasses.

The coordinator owns the file; nodes receive the sections they need over the wire (RunConfig in the proto), so a
node needs only the coordinator's address and the token. Every field has a default good enough for `geotrain demo`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geotrain.protocol.limits import LimitValues

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from geotrain.protocol import geotrain_pb2 as pb


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


MODEL_METADATA_KEY = "geotrain.model"
"""The safetensors metadata key under which a saved model (--save-final) keeps its [model] section, as JSON."""
DATA_METADATA_KEY = "geotrain.data"
"""The key under which it keeps the run's [data] section, as JSON: `geotrain generate` and `export` find the run's
tokenizer through it (data.prepared) on the machine that trained it."""


AUTO_INFLIGHT = 0
"""train.inflight = "auto" (0 on the wire): the coordinator sizes each plan's window (Plan.inflight)."""
MAX_INFLIGHT = 1024
"""The most microbatches a data head keeps in flight."""


def _bounded(default: Any, lo: float | None = None, hi: float | None = None, doc: str = "") -> Any:
    """A dataclass field whose value must lie in [lo, hi]."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "doc": doc})


def _check_bounds(obj: Any, section: str) -> None:
    """Raise ConfigError for the first field of obj outside its declared range."""
    for f in dataclasses.fields(obj):
        lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
        value = getattr(obj, f.name)
        # Written as "not inside" so that NaN, which compares false with every bound, fails too.
        if (lo is not None and not value >= lo) or (hi is not None and not value <= hi):
            allowed = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            raise ConfigError(f"{section}.{f.name} must be in {allowed}, got {value!r}")


@dataclass(kw_only=True)
class RunSection:
    """[run]: identity and length of the run."""

    seed: int = _bounded(1234, 0, 2**63 - 1, "seeds initialisation and the data order")
    steps: int = _bounded(40, 1, 10**9, "optimizer steps to train")
    eval_every: int = _bounded(10, 0, 10**9, "steps between validation passes; 0 = only at the end")
    eval_microbatches: int = _bounded(4, 1, 4096, "validation microbatches per pass")

    def __post_init__(self) -> None:
        _check_bounds(self, "run")


MODEL_FAMILIES = ("byte-gpt", "llama")

# Keys only the llama family reads: a byte-gpt run that sets one would silently train another model than it says.
_LLAMA_ONLY = ("n_kv_heads", "mlp_width", "vocab_size", "rope_base", "norm_eps", "tie_embeddings", "init_from")


@dataclass(kw_only=True)
class ModelSection:
    """[model]: which model of the zoo (geotrain.node.model) and its sizes."""

    n_layers: int = _bounded(4, 1, 1024, "transformer blocks")
    d_model: int = _bounded(128, 8, 65536, "width")
    n_heads: int = _bounded(4, 1, 1024, "attention heads; must divide d_model")
    seq_len: int = _bounded(64, 2, 65536, "tokens (bytes) per sample")
    dropout: float = _bounded(0.0, 0.0, 0.0, "dropout is off: pipeline stages must recompute identically")
    family: str = field(default="byte-gpt", metadata={"doc": "byte-gpt (the zero-setup byte-level GPT) or llama"})
    n_kv_heads: int = _bounded(0, 0, 1024, "llama: key/value heads (grouped-query attention); 0 = n_heads")
    mlp_width: int = _bounded(0, 0, 1 << 20, "llama: SwiGLU hidden width; 0 = 8/3 d_model rounded up to 64")
    vocab_size: int = _bounded(0, 0, 1 << 24, "llama: token ids; 0 = 256, the bytes of the default corpus")
    rope_base: float = _bounded(10000.0, 1.0, 1e12, "llama: base (theta) of the rotary position embeddings")
    norm_eps: float = _bounded(1e-5, 1e-12, 0.1, "llama: RMSNorm epsilon")
    tie_embeddings: bool = field(
        default=False,
        metadata={"doc": "llama: the head starts as a copy of the embedding, then trains apart (see node/llama.py)"},
    )
    init_from: str = field(
        default="",
        metadata={"doc": "llama: a Hugging Face-format checkpoint directory to start from; nodes read it at this path"},
    )
    boundary_rank: int = _bounded(
        0, 0, 65536,
        "blocks write into k of the residual stream's d_model coordinates, the rest is a fixed embedding of the "
        "tokens (node/family.py): a stage boundary carries k values per token, exactly; 0 = off",
    )

    def __post_init__(self) -> None:
        _check_bounds(self, "model")
        if self.family not in MODEL_FAMILIES:
            raise ConfigError(f"model.family must be one of {', '.join(MODEL_FAMILIES)}, got {self.family!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.n_heads must divide model.d_model ({self.d_model}), got {self.n_heads}")
        if self.boundary_rank > self.d_model:
            raise ConfigError(
                f"model.boundary_rank must be at most model.d_model ({self.d_model}), got {self.boundary_rank}"
            )
        if self.family == "byte-gpt":
            defaults = ModelSection.__dataclass_fields__
            for key in _LLAMA_ONLY:
                if getattr(self, key) != defaults[key].default:
                    raise ConfigError(f"model.{key} applies to model.family = 'llama' only")
            return
        if self.boundary_rank and (self.init_from or self.tie_embeddings):
            # A checkpoint's blocks write every coordinate, and a d_model-wide head cannot start as a k-wide embedding.
            raise ConfigError("model.boundary_rank cannot be combined with model.init_from or model.tie_embeddings")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"model.n_kv_heads must divide model.n_heads ({self.n_heads}), got {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head width, d_model / n_heads = {self.head_dim}")

    @property
    def vocab(self) -> int:
        """Token ids: bytes for byte-gpt (and a llama without vocab_size), else vocab_size."""
        return self.vocab_size or 256

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or one per query head."""
        return self.n_kv_heads or self.n_heads

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of a block's MLP: 4 d_model for byte-gpt; mlp_width or about 8/3 d_model for llama (SwiGLU's
        three matrices then hold as many parameters as two of 4 d_model)."""
        if self.family == "byte-gpt":
            return 4 * self.d_model
        return self.mlp_width or -(-8 * self.d_model // (3 * 64)) * 64

    @property
    def boundary_width(self) -> int:
        """Values per token a layer passes on (so a stage boundary carries): boundary_rank, or d_model when off."""
        return self.boundary_rank or self.d_model

    @property
    def total_layers(self) -> int:
        """Entries in the model's layer list: embedding, the blocks, the head."""
        return self.n_layers + 2


@dataclass(kw_only=True)
class DataSection:
    """[data]: the byte corpus every node reads, or a prepared data set the coordinator serves."""

    paths: list[str] = field(default_factory=list, metadata={"doc": "files or globs; empty = Python's stdlib source"})
    max_bytes: int = _bounded(8_000_000, 10_000, 2**40, "corpus bytes to read at most")
    val_fraction: float = _bounded(0.05, 0.001, 0.5, "tail of the corpus held out for validation")
    prepared: str = field(
        default="",
        metadata={"doc": "a directory `geotrain data prepare` wrote, on the coordinator's host; empty = the bytes"},
    )
    fingerprint: str = field(
        default="", metadata={"doc": "set by the coordinator: sha256 of the corpus, or of the prepared manifest"}
    )

    def __post_init__(self) -> None:
        _check_bounds(self, "data")
        if self.prepared and self.paths:
            raise ConfigError("data.paths names a byte corpus; data.prepared replaces it: set one of them")


PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scale: the factor the loss is multiplied by before backward, and the steps since the last
    overflow. The coordinator decides it step by step (TrainSection.decide) and tells every stage."""

    scale: float
    good_steps: int


@dataclass(kw_only=True)
class TrainSection:
    """[train]: batch, optimizer and pipeline window."""

    microbatches: int = _bounded(4, 1, 65536, "microbatches per step")
    microbatch_size: int = _bounded(8, 1, 65536, "samples per microbatch")
    lr: float = _bounded(3e-3, 1e-8, 1.0, "peak learning rate")
    min_lr: float = _bounded(3e-4, 0.0, 1.0, "learning rate at the end of the cosine decay")
    warmup_steps: int = _bounded(5, 0, 10**9, "linear warm-up steps")
    weight_decay: float = _bounded(0.1, 0.0, 1.0, "AdamW weight decay")
    beta1: float = _bounded(0.9, 0.0, 0.999999)
    beta2: float = _bounded(0.95, 0.0, 0.999999)
    grad_clip: float = _bounded(1.0, 0.0, 1e6, "global gradient-norm clip; 0 = off")
    inflight: int = field(
        default=AUTO_INFLIGHT,
        metadata={
            "lo": 0,
            "hi": MAX_INFLIGHT,
            "auto": AUTO_INFLIGHT,
            "doc": "microbatches a data head keeps in flight at once, or \"auto\": each plan's own window, the "
            "round trip over the pace shared among the data heads (sent with the plan)",
        },
    )
    precision: str = field(
        default="fp32",
        metadata={
            "doc": "fp32, or bf16 / fp16: autocast compute over fp32 master weights and optimizer state; activations "
            "and their gradients leave each layer in that dtype (fp16 adds dynamic loss scaling)"
        },
    )
    precision_fallback: str = field(
        default="refuse",
        metadata={"doc": "a node whose device cannot compute in `precision`: refuse (it does not join) or fp32"},
    )
    recompute: bool = field(
        default=False,
        metadata={"doc": "keep only each layer's input for backward and recompute the rest (torch.utils.checkpoint)"},
    )
    loss_scale: float = _bounded(65536.0, 1.0, 2.0**64, "fp16: the initial loss scale, a power of two")
    loss_scale_window: int = _bounded(
        200, 1, 10**9, "fp16: steps without an overflow after which the loss scale doubles"
    )

    def __post_init__(self) -> None:
        _check_bounds(self, "train")
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr must be <= train.lr ({self.lr}), got {self.min_lr}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.precision_fallback not in ("refuse", "fp32"):
            raise ConfigError(f"train.precision_fallback must be refuse or fp32, got {self.precision_fallback!r}")
        if math.frexp(self.loss_scale)[0] != 0.5:
            # A power of two scales and unscales gradients exactly.
            raise ConfigError(f"train.loss_scale must be a power of two, got {self.loss_scale!r}")

    def initial_loss_scale(self) -> LossScale:
        """The loss scale of the first step: train.loss_scale under fp16, else 1 (no scaling)."""
        return LossScale(scale=self.loss_scale if self.precision == "fp16" else 1.0, good_steps=0)

    def decide(self, sq_norm_parts: Iterable[float], scale: LossScale) -> tuple[float, bool, LossScale]:
        """(clip factor, skip, next loss scale) of a step from every gradient tensor's squared norm, scaled by
        `scale`: a non-finite norm (fp16 overflow) skips the step and halves the scale; window steps without one
        double it. The clip factor also undoes the scale, so it is the one multiplication of the gradients; without
        scaling (scale 1) it is clip_coefficient_from's factor exactly."""
        total = math.fsum(sq_norm_parts)
        if not math.isfinite(total):
            return 0.0, True, LossScale(scale=max(1.0, scale.scale / 2), good_steps=0)
        coef = self.clip_coefficient(total / (scale.scale * scale.scale)) / scale.scale
        if self.precision != "fp16":
            return coef, False, scale
        good = scale.good_steps + 1
        if good >= self.loss_scale_window:
            return coef, False, LossScale(scale=min(2.0**64, scale.scale * 2), good_steps=0)
        return coef, False, LossScale(scale=scale.scale, good_steps=good)

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine decay to min_lr."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def clip_coefficient(self, total_sq_norm: float) -> float:
        """The factor gradients are scaled by so their global norm is at most grad_clip (1.0 = unclipped)."""
        if self.grad_clip <= 0:
            return 1.0
        return min(1.0, self.grad_clip / (math.sqrt(total_sq_norm) + 1e-6))

    def clip_coefficient_from(self, sq_norm_parts: Iterable[float]) -> float:
        """clip_coefficient of the squared norms of every gradient tensor of the model, added exactly (math.fsum):
        the same float whichever stages reported which parts, in whatever order."""
        return self.clip_coefficient(math.fsum(sq_norm_parts))


@dataclass(kw_only=True)
class SchedulerSection:
    """[scheduler]: admission and failure detection on the coordinator."""

    min_nodes: int = _bounded(1, 1, 100000, "nodes that must join before training starts")
    stages: int = _bounded(0, 0, 1024, "pipeline stages; 0 = one per node")
    heartbeat_interval_s: float = _bounded(1.0, 0.05, 60.0, "how often nodes heartbeat")
    heartbeat_timeout_s: float = _bounded(5.0, 0.2, 600.0, "silence after which a node is dead")
    step_timeout_s: float = _bounded(
        120.0, 1.0, 86400.0,
        "the least time a step has before it fails: a step fails once it took step_timeout_factor times the plan's "
        "estimate, or this long if that is longer (or no estimate yet)",
    )
    step_timeout_factor: float = _bounded(
        10.0, 1.0, 10000.0, "a step fails once it took this many times the plan's estimated step time (at least "
        "step_timeout_s): a big model on slow nodes has the time its plan says it needs"
    )
    state_deadline_floor_s: float = _bounded(
        300.0, 1.0, 86400.0, "the least time a state transfer (a checkpoint, a node loading its stage) has, whatever "
        "its bytes; it has twice its bytes' time over its link on top"
    )
    state_link_mbps: float = _bounded(
        10.0, 0.001, 1e6, "the bandwidth, in Mbit/s, a state transfer is given time for over a link no probe measured "
        "(a node's link to the coordinator is probed; others are assumed this slow)"
    )
    replicas: int = _bounded(0, 0, 100000, "most replicas per stage; 0 = every node serves; extra nodes are spares")
    checkpoint_every: int = _bounded(10, 0, 10**9, "steps between checkpoints (needs a state dir); 0 = only at the end")
    keep_checkpoints: int = _bounded(3, 1, 1000, "complete checkpoints kept")
    rejoin_timeout_s: float = _bounded(60.0, 0.0, 86400.0, "how long a stage without nodes waits for one to join")
    max_members: int = _bounded(10000, 1, 10**6, "live nodes the coordinator admits at most")
    forget_after_s: float = _bounded(
        600.0, 1.0, 10**7, "members dead this long, or never profiled and never planned this long, are forgotten "
        "(an id stays bound to the key that first registered it)"
    )
    spares_per_host: int = _bounded(32, 1, 10**6, "live members no plan ever gave a stage, from one host at most")
    spares_per_subnet: int = _bounded(
        128, 1, 10**6, "live members no plan ever gave a stage, from one /24 (IPv4) or /64 (IPv6) at most"
    )
    new_ids_per_s: float = _bounded(
        2.0, 0.001, 1e6, "new node ids one host may register per second, on average (its /24 or /64: 8 times that)"
    )
    new_id_burst: int = _bounded(16, 1, 10**6, "new node ids one host may register at once (its subnet: 8 times)")
    stall_refusal_s: float = _bounded(
        60.0, 0.1, 86400.0, "how long a key whose stage stalled a step (a neighbour reported its calls failing, and "
        "the step timed out) is refused stages the first time; it doubles each time after, up to a day"
    )
    behind_proxy: bool = field(
        default=False,
        metadata={"doc": "calls reach the coordinator through a relay or proxy on its own host (they come from "
                  "loopback): the dial-back then dials the address a node advertised, which the caller chooses; "
                  "otherwise it dials only the caller's own address"},
    )
    max_offences: int = _bounded(
        5, 1, 10**6, "refused reports (contradicting the plan, or for another member) that evict their sender"
    )
    placement: str = field(
        default="measured",
        metadata={"doc": "measured: the planner places stages by the nodes' profiles; uniform: equal layer counts"},
    )
    allreduce: str = field(
        default="auto",
        metadata={
            "doc": "how a stage's replicas average gradients: flat (one group), hierarchical (region by region "
            "wherever replicas span regions and some region has several), auto (whichever the cost model's "
            "estimate of the plan prices faster; flat until the nodes' profiles are in)"
        },
    )

    def __post_init__(self) -> None:
        _check_bounds(self, "scheduler")
        if self.placement not in ("measured", "uniform"):
            raise ConfigError(f"scheduler.placement must be measured or uniform, got {self.placement!r}")
        if self.allreduce not in ("auto", "flat", "hierarchical"):
            raise ConfigError(f"scheduler.allreduce must be auto, flat or hierarchical, got {self.allreduce!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"scheduler.heartbeat_timeout_s must exceed scheduler.heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), got {self.heartbeat_timeout_s}"
            )


_NO_CODEC = "none"
REPLICA_SYNC_MODES = ("every_step", "diloco")
_CODEC_KEYS = ("activations", "activation_grads", "replica_grads")
# protocol.probe.MAX_PROBE_BYTES (a test checks they agree): importing it loads torch through protocol.framing,
# which `geotrain --help`, `plan` and `status` must not pay for.
MAX_PROBE_BYTES = 64 << 20


@dataclass(kw_only=True)
class CompressionSection:
    """[compression]: the codec for each kind of traffic (see geotrain.compression)."""

    activations: str = field(
        default="none", metadata={"doc": "codec for activations sent forward, or auto (per link, from measurements)"}
    )
    activation_grads: str = field(
        default="none", metadata={"doc": "codec for gradients sent backward, or auto (per link, from measurements)"}
    )
    replica_grads: str = field(
        default="none",
        metadata={"doc": "how replicas average gradients: none (exact) or powersgd[:rank=R] (low-rank factors)"},
    )
    replica_robust: str = field(
        default="none",
        metadata={
            "doc": "none: replicas take the exact mean of their gradients; centered_clip: CenteredClip (BTARD), so "
            "that a replica sending an outlying gradient is clipped toward the others and flagged (lossy: honest "
            "replicas' gradients differ by their data, and farther than the radius they are clipped too)"
        },
    )
    replica_clip_rms: float = _bounded(
        0.1, 1e-12, 1e6, "CenteredClip's radius, as a root mean square per gradient value (a part of n values: x sqrt(n))"
    )
    replica_sync: str = field(
        default="every_step",
        metadata={
            "doc": "every_step: replicas average their gradients every step (exact); diloco: each replica applies its "
            "own gradients and every replica_sync_every steps they average their parameters' change since the last "
            "sync and take an outer Nesterov step (DiLoCo; far fewer bytes, not exact)"
        },
    )
    replica_sync_every: int = _bounded(32, 1, 10**6, "diloco: inner steps between two syncs (H)")
    replica_sync_lr: float = _bounded(0.7, 1e-6, 10.0, "diloco: the outer step's learning rate")
    replica_sync_momentum: float = _bounded(0.9, 0.0, 0.999, "diloco: the outer step's Nesterov momentum")

    def __post_init__(self) -> None:
        _check_bounds(self, "compression")
        if self.replica_robust not in ("none", "centered_clip"):
            raise ConfigError(f"compression.replica_robust must be none or centered_clip, got {self.replica_robust!r}")
        if self.replica_sync not in REPLICA_SYNC_MODES:
            raise ConfigError(f"compression.replica_sync must be every_step or diloco, got {self.replica_sync!r}")
        if self.diloco and (self.replica_robust != "none" or self.replica_grads.strip() != _NO_CODEC):
            # Both act on each step's gradient all-reduce, which diloco replaces by its periodic parameter sync.
            raise ConfigError("compression.replica_sync = 'diloco' averages no gradients: leave "
                              "compression.replica_grads and compression.replica_robust at 'none' with it")
        codecs = [f.name for f in dataclasses.fields(self) if f.name in _CODEC_KEYS]
        for name in codecs:
            if not getattr(self, name):
                raise ConfigError(f"compression.{name} must name a codec, e.g. 'none' or 'int8'")
        if all(getattr(self, name).strip() == _NO_CODEC for name in codecs):
            return  # the default needs no codec machinery, which loads torch (seconds) for `plan` and `--help`
        from geotrain.compression import CodecError, get_codec
        from geotrain.compression.policy import check_spec

        for f in dataclasses.fields(self):
            if f.name not in _CODEC_KEYS:
                continue
            try:
                check_spec(f.name, getattr(self, f.name))
            except CodecError as e:
                raise ConfigError(f"compression.{f.name}: {e}") from None
        if get_codec(self.replica_grads).base_name not in ("none", "powersgd"):
            # A codec applied to the all-reduce's messages rounds each replica's result differently (hivemind
            # compresses the averaged parts it sends back, not the sender's own), and the replicas' parameters
            # would drift apart; PowerSGD instead averages factors exactly (node.averaging.LowRankAveraging).
            raise ConfigError(
                f"compression.replica_grads must be 'none' or 'powersgd[:rank=R]', got {self.replica_grads!r}: "
                "a lossy all-reduce leaves stage replicas with different parameters"
            )
        if self.replica_robust != "none" and self.replica_rank is not None:
            raise ConfigError("compression.replica_robust clips gradients, not PowerSGD's factors: "
                              "set compression.replica_grads = 'none' with it")

    @property
    def diloco(self) -> bool:
        """Whether replicas train apart and sync their parameters every replica_sync_every steps (not exact)."""
        return self.replica_sync == "diloco"

    @property
    def inexact_replicas(self) -> str:
        """What the run says of its replicas' exactness: '' when they average every step."""
        if not self.diloco:
            return ""
        return f"replicas sync every {self.replica_sync_every} steps (DiLoCo): not exact"

    @property
    def replica_clip(self) -> float:
        """CenteredClip's radius per value when replicas aggregate robustly, 0 when they take the mean."""
        return self.replica_clip_rms if self.replica_robust == "centered_clip" else 0.0

    @property
    def replica_rank(self) -> int | None:
        """PowerSGD's rank when replicas average low-rank factors, None when they average raw gradients."""
        if self.replica_grads.strip() == _NO_CODEC:
            return None
        from geotrain.compression import get_codec

        codec = get_codec(self.replica_grads)
        return codec.param if codec.base_name == "powersgd" else None


@dataclass(kw_only=True)
class EmulationSection:
    """[emulation]: links between regions emulated by every node's data plane (for tests and benchmarks)."""

    links: list[str] = field(
        default_factory=list, metadata={"doc": '"regionA-regionB=MBPS/LATENCY_MS" entries, symmetric'}
    )

    def __post_init__(self) -> None:
        for entry in self.links:
            self._parse(entry)

    @staticmethod
    def _parse(entry: str) -> tuple[frozenset[str], float, float]:
        try:
            pair, shape = entry.split("=")
            a, b = pair.split("-")
            mbps, latency = (float(v) for v in shape.split("/"))
        except ValueError:
            raise ConfigError(f"emulation.links entry {entry!r} must look like 'eu-us=20/50' (Mbit/s / ms)") from None
        if not (0 <= mbps < math.inf and 0 <= latency < math.inf):
            raise ConfigError(f"emulation.links entry {entry!r} must have finite, non-negative numbers")
        return frozenset((a.strip(), b.strip())), mbps, latency

    def link(self, region_a: str, region_b: str) -> tuple[float, float] | None:
        """(Mbit/s, one-way ms) of the emulated link between two regions, or None if not emulated."""
        for entry in self.links:
            pair, mbps, latency = self._parse(entry)
            if pair == frozenset((region_a, region_b)):
                return mbps, latency
        return None


@dataclass(kw_only=True)
class ProfileSection:
    """[profile]: what every node measures when it joins (geotrain.node.profiler)."""

    probe_bytes: int = _bounded(
        2 << 20, 64 << 10, MAX_PROBE_BYTES,
        "bytes of each link's bandwidth probe; several MiB on a WAN, so TCP's ramp-up and a shaper's burst do not count",
    )
    layer_repeats: int = _bounded(5, 1, 100, "timed fwd+bwd runs of each layer after a warm-up; the median counts")
    reprobe_s: float = _bounded(300.0, 0.0, 86400.0, "seconds between re-measurements of a node's links; 0: never")
    memory_headroom_mib: int = _bounded(
        512, 0, 1 << 30,
        "MiB of free device (or host) memory a node keeps back from its stage: allocator slack, the CUDA context",
    )

    def __post_init__(self) -> None:
        _check_bounds(self, "profile")


@dataclass(kw_only=True)
class LimitsSection:
    """[limits]: what one peer may hold or send at a node's and the coordinator's gRPC servers, so that a token holder
    cannot starve the run (a peer is a node id from one host)."""

    streams_per_peer: int = _bounded(
        16, 1, 10000, "streams a peer may have open at once (Forward, Backward, Probe); a sender opens 8 at most"
    )
    streams_per_host: int = _bounded(128, 1, 100000, "streams all peers on one host may have open at once")
    idle_stream_s: float = _bounded(
        30.0, 0.1, 3600.0, "a stream that sends nothing for this long is cut (a 1 MiB chunk at 1 Mbit/s takes 8 s)"
    )
    calls_per_s: float = _bounded(200.0, 1.0, 1e6, "calls a peer may start per second, on average")
    call_burst: int = _bounded(400, 1, 10**7, "calls a peer may start at once after being quiet")
    registrations_per_s: float = _bounded(
        50.0, 0.01, 1e6, "registrations one key (or unsigned calls) from one host may make per second, on average; a "
        "host 8 times that (the coordinator)"
    )
    registration_burst: int = _bounded(100, 1, 10**7, "registrations one key from one host may make at once")

    def __post_init__(self) -> None:
        _check_bounds(self, "limits")
        if self.streams_per_host < self.streams_per_peer:
            raise ConfigError(
                f"limits.streams_per_host must be at least limits.streams_per_peer ({self.streams_per_peer}), "
                f"got {self.streams_per_host}"
            )

    def values(self) -> LimitValues:
        """The numbers a server's PeerLimits enforces (registrations are the coordinator's own)."""
        from geotrain.protocol.limits import LimitValues

        return LimitValues(
            streams_per_peer=self.streams_per_peer, streams_per_host=self.streams_per_host,
            idle_stream_s=self.idle_stream_s, calls_per_s=self.calls_per_s, call_burst=self.call_burst,
        )


@dataclass(kw_only=True)
class TransportSection:
    """[transport]: how tensors travel between nodes."""

    tensor_stream: str = field(
        default="tcp",
        metadata={
            "doc": "tcp: activations and gradients to a node that can be dialled go over a raw TCP stream (TLS when "
            "the run has it) that a signed gRPC call opens, half the gRPC path's CPU per MiB "
            "(bench/tensor_path.py); links over reverse streams or relays, and peers whose stream port cannot be "
            "reached, stay on gRPC. grpc: every tensor goes over gRPC calls, and nodes open no stream port"
        },
    )

    def __post_init__(self) -> None:
        if self.tensor_stream not in ("tcp", "grpc"):
            raise ConfigError(f"transport.tensor_stream must be tcp or grpc, got {self.tensor_stream!r}")


@dataclass(kw_only=True)
class VerifySection:
    """[verify]: spot checks of planned nodes' work, recomputed bit for bit by another node (scheduler/verification.py)."""

    fraction: float = _bounded(
        0.0, 0.0, 1.0, "(stage, microbatch) pairs of each committed step a verifier recomputes, drawn after the step; "
        "0 = off; what 0.05 costs is in the README. Checks need an exact run (activation and gradient codecs none, no "
        "diloco) on one device class"
    )
    keep_steps: int = _bounded(4, 1, 64, "steps whose evidence (inputs received, parameters) a node keeps for checks")

    def __post_init__(self) -> None:
        _check_bounds(self, "verify")


@dataclass(kw_only=True)
class RunConfig:
    """The whole run configuration."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    compression: CompressionSection = field(default_factory=CompressionSection)
    emulation: EmulationSection = field(default_factory=EmulationSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    transport: TransportSection = field(default_factory=TransportSection)
    verify: VerifySection = field(default_factory=VerifySection)

    @property
    def verifying(self) -> bool:
        """Whether planned nodes commit to their tensors and are spot-checked: verify.fraction > 0 in a run whose
        tensors cross the wire unchanged (a lossy codec's output no recompute reproduces) and whose replicas stay
        bit-identical."""
        c = self.compression
        lossless = c.activations == "none" and c.activation_grads == "none"
        return self.verify.fraction > 0 and lossless and not c.diloco

    @property
    def tokens_per_step(self) -> int:
        """Tokens the model trains on in one step."""
        return self.train.microbatches * self.train.microbatch_size * self.model.seq_len


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def _coerce(section: str, key: str, hint: Any, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    where = f"{section}.{key}"
    origin = typing.get_origin(hint)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        return list(value)
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint in (int, float):
        try:
            if isinstance(value, bool):
                raise ValueError
            converted = hint(value) if hint is float or not isinstance(value, str) else int(value, 0)
            if hint is int and isinstance(value, float) and converted != value:
                raise ValueError
            return converted
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be {'an integer' if hint is int else 'a number'}, got {value!r}") from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where} has an unsupported type")  # pragma: no cover


def _suggest(section: str, key: str, known: Iterable[str]) -> str:
    """"did you mean X?" for a mistyped key or section close to a known one, else the list of known ones."""
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    return f"known: {', '.join(sorted(known))}"


# A Hugging Face config.json's keys for the [model] keys its shape gives (model.init_from).
_HF_SHAPE = {
    "n_layers": "num_hidden_layers", "d_model": "hidden_size", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "mlp_width": "intermediate_size", "norm_eps": "rms_norm_eps",
    "vocab_size": "vocab_size", "tie_embeddings": "tie_word_embeddings",
}


def _init_from_shape(model: dict[str, Any]) -> dict[str, Any]:
    """The shape keys a llama [model] leaves unset, from the config.json of its model.init_from directory (read
    where the config is loaded: a coordinator without that directory needs them set). Keys the run config sets are
    kept; one that differs from the checkpoint's is refused where config.json is checked (node/llama.py)."""
    missing = [key for key in (*_HF_SHAPE, "rope_base") if key not in model]
    if not missing or model.get("family") != "llama":  # another family refuses init_from by itself
        return {}
    path = Path(model["init_from"]) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not a JSON file ({e})"
        raise ConfigError(
            f"model.init_from {model['init_from']}: cannot read config.json ({why}) for the model.{', model.'.join(missing)} "
            "the run config does not set: set them, or load the config where that directory is"
        ) from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.init_from {model['init_from']}: config.json is not a JSON object")
    shape: dict[str, Any] = {key: hf[theirs] for key, theirs in _HF_SHAPE.items() if hf.get(theirs) is not None}
    # transformers 5 nests the rotary base in rope_parameters; 4.x has rope_theta (and rope_scaling) at the top.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta")) if isinstance(rope, dict) else hf.get("rope_theta")
    if theta is not None:
        shape["rope_base"] = theta
    return {key: value for key, value in shape.items() if key in missing}


def build_config(raw: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from a nested dict (a parsed TOML file)."""
    sections = _section_types()
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in sections:
            raise ConfigError(f"unknown section [{name}]; {_suggest('', name, sections)}")
        if not isinstance(value, dict):
            raise ConfigError(f"[{name}] must be a table")
        cls = sections[name]
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        fields_: dict[str, Any] = {}
        for key, v in value.items():
            if key not in known:
                raise ConfigError(f"unknown key {name}.{key}; {_suggest(name, key, known)}")
            if v == "auto" and "auto" in known[key].metadata:
                v = known[key].metadata["auto"]
            fields_[key] = _coerce(name, key, hints[key], v)
        if name == "model" and fields_.get("init_from"):
            for key, v in _init_from_shape(fields_).items():
                fields_[key] = _coerce(name, key, hints[key], v)
        kwargs[name] = cls(**fields_)
    return RunConfig(**kwargs)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings to a raw config dict (values typed later by build_config)."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        path, sep, value = item.partition("=")
        section, dot, key = path.strip().partition(".")
        if not sep or not dot or not section or not key:
            raise ConfigError(f"--set takes section.key=value, got {item!r}")
        merged.setdefault(section, {})
        if not isinstance(merged[section], dict):
            raise ConfigError(f"[{section}] must be a table")
        merged[section][key] = value.strip()
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML run config (or the defaults when path is None) and apply --set overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not a text file (not UTF-8): a run config is TOML text") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    return build_config(apply_overrides(raw, overrides or []))


# Sections a node needs; [scheduler] stays on the coordinator.
_WIRE_SECTIONS = (
    "run", "model", "data", "train", "compression", "emulation", "profile", "limits", "transport", "verify",
)


def to_proto(cfg: RunConfig) -> pb.RunConfig:
    """The node-facing part of the config as the typed wire message."""
    msg = pb.RunConfig()
    for name in _WIRE_SECTIONS:
        section, target = getattr(cfg, name), getattr(msg, name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, list):
                getattr(target, f.name).extend(value)
            else:
                setattr(target, f.name, value)
    return msg


def from_proto(msg: pb.RunConfig) -> RunConfig:
    """Rebuild (and validate) a RunConfig from the wire message; [scheduler] takes its defaults."""
    raw: dict[str, Any] = {}
    for name in _WIRE_SECTIONS:
        section_msg = getattr(msg, name)
        hints = typing.get_type_hints(_section_types()[name])
        raw[name] = {}
        for f in dataclasses.fields(_section_types()[name]):
            value = getattr(section_msg, f.name)
            raw[name][f.name] = list(value) if typing.get_origin(hints[f.name]) is list else value
    return build_config(raw)


def saved_model_config(path: str | Path) -> ModelSection:
    """The [model] section a safetensors file written by --save-final records, to load it without the run config."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        recorded = (f.metadata() or {}).get(MODEL_METADATA_KEY)
    if recorded is None:
        raise ConfigError(f"{path} records no [model] section (metadata key {MODEL_METADATA_KEY!r})")
    return build_config({"model": json.loads(recorded)}).model
