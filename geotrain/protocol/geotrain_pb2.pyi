from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_POWERSGD: _ClassVar[Codec]

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_REASON_UNSPECIFIED: _ClassVar[RejectReason]
    REJECT_REASON_PROTOCOL_VERSION: _ClassVar[RejectReason]
    REJECT_REASON_RUN_FINISHED: _ClassVar[RejectReason]
    REJECT_REASON_DUPLICATE_NODE: _ClassVar[RejectReason]
    REJECT_REASON_BAD_REQUEST: _ClassVar[RejectReason]
    REJECT_REASON_FULL: _ClassVar[RejectReason]
    REJECT_REASON_IDENTITY: _ClassVar[RejectReason]
    REJECT_REASON_EVICTED: _ClassVar[RejectReason]

class Reachability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REACHABILITY_UNSPECIFIED: _ClassVar[Reachability]
    REACHABILITY_DIRECT: _ClassVar[Reachability]
    REACHABILITY_UNREACHABLE: _ClassVar[Reachability]

class FailureReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_REASON_UNSPECIFIED: _ClassVar[FailureReason]
    FAILURE_REASON_STATE: _ClassVar[FailureReason]
    FAILURE_REASON_AVERAGING: _ClassVar[FailureReason]
    FAILURE_REASON_COMPUTE: _ClassVar[FailureReason]

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTION_UNSPECIFIED: _ClassVar[Direction]
    DIRECTION_FORWARD: _ClassVar[Direction]
    DIRECTION_BACKWARD: _ClassVar[Direction]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_TOPK: Codec
CODEC_POWERSGD: Codec
REJECT_REASON_UNSPECIFIED: RejectReason
REJECT_REASON_PROTOCOL_VERSION: RejectReason
REJECT_REASON_RUN_FINISHED: RejectReason
REJECT_REASON_DUPLICATE_NODE: RejectReason
REJECT_REASON_BAD_REQUEST: RejectReason
REJECT_REASON_FULL: RejectReason
REJECT_REASON_IDENTITY: RejectReason
REJECT_REASON_EVICTED: RejectReason
REACHABILITY_UNSPECIFIED: Reachability
REACHABILITY_DIRECT: Reachability
REACHABILITY_UNREACHABLE: Reachability
FAILURE_REASON_UNSPECIFIED: FailureReason
FAILURE_REASON_STATE: FailureReason
FAILURE_REASON_AVERAGING: FailureReason
FAILURE_REASON_COMPUTE: FailureReason
DIRECTION_UNSPECIFIED: Direction
DIRECTION_FORWARD: Direction
DIRECTION_BACKWARD: Direction

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "payload_bytes", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    payload_bytes: int
    crc32: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., payload_bytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class RunSettings(_message.Message):
    __slots__ = ("seed", "steps", "eval_every", "eval_microbatches")
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    seed: int
    steps: int
    eval_every: int
    eval_microbatches: int
    def __init__(self, seed: _Optional[int] = ..., steps: _Optional[int] = ..., eval_every: _Optional[int] = ..., eval_microbatches: _Optional[int] = ...) -> None: ...

class ModelSettings(_message.Message):
    __slots__ = ("n_layers", "d_model", "n_heads", "seq_len", "dropout", "family", "n_kv_heads", "mlp_width", "vocab_size", "rope_base", "norm_eps", "tie_embeddings", "init_from", "boundary_rank")
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    MLP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROPE_BASE_FIELD_NUMBER: _ClassVar[int]
    NORM_EPS_FIELD_NUMBER: _ClassVar[int]
    TIE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_RANK_FIELD_NUMBER: _ClassVar[int]
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    dropout: float
    family: str
    n_kv_heads: int
    mlp_width: int
    vocab_size: int
    rope_base: float
    norm_eps: float
    tie_embeddings: bool
    init_from: str
    boundary_rank: int
    def __init__(self, n_layers: _Optional[int] = ..., d_model: _Optional[int] = ..., n_heads: _Optional[int] = ..., seq_len: _Optional[int] = ..., dropout: _Optional[float] = ..., family: _Optional[str] = ..., n_kv_heads: _Optional[int] = ..., mlp_width: _Optional[int] = ..., vocab_size: _Optional[int] = ..., rope_base: _Optional[float] = ..., norm_eps: _Optional[float] = ..., tie_embeddings: _Optional[bool] = ..., init_from: _Optional[str] = ..., boundary_rank: _Optional[int] = ...) -> None: ...

