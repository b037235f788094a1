"""A profiling session's state: what the request path touches while it runs, and its public view.

Request path (only while a session runs): :meth:`Session.enter` opens a ``record_function`` range named
with the request's ids (:func:`~zoomer_serve.profiling.labels.request_label`) and :meth:`Session.leave`
closes it, counts the request as covered, and advances ``KinetoStepTracker`` by one step. While the range is
open it is one of the span's thread joins (:class:`RequestRange`): a ``phase`` of the request that runs on
another thread (an executor thread of a grpc.aio server) opens a range of the same name there, so that
thread's operators and kernels are the request's too. The session is also the profiler's scope
(:class:`~zoomer_serve.recording.recorder.ProfileScope`, :meth:`Session.holds`) from before the profiler starts
until it stopped: only its admitted requests' phases, and those of the batches serving them, become ranges.


Companions (:class:`SessionCompanion`) record something else for the same window as the kernel profiler (the
host telemetry's Python CPU sampler, :mod:`zoomer_serve.host.cpu_profile`); what they return goes onto the
``zoomer.profile`` span (``Session.extra_attributes``).
"""

from __future__ import annotations

import fnmatch
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from zoomer_serve.profiling.config import SessionOptions
from zoomer_serve.profiling.labels import enter_thread_request, exit_thread_request, request_label
from zoomer_serve.recording import RequestSpan, internal_error
from zoomer_serve.recording import records as r

STEP_REQUESTER = "zoomer_serve.request"
"""The ``KinetoStepTracker`` requester name: one step per covered request."""


class State(str, Enum):
    """Controller states: ``idle`` (no session), ``armed`` (accepted, profiler starting), ``running``
    (requests are covered), ``writing`` (no new requests; draining, stopping, writing the trace)."""

    IDLE = "idle"
    ARMED = "armed"
    RUNNING = "running"
    WRITING = "writing"


class Result(str, Enum):
    """What a control call did."""

    STARTED = "started"
    ALREADY_RUNNING = "already_running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    NOT_RUNNING = "not_running"
    ALREADY_STOPPING = "already_stopping"
    STATUS = "status"


class CompanionRun(Protocol):
    """One session's recording by a companion. ``stop`` runs on the session thread once the covered requests
    have ended (or the drain gave up), right before the kernel profiler stops, so that the profiler's own stop is
    not recorded; ``finish`` after the trace was written and returns attributes for the ``zoomer.profile`` span.
    Neither may raise (failures become attributes)."""

    def stop(self) -> None: ...

    def finish(self) -> dict[str, Any]: ...


class SessionCompanion(Protocol):
    """Records alongside every profiling session: ``begin`` runs on the session thread right after the kernel
    profiler started (before requests are covered) with the session id, the profiles folder its files go to
    and the longest the session may last (ms); it returns a :class:`CompanionRun`, or None to sit this session
    out. It may block briefly (the session's start waits) and must not raise."""

    def begin(self, session_id: str, folder: Path, max_duration_ms: int) -> CompanionRun | None: ...


@dataclass(frozen=True)
class CoveredRequest:
    """A request span that a session covered: ids, W3C flags/state, name, and its time range (Unix epoch
    ns; ``end_ns`` is when its range closed, a few µs before the span's own end)."""

    trace_id: int
    span_id: int
    trace_flags: int
    trace_state: str | None
    name: str
    start_ns: int
    end_ns: int

    @property
    def sampled(self) -> bool:
        return bool(self.trace_flags & 1)


@dataclass(frozen=True)
class SessionInfo:
    """A session as callers see it (all times Unix epoch ns, durations µs).

    ``number``: 1, 2, ... per controller; ``session_id``: ``<service>_<UTC time>_<trigger>_<number>``, also
    the trace file's stem; ``outcome``: None while active, then ``done`` or ``failed`` (``error`` says why);
    ``requests``: covered requests so far (final once done); ``requests_incomplete``: admitted requests whose
    range was still open when the profiler stopped (not covered); ``stop_reason``: ``max_requests``,
    ``duration``, ``stop_call`` or ``shutdown``; ``trace_path`` / ``trace_bytes``: the gzip Chrome trace;
    ``kernel_*``: GPU kernel totals of the whole trace; ``attributed_share``: kernel time attributed to
    requests / all kernel time (None without kernels).
    """

    number: int
    session_id: str
    trigger: str
    state: State
    max_requests: int
    duration_ms: int
    cuda: bool
    outcome: str | None = None
    error: str | None = None
    requests: int = 0
    stop_reason: str | None = None
    start_time_unix_nano: int = 0
    end_time_unix_nano: int = 0
    trace_path: str | None = None
    trace_bytes: int = 0
    kernel_count: int = 0
    kernel_time_us: float = 0.0
    attributed_share: float | None = None
    requests_incomplete: int = 0


