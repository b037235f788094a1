"""The report's data: plain dataclasses, all durations in milliseconds, rates per second."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PhaseStats:
    """One ``zoomer.phase`` under the request spans of a method.

    Attributes:
        phase: the phase name (the ``zoomer.phase`` attribute, e.g. "forward").
        count: phase spans seen.
        mean_ms: mean phase duration, ms.
        total_ms: summed phase duration, ms.
        share: summed phase duration / summed duration of all the method's requests (0..1; phases that
            overlap or run past their parent can push the sum of shares over 1).
    """

    phase: str
    count: int
    mean_ms: float
    total_ms: float
    share: float


@dataclass(frozen=True)
class BatchingStats:
    """The requests of one method (or of all a service's methods) that ran in batches.

    Every figure counts each batched message: a unary request queues one, a stream one per message it queued
    (it joins one batch per message). The source is each request's ``queue`` child spans (``zoomer.phase`` =
    ``queue``, one per message, carrying ``zoomer.batch.id``; their duration is the message's queue wait, ns in the
    store), not the request span's ``zoomer.batch.*`` attributes, which for a stream are its last message's only.

    Attributes:
        requests: requests with at least one batched message.
        messages: batched messages (``queue`` child spans; equal to ``requests`` for unary methods).
        batches: distinct ``zoomer.batch.id`` over all those messages (a batch holding requests of two methods
            counts under each; the service's total row counts it once).
        mean_batch_size: mean size of the batch each message ran in (the batch span's ``zoomer.batch.size``,
            requests per batch as a message sees it).
        queue_wait_p50_ms / queue_wait_p99_ms / queue_wait_mean_ms: the messages' queue waits, ms.
        queue_wait_share: summed queue wait of all messages / summed duration of these requests (0..1). The
            Phases table's ``queue`` share sums the same spans over all the method's requests, batched or not
            (a request rejected before the queue adds time there and no wait), so it is equal or lower.
    """

    requests: int
    messages: int
    batches: int
    mean_batch_size: float
    queue_wait_p50_ms: float
    queue_wait_p99_ms: float
    queue_wait_mean_ms: float
    queue_wait_share: float


@dataclass(frozen=True)
class ServiceBatching:
    """:class:`BatchingStats` over all the batched methods of one service (``service_name``): its ``batches`` is
    the number of batches its requests ran in, each once (the batch spans of its queues with a traced member)."""

    service_name: str
    batching: BatchingStats


COUNTS_FROM_METRIC = "rpc.server.call.duration"
"""``counts_from`` when the counts are the calls the ``rpc.server.call.duration`` metric counted (every call)."""
COUNTS_FROM_SPANS = "spans"
"""``counts_from`` when the counts are SERVER spans (the store has no such metric for the method)."""
COUNTS_FROM_MIXED = "mixed"
"""``Report.counts_from`` when some methods are counted by the metric and others by their spans."""


@dataclass(frozen=True)
class MethodStats:
    """Requests of one service and method: counts from the ``rpc.server.call.duration`` metric when the store has
    it (every call, sampled or not), latency figures from the SERVER spans (a sample under a head sampler).

    Attributes:
        service_name: resource ``service.name`` ("unknown_service" when absent).
        method: attribute ``rpc.method`` (``rpc.service/rpc.method`` for the older conventions), else the
            span name (:func:`zoomer_serve.semconv.method_sql`).
        count: requests: the calls the ``rpc.server.call.duration`` metric counted when ``counts_from`` says so
            (:mod:`zoomer_serve.report.calls`), else the SERVER spans.
        rate_per_s: ``count`` per second over the window of this method's spans (first start to last end; None
            when that window is shorter than ``build.MIN_RATE_WINDOW_S``, 1 s, or there is no span).
        error_count / error_rate: failed requests, from the same source as ``count``: spans whose status is
            ERROR, as the instrumentation that recorded them set it (:func:`zoomer_serve.semconv.error_sql`), or
            the metric's calls judged by the same rule (:func:`zoomer_serve.semconv.metric_error_sql`); rate =
            error_count / count. By the RPC semantic conventions only server failures are ERROR on a server span
            (gRPC UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS; a Thrift
            TApplicationException or an undeclared exception): INVALID_ARGUMENT, NOT_FOUND, CANCELLED ... and
            Thrift exceptions declared in the IDL are not errors; they are counted in ``status_counts``.
        status_counts: requests per status code, every code, from the same source as ``count``
            (``rpc.response.status_code``, else the span status code: :func:`zoomer_serve.semconv.status_sql`).
        p50_ms / p90_ms / p99_ms: latency percentiles of the spans, ms (linear interpolation between samples);
            None when the method has no span.
        max_ms / mean_ms: of the spans, ms; None when the method has no span.
        phases: phase breakdown of the spans, largest share first.
        unattributed_share: 1 - sum of phase shares (time not covered by any phase); None without phases.
        batching: queue wait and batch size of the requests that ran in batches; None when none did.
        spans: SERVER spans of the method: what the latency, phase and batching figures rest on.
        counts_from: where ``count``, the rate, the errors and ``status_counts`` come from:
            :data:`COUNTS_FROM_METRIC` or :data:`COUNTS_FROM_SPANS`.
        span_sample_ratio: ``spans / count`` when the counts come from the metric (below 1 when the spans are a
            sample: the sampling ratio seen); None when the counts are the spans.
    """

    service_name: str
    method: str
    count: int
    rate_per_s: float | None
    error_count: int
    error_rate: float
    status_counts: dict[str, int]
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    mean_ms: float | None
    phases: list[PhaseStats] = field(default_factory=list)
    unattributed_share: float | None = None
    batching: BatchingStats | None = None
    spans: int = 0
    counts_from: str = COUNTS_FROM_SPANS
    span_sample_ratio: float | None = None


@dataclass(frozen=True)
class SlowTrace:
    """One of the slowest traces: its longest SERVER span. ``duration_ms`` in ms."""

    trace_id: str
    service_name: str
    method: str
    duration_ms: float
    status: str


@dataclass
class ExportLosses:
    """What the exporters of the processes that wrote a store counted as lost on the way to it, from their own
    counters in the store (:func:`zoomer_serve.report.calls.read_losses`).

    Attributes:
        spans: spans lost, per ``error.type`` (``otel.sdk.exporter.span.exported`` with ``error.type``:
            ``queue_full``, ``too_large``, ``helper_lost``, ``export_failed``, ``rejected``).
        calls: calls missing from ``rpc.server.call.duration`` (and the other call metrics), hence from the
            request counts, per ``error.type`` (``zoomer.exporter.call.dropped``: ``queue_full``, ``too_large``,
            ``helper_lost``).
    """

    spans: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def spans_lost(self) -> int:
        return sum(self.spans.values())

    @property
    def calls_missing(self) -> int:
        return sum(self.calls.values())


@dataclass(frozen=True)
class Report:
    """Everything ``zoomer-serve report`` shows.

    Attributes:
        store_path: the DuckDB store read.
        total_requests / total_errors: over all methods (``MethodStats.count`` and ``.error_count``: the calls
            the ``rpc.server.call.duration`` metric counted where the store has it, else SERVER spans).
        window_start_ns / window_end_ns: first request span start and last request span end, Unix epoch ns
            (None when there are no request spans).
        methods: per (service, method), sorted by service then method.
        slowest: the slowest traces, slowest first (of the spans).
        batching_totals: per service with batched requests, its batching figures over all methods.
        total_spans: SERVER spans over all methods: the sample the latency, phase, batching and slowest-trace
            figures rest on.
        counts_from: where the counts come from: :data:`COUNTS_FROM_METRIC` (every method),
            :data:`COUNTS_FROM_SPANS` (no method has the metric: the store has none, as with metrics off or
            another instrumentation's data) or :data:`COUNTS_FROM_MIXED`.
        span_sample_ratio: over the methods counted by the metric, their spans / their calls (the sampling
            ratio seen; 1.0 when every call has its span); None when no method is.
        notes: what the reader should know about the counts (a method whose metric counted fewer calls than it
            has spans is counted by its spans, and said so here; calls missing from the metric and spans lost
            on the way to the store, with their reasons, from ``export_losses``).
        export_losses: what the exporters counted as lost on the way to the store (:class:`ExportLosses`;
            ``--json``: ``{"spans": {error.type: n}, "calls": {error.type: n}}``, only non-zero counts).
    """

    store_path: str
    total_requests: int
    total_errors: int
    window_start_ns: int | None
    window_end_ns: int | None
    methods: list[MethodStats]
    slowest: list[SlowTrace]
    batching_totals: list[ServiceBatching] = field(default_factory=list)
    total_spans: int = 0
    counts_from: str = COUNTS_FROM_SPANS
    span_sample_ratio: float | None = None
    notes: list[str] = field(default_factory=list)
    export_losses: ExportLosses = field(default_factory=ExportLosses)

    @property
    def empty(self) -> bool:
        """True when the store holds no request: no request (SERVER) span and no call in the metric."""
        return self.total_requests == 0 and self.total_spans == 0

    @property
    def sampled(self) -> bool:
        """True when the spans are a sample of the calls (fewer spans than calls counted by the metric)."""
        return self.span_sample_ratio is not None and self.span_sample_ratio < 1.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (nested dataclasses become dicts, lists stay lists)."""
        return asdict(self)
