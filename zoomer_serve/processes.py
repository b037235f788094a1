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
from collections.abc import Callable
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
    before come back on exit. A second signal while stopping is only noted on stderr (the stop in progress
    goes on, bounded by the children's stop timeouts): stopping the children out of order would lose what the
    server had not flushed yet. The signals are acted on even when the command started with SIGINT ignored
    (as ``serve-demo`` and ``collector`` do)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            print(f"\n{self.name}: {signal.Signals(signum).name} received: stopping the load, then the server "
                  "(it flushes its telemetry), then the collector", file=sys.stderr, flush=True)
        else:
            print(f"{self.name}: {signal.Signals(signum).name} received again: already stopping, in order",
                  file=sys.stderr, flush=True)
        self.event.set()

    @property
    def stopped(self) -> bool:
        return self.event.is_set()

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the shell's convention; 0 when none came."""
        return 128 + self.signum if self.signum is not None else 0


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGTERM the child when the thread that started it ends (its process
    dies, SIGKILL included), or None off Linux. Everything it needs is looked up here, before the fork."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigterm, getppid, kill = 1, int(signal.SIGTERM), os.getppid, os.kill

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)
        if getppid() != parent_pid:  # the parent died before the request took effect
            kill(os.getpid(), sigterm)

    return preexec


def child_popen_kwargs() -> dict[str, Any]:
    """``subprocess.Popen`` arguments for a long-lived child of a command: a process group of its own (a
    Ctrl+C in the terminal goes to the command alone, which stops its children in order), stdin from
    /dev/null (it never reads the terminal), and on Linux SIGTERM when the thread that starts it ends (the
    command died, of SIGKILL too: no child lives on). Start such children from the main thread."""
    kwargs: dict[str, Any] = {"stdin": subprocess.DEVNULL}
    if sys.version_info >= (3, 11):
        kwargs["process_group"] = 0
    else:
        kwargs["start_new_session"] = True
    preexec = _die_with_parent(os.getpid())
    if preexec is not None:
        kwargs["preexec_fn"] = preexec
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
    (:func:`child_popen_kwargs`; from the main thread) and wait for its ready event.

    Raises:
        StopRequested: ``stop`` was set first (the child is stopped with SIGTERM: :func:`stop_process`).
        RuntimeError: naming ``what``, when it exits or stays silent for ``timeout_s`` seconds (it is killed).
    """
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", *argv], stdout=subprocess.PIPE, env=env,
                            **child_popen_kwargs())
    ready = wait_for_event(proc, "ready", timeout_s, stop)
    if ready is None and stop is not None and stop.is_set():
        stop_process(proc, 30)
        raise StopRequested(f"stopped while the {what} was starting")
    if ready is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the {what} did not start (exit code {proc.poll()}); see its messages above")
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
