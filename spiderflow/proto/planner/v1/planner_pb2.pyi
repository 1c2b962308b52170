from spiderflow.proto.types.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Chain(_message.Message):
    __slots__ = ("clusters",)
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    clusters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, clusters: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterGpus(_message.Message):
    __slots__ = ("cluster", "gpus")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    gpus: int
    def __init__(self, cluster: _Optional[str] = ..., gpus: _Optional[int] = ...) -> None: ...

class Allocation(_message.Message):
    __slots__ = ("clusters",)
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    clusters: _containers.RepeatedCompositeFieldContainer[ClusterGpus]
    def __init__(self, clusters: _Optional[_Iterable[_Union[ClusterGpus, _Mapping]]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("topology", "job", "chain", "policy", "allocation", "budget", "schedule", "max_in_flight", "brief")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    topology: _types_pb2.Topology
    job: _types_pb2.JobSpec
    chain: Chain
    policy: str
    allocation: Allocation
    budget: _types_pb2.Budget
    schedule: _types_pb2.Schedule
    max_in_flight: int
    brief: bool
    def __init__(self, topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., job: _Optional[_Union[_types_pb2.JobSpec, _Mapping]] = ..., chain: _Optional[_Union[Chain, _Mapping]] = ..., policy: _Optional[str] = ..., allocation: _Optional[_Union[Allocation, _Mapping]] = ..., budget: _Optional[_Union[_types_pb2.Budget, _Mapping]] = ..., schedule: _Optional[_Union[_types_pb2.Schedule, str]] = ..., max_in_flight: _Optional[int] = ..., brief: _Optional[bool] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("status", "plan", "reason", "constraint", "policy", "planning_seconds", "optimal", "stats")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PLANNING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPTIMAL_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    status: _types_pb2.PlacementStatus
    plan: _types_pb2.Plan
    reason: str
    constraint: str
    policy: str
    planning_seconds: float
    optimal: bool
    stats: _containers.ScalarMap[str, float]
    def __init__(self, status: _Optional[_Union[_types_pb2.PlacementStatus, str]] = ..., plan: _Optional[_Union[_types_pb2.Plan, _Mapping]] = ..., reason: _Optional[str] = ..., constraint: _Optional[str] = ..., policy: _Optional[str] = ..., planning_seconds: _Optional[float] = ..., optimal: _Optional[bool] = ..., stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EstimateRequest(_message.Message):
    __slots__ = ("topology", "job", "plan")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    topology: _types_pb2.Topology
    job: _types_pb2.JobSpec
    plan: _types_pb2.Plan
    def __init__(self, topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., job: _Optional[_Union[_types_pb2.JobSpec, _Mapping]] = ..., plan: _Optional[_Union[_types_pb2.Plan, _Mapping]] = ...) -> None: ...

class EstimateResponse(_message.Message):
    __slots__ = ("plan", "fits_memory", "worst_stage", "excess_gib")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    FITS_MEMORY_FIELD_NUMBER: _ClassVar[int]
    WORST_STAGE_FIELD_NUMBER: _ClassVar[int]
    EXCESS_GIB_FIELD_NUMBER: _ClassVar[int]
    plan: _types_pb2.Plan
    fits_memory: bool
    worst_stage: int
    excess_gib: float
    def __init__(self, plan: _Optional[_Union[_types_pb2.Plan, _Mapping]] = ..., fits_memory: _Optional[bool] = ..., worst_stage: _Optional[int] = ..., excess_gib: _Optional[float] = ...) -> None: ...
