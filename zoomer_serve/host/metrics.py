"""System and process metrics: ``opentelemetry-instrumentation-system-metrics`` (psutil) on zoomer-serve's SDK
``MeterProvider``, so they travel over OTLP with every other zoomer-serve metric, plus the CPython GC pause
time from ``gc.callbacks``.

Every instrument is observable: psutil is read on the SDK reader's collection thread when it collects (every
``OTEL_METRIC_EXPORT_INTERVAL`` ms), never on the request path. The only request-independent work between
collections is the GC callback (two clock reads per collection).

The instrumentation's metric names are kept; the meter it is given rewrites units and attribute keys to the
semantic conventions where they differ (:data:`zoomer_serve.host.names.SEMCONV`), e.g. ``state`` becomes
``cpu.mode`` and the 1-based ``cpu`` becomes the 0-based ``cpu.logical_number``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from zoomer_serve.host import names as n

logger = logging.getLogger("zoomer_serve.host")
METER_NAME = "zoomer_serve.host"


class GcPauses:
    """Time spent in CPython's garbage collector, per generation, from ``gc.callbacks``.

    ``pause_ns[g]``: total ns of collections of generation ``g`` since :meth:`install`. The callback runs in
    the thread that triggered the collection, with the interpreter lock held (collections never overlap):
    it reads ``time.perf_counter_ns`` and adds one int, nothing else.
    """

    def __init__(self) -> None:
        self.pause_ns = [0, 0, 0]
        self._t0 = 0
        self._installed = False

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        elif self._t0:
            generation = info.get("generation", 2)
            if 0 <= generation < len(self.pause_ns):
                self.pause_ns[generation] += time.perf_counter_ns() - self._t0
            self._t0 = 0

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            try:
                gc.callbacks.remove(self)
            except ValueError:
                pass
            self._installed = False

    def observe(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        return [Observation(ns / 1e9, {n.GC_GENERATION: g}) for g, ns in enumerate(self.pause_ns)]


def _conventional(attributes: Any, renames: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        new = renames.get(key, key)
        if not new:
            continue
        if new == "cpu.logical_number" and isinstance(value, int):
            value -= 1
        out[new] = value
    return out


def _wrap_callback(callback: Callable[[Any], Iterable[Any]], renames: dict[str, str]) -> Callable[[Any], list[Any]]:
    from opentelemetry.metrics import Observation

    def observe(options: Any) -> list[Any]:
        return [Observation(o.value, _conventional(o.attributes, renames)) for o in callback(options)]

    return observe


class ConventionalMeter:
    """A meter that hands every call to ``meter``, rewriting the unit and attribute keys of the observable
    instruments named in :data:`~zoomer_serve.host.names.SEMCONV` (used only by the instrumentation)."""

    def __init__(self, meter: Any) -> None:
        self._meter = meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)

    def _create(self, kind: str, name: str, callbacks: Sequence[Callable[[Any], Iterable[Any]]] | None = None,
                unit: str = "", description: str = "") -> Any:
        unit_fix, renames = n.SEMCONV.get(name, (None, {}))
        if renames and callbacks:
            callbacks = [_wrap_callback(cb, renames) for cb in callbacks]
        return getattr(self._meter, kind)(name, callbacks=callbacks, unit=unit_fix or unit, description=description)

    def create_observable_counter(self, name: str, callbacks: Any = None, unit: str = "", description: str = "") -> Any:
        return self._create("create_observable_counter", name, callbacks, unit, description)

    def create_observable_gauge(self, name: str, callbacks: Any = None, unit: str = "", description: str = "") -> Any:
        return self._create("create_observable_gauge", name, callbacks, unit, description)

    def create_observable_up_down_counter(self, name: str, callbacks: Any = None, unit: str = "",
                                          description: str = "") -> Any:
        return self._create("create_observable_up_down_counter", name, callbacks, unit, description)


class _ConventionalMeterProvider:
    """What the instrumentation is given as ``meter_provider``: ``get_meter`` returns a :class:`ConventionalMeter`."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider

    def get_meter(self, name: str, version: str | None = None, schema_url: str | None = None,
                  attributes: Any = None) -> ConventionalMeter:
        return ConventionalMeter(self._provider.get_meter(name, version, schema_url, attributes))


def _instrumentor_class() -> type:
    from opentelemetry.instrumentation.system_metrics import SystemMetricsInstrumentor

    class HostMetricsInstrumentor(SystemMetricsInstrumentor):  # type: ignore[misc]
        """zoomer-serve's own instance: ``BaseInstrumentor`` keeps one instance per class, so an application
        that uses ``SystemMetricsInstrumentor`` itself is not affected by ours (and the reverse)."""

        _instance = None
        _is_instrumented_by_opentelemetry = False

    return HostMetricsInstrumentor


_INSTRUMENTOR: list[type] = []


class HostMetrics:
    """The installed host metrics: the instrumentation (for the configured names) and the GC pause counter.

    :meth:`close` uninstruments and removes the GC callback (idempotent). The instruments stay on the meter
    provider, which is shut down with the telemetry.
    """

    def __init__(self, metrics: Sequence[str], meter_provider: Any) -> None:
        self.metrics = tuple(metrics)
        self.gc_pauses: GcPauses | None = None
        self._instrumentor: Any = None
        wanted = {m: n.INSTRUMENTATION_CONFIG[m] for m in self.metrics if m in n.INSTRUMENTATION_CONFIG}
        if wanted:
            if not _INSTRUMENTOR:
                _INSTRUMENTOR.append(_instrumentor_class())
            self._instrumentor = _INSTRUMENTOR[0](config=wanted)
            self._instrumentor.instrument(meter_provider=_ConventionalMeterProvider(meter_provider),
                                          skip_dep_check=True)
        if n.GC_PAUSE_TIME in self.metrics:
            self.gc_pauses = GcPauses()
            meter = meter_provider.get_meter(METER_NAME)
            meter.create_observable_counter(
                n.GC_PAUSE_TIME, callbacks=[self.gc_pauses.observe], unit="s",
                description="Time spent in CPython garbage collections since host telemetry started.")
            self.gc_pauses.install()

    def close(self) -> None:
        if self.gc_pauses is not None:
            self.gc_pauses.uninstall()
        if self._instrumentor is not None:
            try:
                self._instrumentor.uninstrument()
            except Exception as exc:  # never fail a shutdown on it
                logger.warning("zoomer-serve: system metrics uninstrument failed: %r", exc)
            self._instrumentor = None
