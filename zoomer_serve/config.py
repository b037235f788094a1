"""Configuration: dataclasses filled from the environment, then from code.

Each setting has one environment variable: the OpenTelemetry ``OTEL_*`` one where OpenTelemetry defines it,
else a ``ZOOMER_*`` one. The OTLP connection settings are per signal, as the OpenTelemetry exporter specification
defines them: for traces and for metrics each is the signal's own variable (``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``,
``OTEL_EXPORTER_OTLP_METRICS_TIMEOUT``) when set, else the general one (``OTEL_EXPORTER_OTLP_TIMEOUT``), else the
default; one signal's own variable never applies to the other (:meth:`ExportConfig.otlp`). Arguments passed in code (``configure(service_name=...)``) override the
environment. A bad value raises :class:`ConfigError` naming the variable and the value.

| setting | variable | default |
| --- | --- | --- |
| service name | ``OTEL_SERVICE_NAME`` | ``zoomer-serve`` (also read from ``OTEL_RESOURCE_ATTRIBUTES``) |
| resource attributes | ``OTEL_RESOURCE_ATTRIBUTES`` (``k=v,k2=v2``, percent-encoded values) | none |
| OTLP endpoint | ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL for ``http/protobuf``) / ``..._TRACES_ENDPOINT``, ``..._METRICS_ENDPOINT`` (full URLs); for ``grpc`` also ``host:port`` without a scheme | ``http://localhost:4317`` (grpc), ``http://localhost:4318`` (http) |
| insecure | ``OTEL_EXPORTER_OTLP_INSECURE`` / ``..._TRACES_INSECURE``, ``..._METRICS_INSECURE``: ``true`` or ``false``, for a gRPC endpoint without a scheme only: ``true`` plaintext (``http://host:port``), ``false`` TLS (``https://host:port``); a scheme wins | ``false`` |
| protocol | ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``..._TRACES_PROTOCOL``, ``..._METRICS_PROTOCOL``: ``grpc`` or ``http/protobuf`` | ``grpc`` |
| headers | ``OTEL_EXPORTER_OTLP_HEADERS`` / ``..._TRACES_HEADERS``, ``..._METRICS_HEADERS`` | none |
| export timeout | ``OTEL_EXPORTER_OTLP_TIMEOUT`` / ``..._TRACES_TIMEOUT``, ``..._METRICS_TIMEOUT`` (ms) | 10000 ms |
| compression | ``OTEL_EXPORTER_OTLP_COMPRESSION`` / ``..._TRACES_COMPRESSION``, ``..._METRICS_COMPRESSION``: ``gzip`` or ``none`` | none |
| trusted certificate | ``OTEL_EXPORTER_OTLP_CERTIFICATE`` / ``..._TRACES_CERTIFICATE``, ``..._METRICS_CERTIFICATE``: a PEM file, the root of trust of ``https://`` endpoints (a collector's self-signed certificate, or its CA); checked at configuration time | the system's trusted CAs |
| client certificate (mTLS) | ``OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`` and ``OTEL_EXPORTER_OTLP_CLIENT_KEY`` / their ``..._TRACES_`` and ``..._METRICS_`` forms: PEM certificate chain and private key the exporter presents, both or neither | none |
| sampler | ``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG`` | ``parentbased_always_on`` |
| span queue | ``OTEL_BSP_MAX_QUEUE_SIZE`` | 2048 spans |
| batch size | ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` | 512 spans |
| batch delay | ``OTEL_BSP_SCHEDULE_DELAY`` (ms) | 5000 ms |
| metric interval | ``OTEL_METRIC_EXPORT_INTERVAL`` (ms) | 60000 ms |
| exceptions as logs | ``OTEL_SEMCONV_EXCEPTION_SIGNAL_OPT_IN`` = ``logs`` / ``logs/dup``: not supported (no log export), said in a warning; exceptions stay span events | span events |
| RPC names | ``OTEL_SEMCONV_STABILITY_OPT_IN``: ``rpc`` the unreleased conventions' renames (``rpc.status_code``), ``rpc/dup`` every name (deprecated ones and size metrics too); see :mod:`zoomer_serve.semconv` | semantic conventions v1.44.0 |
| SDK off | ``OTEL_SDK_DISABLED=true`` (as the spec says, any value but ``true`` is false; one other than ``false`` logs a warning) | false |
| exporters | ``OTEL_TRACES_EXPORTER``, ``OTEL_METRICS_EXPORTER``: ``otlp`` or ``none`` (zoomer-serve exports OTLP only; ``none`` sends no spans, or no metrics) | ``otlp`` |
| export mode | ``ZOOMER_EXPORT_MODE``: ``process`` (a helper process encodes and sends), ``thread``, ``none`` | ``process`` |
| span limits | ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``, ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT``, ``OTEL_ATTRIBUTE_COUNT_LIMIT``, ``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``, ``OTEL_SPAN_EVENT_COUNT_LIMIT``, ``OTEL_SPAN_LINK_COUNT_LIMIT``, ``OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT``, ``OTEL_LINK_ATTRIBUTE_COUNT_LIMIT`` (see :class:`SpanLimits`) | none for lengths, 128 for counts |
| exception text | ``ZOOMER_EXCEPTION_VALUE_LENGTH_LIMIT``: characters kept of ``exception.message``, ``exception.stacktrace`` and error status messages | 8192 |
| flush on SIGTERM / SIGINT | ``ZOOMER_SIGNAL_HANDLERS``: ``on`` / ``off`` (see :mod:`zoomer_serve.lifecycle`) | ``on`` |
| export request size | ``ZOOMER_EXPORT_MAX_REQUEST_BYTES``: the most bytes of one OTLP request (traces or metrics, before compression); more goes out as several requests, a span too large for any request is dropped and counted (at least 16384) | 3145728 (3 MiB) |
| excluded methods | ``ZOOMER_EXCLUDED_METHODS`` (comma-separated globs over ``pkg.Service/Method``) | health, reflection, the profiler admin service |
| store | ``ZOOMER_STORE`` | ``./zoomer-data/zoomer.duckdb`` |
| GPU telemetry | ``ZOOMER_GPU`` and ``ZOOMER_GPU_*`` (see :mod:`zoomer_serve.telemetry.config`) | ``auto`` |
| host telemetry | ``ZOOMER_HOST``, ``ZOOMER_HOST_*`` and ``ZOOMER_CPU_PROFILE*`` (see :mod:`zoomer_serve.host.config`) | ``on`` |
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zoomer_serve import envvars
from zoomer_serve.envvars import INT_MAX
from zoomer_serve.semconv import EXCEPTION_SIGNAL_OPT_IN, exception_signal_note, rpc_opt_in

if TYPE_CHECKING:
    from zoomer_serve.host.config import HostConfig
    from zoomer_serve.telemetry.config import GpuTelemetryConfig

DEFAULT_EXCLUDED_METHODS = ("grpc.health.v1.Health/*", "grpc.reflection.*", "zoomer.profiling.v1.ProfilerControl/*")
PROTOCOLS = ("grpc", "http/protobuf")
EXPORT_MODES = ("process", "thread", "none")
DEFAULT_MAX_REQUEST_BYTES = 3 * 1024 * 1024  # under the OpenTelemetry Collector's 4 MiB gRPC receive limit
MIN_REQUEST_BYTES = 16 * 1024  # room for ordinary spans and metric points in every request

logger = logging.getLogger("zoomer_serve")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable (or argument) and the value."""


