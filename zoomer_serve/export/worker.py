"""The export worker: turns span records into OTLP spans and RPC metrics and sends them to the collector.

It runs either in a helper process (the default, ``ZOOMER_EXPORT_MODE=process``: the server hands it
record batches over a pipe, so encoding and sending never hold the server's interpreter) or in a thread of
the server process (``thread``). Either way it keeps a bounded queue of record batches; a batch that does
not fit is dropped and counted, never blocking the sender.

The helper process's loop and protocol are in :mod:`zoomer_serve.export.helper` and
:mod:`zoomer_serve.export.frames`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zoomer_serve import semconv as sc
from zoomer_serve.config import ExportConfig, SpanLimits
from zoomer_serve.export.otlp_wire import FIELD_FRAMING_BYTES, SpanEncoder, request_bytes
from zoomer_serve.export.rpc_metrics import (
    CALL_DROPPED,
    METRIC_POINT_EXPORTED,
    SPAN_EXPORTED,
    MetricsRequestEncoder,
    RpcMetrics,
)
from zoomer_serve.export.transport import Outcome, Sender, make_sender
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.export")
SCOPE_NAME = "zoomer_serve"
SETTLE_S = 0.5
"""Seconds at the end of a shutdown's budget (a quarter of it at most) that the export thread, if still busy
then, is given to count the request it was retrying."""


@dataclass
class ExportStats:
    """Counters of the export path, in spans unless named otherwise.

    ``records``: records the worker received, of which ``calls`` were calls (request records: the others, a
    batch's span or a span made with the OpenTelemetry API, are no call); ``exported``: spans the collector
    accepted; ``dropped_export``:
    spans lost after the worker's queue, for any reason, of which ``dropped_rejected`` the collector rejected in
    a partial success and ``dropped_too_large`` were too large for any export request
    (``ZOOMER_EXPORT_MAX_REQUEST_BYTES`` or the collector's own limit), the rest lost to failed exports;
    ``dropped_queue``: sampled spans that did not fit a queue (server side included); ``dropped_records``: records
    (sampled or not) that never reached a worker, of which ``dropped_calls`` were calls: those are missing from the
    RPC metrics too;
    ``dropped_record_too_large``: spans of records too large for a frame to the helper process
    (:data:`zoomer_serve.export.frames.MAX_FRAME_BYTES`; a request record goes on without them, so its call still
    counts in the RPC metrics); ``records_after_shutdown``: records (requests) that
    ended once shutdown had begun, too late for the last export (their spans are not in ``dropped``);
    ``lost_in_helper``: spans handed to a helper process that
    died holding them, before it sent them (in the pipe, its queue or its pending batch);
    ``records_lost_in_helper``: calls (request records) written to a helper process that died before a metric
    export covering them succeeded: they are missing from the RPC metrics; ``metric_records``: records that the
    last fully accepted export of the RPC metrics covered, of which ``metric_calls`` calls (cumulative; summed
    over helper processes);
    ``helper_restarts``:
    helper processes started again after one died; ``unknown``: spans whose outcome is not known, neither counted
    as exported nor as dropped: those of the export request in flight when the shutdown budget ran out (the
    collector may yet store them), those of the export request a helper process was sending when it died, and
    those of a helper that did not answer at shutdown. ``metric_points_exported`` / ``_rejected`` / ``_dropped``:
    metric data points the collector accepted, rejected in a partial success, or that an export lost for any
    reason (rejected included; the next export carries the cumulative totals again); ``last_error``: the last
    export failure (or record the encoder could not encode).
    """

    records: int = 0
    calls: int = 0
    exported: int = 0
    dropped_export: int = 0
    dropped_queue: int = 0
    dropped_records: int = 0
    dropped_calls: int = 0
    dropped_rejected: int = 0
    dropped_too_large: int = 0
    dropped_record_too_large: int = 0
    lost_in_helper: int = 0
    records_lost_in_helper: int = 0
    metric_records: int = 0
    metric_calls: int = 0
    records_after_shutdown: int = 0
    helper_restarts: int = 0
    unknown: int = 0
    metric_points_exported: int = 0
    metric_points_rejected: int = 0
    metric_points_dropped: int = 0
    last_error: str | None = None

    @property
    def dropped(self) -> int:
        """Every span known to be lost, whatever the reason."""
        return self.dropped_export + self.dropped_queue + self.dropped_record_too_large + self.lost_in_helper


SPAN_OUTCOMES = ("exported", "dropped_export", "dropped_queue", "unknown")
"""The :class:`ExportStats` fields that account for the spans a worker received: every span it got ends in one."""


@dataclass
class _FlushRequest:
    """A flush asked of the export thread: ``done`` is set when it is over, ``ok`` says whether it succeeded
    (see :meth:`ExportWorker.flush`)."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    ok: bool = False
    metrics: bool = True  # False: the spans only (the RPC metrics go with the next export, or the last)


@dataclass
class _Tally:
    """What became of the items (spans or metric points) of one export: accepted, rejected by a partial
    success, too large for any request, or lost to a failed export; ``message`` the last partial success's."""

    accepted: int = 0
    rejected: int = 0
    too_large: int = 0
    failed: int = 0
    message: str = ""

    @property
    def dropped(self) -> int:
        return self.rejected + self.too_large + self.failed


def queue_batches(cfg: ExportConfig) -> int:
    """How many batches (in the helper process: frames, of up to 128 records each) an export worker's queue holds
    before it drops and counts what comes next: ``OTEL_BSP_MAX_QUEUE_SIZE`` / 16, at least 4."""
    return max(4, cfg.max_queue_size // 16)


class ExportWorker:
    """Consumes record batches (``put``), encodes sampled spans, exports them in batches of at most
    ``cfg.max_export_batch_size`` every ``cfg.schedule_delay_ms`` (or sooner when a batch is full), and
    aggregates the RPC metrics of every request record, exported every ``cfg.metric_export_interval_ms``
    and at shutdown (see :mod:`zoomer_serve.export.rpc_metrics`).

    Every request, traces or metrics, is at most ``cfg.max_request_bytes`` long (uncompressed): the spans
    pending reach that many bytes, they are exported; the metric points are packed into as many requests as
    they need. A span too large for any request is dropped and counted (``dropped_too_large``). The collector's
    pushback is handled as the OTLP specification says (see :mod:`zoomer_serve.export.transport` for retries):
    a request refused for its size is sent again as two halves, recursively; a partial success counts its
    rejected spans (``dropped_rejected``) or points (``metric_points_rejected``) and logs its message once.
    Measuring the encoded spans costs about 0.05 µs per span, on 3.1 µs to encode and frame it."""

    def __init__(self, cfg: ExportConfig, resource: dict[str, Any], version: str = "0",
                 limits: SpanLimits | None = None) -> None:
        self.cfg = cfg
        self.stats = ExportStats()
        # the server side's own loss counters, cumulative (see zoomer_serve.export.frames): reported with ours
        self.parent_counters: dict[str, int] = {}
        self._resource = resource
        self._version = version
        self._stop = threading.Event()
        # record batches; None stops the thread; a _FlushRequest asks for a flush of everything before it
        self._queue: queue.Queue[list[tuple[Any, ...]] | _FlushRequest | None] = queue.Queue(
            maxsize=queue_batches(cfg))
        self._encoder = SpanEncoder(resource, SCOPE_NAME, version, limits)
        self._sender = make_sender(cfg, self._stop, "traces")
        self._metric_sender = make_sender(cfg, self._stop, "metrics")
        self._metrics_timeout_s = cfg.otlp("metrics").timeout_ms / 1000  # the traces' is cfg.timeout_ms
        self._pending: list[bytes] = []  # encoded spans waiting for the next export
        self._received = 0  # spans of the batches the queue took: each ends exported, dropped or unknown
        self._losses_at_flush = 0  # _span_losses() when the last flush was over
        self._in_flight = 0  # spans of the request being sent, not yet counted
        self._settle_lock = threading.Lock()  # counting a request's spans against shutdown's final count
        self._abandoned = False  # shutdown counted what was left: the export thread counts and sends no more
        self._pending_bytes = 0  # their total length
        self._span_room = cfg.max_request_bytes - self._encoder.request_overhead  # for spans and their framing
        self._last_flush = time.monotonic()
        self._metrics = RpcMetrics(size_metrics=cfg.semconv_rpc == "dup")
        self._status_rename = cfg.semconv_rpc != "default"
        self._metrics_encoder = MetricsRequestEncoder(resource, SCOPE_NAME, version)
        self._metrics_lock = threading.Lock()
        self._metrics_start_ns = time.time_ns()
        self._last_metrics = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="zoomer-export", daemon=True)
        self._logged: set[str] = set()
        # called on the export thread after each turn of its loop; returns the seconds after which it wants to be
        # called again even if nothing arrives (None: no such wish). The helper process reports its progress so.
        self.on_turn: Callable[[], float | None] | None = None
        # called on the export thread with the spans of an export request just before it is sent, and with 0 once
        # its outcome is counted: the helper process reports both, so that what it may have sent is known.
        self.on_export: Callable[[int], None] | None = None
        # called on the export thread once an export of the RPC metrics was accepted in full (``stats.metric_records``
        # just grew): the helper process reports it at once, so that a server that finds it dead knows which calls
        # the metrics in the collector hold.
        self.on_metrics: Callable[[], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def put(self, batch: list[tuple[Any, ...]]) -> None:
        """Queue a batch of records without blocking; a full queue drops it (counted)."""
        spans = sum(map(r.exported_spans, batch)) if self.cfg.traces else 0
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.stats.dropped_queue += spans
            self.stats.dropped_records += len(batch)
            self.stats.dropped_calls += r.count_calls(batch)
        else:
            self._received += spans

    def flush(self, timeout_s: float, metrics: bool = True) -> bool:
        """Export every span and the metrics of every record put so far, now (not at the next schedule), and
        wait up to ``timeout_s`` seconds. True when the flush succeeded: no span was lost since the previous
        flush (refused by the collector, rejected in a partial success, too large, or not let into the queue)
        and the collector accepted every metric point sent now. A partial success that rejects nothing (a
        warning message only) is a success. False as well when the time ran out. Losses are counted either way
        (:class:`ExportStats`). ``metrics=False``: the spans only (see :meth:`request_flush`)."""
        request = self.request_flush(timeout_s, metrics)
        return request is not None and request.done.wait(timeout_s) and request.ok

    def request_flush(self, timeout_s: float, metrics: bool = True) -> _FlushRequest | None:
        """Queue a flush of everything put so far, behind it, and return it without waiting for it (its
        ``done`` is set when it is over, ``ok`` is :meth:`flush`'s answer); None when the queue had no room
        within ``timeout_s`` seconds. ``metrics=False``: the spans only (shutdown's flushes, whose last export
        sends the RPC metrics: their points are cumulative, one export at the end says it all)."""
        request = _FlushRequest(metrics=metrics)
        try:
            self._queue.put(request, timeout=timeout_s)
        except queue.Full:
            return None
        return request

    def _span_losses(self) -> int:
        """Spans this worker has counted as lost so far (any reason)."""
        return self.stats.dropped_export + self.stats.dropped_queue

    def _answer_flush(self, request: _FlushRequest) -> None:
        """Flush on the export thread, then tell the caller whether anything was lost since the last flush."""
        now = time.monotonic()
        self._flush(now + self.cfg.timeout_ms / 1000)
        metrics_ok = self._export_metrics(now + self._metrics_timeout_s) if request.metrics else True
        losses = self._span_losses()
        request.ok = metrics_ok and losses == self._losses_at_flush
        self._losses_at_flush = losses
        request.done.set()

    def _run(self) -> None:
        delay = self.cfg.schedule_delay_ms / 1000
        metric_interval = self.cfg.metric_export_interval_ms / 1000
        turn_wait: float | None = None
        while True:
            if self.on_turn is not None:
                turn_wait = self.on_turn()
            now = time.monotonic()
            timeout = max(0.0, min(self._last_flush + delay, self._last_metrics + metric_interval) - now)
            if turn_wait is not None:
                timeout = min(timeout, max(0.0, turn_wait))
            try:
                batch = self._queue.get(timeout=timeout)
            except queue.Empty:
                batch = []
            if batch is None:
                return
            if isinstance(batch, _FlushRequest):
                self._answer_flush(batch)
                continue
            self._ingest(batch)
            now = time.monotonic()
            due = now - self._last_flush >= delay
            if len(self._pending) >= self.cfg.max_export_batch_size or (due and self._pending):
                self._flush(now + self.cfg.timeout_ms / 1000)
            elif due:
                self._last_flush = now
            if now - self._last_metrics >= metric_interval:
                self._export_metrics(now + self._metrics_timeout_s)

    def _ingest(self, batch: list[tuple[Any, ...]]) -> None:
        if self._status_rename:
            for rec in batch:
                _opt_in_names(rec[r.R_ATTRS], self.cfg.semconv_rpc)
        with self._metrics_lock:
            for rec in batch:
                try:
                    self._metrics.record(rec)
                except Exception as exc:  # a malformed record must not stop the exporter
                    logger.warning("zoomer-serve: could not aggregate a request record: %r", exc)
        encode, encode_child, scoped = self._encoder.encode_span, self._encoder.encode_child, self._encoder.scoped
        encode_phase, phase_entry = self._encoder.encode_phase, r.PHASE_ENTRY_LEN
        pending = self._pending
        max_spans, max_bytes = self.cfg.max_export_batch_size, self.cfg.max_request_bytes
        sampled = r.F_SAMPLED if self.cfg.traces else 0  # OTEL_TRACES_EXPORTER=none: no span is encoded
        for rec in batch:
            self.stats.records += 1
            if rec[r.R_FLAGS] & r.F_REQUEST:
                self.stats.calls += 1
            before = len(pending)
            try:
                if rec[r.R_FLAGS] & sampled:
                    span = scoped(encode(rec), rec)
                    pending.append(span)
                    self._pending_bytes += len(span)
                    for child in rec[r.R_CHILDREN] or ():
                        span = encode_phase(rec, child) if len(child) == phase_entry else encode_child(child)
                        pending.append(span)
                        self._pending_bytes += len(span)
            except Exception as exc:  # a malformed record must not stop the exporter: its spans are dropped
                self._pending_bytes -= sum(map(len, pending[before:]))
                del pending[before:]
                self.stats.dropped_export += r.exported_spans(rec)
                self.stats.last_error = f"could not encode a span record: {exc!r}"
                logger.warning("zoomer-serve: could not encode a span record: %r", exc)
            if len(pending) >= max_spans or self._pending_bytes >= max_bytes:
                self._flush(time.monotonic() + self.cfg.timeout_ms / 1000)

    def _flush(self, deadline: float) -> None:
        """Export every pending span: requests of at most ``max_export_batch_size`` spans and
        ``max_request_bytes`` bytes, each delivered by :meth:`_deliver` until ``deadline``."""
        while self._pending:
            with self._settle_lock:
                if self._stop.is_set():  # a shutdown past its budget: it counts what is still pending
                    return
                chunk = self._take_request()
                self._in_flight = len(chunk)
            if chunk:
                self._announce(len(chunk))
                tally = self._deliver(self._sender, self._encoder.encode_request, chunk, deadline)
                with self._settle_lock:
                    self._in_flight = 0
                    if not self._abandoned:
                        self._count_spans(tally)
                self._announce(0)
        self._pending_bytes = 0
        self._last_flush = time.monotonic()

    @property
    def in_flight(self) -> int:
        """Spans of the export request being sent now, not yet counted (0: none)."""
        return self._in_flight

    def _announce(self, in_flight: int) -> None:
        """Tell :attr:`on_export` how many spans are now in flight (0: none, their outcome is counted)."""
        if self.on_export is not None:
            self.on_export(in_flight)

    def _take_request(self) -> list[bytes]:
        """Remove the spans of the next request from the front of the pending list and return them. A first
        span too large for any request is removed and counted instead (an empty list is returned)."""
        pending, room = self._pending, self._span_room
        chunk = pending[:self.cfg.max_export_batch_size]
        if sum(map(len, chunk)) + FIELD_FRAMING_BYTES * len(chunk) > room or any(type(s) is not bytes for s in chunk):
            total = n = 0  # rare (or spans of other scopes, each with its ScopeSpans): walk to where it is full
            for span in chunk:
                total += request_bytes(span)
                if total > room:
                    break
                n += 1
            if n == 0:
                del pending[0]
                self._count_spans(_Tally(too_large=1), len(chunk[0]))
                return []
            chunk = chunk[:n]
        del pending[:len(chunk)]
        return chunk

    def _deliver(self, sender: Sender, encode: Callable[[list[Any]], bytes], items: list[Any],
                 deadline: float, tally: _Tally | None = None) -> _Tally:
        """Send ``items`` (spans or metric points) as one request; when it is refused as too large (HTTP 413,
        gRPC RESOURCE_EXHAUSTED about its size), send each half the same way: a single item refused alone is
        too large. Nothing is sent once ``deadline`` has passed. Returns the tally of all items."""
        tally = _Tally() if tally is None else tally
        if time.monotonic() >= deadline:
            tally.failed += len(items)
            return tally
        try:
            result = sender.send(encode(items), deadline)
        except Exception as exc:  # a sender must not stop the exporter: the items are counted as failed
            sender.last_error = f"export error: {exc!r}"
            tally.failed += len(items)
            return tally
        if result.outcome is Outcome.ACCEPTED:
            rejected = min(result.rejected, len(items))
            tally.accepted += len(items) - rejected
            tally.rejected += rejected
            tally.message = result.message or tally.message
        elif result.outcome is Outcome.TOO_LARGE and len(items) > 1:
            half = len(items) // 2
            self._deliver(sender, encode, items[:half], deadline, tally)
            self._deliver(sender, encode, items[half:], deadline, tally)
        elif result.outcome is Outcome.TOO_LARGE:
            tally.too_large += 1
        else:
            tally.failed += len(items)
        return tally

    def _count_spans(self, tally: _Tally, span_bytes: int = 0) -> None:
        """Add one export's span tally to the stats and log each kind of loss once."""
        stats = self.stats
        stats.exported += tally.accepted
        stats.dropped_export += tally.dropped
        stats.dropped_rejected += tally.rejected
        stats.dropped_too_large += tally.too_large
        endpoint = self.cfg.traces_endpoint
        if tally.failed:
            stats.last_error = self._sender.last_error
            self._log_once("span-failed", "zoomer-serve: could not export spans to %s (%s); dropping and counting "
                           "them (logged once)", endpoint, self._sender.last_error)
        if tally.message:
            self._log_once("span-partial", "zoomer-serve: the collector at %s rejected %d spans: %s (rejected spans "
                           "are dropped and counted; logged once)", endpoint, tally.rejected, tally.message)
        if tally.too_large:
            size = f"{span_bytes} bytes" if span_bytes else "larger than the collector accepts"
            self._log_once("span-too-large", "zoomer-serve: a span (%s) does not fit an export request to %s "
                           "(ZOOMER_EXPORT_MAX_REQUEST_BYTES=%d, and the collector's own limit); dropping and "
                           "counting such spans (logged once)", size, endpoint, self.cfg.max_request_bytes)

    def _log_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message, *args)

    def _counters(self) -> dict[str, dict[tuple[tuple[str, str], ...], int]]:
        """The exporter's own counters (see :mod:`zoomer_serve.export.rpc_metrics`), by ``error.type``; the
        server side's losses (``parent_counters``) are added to ours."""
        s, parent = self.stats, self.parent_counters
        return {
            SPAN_EXPORTED: {
                (): s.exported + parent.get("exported", 0),
                (("error.type", "export_failed"),): s.dropped_export - s.dropped_rejected - s.dropped_too_large
                + parent.get("export_failed", 0),
                (("error.type", "rejected"),): s.dropped_rejected + parent.get("rejected", 0),
                (("error.type", "too_large"),): s.dropped_too_large + parent.get("too_large", 0),
                (("error.type", "queue_full"),): s.dropped_queue + parent.get("queue_full", 0),
                (("error.type", "helper_lost"),): parent.get("helper_lost", 0),
            },
            METRIC_POINT_EXPORTED: {
                (): s.metric_points_exported,
                (("error.type", "export_failed"),): s.metric_points_dropped - s.metric_points_rejected,
                (("error.type", "rejected"),): s.metric_points_rejected,
            },
            CALL_DROPPED: {
                (("error.type", "queue_full"),): s.dropped_calls + parent.get("calls_queue_full", 0),
                (("error.type", "too_large"),): parent.get("calls_too_large", 0),
                (("error.type", "helper_lost"),): parent.get("calls_helper_lost", 0),
            },
        }

    def _export_metrics(self, deadline: float) -> bool:
        """Send the cumulative metrics once, in requests of at most ``max_request_bytes``; failures are logged
        once (the next export carries the totals). True when every point was accepted."""
        self._last_metrics = time.monotonic()
        if not self.cfg.metrics:  # OTEL_METRICS_EXPORTER=none
            return True
        with self._metrics_lock:
            points = self._metrics.data_points(self._metrics_start_ns, time.time_ns(), self._counters())
            covered = self.stats.records  # every record aggregated so far is in these points
            covered_calls = self.stats.calls
        requests, too_large = self._metrics_encoder.pack(points, self.cfg.max_request_bytes)
        tally = _Tally(too_large=too_large)
        for request in requests:
            self._deliver(self._metric_sender, self._metrics_encoder.encode_request, request, deadline, tally)
        stats, endpoint = self.stats, self.cfg.metrics_endpoint
        stats.metric_points_exported += tally.accepted
        stats.metric_points_rejected += tally.rejected
        stats.metric_points_dropped += tally.dropped
        if tally.failed:
            why = self._metric_sender.last_error or "no time left in the export budget"
            self._log_once("metrics-failed", "zoomer-serve: could not export metrics to %s (%s); the next export "
                           "carries the totals (logged once)", endpoint, why)
        if tally.message:
            self._log_once("metrics-partial", "zoomer-serve: the collector at %s rejected %d metric data points: %s "
                           "(counted; logged once)", endpoint, tally.rejected, tally.message)
        if tally.too_large:
            self._log_once("metrics-too-large", "zoomer-serve: %d metric data points do not fit an export request "
                           "to %s (ZOOMER_EXPORT_MAX_REQUEST_BYTES=%d, and the collector's own limit); they are left "
                           "out and counted (logged once)", tally.too_large, endpoint, self.cfg.max_request_bytes)
        if tally.dropped == 0 and covered > stats.metric_records:
            stats.metric_records = covered
            stats.metric_calls = covered_calls
            if self.on_metrics is not None:
                self.on_metrics()
        return tally.dropped == 0

    def shutdown(self, timeout_s: float) -> ExportStats:
        """Export what is queued, then stop; returns within about ``timeout_s`` seconds whatever the collector
        does. Every span received ends in a counter: spans not sent by then are counted as dropped, those of a
        request still in flight (a collector that does not answer) as ``unknown``. Returns the final counters (a copy when the export thread was still busy: what it does
        afterwards is no longer counted, and it sends no new request)."""
        deadline = time.monotonic() + timeout_s
        settle_s = min(SETTLE_S, timeout_s / 4)  # the end of the budget kept for _abandon
        try:
            self._queue.put(None, timeout=max(0.01, timeout_s / 2))
        except queue.Full:
            self._stop.set()
        self._thread.join(max(0.0, deadline - settle_s - time.monotonic()))
        if self._thread.is_alive():
            stats = self._abandon(settle_s)
        else:
            self._drain_queue()  # every record is now counted in the metrics ...
            self._flush(deadline)  # ... and every span in the exporter's own counters (retrying until deadline)
            stats = self.stats
        metrics_done = threading.Thread(target=self._export_metrics, args=(deadline,), daemon=True)
        metrics_done.start()
        metrics_done.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._sender.close()
        self._metric_sender.close()
        return stats

    def _abandon(self, settle_s: float) -> ExportStats:
        """The export thread is still busy at the end of the budget (retrying, or waiting on a collector that
        does not answer): stop its retries, give it ``settle_s`` to count the request it was sending, then
        count everything else it received: the request still in flight as ``unknown``, the rest (queued,
        being encoded, pending) as dropped. Returns those counters, as of now."""
        self._stop.set()  # the export thread gives up its retries and sends no new request
        self._thread.join(settle_s)
        with self._settle_lock:
            self._abandoned = True
            stats = dataclasses.replace(self.stats)
            in_flight = self._in_flight
        unsettled = self._received - stats.exported - stats.dropped_export
        stats.unknown += in_flight
        stats.dropped_export += max(0, unsettled - in_flight)
        if unsettled > in_flight and not stats.last_error:
            stats.last_error = "the shutdown budget ran out before these spans could be sent"
        return stats

    def _drain_queue(self) -> None:
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(batch, _FlushRequest):
                batch.done.set()  # shutdown flushes right after (the flush asked for is not answered as done)
            elif batch:
                self._ingest(batch)


def _opt_in_names(attrs: dict[str, Any] | None, opt_in: str) -> None:
    """The status attribute under ``OTEL_SEMCONV_STABILITY_OPT_IN`` (:func:`zoomer_serve.semconv.status_attributes`):
    done here, off the request path, for every adapter at once."""
    if not attrs or sc.RPC_RESPONSE_STATUS_CODE not in attrs:
        return
    status = attrs.pop(sc.RPC_RESPONSE_STATUS_CODE) if opt_in == "next" else attrs[sc.RPC_RESPONSE_STATUS_CODE]
    attrs.update(sc.status_attributes(status, "next" if opt_in == "next" else "dup"))
