"""grpcio under gevent (case C11): locust runs every user as a greenlet on one thread, after gevent has
monkeypatched the standard library. grpcio's C core does not know about that: a blocking call waits in C and
holds the whole process, so 50 users behind a 200 ms method send 5 requests per second instead of 250, and a
worker misses its heartbeats to the master. ``grpc.experimental.gevent.init_gevent()`` makes grpcio wait
cooperatively; it must run after gevent patched the standard library and before any gRPC channel or server
exists in the process.

:func:`init_grpc_gevent` does that once, and refuses clearly (:class:`GeventSetupError`) when it cannot be
done right: gevent has not patched the process (locust was not imported first, or ``LOCUST_SKIP_MONKEY_PATCH``
is set), or gRPC channels already exist (created before the integration: they would block every user).
"""

from __future__ import annotations

import gc
import sys
import threading

_lock = threading.Lock()
_done = False

FIX = ("import zoomer_serve.loadtest.plugin (or locust, then call "
       "zoomer_serve.loadtest.gevent_grpc.init_grpc_gevent()) at the top of the locustfile, before anything "
       "creates a gRPC channel, and create channels inside users (GrpcUser does)")


class GeventSetupError(RuntimeError):
    """grpcio cannot be made gevent-cooperative in this process; the message says what to change."""


def gevent_patched() -> bool:
    """True when gevent has monkeypatched ``socket`` and ``threading`` in this process (what locust does on
    import, unless ``LOCUST_SKIP_MONKEY_PATCH`` is set)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("socket") and monkey.is_module_patched("threading"))


def grpc_gevent_active() -> bool:
    """True once grpcio's gevent integration runs in this process."""
    from grpc._cython import cygrpc

    return bool(getattr(cygrpc, "g_gevent_activated", False))


def live_grpc_channels() -> int:
    """How many gRPC channels (sync or aio) are alive in this process (a scan of the garbage collector's
    objects; only called once, at set-up)."""
    if "grpc" not in sys.modules:
        return 0
    kinds = tuple(t for t in (_class("grpc._channel", "Channel"), _class("grpc.aio._channel", "Channel"))
                  if t is not None)
    return sum(1 for obj in gc.get_objects() if isinstance(obj, kinds)) if kinds else 0


def _class(module: str, name: str) -> type | None:
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def init_grpc_gevent() -> None:
    """Initialise grpcio's gevent integration once per process (idempotent).

    Raises:
        GeventSetupError: gevent has not patched this process, or gRPC channels exist already; the message
            names the fix.
    """
    global _done
    with _lock:
        if _done or grpc_gevent_active():
            _done = True
            return
        if not gevent_patched():
            raise GeventSetupError(
                "gevent has not monkeypatched this process, so locust users cannot run gRPC calls side by side: "
                "import locust (it patches the standard library) before zoomer_serve.loadtest.plugin, and do "
                "not set LOCUST_SKIP_MONKEY_PATCH")
        channels = live_grpc_channels()
        if channels:
            raise GeventSetupError(
                f"{channels} gRPC channel(s) exist already, created before grpcio's gevent integration was "
                f"initialised; calls on them would block every locust user. Fix: {FIX}")
        import grpc.experimental.gevent

        grpc.experimental.gevent.init_gevent()
        _done = True


def require_grpc_gevent() -> None:
    """Raise :class:`GeventSetupError` unless grpcio's gevent integration runs (called by every GrpcUser)."""
    if not grpc_gevent_active():
        init_grpc_gevent()
