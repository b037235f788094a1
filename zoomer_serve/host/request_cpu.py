"""Per-request CPU time: a request observer that puts the thread CPU time of SERVER spans on them as
``zoomer.request.cpu_time_ns`` (see :mod:`zoomer_serve.host.names`), next to the span's wall time.

Which requests are measured (decided when the span starts; an unmeasured request reads no clock at all):

- every sampled request that starts while a profiling session runs (kernel or CPU-only: the observer is a
  :class:`~zoomer_serve.profiling.session.SessionCompanion` of every session, so its window opens before the
  session covers its first request and closes after the last covered one ended);
- outside sessions, a deterministic 1-in-N sample of the sampled traces: a trace is in it when its trace id
  modulo N is 0 (``ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN``, default N =
  :data:`~zoomer_serve.host.config.DEFAULT_REQUEST_CPU_TIME_ONE_IN`; 0: none outside
  sessions, 1: every request). The test uses the trace id's lowest bits, random in W3C trace ids, so every
  service of a trace with the same N measures the same traces, and a ``traceidratio`` head sampler (which
  compares the trace id's low 64 bits with a bound, so decides by its higher bits) does not bias it;
- an unsampled span is not exported, so it is never measured.

A span that was not measured has no attribute (never a zero). The analysis says how many of the requests it
describes carried one.

``on_start`` reads the thread's CPU time (``time.thread_time_ns``) and the thread id; ``on_end`` reads them again
(the clock through :data:`thread_cpu_ns`) and, when the span ends on the thread it started on, sets the
difference. Spans that start on an asyncio event loop are skipped (the loop's thread runs many requests at
once), and so are spans that end on another thread (a streaming response finished from gRPC's callback
thread). Cost of a measured request: two clock reads, two thread-id reads and one dict insert and pop (a few
µs in a hot loop; see ``benchmarks/_bench_host.py``), but in a busy server the end read costs far more
(below); an unmeasured one: a flag test and one modulo of the trace id.

Why the clock is read without the interpreter lock: each read is a system call
(``clock_gettime(CLOCK_THREAD_CPUTIME_ID)``, not served by the vDSO) that brings the scheduler's accounting up
to date, and a thread past its time slice is preempted right there. ``time.thread_time_ns`` holds the
interpreter lock through the call, so in a busy multi-threaded server the other request threads queued on the
lock: on the 2-core benchmark machine (Linux 6.18) 3 to 4 more voluntary context switches and 36 to 92 µs
more CPU per demo-model request. :data:`thread_cpu_ns` makes the same call through ``ctypes``, which lets go
of the lock around it: the extra switches are gone and the cost is about 30 µs lower (benchmarks/RESULTS.md).
Only the end read goes that way: by then the request has run for a while and its slice is likely spent, while
at the start the thread has just been woken with a fresh slice, and letting go of the lock there would only
make the request wait to get it back. Even so the reads cost the demo model 40 to 176 µs of CPU per measured
request on that machine, nearly all of it the end read (the start read alone: nothing measurable): the
preemption it triggers still happens, just without the lock held. No other precise per-thread clock avoids it
(``getrusage`` moves only at ticks and switches; a perf ``task-clock`` event costs as much; benchmarks/RESULTS.md,
runs of 2026-11-30). That is why requests are measured on a sample.
``ZOOMER_HOST_REQUEST_CPU_TIME=false`` turns the attribute off altogether (sessions included).
"""

from __future__ import annotations

import logging
import threading
import time
from asyncio import _get_running_loop as _running_loop  # C function: this thread's running loop or None
from collections.abc import Callable
from pathlib import Path
from threading import get_ident as _thread_id
from time import thread_time_ns as _thread_time_ns
from typing import Any

from zoomer_serve.host.config import DEFAULT_REQUEST_CPU_TIME_ONE_IN
from zoomer_serve.host.names import REQUEST_CPU_TIME
from zoomer_serve.recording import RequestSpan
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.host")


def _unlocked_thread_clock() -> Callable[[], int] | None:
    """A reader of the calling thread's CPU time in ns (user + system, the value of ``time.thread_time_ns``)
    that makes the ``clock_gettime(CLOCK_THREAD_CPUTIME_ID)`` system call through ``ctypes``, which releases
    the interpreter lock around foreign calls. None where libc's ``clock_gettime`` cannot be loaded or does not
    agree with ``time.thread_time_ns``."""
    try:
        import ctypes

        clock_id = time.CLOCK_THREAD_CPUTIME_ID
        clock_gettime = ctypes.CDLL(None).clock_gettime  # this CDLL's own function object: argtypes stay ours
    except (AttributeError, ImportError, OSError, TypeError):  # no ctypes, no clock id, no libc (Windows)
        return None

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    clock_gettime.argtypes = [ctypes.c_int, ctypes.POINTER(Timespec)]
    clock_gettime.restype = ctypes.c_int
    local = threading.local()  # one buffer per thread: the call runs while other threads hold the lock

    def read() -> int:
        try:
            ts = local.ts
        except AttributeError:
            ts = local.ts = Timespec()
        if clock_gettime(clock_id, ts):
            return _thread_time_ns()
        return ts.tv_sec * 1_000_000_000 + ts.tv_nsec

    before = _thread_time_ns()
    value = read()
    if not before <= value <= _thread_time_ns():
        return None
    return read


