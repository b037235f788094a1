"""Hand-written OTLP protobuf encoder for span records.

Building ``opentelemetry.proto`` message objects from Python costs about 10 µs per span and holds the
interpreter for the whole loop (see ../shared/notes on the export path). Spans from a model server repeat the
same few attribute values (method, status code, system), so this module writes the protobuf wire format
directly and caches the encoded bytes of every (key, value) attribute pair it has seen. The output is a
byte-exact ``opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest``; tests parse it back with
the official message classes.

Wire format reference: field tag = (field_number << 3) | wire_type; wire types 0 varint, 1 fixed64,
2 length-delimited, 5 fixed32.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zoomer_serve.config import SpanLimits
from zoomer_serve.recording.records import (
    DROPPED_KEY,
    EV_ATTRS,
    EV_NAME,
    EV_TIME_NS,
    PH_END_NS,
    PH_NAME,
    PH_PARENT_ID,
    PH_SPAN_ID,
    PH_START_NS,
    R_ATTRS,
    R_END_NS,
    R_EVENTS,
    R_KIND,
    R_LINKS,
    R_NAME,
    R_PARENT_ID,
    R_PARENT_REMOTE,
    R_SCOPE,
    R_SPAN_ID,
    R_START_NS,
    R_STATUS,
    R_STATUS_MSG,
    R_TRACE_FLAGS,
    R_TRACE_ID,
    R_TRACE_STATE,
    child_record,
)
from zoomer_serve.semconv import SCHEMA_URL

_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack
# Span fields written by one pack each: trace_id (field 1, 16 bytes as two big-endian halves) + span_id
# (field 2); parent_span_id (field 4); start/end_time_unix_nano (fields 7, 8, fixed64); flags (field 16, fixed32)
_pack_ids = struct.Struct(">HQQHQ").pack
_pack_parent = struct.Struct(">HQ").pack
_pack_phase_ids = struct.Struct(">HQQHQHQ").pack  # trace_id, span_id and parent_span_id of a phase entry
_pack_times = struct.Struct("<BQBQ").pack
_pack_flags = struct.Struct("<HI").pack
_LOW64 = (1 << 64) - 1
_CACHED_INT_LIMIT = 1 << 16  # int attribute values below it (counts, sizes, ports) are cached; larger ones not
_MAX_CACHE = 50_000  # attribute encodings kept; bounded so unique values cannot grow memory forever
_MAX_CACHED_STR = 256  # longer strings are encoded each time: the cache's memory stays bounded by bytes too

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_FLAG_HAS_IS_REMOTE = 0x100
_FLAG_IS_REMOTE = 0x200


_SMALL_VARINTS = tuple(bytes((i,)) for i in range(128))


def varint(value: int) -> bytes:
    """Encode a non-negative int (or a negative int64, two's complement) as a protobuf varint."""
    if 0 <= value < 128:
        return _SMALL_VARINTS[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _ld(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: tag byte(s), length varint, payload."""
    return bytes((tag,)) + varint(len(payload)) + payload


length_delimited = _ld  # the public name, for the other hand-framed OTLP messages (rpc_metrics)
FIELD_FRAMING_BYTES = 6  # the most a length-delimited field adds to its payload: 1 tag byte, a length < 2**35


def _ld_tag(tag_bytes: bytes, payload: bytes) -> bytes:
    return tag_bytes + varint(len(payload)) + payload


def encode_any_value(value: Any) -> bytes:
    """Encode an attribute value as ``opentelemetry.proto.common.v1.AnyValue``.

    bool, int (int64; an int outside int64 is its decimal string), float (double), str, bytes, and sequences of
    those (ArrayValue) are supported; mappings become KeyValueList (on every span, event and link alike); a
    NumPy scalar (``np.float32``, ``np.int64``, ``np.bool_`` ...) is its Python value (``.item()``), so it
    travels as a double, int or bool; anything else is encoded as its ``str()``.
    """
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        if _INT64_MIN <= value <= _INT64_MAX:
            return b"\x18" + varint(value)
        return _ld(0x0A, str(value).encode())  # past int64 (a varint no reader takes): its decimal string
    if isinstance(value, float):
        return b"\x21" + _pack_d(value)
    if isinstance(value, str):
        return _ld(0x0A, value.encode("utf-8", "replace"))
    if isinstance(value, (bytes, bytearray)):
        return _ld(0x3A, bytes(value))
    if isinstance(value, Mapping):
        inner = b"".join(_ld(0x0A, encode_key_value(str(k), v)) for k, v in value.items())
        return _ld(0x32, inner)
    if isinstance(value, (list, tuple)):
        inner = b"".join(_ld(0x0A, encode_any_value(v)) for v in value)
        return _ld(0x2A, inner)
    plain = numpy_scalar_item(value)
    if plain is not value:
        return encode_any_value(plain)
    return _ld(0x0A, str(value).encode("utf-8", "replace"))


def numpy_scalar_item(value: Any) -> Any:
    """The Python value of a NumPy scalar (``value.item()``: float, int, bool, str, bytes ...), else ``value``
    itself. NumPy is never imported here: a NumPy scalar exists only where NumPy already is (``sys.modules``).
    One whose ``item()`` fails, or gives a NumPy scalar again, is returned as it is."""
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(value, numpy.generic):
        return value
    try:
        plain = value.item()
    except Exception:  # a user's value must not stop the export; it is then encoded as its str()
        return value
    return value if isinstance(plain, numpy.generic) else plain


def encode_key_value(key: str, value: Any) -> bytes:
    """Encode one ``KeyValue`` message (without its enclosing tag); a key that is not a str is its ``str()``."""
    return _ld(0x0A, _text(key)) + _ld(0x12, encode_any_value(value))


def _text(value: Any) -> bytes:
    """A key or name as UTF-8 (unencodable characters replaced); one that is not a str as its ``str()``."""
    return (value if type(value) is str else str(value)).encode("utf-8", "replace")


class ScopedSpan(bytes):
    """An encoded span (its ``Span`` message body) of an instrumentation scope other than the encoder's own (a span
    made with the OpenTelemetry API): ``scope`` and ``schema`` are that ``ScopeSpans``' ``scope`` and
    ``schema_url`` fields, encoded (see :meth:`SpanEncoder.scoped`)."""

    scope: bytes
    schema: bytes


def request_bytes(span: bytes) -> int:
    """The most one encoded span adds to an ``ExportTraceServiceRequest`` (see
    :meth:`SpanEncoder.encode_request`): its length and framing, and for a :class:`ScopedSpan` the ``ScopeSpans``
    of its own scope too (counted for each such span: an upper bound)."""
    if type(span) is bytes:
        return len(span) + FIELD_FRAMING_BYTES
    scoped: Any = span
    return len(span) + len(scoped.scope) + len(scoped.schema) + 2 * FIELD_FRAMING_BYTES


class SpanEncoder:
    """Encodes span records (see :mod:`zoomer_serve.recording.records`) into OTLP request bytes.

    One encoder per exporter; it caches the encoded form of attribute pairs and span names, bounded by
    ``_MAX_CACHE`` entries (strings over ``_MAX_CACHED_STR`` characters are never cached). It applies the span
    limits (:class:`~zoomer_serve.config.SpanLimits`): attribute values cut to the length limit, attributes,
    events, links and their attributes cut to the count limits, what was cut counted in the OTLP
    ``dropped_*_count`` fields. Not thread-safe: use it from the export thread only.
    """

    def __init__(self, resource_attributes: Mapping[str, Any], scope_name: str, scope_version: str,
                 limits: SpanLimits | None = None) -> None:
        self.limits = limits or SpanLimits()
        resource = b"".join(_ld(0x0A, encode_key_value(k, v)) for k, v in resource_attributes.items())
        self._resource_field = _ld(0x0A, resource)  # ResourceSpans.resource
        scope = _ld(0x0A, scope_name.encode()) + _ld(0x12, scope_version.encode())
        self._scope_field = _ld(0x0A, scope)  # ScopeSpans.scope
        self._schema_field = _ld(0x1A, SCHEMA_URL.encode())  # ScopeSpans.schema_url: the conventions followed
        # bytes of a request around its spans, at most (resource, scope, two enclosing fields); each span adds
        # its own length and at most FIELD_FRAMING_BYTES (see encode_request)
        self.request_overhead = (len(self._resource_field) + len(self._scope_field) + len(self._schema_field)
                                 + 2 * FIELD_FRAMING_BYTES)
        self._attr_cache: dict[tuple[str, type, Any], bytes] = {}
        self._key_cache: dict[str, bytes] = {}
        self._name_cache: dict[tuple[str, int], bytes] = {}
        self._tail_cache: dict[tuple[Any, ...], bytes] = {}  # encode_child: what follows the timestamps
        self._phase_cache: dict[tuple[str, int], tuple[bytes, bytes]] = {}  # encode_phase: name and kind, and the tail
        self._scope_cache: dict[tuple[str, str, str], tuple[bytes, bytes]] = {}  # scoped: scope and schema fields

    def _cut(self, value: Any) -> Any:
        """``value`` within the attribute value length limit (strings, bytes, and the strings of a list)."""
        limit = self.limits.attribute_value_length
        if limit is None:
            return value
        if isinstance(value, (str, bytes, bytearray)):
            return value[:limit] if len(value) > limit else value
        if isinstance(value, (list, tuple)):
            return [v[:limit] if isinstance(v, (str, bytes, bytearray)) and len(v) > limit else v for v in value]
        return value

    def _key_values(self, items: Iterable[tuple[str, Any]], limit: int, tag: int) -> tuple[bytes, int]:
        """Encoded ``KeyValue`` fields (``tag``) of the first ``limit`` non-None ``items``, values cut to the
        length limit; and how many were dropped."""
        out, kept, dropped = [], 0, 0
        for key, value in items:
            if value is None:
                continue
            if kept >= limit:
                dropped += 1
                continue
            out.append(_ld(tag, encode_key_value(key, self._cut(value))))
            kept += 1
        return b"".join(out), dropped

    def _attr(self, key: str, value: Any) -> bytes:
        """One ``Span.attributes`` entry. Scalars are cached per (key, type, value): the type is part of the key
        because ``True == 1 == 1.0``; sequences, other values and long strings are encoded each time."""
        kind = type(value)
        if kind is int and not 0 <= value < _CACHED_INT_LIMIT:  # ns, ids: unique, so never cached
            return self._int_attr(key, value)
        if kind is not str and kind is not int and kind is not bool and kind is not float:
            return _ld(0x4A, encode_key_value(key, self._cut(value)))
        if kind is str and len(value) > _MAX_CACHED_STR:
            return _ld(0x4A, encode_key_value(key, self._cut(value)))
        cache_key = (key, kind, value)
        hit = self._attr_cache.get(cache_key)
        if hit is None:
            hit = _ld(0x4A, encode_key_value(key, self._cut(value)))
            if len(self._attr_cache) < _MAX_CACHE:
                self._attr_cache[cache_key] = hit
        return hit

    def _int_attr(self, key: str, value: int) -> bytes:
        """``Span.attributes`` entry of an int value: the key's encoded prefix (cached) and the varint."""
        if not _INT64_MIN <= value <= _INT64_MAX:
            return _ld(0x4A, encode_key_value(key, value))
        prefix = self._key_cache.get(key)
        if prefix is None:
            prefix = _ld(0x0A, _text(key))
            if len(self._key_cache) < _MAX_CACHE:
                self._key_cache[key] = prefix
        number = varint(value)  # AnyValue.int_value (field 3), at most 10 bytes: lengths fit one byte
        body = prefix + bytes((0x12, len(number) + 1, 0x18)) + number
        return bytes((0x4A,)) + varint(len(body)) + body

    def _name_kind(self, name: str, kind: int) -> bytes:
        """``Span.name`` and ``Span.kind`` fields, cached per pair."""
        hit = self._name_cache.get((name, kind))
        if hit is None:
            hit = _ld(0x2A, _text(name)) + b"\x30" + varint(kind)
            if len(self._name_cache) < _MAX_CACHE:
                self._name_cache[(name, kind)] = hit
        return hit

    def encode_span(self, rec: Sequence[Any]) -> bytes:
        """Encode one span record as an OTLP ``Span`` message body."""
        return self._head(rec) + self._tail(rec)

    def encode_child(self, rec: Sequence[Any]) -> bytes:
        """:meth:`encode_span` for the child records of a request (its phases), which repeat a few shapes:
        the fields after the timestamps (attributes, status, flags) are cached per shape (attributes, status,
        flags; at most :data:`_MAX_CACHE` shapes). Children with events, links, a trace state, more than two
        attributes or attribute values other than strings take :meth:`encode_span`."""
        attrs = rec[R_ATTRS]
        if rec[R_EVENTS] or rec[R_LINKS] or rec[R_TRACE_STATE] or len(attrs) > 2:
            return self.encode_span(rec)
        for value in attrs.values():
            if type(value) is not str:
                return self.encode_span(rec)
        key = (rec[R_STATUS], rec[R_STATUS_MSG], rec[R_TRACE_FLAGS], rec[R_PARENT_REMOTE], *attrs.items())
        tail = self._tail_cache.get(key)
        if tail is None:
            tail = self._tail(rec)
            if len(self._tail_cache) < _MAX_CACHE:
                self._tail_cache[key] = tail
        return self._head(rec) + tail

    def encode_phase(self, rec: Sequence[Any], entry: Sequence[Any]) -> bytes:
        """:meth:`encode_span` of a phase entry of ``rec`` (see :mod:`zoomer_serve.recording.records`), the same
        bytes as of its full child record, written from the entry: the fields after the span's timestamps and
        its name and kind are cached per (name, trace flags), at most :data:`_MAX_CACHE` of them; a record with a
        trace state or a name over :data:`_MAX_CACHED_STR` characters takes :meth:`encode_span`."""
        name = entry[PH_NAME]
        if rec[R_TRACE_STATE] or type(name) is not str or len(name) > _MAX_CACHED_STR:
            return self.encode_span(child_record(rec, entry))
        key = (name, rec[R_TRACE_FLAGS])
        parts = self._phase_cache.get(key)
        if parts is None:
            full = child_record(rec, entry)
            parts = (self._name_kind(name, full[R_KIND]), self._tail(full))
            if len(self._phase_cache) < _MAX_CACHE:
                self._phase_cache[key] = parts
        trace_id = rec[R_TRACE_ID]
        return b"".join((_pack_phase_ids(0x0A10, trace_id >> 64, trace_id & _LOW64, 0x1208, entry[PH_SPAN_ID],
                                         0x2208, entry[PH_PARENT_ID]),
                         parts[0], _pack_times(0x39, entry[PH_START_NS], 0x41, entry[PH_END_NS]), parts[1]))

    def _head(self, rec: Sequence[Any]) -> bytes:
        """The ``Span`` fields up to the timestamps: ids, trace state, parent, name, kind, start and end."""
        trace_id = rec[R_TRACE_ID]
        parts = [_pack_ids(0x0A10, trace_id >> 64, trace_id & _LOW64, 0x1208, rec[R_SPAN_ID])]
        trace_state = rec[R_TRACE_STATE]
        if trace_state:
            parts.append(_ld(0x1A, trace_state.encode()))
        parent = rec[R_PARENT_ID]
        if parent:
            parts.append(_pack_parent(0x2208, parent))
        parts.append(self._name_kind(rec[R_NAME], rec[R_KIND]))
        parts.append(_pack_times(0x39, rec[R_START_NS], 0x41, rec[R_END_NS]))
        return b"".join(parts)

    def _tail(self, rec: Sequence[Any]) -> bytes:
        """The ``Span`` fields after the timestamps: attributes, events, links (each within the span limits, with
        their ``dropped_*_count``), status, flags."""
        parts = []
        attr, cached = self._attr, self._attr_cache.get
        limits = self.limits
        kept = dropped = 0
        dropped_events = dropped_links = 0
        for key, value in rec[R_ATTRS].items():
            if value is None:
                continue
            if key == DROPPED_KEY:
                dropped_events, dropped_links = value
                continue
            if kept >= limits.attribute_count:
                dropped += 1
                continue
            # _attr's cache hit, without its call (what a cached value's key is: see _attr)
            kind = type(value)
            hit = cached((key, kind, value)) if kind is str or kind is int or kind is bool else None
            parts.append(hit if hit is not None else attr(key, value))
            kept += 1
        if dropped:
            parts.append(b"\x50" + varint(dropped))  # Span.dropped_attributes_count (field 10)
        events = rec[R_EVENTS]
        if events:
            dropped_events += max(0, len(events) - limits.event_count)
            for ev in events[:limits.event_count]:
                body = b"\x09" + _pack_q(ev[EV_TIME_NS]) + _ld(0x12, _text(ev[EV_NAME]))
                attrs, cut = self._key_values((ev[EV_ATTRS] or {}).items(), limits.event_attribute_count, 0x1A)
                body += attrs + (b"\x20" + varint(cut) if cut else b"")  # Event.dropped_attributes_count (4)
                parts.append(_ld(0x5A, body))
        if dropped_events:
            parts.append(b"\x60" + varint(dropped_events))  # Span.dropped_events_count (field 12)
        links = rec[R_LINKS]
        if links:
            dropped_links += max(0, len(links) - limits.link_count)
            for link in links[:limits.link_count]:
                body = _ld(0x0A, link[0].to_bytes(16, "big")) + _ld(0x12, link[1].to_bytes(8, "big"))
                if len(link) > 3 and link[3]:
                    body += _ld(0x1A, _text(link[3]))  # Link.trace_state (3)
                attrs, cut = self._key_values((link[2] or {}).items(), limits.link_attribute_count, 0x22)
                body += attrs + (b"\x28" + varint(cut) if cut else b"")  # Link.dropped_attributes_count (5)
                if len(link) > 4:
                    body += b"\x35" + struct.pack("<I", link[4])  # Link.flags (6, fixed32)
                parts.append(_ld(0x6A, body))
        if dropped_links:
            parts.append(b"\x70" + varint(dropped_links))  # Span.dropped_links_count (field 14)
        status = rec[R_STATUS]
        if status:
            body = b""
            msg = rec[R_STATUS_MSG]
            if msg:
                body += _ld(0x12, _text(msg))
            body += b"\x18" + varint(status)
            parts.append(_ld(0x7A, body))
        flags = rec[R_TRACE_FLAGS] | (_FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE if rec[R_PARENT_REMOTE]
                                      else _FLAG_HAS_IS_REMOTE)
        parts.append(_pack_flags(0x0185, flags))  # tag 0x85 0x01 (field 16, fixed32), little-endian
        return b"".join(parts)

    def scoped(self, span: bytes, rec: Sequence[Any]) -> bytes:
        """``span``, the encoded span of ``rec``, as it is when ``rec`` is of zoomer-serve's own scope, else a
        :class:`ScopedSpan` of the record's ``R_SCOPE`` ``(name, version, schema_url, attributes)`` (its
        encoding cached per scope without attributes, at most :data:`_MAX_CACHE` of them)."""
        if len(rec) <= R_SCOPE or not rec[R_SCOPE]:
            return span
        name, version, schema_url, attributes = rec[R_SCOPE]
        fields = self._scope_cache.get((name, version, schema_url)) if not attributes else None
        if fields is None:
            scope = _ld(0x0A, _text(name)) + (_ld(0x12, _text(version)) if version else b"")
            attrs, cut = self._key_values((attributes or {}).items(), self.limits.attribute_count, 0x1A)
            scope += attrs + (b"\x20" + varint(cut) if cut else b"")  # InstrumentationScope (attributes: 3, 4)
            fields = (_ld(0x0A, scope), _ld(0x1A, _text(schema_url)) if schema_url else b"")
            if not attributes and len(self._scope_cache) < _MAX_CACHE:
                self._scope_cache[(name, version, schema_url)] = fields
        out = ScopedSpan(span)
        out.scope, out.schema = fields
        return out

    def encode_request(self, spans: Iterable[bytes]) -> bytes:
        """Wrap encoded spans into one ``ExportTraceServiceRequest`` (one resource; one ``ScopeSpans`` for
        zoomer-serve's own scope, and one for each other scope among the :class:`ScopedSpan` s). Its length is at
        most :attr:`request_overhead` plus :func:`request_bytes` of each span."""
        spans = list(spans)
        others: dict[tuple[bytes, bytes], list[bytes]] = {}
        for span in spans:
            if type(span) is not bytes:
                scoped: Any = span
                others.setdefault((scoped.scope, scoped.schema), []).append(span)
        resource_spans = self._resource_field
        own = spans if not others else [s for s in spans if type(s) is bytes]
        if own or not others:
            scope_spans = self._scope_field + b"".join(_ld_tag(b"\x12", s) for s in own) + self._schema_field
            resource_spans += _ld(0x12, scope_spans)
        for (scope, schema), group in others.items():
            resource_spans += _ld(0x12, scope + b"".join(_ld_tag(b"\x12", s) for s in group) + schema)
        return _ld(0x0A, resource_spans)
