import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tltd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATUS_UNSPECIFIED: _ClassVar[JobStatus]
    JOB_STATUS_ACTIVE: _ClassVar[JobStatus]
    JOB_STATUS_CANCELLED: _ClassVar[JobStatus]
    JOB_STATUS_FAILED: _ClassVar[JobStatus]

class PolicySwitch(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_SWITCH_UNSPECIFIED: _ClassVar[PolicySwitch]
    POLICY_SWITCH_FINISH_ON_START_VERSION: _ClassVar[PolicySwitch]
    POLICY_SWITCH_NEXT_STEP: _ClassVar[PolicySwitch]
JOB_STATUS_UNSPECIFIED: JobStatus
JOB_STATUS_ACTIVE: JobStatus
JOB_STATUS_CANCELLED: JobStatus
JOB_STATUS_FAILED: JobStatus
POLICY_SWITCH_UNSPECIFIED: PolicySwitch
POLICY_SWITCH_FINISH_ON_START_VERSION: PolicySwitch
POLICY_SWITCH_NEXT_STEP: PolicySwitch

class Job(_message.Message):
    __slots__ = ("job_id", "name", "model_path", "backend", "priority", "weight", "speculative", "status", "status_reason", "policy_version", "drafter_version", "created_at", "updated_at", "policy_switch", "max_staleness", "bounded")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    POLICY_SWITCH_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    model_path: str
    backend: _common_pb2.Backend
    priority: int
    weight: float
    speculative: _common_pb2.SpeculativeConfig
    status: JobStatus
    status_reason: str
    policy_version: int
    drafter_version: int
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    policy_switch: PolicySwitch
    max_staleness: int
    bounded: BoundedStats
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., model_path: _Optional[str] = ..., backend: _Optional[_Union[_common_pb2.Backend, str]] = ..., priority: _Optional[int] = ..., weight: _Optional[float] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeConfig, _Mapping]] = ..., status: _Optional[_Union[JobStatus, str]] = ..., status_reason: _Optional[str] = ..., policy_version: _Optional[int] = ..., drafter_version: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., policy_switch: _Optional[_Union[PolicySwitch, str]] = ..., max_staleness: _Optional[int] = ..., bounded: _Optional[_Union[BoundedStats, _Mapping]] = ...) -> None: ...

class BoundedStats(_message.Message):
    __slots__ = ("groups_sent", "groups_dropped_stale", "prompts_parked", "prompts_open", "samples_sent", "samples_multi_version", "max_version_spread")
    GROUPS_SENT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PARKED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_OPEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_MULTI_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_SPREAD_FIELD_NUMBER: _ClassVar[int]
    groups_sent: int
    groups_dropped_stale: int
    prompts_parked: int
    prompts_open: int
    samples_sent: int
    samples_multi_version: int
    max_version_spread: int
    def __init__(self, groups_sent: _Optional[int] = ..., groups_dropped_stale: _Optional[int] = ..., prompts_parked: _Optional[int] = ..., prompts_open: _Optional[int] = ..., samples_sent: _Optional[int] = ..., samples_multi_version: _Optional[int] = ..., max_version_spread: _Optional[int] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("job_id", "name", "model_path", "backend", "priority", "weight", "speculative", "policy_switch", "max_staleness")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    POLICY_SWITCH_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    model_path: str
    backend: _common_pb2.Backend
    priority: int
    weight: float
    speculative: _common_pb2.SpeculativeConfig
    policy_switch: PolicySwitch
    max_staleness: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., model_path: _Optional[str] = ..., backend: _Optional[_Union[_common_pb2.Backend, str]] = ..., priority: _Optional[int] = ..., weight: _Optional[float] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeConfig, _Mapping]] = ..., policy_switch: _Optional[_Union[PolicySwitch, str]] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("statuses", "limit")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[JobStatus]
    limit: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[JobStatus, str]]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
