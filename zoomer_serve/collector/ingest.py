"""Transport-independent handling of one OTLP export: parse, decode, queue into the store, count.

Both receivers (gRPC and HTTP) call :meth:`Ingestor.ingest_bytes` (or :meth:`Ingestor.ingest_message` for
OTLP/JSON) and map the :class:`Outcome` onto their own status codes. An export's rows are committed to the
store before it is answered OK (:meth:`zoomer_serve.collector.store.Store.write`), so the calling thread
blocks for one insert.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_svc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_svc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_svc

from zoomer_serve.collector import decode
from zoomer_serve.collector.store import Store, WriteStatus


class Signal(enum.Enum):
    """The three OTLP signals; the value is the signal's name in counters and URLs (``/v1/<value>``)."""

    TRACES = "traces"
    METRICS = "metrics"
    LOGS = "logs"


REQUEST_TYPES: dict[Signal, type[Message]] = {
    Signal.TRACES: trace_svc.ExportTraceServiceRequest,
    Signal.METRICS: metrics_svc.ExportMetricsServiceRequest,
    Signal.LOGS: logs_svc.ExportLogsServiceRequest,
}
RESPONSE_TYPES: dict[Signal, type[Message]] = {
    Signal.TRACES: trace_svc.ExportTraceServiceResponse,
    Signal.METRICS: metrics_svc.ExportMetricsServiceResponse,
    Signal.LOGS: logs_svc.ExportLogsServiceResponse,
}
GRPC_SERVICES: dict[Signal, str] = {
    Signal.TRACES: "opentelemetry.proto.collector.trace.v1.TraceService",
    Signal.METRICS: "opentelemetry.proto.collector.metrics.v1.MetricsService",
    Signal.LOGS: "opentelemetry.proto.collector.logs.v1.LogsService",
}


class Outcome(enum.Enum):
    """How an export ended: OK (committed, maybe with partial rejections), INVALID (bad payload, do not
    retry), TOO_LARGE (over the size limit, do not retry), UNAVAILABLE (store queue full, closing, or not
    committed in time: retry)."""

    OK = "ok"
    INVALID = "invalid"
    TOO_LARGE = "too_large"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class IngestResult:
    """Outcome of one export; ``response`` is set for OK, ``message`` explains the others."""

    outcome: Outcome
    response: Message | None = None
    message: str = ""


class Ingestor:
    """Parses and stores exports; thread-safe; counts every request, item and rejection.

    Counter names (see :meth:`counters`): ``<signal>_requests`` (parsed requests),
    ``spans_received`` / ``metric_points_received`` / ``log_records_received`` (items accepted),
    ``spans_rejected`` / ``metric_points_rejected`` (invalid items, answered with partial success),
    ``rejected_invalid``, ``rejected_too_large``, ``rejected_unavailable`` (whole requests), and the receivers' own
    counters added with :meth:`count` (``grpc_requests``, ``http_requests``, ``http_<status>`` ...).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self._counters[name] += n

    def counters(self) -> dict[str, int]:
        """A snapshot of all counters."""
        with self._lock:
            return dict(self._counters)

    def reject(self, outcome: Outcome, message: str) -> IngestResult:
        """Count a whole-request rejection and build its result."""
        self.count(f"rejected_{outcome.value}")
        return IngestResult(outcome, None, message)

    def ingest_bytes(self, signal: Signal, payload: bytes) -> IngestResult:
        """Parse a binary protobuf export request of ``signal`` and store it (traces through
        :func:`decode.parse_traces`, which keeps span attributes serialized for the decoder)."""
        parse = decode.parse_traces if signal is Signal.TRACES else REQUEST_TYPES[signal].FromString
        try:
            request = parse(payload)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return self.reject(Outcome.INVALID, f"cannot parse {REQUEST_TYPES[signal].DESCRIPTOR.name}: {exc}")
        return self.ingest_message(signal, request)

    def ingest_message(self, signal: Signal, request: Any) -> IngestResult:
        """Store an already parsed export request of ``signal``."""
        self.count(f"{signal.value}_requests")
        try:
            if signal is Signal.TRACES:
                return self._store(signal, "spans", decode.span_rows(request, time.time_ns()))
            if signal is Signal.METRICS:
                return self._store(signal, "metric_points", decode.metric_rows(request, time.time_ns()))
            self.count("log_records_received", decode.count_log_records(request))
            return IngestResult(Outcome.OK, RESPONSE_TYPES[signal]())
        except Exception as exc:  # a receiver must answer, never crash, on any input
            return self.reject(Outcome.INVALID, f"cannot decode {signal.value}: {type(exc).__name__}: {exc}")

    def _store(self, signal: Signal, table: str, decoded: decode.Decoded) -> IngestResult:
        """Write the rows and wait for their commit (see :mod:`zoomer_serve.collector.store`): OK is only
        answered for what is in the file."""
        item = "spans" if signal is Signal.TRACES else "metric_points"
        result = self.store.write(table, decoded.rows)
        if result.status is WriteStatus.REFUSED:
            return self.reject(Outcome.UNAVAILABLE, "collector store queue is full or closing; retry later")
        if result.status is WriteStatus.TIMED_OUT:
            # The rows are still written; a retry may store them twice, which beats acknowledging unwritten rows.
            return self.reject(Outcome.UNAVAILABLE, "collector store did not commit in time; retry later")
        rejected = decoded.rejected + result.failed
        self.count(f"{item}_received", len(decoded.rows) - result.failed)
        response = RESPONSE_TYPES[signal]()
        if rejected:
            self.count(f"{item}_rejected", rejected)
            partial = response.partial_success
            if signal is Signal.TRACES:
                partial.rejected_spans = rejected
            else:
                partial.rejected_data_points = rejected
            messages = [m for m in (decoded.error_message, result.error and f"store refused: {result.error}") if m]
            partial.error_message = "; ".join(messages)
        return IngestResult(Outcome.OK, response)
