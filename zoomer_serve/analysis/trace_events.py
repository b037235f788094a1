"""The part of a Chrome / Kineto trace event the analysis reads, as ``msgspec`` structs: decoding a piece of
the file straight into them skips every other field (CPU ops' input shapes, stacks, ...) without building
Python objects for it, which makes loading 2 to 6 times faster than ``orjson`` dicts (measured on the
109k-event ``a100_training_step`` trace; ``benchmarks/ANALYSIS.md``).

Events are a tagged union on ``ph`` (one struct class per phase Chrome defines). Every field is typed
``Any``, so odd values (a name that is a number, a NaN time) decode as they are and are dealt with by the
normaliser, never here. A piece that does not fit the schema at all (an item that is not an object, a ``ph``
that is missing or unknown, ``args`` that is not an object) raises :class:`msgspec.ValidationError`; the
reader then parses it into dicts, which :func:`from_dicts` converts event by event (those that still do not
fit stay dicts and are repaired or counted by the normaliser).
"""

from __future__ import annotations

import math
from typing import Any, Union

import msgspec


class Args(msgspec.Struct, omit_defaults=True, rename={
        "external_id": "External id", "registers_per_thread": "registers per thread",
        "shared_memory": "shared memory", "blocks_per_sm": "blocks per SM", "warps_per_sm": "warps per SM",
        "occupancy": "est. achieved occupancy %", "graph_node_id": "graph node id", "graph_id": "graph id",
        "device_id": "Device Id", "device_type": "Device Type", "memory_bytes": "Bytes",
        "total_allocated": "Total Allocated", "total_reserved": "Total Reserved"}):
    """The ``args`` keys read, with the value the tables use when one is absent: -1 for ids and counts, NaN
    for measures, 0 for byte counts; None for the device and stream (the event's pid / tid then)."""

    external_id: Any = -1
    correlation: Any = -1
    device: Any = None
    stream: Any = None
    grid: Any = None
    block: Any = None
    registers_per_thread: Any = -1
    shared_memory: Any = -1
    blocks_per_sm: Any = math.nan
    warps_per_sm: Any = math.nan
    occupancy: Any = math.nan
    bytes: Any = 0
    cbid: Any = -1
    cuda_sync_kind: Any = None
    wait_on_stream: Any = -1
    graph_node_id: Any = -1
    graph_id: Any = -1
    name: Any = None
    labels: Any = None
    device_id: Any = None
    device_type: Any = None
    memory_bytes: Any = 0
    total_allocated: Any = 0
    total_reserved: Any = 0


EMPTY_ARGS = Args()


class Event(msgspec.Struct, tag_field="ph", omit_defaults=True):
    """A trace event's fields that the analysis reads; ``ph`` is the class's tag (``Event.ph``)."""

    cat: Any = None
    name: Any = None
    ts: Any = None
    dur: Any = 0
    pid: Any = -1
    tid: Any = -1
    id: Any = -1
    args: Union[Args, None] = None  # noqa: UP007 (msgspec reads the annotation at runtime)


class CounterEvent(msgspec.Struct, tag="C", tag_field="ph", omit_defaults=True):
    """A counter sample (``ph`` "C"): its ``args`` are the counter values by series name."""

    cat: Any = None
    name: Any = None
    ts: Any = None
    pid: Any = -1
    tid: Any = -1
    id: Any = None
    args: Union[dict[str, Any], None] = None  # noqa: UP007


PHASES = ("X", "B", "E", "i", "I", "s", "t", "f", "M", "b", "e", "n", "P", "O", "N", "D", "R")
EVENT_TYPES: dict[str, Any] = {
    ph: msgspec.defstruct(f"Event_{ph}", [], bases=(Event,), tag=ph) for ph in PHASES}
EventType = Union[tuple(EVENT_TYPES.values()) + (CounterEvent,)]  # type: ignore[valid-type]  # noqa: UP007
DECODER = msgspec.json.Decoder(list[EventType])  # type: ignore[valid-type]
STRUCTS = (Event, CounterEvent)
"""The classes of decoded events (anything else in a piece is a dict or a bare JSON value)."""


def phase_of(event: Any) -> str:
    """The ``ph`` of an event struct."""
    return type(event).__struct_config__.tag  # type: ignore[no-any-return]


def from_dicts(items: list[Any]) -> list[Any]:
    """Parsed JSON items as event structs where they fit the schema; the others as they are."""
    try:
        return msgspec.convert(items, list[EventType])  # type: ignore[valid-type]
    except msgspec.ValidationError:
        pass
    out: list[Any] = []
    for item in items:
        try:
            out.append(msgspec.convert(item, EventType))
        except msgspec.ValidationError:
            out.append(item)
    return out


def as_dict(event: Any) -> Any:
    """An event struct back as a plain dict with the JSON keys (``ph`` included); anything else unchanged."""
    if isinstance(event, msgspec.Struct):
        return msgspec.to_builtins(event)
    return event
