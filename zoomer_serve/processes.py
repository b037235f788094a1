"""Small helpers for the child processes zoomer-serve starts (export helper, demo collector and server,
post-processing of profiles): long-lived ones announce themselves with JSON lines on stdout, which the parent
waits for with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
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


def wait_for_event(proc: subprocess.Popen[bytes], event: str, timeout_s: float) -> dict[str, Any] | None:
    """Read ``proc``'s stdout lines until a JSON object with ``"event": event`` arrives; return it, or None
    when the timeout passes or stdout closes first. Other lines are skipped."""
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
    reader.join(timeout_s)
    return found[0] if found else None


def start_zoomer_command(argv: list[str], env: dict[str, str], what: str, timeout_s: float = 120.0
                         ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start ``python -m zoomer_serve ARGV...`` (a collector, a demo server) and wait for its ready event.

    Raises:
        RuntimeError: naming ``what``, when it exits or stays silent for ``timeout_s`` seconds (it is killed).
    """
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", *argv], stdout=subprocess.PIPE, env=env)
    ready = wait_for_event(proc, "ready", timeout_s)
    if ready is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the {what} did not start (exit code {proc.poll()}); see its messages above")
    return proc, ready


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM ``proc`` (if still running) and wait up to ``timeout_s`` seconds, then kill it; its exit code."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
