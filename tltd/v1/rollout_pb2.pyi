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

class LogprobMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_MODE_UNSPECIFIED: _ClassVar[LogprobMode]
    LOGPROB_MODE_PROCESSED: _ClassVar[LogprobMode]
    LOGPROB_MODE_RAW: _ClassVar[LogprobMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_FAILED: _ClassVar[FinishReason]

class TokenSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_SOURCE_UNSPECIFIED: _ClassVar[TokenSource]
    TOKEN_SOURCE_PLAIN: _ClassVar[TokenSource]
    TOKEN_SOURCE_ACCEPTED: _ClassVar[TokenSource]
    TOKEN_SOURCE_RESIDUAL: _ClassVar[TokenSource]
    TOKEN_SOURCE_BONUS: _ClassVar[TokenSource]

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_NGRAM: _ClassVar[DrafterKind]
    DRAFTER_KIND_EAGLE: _ClassVar[DrafterKind]
    DRAFTER_KIND_HISTORY: _ClassVar[DrafterKind]

class RequestStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATUS_UNSPECIFIED: _ClassVar[RequestStatus]
    REQUEST_STATUS_QUEUED: _ClassVar[RequestStatus]
    REQUEST_STATUS_RUNNING: _ClassVar[RequestStatus]
    REQUEST_STATUS_COMPLETED: _ClassVar[RequestStatus]
    REQUEST_STATUS_CANCELLED: _ClassVar[RequestStatus]
    REQUEST_STATUS_FAILED: _ClassVar[RequestStatus]
LOGPROB_MODE_UNSPECIFIED: LogprobMode
LOGPROB_MODE_PROCESSED: LogprobMode
LOGPROB_MODE_RAW: LogprobMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_FAILED: FinishReason
TOKEN_SOURCE_UNSPECIFIED: TokenSource
TOKEN_SOURCE_PLAIN: TokenSource
TOKEN_SOURCE_ACCEPTED: TokenSource
TOKEN_SOURCE_RESIDUAL: TokenSource
TOKEN_SOURCE_BONUS: TokenSource
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_NGRAM: DrafterKind
DRAFTER_KIND_EAGLE: DrafterKind
DRAFTER_KIND_HISTORY: DrafterKind
REQUEST_STATUS_UNSPECIFIED: RequestStatus
REQUEST_STATUS_QUEUED: RequestStatus
REQUEST_STATUS_RUNNING: RequestStatus
REQUEST_STATUS_COMPLETED: RequestStatus
REQUEST_STATUS_CANCELLED: RequestStatus
REQUEST_STATUS_FAILED: RequestStatus

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed", "logprob_mode", "return_provenance", "top_logprobs", "prompt_logprobs")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_MODE_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    logprob_mode: LogprobMode
    return_provenance: bool
    top_logprobs: int
    prompt_logprobs: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., logprob_mode: _Optional[_Union[LogprobMode, str]] = ..., return_provenance: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "ranks", "top")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("job_id", "request_id", "prompts", "sampling", "speculative", "return_partial", "batch_samples", "bound")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    RETURN_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    BATCH_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    speculative: _common_pb2.SpeculativeMode
    return_partial: bool
    batch_samples: bool
    bound: StepBound
    def __init__(self, job_id: _Optional[str] = ..., request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeMode, str]] = ..., return_partial: _Optional[bool] = ..., batch_samples: _Optional[bool] = ..., bound: _Optional[_Union[StepBound, _Mapping]] = ...) -> None: ...

class StepBound(_message.Message):
    __slots__ = ("groups", "carried", "park", "deadline_ms", "max_tokens")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CARRIED_FIELD_NUMBER: _ClassVar[int]
    PARK_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    groups: int
    carried: bool
    park: bool
    deadline_ms: int
    max_tokens: int
    def __init__(self, groups: _Optional[int] = ..., carried: _Optional[bool] = ..., park: _Optional[bool] = ..., deadline_ms: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class SpeculativeStats(_message.Message):
    __slots__ = ("draft_steps", "plain_steps", "accepted_tokens", "mean_accepted_length", "drafted_tokens", "bonus_tokens", "residual_tokens")
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    draft_steps: int
    plain_steps: int
    accepted_tokens: int
    mean_accepted_length: float
    drafted_tokens: int
    bonus_tokens: int
    residual_tokens: int
    def __init__(self, draft_steps: _Optional[int] = ..., plain_steps: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., drafted_tokens: _Optional[int] = ..., bonus_tokens: _Optional[int] = ..., residual_tokens: _Optional[int] = ...) -> None: ...

class TokenProvenance(_message.Message):
    __slots__ = ("source", "drafter", "draft_length")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    source: _containers.RepeatedScalarFieldContainer[TokenSource]
    drafter: _containers.RepeatedScalarFieldContainer[DrafterKind]
    draft_length: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, source: _Optional[_Iterable[_Union[TokenSource, str]]] = ..., drafter: _Optional[_Iterable[_Union[DrafterKind, str]]] = ..., draft_length: _Optional[_Iterable[int]] = ...) -> None: ...

class PolicySpan(_message.Message):
    __slots__ = ("first_token", "policy_version")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    policy_version: int
    def __init__(self, first_token: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("request_id", "prompt_index", "sample_index", "token_ids", "logprobs", "finish_reason", "policy_version", "drafter_version", "speculative", "partial", "error", "provenance", "policy_spans", "top_logprobs", "prompt_logprobs", "prompt_token_ids", "simulated")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    POLICY_SPANS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_index: int
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    policy_version: int
    drafter_version: int
    speculative: SpeculativeStats
    partial: bool
    error: str
    provenance: TokenProvenance
    policy_spans: _containers.RepeatedCompositeFieldContainer[PolicySpan]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    prompt_logprobs: PromptLogprobs
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    simulated: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version: _Optional[int] = ..., drafter_version: _Optional[int] = ..., speculative: _Optional[_Union[SpeculativeStats, _Mapping]] = ..., partial: _Optional[bool] = ..., error: _Optional[str] = ..., provenance: _Optional[_Union[TokenProvenance, _Mapping]] = ..., policy_spans: _Optional[_Iterable[_Union[PolicySpan, _Mapping]]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., simulated: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("sample", "samples")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    sample: Sample
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, sample: _Optional[_Union[Sample, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("request_id", "job_id", "status", "num_prompts", "sampling", "samples_total", "samples_done", "status_reason", "created_at", "updated_at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DONE_FIELD_NUMBER: _ClassVar[int]
    STATUS_REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    job_id: str
    status: RequestStatus
    num_prompts: int
    sampling: SamplingParams
    samples_total: int
    samples_done: int
    status_reason: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    def __init__(self, request_id: _Optional[str] = ..., job_id: _Optional[str] = ..., status: _Optional[_Union[RequestStatus, str]] = ..., num_prompts: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., samples_total: _Optional[int] = ..., samples_done: _Optional[int] = ..., status_reason: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("request_id", "include_samples")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    include_samples: bool
    def __init__(self, request_id: _Optional[str] = ..., include_samples: _Optional[bool] = ...) -> None: ...

class GetRequestResponse(_message.Message):
    __slots__ = ("request", "samples")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request: RolloutRequest
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, request: _Optional[_Union[RolloutRequest, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class CancelRequestRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelRequestResponse(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: RolloutRequest
    def __init__(self, request: _Optional[_Union[RolloutRequest, _Mapping]] = ...) -> None: ...