def is_count(value: Any, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool) with ``low <= value <= high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


SIGNALS = ("traces", "metrics")
COMPRESSIONS = ("gzip", "none")


@dataclass(frozen=True)
class _Rule:
    """What an ExportConfig field must hold: ``ok`` tells whether a value does, ``need`` says it in words."""

    ok: Callable[[Any], bool]
    need: str


def _one_of(values: tuple[str, ...]) -> _Rule:
    return _Rule(lambda value: value in values, f"one of {values}")


def _count(low: int) -> _Rule:
    return _Rule(lambda value: is_count(value, low, INT_MAX), f"an integer between {low} and {INT_MAX}")


_TLS = ("certificate", "client_key", "client_certificate")

_EXPORT_FIELDS: dict[str, tuple[str, _Rule | None]] = {
    "protocol": ("OTEL_EXPORTER_OTLP_PROTOCOL", _one_of(PROTOCOLS)),
    "compression": ("OTEL_EXPORTER_OTLP_COMPRESSION", _one_of(COMPRESSIONS)),
    "timeout_ms": ("OTEL_EXPORTER_OTLP_TIMEOUT", _count(1)),
    "metrics_protocol": ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", _one_of(PROTOCOLS)),
    "metrics_compression": ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", _one_of(COMPRESSIONS)),
    "metrics_timeout_ms": ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", _count(1)),
    "max_queue_size": ("OTEL_BSP_MAX_QUEUE_SIZE", _count(1)),
    "max_export_batch_size": ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _count(1)),
    "schedule_delay_ms": ("OTEL_BSP_SCHEDULE_DELAY", _count(1)),
    "metric_export_interval_ms": ("OTEL_METRIC_EXPORT_INTERVAL", _count(1)),
    "max_request_bytes": ("ZOOMER_EXPORT_MAX_REQUEST_BYTES", _count(MIN_REQUEST_BYTES)),
    "mode": ("ZOOMER_EXPORT_MODE", _one_of(EXPORT_MODES)),
    **{name: (f"OTEL_EXPORTER_OTLP_{name.upper()}", None) for name in _TLS},
    **{f"metrics_{name}": (f"OTEL_EXPORTER_OTLP_METRICS_{name.upper()}", None) for name in _TLS},
}
"""ExportConfig's checked fields: (the variable each is read from, what its value must be). A ``metrics_*`` field
may also be None (the field of the same name applies). The TLS files have no rule of their own: they are checked
together, per signal (:func:`check_tls_files`)."""


