"""The OpenTelemetry SDK's OTLP metric exporter as zoomer-serve uses it (the SDK meter provider's metrics: GPU and
host telemetry), with its failures counted and its log kept to one failure.

The SDK's exporter logs a warning for every retry and an error for every failed export ("Transient error
StatusCode.UNAVAILABLE encountered while exporting metrics ..., retrying in 1.1s"): with the collector down, a
few lines a minute for as long as it is down, beside zoomer-serve's own "logged once" line. Here the first failed
export's lines go through as the SDK writes them (its details name the cause); later ones are not logged. Every
failed export and its data points are counted (:attr:`CountedExport.failed_exports`, :attr:`CountedExport.
failed_points`) and summed up in one warning when the exporter shuts down.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

logger = logging.getLogger("zoomer_serve.export")

SDK_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
)
"""The loggers the SDK's OTLP metric exporters write their retries and failures to."""

_exporting = threading.local()  # .quiet: this thread is inside a CountedExport.export that is not the first to fail


class _QuietAfterFirstFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_exporting, "quiet", False)


_FILTER = _QuietAfterFirstFailure()


class CountedExport:
    """Mixed into the SDK's ``OTLPMetricExporter`` (gRPC or HTTP) by :func:`counted_exporter`."""

    failed_exports = 0
    """Exports that returned ``MetricExportResult.FAILURE``."""
    failed_points = 0
    """Data points in them (each metric's ``data.data_points``)."""
    exports = 0
    """Exports attempted."""
    endpoint_name = ""
    exporting_points: int | None = None
    """Data points of the export under way (None when none is)."""

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        _exporting.quiet = self.failed_exports > 0
        self.exporting_points = data_points(metrics_data)
        try:
            result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)  # type: ignore[misc]
        finally:
            _exporting.quiet = False
            self.exporting_points = None
        self.exports += 1
        if result is MetricExportResult.FAILURE:
            self.failed_exports += 1
            self.failed_points += data_points(metrics_data)
            if self.failed_exports == 1:
                logger.warning("zoomer-serve: could not export the OpenTelemetry SDK's metrics (GPU and host "
                               "telemetry) to %s; the exporter's further messages are not logged, its failures "
                               "are counted and summed up at shutdown (logged once)", self.endpoint_name)
        return result

    _summarized = False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        super().shutdown(timeout_millis=timeout_millis, **kwargs)  # type: ignore[misc]
        self.summarize()

    def summarize(self) -> None:
        """Log the failed exports once (nothing when none failed): at the exporter's shutdown, or from
        :func:`summarize_failures` when that shutdown is still retrying at zoomer-serve's deadline."""
        pending = self.exporting_points
        if (self.failed_exports or pending is not None) and not self._summarized:
            self._summarized = True
            still = ("" if pending is None else
                     f"; one more, with {pending} data points, was still under way at the shutdown deadline")
            logger.warning("zoomer-serve: %d of %d exports of the OpenTelemetry SDK's metrics (GPU and host "
                           "telemetry) to %s failed, with %d data points in them%s (cumulative series: an export "
                           "that succeeded after a failure carried their totals)", self.failed_exports,
                           self.exports, self.endpoint_name, self.failed_points, still)


_EXPORTERS: weakref.WeakSet[CountedExport] = weakref.WeakSet()


def summarize_failures() -> None:
    """:meth:`CountedExport.summarize` for every exporter made here (the telemetry's shutdown calls it once its
    deadline has passed, whether or not the SDK's shutdown is still retrying)."""
    for exporter in list(_EXPORTERS):
        exporter.summarize()


def data_points(metrics_data: Any) -> int:
    """Data points in an SDK ``MetricsData``."""
    return sum(len(metric.data.data_points)
               for rm in metrics_data.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics)


def counted_exporter(exporter_class: type, **kwargs: Any) -> Any:
    """An instance of ``exporter_class`` (the SDK's ``OTLPMetricExporter``, either protocol; ``kwargs`` are its
    constructor's, ``endpoint`` among them) with :class:`CountedExport` mixed in; installs the log filter on
    :data:`SDK_EXPORTER_LOGGERS` (once)."""
    for name in SDK_EXPORTER_LOGGERS:
        sdk_logger = logging.getLogger(name)
        if _FILTER not in sdk_logger.filters:
            sdk_logger.addFilter(_FILTER)
    cls = type(f"Counted{exporter_class.__name__}", (CountedExport, exporter_class), {})
    exporter = cls(**kwargs)
    exporter.endpoint_name = kwargs.get("endpoint", "")
    _EXPORTERS.add(exporter)
    return exporter
