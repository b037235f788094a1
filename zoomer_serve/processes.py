"""Small helpers for the child processes zoomer-serve starts (export helper, demo collector and server):
they announce themselves with JSON lines on stdout, which the parent waits for with a timeout."""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Any


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
