from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_TORCH: _ClassVar[Backend]
    BACKEND_SGLANG: _ClassVar[Backend]
    BACKEND_SIM: _ClassVar[Backend]

class SpeculativeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATIVE_MODE_UNSPECIFIED: _ClassVar[SpeculativeMode]
    SPECULATIVE_MODE_AUTO: _ClassVar[SpeculativeMode]
    SPECULATIVE_MODE_OFF: _ClassVar[SpeculativeMode]
BACKEND_UNSPECIFIED: Backend
BACKEND_TORCH: Backend
BACKEND_SGLANG: Backend
BACKEND_SIM: Backend
SPECULATIVE_MODE_UNSPECIFIED: SpeculativeMode
SPECULATIVE_MODE_AUTO: SpeculativeMode
SPECULATIVE_MODE_OFF: SpeculativeMode

class SpeculativeConfig(_message.Message):
    __slots__ = ("mode", "batch_threshold", "draft_lengths", "drafter", "online_training", "initial_drafter_path")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BATCH_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ONLINE_TRAINING_FIELD_NUMBER: _ClassVar[int]
    INITIAL_DRAFTER_PATH_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculativeMode
    batch_threshold: int
    draft_lengths: _containers.RepeatedScalarFieldContainer[int]
    drafter: str
    online_training: bool
    initial_drafter_path: str
    def __init__(self, mode: _Optional[_Union[SpeculativeMode, str]] = ..., batch_threshold: _Optional[int] = ..., draft_lengths: _Optional[_Iterable[int]] = ..., drafter: _Optional[str] = ..., online_training: _Optional[bool] = ..., initial_drafter_path: _Optional[str] = ...) -> None: ...
