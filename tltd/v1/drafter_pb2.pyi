import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_STATUS_UNSPECIFIED: _ClassVar[DrafterStatus]
    DRAFTER_STATUS_CANDIDATE: _ClassVar[DrafterStatus]
    DRAFTER_STATUS_PROMOTED: _ClassVar[DrafterStatus]
    DRAFTER_STATUS_REJECTED: _ClassVar[DrafterStatus]
    DRAFTER_STATUS_RETIRED: _ClassVar[DrafterStatus]
DRAFTER_STATUS_UNSPECIFIED: DrafterStatus
DRAFTER_STATUS_CANDIDATE: DrafterStatus
DRAFTER_STATUS_PROMOTED: DrafterStatus
DRAFTER_STATUS_REJECTED: DrafterStatus
DRAFTER_STATUS_RETIRED: DrafterStatus

class DrafterVersion(_message.Message):
    __slots__ = ("job_id", "version", "policy_version", "path", "train_steps", "loss", "acceptance_length", "status", "pinned", "active", "created_at", "node_id", "shared")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    policy_version: int
    path: str
    train_steps: int
    loss: float
    acceptance_length: float
    status: DrafterStatus
    pinned: bool
    active: bool
    created_at: _timestamp_pb2.Timestamp
    node_id: str
    shared: bool
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., policy_version: _Optional[int] = ..., path: _Optional[str] = ..., train_steps: _Optional[int] = ..., loss: _Optional[float] = ..., acceptance_length: _Optional[float] = ..., status: _Optional[_Union[DrafterStatus, str]] = ..., pinned: _Optional[bool] = ..., active: _Optional[bool] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., node_id: _Optional[str] = ..., shared: _Optional[bool] = ...) -> None: ...

class ListDraftersRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListDraftersResponse(_message.Message):
    __slots__ = ("drafters", "active_version")
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterVersion]
    active_version: int
    def __init__(self, drafters: _Optional[_Iterable[_Union[DrafterVersion, _Mapping]]] = ..., active_version: _Optional[int] = ...) -> None: ...

class GetDrafterRequest(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PinDrafterRequest(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PinDrafterResponse(_message.Message):
    __slots__ = ("drafter", "active_version")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    drafter: DrafterVersion
    active_version: int
    def __init__(self, drafter: _Optional[_Union[DrafterVersion, _Mapping]] = ..., active_version: _Optional[int] = ...) -> None: ...

class ExportDrafterRequest(_message.Message):
    __slots__ = ("job_id", "version", "output_dir", "format")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    output_dir: str
    format: str
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., output_dir: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...

class ExportDrafterResponse(_message.Message):
    __slots__ = ("path", "files")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    path: str
    files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., files: _Optional[_Iterable[str]] = ...) -> None: ...
