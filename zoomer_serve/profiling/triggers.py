"""Automatic triggers: a session once latency is steady, and a session when a method's p99 breaks its SLO.

The request path only appends ``(method, duration, end time)`` of each ended server span to a bounded
queue (:meth:`TriggerMonitor.feed`; a full queue drops and counts). A monitor thread drains it every tick,
groups durations into time windows by end time (windows aligned to ``window_ms``; a window closes
``window_ms / 4`` after its end so that late entries still land), and evaluates the criteria documented
on :class:`~zoomer_serve.profiling.config.SteadyStateConfig` and
:class:`~zoomer_serve.profiling.config.LatencySloConfig`. Starts are non-blocking (``wait=False``).
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from zoomer_serve.profiling.config import (
    TRIGGER_LATENCY_SLO,
    TRIGGER_STEADY_STATE,
    LatencySloConfig,
    SteadyStateConfig,
)
from zoomer_serve.profiling.session import Result, SessionInfo
from zoomer_serve.profiling.stats import coefficient_of_variation, percentile
from zoomer_serve.recording import RequestSpan, internal_error
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.profiling")
MAX_QUEUED = 100_000
ALL = "*"


class MethodMatcher:
    """True for ``pkg.Service/Method`` names matching ``include`` globs (None: all) and no ``exclude`` glob."""

    def __init__(self, include: tuple[str, ...] | None, exclude: tuple[str, ...]) -> None:
        self.include, self.exclude = include, exclude
        self._cache: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        hit = self._cache.get(name)
        if hit is None:
            hit = ((self.include is None or any(fnmatch.fnmatchcase(name, g) for g in self.include))
                   and not any(fnmatch.fnmatchcase(name, g) for g in self.exclude))
            if len(self._cache) < 10_000:
                self._cache[name] = hit
        return hit


class Windows:
    """Durations (ms) grouped per key into time windows of ``window_ms`` by end time."""

    def __init__(self, window_ms: int) -> None:
        self.window_ns = window_ms * 1_000_000
        self.grace_ns = self.window_ns // 4
        self._open: dict[tuple[str, int], list[float]] = {}
        self._closed_until: dict[str, int] = {}  # per key: windows below this index are closed
        self.late = 0

    def add(self, key: str, duration_ms: float, end_ns: int) -> None:
        index = end_ns // self.window_ns
        if index < self._closed_until.get(key, 0):
            self.late += 1
            return
        self._open.setdefault((key, index), []).append(duration_ms)

    def close(self, now_ns: int) -> Iterator[tuple[str, int, list[float]]]:
        """The windows that ended at least a grace period before ``now_ns``, oldest first."""
        due = sorted(k for k in self._open if (k[1] + 1) * self.window_ns + self.grace_ns <= now_ns)
        for key, index in due:
            self._closed_until[key] = max(self._closed_until.get(key, 0), index + 1)
            yield key, index, self._open.pop((key, index))


class SteadyStateTrigger:
    """See :class:`~zoomer_serve.profiling.config.SteadyStateConfig`."""

    def __init__(self, config: SteadyStateConfig) -> None:
        self.config = config
        self.windows = Windows(config.window_ms)
        self.seen = 0
        self.fired = False
        self.session_number = 0  # the session it started
        self._run: list[tuple[int, float]] = []  # (window index, p50 ms) of consecutive counted windows

    def add(self, name: str, duration_ms: float, end_ns: int) -> None:
        if self.fired:
            return
        self.seen += 1
        if self.seen > self.config.warmup_requests:
            self.windows.add(ALL, duration_ms, end_ns)

    def evaluate(self, now_ns: int, controller: Any) -> None:
        cfg = self.config
        for _key, index, values in self.windows.close(now_ns):
            if self.fired:
                return
            if len(values) < cfg.min_requests:
                self._run = []
                continue
            if self._run and index != self._run[-1][0] + 1:
                self._run = []
            self._run.append((index, percentile(sorted(values), 50)))
            self._run = self._run[-cfg.windows:]
            if len(self._run) < cfg.windows:
                continue
            p50s = [p for _, p in self._run]
            cv = coefficient_of_variation(p50s)
            if cv <= cfg.max_cv:
                self.session_number = _fire(controller, cfg.session, TRIGGER_STEADY_STATE, {
                    "p50_ms": round(p50s[-1], 3), "cv": round(cv, 4), "windows": cfg.windows,
                    "window_ms": cfg.window_ms, "warmup_requests": cfg.warmup_requests})
                self.fired = self.session_number > 0


class LatencySloTrigger:
    """See :class:`~zoomer_serve.profiling.config.LatencySloConfig`."""

    def __init__(self, config: LatencySloConfig) -> None:
        self.config = config
        self.windows = Windows(config.window_ms)
        self.fired = 0
        self._runs: dict[str, tuple[int, int]] = {}  # method -> (last window index, violating windows in a row)
        self._pending: int | None = None  # number of the session it started, until that session ends
        self._quiet_until_ns = 0

    def add(self, name: str, duration_ms: float, end_ns: int) -> None:
        self.windows.add(name, duration_ms, end_ns)

    def session_ended(self, info: SessionInfo) -> None:
        """Start the cooldown when the session this trigger started has finished writing."""
        if info.number == self._pending:
            self._quiet_until_ns = time.time_ns() + self.config.cooldown_ms * 1_000_000
            self._pending = None

    def evaluate(self, now_ns: int, controller: Any) -> None:
        cfg = self.config
        for method, index, values in self.windows.close(now_ns):
            p99 = percentile(sorted(values), 99)
            violating = len(values) >= cfg.min_requests and p99 > cfg.p99_ms
            last_index, run = self._runs.get(method, (index - 1, 0))
            run = (run + 1 if index == last_index + 1 else 1) if violating else 0
            self._runs[method] = (index, run)
            if run < cfg.sustain_windows or self._pending is not None or now_ns < self._quiet_until_ns:
                continue
            number = _fire(controller, cfg.session, TRIGGER_LATENCY_SLO, {
                "method": method, "p99_ms": round(p99, 3), "threshold_ms": cfg.p99_ms,
                "sustain_windows": cfg.sustain_windows, "window_ms": cfg.window_ms})
            if number:
                self.fired += 1
                self._pending = number
                self._runs.clear()


def _fire(controller: Any, options: Any, trigger: str, attributes: dict[str, Any]) -> int:
    """Start a session without waiting; the session number, or 0 when none started."""
    try:
        reply = controller.start(options, trigger=trigger, trigger_attributes=attributes, wait=False)
    except Exception as exc:  # ProfilingError / ConfigError: logged once, counted, tried again later
        internal_error(f"profiling.trigger.{trigger}", exc)
        return 0
    if reply.result is Result.STARTED and reply.session is not None:
        logger.info("zoomer-serve: %s trigger started profiling session %s (%s)", trigger,
                    reply.session.session_id, attributes)
        return reply.session.number
    return 0


class TriggerMonitor:
    """Feeds ended request spans to the configured triggers and evaluates them on a background thread."""

    def __init__(self, controller: Any, steady: SteadyStateConfig | None, slo: LatencySloConfig | None,
                 max_queued: int = MAX_QUEUED) -> None:
        self.controller = controller
        excluded = controller.config.excluded_methods
        self.steady = SteadyStateTrigger(steady) if steady is not None else None
        self.slo = LatencySloTrigger(slo) if slo is not None else None
        self._steady_match = MethodMatcher(steady.methods, excluded) if steady is not None else None
        self._slo_match = MethodMatcher(slo.methods, excluded) if slo is not None else None
        if self.slo is not None:
            controller.on_session_end.append(self.slo.session_ended)
        windows = [c.window_ms for c in (steady, slo) if c is not None]
        self.tick_s = min(1.0, max(0.02, min(windows) / 4000)) if windows else 1.0
        self._queue: deque[tuple[str, int, int]] = deque()
        self._max = max_queued
        self.dropped = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def feed(self, span: RequestSpan, end_ns: int) -> None:
        """Request path: queue one ended server span (bounded; drops and counts when full)."""
        if span.kind != r.KIND_SERVER:
            return
        if len(self._queue) >= self._max:
            self.dropped += 1
            return
        self._queue.append((span.name, end_ns - span.start_ns, end_ns))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="zoomer-profile-triggers", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.slo is not None and self.slo.session_ended in self.controller.on_session_end:
            self.controller.on_session_end.remove(self.slo.session_ended)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick(time.time_ns())
            except Exception as exc:
                internal_error("profiling.triggers", exc)

    def tick(self, now_ns: int) -> None:
        """Drain the queue into the triggers' windows, then evaluate the windows that closed."""
        queue = self._queue
        steady, slo = self.steady, self.slo
        while queue:
            name, duration_ns, end_ns = queue.popleft()
            ms = duration_ns / 1e6
            if steady is not None and self._steady_match is not None and self._steady_match(name):
                steady.add(name, ms, end_ns)
            if slo is not None and self._slo_match is not None and self._slo_match(name):
                slo.add(name, ms, end_ns)
        if steady is not None:
            steady.evaluate(now_ns, self.controller)
        if slo is not None:
            slo.evaluate(now_ns, self.controller)