class DataSettings(_message.Message):
    __slots__ = ("paths", "max_bytes", "val_fraction", "fingerprint", "prepared")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    VAL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    max_bytes: int
    val_fraction: float
    fingerprint: str
    prepared: str
    def __init__(self, paths: _Optional[_Iterable[str]] = ..., max_bytes: _Optional[int] = ..., val_fraction: _Optional[float] = ..., fingerprint: _Optional[str] = ..., prepared: _Optional[str] = ...) -> None: ...

class TrainSettings(_message.Message):
    __slots__ = ("microbatches", "microbatch_size", "lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "inflight", "precision", "precision_fallback", "recompute", "loss_scale", "loss_scale_window")
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    microbatches: int
    microbatch_size: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    inflight: int
    precision: str
    precision_fallback: str
    recompute: bool
    loss_scale: float
    loss_scale_window: int
    def __init__(self, microbatches: _Optional[int] = ..., microbatch_size: _Optional[int] = ..., lr: _Optional[float] = ..., min_lr: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., grad_clip: _Optional[float] = ..., inflight: _Optional[int] = ..., precision: _Optional[str] = ..., precision_fallback: _Optional[str] = ..., recompute: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., loss_scale_window: _Optional[int] = ...) -> None: ...

class CompressionSettings(_message.Message):
    __slots__ = ("activations", "activation_grads", "replica_grads", "replica_robust", "replica_clip_rms", "replica_sync", "replica_sync_every", "replica_sync_lr", "replica_sync_momentum")
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_GRADS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GRADS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ROBUST_FIELD_NUMBER: _ClassVar[int]
    REPLICA_CLIP_RMS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SYNC_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SYNC_LR_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SYNC_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    activations: str
    activation_grads: str
    replica_grads: str
    replica_robust: str
    replica_clip_rms: float
    replica_sync: str
    replica_sync_every: int
    replica_sync_lr: float
    replica_sync_momentum: float
    def __init__(self, activations: _Optional[str] = ..., activation_grads: _Optional[str] = ..., replica_grads: _Optional[str] = ..., replica_robust: _Optional[str] = ..., replica_clip_rms: _Optional[float] = ..., replica_sync: _Optional[str] = ..., replica_sync_every: _Optional[int] = ..., replica_sync_lr: _Optional[float] = ..., replica_sync_momentum: _Optional[float] = ...) -> None: ...

class EmulationSettings(_message.Message):
    __slots__ = ("links",)
    LINKS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, links: _Optional[_Iterable[str]] = ...) -> None: ...

class ProfileSettings(_message.Message):
    __slots__ = ("probe_bytes", "layer_repeats", "reprobe_s", "memory_headroom_mib")
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_REPEATS_FIELD_NUMBER: _ClassVar[int]
    REPROBE_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HEADROOM_MIB_FIELD_NUMBER: _ClassVar[int]
    probe_bytes: int
    layer_repeats: int
    reprobe_s: float
    memory_headroom_mib: int
    def __init__(self, probe_bytes: _Optional[int] = ..., layer_repeats: _Optional[int] = ..., reprobe_s: _Optional[float] = ..., memory_headroom_mib: _Optional[int] = ...) -> None: ...

class RunConfig(_message.Message):
    __slots__ = ("run", "model", "data", "train", "compression", "emulation", "profile", "limits", "transport", "verify")
    RUN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    EMULATION_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    run: RunSettings
    model: ModelSettings
    data: DataSettings
    train: TrainSettings
    compression: CompressionSettings
    emulation: EmulationSettings
    profile: ProfileSettings
    limits: LimitsSettings
    transport: TransportSettings
    verify: VerifySettings
    def __init__(self, run: _Optional[_Union[RunSettings, _Mapping]] = ..., model: _Optional[_Union[ModelSettings, _Mapping]] = ..., data: _Optional[_Union[DataSettings, _Mapping]] = ..., train: _Optional[_Union[TrainSettings, _Mapping]] = ..., compression: _Optional[_Union[CompressionSettings, _Mapping]] = ..., emulation: _Optional[_Union[EmulationSettings, _Mapping]] = ..., profile: _Optional[_Union[ProfileSettings, _Mapping]] = ..., limits: _Optional[_Union[LimitsSettings, _Mapping]] = ..., transport: _Optional[_Union[TransportSettings, _Mapping]] = ..., verify: _Optional[_Union[VerifySettings, _Mapping]] = ...) -> None: ...