@dataclass(frozen=True)
class ControlReply:
    """The answer to a start, stop or status call: ``result``, the controller ``state`` after the call, a
    human ``message``, the ``session`` concerned (active or just finished) and the ``last`` finished one."""

    result: Result
    state: State
    message: str
    session: SessionInfo | None = None
    last: SessionInfo | None = None


class Session:
    """One session's mutable state, shared by the request path and the session thread."""

    def __init__(self, number: int, session_id: str, trigger: str, options: SessionOptions,
                 max_requests: int, duration_ms: int, cuda: bool, excluded_methods: tuple[str, ...],
                 trigger_attributes: dict[str, Any] | None = None) -> None:
        self.number = number
        self.session_id = session_id
        self.trigger = trigger
        self.trigger_attributes = dict(trigger_attributes or {})
        self.extra_attributes: dict[str, Any] = {}  # from the companions, onto the zoomer.profile span
        self.options = options
        self.max_requests = max_requests
        self.duration_ms = duration_ms
        self.cuda = cuda
        self.state = State.ARMED
        self.outcome: str | None = None
        self.error: str | None = None
        self.stop_reason: str | None = None
        self.start_ns = 0
        self.end_ns = 0
        self.trace_path: str | None = None
        self.trace_bytes = 0
        self.kernel_count = 0
        self.kernel_time_us = 0.0
        self.attributed_share: float | None = None
        self.covered: list[CoveredRequest] = []
        self.open: dict[RequestSpan, tuple[Any, int, RequestRange | None]] = {}
        self.incomplete = 0
        self.wrapper_ns = 0  # thread CPU time spent in enter/leave on the request path (the overhead figure)
        self.running = threading.Event()  # set once running, or once the start failed
        self.stop_requested = threading.Event()
        self.done = threading.Event()
        self._admitted = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._leaving = 0  # leaves between taking their range and counting the request
        self._excluded = excluded_methods
        self._covers: dict[str, bool] = {}
        self._batches: set[RequestSpan] = set()  # batches serving a request of the session (hold_batch)

    # -- request path -------------------------------------------------------------------------------
    def covers(self, span: RequestSpan) -> bool:
        """Server spans of methods not excluded (decided once per name)."""
        if span.kind != r.KIND_SERVER:
            return False
        hit = self._covers.get(span.name)
        if hit is None:
            hit = not any(fnmatch.fnmatchcase(span.name, g) for g in self._excluded)
            if len(self._covers) < 1000:
                self._covers[span.name] = hit
        return hit

    def enter(self, span: RequestSpan) -> None:
        """Open the request's profiler range (at most ``max_requests`` requests are admitted)."""
        t0 = time.thread_time_ns()
        if not self.covers(span) or next(self._admitted) >= self.max_requests:
            return
        join = RequestRange(request_label(span.trace_id, span.span_id), (span.trace_id, span.span_id, span.name))
        try:
            rf = join.enter()
        except Exception as exc:
            internal_error("profiling.enter", exc)
            return
        with self._lock:
            if not self._closed:
                self.open[span] = (rf, time.thread_time_ns() - t0, join)
                span.add_thread_join(join)  # the request's phases on other threads open the range there too
                return
        join.exit(rf)  # the session closed meanwhile

    def adopt(self, span: RequestSpan) -> bool:
        """Count a request that started before the session ran as covered when it ends, without a range of its
        own (its batch's range and member markers attribute its work: :mod:`zoomer_serve.batching`). Admitted
        like :meth:`enter` (within ``max_requests``); False when not admitted."""
        if not self.covers(span) or next(self._admitted) >= self.max_requests:
            return False
        with self._lock:
            if self._closed or span in self.open:
                return False
            self.open[span] = (None, 0, None)
            return True

    def leave(self, span: RequestSpan) -> None:
        """Close the request's range, count it as covered, advance the Kineto step; ask for the stop once
        ``max_requests`` covered requests have ended. A request counts only when its range closed while the
        profiler still ran (the session thread waits for leaves in progress before it stops the profiler)."""
        with self._lock:
            if self._closed:
                return
            entry = self.open.pop(span, None)
            if entry is None:
                return
            self._leaving += 1
        t0 = time.thread_time_ns()
        end_ns = span.now_ns()  # the request's clock: its profile.request child ends inside it
        rf, enter_ns, join = entry
        if join is not None:  # None: adopted, no range of its own
            span.remove_thread_join(join)
            join.exit(rf)
        from torch.autograd.profiler import KinetoStepTracker

        with self._lock:
            self._leaving -= 1
            if self._closed:  # the drain gave up on this one: its range is unfinished in the trace
                return
            try:
                KinetoStepTracker.increment_step(STEP_REQUESTER)
            except Exception as exc:
                internal_error("profiling.step", exc)
            self.covered.append(CoveredRequest(span.trace_id, span.span_id, span.trace_flags, span.trace_state,
                                               span.name, span.start_ns, end_ns))
            self.wrapper_ns += enter_ns + time.thread_time_ns() - t0
            full = len(self.covered) >= self.max_requests
        if full:
            self.request_stop("max_requests")

    # -- profile scope (zoomer_serve.recording.recorder.ProfileScope) ------------------------------------
    def holds(self, span: RequestSpan | None) -> bool:
        """True while ``span`` is one of the session's requests with its range open (admitted, not yet ended)
        or a batch that serves one (:meth:`hold_batch`): its phases become profiler ranges, nested in that range.
        Phases outside them (requests past ``max_requests``, before the session ran or after its bound, work
        outside any request) add no range to the trace, though the profiler still runs."""
        if span is None:
            return False
        entry = self.open.get(span)
        return (entry is not None and entry[2] is not None) or span in self._batches

    def hold_batch(self, batch: RequestSpan, members: Sequence[RequestSpan | None]) -> bool:
        """A batch starts: held (its range and phases go into the trace) when at least one member is a request of
        the session (admitted, with a range of its own or adopted through this batch, :meth:`adopt`)."""
        with self._lock:
            if self._closed or not any(m is not None and m in self.open for m in members):
                return False
            self._batches.add(batch)
            return True

    def release_batch(self, batch: RequestSpan) -> None:
        with self._lock:
            self._batches.discard(batch)

    # -- session thread -----------------------------------------------------------------------------
    def request_stop(self, reason: str) -> bool:
        """Ask the session to end; True for the first request (its reason is kept)."""
        with self._lock:
            if self.stop_requested.is_set():
                return False
            self.stop_reason = reason
            self.stop_requested.set()
            return True

    def wait_drained(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the admitted requests still running to end (and their leaves to
        finish)."""
        deadline = time.monotonic() + timeout_s
        while (self.open or self._leaving) and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Stop counting (once the profiler stopped); close the ranges of requests that did not end in time
        (they are in the trace as unfinished and not covered)."""
        with self._lock:
            self._closed = True
            left = list(self.open.items())
            self.open.clear()
            self._batches.clear()
            self.incomplete += len(left) + self._leaving
        for span, (rf, _, join) in left:
            if join is not None:
                span.remove_thread_join(join)
                join.exit(rf)

    def drop_uncovered(self, in_trace: Any) -> None:
        """Keep as covered only the requests whose finished range is in the trace (``in_trace`` holds
        ``(trace_id, span_id)`` keys); the others count as incomplete."""
        kept = [c for c in self.covered if (c.trace_id, c.span_id) in in_trace]
        self.incomplete += len(self.covered) - len(kept)
        self.covered = kept

    def info(self) -> SessionInfo:
        return SessionInfo(
            number=self.number, session_id=self.session_id, trigger=self.trigger, state=self.state,
            max_requests=self.max_requests, duration_ms=self.duration_ms, cuda=self.cuda, outcome=self.outcome,
            error=self.error, requests=len(self.covered), stop_reason=self.stop_reason,
            start_time_unix_nano=self.start_ns, end_time_unix_nano=self.end_ns, trace_path=self.trace_path,
            trace_bytes=self.trace_bytes, kernel_count=self.kernel_count, kernel_time_us=self.kernel_time_us,
            attributed_share=self.attributed_share, requests_incomplete=self.incomplete)


class RequestRange:
    """A covered request's ``record_function`` range (named ``label``), as a thread join of its span
    (:meth:`~zoomer_serve.recording.recorder.RequestSpan.add_thread_join`): the session opens it on the
    request's thread, and the request's phases open it on any other thread they run on. ``enter`` raises
    what torch raises; ``exit`` never raises (failures are counted). With ``request`` (``(trace_id, span_id,
    rpc.method)``) it also marks the thread as running the request for the CPU sampler
    (:data:`~zoomer_serve.profiling.labels.THREAD_REQUESTS`) while the range is open."""

    __slots__ = ("label", "request")

    def __init__(self, label: str, request: tuple[int, int, str] | None = None) -> None:
        self.label = label
        self.request = request

    def enter(self) -> Any:
        import torch

        rf = torch.profiler.record_function(self.label)
        rf.__enter__()
        return rf, (enter_thread_request(*self.request) if self.request is not None else None)

    def exit(self, token: Any) -> None:
        rf, marked = token
        if marked is not None:
            exit_thread_request(marked)
        try:
            rf.__exit__(None, None, None)
        except Exception as exc:
            internal_error("profiling.range_exit", exc)
