"""Telemetry setup: :func:`configure` builds the recorder, the export pipeline and the OpenTelemetry SDK
providers from the environment (``OTEL_*``, then ``ZOOMER_*``; see :mod:`zoomer_serve.config`) and code.

One :class:`Telemetry` is active per process, and one :class:`~zoomer_serve.recording.RequestRecorder` serves
every telemetry the process configures in turn: adapters that are created before anyone called
:func:`configure` configure it from the environment (at construction, never on the request path), and when
:func:`configure` is called later their requests go to the new telemetry. A request recorded while no
telemetry is active (after :func:`shutdown`) is dropped and counted (:func:`records_after_shutdown`).
:func:`shutdown` (also registered with ``atexit``, and run before SIGTERM's default action) flushes within the
export timeout plus one second, first while still recording (a server's threads may go on answering calls), then
closing; :func:`force_flush` exports what was recorded so far without stopping. How
signals and fork are handled: :mod:`zoomer_serve.lifecycle`.

**Spawned workers.** A ``multiprocessing`` worker started by the ``spawn`` or ``forkserver`` method (also a
``ProcessPoolExecutor`` with such a context, torch ``DataLoader`` / ``torch.multiprocessing`` workers) is a fresh
interpreter: nothing configured in the parent's memory reaches it, only its environment. So :func:`configure`
also writes the keyword arguments it was given to ``ZOOMER_CONFIGURE_ARGUMENTS`` in ``os.environ`` (and removes
it when given none, and at :func:`shutdown`), and a ``multiprocessing`` worker that records before calling :func:`configure` itself
configures with them, from the environment it inherited: as the parent did. A :class:`ZoomerConfig` passed as
``config=`` is not handed down (the worker configures from the environment and says so once in a warning); an
explicit :func:`configure` in the worker is taken as given. Other child processes (``subprocess``) ignore it.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its fork hooks must be registered before the SDK providers')
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zoomer_serve import lifecycle
from zoomer_serve.config import (
    EXPORT_MODES,
    PROTOCOLS,
    ConfigError,
    ExportConfig,
    ZoomerConfig,
    check_url,
    is_count,
)
from zoomer_serve.envvars import INT_MAX
from zoomer_serve.export import ExportPipeline, ExportStats
from zoomer_serve.recording import RequestRecorder, Sampler
from zoomer_serve.resource import build_resource_attributes, child_resource_attributes

logger = logging.getLogger("zoomer_serve")
CONFIGURE_ARGUMENTS_ENV = "ZOOMER_CONFIGURE_ARGUMENTS"  # configure()'s arguments, for spawned workers
_HANDED_DOWN = ("service_name", "endpoint", "protocol", "export_mode", "sampler", "sampler_ratio",
                "resource_attributes", "timeout_ms", "schedule_delay_ms", "metric_export_interval_ms",
                "set_global_providers")
_lock = threading.RLock()
_active: Telemetry | None = None
_stopping: Telemetry | None = None  # the last one shut down by shutdown()
_recorder: RequestRecorder | None = None  # the process's recorder, kept from one telemetry to the next
_after_shutdown = [0]  # records that came while no telemetry was active
_after_shutdown_lock = threading.Lock()
FINISH_WAIT_S = 0.2
"""How long a process ending on SIGTERM waits for the requests in progress to end (seconds), after telemetry was
shut down and before it counts them (:meth:`Telemetry.finish_before_exit`)."""
_after_shutdown_warn = [True]  # False once warned, and while a shutdown under way counts them for its own report


def _count_after_shutdown(record: tuple[Any, ...]) -> None:
    """The sink of the recorder while no telemetry is active: counts the record, warns the first time (unless a
    shutdown under way reports the count itself)."""
    with _after_shutdown_lock:
        _after_shutdown[0] += 1
        warn = _after_shutdown_warn[0]
        _after_shutdown_warn[0] = False
    if warn:
        logger.warning("zoomer-serve: a request was recorded after telemetry was shut down; it is dropped, as "
                       "are later ones until configure() is called again (counted: records_after_shutdown())")


def records_after_shutdown() -> int:
    """Span records (a request's span with its phases, or a span made with the OpenTelemetry API) dropped because
    they ended while no telemetry was active: after :func:`shutdown`, or on a recorder whose telemetry was shut
    down, until the next :func:`configure`; and those that ended while a shutdown was closing the export (its last
    drain), which it logs in one line."""
    return _after_shutdown[0]


@dataclass
class Telemetry:
    """The configured telemetry of this process.

    ``recorder`` starts request spans; ``pipeline`` carries their records to the exporter (None when the SDK
    is disabled or ``ZOOMER_EXPORT_MODE=none``); ``tracer_provider`` / ``meter_provider`` are SDK providers
    for spans and metrics that user code and other zoomer-serve parts create with the OpenTelemetry API (the
    tracer provider's spans go through ``pipeline`` too: ``span_forwarder``).
    """

    config: ZoomerConfig
    resource: dict[str, Any]
    recorder: RequestRecorder
    pipeline: ExportPipeline | None
    tracer_provider: Any
    meter_provider: Any
    _stats: ExportStats | None = None
    shutting_down: bool = False
    ending: bool = False  # the process ends right after the shutdown (see finish_before_exit)
    _after_shutdown_from: int | None = None  # records_after_shutdown() when this telemetry let go of the recorder
    _shutdown_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    gpu: Any = None  # zoomer_serve.telemetry.GpuTelemetry, or None (no GPU, or ZOOMER_GPU=off)
    host: Any = None  # zoomer_serve.host.HostTelemetry, or None (ZOOMER_HOST=off)
    # the tracer provider's span processor that hands its spans to the pipeline (None: spans are not exported)
    span_forwarder: Any = None

    def sdk_span_flush(self) -> Any:
        """How :attr:`span_forwarder` flushes (the pipeline's ``flush(timeout_s)``); None once shutting down, when
        the pipeline's shutdown exports what it holds."""
        return None if self.shutting_down or self.pipeline is None else self.pipeline.flush

    def shutdown(self, timeout_s: float | None = None) -> ExportStats:
        """Flush and stop everything within about ``timeout_s`` (default: the OTLP export timeout) + 1 s.
        Returns the export counters; calling it again returns the same counters.

        Raises:
            ValueError: ``timeout_s`` is not a finite number of seconds >= 0.
        """
        _check_timeout(timeout_s, "shutdown")
        if self._stats is not None:
            return self._stats
        self.shutting_down = True
        try:
            with self._shutdown_lock:  # a second caller waits for the first's counters
                if self._stats is None:
                    self._stats = self._shutdown(timeout_s)
                return self._stats
        finally:
            lifecycle.deliver_deferred()

    @property
    def shut_down(self) -> bool:
        return self._stats is not None

    def _shutdown(self, timeout_s: float | None) -> ExportStats:
        """Export while still recording (a server's threads may go on answering calls meanwhile), then let go of
        the recorder and close: only requests that end during the closing drain are not exported; they are
        counted (:func:`records_after_shutdown`) and logged once, by :meth:`report_records_after_shutdown`."""
        budget = self.config.export.export_budget_ms / 1000 if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget + 1.0  # one deadline for every part, whatever the collector does
        if self.pipeline is not None:  # half the budget: the closing drain has the rest, a collector down or not
            self.pipeline.flush_while_open(time.monotonic() + budget / 2)
        self.recorder.run_before_shutdown()  # spans that adapters still hold open
        if self.gpu is not None:  # it sends its last allocation totals through the pipeline
            self.gpu.shutdown()
        if self.host is not None:
            self.host.shutdown()
        self._let_go_of_recorder()
        threads = [threading.Thread(target=_shutdown_provider, args=(p, budget), daemon=True)
                   for p in (self.tracer_provider, self.meter_provider) if p is not None]
        for t in threads:
            t.start()
        remaining = max(0.1, deadline - time.monotonic() - 1.0)  # the pipeline adds its own second
        stats = self.pipeline.shutdown(remaining) if self.pipeline is not None else ExportStats()
        for t in threads:  # SDK providers still retrying past the deadline are left behind (daemon threads)
            t.join(max(0.0, deadline - time.monotonic()))
        if self.meter_provider is not None:
            from zoomer_serve.export.sdk_metrics import summarize_failures

            summarize_failures()
        if not self.ending:
            self.report_records_after_shutdown()
        return stats

    def _let_go_of_recorder(self) -> None:
        """From now on the recorder's records are counted, not exported, until the next configure() gives it a
        new sink; so is a record that reaches the closing pipeline. In a process that ends right after
        (``ending``), requests that start from now on are held: only those in progress can end meanwhile."""
        with _after_shutdown_lock:
            self._after_shutdown_from = _after_shutdown[0]
            _after_shutdown_warn[0] = False  # this shutdown reports them itself
        if self.ending:
            self.recorder.hold_new_requests()
        self.recorder.sink = _count_after_shutdown
        if self.pipeline is not None:
            self.pipeline.after_close = _count_after_shutdown

    def report_records_after_shutdown(self, in_progress: int = 0) -> int:
        """Log once how many requests ended after this telemetry began shutting down, too late to be exported
        (a server that kept answering while telemetry was flushed), and ``in_progress``, those still under way
        as the process ends; later ones are warned about once. Returns the first number (0 before the shutdown
        let go of the recorder, and when called again)."""
        with _after_shutdown_lock:
            start, self._after_shutdown_from = self._after_shutdown_from, None
            if start is None:
                return 0
            records = _after_shutdown[0] - start
            _after_shutdown_warn[0] = True
        if records or in_progress:
            from zoomer_serve.export.pipeline import log_records_after_shutdown

            log_records_after_shutdown(records, in_progress)
        return records

    def finish_before_exit(self, wait_s: float = FINISH_WAIT_S) -> None:
        """For a process that ends right after (SIGTERM's default action), once :meth:`shutdown` (with
        ``ending`` set) is over: hold the requests that start from now on, if the shutdown did not already
        (their callers get no answer, as when the process ends without zoomer-serve), wait up to ``wait_s``
        seconds for those in progress to end, then log how many ended after the shutdown began closing and how
        many were still in progress. Every call answered before the process ends is then either exported or in
        that count. :meth:`release_requests` lets the held ones go on (the process did not end)."""
        recorder = self.recorder
        recorder.hold_new_requests()
        end = time.monotonic() + wait_s
        while recorder.in_flight > 0 and time.monotonic() < end:
            time.sleep(0.002)
        self.report_records_after_shutdown(max(0, recorder.in_flight))

    def release_requests(self) -> None:
        """Undo the hold of :meth:`finish_before_exit`."""
        self.recorder.release_requests()

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Export everything recorded so far (spans, the RPC metrics, and the SDK providers' data) and wait for
        it, within ``timeout_s`` seconds (default: the export timeout). Telemetry keeps running.

        Returns True when the flush succeeded, as OpenTelemetry's ``force_flush`` means it: every span recorded
        since the previous ``force_flush`` (or since :func:`configure`) was accepted by the collector, and so
        were the RPC metric points sent now, within ``timeout_s``. False when the collector refused spans (an
        error answer), rejected some (an OTLP partial success with ``rejected_spans`` > 0: those spans are not
        stored; a partial success that rejects none, a warning message only, is a success), or spans were
        dropped on the way (a full queue, too large, a helper process that died), or when the time ran out.
        Losses are counted and logged either way (:class:`~zoomer_serve.export.ExportStats`,
        ``otel.sdk.exporter.span.exported``); a False is about that period only, the next flush answers for
        what comes after. Spans made with the OpenTelemetry API are among those spans (they go through the same
        pipeline: the tracer provider's ``force_flush`` is the pipeline's). The meter provider (metrics made with
        the API) adds its own ``force_flush`` answer: its reader says whether it finished in time, not whether the
        collector took the data; so does any span processor that user code added. Once shut down: True (nothing
        left to flush).

        Raises:
            ValueError: ``timeout_s`` is not a finite number of seconds >= 0.
        """
        _check_timeout(timeout_s, "force_flush")
        if self._stats is not None:
            return True
        budget = self.config.export.export_budget_ms / 1000 if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        ok = True
        if self.pipeline is not None and self.span_forwarder is None:  # else the tracer provider's flush does it
            ok = self.pipeline.flush(budget)
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None and hasattr(provider, "force_flush"):
                try:
                    ok = bool(provider.force_flush(int(max(0.0, deadline - time.monotonic()) * 1000))) and ok
                except Exception as exc:
                    logger.warning("zoomer-serve: SDK provider flush failed: %r", exc)
                    ok = False
        return ok

    def reset_in_child(self) -> None:
        """In a forked child (see :mod:`zoomer_serve.lifecycle`): let go of the parent's export without touching
        it, and export this process's records as its own instance (``service.instance.id``, ``process.pid``)
        through a helper process of its own, started when the first record comes (what comes while it starts is
        held, see :mod:`zoomer_serve.export.pipeline`)."""
        self._shutdown_lock = threading.Lock()  # another thread of the parent may have held it at the fork
        self.resource = child_resource_attributes(self.resource, self.config)
        if self.pipeline is not None:
            self.pipeline.disown()
            self.pipeline = ExportPipeline(self.config.export, self.resource, self.pipeline.version,
                                           self.config.span_limits)
            self.pipeline.start(wait_for_helper=False)
            self.recorder.sink = self.pipeline.submit
        _update_sdk_resource(self.resource, self.tracer_provider, self.meter_provider)


def _check_timeout(timeout_s: Any, what: str) -> None:
    """Refuse a ``timeout_s`` that is not None or a finite number >= 0 (infinity overflowed the SDK's and the
    threads' waits; a string failed deep inside)."""
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < math.inf:
        raise ValueError(f"{what}(timeout_s=...) must be a finite number of seconds >= 0, got {timeout_s!r}")


_UNSTARTED_WORKER = "cannot join thread before it is started"


def _shutdown_provider(provider: Any, budget_s: float) -> None:
    try:
        if hasattr(provider, "force_flush"):
            provider.force_flush(int(budget_s * 1000))
        provider.shutdown()
    except Exception as exc:
        if not _only_unstarted_workers(exc):
            logger.warning("zoomer-serve: SDK provider shutdown failed: %r", exc)


def _only_unstarted_workers(exc: Exception) -> bool:
    """True when all ``exc`` reports is worker threads joined before they started: a forked child stopped
    (SIGTERM) while an SDK fork hook (the batch span processor's, the periodic metric reader's) had made its new
    worker thread and not yet started it. That worker never ran here, so it holds nothing to flush. The
    TracerProvider raises the RuntimeError itself; the MeterProvider one Exception with a line per failed reader
    after its first."""
    if isinstance(exc, RuntimeError):
        return _UNSTARTED_WORKER in str(exc)
    failures = str(exc).splitlines()[1:]
    return bool(failures) and all(_UNSTARTED_WORKER in line for line in failures)


def configure(*, service_name: str | None = None, endpoint: str | None = None, protocol: str | None = None,
              export_mode: str | None = None, sampler: str | None = None, sampler_ratio: float | None = None,
              resource_attributes: dict[str, str] | None = None, timeout_ms: int | None = None,
              schedule_delay_ms: int | None = None, metric_export_interval_ms: int | None = None,
              set_global_providers: bool = True, config: ZoomerConfig | None = None) -> Telemetry:
    """Configure telemetry for this process and return it (replacing, after shutting it down, any earlier one).

    Settings come from ``config`` when given, else from the environment; each keyword argument that is
    not None overrides them. ``endpoint`` is the OTLP base URL (``http://host:4317`` for grpc,
    ``http://host:4318`` for http/protobuf, where ``/v1/traces`` and ``/v1/metrics`` are appended).
    ``endpoint``, ``protocol`` and ``timeout_ms`` (ms) apply to both signals, traces and metrics, over their own
    ``OTEL_EXPORTER_OTLP_TRACES_*`` / ``..._METRICS_*`` variables; headers and compression come from the
    environment (or ``config``) only, each signal its own. ``schedule_delay_ms`` and
    ``metric_export_interval_ms`` are in ms.
    ``set_global_providers`` installs the SDK providers as the OpenTelemetry global ones when none is set yet.

    Raises:
        ConfigError: a setting is invalid (the message names it).
        RuntimeError: the export helper process could not start.
    """
    global _active
    given = {name: value for name, value in locals().items() if name in _HANDED_DOWN and value is not None}
    if set_global_providers:
        del given["set_global_providers"]  # the default
    cfg = config or ZoomerConfig.from_env()
    cfg = _apply_overrides(cfg, service_name, endpoint, protocol, export_mode, sampler, sampler_ratio,
                           resource_attributes, timeout_ms, schedule_delay_ms, metric_export_interval_ms)
    with _lock:
        if _active is not None:
            _active.shutdown()
            _active = None
        _active = _build(cfg, set_global_providers)
        if cfg.signal_handlers and _active.pipeline is not None:
            lifecycle.install_signal_handlers(_current)
        _hand_down(given, config is not None)
        return _active


def _hand_down(given: dict[str, Any], config_object: bool) -> None:
    """Write what :func:`configure` was given to ``os.environ`` for the ``multiprocessing`` workers this process
    spawns (see the module docstring): the arguments as JSON, a note that a ``config=`` object was not handed
    down, or nothing (configured from the environment alone)."""
    if config_object:
        os.environ[CONFIGURE_ARGUMENTS_ENV] = json.dumps({"config": None})
    elif given:
        os.environ[CONFIGURE_ARGUMENTS_ENV] = json.dumps(given, sort_keys=True)
    else:
        os.environ.pop(CONFIGURE_ARGUMENTS_ENV, None)


def inherited_arguments() -> dict[str, Any]:
    """The :func:`configure` arguments that the parent of this ``multiprocessing`` worker handed down
    (``ZOOMER_CONFIGURE_ARGUMENTS``); {} in any other process, or when the parent configured from the environment
    alone or with a ``config=`` object (then a warning says so, once).

    Raises:
        ConfigError: the variable is not a JSON object of :func:`configure` keyword arguments.
    """
    raw = os.environ.get(CONFIGURE_ARGUMENTS_ENV)
    if not raw or multiprocessing.parent_process() is None:
        return {}
    try:
        given = json.loads(raw)
    except ValueError:
        given = None
    if not isinstance(given, dict) or not set(given) <= {*_HANDED_DOWN, "config"}:
        raise ConfigError(f"{CONFIGURE_ARGUMENTS_ENV} must be a JSON object of configure() keyword arguments "
                          f"({', '.join(_HANDED_DOWN)}), got {raw!r}")
    if "config" in given:
        logger.warning("zoomer-serve: this multiprocessing worker (pid %d) configured itself from the environment: "
                       "its parent called configure(config=...), and a ZoomerConfig is not handed down to spawned "
                       "workers; call zoomer_serve.configure(config=...) in the worker (its initializer)",
                       os.getpid())
        return {}
    return given


def _current() -> Telemetry | None:
    """The telemetry that signals should save: the active one, or the one being shut down."""
    return _active if _active is not None else _stopping


def _check_arguments(endpoint: Any, protocol: Any, export_mode: Any, sampler: Any, sampler_ratio: Any,
                     resource_attributes: Any, ms: dict[str, Any]) -> None:
    """Refuse a configure() argument of the wrong type or out of range, naming it (None: not given).

    Raises:
        ConfigError: the first bad argument, with the value given.
    """
    def refuse(name: str, need: str, value: Any) -> None:
        raise ConfigError(f"configure({name}=...) must be {need}, got {value!r}")

    for name, value in ms.items():
        if value is not None and not is_count(value, 1, INT_MAX):
            refuse(name, f"an integer between 1 and {INT_MAX} (ms)", value)
    if endpoint is not None and not isinstance(endpoint, str):
        refuse("endpoint", "a URL string", endpoint)
    for name, value, known in (("protocol", protocol, PROTOCOLS), ("export_mode", export_mode, EXPORT_MODES)):
        if value is not None and value not in known:
            refuse(name, f"one of {known}", value)
    if sampler is not None and not isinstance(sampler, str):
        refuse("sampler", "a string (a value of OTEL_TRACES_SAMPLER)", sampler)
    if sampler_ratio is not None:
        number = isinstance(sampler_ratio, (int, float)) and not isinstance(sampler_ratio, bool)
        if not (number and 0.0 <= sampler_ratio <= 1.0):
            refuse("sampler_ratio", "a number between 0 and 1", sampler_ratio)
    if resource_attributes is not None and not (
            isinstance(resource_attributes, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in resource_attributes.items())):
        refuse("resource_attributes", "a mapping of str to str", resource_attributes)


def _apply_overrides(cfg: ZoomerConfig, service_name: str | None, endpoint: str | None, protocol: str | None,
                     export_mode: str | None, sampler: str | None, sampler_ratio: float | None,
                     resource_attributes: dict[str, str] | None, timeout_ms: int | None,
                     schedule_delay_ms: int | None, metric_export_interval_ms: int | None) -> ZoomerConfig:
    _check_arguments(endpoint, protocol, export_mode, sampler, sampler_ratio, resource_attributes,
                     {"timeout_ms": timeout_ms, "schedule_delay_ms": schedule_delay_ms,
                      "metric_export_interval_ms": metric_export_interval_ms})
    exp = cfg.export
    changes: dict[str, Any] = {}
    if protocol is not None:  # both signals' (the metrics' own variable does not outweigh an argument)
        changes["protocol"] = changes["metrics_protocol"] = protocol
    if endpoint is not None:  # a base URL for both signals, with each one's path where its protocol is http
        base = check_url(endpoint, "configure(endpoint=...)").rstrip("/")
        for signal in ("traces", "metrics"):
            proto = protocol or exp.otlp(signal).protocol
            changes[f"{signal}_endpoint"] = base if proto == "grpc" else f"{base}/v1/{signal}"
    if timeout_ms is not None:  # both signals' export timeout
        changes["timeout_ms"] = changes["metrics_timeout_ms"] = timeout_ms
    for key, value in (("mode", export_mode), ("schedule_delay_ms", schedule_delay_ms),
                       ("metric_export_interval_ms", metric_export_interval_ms)):
        if value is not None:
            changes[key] = value
    new_export: ExportConfig = dataclasses.replace(exp, **changes) if changes else exp
    top: dict[str, Any] = {"export": new_export}
    if service_name is not None:
        if not isinstance(service_name, str) or not service_name.strip():
            raise ConfigError(f"configure(service_name=...) must be a non-empty string, got {service_name!r}")
        top["service_name"] = service_name
    if sampler is not None:
        top["sampler"] = sampler
    if sampler_ratio is not None:
        top["sampler_ratio"] = sampler_ratio
    if resource_attributes:
        top["resource_attributes"] = {**cfg.resource_attributes, **resource_attributes}
    return dataclasses.replace(cfg, **top)


def _build(cfg: ZoomerConfig, set_global: bool) -> Telemetry:
    try:
        sampler = Sampler(cfg.sampler, cfg.sampler_ratio)
    except ValueError as exc:
        raise ConfigError(f"sampler: {exc}") from None
    if cfg.sdk_disabled:
        logger.info("zoomer-serve: OTEL_SDK_DISABLED=true; recording nothing")
        return Telemetry(cfg, {}, _process_recorder(None, sampler, cfg, False), None, None, None)
    from zoomer_serve import __version__

    resource = build_resource_attributes(cfg)
    pipeline = None
    if cfg.export.sends_traces or cfg.export.sends_metrics:
        pipeline = ExportPipeline(cfg.export, resource, __version__, cfg.span_limits)
        pipeline.start()
    recorder = _process_recorder(pipeline.submit if pipeline else None, sampler, cfg, True)
    tracer_provider, meter_provider = _sdk_providers(cfg, resource, set_global)
    telemetry = Telemetry(cfg, resource, recorder, pipeline, tracer_provider, meter_provider)
    if pipeline is not None and cfg.export.sends_traces:
        telemetry.span_forwarder = _forward_sdk_spans(telemetry)
    telemetry.gpu = _gpu_telemetry(cfg, recorder, meter_provider)
    telemetry.host = _host_telemetry(cfg, recorder, meter_provider)
    return telemetry


def _forward_sdk_spans(telemetry: Telemetry) -> Any:
    """Make the spans of ``telemetry``'s SDK tracer provider (those user code starts with the OpenTelemetry API)
    records of the process's recorder's sink, the export pipeline: see :mod:`zoomer_serve.recording.sdk_spans`.
    Returns the span processor."""
    from zoomer_serve.recording.sdk_spans import SdkSpanForwarder

    recorder = telemetry.recorder
    forwarder = SdkSpanForwarder(lambda: recorder.sink, telemetry.sdk_span_flush)
    telemetry.tracer_provider.add_span_processor(forwarder)
    return forwarder


def _process_recorder(sink: Any, sampler: Sampler, cfg: ZoomerConfig, otel_context: bool) -> RequestRecorder:
    """The process's recorder, made on the first call and pointed at ``sink`` on the later ones."""
    global _recorder
    if _recorder is None:
        _recorder = RequestRecorder(sink, sampler, otel_context=otel_context, limits=cfg.span_limits)
    else:
        _recorder.reconfigure(sink, sampler, cfg.span_limits, otel_context)
    return _recorder


def _gpu_telemetry(cfg: ZoomerConfig, recorder: RequestRecorder, meter_provider: Any) -> Any:
    """GPU telemetry per ``cfg.gpu`` (None when off or when there is no GPU); never raises."""
    if cfg.gpu.mode == "off":
        return None
    try:
        from zoomer_serve.telemetry import install_gpu_telemetry

        return install_gpu_telemetry(cfg.gpu, recorder, meter_provider, warn_once=True)
    except Exception as exc:
        logger.warning("zoomer-serve: GPU telemetry could not start, continuing without it: %r", exc)
        return None


def _host_telemetry(cfg: ZoomerConfig, recorder: RequestRecorder, meter_provider: Any) -> Any:
    """Host telemetry per ``cfg.host`` (None when off); never raises."""
    if not cfg.host.enabled:
        return None
    try:
        from zoomer_serve.host import install_host_telemetry

        return install_host_telemetry(cfg.host, recorder, meter_provider)
    except Exception as exc:
        logger.warning("zoomer-serve: host telemetry could not start, continuing without it: %r", exc)
        return None


def _sdk_providers(cfg: ZoomerConfig, resource: dict[str, Any], set_global: bool) -> tuple[Any, Any]:
    """The SDK's tracer and meter providers: the meter provider exports with the SDK's OTLP exporter; the tracer
    provider's spans go to zoomer-serve's export pipeline (:func:`_forward_sdk_spans`)."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from zoomer_serve.export.transport import sdk_metric_exporter

    res = Resource(resource)
    exp = cfg.export
    # shutdown_on_exit=False: Telemetry.shutdown (registered with atexit) shuts them down, within its budget
    tracer_provider = TracerProvider(resource=res, sampler=ParentBased(TraceIdRatioBased(cfg.sampler_ratio)),
                                     shutdown_on_exit=False)
    readers = []
    if exp.sends_metrics:
        readers.append(PeriodicExportingMetricReader(sdk_metric_exporter(exp),
                                                     export_interval_millis=exp.metric_export_interval_ms,
                                                     export_timeout_millis=exp.timeout_ms))
    meter_provider = MeterProvider(resource=res, metric_readers=readers, shutdown_on_exit=False)
    if set_global:
        if type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider":
            trace.set_tracer_provider(tracer_provider)
        if type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider":
            metrics.set_meter_provider(meter_provider)
    return tracer_provider, meter_provider


def get_telemetry() -> Telemetry:
    """The active telemetry, configured on first use from the environment (in a spawned ``multiprocessing``
    worker, with the arguments its parent gave :func:`configure`: :func:`inherited_arguments`).

    Raises:
        ConfigError: a setting is invalid (the message names it).
    """
    with _lock:
        if _active is None:
            return configure(**inherited_arguments())
        return _active


def get_recorder() -> RequestRecorder:
    """The active request recorder (configuring from the environment on first use)."""
    return get_telemetry().recorder


def shutdown(timeout_s: float | None = None) -> ExportStats | None:
    """Flush and stop the active telemetry (see :meth:`Telemetry.shutdown`); None when none is active."""
    global _active, _stopping
    _check_timeout(timeout_s, "shutdown")  # before the telemetry is let go
    with _lock:
        active, _active = _active, None
        if active is not None:
            _stopping = active
            _hand_down({}, False)  # workers spawned from now on configure as this process would: from the environment
    return active.shutdown(timeout_s) if active is not None else None


def force_flush(timeout_s: float | None = None) -> bool:
    """Export what the active telemetry recorded so far and wait for it; True when the flush succeeded (every
    span since the previous flush stored by the collector), False when any was refused, rejected or dropped or
    the time ran out (see :meth:`Telemetry.force_flush`); True when nothing is active.

    Raises:
        ValueError: ``timeout_s`` is not a finite number of seconds >= 0.
    """
    _check_timeout(timeout_s, "force_flush")
    active = _active
    return active.force_flush(timeout_s) if active is not None else True


def _update_sdk_resource(resource: dict[str, Any], *providers: Any) -> None:
    """Give the SDK providers a forked child's own instance attributes (best effort: private SDK parts). The SDK's
    own fork hooks run after ours and merge its per-process ``service.instance.id``: it is set to ours first."""
    try:
        from opentelemetry.sdk import resources as sdk_resources

        own = sdk_resources.Resource(
            {k: resource[k] for k in ("service.instance.id", "process.pid") if k in resource})
        if hasattr(sdk_resources, "_service_instance_id_pid") and "service.instance.id" in resource:
            sdk_resources._service_instance_id = resource["service.instance.id"]
            sdk_resources._service_instance_id_pid = os.getpid()
    except Exception:
        return
    for provider in providers:
        update = getattr(provider, "_update_resource", None)
        if update is not None:
            try:
                update(own)
            except Exception as exc:
                logger.debug("zoomer-serve: could not update an SDK provider's resource after fork: %r", exc)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # another thread of the parent may have held it at the fork
    active = _active
    if active is not None and active._stats is None:
        try:
            active.reset_in_child()
        except Exception as exc:
            logger.warning("zoomer-serve: telemetry could not be set up in a forked child (pid %d): %r",
                           os.getpid(), exc)


atexit.register(shutdown)
lifecycle.register_fork_hooks(_after_fork_in_child)