thread_cpu_ns: Callable[[], int] = _unlocked_thread_clock() or _thread_time_ns
"""The calling thread's CPU time in ns (user + system; ``clock_gettime(CLOCK_THREAD_CPUTIME_ID)``), read without
holding the interpreter lock where ``ctypes`` can call libc (see the module docstring), else
``time.thread_time_ns``."""

MAX_OPEN = 65_536
"""Open request spans tracked at once; beyond, new spans get no CPU time (counted in ``skipped_full``)."""


class RequestCpuTimeObserver:
    """A :class:`~zoomer_serve.recording.recorder.RequestObserver` (``recorder.add_observer``) that sets
    ``zoomer.request.cpu_time_ns`` (int, ns) on the sampled SERVER spans it measures (see the module docstring:
    every one while a profiling session runs, else 1 in ``one_in`` traces) that start and end on one OS thread.
    Also a :class:`~zoomer_serve.profiling.session.SessionCompanion`: :meth:`begin` opens a session's window.

    ``one_in``: N of the 1-in-N sample outside sessions (0: none, 1: every request). Raises ValueError when
    negative.

    Counters of the spans left without the attribute (approximate under concurrency; for tests and
    diagnostics): ``skipped_unsampled`` (not sampled, so not exported: no clock is read for them),
    ``skipped_outside_sample`` (outside a session and not in the 1-in-N sample: no clock read either),
    ``skipped_event_loop`` (started on an asyncio loop), ``skipped_other_thread`` (ended on another thread),
    ``skipped_full`` (more than :data:`MAX_OPEN` open). ``measured``: spans that got the attribute.
    """

    def __init__(self, one_in: int = DEFAULT_REQUEST_CPU_TIME_ONE_IN) -> None:
        if one_in < 0:
            raise ValueError(f"one_in must be >= 0 (0: no requests outside profiling sessions), got {one_in}")
        self.one_in = one_in
        self.sessions = 0  # profiling sessions whose window is open now (every request is measured)
        self._sessions_lock = threading.Lock()
        self._open: dict[RequestSpan, tuple[int, int]] = {}
        self.measured = 0
        self.skipped_event_loop = 0
        self.skipped_unsampled = 0
        self.skipped_outside_sample = 0
        self.skipped_other_thread = 0
        self.skipped_full = 0
        self._warned = False

    def on_start(self, span: RequestSpan) -> None:
        if span.kind != r.KIND_SERVER:
            return
        if not span.trace_flags & 1:  # not exported: nothing would carry the value
            self.skipped_unsampled += 1
            return
        if not self.sessions:
            n = self.one_in
            if not n or span.trace_id % n:
                self.skipped_outside_sample += 1
                return
        if _running_loop() is not None:
            self.skipped_event_loop += 1
            return
        if len(self._open) >= MAX_OPEN:
            self.skipped_full += 1
            if not self._warned:
                self._warned = True
                logger.warning("zoomer-serve: %d request spans are open at once; new ones get no %s (counted)",
                               MAX_OPEN, REQUEST_CPU_TIME)
            return
        self._open[span] = (_thread_id(), _thread_time_ns())

    def on_end(self, span: RequestSpan) -> None:
        if not self._open:
            return
        entry = self._open.pop(span, None)
        if entry is None:
            return
        if entry[0] != _thread_id():
            self.skipped_other_thread += 1
            return
        span.attributes[REQUEST_CPU_TIME] = thread_cpu_ns() - entry[1]
        self.measured += 1

    @property
    def open_spans(self) -> int:
        """Spans started and not yet ended (bounded by :data:`MAX_OPEN`)."""
        return len(self._open)

    def in_sample(self, trace_id: int) -> bool:
        """Whether a sampled trace with this id is measured outside profiling sessions (its id modulo
        ``one_in`` is 0)."""
        return bool(self.one_in) and trace_id % self.one_in == 0

    # -- session companion ---------------------------------------------------------------------------------
    def begin(self, session_id: str, folder: Path, max_duration_ms: int) -> SessionWindow:
        """Open a profiling session's window: until its :meth:`SessionWindow.stop`, every sampled request that
        starts is measured. Never raises."""
        with self._sessions_lock:
            self.sessions += 1
        return SessionWindow(self)

    def _close_window(self) -> None:
        with self._sessions_lock:
            self.sessions = max(0, self.sessions - 1)


class SessionWindow:
    """One profiling session's window of :class:`RequestCpuTimeObserver` (a
    :class:`~zoomer_serve.profiling.session.CompanionRun`). ``stop`` closes it (idempotent); ``finish``
    returns no attributes."""

    def __init__(self, observer: RequestCpuTimeObserver) -> None:
        self._observer: RequestCpuTimeObserver | None = observer

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer._close_window()

    def finish(self) -> dict[str, Any]:
        self.stop()
        return {}
