"""The profiling controller: at most one torch.profiler session at a time, linked to request spans.

Usage::

    controller = ProfilerController()          # the process's telemetry; ProfilerConfig.from_env()
    controller.attach()                        # observe request spans
    reply = controller.start(SessionOptions(max_requests=50))
    ...
    reply = controller.stop(wait_s=30)         # reply.session.trace_path

States (:class:`~zoomer_serve.profiling.session.State`): ``idle`` → ``armed`` (a start was accepted; the
session thread starts the profiler; one long-lived thread runs every session of a controller, see
:mod:`zoomer_serve.profiling.worker`) → ``running`` (each new server request span runs inside a
``record_function`` range named :func:`~zoomer_serve.profiling.labels.request_label` and advances
``KinetoStepTracker`` when it ends; only the phases of those requests, and of batches serving them, become
ranges: :meth:`~zoomer_serve.profiling.session.Session.holds`) → ``writing`` (the bound was reached or stop was called: no new
request is covered; the covered requests still running get ``drain_timeout_ms`` to end; the profiler stops;
the trace is written, then summarized and gzip-compressed by a child process (large traces cost the server
neither its interpreter lock nor its memory), and the spans and metrics are exported) → ``idle``.

Start and stop are serialized by one lock and idempotent: a start while a session is active answers
``already_running`` (nothing else happens), a stop without an active session ``not_running``, a second stop
``already_stopping`` (after waiting, as the first does, for the trace, whose path it then gives); each
session writes exactly one trace or fails with an error. A start that cannot capture (another profiler active,
CUDA requested but missing, profiles folder not writable) raises :class:`ProfilingError`.

Companions: each session also runs the :class:`~zoomer_serve.profiling.session.SessionCompanion` objects in
``companions`` for its window (by default those of the telemetry's host part: the Python CPU sampler of
:mod:`zoomer_serve.host.cpu_profile`, whose files go beside the trace); their attributes go onto the
``zoomer.profile`` span. A companion that cannot record says so in its attributes; the session goes on.

Request path cost: outside a session, ``on_start`` / ``on_end`` read one attribute each (plus one bounded
append when an automatic trigger is configured); see :mod:`zoomer_serve.profiling.session` for the cost
inside a session.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zoomer_serve.processes import run_module
from zoomer_serve.profiling.capture import Activities, Capture, CaptureError
from zoomer_serve.profiling.config import (
    TRIGGER_ON_DEMAND,
    ProfilerConfig,
    SessionOptions,
    check_trigger,
)
from zoomer_serve.profiling.export import ProfileMetrics, export_session
from zoomer_serve.profiling.session import (
    CompanionRun,
    ControlReply,
    Result,
    Session,
    SessionCompanion,
    SessionInfo,
    State,
)
from zoomer_serve.profiling.summary import TraceSummary, summary_from_json
from zoomer_serve.profiling.worker import SessionWorker
from zoomer_serve.recording import RequestRecorder, RequestSpan, internal_error
from zoomer_serve.recording.recorder import set_profile_scope

logger = logging.getLogger("zoomer_serve.profiling")
TRACE_SUFFIX = ".pt.trace.json.gz"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class ProfilingError(RuntimeError):
    """A session could not start (or could not capture); the message says why."""


class ProfilerController:
    """Runs profiling sessions for the request spans of ``recorder`` (see the module docstring).

    Args:
        config: limits, profiles folder, triggers; default ``ProfilerConfig.from_env()``.
        telemetry: where spans and metrics go (its ``recorder`` and ``meter_provider``) and whose
            ``config.service_name`` names the trace files; default the process's (``get_telemetry()``). Its
            ``host`` part (when on) provides the default ``companions``.
    """

    def __init__(self, config: ProfilerConfig | None = None, telemetry: Any = None) -> None:
        if telemetry is None:
            from zoomer_serve.runtime import get_telemetry

            telemetry = get_telemetry()
        self.config = config or ProfilerConfig.from_env()
        self.recorder: RequestRecorder = telemetry.recorder
        self.service_name: str = telemetry.config.service_name
        self._metrics = ProfileMetrics(telemetry.meter_provider)
        self._api_lock = threading.Lock()  # serializes start and stop calls
        self._lock = threading.Lock()  # guards the fields below (held briefly)
        self._session: Session | None = None  # the active session (armed, running or writing)
        self._last: Session | None = None
        self._numbers = 0
        # request path: read without the lock
        self._admitting: Session | None = None  # set while running
        self._closing: Session | None = None  # set while running and writing (covered requests may end)
        self._feed: Callable[[RequestSpan, int], None] | None = None
        self._monitor: Any = None
        self._attached = False
        self.on_session_end: list[Callable[[SessionInfo], None]] = []
        self._worker = SessionWorker("zoomer-profile")  # every session runs on this one thread
        host = getattr(telemetry, "host", None)
        self.companions: list[SessionCompanion] = list(host.session_companions()) if host is not None else []
        from zoomer_serve.artifacts import session_artifacts

        artifacts = session_artifacts(self.config.profiles_dir, dict(getattr(telemetry, "resource", None) or {}))
        if artifacts is not None:  # last: it uploads the files the others wrote
            self.companions.append(artifacts)

    # -- observer (request path) -------------------------------------------------------------------------
    def on_start(self, span: RequestSpan) -> None:
        session = self._admitting
        if session is not None:
            session.enter(span)

    def on_end(self, span: RequestSpan) -> None:
        session = self._closing
        if session is not None:
            session.leave(span)
        feed = self._feed
        if feed is not None:
            feed(span, span.now_ns())  # on the request's clock: a wall-clock step is no slow request

    # -- lifecycle -----------------------------------------------------------------------------------------
    def attach(self) -> ProfilerController:
        """Observe the recorder's request spans and start the configured triggers; returns self."""
        if not self._attached:
            self.recorder.add_observer(self)
            self._attached = True
            if self.config.steady_state is not None or self.config.latency_slo is not None:
                from zoomer_serve.profiling.triggers import TriggerMonitor

                self._monitor = TriggerMonitor(self, self.config.steady_state, self.config.latency_slo)
                self._feed = self._monitor.feed
                self._monitor.start()
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the triggers, stop an active session and wait up to ``timeout_s`` for its trace, end the
        session thread, stop observing requests."""
        deadline = time.monotonic() + timeout_s
        self._feed = None
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        with self._api_lock:
            session = self._session
            if session is not None:
                session.request_stop("shutdown")
        if session is not None:
            session.done.wait(timeout_s)
        self._worker.close(max(0.0, deadline - time.monotonic()))
        if self._attached:
            self.recorder.remove_observer(self)
            self._attached = False

    # -- control -------------------------------------------------------------------------------------------
    @property
    def state(self) -> State:
        session = self._session
        return session.state if session is not None else State.IDLE

    def status(self) -> ControlReply:
        """The current state, the active session (if any) and the last finished one."""
        with self._lock:
            return self._reply(Result.STATUS, self._status_message(), self._session)

    def start(self, options: SessionOptions | None = None, trigger: str = TRIGGER_ON_DEMAND,
              trigger_attributes: dict[str, Any] | None = None, wait: bool = True) -> ControlReply:
        """Start a session with ``options`` (default: ``SessionOptions()``).

        With ``wait`` (the default) it returns once the profiler runs; without, at once (state ``armed``;
        a failure then shows as the session's outcome). Called from an ``on_session_end`` callback (on the
        session thread) it does not wait. A session already active: result
        ``already_running`` and nothing changes.

        Raises:
            ConfigError: bad bounds or trigger name (the message names them).
            ProfilingError: the session cannot capture (the message says why); the controller stays idle.
        """
        options = options or SessionOptions()
        check_trigger(trigger)
        max_requests, duration_ms = options.bounded(self.config.max_requests_cap, self.config.max_duration_ms_cap)
        with self._api_lock:
            with self._lock:
                active = self._session
                if active is not None:
                    return self._reply(Result.ALREADY_RUNNING, f"already running: session {active.session_id} "
                                       f"({active.state.value})", active)
            try:
                activities = Activities.resolve(options)
                self._check_profiles_dir()
            except (CaptureError, OSError) as exc:
                raise ProfilingError(f"cannot start a profiling session: {exc}") from None
            with self._lock:
                self._numbers += 1
                session = Session(self._numbers, self._session_id(trigger, self._numbers), trigger, options,
                                  max_requests, duration_ms, activities.cuda, self.config.excluded_methods,
                                  trigger_attributes)
                self._session = session
            self._worker.submit(lambda: self._run(session, activities))
            if not wait or self._worker.on_thread():  # an on_session_end callback: the session runs after it
                with self._lock:
                    return self._reply(Result.STARTED, f"session {session.session_id} armed", session)
            if not session.running.wait(self.config.start_timeout_ms / 1000):
                session.request_stop("start_timeout")
                raise ProfilingError(f"the profiler did not start within {self.config.start_timeout_ms} ms")
            if session.outcome == "failed":
                raise ProfilingError(f"cannot start a profiling session: {session.error}")
            with self._lock:
                return self._reply(Result.STARTED, f"session {session.session_id} running", session)

    def stop(self, wait_s: float = 0.0, reason: str = "stop_call") -> ControlReply:
        """Ask the active session to end (``reason`` becomes its ``stop_reason``) and wait up to ``wait_s``
        seconds for its trace.

        Results: ``stopped`` (it finished within ``wait_s``; the session info has ``trace_path``), ``stopping``
        (it did not, or ``wait_s`` is 0), ``not_running`` without an active session. A stop that finds the
        session already ending (another stop, its bound, a trigger) starts nothing and answers
        ``already_stopping``, after the same wait: once the session finished, its info and message carry the
        trace path too, so every caller learns where the one trace is."""
        with self._api_lock, self._lock:
            session = self._session
            if session is None:
                return self._reply(Result.NOT_RUNNING, "not running: no active profiling session", None)
            first = session.request_stop(reason)
            ending = f"already stopping: session {session.session_id} ({session.state.value}, {session.stop_reason})"
        finished = wait_s > 0 and session.done.wait(wait_s)
        with self._lock:
            if first and finished:
                return self._reply(Result.STOPPED, self._finished_message(session), session)
            if first:
                return self._reply(Result.STOPPING, f"stopping: session {session.session_id}", session)
            if finished:
                ending = f"already stopping ({session.stop_reason}), now {self._finished_message(session)}"
            return self._reply(Result.ALREADY_STOPPING, ending, session)

    def cover(self, span: RequestSpan, open_range: bool = True) -> bool:
        """Cover ``span``, a request that started before the running session, as if it had started inside it:
        with ``open_range`` its range opens on this thread (call it on the thread that runs the request's work;
        its phases elsewhere open the range there too), without, it is counted as covered when it ends and its
        work is attributed through its batch's range (:mod:`zoomer_serve.batching`). False when no session is
        running or it is full."""
        session = self._admitting
        if session is None:
            return False
        if not open_range:
            return session.adopt(span)
        session.enter(span)
        return span in session.open

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the active session (if any) to finish; True when idle."""
        session = self._session
        return session is None or session.done.wait(timeout_s)

    @property
    def last(self) -> SessionInfo | None:
        """The last finished session."""
        last = self._last
        return last.info() if last is not None else None

    # -- session thread ------------------------------------------------------------------------------------
    def _run(self, session: Session, activities: Activities) -> None:
        capture = Capture(session.options, activities)
        summary: TraceSummary | None = None
        runs: list[CompanionRun] = []
        set_profile_scope(session)  # from before the profiler starts until it stopped: only its requests' phases
        try:
            try:
                capture.start({"zoomer_session_id": session.session_id, "zoomer_trigger": session.trigger,
                               "zoomer_service": self.service_name})
            except CaptureError as exc:
                session.outcome, session.error = "failed", str(exc)
                return
            runs = self._begin_companions(session)
            session.start_ns = time.time_ns()
            with self._lock:
                session.state = State.RUNNING
            self._closing = session
            self._admitting = session
            session.running.set()
            session.stop_requested.wait(session.duration_ms / 1000)
            session.request_stop("duration")
            self._admitting = None
            with self._lock:
                session.state = State.WRITING
            session.wait_drained(self.config.drain_timeout_ms / 1000)
            session.end_ns = time.time_ns()
            _stop_companions(runs)  # before the profiler's own stop (seconds of CPU under load) is sampled too
            try:
                capture.stop()
            finally:
                self._closing = None
                session.close()
                set_profile_scope(None, replacing=session)
            summary = self._write(session, capture)
            session.drop_uncovered(summary.requests)
            session.outcome = "done"
        except Exception as exc:  # CaptureError, OSError, ValueError from reading the trace, or a bug
            session.outcome, session.error = "failed", str(exc) or repr(exc)
            logger.warning("zoomer-serve: profiling session %s failed: %s", session.session_id, session.error)
        finally:
            self._admitting = None
            self._closing = None
            set_profile_scope(None, replacing=session)
            self._finish_companions(session, runs)
            self._finish(session, summary)

    def _begin_companions(self, session: Session) -> list[CompanionRun]:
        runs = []
        for companion in list(self.companions):
            try:
                run = companion.begin(session.session_id, self.config.profiles_dir, session.duration_ms)
            except Exception as exc:
                internal_error("profiling.companion_begin", exc)
                continue
            if run is not None:
                runs.append(run)
        return runs

    @staticmethod
    def _finish_companions(session: Session, runs: list[CompanionRun]) -> None:
        _stop_companions(runs)  # again, for a session that failed before they were stopped (idempotent)
        for run in runs:
            try:
                session.extra_attributes.update(run.finish())
            except Exception as exc:
                internal_error("profiling.companion_finish", exc)

    def _finish(self, session: Session, summary: TraceSummary | None) -> None:
        try:
            if session.start_ns:  # a session whose profiler never ran has no span
                export_session(session, summary, time.time_ns(), self.config.top_kernels, self.recorder.sink)
            self._metrics.record(session, summary)
        except Exception as exc:
            internal_error("profiling.export", exc)
        with self._lock:
            session.state = State.IDLE
            self._last = session
            self._session = None
        session.running.set()
        session.done.set()
        info = session.info()
        for callback in list(self.on_session_end):
            try:
                callback(info)
            except Exception as exc:
                internal_error("profiling.on_session_end", exc)

    def _write(self, session: Session, capture: Capture) -> TraceSummary:
        """Export the trace, then summarize and compress it in a child process (see
        :mod:`zoomer_serve.profiling.postprocess`); sets the session's trace fields. The per-request summary
        stays beside the trace as ``<session_id>.summary.json`` (an artifact, :mod:`zoomer_serve.artifacts`).

        Raises CaptureError / OSError / ValueError; leaves no partial file behind."""
        folder = self.config.profiles_dir
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"{session.session_id}{TRACE_SUFFIX}"
        raw = folder / f".{session.session_id}.json.partial"
        packed = folder / f".{session.session_id}{TRACE_SUFFIX}.partial"
        digest = folder / f".{session.session_id}.summary.json.partial"
        try:
            try:
                capture.export_json(raw)
            finally:
                capture.release()  # the events are in the file; post-processing reads them there
            summary = self._postprocess(raw, packed, digest)
            os.replace(packed, final)
            os.replace(digest, folder / f"{session.session_id}.summary.json")  # kept: an artifact of its own
        finally:
            for leftover in (raw, packed, digest):
                leftover.unlink(missing_ok=True)
        session.trace_path = str(final.resolve())
        session.trace_bytes = final.stat().st_size
        session.kernel_count = summary.totals.kernel_count
        session.kernel_time_us = summary.totals.kernel_time_us
        session.attributed_share = summary.attributed_share
        return summary

    def _postprocess(self, raw: Path, packed: Path, digest: Path) -> TraceSummary:
        from zoomer_serve.profiling.postprocess import EXIT_EMPTY

        try:
            done = run_module("zoomer_serve.profiling.postprocess",
                              [str(raw), str(packed), str(digest), "--top-kernels", str(self.config.top_kernels)],
                              self.config.postprocess_timeout_ms / 1000)
        except subprocess.TimeoutExpired:
            raise CaptureError(f"post-processing the trace took longer than {self.config.postprocess_timeout_ms} "
                               "ms") from None
        if done.returncode == EXIT_EMPTY:
            raise CaptureError("the profiler captured no events; no trace written")
        if done.returncode != 0:
            raise CaptureError(f"post-processing the trace failed (exit {done.returncode}): "
                               f"{done.stderr.strip()[-500:]}")
        return summary_from_json(json.loads(digest.read_text(encoding="utf-8")))

    # -- helpers -----------------------------------------------------------------------------------------
    def _check_profiles_dir(self) -> None:
        folder = self.config.profiles_dir
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OSError(f"profiles folder {folder} is not writable")

    def _session_id(self, trigger: str, number: int) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        service = _UNSAFE.sub("-", self.service_name).strip("-.") or "service"
        return f"{service}_{stamp}_{trigger}_{number}"

    def _status_message(self) -> str:
        session = self._session
        if session is not None:
            return f"{session.state.value}: session {session.session_id}, {len(session.covered)} requests"
        if self._last is not None:
            return f"idle; last: {self._finished_message(self._last)}"
        return "idle; no session yet"

    @staticmethod
    def _finished_message(session: Session) -> str:
        if session.outcome == "done":
            return (f"session {session.session_id} done: {len(session.covered)} requests, "
                    f"trace {session.trace_path}")
        return f"session {session.session_id} failed: {session.error}"

    def _reply(self, result: Result, message: str, session: Session | None) -> ControlReply:
        last = self._last
        return ControlReply(result, self.state, message, session.info() if session is not None else None,
                            last.info() if last is not None else None)


def _stop_companions(runs: list[CompanionRun]) -> None:
    for run in runs:
        try:
            run.stop()
        except Exception as exc:
            internal_error("profiling.companion_stop", exc)


def install_profiler(config: ProfilerConfig | None = None, telemetry: Any = None) -> ProfilerController:
    """Create a :class:`ProfilerController` for the process's telemetry and attach it (convenience)."""
    return ProfilerController(config, telemetry).attach()

