"""The locust side of load-test profiling: start one profiling session on the target once the load is steady,
and make sure it ends before the test does (imports gevent; used by :mod:`zoomer_serve.loadtest.plugin`).

Only the process that runs the test decides: a single process (``LocalRunner``) or the master of a
master/worker run (``MasterRunner``); workers never call the target's admin service, so a run starts at most
one session. The criterion, checked every 0.2 s once spawning has completed (``spawning_complete``):

1. ``warmup_s`` seconds have passed since spawning completed, and
2. locust counted ``warmup_requests`` requests since then, and at least one (on a master: as the workers
   reported them, every 3 s; a test that sends no request is never profiled), and
3. with ``stable_cv`` set: the coefficient of variation of the last ``stable_samples`` one-second samples of
   locust's rolling median response time (``StatsEntry.get_current_response_time_percentile(0.5)``, a ~10 s
   window) is at most ``stable_cv``.

Then ``ProfilerControl.Start`` is called once (trigger ``load_test``, the configured bounds, the token from
``ZOOMER_ADMIN_TOKEN``); it is not retried, whatever the answer (``already_running``: another session is
active; an error: a closed admin service, an unreachable target ...): the record says what happened. The
session ends at its bounds, or at ``test_stopping`` (locust is about to stop its users) with a ``Stop``;
:meth:`SteadyStateProfiler.finish` then waits up to ``stop_wait_s`` for the trace.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import gevent

from zoomer_serve.loadtest.config import LoadTestOptions, grpc_target
from zoomer_serve.profiling import Result
from zoomer_serve.profiling.config import TRIGGER_LOAD_TEST
from zoomer_serve.profiling.stats import coefficient_of_variation

logger = logging.getLogger("zoomer_serve.loadtest")
TICK_S = 0.2
SAMPLE_S = 1.0


@dataclass
class TriggerRecord:
    """What the trigger did in a run (JSON-able; times are Unix epoch seconds).

    ``state``: ``idle`` (spawning never completed), ``warming`` (the criterion was not met before the test
    stopped), ``started`` (a session runs), ``finished`` (the session ended: see ``session``), ``refused`` (the
    start answered ``already_running``), ``failed`` (the call failed or the session did not finish in time),
    ``off`` (profiling disabled). ``reason``: why, in words. ``warmup_elapsed_s``: seconds from spawning
    complete to the Start call (monotonic clock); ``requests_before_start``: locust's count in that time;
    ``rolling_p50_ms`` / ``rolling_cv``: the stability samples and their last CV. ``session``: the final
    ``SessionInfo`` as a dict.
    """

    state: str = "idle"
    reason: str | None = None
    target: str | None = None
    spawning_complete_s: float | None = None
    start_called_s: float | None = None
    warmup_elapsed_s: float | None = None
    requests_before_start: int | None = None
    rolling_p50_ms: list[float] = field(default_factory=list)
    rolling_cv: float | None = None
    session: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def stable(samples: list[float], count: int, max_cv: float) -> tuple[bool, float | None]:
    """``(stable, cv)`` of the last ``count`` samples: stable when there are ``count`` of them and their
    coefficient of variation (population standard deviation / mean) is at most ``max_cv``."""
    if len(samples) < count:
        return False, None
    cv = coefficient_of_variation(samples[-count:])
    return cv <= max_cv, cv


def decides(runner: Any) -> bool:
    """True for the runner that decides about profiling: a local runner or a master."""
    from locust.runners import LocalRunner, MasterRunner

    return isinstance(runner, (LocalRunner, MasterRunner))


class SteadyStateProfiler:
    """Starts one session on ``options.target`` (or the environment's host) once the run is steady.

    Args:
        environment: the locust Environment (its runner must exist: :meth:`attach` checks it decides).
        options: the settings.
        client_factory: ``client_factory(target)`` -> a :class:`~zoomer_serve.profiling.client.ProfilerClient`
            (default: the real one, token from ``ZOOMER_ADMIN_TOKEN``).
    """

    def __init__(self, environment: Any, options: LoadTestOptions, client_factory: Any = None) -> None:
        self.environment = environment
        self.options = options
        self.record = TriggerRecord(state="idle" if options.profile else "off")
        self._client_factory = client_factory
        self._client: Any = None
        self._watch: gevent.Greenlet | None = None
        self._stopping = False
        self._stop_sent = False
        self._number = 0
        self._samples: collections.deque[float] = collections.deque(maxlen=max(2, options.stable_samples))

    # -- wiring --------------------------------------------------------------------------------------------
    def attach(self) -> bool:
        """Listen to the environment's events when its runner decides; False (nothing attached) otherwise."""
        if not self.options.profile or not decides(self.environment.runner):
            return False
        try:
            self.record.target = grpc_target(self.options.target or self.environment.host, "--zoomer-target")
        except Exception as exc:
            self._fail(str(exc))
            return False
        events = self.environment.events
        events.spawning_complete.add_listener(self._on_spawning_complete)
        events.test_stopping.add_listener(self._on_test_stopping)
        return True

    def _on_spawning_complete(self, user_count: int = 0, **_: Any) -> None:
        if self._watch is not None or self.record.state not in ("idle",):
            return  # once per run: a later ramp (web UI, shape) does not start another session
        self.record.state = "warming"
        self.record.spawning_complete_s = time.time()
        self._watch = gevent.spawn(self._run, time.monotonic(), self._request_count())

    def _on_test_stopping(self, **_: Any) -> None:
        self._stopping = True
        if self.record.state == "started":
            self._ask_stop()
        elif self.record.state in ("idle", "warming"):
            if self._watch is not None:
                self._watch.kill(block=False)
            if self.record.state == "idle":
                self.record.reason = "spawning did not complete before the test stopped"
            else:
                self.record.reason = self._warmup_progress("the test stopped before the warm-up passed")

    # -- the watch greenlet --------------------------------------------------------------------------------
    def _request_count(self) -> int:
        return int(self.environment.runner.stats.total.num_requests)

    def _run(self, t0: float, n0: int) -> None:
        try:
            self._watch_until_started(t0, n0)
        except Exception as exc:  # a bug here must not take the load test down: record it
            self._fail(f"the profiling trigger failed: {exc!r}")

    def _watch_until_started(self, t0: float, n0: int) -> None:
        self._t0, self._n0 = t0, n0
        next_sample = t0 + SAMPLE_S
        while not self._stopping:
            now = time.monotonic()
            if self.options.stable_cv is not None and now >= next_sample:
                next_sample = now + SAMPLE_S
                self._sample()
            if self._ready(now):
                self._start()
                return
            gevent.sleep(TICK_S)

    def _sample(self) -> None:
        try:
            p50 = self.environment.runner.stats.total.get_current_response_time_percentile(0.5)
        except ValueError:  # the stats keep no rolling window (a worker's stats)
            p50 = None
        if p50:
            self._samples.append(float(p50))
            self.record.rolling_p50_ms = list(self._samples)

    def _ready(self, now: float) -> bool:
        opts = self.options
        if now - self._t0 < opts.warmup_s or self._request_count() - self._n0 < self._requests_needed:
            return False
        if opts.stable_cv is None:
            return True
        ok, cv = stable(list(self._samples), opts.stable_samples, opts.stable_cv)
        self.record.rolling_cv = cv
        return ok

    @property
    def _requests_needed(self) -> int:
        return max(1, self.options.warmup_requests)

    def _warmup_progress(self, prefix: str) -> str:
        t0 = getattr(self, "_t0", None)
        if t0 is None:
            return prefix
        opts = self.options
        parts = [f"{time.monotonic() - t0:.1f} of {opts.warmup_s:g} s",
                 f"{self._request_count() - self._n0} of {self._requests_needed} requests"]
        if opts.stable_cv is not None:
            cv = "n/a" if self.record.rolling_cv is None else f"{self.record.rolling_cv:.3f}"
            parts.append(f"rolling-median CV {cv} (needs <= {opts.stable_cv:g} over {opts.stable_samples} "
                         f"samples, {len(self._samples)} taken)")
        return f"{prefix}: {', '.join(parts)}"

    def _profiler(self) -> Any:
        if self._client is None:
            target = str(self.record.target)  # set by attach()
            if self._client_factory is not None:
                self._client = self._client_factory(target)
            else:
                from zoomer_serve.profiling.client import ProfilerClient

                self._client = ProfilerClient(target)
        return self._client

    def _start(self) -> None:
        opts = self.options
        self.record.start_called_s = time.time()
        self.record.warmup_elapsed_s = time.monotonic() - self._t0
        self.record.requests_before_start = self._request_count() - self._n0
        try:
            reply = self._profiler().start(max_requests=opts.profile_requests, duration_ms=opts.duration_ms,
                                           cuda=opts.session_options().cuda, trigger=TRIGGER_LOAD_TEST)
        except Exception as exc:  # ProfilerControlError (refused, unreachable ...) or a bad option
            self._fail(f"ProfilerControl.Start on {self.record.target} failed: {exc}")
            return
        if reply.result is not Result.STARTED or reply.session is None:
            self.record.state = "refused"
            self.record.reason = f"ProfilerControl.Start answered {reply.result.value}: {reply.message}"
            logger.warning("zoomer-serve loadtest: %s", self.record.reason)
            return
        self._number = reply.session.number
        self.record.state = "started"
        self.record.session = _plain(reply.session)
        logger.info("zoomer-serve loadtest: profiling session %s started on %s", reply.session.session_id,
                    self.record.target)
        if self._stopping:
            self._ask_stop()
        self._await_end(None)

    def _await_end(self, timeout_s: float | None) -> None:
        """Poll until the session finished (records it) or ``timeout_s`` passed (None: until killed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            try:
                last = self._profiler().status().last
            except Exception as exc:
                self._fail(f"ProfilerControl.Status on {self.record.target} failed: {exc}")
                return
            if last is not None and last.number >= self._number:
                self.record.session = _plain(last)
                self.record.state = "finished" if last.number == self._number else "failed"
                if last.number != self._number:
                    self.record.reason = f"session #{self._number} was superseded by #{last.number}"
                return
            gevent.sleep(0.25)

    def _ask_stop(self) -> None:
        if self._stop_sent:
            return
        self._stop_sent = True
        try:
            self._profiler().stop(wait_s=0)
        except Exception as exc:
            logger.warning("zoomer-serve loadtest: ProfilerControl.Stop on %s failed: %s", self.record.target, exc)

    def _fail(self, reason: str) -> None:
        self.record.state = "failed"
        self.record.reason = reason
        logger.warning("zoomer-serve loadtest: %s", reason)

    # -- the end -------------------------------------------------------------------------------------------
    def finish(self) -> TriggerRecord:
        """After the test stopped: make sure an active session was asked to stop, wait up to ``stop_wait_s``
        for its trace, close the admin channel; returns the record."""
        if self.record.state == "started":
            self._ask_stop()
            if self._watch is not None:
                self._watch.join(self.options.stop_wait_s)
            if self.record.state == "started":
                if self._watch is not None:
                    self._watch.kill(block=False)
                self._fail(f"the server did not finish session #{self._number} within {self.options.stop_wait_s:g} "
                           "s (--zoomer-stop-wait-s)")
        elif self._watch is not None and not self._watch.dead:
            self._watch.kill(block=False)
        if self._client is not None:
            self._client.close()
            self._client = None
        return self.record


def _plain(value: Any) -> dict[str, Any]:
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(value).items()}
