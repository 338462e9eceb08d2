"""Estimated step time of a pipeline plan, from numbers the nodes measured.

The model (all times per training step of M microbatches; "one microbatch" means fwd+bwd):

For stage s with replicas R_s serving layers [a_s, b_s):
    t_r = sum of node r's layer_seconds over [a_s, b_s)       one microbatch on replica r
    c_s = 1 / sum_r (1 / t_r)                                   stage occupancy per microbatch: replicas share
                                                                microbatches in proportion to speed
    h_s = |R_s| * c_s                                           harmonic mean of t_r: one microbatch's latency
    w_r = c_s / t_r                                             share of the microbatches replica r gets
For the boundary s -> s+1 carrying B = boundary_bytes[b_s - 1] per microbatch, codec ratio rho:
    sigma_ij = B * rho_ij / bw_ij                               serialisation one way: links are full duplex, so
                                                                activations forward and gradients back overlap
    tau_ij = 2 * (sigma_ij + lat_ij + e)                        one microbatch's transfer there and back, i->j
    x_s = sum_ij w_i w_j tau_ij                                 expected over speed-weighted routing
    o_s = (sum_ij w_i w_j sigma_ij) / min(|R_s|, |R_s+1|)       link occupancy: disjoint pairs send in parallel;
                                                                latency does not occupy a link (microbatches in
                                                                flight overlap it), it counts once in the fill
where e is the fixed seconds a crossing costs beyond its bytes and the link's latency (StepShape.crossing_s: encoding
and decoding, framing, the receiver's queue, a rate limiter's buffer).
For the replica gradient averaging of stage s (hivemind butterfly all-reduce, n = |R_s| >= 2):
    flat(G, P) = 2 (n-1)/n * P / min_{i!=j in G} bw_ij + 2 * max_{i!=j in G} lat_ij     n = |G|
    g_s = flat(R_s, P_s)                                        P_s = parameter bytes of the stage
  or, hierarchically, where the replicas sit in m >= 2 regions with k_r of them in region r and some k_r >= 2
  (node.averaging: average inside each region, all-reduce L = max k_r shards across regions, each by one replica
  per region, then share the shards inside each region again):
    h_s = 2 max_r flat(R_s in r, P_s) + max_r ceil(L/k_r)/L * 2 (m-1)/m * P_s / min bw_x + 2 max lat_x
  where bw_x and lat_x range over pairs of replicas in different regions; g_s = min(flat, h_s) with
  allreduce="auto", either one alone with "flat" or "hierarchical".
The data heads' window (train.inflight = W; None: unbounded): each replica of stage 0 keeps at most W microbatches
in flight and launches the next only when one has come back: the first K = W |R_0| start at once, each later one a
round trip after the one it replaces, so the M microbatches go in ceil(M / K) waves of one round trip each,
    w = (ceil(M / K) - 1) * (sum_s h_s + sum_s x_s)             the waves after the first (none when K >= M)
Under train.inflight = "auto" plans are searched unbounded and each plan gets the smallest window that keeps its pace
(by Little's law: a round trip's worth of microbatches at the pace),
    W = ceil((sum_s h_s + sum_s x_s) / (max(max_s c_s, max_s o_s) * |R_0|))
lowered where a replica's memory cannot hold its share of the W |R_0| microbatches in flight (below).
Step (GPipe-style fill and drain; compute and communication overlap, so the slowest resource sets the pace):
    beta = max(max_s c_s, max_s o_s)
    T = max((M - 1) * beta, w) + sum_s h_s + sum_s x_s + max_s g_s + f + r
  and with one stage (data parallelism: nothing to fill, the replicas take their shares side by side)
    T = max(max(M - |R_0|, 0) * c_0, w) + h_0 + g_0 + f + r
    samples/s = M * microbatch_size / T
where r = max over the data heads of their round trip to the coordinator (NodeProfile.coordinator_rtt_s): between a
head's last backward of a step and its first forward of the next, its reports reach the coordinator and the order
to apply comes back (the other stages finish their backwards first, so their reports are in by then), and f is the
commit's fixed seconds (StepShape.commit_s: the commit order, gradient means and norms, their reports),
and each hivemind round of g_s costs a fixed StepShape.averaging_round_s on top of its bytes (matchmaking, message
overheads; a flat all-reduce is one round, a hierarchical one HIERARCHICAL_ROUNDS); a live run measures these and e
(scheduler.calibration), a plan from profiles alone counts them 0.

Memory of a replica of stage s among S stages (geotrain/memory.py, the model a node checks itself against too): the
larger of training (24 bytes a parameter: fp32 weight, gradient, float64 gradient sum, AdamW's two moments; 8 more
under diloco) with the activations of its microbatches in flight and the largest tensor's gradient widened to
float64, and serving its state (the state after the commit and a snapshot of it, the largest tensor framed); on top of
the node's measured baseline (NodeProfile.baseline_bytes), within its memory_bytes. Activations are of min(M, S) microbatches in flight (1F1B
keeps at most S - s; S is the stage-independent bound) while plans are searched; a plan's window W puts
min(M, ceil(W |R_0| w_r)) of them on replica r, its routing share of the W |R_0| microbatches the data heads keep in
flight, and the plan reports that, per stage and per node.
A link between two nodes nobody can dial goes through a relay, which receives every byte and sends it again: its
bandwidth counts twice and its latency once per hop, so such a pair's link is priced at half its bandwidth and twice
its latency (the pair's own link stands for both of the relay's; which node relays is chosen after planning).
P_s counts the bytes each replica puts on the all-reduce's wire: the stage's parameter count times
StepShape.sync_bytes_per_value, which a live run sets to 8 (node.averaging adds the replicas' float64 gradient sums
exactly, so replicas end bit-identical; PowerSGD's factors are float64 too), or 2 under diloco (int16).
Not modelled: contention of several pairs on one region's uplink, and the all-reduce overlapping the drain.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from geotrain import memory
from geotrain.config import AUTO_INFLIGHT, MAX_INFLIGHT, RunConfig
from geotrain.scheduler.costinputs import CodecRatio, Link, ModelProfile, Network, NodeProfile
from geotrain.scheduler.links import LinkClasses

logger = logging.getLogger(__name__)

ALLREDUCE_MODES = ("auto", "flat", "hierarchical")
"""How replicas average (scheduler.allreduce): the faster estimate per stage, or one way wherever it applies."""

FP32_BYTES = memory.FP32_BYTES
EXACT_SUM_BYTES = 8  # node.averaging all-reduces replicas' float64 gradient sums: exact in any order
DILOCO_WIRE_BYTES = 2  # node.diloco's pseudo-gradients cross the wire as int16
HIERARCHICAL_ROUNDS = 3  # a hierarchical all-reduce: inside each region, the shards across regions, inside again


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """One training step as the cost model and the planner see it: how many microbatches of what size, what the
    codecs leave of a boundary's bytes, the data heads' window and how replicas average."""

    microbatches: int
    """Microbatches per step (M; train.microbatches)."""
    microbatch_size: int
    """Samples per microbatch (train.microbatch_size)."""
    codec_ratio: CodecRatio = field(default_factory=CodecRatio)
    """Compressed / raw size of activations and their gradients per link kind; a float applies to every link."""
    inflight: int | str | None = None
    """Microbatches each data head keeps in flight (train.inflight); None: unbounded; "auto": each plan's own
    (Plan.inflight)."""
    allreduce: str = "auto"
    """How replicas average (scheduler.allreduce): one of ALLREDUCE_MODES."""
    replica_rank: int | None = None
    """PowerSGD's rank when replicas average low-rank factors (compression.replica_grads); None: raw gradients."""
    replica_sync_every: int = 1
    """Steps between two replica averagings: 1 averages gradients every step; H under compression.replica_sync =
    "diloco", whose sync moves as many bytes as a step's gradient averaging once every H steps."""
    compute_bytes: int = 4
    """Bytes per value the stages compute in (train.precision): 2 under bf16/fp16 autocast (whose 16-bit weight
    copies each microbatch keeps with its activations, as the nodes measure them)."""
    recompute: bool = False
    """Stages keep only each layer's input per microbatch and recompute one layer at a time in backward
    (train.recompute)."""
    diloco: bool = False
    """Replicas average under compression.replica_sync = "diloco", and keep its anchor and velocity (memory)."""
    sync_bytes_per_value: int | None = None
    """Bytes per gradient value each replica puts on the all-reduce's wire; None: the training dtype's. A live run
    (from_config) sends 8, the float64 sums node.averaging adds exactly (PowerSGD's factors are float64 too), or 2
    under diloco, whose pseudo-gradients cross as int16."""
    averaging_round_s: float = 0.0
    """Fixed seconds of each hivemind all-reduce round beyond its bytes over the bandwidth (measured in the run)."""
    commit_s: float = 0.0
    """Fixed seconds each step's commit adds to the pipeline's (measured in the run)."""
    crossing_s: float = 0.0
    """Fixed seconds each boundary crossing of a microbatch costs beyond its bytes over the bandwidth and the link's
    latency (measured in the run: the data heads' round trips)."""

    def __post_init__(self) -> None:
        # Frozen: the one normalisation goes through object.__setattr__.
        object.__setattr__(self, "codec_ratio", CodecRatio.of(self.codec_ratio))
        if self.microbatches <= 0 or self.microbatch_size <= 0:
            raise ValueError("microbatches and microbatch_size must be > 0")
        if self.replica_rank is not None and self.replica_rank <= 0:
            raise ValueError(f"replica_rank must be > 0 or None, got {self.replica_rank}")
        if self.allreduce not in ALLREDUCE_MODES:
            raise ValueError(f"allreduce must be one of {', '.join(ALLREDUCE_MODES)}, got {self.allreduce!r}")
        if self.inflight not in (None, "auto") and not (isinstance(self.inflight, int) and self.inflight > 0):
            raise ValueError(f"inflight must be > 0, None or 'auto', got {self.inflight!r}")
        if not (isinstance(self.replica_sync_every, int) and self.replica_sync_every >= 1):
            raise ValueError(f"replica_sync_every must be an integer >= 1, got {self.replica_sync_every!r}")
        if self.compute_bytes not in (2, 4):
            raise ValueError(f"compute_bytes must be 2 or 4, got {self.compute_bytes}")
        if self.sync_bytes_per_value not in (None, 1, 2, 4, 8):
            raise ValueError(f"sync_bytes_per_value must be 1, 2, 4, 8 or None, got {self.sync_bytes_per_value!r}")
        for name in ("averaging_round_s", "commit_s", "crossing_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)!r}")

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        *,
        param_shapes_known: bool,
        averaging_round_s: float = 0.0,
        commit_s: float = 0.0,
        crossing_s: float = 0.0,
    ) -> StepShape:
        """The step of a run config, with the fixed costs a live run measured. Low-rank averaging is priced only where
        the model's parameter shapes are known (they size PowerSGD's factors), raw averaging elsewhere. Boundaries are
        priced at their raw size whatever the codecs, as the coordinator always has: "auto" picks a link's codec only
        after the plan is made."""
        return cls(
            microbatches=cfg.train.microbatches,
            microbatch_size=cfg.train.microbatch_size,
            inflight="auto" if cfg.train.inflight == AUTO_INFLIGHT else cfg.train.inflight,
            allreduce=cfg.scheduler.allreduce,
            replica_rank=cfg.compression.replica_rank if param_shapes_known else None,
            replica_sync_every=cfg.compression.replica_sync_every if cfg.compression.diloco else 1,
            compute_bytes=4 if cfg.train.precision == "fp32" else 2,
            recompute=cfg.train.recompute,
            diloco=cfg.compression.diloco,
            sync_bytes_per_value=DILOCO_WIRE_BYTES if cfg.compression.diloco else EXACT_SUM_BYTES,
            averaging_round_s=averaging_round_s,
            commit_s=commit_s,
            crossing_s=crossing_s,
        )


