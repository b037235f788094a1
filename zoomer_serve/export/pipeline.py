"""The export pipeline on the server side: a bounded queue that the request path appends to, and a
writer thread that moves records in batches to the export worker.

The request path calls :meth:`ExportPipeline.submit`: one length check and one ``deque.append``
(no lock, no system call, no encoding). When the queue holds ``max_queue_size`` records, new records are
dropped and counted (``dropped``), never blocking a request. A writer thread wakes every 500 ms (or when the
queue is half full), takes everything queued, and either pickles it into frames of at most 128 records on the
helper process's stdin (``mode="process"``) or hands it to an in-process
:class:`~zoomer_serve.export.worker.ExportWorker` thread (``mode="thread"``).

Why 500 ms: each hand-off has a fixed cost (waking the writer here and the helper there, cold caches), about
250 µs of helper CPU measured on the demo model server; at 50 ms that was about 40 µs per request at 110
requests/s, at 500 ms about 5 (benchmarks/RESULTS.md). Spans still reach the collector well within the
export schedule delay (``OTEL_BSP_SCHEDULE_DELAY``, 5 s by default). Why 128-record frames, each written
before the next is pickled: pickling holds the interpreter lock for the whole call (about 2.6 µs per record),
and a thread waiting for the lock only forces a switch after ``sys.getswitchinterval()`` (5 ms); the write in
between releases the lock, so request threads wait at most about one frame's pickling (0.3 ms).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from zoomer_serve.config import ExportConfig
from zoomer_serve.export.worker import SHUTDOWN_FRAME, ExportStats, ExportWorker
from zoomer_serve.processes import wait_for_event
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.export")
_FRAME_HEADER = struct.Struct(">I")
_WRITER_PERIOD_S = 0.5
_FRAME_RECORDS = 128  # records per pickled frame: bounds how long one pickle.dumps holds the interpreter
_READY_TIMEOUT_S = 30.0


class ExportPipeline:
    """Bounded, non-blocking hand-off of span records from the request path to the export worker.

    Args:
        cfg: export settings (mode, queue size, endpoint ...).
        resource: resource attributes of every exported span and metric.
        version: instrumentation scope version.
    Raises:
        RuntimeError from :meth:`start` when the helper process does not come up (mode ``process``).
    """

    def __init__(self, cfg: ExportConfig, resource: dict[str, Any], version: str = "0") -> None:
        self.cfg = cfg
        self.resource = resource
        self.version = version
        self.dropped = 0  # sampled spans dropped on the server side (queue full or worker gone)
        self.dropped_records = 0  # records dropped there, sampled or not (their calls miss the RPC metrics)
        self.submitted = 0  # sampled spans handed to the worker
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._max = cfg.max_queue_size
        self._wake_at = max(1, cfg.max_queue_size // 2)
        self._wake = threading.Event()
        self._closing = False
        self._writer: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._worker: ExportWorker | None = None
        self._broken = False
        self.final_stats: ExportStats | None = None

    # -- request path -------------------------------------------------------------------------------
    def submit(self, record: tuple[Any, ...]) -> None:
        """Queue one record; never blocks, never raises. Drops (and counts) it when the queue is full."""
        q = self._queue
        n = len(q)
        if n >= self._max or self._closing:
            self.dropped += r.exported_spans(record)
            self.dropped_records += 1
            return
        q.append(record)
        if n == self._wake_at:
            self._wake.set()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.mode == "process":
            self._start_process()
        elif self.cfg.mode == "thread":
            self._worker = ExportWorker(self.cfg, self.resource, self.version)
            self._worker.start()
        self._writer = threading.Thread(target=self._write_loop, name="zoomer-export-writer", daemon=True)
        self._writer.start()

    def _start_process(self) -> None:
        spec = {"export": asdict(self.cfg), "resource": self.resource, "version": self.version}
        env = dict(os.environ, ZOOMER_WORKER_CONFIG=json.dumps(spec))
        self._proc = subprocess.Popen(  # a subprocess (fork+exec), never a bare fork: grpcio is not fork-safe
            [sys.executable, "-m", "zoomer_serve.export.helper"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, close_fds=True)
        if wait_for_event(self._proc, "ready", _READY_TIMEOUT_S) is None:
            self._proc.kill()
            raise RuntimeError("zoomer-serve: the export helper process did not start within "
                               f"{_READY_TIMEOUT_S:.0f} s (python -m zoomer_serve.export.helper; see its stderr)")

    @property
    def helper_pid(self) -> int | None:
        """The pid of the export helper process (mode ``process``), else None."""
        return self._proc.pid if self._proc is not None else None

    def _write_loop(self) -> None:
        while not self._closing:
            self._wake.wait(_WRITER_PERIOD_S)
            self._wake.clear()
            self._drain_once()
        self._drain_once()

    def _drain_once(self) -> None:
        q = self._queue
        if not q:
            return
        batch = []
        popleft = q.popleft
        try:
            while True:
                batch.append(popleft())
        except IndexError:
            pass
        spans = sum(map(r.exported_spans, batch))
        self.submitted += spans
        if self._broken:
            self._lose(spans, len(batch))
            return
        try:
            if self._worker is not None:
                self._worker.put(batch)
            elif self._proc is not None and self._proc.stdin is not None:
                stdin = self._proc.stdin
                for frame in self._frames(batch):
                    stdin.write(frame)
                    stdin.flush()  # a system call: request threads waiting for the interpreter get it here
            else:
                self._lose(spans, len(batch))
        except (BrokenPipeError, OSError, ValueError) as exc:
            self._broken = True
            self._lose(spans, len(batch))
            logger.warning("zoomer-serve: the export helper process is gone (%r); spans are now dropped "
                           "and counted (logged once)", exc)

    def _lose(self, spans: int, records: int) -> None:
        """Count a batch that will not reach the worker: its sampled spans and its records."""
        self.dropped += spans
        self.dropped_records += records

    def _frames(self, batch: list[tuple[Any, ...]]) -> Iterator[bytes]:
        """The helper's frames for ``batch``, made one at a time: length header + pickled ``(dropped so far,
        records)``, at most :data:`_FRAME_RECORDS` records each."""
        for i in range(0, len(batch), _FRAME_RECORDS):
            payload = pickle.dumps((self.dropped, batch[i:i + _FRAME_RECORDS]), protocol=pickle.HIGHEST_PROTOCOL)
            yield _FRAME_HEADER.pack(len(payload)) + payload

    def shutdown(self, timeout_s: float | None = None) -> ExportStats:
        """Flush queued records and stop the worker, within about ``timeout_s`` (default: the export
        timeout) plus one second, even when the collector is unreachable. Logs once how many spans could not
        be sent. Returns the final counters; safe to call twice."""
        if self.final_stats is not None:
            return self.final_stats
        budget = self.cfg.timeout_ms / 1000 if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget + 1.0
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            self._writer.join(max(0.1, deadline - time.monotonic()))
        stats = ExportStats()
        if self._worker is not None:
            stats = self._worker.shutdown(max(0.1, deadline - time.monotonic() - 0.5))
        elif self._proc is not None:
            stats = self._stop_process(deadline)
        stats.dropped_queue += self.dropped
        stats.dropped_records += self.dropped_records
        self.final_stats = stats
        if stats.dropped:
            logger.warning("zoomer-serve: %d spans could not be exported to %s (queue full: %d, export failed: "
                           "%d; last error: %s)", stats.dropped, self.cfg.traces_endpoint, stats.dropped_queue,
                           stats.dropped_export, stats.last_error)
        if stats.dropped_records:
            logger.warning("zoomer-serve: %d records did not fit the export queue; their calls are missing from "
                           "the RPC metrics (and their spans, when sampled, are counted above)",
                           stats.dropped_records)
        return stats

    def _stop_process(self, deadline: float) -> ExportStats:
        proc = self._proc
        assert proc is not None
        try:
            if proc.stdin is not None:
                budget_s = max(0.1, deadline - time.monotonic() - 0.5)  # leave time to report and exit
                payload = pickle.dumps((SHUTDOWN_FRAME, budget_s), protocol=pickle.HIGHEST_PROTOCOL)
                proc.stdin.write(_FRAME_HEADER.pack(len(payload)) + payload)
                proc.stdin.close()
        except OSError:
            pass
        data = wait_for_event(proc, "stats", max(0.1, deadline - time.monotonic()))
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if data is None:
            return ExportStats(dropped_export=self.submitted, last_error="the export helper did not report")
        data.pop("event", None)
        return ExportStats(**data)