@dataclass(frozen=True)
class OtlpConnection:
    """How one signal's OTLP requests are sent (:meth:`ExportConfig.otlp`): ``endpoint``, the full URL (for
    ``http/protobuf`` with ``/v1/traces`` or ``/v1/metrics``); ``protocol``, ``grpc`` or ``http/protobuf``;
    ``headers`` sent with every request (HTTP headers or gRPC metadata); ``timeout_ms``, the time in ms one export
    of the signal may take, retries included; ``compression``, ``gzip`` or ``none``; ``certificate``, the path
    of the PEM file whose certificates are the root of trust of an ``https`` endpoint (None: the system's);
    ``client_certificate`` and ``client_key``, the PEM certificate chain and private key presented to the server
    (mTLS; both or None). The files are used for ``https`` endpoints only."""

    endpoint: str
    protocol: str
    headers: Mapping[str, str]
    timeout_ms: int
    compression: str
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None

    @property
    def secure(self) -> bool:
        """Whether the endpoint is ``https`` (TLS; the gRPC channel is secure)."""
        return urllib.parse.urlparse(self.endpoint).scheme == "https"


@dataclass
class ExportConfig:
    """Where and how spans and metrics leave the process.

    ``traces_endpoint`` is the full URL the trace exporter uses (for ``http/protobuf`` it includes
    ``/v1/traces``); ``metrics_endpoint`` likewise. Its scheme says whether the connection is TLS
    (``https``): :meth:`from_env <ZoomerConfig.from_env>` gives a gRPC endpoint set without a scheme one, by
    ``OTEL_EXPORTER_OTLP_INSECURE``. Times are in ms, sizes in spans.

    ``protocol``, ``headers``, ``timeout_ms`` and ``compression`` are the traces' connection settings, and the
    metrics' too where the matching ``metrics_*`` field is None (so an ExportConfig built in code with only
    them sets both signals, as before). :meth:`from_env <ZoomerConfig.from_env>` fills the ``metrics_*`` fields
    from the metrics' own variables (else the general ones): a trace setting never reaches the metrics.
    :meth:`otlp` gives one signal's settings, resolved.

    ``certificate``, ``client_key`` and ``client_certificate`` are paths of PEM files (TLS: the trusted
    certificate, the client's key and certificate chain), the traces' and the metrics' where the matching
    ``metrics_*`` field is None; a ``metrics_*`` field of ``""`` means none for the metrics. Each file is read
    and checked when the config is made (a file that does not exist or holds no PEM certificate or key, or a
    client key that does not match its certificate, is a ConfigError); the senders read them again.

    ``read_from`` maps a field to the environment variable :meth:`from_env <ZoomerConfig.from_env>` read it from
    (the per-signal one, or the general one); an error about that field names the variable, and an error about a
    field set in code names the field and its variable. One check serves both (``__post_init__``).

    Raises:
        ConfigError: a field is out of range or not one of its values, or a TLS file is unusable (the message
            names the field or the variable, and the value).
    """

    protocol: str = "grpc"
    traces_endpoint: str = "http://localhost:4317"
    metrics_endpoint: str = "http://localhost:4317"
    headers: dict[str, str] = field(default_factory=dict)
    timeout_ms: int = 10_000
    compression: str = "none"
    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    schedule_delay_ms: int = 5000
    metric_export_interval_ms: int = 60_000
    mode: str = "process"
    # -- which signals leave (OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER: otlp, or none for False) -----------
    traces: bool = True
    metrics: bool = True
    # -- export request size (bytes) ------------------------------------------------------------------------
    # Every OTLP request (traces and metrics) is at most this long, uncompressed: well under the OpenTelemetry
    # Collector's default gRPC receive limit (4 MiB). ZOOMER_EXPORT_MAX_REQUEST_BYTES.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # -- which RPC names (zoomer_serve.semconv.rpc_opt_in): "default" (v1.44.0), "next" or "dup" ---------------
    semconv_rpc: str = "default"
    # -- the metrics' own connection settings (OTEL_EXPORTER_OTLP_METRICS_*); None: the field of the same name
    # above (protocol, headers, timeout_ms in ms, compression) ------------------------------------------------
    metrics_protocol: str | None = None
    metrics_headers: dict[str, str] | None = None
    metrics_timeout_ms: int | None = None
    metrics_compression: str | None = None
    # -- TLS (OTEL_EXPORTER_OTLP_CERTIFICATE, _CLIENT_KEY, _CLIENT_CERTIFICATE): PEM file paths; the metrics_*
    # ones are the metrics' (None: the field above; "": none) -------------------------------------------------
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None
    metrics_certificate: str | None = None
    metrics_client_key: str | None = None
    metrics_client_certificate: str | None = None
    # -- where the fields above came from: {field: the environment variable read}, filled by from_env; an error
    # about a field names that variable (else ExportConfig.<field> and the variable it would be read from) ----
    read_from: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def otlp(self, signal: str) -> OtlpConnection:
        """The connection settings of ``signal`` (``"traces"`` or ``"metrics"``).

        Raises:
            ValueError: ``signal`` is neither.
        """
        if signal == "traces":
            return OtlpConnection(self.traces_endpoint, self.protocol, dict(self.headers), self.timeout_ms,
                                  self.compression, self.certificate or None, self.client_key or None,
                                  self.client_certificate or None)
        if signal == "metrics":
            def either(own: Any, shared: Any) -> Any:
                return shared if own is None else own

            return OtlpConnection(self.metrics_endpoint, either(self.metrics_protocol, self.protocol),
                                  dict(either(self.metrics_headers, self.headers)),
                                  either(self.metrics_timeout_ms, self.timeout_ms),
                                  either(self.metrics_compression, self.compression),
                                  either(self.metrics_certificate, self.certificate) or None,
                                  either(self.metrics_client_key, self.client_key) or None,
                                  either(self.metrics_client_certificate, self.client_certificate) or None)
        raise ValueError(f"an OTLP signal is one of {SIGNALS}, got {signal!r}")

    def _label(self, name: str) -> str:
        """How an error names field ``name``: the variable from_env read it from, else the field and its
        variable."""
        return self.read_from.get(name) or f"ExportConfig.{name} ({_EXPORT_FIELDS[name][0]})"

    def _tls_field(self, signal: str, name: str) -> str:
        """The field that gives ``signal`` its TLS file ``name``: the metrics' own unless it is None."""
        own = f"metrics_{name}"
        return own if signal == "metrics" and getattr(self, own) is not None else name

    @property
    def export_budget_ms(self) -> int:
        """The longer of the two signals' export timeouts (ms): the default budget of a flush and of shutdown."""
        return max(self.timeout_ms, self.otlp("metrics").timeout_ms)

    @property
    def sends_traces(self) -> bool:
        """Whether spans leave the process (an export mode other than ``none``, ``OTEL_TRACES_EXPORTER`` not
        ``none``)."""
        return self.mode != "none" and self.traces

    @property
    def sends_metrics(self) -> bool:
        """Whether metrics leave the process (an export mode other than ``none``, ``OTEL_METRICS_EXPORTER`` not
        ``none``)."""
        return self.mode != "none" and self.metrics

    def __post_init__(self) -> None:
        for name, (_, rule) in _EXPORT_FIELDS.items():
            value = getattr(self, name)
            if rule is not None and not (value is None and name.startswith("metrics_")) and not rule.ok(value):
                raise ConfigError(f"{self._label(name)} must be {rule.need}, got {value!r}")
        for signal in SIGNALS:
            otlp = self.otlp(signal)  # the metrics' files resolved, as they are used
            check_tls_files(otlp.certificate, otlp.client_key, otlp.client_certificate,
                            *(self._label(self._tls_field(signal, name)) for name in _TLS))
        if self.max_export_batch_size > self.max_queue_size:
            raise ConfigError("OTEL_BSP_MAX_EXPORT_BATCH_SIZE must not exceed OTEL_BSP_MAX_QUEUE_SIZE "
                              f"({self.max_export_batch_size} > {self.max_queue_size})")


