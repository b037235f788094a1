"""Kineto's lines on the process's stderr, routed to the ``zoomer_serve`` log at debug level.

Every profiler start and stop in torch 2.13 makes Kineto (C++) write to file descriptor 2, past Python's
``sys.stderr`` and ``logging``:

- ``USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start`` (and ``profiler_stop``):
  Kineto's log at its ``USDT`` level (5). ``KINETO_LOG_LEVEL=6`` hides them, but it also hides Kineto's
  errors and warnings, and it is read once, when Kineto first starts.
- ``ERROR: External init callback must run in same thread as registerClient (A != B)``, once per process, at
  the first start: Kineto registered its client on the thread that imported torch and is initialised on the
  session thread. It is harmless (the profiler runs normally) and printed with ``fprintf``, whatever
  ``KINETO_LOG_LEVEL`` or ``TORCH_CPP_LOG_LEVEL`` say.

So :func:`kineto_lines_to_log` points fd 2 at a temporary file for the length of one start or stop call,
then points it back and reads the file: those known lines go to the ``zoomer_serve.profiling`` logger at
DEBUG; every other line (another thread's, or a Kineto warning worth seeing) is written to the real stderr,
in order. fd 2 belongs to the whole process, so nothing written in that window is lost, only held back for
the length of the call.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

logger = logging.getLogger("zoomer_serve.profiling")

KINETO_NOISE = re.compile(rb"^(USDT:.*\] profiler_(start|stop)|ERROR: External init callback must run in same "
                          rb"thread as registerClient\b.*)$")
"""The two kinds of line above (one line, bytes, without its newline)."""

_lock = threading.Lock()


def _flush_stderr() -> None:
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # no stderr, or a closed one
        pass


@contextmanager
def kineto_lines_to_log() -> Iterator[None]:
    """Around one profiler start or stop: Kineto's known lines on fd 2 go to the log at DEBUG, every other
    line written to fd 2 meanwhile goes to stderr once the block ends. Without a usable fd 2 (closed, or no
    temporary file can be made) the block runs unchanged. One block at a time per process."""
    with _lock:
        held = _hold_fd2()
        try:
            yield
        finally:
            if held is not None:
                _release_fd2(*held)


def _hold_fd2() -> tuple[int, IO[bytes]] | None:
    _flush_stderr()
    try:
        saved = os.dup(2)
    except OSError:
        return None
    try:
        spool = tempfile.TemporaryFile()
        os.dup2(spool.fileno(), 2)
    except OSError:
        os.close(saved)
        return None
    return saved, spool


def _release_fd2(saved: int, spool: IO[bytes]) -> None:
    _flush_stderr()
    os.dup2(saved, 2)
    os.close(saved)
    with spool:
        spool.seek(0)
        for line in spool:
            if KINETO_NOISE.match(line.rstrip(b"\r\n")):
                logger.debug("kineto: %s", line.rstrip(b"\r\n").decode("utf-8", "replace"))
            else:
                _write_all(line)


def _write_all(data: bytes) -> None:
    while data:
        try:
            written = os.write(2, data)
        except OSError:
            return
        data = data[written:]
