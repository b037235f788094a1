"""The server side's handle on one export helper process (``python -m zoomer_serve.export.helper``).

The helper is started as a subprocess (fork + exec, never a bare fork: grpcio is not fork-safe) in a session of
its own, so that signals aimed at the server's process group (Ctrl+C in a terminal, ``kill -TERM -PGID``,
``tini -g``) do not reach it: it outlives them, takes the server's last frames and drains when the server's
end of the pipe closes. A reader thread takes its JSON lines (:mod:`zoomer_serve.export.helper`) as they come,
so the server always knows the helper's last reported counters: what a helper that died took with it can be
counted, and shutdown waits for the final ``stats`` line without a thread of its own.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from zoomer_serve.export import frames
from zoomer_serve.export.worker import SPAN_OUTCOMES

READY_TIMEOUT_S = 30.0
_ROOM_POLL_S = 0.5  # a blocking write looks this often whether the helper still runs
LAST_LINES_TIMEOUT_S = 2.0
"""Seconds a helper that died is given for its last lines to be read (its stdout to reach its end)."""


class HelperProcess:
    """One started helper. ``sent_spans`` / ``sent_records``: what was written to it; :attr:`counters`: its last
    ``progress`` or ``stats`` line (the fields of :class:`~zoomer_serve.export.worker.ExportStats`).

    Raises (from :meth:`start`):
        RuntimeError: it did not say it was ready within ``timeout_s`` (it is killed).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self._spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._cond = threading.Condition()
        self._events: dict[str, dict[str, Any]] = {}
        self._eof = False
        self._launching = False  # launch_in_background: Popen has not returned yet
        self._killed = False
        self.launch_error: OSError | None = None
        """Why :meth:`launch_in_background` could not start the process; None otherwise."""
        self.sent_spans = 0
        self.sent_records = 0
        self.sent_calls = 0  # of sent_records, the calls (request records)
        self._out = bytearray()  # the rest of the last frame taken, which the pipe had no room for yet
        self._nonblocking_fd = -1  # the stdin descriptor made non-blocking

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> HelperProcess:
        """Start it and wait until it is ready (:meth:`launch`, then :meth:`wait_ready`).

        Raises:
            RuntimeError: it did not say it was ready within ``timeout_s`` seconds (it is killed).
            OSError: it could not be started.
        """
        self.launch()
        if not self.wait_ready(timeout_s):
            self.kill()
            raise RuntimeError("zoomer-serve: the export helper process did not start within "
                               f"{timeout_s:.0f} s (python -m zoomer_serve.export.helper; see its stderr)")
        return self

    def launch(self) -> HelperProcess:
        """Start the process without waiting for it (a fresh interpreter: about 0.2 s on an idle machine,
        seconds on a busy one); :meth:`ready` says when it takes frames. ``subprocess.Popen`` itself returns
        only once the new process has exec'd (0.7 s measured on 2 busy vCPUs); see :meth:`launch_in_background`.

        Raises:
            OSError: it could not be started.
        """
        env = dict(os.environ, ZOOMER_WORKER_CONFIG=json.dumps(self._spec))
        proc = subprocess.Popen(
            [sys.executable, "-m", "zoomer_serve.export.helper"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, close_fds=True, start_new_session=True)
        with self._cond:
            self._proc = proc
            killed = self._killed
        if killed:  # killed while Popen ran (launch_in_background)
            self.kill()
            return self
        threading.Thread(target=self._read_events, name="zoomer-export-events", daemon=True).start()
        return self

    def launch_in_background(self) -> HelperProcess:
        """:meth:`launch` on a thread of its own, so that the caller (the pipeline's writer thread, which must keep
        taking records) never waits for ``subprocess.Popen``. Until Popen returns the helper counts as
        :meth:`alive` and not :meth:`ready`; when Popen fails, :attr:`launch_error` holds the OSError and the
        helper is no longer alive."""
        self._launching = True
        threading.Thread(target=self._launch_quietly, name="zoomer-export-launch", daemon=True).start()
        return self

    def _launch_quietly(self) -> None:
        try:
            self.launch()
        except OSError as exc:
            self.launch_error = exc
            with self._cond:
                self._eof = True
                self._cond.notify_all()
        finally:
            self._launching = False

    def ready(self) -> bool:
        """Whether it said it was ready (never blocks)."""
        with self._cond:
            return "ready" in self._events

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for it to say it is ready; False when it did not (or its stdout
        closed first)."""
        return self.wait_event("ready", timeout_s) is not None

    def _read_events(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        try:
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("{"):
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and isinstance(event.get("event"), str):
                    with self._cond:
                        self._events[event["event"]] = event
                        self._cond.notify_all()
        except (OSError, ValueError):
            pass
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_event(self, name: str, timeout_s: float, seq: int | None = None) -> dict[str, Any] | None:
        """The latest ``name`` event (with ``"seq": seq`` or later when given), waiting up to ``timeout_s``;
        None when it did not come (or the helper's stdout closed first)."""
        def arrived() -> bool:
            event = self._events.get(name)
            found = event is not None and (seq is None or event.get("seq", -1) >= seq)
            return found or self._eof

        with self._cond:
            self._cond.wait_for(arrived, max(0.0, timeout_s))
            event = self._events.get(name)
            if event is None or (seq is not None and event.get("seq", -1) < seq):
                return None
            return event

    @property
    def counters(self) -> dict[str, Any]:
        """The helper's last reported counters (``stats`` if it sent them, else the last ``progress``)."""
        with self._cond:
            return dict(self._events.get("stats") or self._events.get("progress") or {})

    def alive(self) -> bool:
        """Whether it runs, or is being launched (:meth:`launch_in_background`)."""
        if self._launching:
            return True
        proc = self._proc
        return proc is not None and proc.poll() is None and not self._eof

    def send(self, frame: bytes, block: bool = True, deadline: float | None = None) -> bool:
        """Write one frame, after what is left of the frames before it (:attr:`pending_bytes`). The pipe is
        non-blocking: ``block=False`` never waits; it returns False, the frame not taken, when the earlier
        frames' rest still does not fit the pipe; a frame taken may be written in part, its rest kept to go
        first next time. ``block=True`` waits until the pipe took everything (up to ``deadline``,
        ``time.monotonic()``, when given) and returns True.

        Raises:
            OSError: the helper is gone (a broken pipe), was disowned, or exited while a write waited;
                TimeoutError (an OSError) at ``deadline``.
        """
        fd = self._stdin_fd()
        if not self._push(fd, block, deadline):
            return False
        view = memoryview(frame)
        written = _write_some(fd, view)
        if written < len(view):
            self._out = bytearray(view[written:])
            if block:
                self._push(fd, True, deadline)
        return True

    @property
    def pending_bytes(self) -> int:
        """Bytes of a frame taken by :meth:`send` that the pipe had no room for yet."""
        return len(self._out)

    def push(self, block: bool = False) -> bool:
        """Write what is left of the last frame taken; unless ``block``, only as far as the pipe takes it without
        waiting. True once nothing is left.

        Raises:
            OSError: the helper is gone (a broken pipe), was disowned, or exited while a write waited.
        """
        return self._push(self._stdin_fd(), block, None)

    def _stdin_fd(self) -> int:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise OSError("no export helper")
        fd = proc.stdin.fileno()
        if fd != self._nonblocking_fd:
            os.set_blocking(fd, False)
            self._nonblocking_fd = fd
        return fd

    def _push(self, fd: int, block: bool, deadline: float | None) -> bool:
        """Write :attr:`pending_bytes` to ``fd``; when ``block``, wait for room (see :meth:`send`)."""
        out = self._out
        while out:
            written = _write_some(fd, out)
            del out[:written]
            if not out or written:
                continue
            if not block:
                return False
            self._wait_for_room(fd, deadline)
        return True

    def _wait_for_room(self, fd: int, deadline: float | None) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("the export helper took no frame before the deadline")
        wait_s = _ROOM_POLL_S if deadline is None else min(_ROOM_POLL_S, max(0.0, deadline - time.monotonic()))
        poller = select.poll()  # not select.select: a server's descriptors may pass FD_SETSIZE
        poller.register(fd, select.POLLOUT)
        poller.poll(wait_s * 1000)
        if not self.alive():
            raise BrokenPipeError("the export helper exited")

    def unreported_spans(self) -> int:
        """Spans written to the helper that its last counters do not account for (neither exported nor
        dropped): what it takes with it if it is gone."""
        c = self.counters
        done = sum(int(c.get(k, 0)) for k in SPAN_OUTCOMES)
        return max(0, self.sent_spans - done)

    def taken_spans(self, timeout_s: float = LAST_LINES_TIMEOUT_S) -> tuple[int, int]:
        """What a helper that is gone took with it, in spans: ``(lost, unknown)``. Its lines are read to the end
        of its stdout first (up to ``timeout_s`` seconds). Of the spans written to it (:attr:`sent_spans`), those
        its last line accounts for are settled; those of the export request it said it was sending
        (``in_flight``) may have reached the collector: unknown; the rest never left it (in the pipe, its queue
        or its pending batch): lost. When its stdout did not end in time, every unsettled span is unknown."""
        with self._cond:
            complete = self._cond.wait_for(lambda: self._eof, max(0.0, timeout_s))
        unreported = self.unreported_spans()
        if not complete:
            return 0, unreported
        in_flight = min(unreported, max(0, int(self.counters.get("in_flight", 0))))
        return unreported - in_flight, in_flight

    def calls_missing_from_metrics(self) -> int:
        """Of the calls written to a helper that is gone (:attr:`sent_calls`), those in no RPC metric export it
        reported accepted (``metric_calls`` of its last line) and that it did not report dropped
        (``dropped_calls``, counted with its other counters): they are missing from the RPC metrics. Call after
        :meth:`taken_spans` (which reads its lines to the end)."""
        c = self.counters
        covered = int(c.get("metric_calls", 0)) + int(c.get("dropped_calls", 0))
        return max(0, self.sent_calls - covered)

    def stop(self, deadline: float) -> dict[str, Any] | None:
        """Ask for the final flush (budget: up to ``deadline``, ``time.monotonic()``), close its stdin and wait
        for its ``stats`` line and its exit; kill it at the deadline. Returns the stats, or None when it did
        not report."""
        proc = self._proc
        if proc is None:
            return None
        try:
            if proc.stdin is not None:
                budget_s = max(0.1, deadline - time.monotonic() - 0.5)  # leave it time to report and exit
                self.send(frames.encode(frames.SHUTDOWN, budget_s), deadline=deadline)
                proc.stdin.close()
        except (OSError, ValueError):
            pass
        stats = self.wait_event("stats", deadline - time.monotonic())
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return stats

    def kill(self) -> None:
        """End a helper that is being replaced (it stopped answering); one still being launched is ended as soon
        as its Popen returns."""
        with self._cond:
            self._killed = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def disown(self) -> None:
        """In a process forked from the one that started the helper: let go of the helper's pipes without
        writing, flushing or closing anything the parent still uses. Our copies of the pipe descriptors are
        pointed at /dev/null (closing them would let a later ``close()`` of the inherited file objects hit
        whatever file reuses the number), so the helper sees its stdin close when the parent's copy closes."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream, mode in ((proc.stdin, os.O_WRONLY), (proc.stdout, os.O_RDONLY)):
            if stream is None:
                continue
            try:
                null = os.open(os.devnull, mode)
                try:
                    os.dup2(null, stream.fileno())
                finally:
                    os.close(null)
            except (OSError, ValueError):
                pass
        _DISOWNED.append(proc)  # never collected: its finalizer would wait for a child that is not ours


_DISOWNED: list[subprocess.Popen[bytes]] = []


def _write_some(fd: int, data: bytes | bytearray | memoryview) -> int:
    """``os.write`` on a non-blocking descriptor: how many bytes the pipe took, 0 when it had no room."""
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