@dataclass(frozen=True)
class SpanLimits:
    """OpenTelemetry's span limits, read from their standard variables (the span-specific one first, then the
    general one), and zoomer-serve's bound on exception text.

    ``attribute_value_length``: characters (bytes for byte values) kept of a string attribute value, and of each
    string in an array (None: no limit, the OpenTelemetry default); ``attribute_count``, ``event_count``,
    ``link_count``, ``event_attribute_count``, ``link_attribute_count``: how many are kept per span / event /
    link (128 each by default). What is cut is counted in the exported span's ``dropped_attributes_count``,
    ``dropped_events_count``, ``dropped_links_count`` (and the event's and link's own). Counts apply when the
    span is recorded (events, links) or encoded (attributes, lengths: off the request path).
    ``exception_value_length``: characters kept of ``exception.message`` and ``exception.stacktrace`` (whose
    first and last parts are kept, around a note of how much was cut) and of an error status message, 8192 by
    default: an exception's text is unbounded, a span must not be.
    """

    attribute_value_length: int | None = None
    attribute_count: int = 128
    event_count: int = 128
    link_count: int = 128
    event_attribute_count: int = 128
    link_attribute_count: int = 128
    exception_value_length: int = 8192

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SpanLimits:
        """Raises ConfigError naming the variable on a value that is not a non-negative integer."""
        def limit(names: tuple[str, ...], default: int | None) -> int | None:
            for name in names:
                if (env.get(name) or "").strip():
                    return envvars.integer(env, name, 0, ConfigError, minimum=0)
            return default

        general = ("OTEL_ATTRIBUTE_COUNT_LIMIT",)
        return cls(
            attribute_value_length=limit(("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
                                          "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"), None),
            attribute_count=limit(("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", *general), 128) or 0,
            event_count=limit(("OTEL_SPAN_EVENT_COUNT_LIMIT",), 128) or 0,
            link_count=limit(("OTEL_SPAN_LINK_COUNT_LIMIT",), 128) or 0,
            event_attribute_count=limit(("OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", *general), 128) or 0,
            link_attribute_count=limit(("OTEL_LINK_ATTRIBUTE_COUNT_LIMIT", *general), 128) or 0,
            exception_value_length=limit(("ZOOMER_EXCEPTION_VALUE_LENGTH_LIMIT",), 8192) or 0,
        )


