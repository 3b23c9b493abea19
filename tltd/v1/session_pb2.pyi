import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tltd.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TurnStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_STATUS_UNSPECIFIED: _ClassVar[TurnStatus]
    TURN_STATUS_RUNNING: _ClassVar[TurnStatus]
    TURN_STATUS_DONE: _ClassVar[TurnStatus]

class SessionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATUS_UNSPECIFIED: _ClassVar[SessionStatus]
    SESSION_STATUS_OPEN: _ClassVar[SessionStatus]
    SESSION_STATUS_CLOSED: _ClassVar[SessionStatus]
TURN_STATUS_UNSPECIFIED: TurnStatus
TURN_STATUS_RUNNING: TurnStatus
TURN_STATUS_DONE: TurnStatus
SESSION_STATUS_UNSPECIFIED: SessionStatus
SESSION_STATUS_OPEN: SessionStatus
SESSION_STATUS_CLOSED: SessionStatus

class OpenSessionRequest(_message.Message):
    __slots__ = ("job_id", "session_id", "prompt_token_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenSessionGroupRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "prompt_token_ids", "n")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ...) -> None: ...

class SessionGroup(_message.Message):
    __slots__ = ("group_id", "sessions")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, group_id: _Optional[str] = ..., sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class TurnRequest(_message.Message):
    __slots__ = ("session_id", "turn_index", "input_token_ids", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turn_index: int
    input_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _rollout_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., turn_index: _Optional[int] = ..., input_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_rollout_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class TurnResponse(_message.Message):
    __slots__ = ("turn", "num_tokens")
    TURN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    turn: Turn
    num_tokens: int
    def __init__(self, turn: _Optional[_Union[Turn, _Mapping]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("turn_index", "status", "input_token_ids", "token_ids", "logprobs", "finish_reason", "policy_version", "policy_spans", "request_id")
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_SPANS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    turn_index: int
    status: TurnStatus
    input_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _rollout_pb2.FinishReason
    policy_version: int
    policy_spans: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.PolicySpan]
    request_id: str
    def __init__(self, turn_index: _Optional[int] = ..., status: _Optional[_Union[TurnStatus, str]] = ..., input_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_rollout_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., policy_spans: _Optional[_Iterable[_Union[_rollout_pb2.PolicySpan, _Mapping]]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("token_ids", "loss_mask", "logprobs", "policy_versions", "prompt_length")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "job_id", "status", "num_turns", "num_tokens", "turns", "trajectory", "created_at", "updated_at", "streaming")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job_id: str
    status: SessionStatus
    num_turns: int
    num_tokens: int
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    trajectory: Trajectory
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    streaming: bool
    def __init__(self, session_id: _Optional[str] = ..., job_id: _Optional[str] = ..., status: _Optional[_Union[SessionStatus, str]] = ..., num_turns: _Optional[int] = ..., num_tokens: _Optional[int] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., trajectory: _Optional[_Union[Trajectory, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., streaming: _Optional[bool] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("job_id", "statuses", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    statuses: _containers.RepeatedScalarFieldContainer[SessionStatus]
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[SessionStatus, str]]] = ..., limit: _Optional[int] = ...) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("session_id", "job_id", "status", "num_turns", "num_tokens", "running_turn", "created_at", "updated_at", "worker_id", "node_id", "reuse_hits", "reused_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TURN_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REUSE_HITS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job_id: str
    status: SessionStatus
    num_turns: int
    num_tokens: int
    running_turn: int
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    worker_id: str
    node_id: str
    reuse_hits: int
    reused_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., job_id: _Optional[str] = ..., status: _Optional[_Union[SessionStatus, str]] = ..., num_turns: _Optional[int] = ..., num_tokens: _Optional[int] = ..., running_turn: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., worker_id: _Optional[str] = ..., node_id: _Optional[str] = ..., reuse_hits: _Optional[int] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ...) -> None: ...
