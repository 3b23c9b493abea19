import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyVersion(_message.Message):
    __slots__ = ("job_id", "version", "source", "path", "created_at", "note")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    source: str
    path: str
    created_at: _timestamp_pb2.Timestamp
    note: str
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., source: _Optional[str] = ..., path: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., note: _Optional[str] = ...) -> None: ...

class CheckpointSource(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class TensorSource(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class NcclSource(_message.Message):
    __slots__ = ("master_address", "master_port", "world_size", "group_name")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    world_size: int
    group_name: str
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ...) -> None: ...

class UpdatePolicyRequest(_message.Message):
    __slots__ = ("job_id", "checkpoint", "tensors", "nccl", "note")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    checkpoint: CheckpointSource
    tensors: TensorSource
    nccl: NcclSource
    note: str
    def __init__(self, job_id: _Optional[str] = ..., checkpoint: _Optional[_Union[CheckpointSource, _Mapping]] = ..., tensors: _Optional[_Union[TensorSource, _Mapping]] = ..., nccl: _Optional[_Union[NcclSource, _Mapping]] = ..., note: _Optional[str] = ...) -> None: ...

class UpdatePolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: PolicyVersion
    def __init__(self, policy: _Optional[_Union[PolicyVersion, _Mapping]] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("job_id", "update_id", "tensors", "note", "base_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    update_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    note: str
    base_version: int
    def __init__(self, job_id: _Optional[str] = ..., update_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., note: _Optional[str] = ..., base_version: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "offset", "length", "data", "delta", "crc32c")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    data: bytes
    delta: bool
    crc32c: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., data: _Optional[bytes] = ..., delta: _Optional[bool] = ..., crc32c: _Optional[int] = ...) -> None: ...

class PushPolicyRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    commit: bool
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., commit: _Optional[bool] = ...) -> None: ...

class TensorProgress(_message.Message):
    __slots__ = ("name", "received", "total")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    received: int
    total: int
    def __init__(self, name: _Optional[str] = ..., received: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class PushStatus(_message.Message):
    __slots__ = ("job_id", "update_id", "tensors", "bytes_received", "bytes_total", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    update_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorProgress]
    bytes_received: int
    bytes_total: int
    version: int
    def __init__(self, job_id: _Optional[str] = ..., update_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorProgress, _Mapping]]] = ..., bytes_received: _Optional[int] = ..., bytes_total: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class PushPolicyResponse(_message.Message):
    __slots__ = ("status", "policy")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    status: PushStatus
    policy: PolicyVersion
    def __init__(self, status: _Optional[_Union[PushStatus, _Mapping]] = ..., policy: _Optional[_Union[PolicyVersion, _Mapping]] = ...) -> None: ...

class GetPushRequest(_message.Message):
    __slots__ = ("job_id", "update_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    update_id: str
    def __init__(self, job_id: _Optional[str] = ..., update_id: _Optional[str] = ...) -> None: ...

class OpenBroadcastRequest(_message.Message):
    __slots__ = ("header", "backend", "timeout_seconds")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    backend: str
    timeout_seconds: float
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., backend: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class BroadcastGroup(_message.Message):
    __slots__ = ("address", "port", "world_size", "rank", "prefix", "backend", "workers")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    world_size: int
    rank: int
    prefix: str
    backend: str
    workers: WorkerGroup
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., prefix: _Optional[str] = ..., backend: _Optional[str] = ..., workers: _Optional[_Union[WorkerGroup, _Mapping]] = ...) -> None: ...

class WorkerGroup(_message.Message):
    __slots__ = ("prefix", "world_size", "backend")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    world_size: int
    backend: str
    def __init__(self, prefix: _Optional[str] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...
