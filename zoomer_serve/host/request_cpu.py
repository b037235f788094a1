"""Per-request CPU time: a request observer that puts the thread CPU time of each sampled SERVER span on it as
``zoomer.request.cpu_time_ns`` (see :mod:`zoomer_serve.host.names`), next to the span's wall time. An unsampled
span is not exported, so no clock is read for it.

``on_start`` reads the thread's CPU time (``time.thread_time_ns``) and the thread id; ``on_end`` reads them again
(the clock through :data:`thread_cpu_ns`) and, when the span ends on the thread it started on, sets the
difference. Spans that start on an asyncio event loop are skipped (the loop's thread runs many requests at
once), and so are spans that end on another thread (a streaming response finished from gRPC's callback
thread). Cost: two clock reads, two thread-id reads and one dict insert and pop per request (a few µs in a hot
loop; see ``benchmarks/_bench_host.py``), but in a busy server the end read costs far more (below).

Why the clock is read without the interpreter lock: each read is a system call
(``clock_gettime(CLOCK_THREAD_CPUTIME_ID)``, not served by the vDSO) that brings the scheduler's accounting up
to date, and a thread past its time slice is preempted right there. ``time.thread_time_ns`` holds the
interpreter lock through the call, so in a busy multi-threaded server the other request threads queued on the
lock: on the 2-core benchmark machine (Linux 6.18) 3 to 4 more voluntary context switches and 36 to 92 µs
more CPU per demo-model request. :data:`thread_cpu_ns` makes the same call through ``ctypes``, which lets go
of the lock around it: the extra switches are gone and the cost is about 30 µs lower (benchmarks/RESULTS.md).
Only the end read goes that way: by then the request has run for a while and its slice is likely spent, while
at the start the thread has just been woken with a fresh slice, and letting go of the lock there would only
make the request wait to get it back. Even so the reads cost the demo model 50 to 110 µs of CPU per request on
that machine, nearly all of it the end read (the start read alone: nothing measurable): the preemption it
triggers still happens, just without the lock held. No other precise per-thread clock avoids it
(``getrusage`` moves only at ticks and switches; a perf ``task-clock`` event costs as much; benchmarks/RESULTS.md,
runs of 2026-11-30).
``ZOOMER_HOST_REQUEST_CPU_TIME=false`` turns the attribute off.
"""

from __future__ import annotations

import logging
import threading
import time
from asyncio import _get_running_loop as _running_loop  # C function: this thread's running loop or None
from collections.abc import Callable
from threading import get_ident as _thread_id
from time import thread_time_ns as _thread_time_ns

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
    ``zoomer.request.cpu_time_ns`` (int, ns) on sampled SERVER spans that start and end on one OS thread.

    Counters of the spans left without the attribute (approximate under concurrency; for tests and
    diagnostics): ``skipped_unsampled`` (not sampled, so not exported: no clock is read for them),
    ``skipped_event_loop`` (started on an asyncio loop),
    ``skipped_other_thread`` (ended on another thread), ``skipped_full`` (more than :data:`MAX_OPEN` open).
    """

    def __init__(self) -> None:
        self._open: dict[RequestSpan, tuple[int, int]] = {}
        self.skipped_event_loop = 0
        self.skipped_unsampled = 0
        self.skipped_other_thread = 0
        self.skipped_full = 0
        self._warned = False

    def on_start(self, span: RequestSpan) -> None:
        if span.kind != r.KIND_SERVER:
            return
        if not span.trace_flags & 1:  # not exported: nothing would carry the value
            self.skipped_unsampled += 1
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
        entry = self._open.pop(span, None)
        if entry is None:
            return
        if entry[0] != _thread_id():
            self.skipped_other_thread += 1
            return
        span.attributes[REQUEST_CPU_TIME] = thread_cpu_ns() - entry[1]

    @property
    def open_spans(self) -> int:
        """Spans started and not yet ended (bounded by :data:`MAX_OPEN`)."""
        return len(self._open)
