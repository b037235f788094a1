"""The export pipeline on the server side: a bounded queue that the request path appends to, and a
writer thread that moves records in batches to the export worker.

The request path calls :meth:`ExportPipeline.submit`: one length check and one ``deque.append``
(no lock, no system call, no encoding). When the queue holds ``max_queue_size`` records, new records are
dropped and counted (``dropped``), never blocking a request. A writer thread wakes every 500 ms (or when the
queue is half full), takes everything queued, and either pickles it into frames on the helper process's stdin
(``mode="process"``, see :mod:`zoomer_serve.export.frames` and :mod:`zoomer_serve.export.helper_process`) or
hands it to an in-process :class:`~zoomer_serve.export.worker.ExportWorker` thread (``mode="thread"``).

Why 500 ms: each hand-off has a fixed cost (waking the writer here and the helper there, cold caches), about
250 µs of helper CPU measured on the demo model server; at 50 ms that was about 40 µs per request at 110
requests/s, at 500 ms about 5 (benchmarks/RESULTS.md). Spans still reach the collector well within the
export schedule delay (``OTEL_BSP_SCHEDULE_DELAY``, 5 s by default). Why frames of at most 128 records, each
written before the next is pickled: pickling holds the interpreter lock for the whole call (about 2.6 µs per
record), and a thread waiting for the lock only forces a switch after ``sys.getswitchinterval()`` (5 ms); the
write in between releases the lock, so request threads wait at most about one frame's pickling (0.3 ms).
A frame is also bounded by bytes (:data:`~zoomer_serve.export.frames.MAX_FRAME_BYTES`): a larger one is split;
a record larger on its own loses its spans, counted (``dropped_record_too_large``), and goes on reduced to what
the RPC metrics read, so that its call still counts.

**While a helper process starts, or is behind.** A forked child (a pre-forking server's worker) starts its own
helper when it first records, and a helper that died is started again; a fresh interpreter takes about 0.2 s on
an idle machine but seconds on a busy one (0.6 to 5.6 s measured in a pre-forked gRPC server under full load on
2 vCPUs), and records keep coming. The writer never waits for it, not even for ``subprocess.Popen`` (which
returns only once the new process has exec'd: 0.7 s measured there; it runs on a thread of its own): it keeps
taking the queue, pickles what it
takes into full frames and holds them in a buffer until the helper says it is ready, then writes them, oldest
first. It writes no further ahead than half the helper's own queue (:func:`~zoomer_serve.export.worker.
queue_batches` frames of 128 records) past what the helper last reported having taken (its ``progress`` lines),
so that the helper does not drop a burst; what is ahead waits in the buffer too. Nor does the writer wait for the
pipe: it is non-blocking, and a frame it has no room for (a helper starved of CPU reads nothing for a while) waits
in the buffer as well (a blocking write stalled the writer while the queue filled: a CI run of a pre-forked
server under full load on 2 vCPUs lost 582 spans as a full queue). A flush, a signal's hand-off and the shutdown
write everything, waiting for the pipe. The buffer is bounded by :data:`BUFFER_BYTES`: records past it are dropped
and counted as a full queue (``dropped``), and logged once. A helper that does not say it is ready within
:data:`~zoomer_serve.export.helper_process.READY_TIMEOUT_S` is killed, and what the buffer held for it is
counted the same way. A configured parent waits for its helper before serving instead (see
:meth:`ExportPipeline.start`).

A helper process that dies (killed, out of memory) is started again by the writer thread, at most once per
:data:`RESTART_BACKOFF_S`; what it took with it is counted from its last lines
(:meth:`~zoomer_serve.export.helper_process.HelperProcess.taken_spans`): the spans written to it that it had not
reported exported or dropped are ``lost_in_helper``, except those of the export request it was sending, whose
outcome is ``unknown`` (the collector may have stored them). The records (calls) written to it that no RPC metric
export it reported accepted covers are ``records_lost_in_helper``: their calls are missing from the metrics
(:meth:`~zoomer_serve.export.helper_process.HelperProcess.calls_missing_from_metrics`). Every record lost while
none runs is counted too. The calls missing from the metrics, by reason, go to the helper with every frame
(:meth:`_counters`), so that the next one exports them (``zoomer.exporter.call.dropped``). At shutdown, a helper
that is gone and took something with it (or left records held) gets a successor whatever the back-off, to export
them and the loss counters; its final counters go to it in a frame of their own before the shutdown frame.
Export never stays off for the rest of the process's life.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import Any, NamedTuple

from zoomer_serve.config import ExportConfig, SpanLimits
from zoomer_serve.export import frames, rpc_metrics
from zoomer_serve.export.helper_process import READY_TIMEOUT_S, HelperProcess
from zoomer_serve.export.worker import ExportStats, ExportWorker, queue_batches
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.export")
_WRITER_PERIOD_S = 0.5
_FRAME_RECORDS = 128  # records per pickled frame: bounds how long one pickle.dumps holds the interpreter
RESTART_BACKOFF_S = 5.0
"""Least time between two starts of a helper process after one died (seconds)."""
BUFFER_BYTES = 32 * 1024 * 1024
"""Most bytes of pickled records held while the helper process starts or is behind (see the module docstring)."""


class _Frame(NamedTuple):
    """One frame for the helper process and what it carries: sampled ``spans``, ``records``, and ``calls`` (request
    records, each one call in the RPC metrics; the other records are spans only)."""

    data: bytes
    spans: int
    records: int
    calls: int


class ExportPipeline:
    """Bounded, non-blocking hand-off of span records from the request path to the export worker.

    Args:
        cfg: export settings (mode, queue size, endpoint ...).
        resource: resource attributes of every exported span and metric.
        version: instrumentation scope version.
        limits: the span limits the encoder applies.
    Raises:
        RuntimeError from :meth:`start` when the helper process does not come up (mode ``process``, waiting
        for it).
    """

    def __init__(self, cfg: ExportConfig, resource: dict[str, Any], version: str = "0",
                 limits: SpanLimits | None = None) -> None:
        self.cfg = cfg
        self.resource = resource
        self.version = version
        self.limits = limits or SpanLimits()
        self.dropped = 0  # sampled spans dropped on the server side (queue full or worker gone)
        self.dropped_records = 0  # records dropped there, sampled or not
        self.dropped_calls = 0  # of those, calls (request records: they miss the RPC metrics), too large ones apart
        self.submitted = 0  # sampled spans handed to the worker
        self._moved_records = 0  # records taken from the queue (for the worker, or lost on the way)
        self.dropped_record_too_large = 0  # sampled spans of records too large for any frame
        self._logged_too_large = False  # the warning about such records is logged once
        self.lost_in_helper = 0  # sampled spans that a helper which died held and had not sent
        self.unknown_in_helper = 0  # sampled spans that a helper which died may have sent (not reported)
        self.records_lost_in_helper = 0  # records written to a helper that died, their calls in no metric export
        self.records_too_large = 0  # records too large for any frame (of dropped_records)
        self.calls_too_large = 0  # of those, calls
        self._gone_stats = ExportStats()  # the last counters of the helpers that died (their exports, ...)
        self.helper_restarts = 0
        self.records_after_close = 0  # records submitted once shutdown began (by the default after_close)
        self.after_close: Callable[[tuple[Any, ...]], None] = self._count_after_close
        """Takes each record submitted once :meth:`shutdown` began (the request ended while telemetry was
        shutting down); by default it is counted in ``records_after_close``, and so logged at shutdown."""
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._max = cfg.max_queue_size
        self._wake_at = max(1, cfg.max_queue_size // 2)
        self._wake = threading.Event()
        self._closing = False
        self._writer: threading.Thread | None = None
        self._write_lock = threading.Lock()  # one thread at a time moves records to the worker
        self._helper: HelperProcess | None = None  # the helper that takes frames
        self._starting: HelperProcess | None = None  # one started, not ready yet
        self._ready_by = 0.0  # time.monotonic() by which it must be ready
        # the buffer: frames held while the helper starts or is behind, oldest first
        self._held: collections.deque[_Frame] = collections.deque()
        self._held_bytes = 0
        self._held_tail: list[tuple[Any, ...]] = []  # records held, fewer than a frame's
        self._helper_room = queue_batches(cfg) * _FRAME_RECORDS // 2  # records the helper may be behind by
        self._logged_buffer_full = False
        self._helpers_started = 0
        self._next_start = 0.0  # time.monotonic() before which no helper is started again
        self._logged_helper_gone = False
        self._flush_seq = 0
        self._losses_at_flush = 0  # _losses() when the last flush was over
        self._worker: ExportWorker | None = None
        self._disowned = False
        self.final_stats: ExportStats | None = None

    # -- request path -------------------------------------------------------------------------------
    def submit(self, record: tuple[Any, ...]) -> None:
        """Queue one record; never blocks, never raises. Drops (and counts) it when the queue is full; once the
        pipeline is shutting down, hands it to :attr:`after_close` instead (a request that ended meanwhile)."""
        q = self._queue
        n = len(q)
        if self._closing:
            self.after_close(record)
            return
        if n >= self._max:
            self.dropped += r.exported_spans(record)
            self.dropped_records += 1
            if record[r.R_FLAGS] & r.F_REQUEST:
                self.dropped_calls += 1
            return
        q.append(record)
        if n == self._wake_at:
            self._wake.set()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self, wait_for_helper: bool = True) -> None:
        """Start the worker and the writer thread. ``wait_for_helper`` (mode ``process``): start the helper
        process now and wait until it is ready (so that its start-up does not land on the first requests);
        when False the writer thread starts it once there are records to send (a forked child uses this).

        Raises:
            RuntimeError: the helper did not start (``wait_for_helper`` only).
        """
        if self.cfg.mode == "process" and wait_for_helper:
            self._helper = self._start_helper()
        elif self.cfg.mode == "thread":
            self._worker = ExportWorker(self.cfg, self.resource, self.version, self.limits)
            self._worker.start()
        self._writer = threading.Thread(target=self._write_loop, name="zoomer-export-writer", daemon=True)
        self._writer.start()

    def _start_helper(self, timeout_s: float = READY_TIMEOUT_S) -> HelperProcess:
        return self._adopt(HelperProcess(self._helper_spec()).start(timeout_s))

    def _helper_spec(self) -> dict[str, Any]:
        return {"export": asdict(self.cfg), "resource": self.resource, "version": self.version,
                "limits": asdict(self.limits)}

    def _adopt(self, helper: HelperProcess) -> HelperProcess:
        """``helper`` is ready: it takes the frames from now on."""
        self._helper = helper
        self._helpers_started += 1
        if self._helpers_started > 1:
            self.helper_restarts += 1
        return helper

    @property
    def helper_pid(self) -> int | None:
        """The pid of the export helper process (mode ``process``), else None."""
        helper = self._helper
        return helper.pid if helper is not None else None

    def _write_loop(self) -> None:
        while not self._closing:
            self._wake.wait(_WRITER_PERIOD_S)
            self._wake.clear()
            self._drain_once()
        self._drain_once(force=True)

    def _drain_once(self, timeout_s: float = -1, force: bool = False) -> bool:
        """Move everything queued to the worker; False when the write lock was not had within ``timeout_s``
        (-1: wait as long as it takes). ``force``: also what the buffer holds, however far behind the helper
        process is (see :meth:`_send_to_helper`)."""
        if not self._write_lock.acquire(timeout=timeout_s):
            return False
        try:
            self._drain_locked(force)
        finally:
            self._write_lock.release()
        return True

    def _drain_locked(self, force: bool = False) -> None:
        if self._disowned:
            return
        q = self._queue
        if not q:
            helper = self._helper
            if (self._starting is not None or self._held or self._held_tail
                    or (helper is not None and helper.pending_bytes)):
                self._send_to_helper([], 0, force)  # what the buffer holds, once the helper takes it
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
        self._moved_records += len(batch)
        if self._worker is not None:
            self._worker.parent_counters = self._counters()
            self._worker.put(batch)
        elif self.cfg.mode == "process":
            self._send_to_helper(batch, spans, force)
        else:
            self._lose(spans, len(batch), r.count_calls(batch))

    def _send_to_helper(self, batch: list[tuple[Any, ...]], spans: int, force: bool = False) -> None:
        """Write ``batch`` to the helper process, after what the buffer holds; hold it instead while the helper
        starts, while it is behind, or while its pipe is full (unless ``force``: a flush, a hand-off, the
        shutdown, which wait for the pipe)."""
        helper = self._live_helper()
        if helper is None:
            if self._starting is not None:
                self._hold(batch)
            else:
                self._lose(spans, len(batch), r.count_calls(batch))
            return
        if (not (self._held or self._held_tail or helper.pending_bytes)
                and (force or not self._behind(helper))):
            self._write(helper, self._frames(batch), block=force)
            return
        self._hold(batch)
        self._release_held(helper, force)

    def _write(self, helper: HelperProcess, frame_list: Iterable[_Frame], block: bool = True) -> bool:
        """Write ``frame_list`` to ``helper``; unless ``block``, the frames its pipe has no room for go to the buffer
        (in order, after what it holds). False when the helper is gone (the frames not written are counted as
        lost)."""
        frame_iter = iter(frame_list)
        for frame in frame_iter:
            try:
                taken = self._send_frame(helper, frame, block)
            except (OSError, ValueError) as exc:
                for lost in itertools.chain([frame], frame_iter):
                    self._lose(lost.spans, lost.records, lost.calls)
                self._helper_gone(helper, exc)
                return False
            if not taken:
                for rest in itertools.chain([frame], frame_iter):
                    self._keep(rest)
                return True
        return True

    @staticmethod
    def _send_frame(helper: HelperProcess, frame: _Frame, block: bool) -> bool:
        """Write one frame to ``helper`` (counted in its ``sent_*``); False when its pipe has no room and ``block``
        is False (the writer thread never waits for the helper: the queue would fill).

        Raises:
            OSError, ValueError: the helper is gone.
        """
        if not helper.send(frame.data, block):
            return False
        helper.sent_spans += frame.spans
        helper.sent_records += frame.records
        helper.sent_calls += frame.calls
        return True

    def _live_helper(self) -> HelperProcess | None:
        """The helper that takes frames now, or None: one is starting (see :meth:`_started`), none could be
        started, or the last one died less than RESTART_BACKOFF_S after the last start."""
        helper = self._helper
        if helper is not None and helper.alive():
            return helper
        if helper is not None:
            self._helper_gone(helper, None)
        if self._starting is None and not self._launch():
            return None
        return self._started()

    def _launch(self) -> bool:
        """Start a helper without waiting for it (at most once per RESTART_BACKOFF_S); True when started."""
        now = time.monotonic()
        if now < self._next_start:
            return False
        self._next_start = now + RESTART_BACKOFF_S
        self._starting = HelperProcess(self._helper_spec()).launch_in_background()
        self._ready_by = now + READY_TIMEOUT_S
        return True

    def _started(self) -> HelperProcess | None:
        """The starting helper once it is ready (it takes the frames from then on); None while it starts, or
        when it exited or was not ready within READY_TIMEOUT_S (it is killed; what the buffer holds is counted as
        lost)."""
        starting = self._starting
        if starting is None:
            return None
        if starting.ready():
            self._starting = None
            return self._adopt(starting)
        if starting.alive() and time.monotonic() < self._ready_by:
            return None
        if starting.launch_error is not None:
            error = starting.launch_error
            self._abandon_start(f"{type(error).__name__}: {error}")
        else:
            self._abandon_start(f"it {'was not ready within' if starting.alive() else 'exited before'} "
                                f"{READY_TIMEOUT_S:.0f} s; see its stderr")
        return None

    def _abandon_start(self, why: str) -> None:
        """Kill the starting helper and count what the buffer holds as lost."""
        starting, self._starting = self._starting, None
        if starting is not None:
            starting.kill()
        held_spans, _ = self._lose_held()
        logger.warning("zoomer-serve: could not start the export helper process (python -m "
                       "zoomer_serve.export.helper: %s); %d spans it was to take are counted as lost, and records "
                       "are dropped and counted until one starts", why, held_spans)

    # -- the buffer (see the module docstring) ------------------------------------------------------------
    def _behind(self, helper: HelperProcess) -> bool:
        """Whether the helper has not reported taking all but half its queue of what was written to it (its
        ``progress`` lines, at most one a second, say how many records its worker took or dropped)."""
        counters = helper.counters
        taken = int(counters.get("records", 0)) + int(counters.get("dropped_records", 0))
        return helper.sent_records - taken >= self._helper_room

    def _hold(self, batch: list[tuple[Any, ...]]) -> None:
        """Keep ``batch`` after what the buffer holds: full frames pickled, the rest (under a frame) as records;
        frames past :data:`BUFFER_BYTES` are dropped and counted."""
        records = self._held_tail + batch
        full = len(records) - len(records) % _FRAME_RECORDS
        self._held_tail = records[full:]
        for item in self._frames(records[:full]):
            self._keep(item)

    def _keep(self, frame: _Frame) -> None:
        """Append one frame to the buffer; past :data:`BUFFER_BYTES` it is dropped and counted."""
        if self._held_bytes + len(frame.data) > BUFFER_BYTES:
            self._lose(frame.spans, frame.records, frame.calls)
            self._log_buffer_full()
            return
        self._held.append(frame)
        self._held_bytes += len(frame.data)

    def _log_buffer_full(self) -> None:
        if not self._logged_buffer_full:
            self._logged_buffer_full = True
            logger.warning("zoomer-serve: the export helper process is %s and the records held meanwhile reached "
                           "%d bytes; dropping and counting what does not fit (logged once)",
                           "still starting" if self._starting is not None else "behind", self._held_bytes)

    def _release_held(self, helper: HelperProcess, force: bool) -> None:
        """Write what the buffer holds to ``helper``, oldest first, as long as it is not behind and its pipe has
        room (all of it, waiting for the pipe, when ``force``); once the buffer is empty, the loss counters as
        they are now (each held frame carries those of when it was made). A helper that is gone leaves the rest
        held, for the next one."""
        held = self._held
        try:
            if not helper.push(force):
                return
            while held and (force or not self._behind(helper)):
                if not self._send_frame(helper, held[0], force):
                    return
                self._held_bytes -= len(held.popleft().data)
        except (OSError, ValueError) as exc:  # no byte of the frame at the head was written: it stays held
            self._helper_gone(helper, exc)
            return
        if held or (not force and self._behind(helper)):
            return
        tail, self._held_tail = self._held_tail, []
        counters = _Frame(frames.encode(frames.RECORDS, (self._counters(), [])), 0, 0, 0)
        self._write(helper, itertools.chain(self._frames(tail), [counters]), block=force)

    def _lose_held(self) -> tuple[int, int]:
        """Count what the buffer holds as lost and empty it; returns its (spans, records)."""
        held, tail = self._held, self._held_tail
        self._held, self._held_tail, self._held_bytes = collections.deque(), [], 0
        spans = sum(f.spans for f in held) + sum(map(r.exported_spans, tail))
        records = sum(f.records for f in held) + len(tail)
        self._lose(spans, records, sum(f.calls for f in held) + r.count_calls(tail))
        return spans, records

    def _await_helper(self, deadline: float) -> None:
        """Wait until a starting helper is ready (up to ``deadline``, ``time.monotonic()``), then write it
        everything queued or held."""
        starting = self._starting
        if starting is not None:
            starting.wait_ready(deadline - time.monotonic())
        with self._write_lock:
            self._drain_locked(force=True)

    def _helper_gone(self, helper: HelperProcess, exc: BaseException | None) -> None:
        """Count what a helper that died took with it; the next drain starts a new one."""
        if self._helper is helper:
            self._helper = None
        helper.kill()
        lost, unknown = helper.taken_spans()
        self.lost_in_helper += lost
        self.unknown_in_helper += unknown
        if self.cfg.metrics:  # OTEL_METRICS_EXPORTER=none: no call is in any metric, none is missing from one
            self.records_lost_in_helper += helper.calls_missing_from_metrics()
        _add_counters(self._gone_stats, helper.counters)
        if not self._logged_helper_gone:
            self._logged_helper_gone = True
            logger.warning("zoomer-serve: the export helper process is gone (%s); starting a new one, and "
                           "counting the spans it took with it (logged once)", exc or "it exited")

    def _count_after_close(self, record: tuple[Any, ...]) -> None:
        self.records_after_close += 1

    def _lose(self, spans: int, records: int, calls: int) -> None:
        """Count a batch that will not reach the worker: its sampled spans, its records and its calls."""
        self.dropped += spans
        self.dropped_records += records
        self.dropped_calls += calls

    def _counters(self) -> dict[str, int]:
        """The server side's loss counters that the helper reports with its own (see frames.RECORDS), with those of
        the helpers that died (their series end with them: the next helper's carry the process's totals)."""
        gone = self._gone_stats  # so that each helper's series holds the process's counts so far, as cumulative
        return {"queue_full": self.dropped + gone.dropped_queue,
                "too_large": self.dropped_record_too_large + gone.dropped_too_large,
                "helper_lost": self.lost_in_helper, "exported": gone.exported, "rejected": gone.dropped_rejected,
                "export_failed": gone.dropped_export - gone.dropped_rejected - gone.dropped_too_large,
                "calls_queue_full": self.dropped_calls + gone.dropped_calls,
                "calls_too_large": self.calls_too_large, "calls_helper_lost": self.records_lost_in_helper}

    def _frames(self, batch: list[tuple[Any, ...]]) -> Iterator[_Frame]:
        """The helper's frames for ``batch``, made one at a time: at most
        :data:`_FRAME_RECORDS` records and :data:`~zoomer_serve.export.frames.MAX_FRAME_BYTES` bytes each. A
        chunk whose pickle is too large is split in halves; a single record too large goes as :meth:`_too_large`
        says."""
        for i in range(0, len(batch), _FRAME_RECORDS):
            yield from self._bounded_frames(batch[i:i + _FRAME_RECORDS])

    def _bounded_frames(self, chunk: list[tuple[Any, ...]]) -> Iterator[_Frame]:
        payload = frames.pickled(frames.RECORDS, (self._counters(), chunk))
        if len(payload) <= frames.MAX_FRAME_BYTES:
            yield _Frame(frames.framed(payload), sum(map(r.exported_spans, chunk)), len(chunk), r.count_calls(chunk))
        elif len(chunk) > 1:
            mid = len(chunk) // 2
            yield from self._bounded_frames(chunk[:mid])
            yield from self._bounded_frames(chunk[mid:])
        else:
            yield from self._too_large(chunk[0], len(payload))

    def _too_large(self, rec: tuple[Any, ...], size: int) -> Iterator[_Frame]:
        """The frame for a record of ``size`` pickled bytes, too large for any frame: its spans are dropped and
        counted (``dropped_record_too_large``, reported as ``too_large``); a request record goes on reduced to what
        the RPC metrics read (:func:`~zoomer_serve.export.rpc_metrics.metrics_only`), so that its call still
        counts. Any other record, or one still too large reduced, is dropped whole (``dropped_records``)."""
        self.dropped_record_too_large += r.exported_spans(rec)
        if not self._logged_too_large:
            self._logged_too_large = True
            logger.warning("zoomer-serve: a span record of %d bytes is over the frames to the export helper (%d "
                           "bytes): its spans are dropped and counted as too large, a request's call still counts "
                           "in the RPC metrics (logged once; see the OTEL_*_LIMIT span limits)", size, frames.MAX_FRAME_BYTES)
        if rec[r.R_FLAGS] & r.F_REQUEST:
            payload = frames.pickled(frames.RECORDS, (self._counters(), [rpc_metrics.metrics_only(rec)]))
            if len(payload) <= frames.MAX_FRAME_BYTES:
                yield _Frame(frames.framed(payload), 0, 1, 1)
                return
            self.calls_too_large += 1
        self.dropped_records += 1
        self.records_too_large += 1

    # -- flush, fork, shutdown ----------------------------------------------------------------------
    def hand_off(self, timeout_s: float = 1.0) -> bool:
        """Move every queued record to the worker now (to the helper process's pipe, where it outlives this
        process); True when done within ``timeout_s``. Cheap: no export is waited for."""
        return self._drain_once(max(0.0, timeout_s), force=True)

    def flush_while_open(self, deadline: float, rounds: int = 4) -> None:
        """Before :meth:`shutdown`, while the server may still be answering calls: flush, and flush again while
        the server recorded more than a frame of records meanwhile and the flushes get shorter, at most
        ``rounds`` times and until ``deadline`` (``time.monotonic()``). Records keep being taken all along: what
        the server answers during an export is exported too, and the closing drain of :meth:`shutdown` is left
        what came during the last round only. A flush no shorter than the one before means the export does not
        keep up with the server (or the collector is slow): more rounds would not shorten the closing drain."""
        last = float("inf")
        for _ in range(rounds):
            began, moved, queued = time.monotonic(), self._moved_records, len(self._queue)
            if began >= deadline:
                return
            self.flush(deadline - began, metrics=False)
            took = time.monotonic() - began
            came = self._moved_records - moved - queued + len(self._queue)  # recorded during this flush
            if came <= _FRAME_RECORDS or took >= last:
                return
            last = took

    def flush(self, timeout_s: float, metrics: bool = True) -> bool:
        """Export everything recorded so far now (``metrics=False``: the spans only, the RPC metrics go with a
        later export) and wait for it, within ``timeout_s`` seconds. True when the flush succeeded: nothing was
        lost since the previous flush, here (a full queue, a record too large for a frame, a helper process that
        died: lost or of unknown outcome) or in the worker (refused or rejected by the collector, see
        :meth:`~zoomer_serve.export.worker.ExportWorker.flush`). False otherwise, or when the time ran out; the
        losses are counted either way."""
        deadline = time.monotonic() + timeout_s
        if not self.hand_off(timeout_s):
            return False
        self._await_helper(deadline)
        worker_ok = self._flush_worker(deadline, metrics)
        losses = self._losses()
        ok = worker_ok and losses == self._losses_at_flush
        self._losses_at_flush = losses
        return ok

    def _losses(self) -> int:
        """Spans this side has counted as lost, or whose outcome it does not know, so far (the worker counts its
        own)."""
        return self.dropped + self.dropped_record_too_large + self.lost_in_helper + self.unknown_in_helper

    def _flush_worker(self, deadline: float, metrics: bool) -> bool:
        """Have the worker (thread or helper process) flush what it got; its answer, False when none came by
        ``deadline`` (``time.monotonic()``)."""
        if self._worker is not None:
            return self._worker.flush(max(0.0, deadline - time.monotonic()), metrics)
        with self._write_lock:
            helper = self._helper
            if helper is None:
                return self.cfg.mode != "process" or not self.submitted
            self._flush_seq += 1
            seq = self._flush_seq
            try:
                helper.send(frames.encode(frames.FLUSH, (seq, metrics)))
            except (OSError, ValueError):
                return False
        event = helper.wait_event("flushed", deadline - time.monotonic(), seq)
        return event is not None and event.get("ok") is True

    def disown(self) -> None:
        """In a process forked from this pipeline's: let go of everything that belongs to the parent (its
        helper process and queued records) without touching it; this object records nothing more."""
        self._disowned = True
        self._closing = True
        self._queue = collections.deque()
        for helper in (self._helper, self._starting):
            if helper is not None:
                helper.disown()
        self._helper = self._starting = None
        self._held, self._held_tail, self._held_bytes = collections.deque(), [], 0
        self._worker = None
        self.final_stats = ExportStats()

    def shutdown(self, timeout_s: float | None = None) -> ExportStats:
        """Flush queued records and stop the worker, within about ``timeout_s`` (default: the export
        timeout) plus one second, even when the collector is unreachable. Logs once how many spans could not
        be sent. Returns the final counters; safe to call twice."""
        if self.final_stats is not None:
            return self.final_stats
        budget = self.cfg.export_budget_ms / 1000 if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget + 1.0
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            self._writer.join(max(0.1, deadline - time.monotonic()))
        stats = ExportStats()
        if self._worker is not None:
            stats = self._worker.shutdown(max(0.1, deadline - time.monotonic() - 0.5))
        elif self.cfg.mode == "process":
            stats = self._shut_down_helper(deadline)
        stats.dropped_queue += self.dropped
        stats.dropped_records += self.dropped_records
        stats.dropped_calls += self.dropped_calls + self.calls_too_large
        stats.dropped_record_too_large += self.dropped_record_too_large
        _add_counters(stats, asdict(self._gone_stats))
        stats.lost_in_helper += self.lost_in_helper
        stats.records_lost_in_helper += self.records_lost_in_helper
        stats.unknown += self.unknown_in_helper
        stats.records_after_shutdown += self.records_after_close
        stats.helper_restarts += self.helper_restarts
        self.final_stats = stats
        _log_losses(stats, self.cfg.traces_endpoint)
        return stats

    def _shut_down_helper(self, deadline: float) -> ExportStats:
        """Have the helper export what it was given and what the start-up buffer holds, and stop it, by
        ``deadline``; one still starting gets until a second before it."""
        with self._write_lock:
            self._start_successor()
        self._await_helper(deadline - 1.0)
        with self._write_lock:
            if self._starting is not None:
                self._abandon_start("it was still starting when the shutdown budget ran out")
            self._lose_held()  # none took it (the helper died, and none was started again in time)
            helper = self._helper
            if helper is not None and not helper.alive():  # it died after the last frame it took: count what it took
                self._helper_gone(helper, None)
                helper = None
        if helper is None:
            return ExportStats()
        return self._stop_helper(helper, deadline)

    def _start_successor(self) -> None:
        """At shutdown, when the helper is gone and took spans or calls with it, or left records held (or none ran
        since records were lost): start one now, within :data:`RESTART_BACKOFF_S` of the last start too. It is the
        last chance to export them and the loss counters; without it the store held no trace of those losses (they
        were only logged)."""
        helper = self._helper
        if self._starting is not None or (helper is not None and helper.alive()):
            return
        if helper is not None:
            self._helper_gone(helper, None)
        if self._held or self._held_tail or self._losses() or self.dropped_calls or self.records_lost_in_helper:
            self._next_start = 0.0
            self._launch()

    def _stop_helper(self, helper: HelperProcess, deadline: float) -> ExportStats:
        with self._write_lock:
            try:  # the loss counters as they are now (what the buffer held may have been lost since the last frame)
                helper.send(frames.encode(frames.RECORDS, (self._counters(), [])), deadline=deadline)
            except (OSError, ValueError):
                pass
            data = helper.stop(deadline)
        if data is not None:
            data = {k: v for k, v in data.items() if k in ExportStats.__dataclass_fields__}
            return ExportStats(**data)
        # It did not report in time: what its last counters account for is known, the rest is not (never claimed
        # lost). Those counters may be its final ones after all, come just late, with spans it called unknown.
        last = {k: v for k, v in helper.counters.items() if k in ExportStats.__dataclass_fields__}
        stats = ExportStats(**last)
        stats.unknown += helper.unreported_spans()
        stats.last_error = "the export helper did not report its final counters"
        return stats


def _add_counters(stats: ExportStats, counters: dict[str, Any]) -> None:
    """Add a worker's counters (an :class:`ExportStats` as a dict, or a helper's last line) to ``stats``: every
    count; ``last_error`` only where ``stats`` has none."""
    for name, value in counters.items():
        if name == "last_error":
            stats.last_error = stats.last_error or value
        elif name in ExportStats.__dataclass_fields__ and isinstance(value, int):
            setattr(stats, name, getattr(stats, name) + value)


def _log_losses(stats: ExportStats, endpoint: str) -> None:
    """One warning per kind of loss, with its count (nothing when nothing was lost)."""
    if stats.dropped:
        failed = stats.dropped_export - stats.dropped_rejected - stats.dropped_too_large
        logger.warning("zoomer-serve: %d spans could not be exported to %s (queue full: %d, export failed: %d, "
                       "rejected in a partial success: %d, too large: %d, lost with a helper process: %d; last error: "
                       "%s)", stats.dropped, endpoint, stats.dropped_queue, failed, stats.dropped_rejected,
                       stats.dropped_too_large + stats.dropped_record_too_large, stats.lost_in_helper,
                       stats.last_error)
    if stats.dropped_records:
        logger.warning("zoomer-serve: %d records did not reach the exporter; %d of them were calls, missing from the "
                       "RPC metrics (their spans, when sampled, are counted above)", stats.dropped_records,
                       stats.dropped_calls)
    if stats.records_lost_in_helper:
        logger.warning("zoomer-serve: %d calls are missing from the RPC metrics: an export helper process died "
                       "holding them before a metric export covered them (counted in zoomer.exporter.call.dropped, "
                       "error.type=helper_lost)", stats.records_lost_in_helper)
    if stats.records_after_shutdown:
        log_records_after_shutdown(stats.records_after_shutdown)
    if stats.unknown:
        logger.warning("zoomer-serve: the outcome of %d spans is unknown: they were in flight when the shutdown "
                       "budget ran out or when an export helper process died, or the export helper did not report "
                       "them; they may or may not have reached %s", stats.unknown, endpoint)


def log_records_after_shutdown(records: int, in_progress: int = 0) -> None:
    """The one warning about requests that ended once telemetry began shutting down, and those still in
    progress when the process ended (neither exported)."""
    still = (f"; {in_progress} more were still in progress as the process ended (their answers may have been sent)"
             if in_progress else "")
    logger.warning("zoomer-serve: %d %s ended after telemetry began shutting down (the server kept answering "
                   "while telemetry was being flushed); not exported%s", records,
                   "request" if records == 1 else "requests", still)
