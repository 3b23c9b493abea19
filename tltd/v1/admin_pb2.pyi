import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Node(_message.Message):
    __slots__ = ("node_id", "address", "state", "epoch", "heartbeat_age_seconds", "started_at", "cordoned", "draining")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    state: str
    epoch: int
    heartbeat_age_seconds: float
    started_at: _timestamp_pb2.Timestamp
    cordoned: bool
    draining: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., epoch: _Optional[int] = ..., heartbeat_age_seconds: _Optional[float] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., cordoned: _Optional[bool] = ..., draining: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class DeviceProcess(_message.Message):
    __slots__ = ("pid", "used_memory_bytes", "ours")
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    OURS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    used_memory_bytes: int
    ours: bool
    def __init__(self, pid: _Optional[int] = ..., used_memory_bytes: _Optional[int] = ..., ours: _Optional[bool] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("device_id", "kind", "index", "uuid", "name", "memory_total_bytes", "memory_used_bytes", "utilization", "processes", "foreign", "cordoned", "draining", "state", "state_reason", "updated_at")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    kind: str
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float
    processes: _containers.RepeatedCompositeFieldContainer[DeviceProcess]
    foreign: bool
    cordoned: bool
    draining: bool
    state: str
    state_reason: str
    updated_at: _timestamp_pb2.Timestamp
    def __init__(self, device_id: _Optional[str] = ..., kind: _Optional[str] = ..., index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., utilization: _Optional[float] = ..., processes: _Optional[_Iterable[_Union[DeviceProcess, _Mapping]]] = ..., foreign: _Optional[bool] = ..., cordoned: _Optional[bool] = ..., draining: _Optional[bool] = ..., state: _Optional[str] = ..., state_reason: _Optional[str] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("worker_id", "kind", "device_id", "job_id", "state", "pid", "started_at", "last_heartbeat", "state_reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kind: str
    device_id: str
    job_id: str
    state: str
    pid: int
    started_at: _timestamp_pb2.Timestamp
    last_heartbeat: _timestamp_pb2.Timestamp
    state_reason: str
    def __init__(self, worker_id: _Optional[str] = ..., kind: _Optional[str] = ..., device_id: _Optional[str] = ..., job_id: _Optional[str] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_heartbeat: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., state_reason: _Optional[str] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("device_id",)
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    def __init__(self, device_id: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ...) -> None: ...

class CordonRequest(_message.Message):
    __slots__ = ("device_id", "reason", "node_id")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    reason: str
    node_id: str
    def __init__(self, device_id: _Optional[str] = ..., reason: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class UncordonRequest(_message.Message):
    __slots__ = ("device_id", "node_id")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    node_id: str
    def __init__(self, device_id: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("device_id", "node", "grace_seconds", "node_id")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    node: bool
    grace_seconds: int
    node_id: str
    def __init__(self, device_id: _Optional[str] = ..., node: _Optional[bool] = ..., grace_seconds: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("version", "uptime_seconds", "database", "devices", "devices_schedulable", "workers", "jobs_active", "requests_by_status", "samples_total", "tokens_generated", "mean_accepted_length", "draining")
    class RequestsByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATABASE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_SCHEDULABLE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    JOBS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_seconds: float
    database: str
    devices: int
    devices_schedulable: int
    workers: int
    jobs_active: int
    requests_by_status: _containers.ScalarMap[str, int]
    samples_total: int
    tokens_generated: int
    mean_accepted_length: float
    draining: bool
    def __init__(self, version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., database: _Optional[str] = ..., devices: _Optional[int] = ..., devices_schedulable: _Optional[int] = ..., workers: _Optional[int] = ..., jobs_active: _Optional[int] = ..., requests_by_status: _Optional[_Mapping[str, int]] = ..., samples_total: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...
