"""Host telemetry as one unit: what :func:`zoomer_serve.configure` installs (``ZOOMER_HOST``, on by default).

- system and process metrics on the SDK meter provider (:mod:`.metrics`);
- the per-request thread CPU time observer on the recorder (:mod:`.request_cpu`), on a sample of requests and
  on every request of a profiling session;
- the CPU profiler that profiling sessions start for their window (:mod:`.cpu_profile`), handed to every
  :class:`~zoomer_serve.profiling.ProfilerController` built on this telemetry, with the CPU time observer's
  session window.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from zoomer_serve.host.config import HostConfig
from zoomer_serve.host.cpu_profile import CpuProfiler
from zoomer_serve.host.metrics import HostMetrics
from zoomer_serve.host.request_cpu import RequestCpuTimeObserver
from zoomer_serve.recording import RequestRecorder

logger = logging.getLogger("zoomer_serve.host")


@dataclass
class HostTelemetry:
    """The installed host telemetry of one :class:`~zoomer_serve.Telemetry` (``telemetry.host``). Each part is
    None when configured off. :meth:`shutdown` removes the observer and the GC callback (idempotent)."""

    config: HostConfig
    recorder: RequestRecorder
    metrics: HostMetrics | None = None
    request_cpu: RequestCpuTimeObserver | None = None
    cpu_profiler: CpuProfiler | None = None

    def session_companions(self) -> list[Any]:
        """What records alongside each profiling session: the CPU profiler and the per-request CPU time's
        session window (every request measured), each when on. The window comes last, so that it opens right
        before the session covers requests (after py-spy has attached)."""
        return [c for c in (self.cpu_profiler, self.request_cpu) if c is not None]

    def shutdown(self) -> None:
        if self.request_cpu is not None:
            self.recorder.remove_observer(self.request_cpu)
        if self.metrics is not None:
            self.metrics.close()


def install_host_telemetry(config: HostConfig, recorder: RequestRecorder, meter_provider: Any = None
                           ) -> HostTelemetry | None:
    """Install host telemetry on ``recorder`` (request observer) and ``meter_provider`` (metrics; None: no
    metrics). Returns None when ``config.enabled`` is false. A part that cannot start is left out with one
    warning; the rest runs."""
    if not config.enabled:
        return None
    host = HostTelemetry(config, recorder)
    if config.metrics and meter_provider is not None:
        try:
            host.metrics = HostMetrics(config.metrics, meter_provider)
        except Exception as exc:
            logger.warning("zoomer-serve: system metrics could not start, continuing without them: %r", exc)
    if config.request_cpu_time:
        if gevent_patched_threads():
            logger.warning("zoomer-serve: gevent patched threading (greenlets share OS threads), so requests get "
                           "no per-request CPU time")
        else:
            host.request_cpu = RequestCpuTimeObserver(config.request_cpu_time_one_in)
            recorder.add_observer(host.request_cpu)
    if config.cpu_profile != "off":
        host.cpu_profiler = CpuProfiler(config)
    return host


def gevent_patched_threads() -> bool:
    """Whether gevent monkey-patched ``threading`` in this process (greenlets then share OS threads, so a
    thread's CPU clock cannot be split per request)."""
    import sys

    monkey = sys.modules.get("gevent.monkey")
    try:
        return bool(monkey is not None and monkey.is_module_patched("threading"))
    except Exception:
        return False
