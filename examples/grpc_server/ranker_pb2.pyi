from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Candidate(_message.Message):
    __slots__ = ("item_id", "features")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    features: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, item_id: _Optional[str] = ..., features: _Optional[_Iterable[float]] = ...) -> None: ...

class RankRequest(_message.Message):
    __slots__ = ("request_id", "candidates")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, request_id: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class ScoredItem(_message.Message):
    __slots__ = ("item_id", "score")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    score: float
    def __init__(self, item_id: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class RankResponse(_message.Message):
    __slots__ = ("request_id", "items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[ScoredItem]
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ScoredItem, _Mapping]]] = ...) -> None: ...