@dataclass(kw_only=True)
class StagePlan:
    """One pipeline stage of a plan, with its estimated load per step."""

    start: int
    """First layer (inclusive)."""
    end: int
    """Last layer (exclusive)."""
    node_ids: list[str]
    """Replicas serving the stage, sorted."""
    compute_s: float
    """Busy seconds per step of the stage: M * c_s."""
    transfer_s: float
    """Busy seconds per step of the link to the next stage: M * o_s (0 for the last stage)."""
    allreduce_s: float
    """Seconds of the replicas' gradient averaging at the end of the step."""
    hierarchical_allreduce: bool = False
    """Replicas average inside each region first, then across regions shard by shard, then share the shards
    inside each region again (set where the estimate says it beats one flat all-reduce)."""
    allreduce_rounds: int = 0
    """hivemind all-reduce rounds of the replicas' averaging in a step that averages (0: one replica)."""
    memory_bytes: int
    """Memory each replica needs beyond its baseline (the most any of them needs)."""


@dataclass(kw_only=True)
class Plan:
    """A pipeline plan and its estimate."""

    stages: list[StagePlan]
    """Stages in pipeline order."""
    excluded: dict[str, str]
    """Node id -> why it is left out."""
    microbatches: int
    """Microbatches per step (M)."""
    microbatch_size: int
    """Samples per microbatch."""
    step_seconds: float
    """Estimated seconds per step."""
    samples_per_s: float
    """Estimated training throughput."""
    bottleneck: str
    """What limits the step, and why."""
    compute_bound_samples_per_s: float
    """Sum of the full-model speeds of every node with memory for some stage: no plan beats it."""
    inflight: int | None = None
    """Microbatches each data head keeps in flight under this plan, the window it is priced at (train.inflight, the
    plan's own under "auto", or the one a running plan was made with); None: unbounded."""
    chosen_inflight: int | None = None
    """The window train.inflight gives this layout now (under "auto" from these profiles): a running plan priced at
    the window it was made with may run another."""
    window_need: float | None = None
    """Under "auto": the microbatches in flight per data head that keep the unbounded pace, before chosen_inflight
    rounds them up and caps them."""
    round_trip_s: float = 0.0
    """One microbatch's round trip through every stage and back (sum_s h_s + sum_s x_s)."""
    coordinator_round_trip_s: float = 0.0
    """The data heads' slowest round trip to the coordinator (r), which each step waits once."""
    node_memory_bytes: dict[str, int] = field(default_factory=dict)
    """Node id -> the peak memory its process is estimated at: its baseline and its stage's need at its share of
    the window's microbatches in flight."""
    layout: str = ""
    """The plan's shape (layout_of): "pipeline", "data parallel", "hybrid" or "one node"."""
    layout_steps: dict[str, float] = field(default_factory=dict)
    """Layout -> the best estimated step seconds the planner found of it: why it chose this plan's layout."""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)

    def layer_ranges(self) -> dict[str, tuple[int, int]]:
        """Node id -> the layer range it serves."""
        return {n: (st.start, st.end) for st in self.stages for n in st.node_ids}


