"""What the locust plugin adds so that a run's figures and exit code tell the truth, above all with a master
and workers (locust's distributed mode). Imports gevent; used by :mod:`zoomer_serve.loadtest.plugin`.

- **Last reports.** When a test stops, the master asks every worker (custom message
  :data:`LAST_REPORT`) to stop its users (locust's ``--stop-timeout`` applies) and send its last statistics,
  and waits for each to confirm, at most ``stop_timeout`` + :data:`LAST_REPORT_GRACE_S` seconds. locust's own
  headless quit waits 0.5 s for those statistics: the calls that ended later (those a ``--stop-timeout``
  lets finish, or any on a loaded machine) were missing from the master's figures, though the server
  answered them.
- **Failed workers.** A worker that had an unhandled error (its log has the traceback; e.g. a user class it
  does not have) says so in each statistics report it sends (key :data:`WORKER_FAILED`); the master logs it
  once per worker. A worker that is missing (locust's heartbeat check: no heartbeat for 3 s) instead of
  sending its last report failed too: it crashed, was killed, or exited before it could report. locust
  exits a worker 1, silently, when an unhandled error happened while its ``init`` handlers ran: a master
  may send users to a worker that is still starting (its runner connects before ``init``), so a worker that
  lacks the user class can die before its first report. The master stops waiting for the last report of a
  worker missing for :data:`MISSING_GIVE_UP_S` seconds.
- **Exit code.** The deciding process (a single process or the master) exits 1 when a worker failed, or
  when a test ran and no request was sent, whatever locust would have answered (it exits 0 when every
  worker failed before sending anything). A master stopped by a signal first collects the last reports.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import gevent

logger = logging.getLogger("zoomer_serve.loadtest")

LAST_REPORT = "zoomer_last_report"
"""Custom message, master to worker: stop your users and send your last statistics."""
LAST_REPORT_SENT = "zoomer_last_report_sent"
"""Custom message, worker to master: my last statistics are sent (they travel before this message)."""
WORKER_FAILED = "zoomer_worker_failed"
"""Key of a worker's statistics report: why the worker failed (absent while it has not)."""
LAST_REPORT_GRACE_S = 30.0
"""Seconds the master waits for the last reports beyond locust's ``--stop-timeout``."""
MISSING_GIVE_UP_S = 5
"""Seconds the master still waits for the last report of a worker that locust marked missing (no heartbeat for
3 s): one that comes back in time is waited for as any other."""


def _unhandled_error() -> bool:
    import locust.log

    return bool(locust.log.unhandled_greenlet_exception)


def _is_missing(client: Any) -> bool:
    """locust's master marks a worker missing after 3 s without a heartbeat (it may come back)."""
    from locust.runners import STATE_MISSING

    return bool(client.state == STATE_MISSING)


def _gone(client: Any) -> bool:
    """Missing for :data:`MISSING_GIVE_UP_S` more seconds (locust counts a missing worker's ``heartbeat`` down
    by one a second, below zero)."""
    return _is_missing(client) and client.heartbeat <= -MISSING_GIVE_UP_S


