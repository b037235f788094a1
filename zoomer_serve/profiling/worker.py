"""The one long-lived thread that runs a controller's profiling sessions.

Every session of a :class:`~zoomer_serve.profiling.controller.ProfilerController` runs on the same thread, one
after another. A new thread per session made a server's resident memory grow by about 40 MB per session until
glibc's arena limit (8 per core) was reached: a session's thread allocates tens of MB of native memory
(Kineto's activity buffers, the Chrome trace export), frees it at the end, and glibc keeps that freed memory in
the malloc arena the thread was given; the next session's new thread was given a new arena, so every session
left its freed memory behind in an arena of its own (``malloc_info``: one arena per past session, each about
40 MB with all but a few hundred KB of it free). One thread reuses one arena. The figures, before and after:
``benchmarks/profiling_memory.py``, ``benchmarks/RESULTS.md``.

The thread starts with the first task, and again in a forked child (which has none of its parent's threads).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

from zoomer_serve.recording import internal_error

Task = Callable[[], None]


class SessionWorker:
    """Runs submitted tasks one at a time, in order, on one daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    @property
    def thread(self) -> threading.Thread | None:
        """The worker's thread while it runs in this process, else None."""
        thread = self._thread
        return thread if thread is not None and self._pid == os.getpid() and thread.is_alive() else None

    def on_thread(self) -> bool:
        """True when called on the worker's thread (where waiting for a later task would wait forever)."""
        return threading.current_thread() is self.thread

    def submit(self, task: Task) -> None:
        """Run ``task`` on the worker's thread, after the tasks submitted before it; start the thread when it
        does not run in this process. A task should not raise: an exception is counted as an internal error
        (``profiling.worker``) and the thread goes on."""
        if self._pid != os.getpid():  # a forked child: the parent's lock, queue and thread are not ours
            self._lock = threading.Lock()
            self._queue = queue.SimpleQueue()
            self._thread = None
            self._pid = os.getpid()
        with self._lock:
            if self.thread is None:
                self._thread = threading.Thread(target=_run_tasks, args=(self._queue,), name=self.name, daemon=True)
                self._thread.start()
            self._queue.put(task)

    def close(self, timeout_s: float) -> bool:
        """End the thread once the tasks already submitted are done; wait up to ``timeout_s`` seconds for it.
        True when it ended (or did not run). A later :meth:`submit` starts a new one."""
        with self._lock:
            thread = self.thread
            if thread is None:
                return True
            self._queue.put(None)
            self._thread = None
            self._queue = queue.SimpleQueue()  # the ending thread keeps its own queue
        thread.join(timeout_s)
        return not thread.is_alive()


def _run_tasks(tasks: queue.SimpleQueue[Task | None]) -> None:
    while (task := tasks.get()) is not None:
        try:
            task()
        except Exception as exc:
            internal_error("profiling.worker", exc)
        del task  # keep nothing of a finished session while waiting for the next
