from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[State]
    IDLE: _ClassVar[State]
    ARMED: _ClassVar[State]
    RUNNING: _ClassVar[State]
    WRITING: _ClassVar[State]
STATE_UNSPECIFIED: State
IDLE: State
ARMED: State
RUNNING: State
WRITING: State

class StartRequest(_message.Message):
    __slots__ = ("max_requests", "duration_ms", "cuda", "record_shapes", "profile_memory", "with_stack", "with_flops", "trigger")
    class Cuda(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CUDA_AUTO: _ClassVar[StartRequest.Cuda]
        CUDA_ON: _ClassVar[StartRequest.Cuda]
        CUDA_OFF: _ClassVar[StartRequest.Cuda]
    CUDA_AUTO: StartRequest.Cuda
    CUDA_ON: StartRequest.Cuda
    CUDA_OFF: StartRequest.Cuda
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    RECORD_SHAPES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    WITH_FLOPS_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    max_requests: int
    duration_ms: int
    cuda: StartRequest.Cuda
    record_shapes: bool
    profile_memory: bool
    with_stack: bool
    with_flops: bool
    trigger: str
    def __init__(self, max_requests: _Optional[int] = ..., duration_ms: _Optional[int] = ..., cuda: _Optional[_Union[StartRequest.Cuda, str]] = ..., record_shapes: _Optional[bool] = ..., profile_memory: _Optional[bool] = ..., with_stack: _Optional[bool] = ..., with_flops: _Optional[bool] = ..., trigger: _Optional[str] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("wait_ms",)
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    wait_ms: int
    def __init__(self, wait_ms: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Session(_message.Message):
    __slots__ = ("number", "session_id", "trigger", "state", "outcome", "error", "max_requests", "duration_ms", "cuda", "requests", "stop_reason", "start_time_unix_nano", "end_time_unix_nano", "trace_path", "trace_bytes", "kernel_count", "kernel_time_us", "attributed_share", "requests_incomplete")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    START_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    END_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    TRACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_COUNT_FIELD_NUMBER: _ClassVar[int]
    KERNEL_TIME_US_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    number: int
    session_id: str
    trigger: str
    state: State
    outcome: str
    error: str
    max_requests: int
    duration_ms: int
    cuda: bool
    requests: int
    stop_reason: str
    start_time_unix_nano: int
    end_time_unix_nano: int
    trace_path: str
    trace_bytes: int
    kernel_count: int
    kernel_time_us: float
    attributed_share: float
    requests_incomplete: int
    def __init__(self, number: _Optional[int] = ..., session_id: _Optional[str] = ..., trigger: _Optional[str] = ..., state: _Optional[_Union[State, str]] = ..., outcome: _Optional[str] = ..., error: _Optional[str] = ..., max_requests: _Optional[int] = ..., duration_ms: _Optional[int] = ..., cuda: _Optional[bool] = ..., requests: _Optional[int] = ..., stop_reason: _Optional[str] = ..., start_time_unix_nano: _Optional[int] = ..., end_time_unix_nano: _Optional[int] = ..., trace_path: _Optional[str] = ..., trace_bytes: _Optional[int] = ..., kernel_count: _Optional[int] = ..., kernel_time_us: _Optional[float] = ..., attributed_share: _Optional[float] = ..., requests_incomplete: _Optional[int] = ...) -> None: ...

class ControlReply(_message.Message):
    __slots__ = ("result", "state", "message", "session", "last")
    class Result(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RESULT_UNSPECIFIED: _ClassVar[ControlReply.Result]
        STARTED: _ClassVar[ControlReply.Result]
        ALREADY_RUNNING: _ClassVar[ControlReply.Result]
        STOPPING: _ClassVar[ControlReply.Result]
        STOPPED: _ClassVar[ControlReply.Result]
        NOT_RUNNING: _ClassVar[ControlReply.Result]
        ALREADY_STOPPING: _ClassVar[ControlReply.Result]
        STATUS: _ClassVar[ControlReply.Result]
    RESULT_UNSPECIFIED: ControlReply.Result
    STARTED: ControlReply.Result
    ALREADY_RUNNING: ControlReply.Result
    STOPPING: ControlReply.Result
    STOPPED: ControlReply.Result
    NOT_RUNNING: ControlReply.Result
    ALREADY_STOPPING: ControlReply.Result
    STATUS: ControlReply.Result
    RESULT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    result: ControlReply.Result
    state: State
    message: str
    session: Session
    last: Session
    def __init__(self, result: _Optional[_Union[ControlReply.Result, str]] = ..., state: _Optional[_Union[State, str]] = ..., message: _Optional[str] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., last: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...
