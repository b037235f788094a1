from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SparseFeature(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("dense", "sparse")
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    dense: _containers.RepeatedScalarFieldContainer[float]
    sparse: _containers.RepeatedCompositeFieldContainer[SparseFeature]
    def __init__(self, dense: _Optional[_Iterable[float]] = ..., sparse: _Optional[_Iterable[_Union[SparseFeature, _Mapping]]] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("request_id", "candidates")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, request_id: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("request_id", "scores", "model_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    scores: _containers.RepeatedScalarFieldContainer[float]
    model_version: str
    def __init__(self, request_id: _Optional[str] = ..., scores: _Optional[_Iterable[float]] = ..., model_version: _Optional[str] = ...) -> None: ...