@dataclass
class ZoomerConfig:
    """Everything :func:`zoomer_serve.configure` needs. Build it with :meth:`from_env`."""

    service_name: str = "zoomer-serve"
    resource_attributes: dict[str, str] = field(default_factory=dict)
    sampler: str = "parentbased_always_on"
    sampler_ratio: float = 1.0
    export: ExportConfig = field(default_factory=ExportConfig)
    semconv_rpc_dup: bool = False
    excluded_methods: tuple[str, ...] = DEFAULT_EXCLUDED_METHODS
    sdk_disabled: bool = False
    gpu: GpuTelemetryConfig = field(default_factory=lambda: _gpu_config({}))
    host: HostConfig = field(default_factory=lambda: _host_config({}))
    signal_handlers: bool = True
    span_limits: SpanLimits = field(default_factory=SpanLimits)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ZoomerConfig:
        """Read every setting from ``env`` (default ``os.environ``). Raises ConfigError on a bad value."""
        env = os.environ if env is None else env
        resource = parse_key_values(env.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES")
        service = env.get("OTEL_SERVICE_NAME") or resource.get("service.name") or "zoomer-serve"
        sampler, ratio = _sampler_from_env(env)
        excluded = env.get("ZOOMER_EXCLUDED_METHODS")
        note = exception_signal_note(env.get(EXCEPTION_SIGNAL_OPT_IN))
        if note:
            logger.warning("zoomer-serve: %s", note)
        return cls(
            service_name=service,
            resource_attributes=resource,
            sampler=sampler,
            sampler_ratio=ratio,
            export=_export_from_env(env),
            semconv_rpc_dup=rpc_opt_in(env.get("OTEL_SEMCONV_STABILITY_OPT_IN")) == "dup",
            excluded_methods=tuple(_csv(excluded)) if excluded is not None else DEFAULT_EXCLUDED_METHODS,
            sdk_disabled=otel_bool(env, "OTEL_SDK_DISABLED"),
            gpu=_gpu_config(env),
            host=_host_config(env),
            signal_handlers=envvars.switch(env, "ZOOMER_SIGNAL_HANDLERS", True, ConfigError, "on or off"),
            span_limits=SpanLimits.from_env(env),
        )


def _gpu_config(env: Mapping[str, str]) -> GpuTelemetryConfig:
    """The ``ZOOMER_GPU*`` settings (see :mod:`zoomer_serve.telemetry.config`)."""
    from zoomer_serve.telemetry.config import GpuConfigError, GpuTelemetryConfig

    try:
        return GpuTelemetryConfig.from_env(env)
    except GpuConfigError as exc:
        raise ConfigError(str(exc)) from None


def _host_config(env: Mapping[str, str]) -> HostConfig:
    """The ``ZOOMER_HOST*`` / ``ZOOMER_CPU_PROFILE*`` settings (see :mod:`zoomer_serve.host.config`)."""
    from zoomer_serve.host.config import HostConfig, HostConfigError

    try:
        return HostConfig.from_env(env)
    except HostConfigError as exc:
        raise ConfigError(str(exc)) from None


def otel_bool(env: Mapping[str, str], name: str) -> bool:
    """An OpenTelemetry boolean variable, read as the spec says: true only for ``true`` (any case, spaces
    around ignored); unset, empty, ``false`` or anything else is false, and anything else logs one warning
    naming the variable and the value. (``ZOOMER_*`` booleans are stricter: an unknown value raises.)"""
    raw = env.get(name, "").strip().lower()
    if raw not in ("", "true", "false"):
        logger.warning("zoomer-serve: %s=%r is neither true nor false; taken as false (OpenTelemetry reads any "
                       "value but true as false)", name, env.get(name))
    return raw == "true"


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def parse_key_values(value: str, variable: str) -> dict[str, str]:
    """Parse the W3C-baggage-like ``k=v,k2=v2`` form of ``OTEL_RESOURCE_ATTRIBUTES`` and
    ``OTEL_EXPORTER_OTLP_HEADERS`` (values percent-decoded). Raises ConfigError naming ``variable``."""
    out: dict[str, str] = {}
    for item in _csv(value):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{variable}: expected key=value pairs separated by commas, got {item!r}")
        out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(val.strip())
    return out


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an RFC 9110 token


def _check_headers(headers: dict[str, str], variable: str) -> dict[str, str]:
    """Headers that HTTP and gRPC metadata both accept: token names, printable values (no CR/LF)."""
    for name, value in headers.items():
        if not _HEADER_NAME.match(name):
            raise ConfigError(f"{variable}: {name!r} is not a valid header name")
        if not all(" " <= ch <= "~" or ch == "\t" for ch in value):
            raise ConfigError(f"{variable}: the value of {name!r} has characters a header "
                              "cannot carry (control characters or non-ASCII)")
    return headers


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    return envvars.integer(env, name, default, ConfigError, minimum=1)


def _sampler_from_env(env: Mapping[str, str]) -> tuple[str, float]:
    from zoomer_serve.recording.sampling import SAMPLER_NAMES

    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower() or "parentbased_always_on"
    if name not in SAMPLER_NAMES:
        raise ConfigError(f"OTEL_TRACES_SAMPLER={name!r} is not supported; use one of {', '.join(SAMPLER_NAMES)}")
    ratio = 1.0
    if name.endswith("traceidratio"):
        raw = (env.get("OTEL_TRACES_SAMPLER_ARG") or "").strip() or "1.0"  # empty counts as unset, as elsewhere
        try:
            ratio = float(raw)
        except ValueError:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {raw!r}") from None
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be within [0, 1], got {raw!r}")
    return name, ratio


def _signal(env: Mapping[str, str], signal: str, suffix: str) -> tuple[str, str | None]:
    """(the variable the setting comes from, its value): the per-signal one when set, else the general one."""
    specific = f"OTEL_EXPORTER_OTLP_{signal}_{suffix}"
    if env.get(specific):
        return specific, env[specific]
    general = f"OTEL_EXPORTER_OTLP_{suffix}"
    return general, env.get(general)


def _endpoint(env: Mapping[str, str], signal: str, protocol: str, insecure: bool) -> str:
    """``signal``'s endpoint URL: its own variable's as is, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` (for
    ``http/protobuf`` with ``/v1/<signal>`` appended), else the default. A gRPC endpoint without a scheme gets
    ``http://`` when ``insecure`` (:func:`_insecure`), else ``https://``."""
    specific = f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"
    if env.get(specific):
        return _url(env[specific], specific, protocol, insecure)
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        base = "http://localhost:4317" if protocol == "grpc" else "http://localhost:4318"
    base = _url(base, "OTEL_EXPORTER_OTLP_ENDPOINT", protocol, insecure)
    if protocol == "grpc":
        return base
    return base.rstrip("/") + "/v1/" + signal.lower()


def _url(value: str, variable: str, protocol: str, insecure: bool) -> str:
    """``value`` of ``variable`` as a checked http:// or https:// URL. For gRPC, ``host:port`` without a scheme
    (the form gRPC clients take) is allowed: ``https://host:port`` (TLS), or ``http://host:port`` (plaintext)
    when ``insecure``. Raises ConfigError naming ``variable``."""
    if protocol != "grpc" or "://" in value:
        return check_url(value, variable)
    target = value.strip().rstrip("/")
    url = f"{'http' if insecure else 'https'}://{target}"
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None or parsed.path or parsed.query or parsed.fragment:
        raise ConfigError(f"{variable}={value!r}: a gRPC endpoint without a scheme must be host:port (or use an "
                          "http:// or https:// URL)")
    return url


def _insecure(env: Mapping[str, str], signal: str) -> bool:
    """``OTEL_EXPORTER_OTLP_<signal>_INSECURE``, else ``OTEL_EXPORTER_OTLP_INSECURE``: whether a gRPC endpoint
    without a scheme is plaintext (``true``) or TLS (``false``, the default); read case-insensitively, empty is
    unset. An endpoint with a scheme ignores it (the scheme says), and OTLP/HTTP endpoints have one; it is checked
    all the same. Raises ConfigError naming the variable for any other value."""
    variable, raw = _signal(env, signal, "INSECURE")
    value = (raw or "").strip().lower()
    if value not in ("", "true", "false"):
        raise ConfigError(f"{variable}={raw!r} must be true or false (true: plaintext gRPC to an endpoint "
                          "without a scheme)")
    return value == "true"


def check_url(url: str, variable: str) -> str:
    """``url`` (stripped) when it is an http:// or https:// URL with a host and a valid port. Raises ConfigError
    naming ``variable`` (where the value came from)."""
    try:
        parsed = urllib.parse.urlparse(url.strip())
    except ValueError as exc:
        raise ConfigError(f"{variable} is not a valid URL ({exc}): {url!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{variable} must be an http:// or https:// URL with a host, got {url!r}")
    try:
        _ = parsed.port
    except ValueError:
        raise ConfigError(f"{variable} has an invalid port: {url!r}") from None
    return url.strip()


def _read_pem(path: str, variable: str, what: str) -> bytes:
    """The bytes of the PEM file ``path`` (``what``: the kind of PEM block it must hold). Raises ConfigError naming
    ``variable`` and the path when it cannot be read or holds no such block."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{variable}={path!r}: cannot read the file ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data or what.encode() not in data:
        raise ConfigError(f"{variable}={path!r}: the file holds no PEM {what.lower()}")
    return data


def check_tls_files(certificate: str | None, client_key: str | None, client_certificate: str | None,
                    certificate_var: str, client_key_var: str, client_certificate_var: str) -> None:
    """Check one signal's TLS files once, at configuration time: ``certificate`` a readable PEM file of
    certificates (the trusted ones), ``client_key`` and ``client_certificate`` both or neither, readable, and a
    private key matching its certificate chain. Raises ConfigError naming the variable and the path."""
    if certificate:
        _read_pem(certificate, certificate_var, "CERTIFICATE")
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=certificate)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{certificate_var}={certificate!r}: not a PEM certificate file ({exc})") from None
    if bool(client_key) != bool(client_certificate):
        missing = client_key_var if not client_key else client_certificate_var
        raise ConfigError(f"a TLS client certificate needs both {client_certificate_var} and {client_key_var}; "
                          f"{missing} is not set")
    if client_key and client_certificate:
        _read_pem(client_certificate, client_certificate_var, "CERTIFICATE")
        _read_pem(client_key, client_key_var, "PRIVATE KEY")
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(client_certificate, client_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{client_certificate_var}={client_certificate!r} / {client_key_var}={client_key!r}: "
                              f"cannot load the client certificate and key ({exc})") from None


def _exporter(env: Mapping[str, str], variable: str) -> bool:
    """Whether ``variable`` (``OTEL_TRACES_EXPORTER`` or ``OTEL_METRICS_EXPORTER``, a comma-separated list in
    the spec) asks for the OTLP exporter: ``otlp`` (the default) True, ``none`` False. Raises ConfigError for
    any other exporter (``console``, ``zipkin``, ``prometheus`` ...): zoomer-serve exports OTLP only."""
    names = {n.strip().lower() for n in (env.get(variable) or "otlp").split(",") if n.strip()} or {"otlp"}
    other = sorted(names - {"otlp", "none"})
    if other or names == {"otlp", "none"}:
        raise ConfigError(f"{variable}={env.get(variable)!r}: zoomer-serve exports OTLP only; use 'otlp' or 'none' "
                          f"(point OTEL_EXPORTER_OTLP_ENDPOINT at a collector that forwards to the backend you want)")
    return names == {"otlp"}


def _otlp_from_env(env: Mapping[str, str], signal: str) -> tuple[OtlpConnection, dict[str, str]]:
    """The connection settings of ``signal`` (``TRACES`` or ``METRICS``): each the signal's own variable when set,
    else the general one, else the default; and the variable each TLS file came from (``certificate``,
    ``client_key``, ``client_certificate``: the files are checked once, by ExportConfig, naming it). Raises
    ConfigError naming the variable a bad value came from."""
    protocol_var, protocol = _signal(env, signal, "PROTOCOL")
    protocol = (protocol or "grpc").strip().lower()  # the spec: enum values are read case-insensitively
    if protocol not in PROTOCOLS:
        raise ConfigError(f"{protocol_var}={protocol!r} is not supported; use 'grpc' or 'http/protobuf'")
    timeout_var, timeout = _signal(env, signal, "TIMEOUT")
    compression_var, compression = _signal(env, signal, "COMPRESSION")
    compression = (compression or "none").strip().lower()
    if compression not in COMPRESSIONS:
        raise ConfigError(f"{compression_var}={compression!r} is not supported; use 'gzip' or 'none'")
    headers_var, headers = _signal(env, signal, "HEADERS")
    tls = {name: _signal(env, signal, name.upper()) for name in _TLS}
    paths = {name: (value or "").strip() or None for name, (_, value) in tls.items()}
    connection = OtlpConnection(
        endpoint=_endpoint(env, signal, protocol, _insecure(env, signal)),
        protocol=protocol,
        headers=_check_headers(parse_key_values(headers or "", headers_var), headers_var),
        timeout_ms=_int({timeout_var: timeout} if timeout else {}, timeout_var, 10_000),
        compression=compression,
        **paths,
    )
    return connection, {name: variable for name, (variable, _) in tls.items()}


def _export_from_env(env: Mapping[str, str]) -> ExportConfig:
    (traces, traces_tls), (metrics, metrics_tls) = _otlp_from_env(env, "TRACES"), _otlp_from_env(env, "METRICS")
    return ExportConfig(
        protocol=traces.protocol,
        traces_endpoint=traces.endpoint,
        metrics_endpoint=metrics.endpoint,
        headers=dict(traces.headers),
        timeout_ms=traces.timeout_ms,
        compression=traces.compression,
        metrics_protocol=metrics.protocol,
        metrics_headers=dict(metrics.headers),
        metrics_timeout_ms=metrics.timeout_ms,
        metrics_compression=metrics.compression,
        certificate=traces.certificate,
        client_key=traces.client_key,
        client_certificate=traces.client_certificate,
        metrics_certificate=metrics.certificate or "",
        metrics_client_key=metrics.client_key or "",
        metrics_client_certificate=metrics.client_certificate or "",
        max_queue_size=_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
        max_export_batch_size=_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
        schedule_delay_ms=_int(env, "OTEL_BSP_SCHEDULE_DELAY", 5000),
        metric_export_interval_ms=_int(env, "OTEL_METRIC_EXPORT_INTERVAL", 60_000),
        mode=(env.get("ZOOMER_EXPORT_MODE") or "process").strip().lower(),
        traces=_exporter(env, "OTEL_TRACES_EXPORTER"),
        metrics=_exporter(env, "OTEL_METRICS_EXPORTER"),
        max_request_bytes=envvars.integer(env, "ZOOMER_EXPORT_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES,
                                          ConfigError, minimum=MIN_REQUEST_BYTES),
        semconv_rpc=rpc_opt_in(env.get("OTEL_SEMCONV_STABILITY_OPT_IN")),
        read_from={**traces_tls, **{f"metrics_{name}": variable for name, variable in metrics_tls.items()}},
    )