Stages = Sequence[tuple[int, int, Sequence[int]]]
"""Internal plan form: (start, end, node indices) per stage, indices into CostModel.nodes."""


def layout_of(stages: Stages) -> str:
    """A plan's shape: one stage of several replicas is data parallelism (every node holds the whole model), stages
    of one node each a pipeline, several stages with replicas a hybrid."""
    if len(stages) == 1:
        return "data parallel" if len(stages[0][2]) > 1 else "one node"
    return "pipeline" if all(len(nodes) == 1 for *_, nodes in stages) else "hybrid"


@dataclass(kw_only=True)
class _Terms:
    occupancy: np.ndarray  # c_s
    latency: np.ndarray  # h_s
    transfer: np.ndarray  # x_s, one per boundary
    link_occupancy: np.ndarray  # o_s, one per boundary
    allreduce: np.ndarray  # g_s
    paced: float  # the pace term: (M - 1) x the slowest stage or link (M - |R_0| for a lone stage)
    window: float  # w, the seconds the data heads' window paces the step
    control: float  # r, the data heads' slowest round trip to the coordinator
    step_s: float


class CostModel:
    """Scores plans over a fixed set of nodes; precomputes pairwise link matrices once."""

    def __init__(
        self,
        *,
        nodes: Sequence[NodeProfile],
        model: ModelProfile,
        network: Network,
        shape: StepShape,
    ) -> None:
        ids = [n.node_id for n in nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("node ids must be unique")
        for n in nodes:
            if len(n.layer_seconds) != model.n_layers:
                raise ValueError(
                    f"node {n.node_id} has {len(n.layer_seconds)} layer times, the model has {model.n_layers} layers"
                )
        self.nodes = list(nodes)
        self.model = model
        self.network = network
        self.shape = shape
        self.index = {nid: i for i, nid in enumerate(ids)}
        n_layers = model.n_layers
        self.prefix_seconds = np.zeros((len(nodes), n_layers + 1))
        if nodes:
            self.prefix_seconds[:, 1:] = np.cumsum([n.layer_seconds for n in nodes], axis=1)
        self.memory = np.array([n.room_bytes for n in nodes], dtype=np.float64)  # what a stage may take
        self.coordinator_rtt = np.array([n.coordinator_rtt_s for n in nodes], dtype=np.float64)
        self.param_prefix = np.concatenate([[0.0], np.cumsum(model.layer_param_bytes, dtype=np.float64)])
        self.count_prefix = self.param_prefix / model.bytes_per_value
        # Bits of each all-reduce round of replica averaging, summed over layers: [round][b] = bits of layers [0, b).
        self.sync_prefix = [
            np.concatenate([[0.0], np.cumsum(round_, dtype=np.float64) * 8])
            for round_ in model.replica_sync_bytes(shape.replica_rank, shape.sync_bytes_per_value)
        ]
        acts = np.asarray(model.layer_activation_bytes, dtype=np.float64)
        self.act_prefix = np.concatenate([[0.0], np.cumsum(acts)])
        # With recomputation: each layer keeps its input (the previous layer's boundary; token ids for the first,
        # negligible), and backward holds one layer's full activations at a time, the largest of the stage's.
        self.input_prefix = np.concatenate([[0.0, 0.0], np.cumsum(model.boundary_bytes[:-1], dtype=np.float64)])
        self.max_act = np.zeros((model.n_layers + 1, model.n_layers + 1))
        self.max_tensor = np.zeros_like(self.max_act)
        tensors = np.asarray(model.largest_tensor_bytes, dtype=np.float64)
        for a in range(model.n_layers):
            self.max_act[a, a + 1:] = np.maximum.accumulate(acts[a:])
            self.max_tensor[a, a + 1:] = np.maximum.accumulate(tensors[a:])
        self.boundary_bits = np.asarray(model.boundary_bytes, dtype=np.float64) * 8
        self.links = LinkClasses(self.nodes, network, shape.codec_ratio)
        self._stage_memo: dict[tuple, tuple] = {}
        self._boundary_memo: dict[tuple[int, int], tuple[float, float]] = {}
        self._fits_memo: dict[tuple, bool] = {}
        # A node that cannot hold even the smallest one-layer stage can serve no plan.
        self.usable = [int(i) for i in np.flatnonzero(self.memory >= self.min_memory_bytes())]

    def _allreduce_both(self, idx: np.ndarray, bits: np.ndarray | float) -> tuple:
        """Seconds of one flat and one hierarchical all-reduce of bits (a number or an array of sizes) among the
        replicas idx; inf where that way does not apply or is not allowed."""
        (flat_per_bit, flat_s), hierarchical = self.links.group_terms(idx, self.shape.allreduce)
        round_s = self.shape.averaging_round_s
        if hierarchical is None:
            return flat_per_bit * bits + flat_s + round_s, math.inf
        flat = flat_per_bit * bits + flat_s + round_s if self.shape.allreduce == "auto" else math.inf
        (inside_per_bit, inside_s), (shard_per_bit, shard_s) = hierarchical
        region_rounds = np.max(
            np.multiply.outer(inside_per_bit, bits) + inside_s.reshape((-1,) + (1,) * np.ndim(bits)), axis=0
        )
        return flat, 2 * region_rounds + shard_per_bit * bits + shard_s + HIERARCHICAL_ROUNDS * round_s

    def _sync_both(self, idx: np.ndarray, start: np.ndarray | int, end: np.ndarray | int) -> tuple:
        """Seconds per step of the replicas idx averaging layers [start, end) (numbers or arrays), every round flat
        and every round hierarchical: a stage averages one way throughout. A sync every H steps costs its whole
        time once in H steps (StepShape.replica_sync_every)."""
        if len(idx) < 2:
            return 0.0, math.inf
        both = [self._allreduce_both(idx, p[end] - p[start]) for p in self.sync_prefix]
        every = self.shape.replica_sync_every
        return sum(flat for flat, _ in both) / every, sum(hierarchical for _, hierarchical in both) / every

    def sync_seconds(self, idx: np.ndarray, start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray | float:
        """Replica averaging of layers [start, end) (numbers or arrays of bounds) among the replicas idx, the
        faster of the flat and the hierarchical way where both are allowed (see the module docstring)."""
        faster = np.minimum(*self._sync_both(idx, start, end))
        return faster if np.ndim(faster) else float(faster)

    def hierarchical_allreduce(self, idx: np.ndarray, start: int, end: int) -> bool:
        """Whether the replicas idx average layers [start, end) hierarchically (region by region)."""
        flat, hierarchical = self._sync_both(idx, start, end)
        return bool(hierarchical < flat)

    # --- per-node and per-range quantities -------------------------------------------------------------

    def node_seconds(self, idx: np.ndarray, start: int, end: int) -> np.ndarray:
        """One microbatch's fwd+bwd seconds over [start, end) on each node in idx."""
        return self.prefix_seconds[idx, end] - self.prefix_seconds[idx, start]

    def _activation_bytes(
        self, start: np.ndarray | int, end: np.ndarray | int, in_flight: int
    ) -> np.ndarray | float:
        """Activations a replica of layers [start, end) keeps for in_flight microbatches (with recomputation only
        each layer's input, plus one layer's activations in backward)."""
        if self.shape.recompute:
            return (self.input_prefix[end] - self.input_prefix[start]) * in_flight + self.max_act[start, end]
        return (self.act_prefix[end] - self.act_prefix[start]) * in_flight

    def stage_memory_bytes(
        self, start: np.ndarray | int, end: np.ndarray | int, n_stages: int, in_flight: int | None = None
    ) -> np.ndarray | float:
        """Memory a replica of layers [start, end) (numbers or arrays of bounds) needs beyond its baseline in a
        pipeline of n_stages (geotrain/memory.py): its state while training with the activations of the microbatches
        in flight, min(M, n_stages) unless given, or while it serves a snapshot of its state, whichever is more."""
        if in_flight is None:
            in_flight = min(self.shape.microbatches, n_stages)
        need = memory.stage_bytes(
            self.count_prefix[end] - self.count_prefix[start], self._activation_bytes(start, end, in_flight),
            self.max_tensor[start, end], diloco=self.shape.diloco,
        )
        return need if np.ndim(need) else float(need)

    def min_memory_bytes(self) -> float:
        """Smallest memory any stage needs: one layer, one microbatch in flight."""
        return min(self.stage_memory_bytes(i, i + 1, 1) for i in range(self.model.n_layers))

    def no_room(self) -> str:
        """Why no node can hold a stage, in one line: what the smallest stage needs against the roomiest node, and
        what nodes found out themselves."""
        gib = 2**30
        layer = min(range(self.model.n_layers), key=lambda i: self.stage_memory_bytes(i, i + 1, 1))
        line = (f"the smallest (layer {layer}, one microbatch) needs {self.min_memory_bytes() / gib:.2f} GiB beyond a"
                f" node's baseline")
        if self.nodes:
            roomiest = int(np.argmax(self.memory))
            line += (f", the roomiest node ({self.nodes[roomiest].node_id}) has"
                     f" {max(self.memory[roomiest], 0) / gib:.2f} GiB")
        unfit = [f"{n.node_id}: {n.unfit}" for n in self.nodes if n.unfit]
        return line + "".join(f"; {u}" for u in unfit[:3]) + (f"; {len(unfit) - 3} more" if len(unfit) > 3 else "")

    def compute_bound(self, idx: Sequence[int]) -> float:
        """Samples/s if the nodes in idx each ran the whole model with no communication at all."""
        full = self.prefix_seconds[np.asarray(idx, dtype=np.int64), -1]
        return float(np.sum(1.0 / full)) * self.shape.microbatch_size

    # --- plan terms: the formulas of the module docstring, on numbers or arrays (the planner's tables) ----

    @staticmethod
    def compute_terms(
        rate: np.ndarray | float, replicas: np.ndarray | int
    ) -> tuple[np.ndarray | float, np.ndarray | float]:
        """c_s and h_s of a stage whose replicas (that many) together do rate = sum_r 1 / t_r microbatches per
        second."""
        occupancy = 1.0 / rate
        return occupancy, replicas * occupancy

    def boundary_terms(
        self, bits: np.ndarray | float, seconds_per_bit: np.ndarray | float, latency_s: np.ndarray | float, pairs: int
    ) -> tuple[np.ndarray | float, np.ndarray | float]:
        """o_s and x_s of a boundary carrying bits per microbatch over links of seconds_per_bit (codec applied)
        and latency_s, with `pairs` disjoint pairs sending in parallel."""
        serialise = bits * seconds_per_bit
        return serialise / pairs, 2 * (serialise + latency_s + self.shape.crossing_s)

    @property
    def fixed_window(self) -> int | None:
        """The window every plan is priced with: train.inflight when it is a number; None while searching unbounded
        (and under "auto", whose window each plan gets once chosen: auto_window)."""
        return self.shape.inflight if isinstance(self.shape.inflight, int) else None

    def window_paced_seconds(
        self, round_trip_s: np.ndarray | float, data_heads: int, window: int | None
    ) -> np.ndarray | float:
        """w: the seconds a window of that many microbatches per data head (None: unbounded) paces the step, for one
        microbatch's round trip over all stages: a round trip for each wave of microbatches after the first."""
        if not window:
            return 0.0 * round_trip_s
        return (math.ceil(self.shape.microbatches / (window * data_heads)) - 1) * round_trip_s

    def paced_seconds(self, per_microbatch_s: np.ndarray | float, starters: int = 1) -> np.ndarray | float:
        """The step's pace term: seconds of the microbatches after the first `starters` at this pace (M - 1 in a
        pipeline; see lone_starters)."""
        paced = max(self.shape.microbatches - starters, 0)
        if paced or np.all(np.isfinite(per_microbatch_s)):
            return paced * per_microbatch_s
        # One microbatch paces nothing, but a stage that no replica can serve stays out of reach.
        return np.where(np.isinf(per_microbatch_s), math.inf, 0.0)

    @staticmethod
    def lone_starters(n_stages: int, replicas: int) -> int:
        """How many microbatches start at once before the pace: a pipeline's microbatches file through its slowest
        stage or link one after another, but a lone stage (data parallelism) has nothing to fill, its replicas take
        their shares side by side, so its first |R_0| start together."""
        return replicas if n_stages == 1 else 1

    def control_seconds(self, heads: Sequence[int] | np.ndarray) -> float:
        """r: the slowest round trip to the coordinator among the data heads (node indices)."""
        idx = np.asarray(heads, dtype=np.int64)
        return float(self.coordinator_rtt[idx].max()) if idx.size else 0.0

    def step_from(
        self, paced_s: float, fill_s: float, sync_s: float, data_heads: int, window: int | None, control_s: float
    ) -> float:
        """T from its terms: paced_s = paced_seconds(max_s max(c_s, o_s)), fill_s = sum_s h_s + sum_s x_s,
        sync_s = max_s g_s, control_s = control_seconds(the data heads); the data heads' window paces instead where
        it is slower; the commit's fixed seconds on top."""
        paced = np.maximum(paced_s, self.window_paced_seconds(fill_s, data_heads, window))
        return paced + fill_s + sync_s + self.shape.commit_s + control_s

    def occupancy(self, start: int, end: int, nodes: Sequence[int]) -> float:
        """c_s of the replicas nodes serving layers [start, end)."""
        rate = np.sum(1.0 / self.node_seconds(np.asarray(nodes, dtype=np.int64), start, end))
        return float(self.compute_terms(rate, len(nodes))[0])

    def _stage_terms(self, start: int, end: int, nodes: Sequence[int]) -> tuple:
        """c_s, h_s, g_s, the link classes of the replicas with their routing weights, the replica count, and the
        entry's number (boundary terms are memoised by the pair of numbers). Memoised: local searches score many plans
        that differ in one or two stages."""
        key = (start, end, tuple(nodes))
        if key not in self._stage_memo:
            idx = np.asarray(nodes, dtype=np.int64)
            inv = 1.0 / self.node_seconds(idx, start, end)
            occ, lat = self.compute_terms(inv.sum(), len(idx))
            allreduce = self.sync_seconds(idx, start, end)
            number = len(self._stage_memo)
            self._stage_memo[key] = (occ, lat, allreduce, *self.links.class_weights(idx, inv * occ), len(idx), number)
        return self._stage_memo[key]

    def _boundary(self, cut: int, left: tuple, right: tuple) -> tuple[float, float]:
        """o_s and x_s between two consecutive stages cut after layer cut - 1, given their _stage_terms (whose numbers
        fix the cut too). Memoised: plans that differ in one or two stages share the other boundaries."""
        key = (left[-1], right[-1])
        if key not in self._boundary_memo:
            (*_, ca, va, na, _), (*_, cb, vb, nb, _) = left, right
            self._boundary_memo[key] = self.boundary_terms(
                self.boundary_bits[cut - 1], *self.links.class_link(ca, va, cb, vb), min(na, nb)
            )
        return self._boundary_memo[key]

    def _terms(self, stages: Stages, window: int | None) -> _Terms:
        n_stages = len(stages)
        terms = [self._stage_terms(start, end, nodes) for start, end, nodes in stages]
        occ = np.array([t[0] for t in terms])
        lat = np.array([t[1] for t in terms])
        allreduce = np.array([t[2] for t in terms])
        transfer = np.empty(max(n_stages - 1, 0))
        link_occ = np.empty_like(transfer)
        for s in range(n_stages - 1):
            link_occ[s], transfer[s] = self._boundary(stages[s][1], terms[s], terms[s + 1])
        round_trip = lat.sum() + transfer.sum()
        pace = max(occ.max(), link_occ.max() if len(link_occ) else 0.0)
        paced = float(self.paced_seconds(pace, self.lone_starters(n_stages, terms[0][5])))
        control = self.control_seconds(stages[0][2])
        step = self.step_from(paced, round_trip, allreduce.max(), terms[0][5], window, control)
        return _Terms(
            occupancy=occ,
            latency=lat,
            transfer=transfer,
            link_occupancy=link_occ,
            allreduce=allreduce,
            paced=paced,
            window=self.window_paced_seconds(round_trip, terms[0][5], window),
            control=control,
            step_s=step,
        )

    def feasible(self, stages: Stages) -> bool:
        """Every stage has replicas and layers, layers are covered in order, and every replica fits."""
        if not stages or stages[0][0] != 0 or stages[-1][1] != self.model.n_layers:
            return False
        for s, (start, end, nodes) in enumerate(stages):
            if end <= start or not len(nodes) or (s and stages[s - 1][1] != start):
                return False
            key = (start, end, tuple(nodes), len(stages))
            if key not in self._fits_memo:
                need = self.stage_memory_bytes(start, end, len(stages))
                self._fits_memo[key] = bool(np.all(self.memory[np.asarray(nodes, dtype=np.int64)] >= need))
            if not self._fits_memo[key]:
                return False
        return True

    def step_seconds(self, stages: Stages) -> float:
        """Estimated seconds per step; inf when the plan is infeasible."""
        if not self.feasible(stages):
            return math.inf
        return self._terms(stages, self.fixed_window).step_s

    def plan(
        self, stages: Stages, excluded: dict[str, str], inflight: int | None = None,
        layout_steps: dict[str, float] | None = None,
    ) -> Plan:
        """Full Plan with per-stage estimates and the bottleneck, for a feasible stage list; priced at the window
        `inflight` where given (a running plan's), else at the one train.inflight gives it; layout_steps is the
        planner's best step of each layout it tried."""
        if not self.feasible(stages):
            raise ValueError("plan is infeasible: layers not covered in order, empty stage, or a replica lacks memory")
        t = self._terms(stages, self.fixed_window)
        need = self.window_need(t, len(stages[0][2])) if self.shape.inflight == "auto" else None
        chosen = self.auto_window(stages, need) if need is not None else self.fixed_window
        window = chosen if inflight is None else inflight
        if window != self.fixed_window:
            t = self._terms(stages, window)
        m = self.shape.microbatches
        needs = [self._replica_memory(stages, s, window) for s in range(len(stages))]
        out = []
        for s, (start, end, nodes) in enumerate(stages):
            hierarchical = self.hierarchical_allreduce(np.asarray(nodes, dtype=np.int64), start, end)
            rounds = len(self.sync_prefix) * (HIERARCHICAL_ROUNDS if hierarchical else 1) if len(nodes) > 1 else 0
            out.append(
                StagePlan(
                    start=start,
                    end=end,
                    node_ids=sorted(self.nodes[i].node_id for i in nodes),
                    compute_s=float(m * t.occupancy[s]),
                    transfer_s=float(m * t.link_occupancy[s]) if s < len(stages) - 1 else 0.0,
                    allreduce_s=float(t.allreduce[s]),
                    hierarchical_allreduce=hierarchical,
                    allreduce_rounds=rounds,
                    memory_bytes=int(max(needs[s])),
                )
            )
        return Plan(
            stages=out,
            excluded=dict(sorted(excluded.items())),
            microbatches=m,
            microbatch_size=self.shape.microbatch_size,
            step_seconds=float(t.step_s),
            samples_per_s=m * self.shape.microbatch_size / t.step_s,
            bottleneck=_bottleneck(self.nodes, stages, t, window),
            compute_bound_samples_per_s=self.compute_bound(self.usable),
            inflight=window,
            chosen_inflight=chosen,
            window_need=need,
            round_trip_s=float(t.latency.sum() + t.transfer.sum()),
            coordinator_round_trip_s=t.control,
            node_memory_bytes={
                self.nodes[i].node_id: int(self.nodes[i].baseline_bytes + need)
                for (_, _, nodes), stage_needs in zip(stages, needs) for i, need in zip(nodes, stage_needs)
            },
            layout=layout_of(stages),
            layout_steps=dict(layout_steps or {}),
        )

    def _in_flight_shares(self, stages: Stages, s: int, window: int) -> np.ndarray:
        """How many of the window x |R_0| microbatches in flight each replica of stage s holds at most: its routing
        share (w_r = c_s / t_r) of them, rounded up, and never more than the step's M."""
        start, end, nodes = stages[s]
        inv = 1.0 / self.node_seconds(np.asarray(nodes, dtype=np.int64), start, end)
        total = window * len(stages[0][2])
        return np.minimum(self.shape.microbatches, np.ceil(total * inv / inv.sum() - 1e-9))

    def _replica_memory(self, stages: Stages, s: int, window: int | None) -> np.ndarray:
        """Memory each replica of stage s needs: its share of the window's microbatches in flight, or the search's
        min(M, S) when the window is unbounded."""
        start, end, nodes = stages[s]
        if window is None:
            return np.full(len(nodes), self.stage_memory_bytes(start, end, len(stages)))
        shares = self._in_flight_shares(stages, s, window)
        return np.array([self.stage_memory_bytes(start, end, len(stages), int(k)) for k in shares])

    def auto_window(self, stages: Stages, need: float) -> int:
        """train.inflight = "auto": the smallest window that keeps the plan's unbounded pace (`need`, window_need:
        one microbatch's round trip over the pace, shared among the stage-0 replicas), at most enough for the whole step
        and MAX_INFLIGHT, and lowered (to 1 at least) until every replica's memory holds its share of the microbatches
        in flight."""
        heads = len(stages[0][2])
        enough = math.ceil(self.shape.microbatches / heads)  # the whole step in flight at once
        window = min(math.ceil(need - 1e-9), enough, MAX_INFLIGHT)
        for s, (start, end, nodes) in enumerate(stages):
            idx = np.asarray(nodes, dtype=np.int64)
            # Microbatches in flight weigh on the training phase only (a node short of the serving phase fits not at all).
            fixed = memory.training_bytes(
                self.count_prefix[end] - self.count_prefix[start], self._activation_bytes(start, end, 0),
                self.max_tensor[start, end], diloco=self.shape.diloco,
            )
            per_microbatch = self._activation_bytes(start, end, 1) - self._activation_bytes(start, end, 0)
            if per_microbatch <= 0:
                continue
            inv = 1.0 / self.node_seconds(idx, start, end)
            room = np.floor((self.memory[idx] - fixed) / per_microbatch)  # microbatches in flight each one holds
            short = room < self.shape.microbatches
            if short.any():
                share = heads * inv[short] / inv.sum()  # of the window, in microbatches per replica
                window = min(window, int(np.floor(room[short] / share + 1e-9).min()))
        return max(window, 1)

    @staticmethod
    def window_need(unbounded: _Terms, heads: int) -> float:
        """Microbatches in flight per data head that keep the unbounded pace: one microbatch's round trip over the
        pace, shared among the `heads` stage-0 replicas (Little's law)."""
        pace = max(unbounded.occupancy.max(), unbounded.link_occupancy.max() if len(unbounded.link_occupancy) else 0.0)
        return float((unbounded.latency.sum() + unbounded.transfer.sum()) / (pace * heads))


def _bottleneck(nodes: Sequence[NodeProfile], stages: Stages, t: _Terms, window: int | None) -> str:
    """What limits the step of these stages priced at t, in one line."""
    pace = max(t.paced, t.window)
    fill = t.latency.sum() + t.transfer.sum()
    sync = t.allreduce.max()

    def share(x: float) -> str:
        return f"{100 * x / t.step_s:.0f}% of the step"

    def regions(k: int) -> str:
        names = sorted({nodes[i].region for i in stages[k][2]})
        return "+".join(names) if len(names) <= 3 else f"{len(names)} regions"

    if sync >= pace and sync >= fill:
        s = int(np.argmax(t.allreduce))
        return f"stage {s} gradient all-reduce among {len(stages[s][2])} replicas: {sync:.3g} s, {share(sync)}"
    if t.control > max(pace, fill, sync):
        return f"the data heads' round trip to the coordinator, once a step: {t.control:.3g} s, {share(t.control)}"
    if len(stages) == 1 and t.window <= t.paced:
        return (
            f"compute: {len(stages[0][2])} replicas of the whole model side by side, {t.occupancy[0]:.3g} s per"
            f" microbatch together, {share(t.paced + fill)}"
        )
    if fill > pace:
        return f"pipeline fill and drain over {len(stages)} stages: {fill:.3g} s, {share(fill)}"
    s = int(np.argmax(t.occupancy))
    if t.window > t.paced:
        return (
            f"data heads' window: {window} microbatches in flight on each of {len(stages[0][2])} stage-0"
            f" replicas over a {fill:.3g} s round trip, {share(pace)}"
        )
    if len(t.link_occupancy) and t.link_occupancy.max() > t.occupancy[s]:
        b = int(np.argmax(t.link_occupancy))
        return (
            f"link stage {b} -> {b + 1} ({regions(b)} -> {regions(b + 1)}): {t.link_occupancy[b]:.3g} s per"
            f" microbatch over {min(len(stages[b][2]), len(stages[b + 1][2]))} parallel pairs, {share(pace)}"
        )
    return (
        f"stage {s} compute (layers {stages[s][0]}-{stages[s][1] - 1}, {len(stages[s][2])} replicas):"
        f" {t.occupancy[s]:.3g} s per microbatch, {share(pace)}"
    )
