import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from spiderflow.proto.types.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReportProfileRequest(_message.Message):
    __slots__ = ("cluster", "agent_id", "agent_address", "measured_at")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    cluster: _types_pb2.Cluster
    agent_id: str
    agent_address: str
    measured_at: _timestamp_pb2.Timestamp
    def __init__(self, cluster: _Optional[_Union[_types_pb2.Cluster, _Mapping]] = ..., agent_id: _Optional[str] = ..., agent_address: _Optional[str] = ..., measured_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportProfileResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("target", "bandwidth_gbps", "latency_ms", "probe_bytes", "rtt_samples", "measured_at")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RTT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    target: str
    bandwidth_gbps: float
    latency_ms: float
    probe_bytes: int
    rtt_samples: int
    measured_at: _timestamp_pb2.Timestamp
    def __init__(self, target: _Optional[str] = ..., bandwidth_gbps: _Optional[float] = ..., latency_ms: _Optional[float] = ..., probe_bytes: _Optional[int] = ..., rtt_samples: _Optional[int] = ..., measured_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportLinksRequest(_message.Message):
    __slots__ = ("cluster", "agent_id", "measurements")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MEASUREMENTS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    agent_id: str
    measurements: _containers.RepeatedCompositeFieldContainer[LinkMeasurement]
    def __init__(self, cluster: _Optional[str] = ..., agent_id: _Optional[str] = ..., measurements: _Optional[_Iterable[_Union[LinkMeasurement, _Mapping]]] = ...) -> None: ...

class ReportLinksResponse(_message.Message):
    __slots__ = ("revision", "accepted", "rejected")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    revision: int
    accepted: int
    rejected: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, revision: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTopologyResponse(_message.Message):
    __slots__ = ("topology", "link_status", "cluster_status")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LINK_STATUS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_STATUS_FIELD_NUMBER: _ClassVar[int]
    topology: _types_pb2.Topology
    link_status: _containers.RepeatedCompositeFieldContainer[LinkStatus]
    cluster_status: _containers.RepeatedCompositeFieldContainer[ClusterStatus]
    def __init__(self, topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., link_status: _Optional[_Iterable[_Union[LinkStatus, _Mapping]]] = ..., cluster_status: _Optional[_Iterable[_Union[ClusterStatus, _Mapping]]] = ...) -> None: ...

class LinkStatus(_message.Message):
    __slots__ = ("a", "b", "updated_at", "samples", "pending_outliers")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PENDING_OUTLIERS_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    updated_at: _timestamp_pb2.Timestamp
    samples: int
    pending_outliers: int
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., samples: _Optional[int] = ..., pending_outliers: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("name", "agent_id", "agent_address", "updated_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    agent_id: str
    agent_address: str
    updated_at: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., agent_id: _Optional[str] = ..., agent_address: _Optional[str] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WatchTopologyRequest(_message.Message):
    __slots__ = ("from_revision", "full_snapshots")
    FROM_REVISION_FIELD_NUMBER: _ClassVar[int]
    FULL_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    from_revision: int
    full_snapshots: bool
    def __init__(self, from_revision: _Optional[int] = ..., full_snapshots: _Optional[bool] = ...) -> None: ...

class TopologyChange(_message.Message):
    __slots__ = ("kind", "cluster", "link")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[TopologyChange.Kind]
        KIND_CLUSTER_UPSERTED: _ClassVar[TopologyChange.Kind]
        KIND_CLUSTER_REMOVED: _ClassVar[TopologyChange.Kind]
        KIND_LINK_UPSERTED: _ClassVar[TopologyChange.Kind]
        KIND_LINK_REMOVED: _ClassVar[TopologyChange.Kind]
    KIND_UNSPECIFIED: TopologyChange.Kind
    KIND_CLUSTER_UPSERTED: TopologyChange.Kind
    KIND_CLUSTER_REMOVED: TopologyChange.Kind
    KIND_LINK_UPSERTED: TopologyChange.Kind
    KIND_LINK_REMOVED: TopologyChange.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    kind: TopologyChange.Kind
    cluster: _types_pb2.Cluster
    link: _types_pb2.Link
    def __init__(self, kind: _Optional[_Union[TopologyChange.Kind, str]] = ..., cluster: _Optional[_Union[_types_pb2.Cluster, _Mapping]] = ..., link: _Optional[_Union[_types_pb2.Link, _Mapping]] = ...) -> None: ...

class WatchTopologyResponse(_message.Message):
    __slots__ = ("revision", "changes", "resync", "snapshot")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    revision: int
    changes: _containers.RepeatedCompositeFieldContainer[TopologyChange]
    resync: bool
    snapshot: _types_pb2.Topology
    def __init__(self, revision: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[TopologyChange, _Mapping]]] = ..., resync: _Optional[bool] = ..., snapshot: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ...) -> None: ...