class LimitsSettings(_message.Message):
    __slots__ = ("streams_per_peer", "streams_per_host", "idle_stream_s", "calls_per_s", "call_burst", "registrations_per_s", "registration_burst")
    STREAMS_PER_PEER_FIELD_NUMBER: _ClassVar[int]
    STREAMS_PER_HOST_FIELD_NUMBER: _ClassVar[int]
    IDLE_STREAM_S_FIELD_NUMBER: _ClassVar[int]
    CALLS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CALL_BURST_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_BURST_FIELD_NUMBER: _ClassVar[int]
    streams_per_peer: int
    streams_per_host: int
    idle_stream_s: float
    calls_per_s: float
    call_burst: int
    registrations_per_s: float
    registration_burst: int
    def __init__(self, streams_per_peer: _Optional[int] = ..., streams_per_host: _Optional[int] = ..., idle_stream_s: _Optional[float] = ..., calls_per_s: _Optional[float] = ..., call_burst: _Optional[int] = ..., registrations_per_s: _Optional[float] = ..., registration_burst: _Optional[int] = ...) -> None: ...

class TransportSettings(_message.Message):
    __slots__ = ("tensor_stream",)
    TENSOR_STREAM_FIELD_NUMBER: _ClassVar[int]
    tensor_stream: str
    def __init__(self, tensor_stream: _Optional[str] = ...) -> None: ...

class VerifySettings(_message.Message):
    __slots__ = ("fraction", "keep_steps")
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    KEEP_STEPS_FIELD_NUMBER: _ClassVar[int]
    fraction: float
    keep_steps: int
    def __init__(self, fraction: _Optional[float] = ..., keep_steps: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("protocol_version", "node_id", "address", "region", "software_version", "layer_start", "layer_end", "applied_steps", "public_key")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    APPLIED_STEPS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    node_id: str
    address: str
    region: str
    software_version: str
    layer_start: int
    layer_end: int
    applied_steps: int
    public_key: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., region: _Optional[str] = ..., software_version: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., applied_steps: _Optional[int] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("accepted", "reason", "message", "node_id", "config", "heartbeat_interval_s", "run_id", "reachability", "reachable_at")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_AT_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: RejectReason
    message: str
    node_id: str
    config: RunConfig
    heartbeat_interval_s: float
    run_id: str
    reachability: Reachability
    reachable_at: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[_Union[RejectReason, str]] = ..., message: _Optional[str] = ..., node_id: _Optional[str] = ..., config: _Optional[_Union[RunConfig, _Mapping]] = ..., heartbeat_interval_s: _Optional[float] = ..., run_id: _Optional[str] = ..., reachability: _Optional[_Union[Reachability, str]] = ..., reachable_at: _Optional[str] = ...) -> None: ...

class LinkCounter(_message.Message):
    __slots__ = ("peer", "raw_bytes", "wire_bytes", "codec", "stream_bytes")
    PEER_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    STREAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    peer: str
    raw_bytes: int
    wire_bytes: int
    codec: str
    stream_bytes: int
    def __init__(self, peer: _Optional[str] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., codec: _Optional[str] = ..., stream_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "bytes_sent", "bytes_received", "links", "microbatches_per_s", "applied_step", "dht_peer_id", "state_epoch", "peak_memory_bytes", "relayed_bytes", "averaging_bytes_sent")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_PER_S_FIELD_NUMBER: _ClassVar[int]
    APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    DHT_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    bytes_sent: int
    bytes_received: int
    links: _containers.RepeatedCompositeFieldContainer[LinkCounter]
    microbatches_per_s: float
    applied_step: int
    dht_peer_id: str
    state_epoch: int
    peak_memory_bytes: int
    relayed_bytes: int
    averaging_bytes_sent: int
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., links: _Optional[_Iterable[_Union[LinkCounter, _Mapping]]] = ..., microbatches_per_s: _Optional[float] = ..., applied_step: _Optional[int] = ..., dht_peer_id: _Optional[str] = ..., state_epoch: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., relayed_bytes: _Optional[int] = ..., averaging_bytes_sent: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "next_heartbeat_s")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NEXT_HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    known: bool
    next_heartbeat_s: float
    def __init__(self, known: _Optional[bool] = ..., next_heartbeat_s: _Optional[float] = ...) -> None: ...

class OrdersRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class StageAssignment(_message.Message):
    __slots__ = ("index", "layer_start", "layer_end", "node_ids", "addresses", "regions", "peer_ids", "hierarchical_allreduce", "public_keys", "unreachable")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    PEER_IDS_FIELD_NUMBER: _ClassVar[int]
    HIERARCHICAL_ALLREDUCE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEYS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    index: int
    layer_start: int
    layer_end: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    regions: _containers.RepeatedScalarFieldContainer[str]
    peer_ids: _containers.RepeatedScalarFieldContainer[str]
    hierarchical_allreduce: bool
    public_keys: _containers.RepeatedScalarFieldContainer[bytes]
    unreachable: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, index: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., addresses: _Optional[_Iterable[str]] = ..., regions: _Optional[_Iterable[str]] = ..., peer_ids: _Optional[_Iterable[str]] = ..., hierarchical_allreduce: _Optional[bool] = ..., public_keys: _Optional[_Iterable[bytes]] = ..., unreachable: _Optional[_Iterable[bool]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("epoch", "stages", "total_layers", "steps_done", "loss_scale", "excluded", "coordinator_key", "inflight", "relays", "call_deadline_s")
    class ExcludedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_KEY_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    CALL_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    stages: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    total_layers: int
    steps_done: int
    loss_scale: float
    excluded: _containers.ScalarMap[str, str]
    coordinator_key: bytes
    inflight: int
    relays: _containers.RepeatedCompositeFieldContainer[RelayRoute]
    call_deadline_s: float
    def __init__(self, epoch: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ..., total_layers: _Optional[int] = ..., steps_done: _Optional[int] = ..., loss_scale: _Optional[float] = ..., excluded: _Optional[_Mapping[str, str]] = ..., coordinator_key: _Optional[bytes] = ..., inflight: _Optional[int] = ..., relays: _Optional[_Iterable[_Union[RelayRoute, _Mapping]]] = ..., call_deadline_s: _Optional[float] = ...) -> None: ...

class RelayRoute(_message.Message):
    __slots__ = ("a", "b", "relay_id", "relay_address", "relay_key")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_KEY_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    relay_id: str
    relay_address: str
    relay_key: bytes
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., relay_id: _Optional[str] = ..., relay_address: _Optional[str] = ..., relay_key: _Optional[bytes] = ...) -> None: ...

class LoadState(_message.Message):
    __slots__ = ("plan_epoch", "steps_done", "source_address", "expected_checksum")
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    plan_epoch: int
    steps_done: int
    source_address: str
    expected_checksum: str
    def __init__(self, plan_epoch: _Optional[int] = ..., steps_done: _Optional[int] = ..., source_address: _Optional[str] = ..., expected_checksum: _Optional[str] = ...) -> None: ...

class StartStep(_message.Message):
    __slots__ = ("step", "microbatches", "total_microbatches")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatches: _containers.RepeatedScalarFieldContainer[int]
    total_microbatches: int
    def __init__(self, step: _Optional[int] = ..., microbatches: _Optional[_Iterable[int]] = ..., total_microbatches: _Optional[int] = ...) -> None: ...

class Evaluate(_message.Message):
    __slots__ = ("step", "microbatches")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatches: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., microbatches: _Optional[_Iterable[int]] = ...) -> None: ...

class ProbePeers(_message.Message):
    __slots__ = ("node_ids", "addresses", "regions")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    regions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., addresses: _Optional[_Iterable[str]] = ..., regions: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinAveraging(_message.Message):
    __slots__ = ("initial_peers",)
    INITIAL_PEERS_FIELD_NUMBER: _ClassVar[int]
    initial_peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, initial_peers: _Optional[_Iterable[str]] = ...) -> None: ...

