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

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_RUNNING: _ClassVar[WorkerState]
    WORKER_STATE_SUCCEEDED: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_RUNNING: WorkerState
WORKER_STATE_SUCCEEDED: WorkerState
WORKER_STATE_FAILED: WorkerState
WORKER_STATE_STOPPED: WorkerState

class ProbeEchoRequest(_message.Message):
    __slots__ = ("payload", "sequence")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    sequence: int
    def __init__(self, payload: _Optional[bytes] = ..., sequence: _Optional[int] = ...) -> None: ...

class ProbeEchoResponse(_message.Message):
    __slots__ = ("payload", "sequence")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    sequence: int
    def __init__(self, payload: _Optional[bytes] = ..., sequence: _Optional[int] = ...) -> None: ...

class ProbeUploadRequest(_message.Message):
    __slots__ = ("source", "data")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    source: str
    data: bytes
    def __init__(self, source: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProbeUploadResponse(_message.Message):
    __slots__ = ("bytes_received", "seconds")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    seconds: float
    def __init__(self, bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ProbeDownloadRequest(_message.Message):
    __slots__ = ("source", "total_bytes", "chunk_bytes")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    source: str
    total_bytes: int
    chunk_bytes: int
    def __init__(self, source: _Optional[str] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ProbeDownloadResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("rank", "stage", "replica", "tp_rank", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    stage: int
    replica: int
    tp_rank: int
    pid: int
    def __init__(self, rank: _Optional[int] = ..., stage: _Optional[int] = ..., replica: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("job_id", "attempt", "worker", "state", "step", "exit_code", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    worker: Worker
    state: WorkerState
    step: int
    exit_code: int
    error: str
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., worker: _Optional[_Union[Worker, _Mapping]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., step: _Optional[int] = ..., exit_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PeerProbe(_message.Message):
    __slots__ = ("peer", "bandwidth_gbps", "latency_ms", "measured_at")
    PEER_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    peer: str
    bandwidth_gbps: float
    latency_ms: float
    measured_at: _timestamp_pb2.Timestamp
    def __init__(self, peer: _Optional[str] = ..., bandwidth_gbps: _Optional[float] = ..., latency_ms: _Optional[float] = ..., measured_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("cluster", "agent_id", "address", "training", "workers", "probes", "started_at")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    cluster: _types_pb2.Cluster
    agent_id: str
    address: str
    training: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    probes: _containers.RepeatedCompositeFieldContainer[PeerProbe]
    started_at: _timestamp_pb2.Timestamp
    def __init__(self, cluster: _Optional[_Union[_types_pb2.Cluster, _Mapping]] = ..., agent_id: _Optional[str] = ..., address: _Optional[str] = ..., training: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., probes: _Optional[_Iterable[_Union[PeerProbe, _Mapping]]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WatchWorkersRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchWorkersResponse(_message.Message):
    __slots__ = ("worker", "progress")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerStatus
    progress: _types_pb2.ProgressEvent
    def __init__(self, worker: _Optional[_Union[WorkerStatus, _Mapping]] = ..., progress: _Optional[_Union[_types_pb2.ProgressEvent, _Mapping]] = ...) -> None: ...

class ReadLogsOffset(_message.Message):
    __slots__ = ("attempt", "rank", "stream", "offset")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    rank: int
    stream: str
    offset: int
    def __init__(self, attempt: _Optional[int] = ..., rank: _Optional[int] = ..., stream: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ReadLogsRequest(_message.Message):
    __slots__ = ("job_id", "attempt", "rank", "follow", "stream", "offsets")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    rank: int
    follow: bool
    stream: str
    offsets: _containers.RepeatedCompositeFieldContainer[ReadLogsOffset]
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., rank: _Optional[int] = ..., follow: _Optional[bool] = ..., stream: _Optional[str] = ..., offsets: _Optional[_Iterable[_Union[ReadLogsOffset, _Mapping]]] = ...) -> None: ...

class ReadLogsResponse(_message.Message):
    __slots__ = ("cluster", "attempt", "rank", "stream", "offset", "data")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    attempt: int
    rank: int
    stream: str
    offset: int
    data: bytes
    def __init__(self, cluster: _Optional[str] = ..., attempt: _Optional[int] = ..., rank: _Optional[int] = ..., stream: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