class RunCheck:
    """The checks above for one locust process; :meth:`attach` wires them to its runner's events."""

    def __init__(self, environment: Any) -> None:
        self.environment = environment
        self.test_started = False
        self.failed_workers: dict[str, str] = {}
        self._awaiting: set[str] = set()

    def attach(self) -> RunCheck:
        from locust.runners import MasterRunner, WorkerRunner

        runner, events = self.environment.runner, self.environment.events
        if isinstance(runner, WorkerRunner):
            events.report_to_master.add_listener(self._on_report_to_master)
            runner.register_message(LAST_REPORT, lambda **_: gevent.spawn(self._send_last_report))
            return self
        if isinstance(runner, MasterRunner):
            events.worker_report.add_listener(self._on_worker_report)
            events.test_stop.add_listener(self._collect_last_reports)
            runner.register_message(LAST_REPORT_SENT, self._on_last_report_sent)
        events.test_start.add_listener(self._on_test_start)
        events.quitting.add_listener(self._on_quitting)
        return self

    # -- worker --------------------------------------------------------------------------------------------
    def _on_report_to_master(self, data: dict[str, Any], **_: Any) -> None:
        if _unhandled_error():
            data[WORKER_FAILED] = "an unhandled error (the worker's log has its traceback)"

    def _send_last_report(self) -> None:
        runner = self.environment.runner
        try:
            runner.stop()
            runner._send_stats()  # locust's own report (private, but the only way to send one now)
        finally:
            runner.send_message(LAST_REPORT_SENT, {})

    # -- master --------------------------------------------------------------------------------------------
    def _on_worker_report(self, client_id: str, data: dict[str, Any], **_: Any) -> None:
        reason = data.get(WORKER_FAILED)
        if reason:
            self._worker_failed(client_id, str(reason))

    def _worker_failed(self, client_id: str, reason: str) -> None:
        if client_id not in self.failed_workers:
            self.failed_workers[client_id] = reason
            logger.error("zoomer-serve loadtest: worker %s failed: %s", client_id, reason)

    def _on_last_report_sent(self, msg: Any, **_: Any) -> None:
        self._awaiting.discard(msg.node_id)

    def _collect_last_reports(self, **_: Any) -> None:
        runner = self.environment.runner
        self._awaiting = {client.id for client in runner.clients.all}
        for client_id in sorted(self._awaiting):
            runner.send_message(LAST_REPORT, {}, client_id)
        limit_s = (self.environment.stop_timeout or 0) + LAST_REPORT_GRACE_S
        deadline = time.monotonic() + limit_s
        while self._still_expected(runner) and time.monotonic() < deadline:
            gevent.sleep(0.05)
        unreported = [client for client in runner.clients.all if client.id in self._awaiting]
        for client in unreported:
            if _is_missing(client):
                self._worker_failed(client.id, "it went missing (no heartbeat: it crashed, was killed or exited; "
                                               "its log says why) before its last report")
        late = [client for client in unreported if not _is_missing(client)]
        if late:
            logger.warning("zoomer-serve loadtest: no last report from %d worker(s) within %.0f s; the figures "
                           "may miss their last requests", len(late), limit_s)

    def _still_expected(self, runner: Any) -> bool:
        """Some worker has not sent its last report and has not been missing for :data:`MISSING_GIVE_UP_S`."""
        return any(client.id in self._awaiting and not _gone(client) for client in runner.clients.all)

    @staticmethod
    def _stop_test_first(runner: Any) -> None:
        """A master stopped by a signal (Ctrl+C, SIGTERM) while its test runs: stop the test now, as locust's
        ``quit`` does next, so that the workers' last reports (:meth:`_collect_last_reports`) are counted
        before the exit code is decided. locust decides it first, from the reports so far: one stopped within
        a worker's first report interval (3 s) would say that no request was sent. (locust's ``stop`` does
        nothing when no test runs or one is already stopping.)"""
        from locust.runners import MasterRunner

        if isinstance(runner, MasterRunner):
            runner.stop(send_stop_to_client=False)

    # -- deciding process ----------------------------------------------------------------------------------
    def _on_test_start(self, **_: Any) -> None:
        self.test_started = True

    def problems(self) -> list[str]:
        """Why the run failed, in words (empty when it did not)."""
        found = [f"{len(self.failed_workers)} worker(s) failed"] if self.failed_workers else []
        if self.test_started and self.environment.runner.stats.total.num_requests == 0:
            found.append("no request was sent")
        return found

    def _on_quitting(self, environment: Any, **_: Any) -> None:
        self._stop_test_first(environment.runner)
        problems = self.problems()
        if not problems:
            return
        logger.error("zoomer-serve loadtest: the run failed: %s (exit code 1)", "; ".join(problems))
        if not environment.process_exit_code:
            environment.process_exit_code = 1
