"""Small helpers for the child processes zoomer-serve starts (export helper, demo collector and server,
post-processing of profiles): long-lived ones announce themselves with JSON lines on stdout, which the parent
waits for with a timeout.

The long-lived children of a command (the ``demo``'s and ``loadtest``'s collector and server, ``loadtest``'s locust)
run in a process group of their own (:func:`child_popen_kwargs`): a Ctrl+C in the terminal reaches the command
alone, which stops them in order (load, then server, whose telemetry flushes into the collector, then the
collector: :class:`SignalStop`); and on Linux they get SIGTERM when the command dies, even of SIGKILL, so none
lives on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
"""The folder that holds ``zoomer_serve/`` (put first on the children's ``PYTHONPATH``)."""


def run_module(module: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``python -m MODULE ARGS...`` with this interpreter, this package importable (its folder first on
    ``PYTHONPATH``), output captured as text, and wait for it.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout_s`` seconds (it is killed).
    """
    path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", module, *args], env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=timeout_s)


class StopRequested(Exception):
    """A stop (:class:`SignalStop`) came while a child was starting; the child was stopped."""


class SignalStop:
    """While entered: SIGINT and SIGTERM set :attr:`event` instead of raising KeyboardInterrupt or ending the
    process, so that the command can stop its load and its children in order; the handlers that were there
    before come back on exit. With ``announce`` (the default) the first signal is said on stderr, with the order
    of the stop, and a second one while stopping is only noted there (the stop in progress goes on, bounded by
    the children's stop timeouts): stopping the children out of order would lose what the server had not flushed
    yet. The signals are acted on even when the command started with SIGINT ignored (as ``serve-demo`` and
    ``collector`` do). Off the main thread, where Python cannot install handlers, nothing is routed: only
    :attr:`event` (``event``, when given, is the one set) stops the command."""

    def __init__(self, name: str, *, event: threading.Event | None = None, announce: bool = True) -> None:
        self.name = name
        self.event = event if event is not None else threading.Event()
        self.announce = announce
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if self.announce:
            name = signal.Signals(signum).name
            if first:
                message = (f"\n{self.name}: {name} received: stopping the load, then the server (it flushes its "
                           "telemetry), then the collector")
            else:
                message = f"{self.name}: {name} received again: already stopping, in order"
            print(message, file=sys.stderr, flush=True)
        self.event.set()

    @property
    def stopped(self) -> bool:
        return self.event.is_set()

    @property
    def signal_name(self) -> str:
        """The first signal's name (``SIGINT``, ``SIGTERM``); "" when none came."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the shell's convention; 0 when none came."""
        return 128 + self.signum if self.signum is not None else 0


PARENT_PID_VAR = "ZOOMER_PARENT_PID"
"""Set by :func:`child_popen_kwargs` in a child's environment: the pid of the command that started it, which the
child (:func:`die_with_parent`, run first thing by ``python -m zoomer_serve`` and by :data:`LOCUST_BOOT`)
follows into death."""

LOCUST_BOOT = ("import runpy; from zoomer_serve.processes import die_with_parent; die_with_parent(); "
               "runpy.run_module('locust', run_name='__main__', alter_sys=True)")
"""``python -c LOCUST_BOOT ARGS...`` is ``python -m locust ARGS...`` that first follows its parent into death."""


def die_with_parent() -> None:
    """In a child started with :func:`child_popen_kwargs`: take :data:`PARENT_PID_VAR` out of the environment (so
    that this process's own children do not act on it) and, on Linux, ask for SIGTERM when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``), SIGKILL included; SIGTERM at once when it is already gone. Done here, after
    ``exec``, not in a ``preexec_fn``, which is not safe in a parent with threads. Nothing without the variable
    or off Linux."""
    raw = os.environ.pop(PARENT_PID_VAR, None)
    if raw is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        parent_pid = int(raw)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (ValueError, OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def child_popen_kwargs(env: dict[str, str] | None = None) -> dict[str, Any]:
    """``subprocess.Popen`` arguments for a long-lived child of a command: a process group of its own (a
    Ctrl+C in the terminal goes to the command alone, which stops its children in order), stdin from
    /dev/null (it never reads the terminal), and ``env`` (default: this process's) with :data:`PARENT_PID_VAR`,
    so that a child that runs :func:`die_with_parent` gets SIGTERM when the command dies (on Linux; of SIGKILL
    too: no child lives on)."""
    kwargs: dict[str, Any] = {"stdin": subprocess.DEVNULL,
                              "env": {**(os.environ if env is None else env), PARENT_PID_VAR: str(os.getpid())}}
    if sys.version_info >= (3, 11):
        kwargs["process_group"] = 0
    else:
        kwargs["start_new_session"] = True
    return kwargs


def wait_for_event(proc: subprocess.Popen[bytes], event: str, timeout_s: float,
                   stop: threading.Event | None = None) -> dict[str, Any] | None:
    """Read ``proc``'s stdout lines until a JSON object with ``"event": event`` arrives; return it, or None
    when the timeout passes, stdout closes or ``stop`` is set first. Other lines are skipped."""
    found: list[dict[str, Any]] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("{"):
                continue
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict) and data.get("event") == event:
                found.append(data)
                return

    reader = threading.Thread(target=read, name=f"wait-{event}", daemon=True)
    reader.start()
    if stop is None:
        reader.join(timeout_s)
    else:
        import time

        deadline = time.monotonic() + timeout_s
        while reader.is_alive() and not stop.is_set() and time.monotonic() < deadline:
            reader.join(min(0.1, max(0.0, deadline - time.monotonic())))
    return found[0] if found else None


def start_zoomer_command(argv: list[str], env: dict[str, str], what: str, timeout_s: float = 120.0,
                         stop: threading.Event | None = None) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start ``python -m zoomer_serve ARGV...`` (a collector, a demo server) as a child of its own
    (:func:`child_popen_kwargs`) and wait for its ready event.

    Raises:
        StopRequested: ``stop`` was set first (the child is stopped with SIGTERM: :func:`stop_process`).
        RuntimeError: naming ``what``, when it exits or stays silent for ``timeout_s`` seconds (it is killed).
    """
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", *argv], stdout=subprocess.PIPE,
                            **child_popen_kwargs(env))
    ready = wait_for_event(proc, "ready", timeout_s, stop)
    if ready is None and stop is not None and stop.is_set():
        stop_process(proc, 30)
        raise StopRequested(f"stopped while the {what} was starting")
    if ready is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the {what} did not start (exit code {proc.poll()}); see its messages on stderr")
    return proc, ready


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM ``proc`` (if still running) and wait up to ``timeout_s`` seconds, then kill it; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
