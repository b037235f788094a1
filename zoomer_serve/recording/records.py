"""The span record: the one compact shape in which the request path hands spans to the exporter.

A record is a plain tuple (cheap to build, to pickle across the pipe to the exporter process, and to read).
The index constants below are the single definition of its layout; everything that builds or reads records
uses them.

Fields (units):

- ``R_TRACE_ID`` int, 128-bit trace id; ``R_SPAN_ID`` int, 64-bit span id; ``R_PARENT_ID`` int (0 = root)
- ``R_PARENT_REMOTE`` bool, the parent came from another process (W3C ``traceparent``)
- ``R_TRACE_FLAGS`` int, W3C trace flags (bit 0 = sampled); ``R_TRACE_STATE`` str or None (W3C tracestate)
- ``R_NAME`` str; ``R_KIND`` int, OTLP ``Span.SpanKind`` (``KIND_SERVER`` ...)
- ``R_START_NS`` / ``R_END_NS`` int, Unix epoch time in ns (``time.time_ns``)
- ``R_STATUS`` int, OTLP ``Status.StatusCode`` (``STATUS_UNSET`` / ``STATUS_OK`` / ``STATUS_ERROR``)
- ``R_STATUS_MSG`` str or None; ``R_ATTRS`` dict[str, scalar or list]
- ``R_EVENTS`` list of ``(time_ns, name, attrs)`` or None; ``R_LINKS`` list of ``(trace_id, span_id, attrs)``
  or None; a link may add ``trace_state`` (str or None) and ``flags`` (int, OTLP ``Link.flags``: the W3C trace
  flags and whether the linked context is remote)
- ``R_CHILDREN`` list of the children exported with this one (its phases), or None: each either a child record
  (this same layout) or a *phase entry*, the short form of a plain phase (below)
- ``R_FLAGS`` int, ``F_SAMPLED`` (export the span) | ``F_REQUEST`` (count it in the RPC metrics)
- ``R_SCOPE`` (optional, only on the records of spans that user code made with the OpenTelemetry API, see
  :mod:`zoomer_serve.recording.sdk_spans`): the span's instrumentation scope, ``(name, version, schema_url,
  attributes)``; a record without it (17 fields) is of zoomer-serve's own scope

Times: ``R_START_NS`` is read from the wall clock once; the end and every time inside the span are that start plus
a monotonic delta (see :class:`~zoomer_serve.recording.recorder.RequestSpan`).

A phase entry is a 5-tuple ``(span_id, parent_id, name, start_ns, end_ns)`` (indexes ``PH_*``): a phase span that
ended normally and has no attributes of its own, so everything else about it follows from its record: the
record's trace id, trace flags, trace state and sampled flag, kind ``KIND_INTERNAL``, status unset, attributes
``{PHASE_KEY: name}``, no events or links. The request path builds one for most phases (its pickle is under half
of a full child's); :func:`child_record` turns it into the full child record, and the encoder writes it directly.

``R_ATTRS`` may hold :data:`DROPPED_KEY`: ``(events, links)`` the span dropped past its count limits; the encoder
takes it out and writes the OTLP ``dropped_events_count`` / ``dropped_links_count`` fields instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

R_TRACE_ID = 0
R_SPAN_ID = 1
R_PARENT_ID = 2
R_PARENT_REMOTE = 3
R_TRACE_FLAGS = 4
R_TRACE_STATE = 5
R_NAME = 6
R_KIND = 7
R_START_NS = 8
R_END_NS = 9
R_STATUS = 10
R_STATUS_MSG = 11
R_ATTRS = 12
R_EVENTS = 13
R_LINKS = 14
R_CHILDREN = 15
R_FLAGS = 16
R_SCOPE = 17

EV_TIME_NS = 0
EV_NAME = 1
EV_ATTRS = 2

# OTLP Span.SpanKind values
KIND_INTERNAL = 1
KIND_SERVER = 2
KIND_CLIENT = 3

# OTLP Status.StatusCode values
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2

F_SAMPLED = 1
F_REQUEST = 2

DROPPED_KEY = "zoomer.internal.dropped"
PHASE_KEY = "zoomer.phase"  # the attribute naming a phase span's phase

PH_SPAN_ID = 0
PH_PARENT_ID = 1
PH_NAME = 2
PH_START_NS = 3
PH_END_NS = 4
PHASE_ENTRY_LEN = 5

SpanRecord = tuple[Any, ...]


def count_calls(records: Iterable[SpanRecord]) -> int:
    """How many of ``records`` are calls: request records (``F_REQUEST``), each one call in the RPC metrics. The
    others (a batch's span, a span made with the OpenTelemetry API) are spans only."""
    return sum(1 for rec in records if rec[R_FLAGS] & F_REQUEST)


def exported_spans(rec: SpanRecord) -> int:
    """How many spans a record exports: itself and its children (phases) when sampled, else 0 (an unsampled
    record only feeds the RPC metrics)."""
    if not rec[R_FLAGS] & F_SAMPLED:
        return 0
    return 1 + len(rec[R_CHILDREN] or ())


def phase_record(trace_id: int, trace_flags: int, trace_state: str | None, sampled: int,
                 entry: Sequence[Any]) -> SpanRecord:
    """The full child record of a phase entry (see the module docstring) of a span with these ids and flags
    (``sampled``: its ``F_SAMPLED`` bit)."""
    name = entry[PH_NAME]
    return (trace_id, entry[PH_SPAN_ID], entry[PH_PARENT_ID], False, trace_flags, trace_state, name, KIND_INTERNAL,
            entry[PH_START_NS], entry[PH_END_NS], STATUS_UNSET, None, {PHASE_KEY: name}, None, None, None, sampled)


def child_record(rec: Sequence[Any], child: Sequence[Any]) -> Sequence[Any]:
    """A child of ``rec`` (an element of its ``R_CHILDREN``) as a full record: a phase entry expanded, a child
    record as it is."""
    if len(child) != PHASE_ENTRY_LEN:
        return child
    return phase_record(rec[R_TRACE_ID], rec[R_TRACE_FLAGS], rec[R_TRACE_STATE], rec[R_FLAGS] & F_SAMPLED, child)


def child_records(rec: Sequence[Any]) -> list[Sequence[Any]]:
    """Every child of ``rec`` as a full record (:func:`child_record`), in the order they ended."""
    return [child_record(rec, child) for child in rec[R_CHILDREN] or ()]
