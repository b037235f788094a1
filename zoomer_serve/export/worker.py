"""The export worker: turns span records into OTLP spans and RPC metrics and sends them to the collector.

It runs either in a helper process (the default, ``ZOOMER_EXPORT_MODE=process``: the server hands it
record batches over a pipe, so encoding and sending never hold the server's interpreter) or in a thread of
the server process (``thread``). Either way it keeps a bounded queue of record batches; a batch that does
not fit is dropped and counted, never blocking the sender.

The helper process's loop and protocol are in :mod:`zoomer_serve.export.helper` and
:mod:`zoomer_serve.export.frames`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from zoomer_serve.config import ExportConfig, SpanLimits
from zoomer_serve.export.otlp_wire import SpanEncoder
from zoomer_serve.export.rpc_metrics import RpcMetrics
from zoomer_serve.export.transport import make_sender
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.export")
SCOPE_NAME = "zoomer_serve"


@dataclass
class ExportStats:
    """Counters of the export path, in spans unless named otherwise.

    ``records``: records the worker received; ``exported``: spans the collector accepted; ``dropped_export``:
    spans lost to export failures; ``dropped_queue``: sampled spans that did not fit a queue (server side
    included); ``dropped_records``: records (sampled or not) that never reached a worker: their calls are
    missing from the RPC metrics too; ``dropped_too_large``: spans of records too large for a frame to the
    helper (:data:`zoomer_serve.export.frames.MAX_FRAME_BYTES`); ``lost_in_helper``: spans handed to a helper
    process that died before it reported them exported or dropped; ``helper_restarts``: helper processes
    started again after one died; ``unknown``: spans whose outcome no helper reported (it did not answer
    at shutdown: neither counted as exported nor as dropped); ``last_error``: the last export failure.
    """

    records: int = 0
    exported: int = 0
    dropped_export: int = 0
    dropped_queue: int = 0
    dropped_records: int = 0
    dropped_too_large: int = 0
    lost_in_helper: int = 0
    helper_restarts: int = 0
    unknown: int = 0
    last_error: str | None = None

    @property
    def dropped(self) -> int:
        """Every span known to be lost, whatever the reason."""
        return self.dropped_export + self.dropped_queue + self.dropped_too_large + self.lost_in_helper


SPAN_OUTCOMES = ("exported", "dropped_export", "dropped_queue")
"""The :class:`ExportStats` fields that account for the spans a worker received: every span it got ends in one."""


class ExportWorker:
    """Consumes record batches (``put``), encodes sampled spans, exports them in batches of at most
    ``cfg.max_export_batch_size`` every ``cfg.schedule_delay_ms`` (or sooner when a batch is full), and
    aggregates the RPC metrics of every request record, exported every ``cfg.metric_export_interval_ms``
    and at shutdown (see :mod:`zoomer_serve.export.rpc_metrics`)."""

    def __init__(self, cfg: ExportConfig, resource: dict[str, Any], version: str = "0",
                 limits: SpanLimits | None = None) -> None:
        self.cfg = cfg
        self.stats = ExportStats()
        # the server side's own loss counters, cumulative (see zoomer_serve.export.frames): reported with ours
        self.parent_counters: dict[str, int] = {}
        self._resource = resource
        self._version = version
        self._stop = threading.Event()
        # record batches; None stops the thread; an Event asks for a flush of everything before it
        self._queue: queue.Queue[list[tuple[Any, ...]] | threading.Event | None] = queue.Queue(
            maxsize=max(4, cfg.max_queue_size // 16))
        self._encoder = SpanEncoder(resource, SCOPE_NAME, version, limits)
        self._sender = make_sender(cfg, self._stop, "traces")
        self._metric_sender = make_sender(cfg, self._stop, "metrics")
        self._pending: list[bytes] = []
        self._last_flush = time.monotonic()
        self._metrics = RpcMetrics()
        self._metrics_lock = threading.Lock()
        self._metrics_start_ns = time.time_ns()
        self._last_metrics = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="zoomer-export", daemon=True)
        self._logged_failure = False
        self._logged_metrics_failure = False

    def start(self) -> None:
        self._thread.start()

    def put(self, batch: list[tuple[Any, ...]]) -> None:
        """Queue a batch of records without blocking; a full queue drops it (counted)."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.stats.dropped_queue += sum(map(r.exported_spans, batch))
            self.stats.dropped_records += len(batch)

    def flush(self, timeout_s: float) -> bool:
        """Export every span and the metrics of every record put so far, now (not at the next schedule);
        True when that was done within ``timeout_s`` seconds (exported or counted as dropped)."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def _run(self) -> None:
        delay = self.cfg.schedule_delay_ms / 1000
        metric_interval = self.cfg.metric_export_interval_ms / 1000
        while True:
            now = time.monotonic()
            timeout = max(0.0, min(self._last_flush + delay, self._last_metrics + metric_interval) - now)
            try:
                batch = self._queue.get(timeout=timeout)
            except queue.Empty:
                batch = []
            if batch is None:
                return
            if isinstance(batch, threading.Event):
                now = time.monotonic()
                self._flush(now + self.cfg.timeout_ms / 1000)
                self._export_metrics(now + self.cfg.timeout_ms / 1000)
                batch.set()
                continue
            self._ingest(batch)
            now = time.monotonic()
            due = now - self._last_flush >= delay
            if len(self._pending) >= self.cfg.max_export_batch_size or (due and self._pending):
                self._flush(now + self.cfg.timeout_ms / 1000)
            elif due:
                self._last_flush = now
            if now - self._last_metrics >= metric_interval:
                self._export_metrics(now + self.cfg.timeout_ms / 1000)

    def _ingest(self, batch: list[tuple[Any, ...]]) -> None:
        with self._metrics_lock:
            for rec in batch:
                try:
                    self._metrics.record(rec)
                except Exception as exc:  # a malformed record must not stop the exporter
                    logger.warning("zoomer-serve: could not aggregate a request record: %r", exc)
        encode, encode_child = self._encoder.encode_span, self._encoder.encode_child
        for rec in batch:
            self.stats.records += 1
            try:
                if rec[r.R_FLAGS] & r.F_SAMPLED:
                    self._pending.append(encode(rec))
                    for child in rec[r.R_CHILDREN] or ():
                        self._pending.append(encode_child(child))
            except Exception as exc:  # a malformed record must not stop the exporter
                self.stats.dropped_export += 1
                logger.warning("zoomer-serve: could not encode a span record: %r", exc)
            if len(self._pending) >= self.cfg.max_export_batch_size:
                self._flush(time.monotonic() + self.cfg.timeout_ms / 1000)

    def _flush(self, deadline: float) -> None:
        size = self.cfg.max_export_batch_size
        while self._pending:
            chunk, self._pending = self._pending[:size], self._pending[size:]
            if self._stop.is_set() and time.monotonic() >= deadline:
                self.stats.dropped_export += len(chunk)
                continue
            if self._sender.send(self._encoder.encode_request(chunk), deadline):
                self.stats.exported += len(chunk)
            else:
                self.stats.dropped_export += len(chunk)
                self.stats.last_error = self._sender.last_error
                if not self._logged_failure:
                    self._logged_failure = True
                    logger.warning("zoomer-serve: could not export spans to %s (%s); dropping and counting "
                                   "them (logged once)", self.cfg.traces_endpoint, self._sender.last_error)
        self._last_flush = time.monotonic()

    def _counters(self) -> dict[str, dict[tuple[tuple[str, str], ...], int]]:
        return {"otel.sdk.exporter.span.exported": {
            (): self.stats.exported,
            (("error.type", "export_failed"),): self.stats.dropped_export,
            (("error.type", "queue_full"),): self.stats.dropped_queue + self.parent_counters.get("queue_full", 0),
            (("error.type", "too_large"),): self.parent_counters.get("too_large", 0),
            (("error.type", "helper_lost"),): self.parent_counters.get("helper_lost", 0),
        }}

    def _export_metrics(self, deadline: float) -> bool:
        """Send the cumulative metrics once; failures are logged once (the next export carries the totals)."""
        self._last_metrics = time.monotonic()
        with self._metrics_lock:
            payload = self._metrics.encode(self._resource, SCOPE_NAME, self._version, self._metrics_start_ns,
                                           time.time_ns(), self._counters())
        if self._metric_sender.send(payload, deadline):
            return True
        if not self._logged_metrics_failure:
            self._logged_metrics_failure = True
            logger.warning("zoomer-serve: could not export metrics to %s (%s); the next export carries the "
                           "totals (logged once)", self.cfg.metrics_endpoint, self._metric_sender.last_error)
        return False

    def shutdown(self, timeout_s: float) -> ExportStats:
        """Export what is queued, then stop; returns within about ``timeout_s`` seconds whatever the
        collector does. Spans not sent by then are counted as dropped."""
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=max(0.01, timeout_s / 2))
        except queue.Full:
            self._stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        alive = self._thread.is_alive()
        if alive:
            self.stats.dropped_export += len(self._pending)
        else:
            self._drain_queue()  # every record is now counted in the metrics ...
            self._flush(deadline)  # ... and every span in the exporter's own counters
        metrics_done = threading.Thread(target=self._export_metrics, args=(deadline,), daemon=True)
        metrics_done.start()
        metrics_done.join(max(0.0, deadline - time.monotonic()))
        self._sender.close()
        self._metric_sender.close()
        return self.stats

    def _drain_queue(self) -> None:
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(batch, threading.Event):
                batch.set()  # shutdown flushes right after
            elif batch:
                self._ingest(batch)
