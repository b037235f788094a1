"""The export helper process: ``python -m zoomer_serve.export.helper`` (started by
:class:`~zoomer_serve.export.helper_process.HelperProcess`).

It runs an :class:`~zoomer_serve.export.worker.ExportWorker` on the records that arrive as frames on stdin
(:mod:`zoomer_serve.export.frames`) and writes JSON lines on stdout:

- ``{"event": "ready", "pid": P}`` once it can take frames;
- ``{"event": "progress", ...counters, "in_flight": N}``: the export thread writes one just before each export
  request of spans (``N``: its spans) and one once that request's outcome is counted (``N`` = 0), and otherwise
  between two turns of its loop when its counters changed, at most once a second (no thread of its own wakes
  every second). The server uses the last one to count what a helper that died took with it: spans it had not
  reported are lost, except the ``N`` of a request it may have sent, whose outcome is unknown. One is also
  written right after each export of the RPC metrics the collector accepted in full: its ``metric_records``
  (records whose calls those metrics hold) lets the server count the calls of a helper that died after it as
  missing from the metrics;
- ``{"event": "flushed", "seq": N, "ok": B}`` after a ``FLUSH`` frame's records were sent (or failed); ``ok`` is
  :meth:`ExportWorker.flush`'s answer (False when anything was lost since the previous flush). The frames behind
  a ``FLUSH`` keep being read meanwhile (a server under load goes on sending records: were they left in the
  pipe, its queue would fill up and drop them);
- ``{"event": "stats", ...counters}`` last, after everything was flushed or the budget ran out.

Its lifetime follows the server's, not the server's signals: it runs in a session of its own (Ctrl+C and
``kill -TERM -PGID`` of the server's process group do not reach it) and ignores SIGINT. When stdin closes (the
server exited, however it exited) or a ``SHUTDOWN`` frame comes, it flushes within the budget and exits 0. A
SIGTERM aimed at it directly (systemd stops every process of a unit) starts that same budget: it keeps taking
the server's last frames until stdin closes or the budget is over, then flushes what it has and exits.
Writing to a server that is gone (a closed stdout) is ignored.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, BinaryIO

from zoomer_serve.config import ExportConfig, SpanLimits
from zoomer_serve.export import frames
from zoomer_serve.export.worker import ExportWorker

logger = logging.getLogger("zoomer_serve.export")
PROGRESS_PERIOD_S = 1.0


class EventWriter:
    """JSON lines on stdout from any thread; a closed stdout (the server is gone) is ignored."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.broken = False

    def emit(self, event: dict[str, Any]) -> None:
        line = json.dumps(event) + "\n"
        with self._lock:
            if self.broken:
                return
            try:
                self._stream.write(line)
                self._stream.flush()
            except (OSError, ValueError):
                self.broken = True


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _skip(stream: BinaryIO, n: int) -> bool:
    """Read and discard ``n`` bytes; False at end of stream."""
    while n > 0:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            return False
        n -= len(chunk)
    return True


