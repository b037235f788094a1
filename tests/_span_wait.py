"""Waiting for the server side of a call instead of sleeping: a server's handler may still be running (or not
yet started) for a while after the client got its answer or its error, and on a loaded 2-core machine that
while is longer than any fixed sleep a test can afford.

:class:`SpanWatch` watches a recorder (``telemetry.recorder``): it counts request spans as they start (an
observer's ``on_start``) and as their records are handed to the recorder's sink (the export pipeline), so
``wait_ended`` returning True means the records are in the pipeline and ``collector.spans()`` will find them.
"""

from __future__ import annotations

import threading
from typing import Any

from zoomer_serve.recording import RequestRecorder, RequestSpan
from zoomer_serve.recording import records as r

KINDS = {"SERVER": r.KIND_SERVER, "CLIENT": r.KIND_CLIENT, "INTERNAL": r.KIND_INTERNAL}


class SpanWatch:
    """Counts the spans of ``recorder`` that start and end from now on (see the module docstring)."""

    def __init__(self, recorder: RequestRecorder) -> None:
        self._cond = threading.Condition()
        self._started: list[int] = []
        self._ended: list[int] = []
        self._sink = recorder.sink
        recorder.sink = self._hand_on
        recorder.add_observer(self)

    def _hand_on(self, record: tuple[Any, ...]) -> None:
        self._sink(record)
        with self._cond:
            self._ended.append(record[r.R_KIND])
            self._cond.notify_all()

    def on_start(self, span: RequestSpan) -> None:
        with self._cond:
            self._started.append(span.kind)
            self._cond.notify_all()

    def on_end(self, span: RequestSpan) -> None:
        pass

    def wait_started(self, count: int, kind: str = "SERVER", timeout_s: float = 30.0) -> bool:
        """True once ``count`` spans of ``kind`` have started; False after ``timeout_s`` seconds."""
        return self._wait(self._started, count, KINDS[kind], timeout_s)

    def wait_ended(self, count: int, kind: str = "SERVER", timeout_s: float = 30.0) -> bool:
        """True once ``count`` spans of ``kind`` have ended and their records are in the export pipeline;
        False after ``timeout_s`` seconds."""
        return self._wait(self._ended, count, KINDS[kind], timeout_s)

    def wait_all_ended(self, kind: str = "SERVER", timeout_s: float = 30.0) -> bool:
        """True once every span of ``kind`` that has started has ended (a stopped grpc server's handlers run on
        after its stop); False after ``timeout_s`` seconds."""
        k = KINDS[kind]
        with self._cond:
            return self._cond.wait_for(lambda: self._ended.count(k) >= self._started.count(k), timeout_s)

    def _wait(self, seen: list[int], count: int, kind: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: seen.count(kind) >= count, timeout_s)
