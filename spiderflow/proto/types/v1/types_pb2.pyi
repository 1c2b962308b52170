import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Schedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_UNSPECIFIED: _ClassVar[Schedule]
    SCHEDULE_GPIPE: _ClassVar[Schedule]
    SCHEDULE_ONE_F_ONE_B: _ClassVar[Schedule]
    SCHEDULE_INTERLEAVED_1F1B: _ClassVar[Schedule]
    SCHEDULE_LATENCY_AWARE: _ClassVar[Schedule]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_PLACED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RESCHEDULING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class PlacementStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_STATUS_UNSPECIFIED: _ClassVar[PlacementStatus]
    PLACEMENT_STATUS_SUCCESS: _ClassVar[PlacementStatus]
    PLACEMENT_STATUS_UNSCHEDULABLE: _ClassVar[PlacementStatus]
    PLACEMENT_STATUS_UNRESOLVABLE: _ClassVar[PlacementStatus]
    PLACEMENT_STATUS_ERROR: _ClassVar[PlacementStatus]

class Objective(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECTIVE_UNSPECIFIED: _ClassVar[Objective]
    OBJECTIVE_JCT: _ClassVar[Objective]
    OBJECTIVE_COST: _ClassVar[Objective]
    OBJECTIVE_BALANCED: _ClassVar[Objective]
SCHEDULE_UNSPECIFIED: Schedule
SCHEDULE_GPIPE: Schedule
SCHEDULE_ONE_F_ONE_B: Schedule
SCHEDULE_INTERLEAVED_1F1B: Schedule
SCHEDULE_LATENCY_AWARE: Schedule
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_PLACED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RESCHEDULING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
PLACEMENT_STATUS_UNSPECIFIED: PlacementStatus
PLACEMENT_STATUS_SUCCESS: PlacementStatus
PLACEMENT_STATUS_UNSCHEDULABLE: PlacementStatus
PLACEMENT_STATUS_UNRESOLVABLE: PlacementStatus
PLACEMENT_STATUS_ERROR: PlacementStatus
OBJECTIVE_UNSPECIFIED: Objective
OBJECTIVE_JCT: Objective
OBJECTIVE_COST: Objective
OBJECTIVE_BALANCED: Objective

class Cluster(_message.Message):
    __slots__ = ("name", "gpu", "nodes", "gpus_per_node", "intra_node_gbps", "inter_node_gbps", "electricity_usd_per_kwh", "free_gpus", "tflops", "mfu", "memory_gib", "region", "lat", "lon", "layer_overhead_ms", "optimizer_ms_per_layer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    INTRA_NODE_GBPS_FIELD_NUMBER: _ClassVar[int]
    INTER_NODE_GBPS_FIELD_NUMBER: _ClassVar[int]
    ELECTRICITY_USD_PER_KWH_FIELD_NUMBER: _ClassVar[int]
    FREE_GPUS_FIELD_NUMBER: _ClassVar[int]
    TFLOPS_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GIB_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    LAT_FIELD_NUMBER: _ClassVar[int]
    LON_FIELD_NUMBER: _ClassVar[int]
    LAYER_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_MS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    name: str
    gpu: str
    nodes: int
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    electricity_usd_per_kwh: float
    free_gpus: int
    tflops: float
    mfu: float
    memory_gib: float
    region: str
    lat: float
    lon: float
    layer_overhead_ms: float
    optimizer_ms_per_layer: float
    def __init__(self, name: _Optional[str] = ..., gpu: _Optional[str] = ..., nodes: _Optional[int] = ..., gpus_per_node: _Optional[int] = ..., intra_node_gbps: _Optional[float] = ..., inter_node_gbps: _Optional[float] = ..., electricity_usd_per_kwh: _Optional[float] = ..., free_gpus: _Optional[int] = ..., tflops: _Optional[float] = ..., mfu: _Optional[float] = ..., memory_gib: _Optional[float] = ..., region: _Optional[str] = ..., lat: _Optional[float] = ..., lon: _Optional[float] = ..., layer_overhead_ms: _Optional[float] = ..., optimizer_ms_per_layer: _Optional[float] = ...) -> None: ...

class Link(_message.Message):
    __slots__ = ("a", "b", "bandwidth_gbps", "latency_ms", "directed")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    DIRECTED_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    bandwidth_gbps: float
    latency_ms: float
    directed: bool
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., bandwidth_gbps: _Optional[float] = ..., latency_ms: _Optional[float] = ..., directed: _Optional[bool] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("clusters", "links", "revision")
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    clusters: _containers.RepeatedCompositeFieldContainer[Cluster]
    links: _containers.RepeatedCompositeFieldContainer[Link]
    revision: int
    def __init__(self, clusters: _Optional[_Iterable[_Union[Cluster, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[Link, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("name", "layers", "hidden", "heads", "vocab")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    def __init__(self, name: _Optional[str] = ..., layers: _Optional[int] = ..., hidden: _Optional[int] = ..., heads: _Optional[int] = ..., vocab: _Optional[int] = ...) -> None: ...

class GpuRange(_message.Message):
    __slots__ = ("min", "max")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    min: int
    max: int
    def __init__(self, min: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("id", "model", "global_batch", "micro_batch", "seq_len", "steps", "gpus", "arrival_s", "priority", "tenant", "precision", "data", "optimizer", "constraints", "checkpoint_every")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: _struct_pb2.Value
    global_batch: int
    micro_batch: int
    seq_len: int
    steps: int
    gpus: GpuRange
    arrival_s: float
    priority: int
    tenant: str
    precision: str
    data: TrainingData
    optimizer: OptimizerConfig
    constraints: ResourceConstraints
    checkpoint_every: int
    def __init__(self, id: _Optional[str] = ..., model: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., global_batch: _Optional[int] = ..., micro_batch: _Optional[int] = ..., seq_len: _Optional[int] = ..., steps: _Optional[int] = ..., gpus: _Optional[_Union[GpuRange, _Mapping]] = ..., arrival_s: _Optional[float] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., precision: _Optional[str] = ..., data: _Optional[_Union[TrainingData, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., constraints: _Optional[_Union[ResourceConstraints, _Mapping]] = ..., checkpoint_every: _Optional[int] = ...) -> None: ...

class ResourceConstraints(_message.Message):
    __slots__ = ("gpu_types", "clusters", "exclude_clusters", "regions", "exclude_regions")
    GPU_TYPES_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_REGIONS_FIELD_NUMBER: _ClassVar[int]
    gpu_types: _containers.RepeatedScalarFieldContainer[str]
    clusters: _containers.RepeatedScalarFieldContainer[str]
    exclude_clusters: _containers.RepeatedScalarFieldContainer[str]
    regions: _containers.RepeatedScalarFieldContainer[str]
    exclude_regions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gpu_types: _Optional[_Iterable[str]] = ..., clusters: _Optional[_Iterable[str]] = ..., exclude_clusters: _Optional[_Iterable[str]] = ..., regions: _Optional[_Iterable[str]] = ..., exclude_regions: _Optional[_Iterable[str]] = ...) -> None: ...

class TrainingData(_message.Message):
    __slots__ = ("kind", "path", "dtype", "tokenizer", "text_field", "cache_dir", "seed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_FIELD_NUMBER: _ClassVar[int]
    CACHE_DIR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    path: str
    dtype: str
    tokenizer: str
    text_field: str
    cache_dir: str
    seed: int
    def __init__(self, kind: _Optional[str] = ..., path: _Optional[str] = ..., dtype: _Optional[str] = ..., tokenizer: _Optional[str] = ..., text_field: _Optional[str] = ..., cache_dir: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class OptimizerConfig(_message.Message):
    __slots__ = ("lr", "warmup_steps", "schedule", "min_lr_ratio", "decay_steps", "weight_decay", "betas", "eps", "grad_clip")
    LR_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    DECAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETAS_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    lr: float
    warmup_steps: int
    schedule: str
    min_lr_ratio: float
    decay_steps: int
    weight_decay: float
    betas: _containers.RepeatedScalarFieldContainer[float]
    eps: float
    grad_clip: float
    def __init__(self, lr: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., schedule: _Optional[str] = ..., min_lr_ratio: _Optional[float] = ..., decay_steps: _Optional[int] = ..., weight_decay: _Optional[float] = ..., betas: _Optional[_Iterable[float]] = ..., eps: _Optional[float] = ..., grad_clip: _Optional[float] = ...) -> None: ...

class Stage(_message.Message):
    __slots__ = ("cluster", "first_layer", "last_layer", "tp", "dp", "sharding", "recompute", "replicas")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    first_layer: int
    last_layer: int
    tp: int
    dp: int
    sharding: str
    recompute: bool
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaShare]
    def __init__(self, cluster: _Optional[str] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., tp: _Optional[int] = ..., dp: _Optional[int] = ..., sharding: _Optional[str] = ..., recompute: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[ReplicaShare, _Mapping]]] = ...) -> None: ...

class ReplicaShare(_message.Message):
    __slots__ = ("cluster", "dp")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    dp: int
    def __init__(self, cluster: _Optional[str] = ..., dp: _Optional[int] = ...) -> None: ...

class Predictions(_message.Message):
    __slots__ = ("step_time_s", "throughput_tokens_per_s", "memory_gib_per_gpu", "usd_per_step", "extras")
    class ExtrasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GIB_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    USD_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    step_time_s: float
    throughput_tokens_per_s: float
    memory_gib_per_gpu: _containers.RepeatedScalarFieldContainer[float]
    usd_per_step: float
    extras: _containers.ScalarMap[str, float]
    def __init__(self, step_time_s: _Optional[float] = ..., throughput_tokens_per_s: _Optional[float] = ..., memory_gib_per_gpu: _Optional[_Iterable[float]] = ..., usd_per_step: _Optional[float] = ..., extras: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("stages", "micro_batches", "schedule", "predictions")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    micro_batches: int
    schedule: Schedule
    predictions: Predictions
    def __init__(self, stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ..., micro_batches: _Optional[int] = ..., schedule: _Optional[_Union[Schedule, str]] = ..., predictions: _Optional[_Union[Predictions, _Mapping]] = ...) -> None: ...

class Budget(_message.Message):
    __slots__ = ("time_limit_s", "seed", "objective")
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    time_limit_s: float
    seed: int
    objective: Objective
    def __init__(self, time_limit_s: _Optional[float] = ..., seed: _Optional[int] = ..., objective: _Optional[_Union[Objective, str]] = ...) -> None: ...

class ProgressEvent(_message.Message):
    __slots__ = ("job_id", "attempt", "step", "steps_total", "loss", "tokens_per_s", "step_time_s", "time", "stage", "stage_busy_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    step: int
    steps_total: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    time: _timestamp_pb2.Timestamp
    stage: int
    stage_busy_s: float
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ..., steps_total: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., stage: _Optional[int] = ..., stage_busy_s: _Optional[float] = ...) -> None: ...
