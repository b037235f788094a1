"""Per-request CPU time: a request observer that puts the thread CPU time of each SERVER span on it as
``zoomer.request.cpu_time_ns`` (see :mod:`zoomer_serve.host.names`), next to the span's wall time.

``on_start`` reads ``time.thread_time_ns()`` and the thread id; ``on_end`` reads them again and, when the span
ends on the thread it started on, sets the difference. Spans that start on an asyncio event loop are skipped
(the loop's thread runs many requests at once), and so are spans that end on another thread (a streaming
response finished from gRPC's callback thread). Cost: two clock reads, two thread-id reads and one dict
insert and pop per request (about 1 µs in a hot loop; see ``benchmarks/_bench_host.py``). In a busy
multi-threaded server it costs more: each read is a system call (``clock_gettime(CLOCK_THREAD_CPUTIME_ID)``,
not served by the vDSO) that brings the scheduler's accounting up to date and can preempt the thread there,
while it holds the interpreter lock; on the 2-core benchmark machine (Linux 6.18) that meant about 0.7 more
involuntary and 2.4 more voluntary context switches per demo-model request, and 30 to 60 µs more server CPU
in most paired runs, nothing measurable in others (benchmarks/RESULTS.md). ``ZOOMER_HOST_REQUEST_CPU_TIME=false``
turns it off.
"""

from __future__ import annotations

import logging
from asyncio import _get_running_loop as _running_loop  # C function: this thread's running loop or None
from threading import get_ident as _thread_id
from time import thread_time_ns as _thread_time_ns

from zoomer_serve.host.names import REQUEST_CPU_TIME
from zoomer_serve.recording import RequestSpan
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.host")
MAX_OPEN = 65_536
"""Open request spans tracked at once; beyond, new spans get no CPU time (counted in ``skipped_full``)."""


class RequestCpuTimeObserver:
    """A :class:`~zoomer_serve.recording.recorder.RequestObserver` (``recorder.add_observer``) that sets
    ``zoomer.request.cpu_time_ns`` (int, ns) on SERVER spans that start and end on one OS thread.

    Counters of the spans left without the attribute (approximate under concurrency; for tests and
    diagnostics): ``skipped_event_loop`` (started on an asyncio loop),
    ``skipped_other_thread`` (ended on another thread), ``skipped_full`` (more than :data:`MAX_OPEN` open).
    """

    def __init__(self) -> None:
        self._open: dict[RequestSpan, tuple[int, int]] = {}
        self.skipped_event_loop = 0
        self.skipped_other_thread = 0
        self.skipped_full = 0
        self._warned = False

    def on_start(self, span: RequestSpan) -> None:
        if span.kind != r.KIND_SERVER:
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
        span.attributes[REQUEST_CPU_TIME] = _thread_time_ns() - entry[1]

    @property
    def open_spans(self) -> int:
        """Spans started and not yet ended (bounded by :data:`MAX_OPEN`)."""
        return len(self._open)
