"""Spans made with the OpenTelemetry API (the SDK ``TracerProvider`` that :func:`zoomer_serve.configure` builds) go
to zoomer-serve's own export pipeline, as span records: :class:`SdkSpanForwarder` is that provider's span processor.

Why not the SDK's ``BatchSpanProcessor`` and OTLP exporter: they sent a batch as one request whatever its size,
so one span over the collector's limit lost the whole batch (the small spans with it), counted nowhere but a log
line; and they kept their own retry rules beside zoomer's. Through the pipeline, every span gets the same
guarantees, from one place: requests of at most ``ZOOMER_EXPORT_MAX_REQUEST_BYTES``, a span too large for any
request dropped alone, every loss in :class:`~zoomer_serve.export.ExportStats`, the shutdown's loss summary and
``otel.sdk.exporter.span.exported``, the same retries and timeouts (:mod:`zoomer_serve.export.transport`), and the
encoding done in the export helper process, off the server's interpreter.

What a record carries of an SDK span (:func:`sdk_record`): ids, parent (and whether it is remote), trace flags and
state, name, kind, times, status, attributes, events, links (their trace and span ids and attributes), the SDK's
dropped event and link counts, and the instrumentation scope (``R_SCOPE``: name, version, schema URL,
attributes). Not carried: the SDK's own dropped-attribute counts (of spans, events and links).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve")
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200


def sdk_record(span: ReadableSpan) -> r.SpanRecord:
    """The span record (:mod:`zoomer_serve.recording.records`, with ``R_SCOPE``) of an ended, sampled SDK span:
    sampled and not a request (it is exported, and not counted in the RPC metrics). Values are referenced, not
    copied: the SDK's span is read-only once ended."""
    ctx, parent = span.context, span.parent
    attrs: dict[str, Any] = dict(span.attributes or {})
    if span.dropped_events or span.dropped_links:
        attrs[r.DROPPED_KEY] = (span.dropped_events, span.dropped_links)
    events = [(e.timestamp, e.name, dict(e.attributes or {})) for e in span.events] or None
    links = [(link.context.trace_id, link.context.span_id, dict(link.attributes or {}),
              link.context.trace_state.to_header() or None, _flags(link.context)) for link in span.links]
    status = span.status
    scope = span.instrumentation_scope
    scope_field = None
    if scope is not None:
        scope_field = (scope.name, scope.version or "", scope.schema_url or "", dict(scope.attributes or {}))
    return (ctx.trace_id, ctx.span_id, parent.span_id if parent is not None else 0,
            bool(parent is not None and parent.is_remote), int(ctx.trace_flags),
            ctx.trace_state.to_header() or None if ctx.trace_state else None, span.name,
            span.kind.value + 1,  # the SDK's SpanKind counts from INTERNAL = 0, OTLP's from UNSPECIFIED = 0
            span.start_time or 0, span.end_time or 0, status.status_code.value,
            status.description if status.description else None, attrs, events, links or None, None, r.F_SAMPLED,
            scope_field)


def _flags(ctx: Any) -> int:
    """OTLP ``Span.flags`` / ``Link.flags`` of a span context: its W3C trace flags, and whether it is remote."""
    return int(ctx.trace_flags) | _HAS_IS_REMOTE | (_IS_REMOTE if ctx.is_remote else 0)


class SdkSpanForwarder(SpanProcessor):
    """The span processor of zoomer-serve's SDK ``TracerProvider``: each ended, sampled span becomes a record
    handed to ``sink()`` (the process's recorder's sink: the export pipeline's non-blocking ``submit``, which
    counts what does not fit its queue; after :func:`zoomer_serve.shutdown`, the count of records that came too
    late). ``flush(timeout_s)`` exports what was handed over and says whether it all reached the collector
    (:meth:`~zoomer_serve.export.ExportPipeline.flush`); None while telemetry shuts down (the pipeline's own
    shutdown exports it). Never raises: a span that cannot be turned into a record is counted in
    :attr:`unconverted` and logged once."""

    def __init__(self, sink: Callable[[], Callable[[r.SpanRecord], None]],
                 flush: Callable[[], Callable[[float], bool] | None]) -> None:
        self._sink = sink
        self._flush = flush
        self.unconverted = 0  # spans lost because sdk_record failed on them
        self._lock = threading.Lock()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        try:
            record = sdk_record(span)
        except Exception as exc:  # fail open: the server goes on; the loss is counted
            with self._lock:
                self.unconverted += 1
                first = self.unconverted == 1
            if first:
                logger.warning("zoomer-serve: could not export a span made with the OpenTelemetry API (%r); "
                               "dropping and counting such spans (logged once)", exc)
            return
        self._sink()(record)

    def shutdown(self) -> None:
        pass  # nothing is held here; the telemetry's shutdown exports what the pipeline holds

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = self._flush()
        return True if flush is None else flush(timeout_millis / 1000)