class Helper:
    """The helper's main loop (see the module docstring); ``run`` never returns: it exits the process."""

    def __init__(self, worker: ExportWorker, out: EventWriter, default_budget_s: float) -> None:
        self.worker = worker
        self.out = out
        self.budget_s = default_budget_s
        self._done = threading.Lock()
        self._finished = False
        self.bad_frames = 0
        self._reported: dict[str, Any] | None = None  # the counters of the last progress line
        self._reported_at = float("-inf")  # time.monotonic() of it
        worker.on_turn = self.report_progress
        worker.on_export = self.report_export
        worker.on_metrics = self.report_metrics

    def run(self, stdin: BinaryIO) -> None:
        self.out.emit({"event": "ready", "pid": os.getpid()})
        while True:
            header = _read_exact(stdin, frames.HEADER.size)
            if header is None:
                break  # the server closed stdin or exited
            (length,) = frames.HEADER.unpack(header)
            if length > frames.MAX_FRAME_BYTES:
                self._bad_frame(f"a frame of {length} bytes (limit {frames.MAX_FRAME_BYTES})")
                if not _skip(stdin, length):
                    break
                continue
            payload = _read_exact(stdin, length)
            if payload is None:
                break
            if self._handle(payload):
                break
        self.finish(self.budget_s)

    def _handle(self, payload: bytes) -> bool:
        """Act on one frame; True for the last one (SHUTDOWN)."""
        try:
            kind, body = frames.decode(payload)
        except ValueError as exc:
            self._bad_frame(str(exc))
            return False
        if kind == frames.RECORDS:
            counters, batch = body
            self.worker.parent_counters = dict(counters)
            self.worker.put(batch)
        elif kind == frames.FLUSH:  # answered on a thread of its own: the frames behind it keep being read
            seq, metrics = body
            request = self.worker.request_flush(self.budget_s, metrics)
            threading.Thread(target=self._answer_flush, args=(request, seq), name="zoomer-export-flushed",
                             daemon=True).start()
        else:
            self.budget_s = float(body)
            return True
        return False

    def _answer_flush(self, request: Any, seq: Any) -> None:
        """Write the ``flushed`` line once the flush is over (``ok`` False when it did not end within the budget)."""
        ok = request is not None and request.done.wait(self.budget_s) and request.ok
        self.out.emit({"event": "flushed", "seq": seq, "ok": ok})

    def _bad_frame(self, what: str) -> None:
        self.bad_frames += 1
        if self.bad_frames == 1:
            logger.error("zoomer-serve exporter: skipped %s; counting such frames (logged once)", what)

    def report_progress(self) -> float | None:
        """Write a progress line when the counters changed and the last line is :data:`PROGRESS_PERIOD_S` old.
        Runs on the export thread (:attr:`ExportWorker.on_turn`) between two turns of its loop; returns the
        seconds until a change not yet reported may be written, or None when everything is reported."""
        now = vars(self.worker.stats)
        if now == self._reported:
            return None
        wait = self._reported_at + PROGRESS_PERIOD_S - time.monotonic()
        if wait > 0:
            return wait
        self._reported = dict(now)
        self._reported_at = time.monotonic()
        self.out.emit({"event": "progress", **self._reported})
        return None

    def report_export(self, in_flight: int) -> None:
        """Write a progress line now, with the spans of the export request about to be sent (``in_flight``), or 0
        once its outcome is counted (:attr:`ExportWorker.on_export`, on the export thread): written before the
        request goes out, so a server that finds this helper dead knows which spans it may have sent."""
        self._reported = dict(vars(self.worker.stats))
        self._reported_at = time.monotonic()
        self.out.emit({"event": "progress", **self._reported, "in_flight": in_flight})

    def report_metrics(self) -> None:
        """Write a progress line now, after an export of the RPC metrics that the collector accepted in full
        (:attr:`ExportWorker.on_metrics`): its ``metric_records`` tells a server that later finds this helper dead
        which of the calls it wrote here the collector's metrics hold (the rest are counted as missing)."""
        self._reported = dict(vars(self.worker.stats))
        self._reported_at = time.monotonic()
        self.out.emit({"event": "progress", **self._reported, "in_flight": self.worker.in_flight})

    def on_sigterm(self, _signum: int, _frame: Any) -> None:
        """Keep taking the server's last frames for the budget, then flush and exit (see the module docstring)."""
        deadline = time.monotonic() + self.budget_s

        def finish_at_deadline() -> None:
            time.sleep(max(0.0, deadline - time.monotonic()))
            self.finish(min(self.budget_s, 1.0))

        threading.Thread(target=finish_at_deadline, name="zoomer-export-sigterm", daemon=True).start()

    def finish(self, budget_s: float) -> None:
        """Flush within ``budget_s``, report the counters, exit 0 (once, whichever thread gets here first)."""
        with self._done:
            if self._finished:
                return
            self._finished = True
            stats = self.worker.shutdown(budget_s)
            self.out.emit({"event": "stats", **asdict(stats)})
            os._exit(0)  # do not wait for exporter threads still retrying against an unreachable collector


def main() -> None:
    """Entry point of the helper process (see the module docstring)."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(5)
    except OSError:
        pass
    spec = json.loads(os.environ["ZOOMER_WORKER_CONFIG"])
    worker = ExportWorker(ExportConfig(**spec["export"]), spec["resource"], spec.get("version", "0"),
                          SpanLimits(**spec.get("limits", {})))
    worker.start()
    helper = Helper(worker, EventWriter(sys.stdout), worker.cfg.export_budget_ms / 1000)
    signal.signal(signal.SIGTERM, helper.on_sigterm)
    helper.run(sys.stdin.buffer)


if __name__ == "__main__":
    main()
