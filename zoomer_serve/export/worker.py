"""The export worker: turns span records into OTLP spans and RPC metrics and sends them to the collector.

It runs either in a helper process (the default, ``ZOOMER_EXPORT_MODE=process``: the server hands it
record batches over a pipe, so encoding and sending never hold the server's interpreter) or in a thread of
the server process (``thread``). Either way it keeps a bounded queue of record batches; a batch that does
not fit is dropped and counted, never blocking the sender.

Protocol of the helper process (``python -m zoomer_serve.export.helper``): the configuration is JSON in
the environment variable ``ZOOMER_WORKER_CONFIG``; stdin carries frames of a 4-byte big-endian length and a
pickled ``(parent_dropped_total, [record, ...])``, and last ``(SHUTDOWN_FRAME, budget_s)``; stdout carries JSON lines: ``{"event": "ready"}`` once
started, ``{"event": "stats", ...}`` when stdin closes and everything is flushed (or the deadline passed).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from zoomer_serve.config import ExportConfig
from zoomer_serve.export.otlp_wire import SpanEncoder
from zoomer_serve.export.rpc_metrics import RpcMetrics
from zoomer_serve.export.transport import make_sender
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.export")
_FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024
SCOPE_NAME = "zoomer_serve"
SHUTDOWN_FRAME = -1  # a frame ``(SHUTDOWN_FRAME, budget_s)``: flush within budget_s seconds and exit


@dataclass
class ExportStats:
    """Counters of the export path: ``records`` received by the worker, ``exported`` spans the collector
    accepted, ``dropped_export`` spans lost to export failures, ``dropped_queue`` sampled spans that did not fit
    a queue (server side included), ``dropped_records`` records (sampled or not) that did not fit a queue:
    their calls are missing from the RPC metrics too; ``last_error`` the last export failure."""

    records: int = 0
    exported: int = 0
    dropped_export: int = 0
    dropped_queue: int = 0
    dropped_records: int = 0
    last_error: str | None = None

    @property
    def dropped(self) -> int:
        return self.dropped_export + self.dropped_queue


class ExportWorker:
    """Consumes record batches (``put``), encodes sampled spans, exports them in batches of at most
    ``cfg.max_export_batch_size`` every ``cfg.schedule_delay_ms`` (or sooner when a batch is full), and
    aggregates the RPC metrics of every request record, exported every ``cfg.metric_export_interval_ms``
    and at shutdown (see :mod:`zoomer_serve.export.rpc_metrics`)."""

    def __init__(self, cfg: ExportConfig, resource: dict[str, Any], version: str = "0") -> None:
        self.cfg = cfg
        self.stats = ExportStats()
        self.parent_dropped = 0
        self._resource = resource
        self._version = version
        self._stop = threading.Event()
        self._queue: queue.Queue[list[tuple[Any, ...]] | None] = queue.Queue(
            maxsize=max(4, cfg.max_queue_size // 16))
        self._encoder = SpanEncoder(resource, SCOPE_NAME, version)
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
            (("error.type", "queue_full"),): self.stats.dropped_queue + self.parent_dropped,
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
            if batch:
                self._ingest(batch)


def _read_exact(stream: Any, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Entry point of the helper process (see the module docstring)."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        os.nice(5)
    except OSError:
        pass
    spec = json.loads(os.environ["ZOOMER_WORKER_CONFIG"])
    worker = ExportWorker(ExportConfig(**spec["export"]), spec["resource"], spec.get("version", "0"))
    worker.start()
    _emit({"event": "ready", "pid": os.getpid()})
    stdin = sys.stdin.buffer
    budget_s = spec["export"]["timeout_ms"] / 1000  # when stdin just closes (the parent died)
    while True:
        header = _read_exact(stdin, _FRAME_HEADER.size)
        if header is None:
            break
        (length,) = _FRAME_HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            logger.error("zoomer-serve exporter: frame of %d bytes exceeds the limit; stopping", length)
            break
        payload = _read_exact(stdin, length)
        if payload is None:
            break
        parent_dropped, batch = pickle.loads(payload)
        if parent_dropped == SHUTDOWN_FRAME:  # the parent's last frame: the time left for the shutdown, s
            budget_s = float(batch)
            break
        worker.parent_dropped = parent_dropped
        worker.put(batch)
    stats = worker.shutdown(budget_s)
    _emit({"event": "stats", **asdict(stats)})
    sys.stdout.flush()
    os._exit(0)  # do not wait for SDK threads still retrying against an unreachable collector


if __name__ == "__main__":
    main()