class UploadState(_message.Message):
    __slots__ = ("request", "steps_done", "layer_start", "layer_end")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    request: int
    steps_done: int
    layer_start: int
    layer_end: int
    def __init__(self, request: _Optional[int] = ..., steps_done: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class CommitStep(_message.Message):
    __slots__ = ("step", "plan_epoch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    plan_epoch: int
    def __init__(self, step: _Optional[int] = ..., plan_epoch: _Optional[int] = ...) -> None: ...

class ApplyStep(_message.Message):
    __slots__ = ("step", "clip_coef", "lr", "skip", "loss_scale", "checks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLIP_COEF_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    clip_coef: float
    lr: float
    skip: bool
    loss_scale: float
    checks: _containers.RepeatedCompositeFieldContainer[CheckDraw]
    def __init__(self, step: _Optional[int] = ..., clip_coef: _Optional[float] = ..., lr: _Optional[float] = ..., skip: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., checks: _Optional[_Iterable[_Union[CheckDraw, _Mapping]]] = ...) -> None: ...

class CheckDraw(_message.Message):
    __slots__ = ("stage", "microbatch", "verifier", "order")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    stage: int
    microbatch: int
    verifier: str
    order: VerifyOrder
    def __init__(self, stage: _Optional[int] = ..., microbatch: _Optional[int] = ..., verifier: _Optional[str] = ..., order: _Optional[_Union[VerifyOrder, _Mapping]] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason", "aborted")
    REASON_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    reason: str
    aborted: bool
    def __init__(self, reason: _Optional[str] = ..., aborted: _Optional[bool] = ...) -> None: ...

class Order(_message.Message):
    __slots__ = ("plan", "start_step", "commit", "apply", "evaluate", "shutdown", "load_state", "probe_peers", "join_averaging", "upload_state", "verify")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    LOAD_STATE_FIELD_NUMBER: _ClassVar[int]
    PROBE_PEERS_FIELD_NUMBER: _ClassVar[int]
    JOIN_AVERAGING_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_STATE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    start_step: StartStep
    commit: CommitStep
    apply: ApplyStep
    evaluate: Evaluate
    shutdown: Shutdown
    load_state: LoadState
    probe_peers: ProbePeers
    join_averaging: JoinAveraging
    upload_state: UploadState
    verify: VerifyOrder
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., start_step: _Optional[_Union[StartStep, _Mapping]] = ..., commit: _Optional[_Union[CommitStep, _Mapping]] = ..., apply: _Optional[_Union[ApplyStep, _Mapping]] = ..., evaluate: _Optional[_Union[Evaluate, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., load_state: _Optional[_Union[LoadState, _Mapping]] = ..., probe_peers: _Optional[_Union[ProbePeers, _Mapping]] = ..., join_averaging: _Optional[_Union[JoinAveraging, _Mapping]] = ..., upload_state: _Optional[_Union[UploadState, _Mapping]] = ..., verify: _Optional[_Union[VerifyOrder, _Mapping]] = ...) -> None: ...

class VerifyOrder(_message.Message):
    __slots__ = ("check", "step", "microbatch", "layer_start", "layer_end", "target", "target_address")
    CHECK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    check: int
    step: int
    microbatch: int
    layer_start: int
    layer_end: int
    target: str
    target_address: str
    def __init__(self, check: _Optional[int] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., target: _Optional[str] = ..., target_address: _Optional[str] = ...) -> None: ...

class MicrobatchDoneRequest(_message.Message):
    __slots__ = ("node_id", "step", "microbatch", "path", "loss", "tokens", "plan_epoch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    microbatch: int
    path: _containers.RepeatedScalarFieldContainer[str]
    loss: float
    tokens: int
    plan_epoch: int
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., path: _Optional[_Iterable[str]] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., plan_epoch: _Optional[int] = ...) -> None: ...

class EvalDoneRequest(_message.Message):
    __slots__ = ("node_id", "step", "microbatch", "loss", "plan_epoch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    microbatch: int
    loss: float
    plan_epoch: int
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., loss: _Optional[float] = ..., plan_epoch: _Optional[int] = ...) -> None: ...

class GradNormRequest(_message.Message):
    __slots__ = ("node_id", "step", "sq_norm", "plan_epoch", "sq_norm_parts", "clipped_peers", "compute_s_per_microbatch", "averaging_s", "round_trip_s", "params_before", "commitments", "forward_s_per_microbatch", "reports")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SQ_NORM_PARTS_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_PEERS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_PER_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_S_FIELD_NUMBER: _ClassVar[int]
    PARAMS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    COMMITMENTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_PER_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    sq_norm: float
    plan_epoch: int
    sq_norm_parts: _containers.RepeatedScalarFieldContainer[float]
    clipped_peers: _containers.RepeatedScalarFieldContainer[str]
    compute_s_per_microbatch: float
    averaging_s: float
    round_trip_s: float
    params_before: str
    commitments: _containers.RepeatedCompositeFieldContainer[MicrobatchCommitment]
    forward_s_per_microbatch: float
    reports: _containers.RepeatedCompositeFieldContainer[VerifyReport]
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., sq_norm: _Optional[float] = ..., plan_epoch: _Optional[int] = ..., sq_norm_parts: _Optional[_Iterable[float]] = ..., clipped_peers: _Optional[_Iterable[str]] = ..., compute_s_per_microbatch: _Optional[float] = ..., averaging_s: _Optional[float] = ..., round_trip_s: _Optional[float] = ..., params_before: _Optional[str] = ..., commitments: _Optional[_Iterable[_Union[MicrobatchCommitment, _Mapping]]] = ..., forward_s_per_microbatch: _Optional[float] = ..., reports: _Optional[_Iterable[_Union[VerifyReport, _Mapping]]] = ...) -> None: ...

class MicrobatchCommitment(_message.Message):
    __slots__ = ("microbatch", "received", "sent", "received_grad", "sent_grad", "param_grads")
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_GRAD_FIELD_NUMBER: _ClassVar[int]
    SENT_GRAD_FIELD_NUMBER: _ClassVar[int]
    PARAM_GRADS_FIELD_NUMBER: _ClassVar[int]
    microbatch: int
    received: bytes
    sent: bytes
    received_grad: bytes
    sent_grad: bytes
    param_grads: bytes
    def __init__(self, microbatch: _Optional[int] = ..., received: _Optional[bytes] = ..., sent: _Optional[bytes] = ..., received_grad: _Optional[bytes] = ..., sent_grad: _Optional[bytes] = ..., param_grads: _Optional[bytes] = ...) -> None: ...

class VerifyReport(_message.Message):
    __slots__ = ("node_id", "check", "error", "params_checksum", "digests", "seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    check: int
    error: str
    params_checksum: str
    digests: MicrobatchCommitment
    seconds: float
    def __init__(self, node_id: _Optional[str] = ..., check: _Optional[int] = ..., error: _Optional[str] = ..., params_checksum: _Optional[str] = ..., digests: _Optional[_Union[MicrobatchCommitment, _Mapping]] = ..., seconds: _Optional[float] = ...) -> None: ...

class StepAppliedRequest(_message.Message):
    __slots__ = ("node_id", "step", "checksum")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    checksum: str
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("node_id", "peer", "detail", "reason", "plan_epoch", "step", "relayed_to")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RELAYED_TO_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer: str
    detail: str
    reason: FailureReason
    plan_epoch: int
    step: int
    relayed_to: str
    def __init__(self, node_id: _Optional[str] = ..., peer: _Optional[str] = ..., detail: _Optional[str] = ..., reason: _Optional[_Union[FailureReason, str]] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., relayed_to: _Optional[str] = ...) -> None: ...

class FetchCheckpointRequest(_message.Message):
    __slots__ = ("layer_start", "layer_end", "steps_done")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    steps_done: int
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., steps_done: _Optional[int] = ...) -> None: ...

class StateUpload(_message.Message):
    __slots__ = ("node_id", "request", "error", "chunk")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    request: int
    error: str
    chunk: TensorChunk
    def __init__(self, node_id: _Optional[str] = ..., request: _Optional[int] = ..., error: _Optional[str] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkProbe(_message.Message):
    __slots__ = ("peer", "bandwidth_bps", "rtt_s")
    PEER_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    peer: str
    bandwidth_bps: float
    rtt_s: float
    def __init__(self, peer: _Optional[str] = ..., bandwidth_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ...) -> None: ...

class NodeProfileReport(_message.Message):
    __slots__ = ("node_id", "layer_seconds", "boundary_bytes", "param_bytes", "memory_bytes", "links", "activation_bytes", "param_shapes", "device", "device_name", "copy_bytes_per_s", "precision", "torch_build", "baseline_bytes", "unfit")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAM_SHAPES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    COPY_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    TORCH_BUILD_FIELD_NUMBER: _ClassVar[int]
    BASELINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNFIT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    layer_seconds: _containers.RepeatedScalarFieldContainer[float]
    boundary_bytes: _containers.RepeatedScalarFieldContainer[int]
    param_bytes: _containers.RepeatedScalarFieldContainer[int]
    memory_bytes: int
    links: _containers.RepeatedCompositeFieldContainer[LinkProbe]
    activation_bytes: _containers.RepeatedScalarFieldContainer[int]
    param_shapes: _containers.RepeatedCompositeFieldContainer[LayerShapes]
    device: str
    device_name: str
    copy_bytes_per_s: float
    precision: str
    torch_build: str
    baseline_bytes: int
    unfit: str
    def __init__(self, node_id: _Optional[str] = ..., layer_seconds: _Optional[_Iterable[float]] = ..., boundary_bytes: _Optional[_Iterable[int]] = ..., param_bytes: _Optional[_Iterable[int]] = ..., memory_bytes: _Optional[int] = ..., links: _Optional[_Iterable[_Union[LinkProbe, _Mapping]]] = ..., activation_bytes: _Optional[_Iterable[int]] = ..., param_shapes: _Optional[_Iterable[_Union[LayerShapes, _Mapping]]] = ..., device: _Optional[str] = ..., device_name: _Optional[str] = ..., copy_bytes_per_s: _Optional[float] = ..., precision: _Optional[str] = ..., torch_build: _Optional[str] = ..., baseline_bytes: _Optional[int] = ..., unfit: _Optional[str] = ...) -> None: ...

class LayerShapes(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorShape]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ProbeChunk(_message.Message):
    __slots__ = ("total_bytes", "data")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    data: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "region", "address", "stage", "layer_start", "layer_end", "role", "microbatches_per_s", "last_heartbeat_s", "bytes_sent", "bytes_received", "compression_ratio", "alive", "profiled_microbatch_s", "memory_bytes", "lifecycle", "device", "precision", "peak_memory_bytes", "reachability", "relayed_bytes", "averaging_bytes_sent", "planned_memory_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    PROFILED_MICROBATCH_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PLANNED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    region: str
    address: str
    stage: int
    layer_start: int
    layer_end: int
    role: str
    microbatches_per_s: float
    last_heartbeat_s: float
    bytes_sent: int
    bytes_received: int
    compression_ratio: float
    alive: bool
    profiled_microbatch_s: float
    memory_bytes: int
    lifecycle: str
    device: str
    precision: str
    peak_memory_bytes: int
    reachability: str
    relayed_bytes: int
    averaging_bytes_sent: int
    planned_memory_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., region: _Optional[str] = ..., address: _Optional[str] = ..., stage: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., role: _Optional[str] = ..., microbatches_per_s: _Optional[float] = ..., last_heartbeat_s: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., compression_ratio: _Optional[float] = ..., alive: _Optional[bool] = ..., profiled_microbatch_s: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., lifecycle: _Optional[str] = ..., device: _Optional[str] = ..., precision: _Optional[str] = ..., peak_memory_bytes: _Optional[int] = ..., reachability: _Optional[str] = ..., relayed_bytes: _Optional[int] = ..., averaging_bytes_sent: _Optional[int] = ..., planned_memory_bytes: _Optional[int] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("index", "layer_start", "layer_end", "node_ids", "est_compute_s", "est_transfer_s", "utilisation")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    EST_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    EST_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    index: int
    layer_start: int
    layer_end: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    est_compute_s: float
    est_transfer_s: float
    utilisation: float
    def __init__(self, index: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., est_compute_s: _Optional[float] = ..., est_transfer_s: _Optional[float] = ..., utilisation: _Optional[float] = ...) -> None: ...

class LinkStatus(_message.Message):
    __slots__ = ("src", "dst", "bandwidth_mbps", "latency_ms", "codec", "compression_ratio", "raw_bytes", "wire_bytes", "transport")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_MBPS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    bandwidth_mbps: float
    latency_ms: float
    codec: str
    compression_ratio: float
    raw_bytes: int
    wire_bytes: int
    transport: str
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., bandwidth_mbps: _Optional[float] = ..., latency_ms: _Optional[float] = ..., codec: _Optional[str] = ..., compression_ratio: _Optional[float] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class StepPoint(_message.Message):
    __slots__ = ("step", "loss", "has_val_loss", "val_loss", "tokens_per_s", "seconds", "at")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    has_val_loss: bool
    val_loss: float
    tokens_per_s: float
    seconds: float
    at: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., has_val_loss: _Optional[bool] = ..., val_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., seconds: _Optional[float] = ..., at: _Optional[float] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("at", "kind", "node_id", "detail")
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    at: float
    kind: str
    node_id: str
    detail: str
    def __init__(self, at: _Optional[float] = ..., kind: _Optional[str] = ..., node_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("state", "step", "steps", "loss", "val_loss", "tokens_per_s", "eta_s", "plan_epoch", "bottleneck", "nodes", "stages", "links", "history", "events", "failures", "recovery_s", "estimated_step_s", "phase", "val_bits_per_byte", "exactness", "verify")
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    VAL_BITS_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    EXACTNESS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    state: str
    step: int
    steps: int
    loss: float
    val_loss: float
    tokens_per_s: float
    eta_s: float
    plan_epoch: int
    bottleneck: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    links: _containers.RepeatedCompositeFieldContainer[LinkStatus]
    history: _containers.RepeatedCompositeFieldContainer[StepPoint]
    events: _containers.RepeatedCompositeFieldContainer[RunEvent]
    failures: int
    recovery_s: _containers.RepeatedScalarFieldContainer[float]
    estimated_step_s: float
    phase: str
    val_bits_per_byte: float
    exactness: str
    verify: VerifyStatus
    def __init__(self, state: _Optional[str] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., loss: _Optional[float] = ..., val_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., eta_s: _Optional[float] = ..., plan_epoch: _Optional[int] = ..., bottleneck: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkStatus, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[StepPoint, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[RunEvent, _Mapping]]] = ..., failures: _Optional[int] = ..., recovery_s: _Optional[_Iterable[float]] = ..., estimated_step_s: _Optional[float] = ..., phase: _Optional[str] = ..., val_bits_per_byte: _Optional[float] = ..., exactness: _Optional[str] = ..., verify: _Optional[_Union[VerifyStatus, _Mapping]] = ...) -> None: ...

class VerifyStatus(_message.Message):
    __slots__ = ("checks", "mismatches", "unserved", "evicted", "seconds", "commitments_refused")
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    UNSERVED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMITMENTS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    checks: int
    mismatches: int
    unserved: int
    evicted: int
    seconds: float
    commitments_refused: int
    def __init__(self, checks: _Optional[int] = ..., mismatches: _Optional[int] = ..., unserved: _Optional[int] = ..., evicted: _Optional[int] = ..., seconds: _Optional[float] = ..., commitments_refused: _Optional[int] = ...) -> None: ...

class WindowsRequest(_message.Message):
    __slots__ = ("node_id", "step", "microbatch", "validation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    microbatch: int
    validation: bool
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., validation: _Optional[bool] = ...) -> None: ...

class WindowsReply(_message.Message):
    __slots__ = ("fingerprint", "rows", "cols", "tokens")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    rows: int
    cols: int
    tokens: bytes
    def __init__(self, fingerprint: _Optional[str] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class MicrobatchRef(_message.Message):
    __slots__ = ("plan_epoch", "step", "microbatch", "path", "eval", "loss")
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    plan_epoch: int
    step: int
    microbatch: int
    path: _containers.RepeatedScalarFieldContainer[str]
    eval: bool
    loss: float
    def __init__(self, plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., path: _Optional[_Iterable[str]] = ..., eval: _Optional[bool] = ..., loss: _Optional[float] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("ref", "header", "data")
    REF_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ref: MicrobatchRef
    header: TensorHeader
    data: bytes
    def __init__(self, ref: _Optional[_Union[MicrobatchRef, _Mapping]] = ..., header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReverseUp(_message.Message):
    __slots__ = ("open", "ack")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    open: ReverseOpen
    ack: ReverseAck
    def __init__(self, open: _Optional[_Union[ReverseOpen, _Mapping]] = ..., ack: _Optional[_Union[ReverseAck, _Mapping]] = ...) -> None: ...

class ReverseOpen(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class ReverseAck(_message.Message):
    __slots__ = ("seq", "code", "detail")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    code: int
    detail: str
    def __init__(self, seq: _Optional[int] = ..., code: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ReverseDown(_message.Message):
    __slots__ = ("proof", "seq", "direction", "chunk", "last", "origin", "signature")
    PROOF_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    seq: int
    direction: Direction
    chunk: TensorChunk
    last: bool
    origin: str
    signature: bytes
    def __init__(self, proof: _Optional[bytes] = ..., seq: _Optional[int] = ..., direction: _Optional[_Union[Direction, str]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., last: _Optional[bool] = ..., origin: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RelayChunk(_message.Message):
    __slots__ = ("receiver", "direction", "signature", "chunk")
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    receiver: str
    direction: Direction
    signature: bytes
    chunk: TensorChunk
    def __init__(self, receiver: _Optional[str] = ..., direction: _Optional[_Union[Direction, str]] = ..., signature: _Optional[bytes] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class TensorStreamRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorStreamTicket(_message.Message):
    __slots__ = ("port", "ticket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class TensorStreamHello(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    def __init__(self, ticket: _Optional[bytes] = ...) -> None: ...

class TensorFrame(_message.Message):
    __slots__ = ("direction", "ref", "header")
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    direction: Direction
    ref: MicrobatchRef
    header: TensorHeader
    def __init__(self, direction: _Optional[_Union[Direction, str]] = ..., ref: _Optional[_Union[MicrobatchRef, _Mapping]] = ..., header: _Optional[_Union[TensorHeader, _Mapping]] = ...) -> None: ...

class TensorStreamReply(_message.Message):
    __slots__ = ("code", "detail")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    code: int
    detail: str
    def __init__(self, code: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class FetchEvidenceRequest(_message.Message):
    __slots__ = ("step", "microbatch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatch: int
    def __init__(self, step: _Optional[int] = ..., microbatch: _Optional[int] = ...) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("steps_done", "layer_start", "layer_end")
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    steps_done: int
    layer_start: int
    layer_end: int
    def __init__(self, steps_done: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...
