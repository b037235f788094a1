"""What the process's own life does to telemetry: signals, fork, and exit.

**Signals.** :func:`install_signal_handlers` (called by :func:`zoomer_serve.configure` on the main thread, unless
``ZOOMER_SIGNAL_HANDLERS=off``) puts a handler in front of SIGTERM and SIGINT that first saves what was recorded,
then does what the process would have done without zoomer-serve:

- the default SIGTERM action (Kubernetes, ``docker stop``, systemd): flush and stop telemetry within its shutdown
  budget (the export timeout plus one second), then die of SIGTERM as before. The server's threads go on
  answering calls while telemetry flushes, and those calls are exported too (flushes are repeated while they
  get shorter); then requests that start are held (they get no answer, as when the process dies without
  zoomer-serve) while the last records are exported, the requests still in progress are waited for (up to
  :data:`~zoomer_serve.runtime.FINISH_WAIT_S`), and those that ended too late to be exported are counted
  (:func:`zoomer_serve.records_after_shutdown`) and logged in one line. If the process does not die (PID 1 of a
  container ignores SIGTERM's default action), the held requests go on;
- the default SIGINT action (Ctrl+C): hand every queued record to the export helper process (milliseconds; the
  helper runs in a session of its own, outlives the Ctrl+C and drains when the process exits), then raise
  KeyboardInterrupt as before; calls that still end during the server's own graceful stop are recorded too, and
  the exit flushes them (``atexit``);
- a handler the application installed: the same hand-off, then that handler;
- an ignored signal: left alone (no handler is installed).

A handler the application installs *after* :func:`zoomer_serve.configure` replaces ours; it then decides, and a
normal exit still flushes through ``atexit``. A signal that comes while telemetry is being shut down (at exit, or
in a ``multiprocessing`` worker that ``Pool.terminate()`` stops while it flushes) waits until that bounded
shutdown is over, then takes its course.

**Fork.** In a child made by ``os.fork`` (or a ``multiprocessing`` fork start method, or a pre-forking server),
:func:`_after_fork_in_child` lets go of the parent's export helper without touching it, gives the child its own
``service.instance.id`` and ``process.pid``, and a pipeline whose helper process starts once the child records
something; what the child records while it starts is held (bounded, see :mod:`zoomer_serve.export.pipeline`),
not dropped. It is not started at the fork: a ``multiprocessing`` fork pool of short tasks that never record
would pay for a fresh interpreter per worker (measured: 40 tasks with ``maxtasksperchild=1`` took 7.7 s instead
of 0.9 s, 0.18 s of CPU more per worker). In ``multiprocessing`` children, which leave through ``os._exit`` (no ``atexit``), telemetry is
flushed by a ``multiprocessing.util.Finalize`` that the child's exit runs. A child that calls ``os._exit``
itself must call :func:`zoomer_serve.shutdown` first.

**Spawned workers.** A ``multiprocessing`` worker started by ``spawn`` or ``forkserver`` imports zoomer-serve
afresh (configured with its parent's :func:`zoomer_serve.configure` arguments, see :mod:`zoomer_serve.runtime`).
When that import comes with the worker's first task, after the worker ran its after-fork hooks, the same
``Finalize`` is registered at import: a ``forkserver`` worker leaves through ``os._exit`` and lost its spans
without it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("zoomer_serve")

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
HAND_OFF_TIMEOUT_S = 1.0
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced
_state = threading.local()
_deferred: list[int] = []  # signals that came while telemetry was being shut down: delivered again after


def install_signal_handlers(get_active: Callable[[], Any]) -> list[int]:
    """Put our handler in front of SIGTERM and SIGINT (see the module docstring); ``get_active()`` returns the
    :class:`~zoomer_serve.Telemetry` to save (or None). Only on the main thread (elsewhere Python refuses signal
    handlers; nothing is installed). Idempotent. Returns the signals handled."""
    if threading.current_thread() is not threading.main_thread():
        logger.debug("zoomer-serve: configured off the main thread; no signal handlers installed")
        return []
    handled: list[int] = []
    for sig in HANDLED_SIGNALS:
        current = signal.getsignal(sig)
        if getattr(current, "_zoomer_handler", False):
            handled.append(sig)
            continue
        if current in (signal.SIG_IGN, None):  # ignored, or set outside Python: leave it alone
            continue
        handler = _make_handler(get_active)
        _previous[sig] = current
        signal.signal(sig, handler)
        handled.append(sig)
    return handled


def uninstall_signal_handlers() -> None:
    """Put back the handlers ours replaced, where ours is still the one installed (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in list(_previous.items()):
        if getattr(signal.getsignal(sig), "_zoomer_handler", False):
            signal.signal(sig, previous)
        del _previous[sig]


def _make_handler(get_active: Callable[[], Any]) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        previous = _previous.get(signum, signal.SIG_DFL)
        telemetry = get_active()
        held = None  # the telemetry whose recorder holds new requests until the process ends
        if telemetry is not None and telemetry.shutting_down and not telemetry.shut_down:
            _deferred.append(signum)  # the shutdown under way finishes first, then the signal is delivered again
            return
        if telemetry is not None and not getattr(_state, "busy", False):
            _state.busy = True  # a second signal during our own save goes straight to what follows
            terminal = previous is signal.SIG_DFL
            held = telemetry if terminal else None
            try:
                _save(telemetry, terminal)
            except Exception as exc:  # never let telemetry stand between a signal and the application
                logger.warning("zoomer-serve: could not save telemetry on signal %d: %r", signum, exc)
            finally:
                _state.busy = False
        try:
            _chain(signum, frame, previous)
        finally:
            if held is not None:  # still alive (PID 1 of a container ignores SIGTERM's default action)
                held.release_requests()

    handler._zoomer_handler = True  # type: ignore[attr-defined]
    return handler


def _save(telemetry: Any, terminal: bool) -> None:
    """Before a default action that ends the process: the whole shutdown, then the count of the calls the
    server's threads answered too late to be exported (see the module docstring); else the quick hand-off."""
    if terminal:
        telemetry.ending = True
        telemetry.shutdown()
        telemetry.finish_before_exit()
    elif telemetry.pipeline is not None:
        telemetry.pipeline.hand_off(HAND_OFF_TIMEOUT_S)


def _chain(signum: int, frame: Any, previous: Any) -> None:
    """Do what the signal did before our handler: call the application's handler, or take the default action
    (for SIGTERM: end the process by the signal itself, so its exit status says so)."""
    if callable(previous):
        previous(signum, frame)
        return
    if previous is signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def deliver_deferred() -> None:
    """Deliver again the signals that came while telemetry was being shut down (see the module docstring)."""
    while _deferred:
        os.kill(os.getpid(), _deferred.pop(0))


# -- fork ------------------------------------------------------------------------------------------------
def register_fork_hooks(after_in_child: Callable[[], None]) -> None:
    """Run ``after_in_child`` in every forked child, and flush telemetry at the exit of ``multiprocessing``
    children (see the module docstring). Call once."""
    os.register_at_fork(after_in_child=after_in_child)
    try:
        import multiprocessing.util as mp_util
    except ImportError:  # pragma: no cover - part of the standard library
        return
    mp_util.register_after_fork(_MP_TOKEN, _in_multiprocessing_child)
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        # first imported inside a multiprocessing worker's task (spawn or forkserver): the worker ran its
        # after-fork hooks before; a forkserver worker leaves through os._exit, so only this flushes at its exit
        _in_multiprocessing_child(_MP_TOKEN)


class _Token:
    """A weakly referenced object for ``multiprocessing.util.register_after_fork`` (kept alive here)."""


_MP_TOKEN = _Token()


def _in_multiprocessing_child(_token: Any) -> None:
    """Runs in each multiprocessing child right after its finalizers were cleared: flush at its exit."""
    import multiprocessing.util as mp_util

    from zoomer_serve.runtime import shutdown

    mp_util.Finalize(None, shutdown, exitpriority=100)
