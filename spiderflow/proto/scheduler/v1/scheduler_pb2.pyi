import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from spiderflow.proto.types.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateTransition(_message.Message):
    __slots__ = ("from_state", "to_state", "reason", "time")
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    from_state: _types_pb2.JobState
    to_state: _types_pb2.JobState
    reason: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, from_state: _Optional[_Union[_types_pb2.JobState, str]] = ..., to_state: _Optional[_Union[_types_pb2.JobState, str]] = ..., reason: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("spec", "state", "reason", "plan", "attempt", "progress", "history", "request_id", "policy", "submitted_at", "updated_at", "revision")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.JobSpec
    state: _types_pb2.JobState
    reason: str
    plan: _types_pb2.Plan
    attempt: int
    progress: _types_pb2.ProgressEvent
    history: _containers.RepeatedCompositeFieldContainer[StateTransition]
    request_id: str
    policy: str
    submitted_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    revision: int
    def __init__(self, spec: _Optional[_Union[_types_pb2.JobSpec, _Mapping]] = ..., state: _Optional[_Union[_types_pb2.JobState, str]] = ..., reason: _Optional[str] = ..., plan: _Optional[_Union[_types_pb2.Plan, _Mapping]] = ..., attempt: _Optional[int] = ..., progress: _Optional[_Union[_types_pb2.ProgressEvent, _Mapping]] = ..., history: _Optional[_Iterable[_Union[StateTransition, _Mapping]]] = ..., request_id: _Optional[str] = ..., policy: _Optional[str] = ..., submitted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("request_id", "job", "policy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    job: _types_pb2.JobSpec
    policy: str
    def __init__(self, request_id: _Optional[str] = ..., job: _Optional[_Union[_types_pb2.JobSpec, _Mapping]] = ..., policy: _Optional[str] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job", "created")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    job: Job
    created: bool
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states", "tenant", "page_size", "page_token")
    STATES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_types_pb2.JobState]
    tenant: str
    page_size: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[_types_pb2.JobState, str]]] = ..., tenant: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "from_revision", "include_progress")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_REVISION_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_revision: int
    include_progress: bool
    def __init__(self, job_id: _Optional[str] = ..., from_revision: _Optional[int] = ..., include_progress: _Optional[bool] = ...) -> None: ...

class WatchJobResponse(_message.Message):
    __slots__ = ("revision", "job", "state_change", "progress")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_CHANGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    revision: int
    job: Job
    state_change: StateTransition
    progress: _types_pb2.ProgressEvent
    def __init__(self, revision: _Optional[int] = ..., job: _Optional[_Union[Job, _Mapping]] = ..., state_change: _Optional[_Union[StateTransition, _Mapping]] = ..., progress: _Optional[_Union[_types_pb2.ProgressEvent, _Mapping]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class WorkerOutcome(_message.Message):
    __slots__ = ("stage", "succeeded", "error", "preempted")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    stage: int
    succeeded: bool
    error: str
    preempted: bool
    def __init__(self, stage: _Optional[int] = ..., succeeded: _Optional[bool] = ..., error: _Optional[str] = ..., preempted: _Optional[bool] = ...) -> None: ...

class ReportProgressRequest(_message.Message):
    __slots__ = ("cluster", "job_id", "attempt", "progress", "outcomes")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    job_id: str
    attempt: int
    progress: _containers.RepeatedCompositeFieldContainer[_types_pb2.ProgressEvent]
    outcomes: _containers.RepeatedCompositeFieldContainer[WorkerOutcome]
    def __init__(self, cluster: _Optional[str] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., progress: _Optional[_Iterable[_Union[_types_pb2.ProgressEvent, _Mapping]]] = ..., outcomes: _Optional[_Iterable[_Union[WorkerOutcome, _Mapping]]] = ...) -> None: ...

class ReportProgressResponse(_message.Message):
    __slots__ = ("accepted", "stop")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    stop: bool
    def __init__(self, accepted: _Optional[bool] = ..., stop: _Optional[bool] = ...) -> None: ...

class GetJobLogsRequest(_message.Message):
    __slots__ = ("job_id", "attempt", "cluster", "rank", "follow", "stream")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    cluster: str
    rank: int
    follow: bool
    stream: str
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., cluster: _Optional[str] = ..., rank: _Optional[int] = ..., follow: _Optional[bool] = ..., stream: _Optional[str] = ...) -> None: ...

class GetJobLogsResponse(_message.Message):
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

class GetJobMetricsRequest(_message.Message):
    __slots__ = ("job_id", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class GetJobMetricsPoint(_message.Message):
    __slots__ = ("attempt", "step", "loss", "tokens_per_s", "step_time_s", "predicted_step_time_s", "time", "stage_busy_s", "predicted_stage_busy_s")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STAGE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STAGE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    step: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    predicted_step_time_s: float
    time: _timestamp_pb2.Timestamp
    stage_busy_s: _containers.RepeatedScalarFieldContainer[float]
    predicted_stage_busy_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, attempt: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., predicted_step_time_s: _Optional[float] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., stage_busy_s: _Optional[_Iterable[float]] = ..., predicted_stage_busy_s: _Optional[_Iterable[float]] = ...) -> None: ...

class GetJobMetricsResponse(_message.Message):
    __slots__ = ("job_id", "points", "dropped")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    points: _containers.RepeatedCompositeFieldContainer[GetJobMetricsPoint]
    dropped: int
    def __init__(self, job_id: _Optional[str] = ..., points: _Optional[_Iterable[_Union[GetJobMetricsPoint, _Mapping]]] = ..., dropped: _Optional[int] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...
