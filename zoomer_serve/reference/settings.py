"""Every environment variable zoomer-serve reads, with its unit, default and meaning: the one machine-readable
place for these facts outside the code that reads them. ``docs/reference/configuration.md`` is generated from
:data:`SETTINGS` (see :mod:`zoomer_serve.reference`); ``tests/test_docs_reference.py`` fails when the code reads
a variable missing here, or this table names one the code does not read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One variable: ``name``, its ``unit`` ("" for words and switches), ``default`` (as text, what applies
    when it is unset or empty), ``meaning`` (Markdown) and the ``group`` it is listed under."""

    name: str
    group: str
    unit: str
    default: str
    meaning: str


_CORE = "OpenTelemetry and export"
_RPC = "Requests and interceptors"
_GPU = "GPU telemetry"
_HOST = "Host telemetry and CPU profiles"
_PROF = "Kernel profiling and artifacts"
_COLL = "Embedded collector and store"
_LOAD = "Load tests (locust plugin and `zoomer-serve loadtest`)"
_INTERNAL = "Internal"

SETTINGS: tuple[Setting, ...] = (
    # -- OpenTelemetry and export -----------------------------------------------------------------------------
    Setting("OTEL_SERVICE_NAME", _CORE, "", "`zoomer-serve`",
            "`service.name` of this process (else `service.name` in `OTEL_RESOURCE_ATTRIBUTES`)"),
    Setting("OTEL_RESOURCE_ATTRIBUTES", _CORE, "", "none",
            "extra resource attributes, `k=v,k2=v2` (values percent-decoded)"),
    Setting("OTEL_SDK_DISABLED", _CORE, "", "`false`",
            "`true` turns everything off (any other value is false; one other than `false` logs a warning)"),
    Setting("OTEL_EXPORTER_OTLP_ENDPOINT", _CORE, "URL", "`http://localhost:4317` (grpc), "
            "`http://localhost:4318` (http/protobuf)",
            "where spans and metrics go; for `http/protobuf` a base URL (`/v1/traces`, `/v1/metrics` appended); "
            "for `grpc` also `host:port` without a scheme (TLS unless `OTEL_EXPORTER_OTLP_INSECURE=true`)"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", _CORE, "URL", "from `OTEL_EXPORTER_OTLP_ENDPOINT`",
            "the full URL for spans only"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", _CORE, "URL", "from `OTEL_EXPORTER_OTLP_ENDPOINT`",
            "the full URL for metrics only (a backend that takes traces only, such as Jaeger)"),
    Setting("OTEL_EXPORTER_OTLP_PROTOCOL", _CORE, "", "`grpc`", "`grpc` or `http/protobuf`"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", _CORE, "", "from `OTEL_EXPORTER_OTLP_PROTOCOL`",
            "the same for spans only, read first"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", _CORE, "", "from `OTEL_EXPORTER_OTLP_PROTOCOL`",
            "the same for metrics only, read first (metrics to an OTLP/HTTP port while spans go over gRPC)"),
    Setting("OTEL_EXPORTER_OTLP_HEADERS", _CORE, "", "none",
            "headers on every export, `k=v,k2=v2` (percent-encode spaces: `%20`)"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_HEADERS", _CORE, "", "from `OTEL_EXPORTER_OTLP_HEADERS`",
            "the same for spans only, read first (never sent with metrics)"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_HEADERS", _CORE, "", "from `OTEL_EXPORTER_OTLP_HEADERS`",
            "the same for metrics only, read first (never sent with spans)"),
    Setting("OTEL_EXPORTER_OTLP_TIMEOUT", _CORE, "ms", "10000",
            "export timeout; shutdown flushes within it (the longer of the two signals') plus 1 s"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", _CORE, "ms", "from `OTEL_EXPORTER_OTLP_TIMEOUT`",
            "the same for spans only, read first"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", _CORE, "ms", "from `OTEL_EXPORTER_OTLP_TIMEOUT`",
            "the same for metrics only, read first"),
    Setting("OTEL_EXPORTER_OTLP_COMPRESSION", _CORE, "", "`none`", "`gzip` or `none`"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", _CORE, "", "from `OTEL_EXPORTER_OTLP_COMPRESSION`",
            "the same for spans only, read first"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", _CORE, "", "from `OTEL_EXPORTER_OTLP_COMPRESSION`",
            "the same for metrics only, read first"),
    Setting("OTEL_EXPORTER_OTLP_INSECURE", _CORE, "", "`false`",
            "for a gRPC endpoint without a scheme (`host:port`): `true` plaintext, `false` TLS; an `http://` or "
            "`https://` endpoint ignores it (the scheme says); any value but `true` or `false` (any case) stops "
            "`configure()` (`ConfigError`)"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_INSECURE", _CORE, "", "from `OTEL_EXPORTER_OTLP_INSECURE`",
            "the same for spans only, read first"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_INSECURE", _CORE, "", "from `OTEL_EXPORTER_OTLP_INSECURE`",
            "the same for metrics only, read first"),
    Setting("OTEL_EXPORTER_OTLP_CERTIFICATE", _CORE, "path", "the system's trusted CAs",
            "PEM file of the certificates trusted for `https://` endpoints (a collector's self-signed certificate "
            "or its CA); a file that does not exist or holds no PEM certificate stops `configure()` "
            "(`ConfigError`)"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", _CORE, "path", "from `OTEL_EXPORTER_OTLP_CERTIFICATE`",
            "the same for spans only, read first"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", _CORE, "path", "from `OTEL_EXPORTER_OTLP_CERTIFICATE`",
            "the same for metrics only, read first"),
    Setting("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", _CORE, "path", "none",
            "PEM certificate chain the exporter presents to an `https://` endpoint (mTLS); needs "
            "`OTEL_EXPORTER_OTLP_CLIENT_KEY`"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", _CORE, "path",
            "from `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`", "the same for spans only, read first"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE", _CORE, "path",
            "from `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`", "the same for metrics only, read first"),
    Setting("OTEL_EXPORTER_OTLP_CLIENT_KEY", _CORE, "path", "none",
            "PEM private key of the client certificate (mTLS); both or neither"),
    Setting("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", _CORE, "path", "from `OTEL_EXPORTER_OTLP_CLIENT_KEY`",
            "the same for spans only, read first"),
    Setting("OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY", _CORE, "path", "from `OTEL_EXPORTER_OTLP_CLIENT_KEY`",
            "the same for metrics only, read first"),
    Setting("OTEL_TRACES_SAMPLER", _CORE, "", "`parentbased_always_on`",
            "the sampler (OpenTelemetry's names: `always_on`, `always_off`, `traceidratio` and their "
            "`parentbased_` forms); unsampled requests still count in the RPC metrics"),
    Setting("OTEL_TRACES_SAMPLER_ARG", _CORE, "ratio in [0, 1]", "1.0", "the ratio of the `traceidratio` samplers"),
    Setting("OTEL_BSP_MAX_QUEUE_SIZE", _CORE, "spans", "2048", "span records the bounded queue holds (more are "
            "dropped and counted)"),
    Setting("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _CORE, "spans", "512", "spans per batch (at most the queue size)"),
    Setting("OTEL_BSP_SCHEDULE_DELAY", _CORE, "ms", "5000", "longest wait before a batch goes out"),
    Setting("OTEL_TRACES_EXPORTER", _CORE, "", "`otlp`",
            "`otlp` or `none` (no span leaves; the RPC metrics still do); any other exporter is refused"),
    Setting("OTEL_METRICS_EXPORTER", _CORE, "", "`otlp`",
            "`otlp` or `none` (no metric leaves: the RPC, GPU and host metrics); any other exporter is refused"),
    Setting("OTEL_METRIC_EXPORT_INTERVAL", _CORE, "ms", "60000",
            "metric export period, and the period host metrics are read"),
    Setting("OTEL_SEMCONV_STABILITY_OPT_IN", _CORE, "", "off",
            "`rpc`: the unreleased conventions' renames (`rpc.status_code`) instead of v1.44.0's; `rpc/dup` "
            "(wins): every name, the older ones too (`rpc.system`, `rpc.service`, `rpc.grpc.status_code`, the "
            "size histograms)"),
    Setting("OTEL_SEMCONV_EXCEPTION_SIGNAL_OPT_IN", _CORE, "", "off",
            "`logs` / `logs/dup` ask for exceptions as log records: zoomer-serve exports no logs, keeps the "
            "`exception` span event and says so once"),
    Setting("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", _CORE, "characters", "no limit",
            "characters kept of a string attribute value"),
    Setting("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", _CORE, "characters", "from "
            "`OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`", "the same for span attributes, read first"),
    Setting("OTEL_ATTRIBUTE_COUNT_LIMIT", _CORE, "attributes", "128", "attributes kept per span, event and link"),
    Setting("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", _CORE, "attributes", "from `OTEL_ATTRIBUTE_COUNT_LIMIT`",
            "attributes kept per span"),
    Setting("OTEL_SPAN_EVENT_COUNT_LIMIT", _CORE, "events", "128", "events kept per span"),
    Setting("OTEL_SPAN_LINK_COUNT_LIMIT", _CORE, "links", "128", "links kept per span"),
    Setting("OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", _CORE, "attributes", "from `OTEL_ATTRIBUTE_COUNT_LIMIT`",
            "attributes kept per event"),
    Setting("OTEL_LINK_ATTRIBUTE_COUNT_LIMIT", _CORE, "attributes", "from `OTEL_ATTRIBUTE_COUNT_LIMIT`",
            "attributes kept per link"),
    Setting("ZOOMER_EXPORT_MODE", _CORE, "", "`process`",
            "`process` (a helper process encodes and sends), `thread`, `none` (export nothing)"),
    Setting("ZOOMER_EXPORT_MAX_REQUEST_BYTES", _CORE, "bytes", "3145728 (3 MiB)",
            "the most bytes of one OTLP request before compression (at least 16384); more goes out as several "
            "requests, a span too large for any request is dropped and counted"),
    Setting("ZOOMER_SIGNAL_HANDLERS", _CORE, "", "`on`", "`on`: flush on SIGTERM / SIGINT; `off`: install no "
            "handler"),
    # -- requests -----------------------------------------------------------------------------------------------
    Setting("ZOOMER_EXCLUDED_METHODS", _RPC, "", "`grpc.health.v1.Health/*,grpc.reflection.*,"
            "zoomer.profiling.v1.ProfilerControl/*`", "methods not traced: comma-separated globs over "
            "`pkg.Service/Method`"),
    Setting("ZOOMER_EXCEPTION_VALUE_LENGTH_LIMIT", _RPC, "characters", "8192",
            "characters kept of `exception.message`, `exception.stacktrace` and error status messages (0: all)"),
    # -- GPU ------------------------------------------------------------------------------------------------------
    Setting("ZOOMER_GPU", _GPU, "", "`auto`", "`auto` (on where CUDA or NVML is there), `on`, `off`"),
    Setting("ZOOMER_GPU_DEVICES", _GPU, "CUDA indices", "all visible", "watched CUDA devices, comma-separated"),
    Setting("ZOOMER_GPU_PEAK", _GPU, "", "`true`",
            "per-request peak memory (resets the allocator's peak statistics at request boundaries)"),
    Setting("ZOOMER_GPU_OOM", _GPU, "", "`true`", "the CUDA out-of-memory observer"),
    Setting("ZOOMER_GPU_MEMORY_HISTORY", _GPU, "", "`false`", "allocator events attributed to requests"),
    Setting("ZOOMER_GPU_MEMORY_HISTORY_STACKS", _GPU, "", "`python`", "stacks recorded with history: `python` or "
            "`none`"),
    Setting("ZOOMER_GPU_MEMORY_HISTORY_MAX_ENTRIES", _GPU, "entries per device", "10000", "history ring size"),
    Setting("ZOOMER_GPU_MEMORY_HISTORY_DRAIN_MS", _GPU, "ms", "1000", "history drain period"),
    Setting("ZOOMER_GPU_MEMORY_HISTORY_TOP_EVENTS", _GPU, "events", "5", "largest allocator events put on a "
            "request's span"),
    Setting("ZOOMER_GPU_NVML_PERIOD_MS", _GPU, "ms", "1000", "NVML sampling period"),
    # -- host -----------------------------------------------------------------------------------------------------
    Setting("ZOOMER_HOST", _HOST, "", "`on`", "host telemetry: everything below"),
    Setting("ZOOMER_HOST_METRICS", _HOST, "", "all groups", "groups `cpu`, `memory`, `disk`, `network`, `process`, "
            "`gc` and/or metric names, comma-separated, or `none`"),
    Setting("ZOOMER_HOST_REQUEST_CPU_TIME", _HOST, "", "`true`", "`zoomer.request.cpu_time_ns` on request spans "
            "(`false`: never, profiling sessions included)"),
    Setting("ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN", _HOST, "traces", "16", "outside profiling sessions, measure "
            "the CPU time of 1 in N sampled traces (0: only in sessions, 1: every request)"),
    Setting("ZOOMER_CPU_PROFILE", _HOST, "", "`auto`", "Python CPU profile in profiling sessions: `auto` (py-spy, "
            "else in-process), `py-spy`, `in-process`, `off`"),
    Setting("ZOOMER_CPU_PROFILE_RATE_HZ", _HOST, "Hz", "19", "samples per second per thread (1..1000)"),
    Setting("ZOOMER_CPU_PROFILE_TOP", _HOST, "functions", "10", "top functions put on the `zoomer.profile` span"),
    Setting("ZOOMER_CPU_PROFILE_PYSPY", _HOST, "path", "`py-spy` beside the interpreter, else on `PATH`",
            "the py-spy binary"),
    Setting("ZOOMER_CPU_PROFILE_ATTACH_TIMEOUT_MS", _HOST, "ms", "5000", "how long py-spy may take to attach"),
    # -- profiling ------------------------------------------------------------------------------------------------
    Setting("ZOOMER_PROFILES_DIR", _PROF, "path", "`./zoomer-data/profiles`", "where profiling sessions write "
            "their files (for `loadtest`: the server's folder as mounted here)"),
    Setting("ZOOMER_ADMIN_TOKEN", _PROF, "", "none: the admin service refuses every call",
            "shared token of the `ProfilerControl` admin service and of `zoomer-profile` request metadata"),
    Setting("ZOOMER_ADMIN_OPEN_LOOPBACK", _PROF, "", "`false`", "let loopback callers in without a token"),
    Setting("ZOOMER_ARTIFACTS_URL", _PROF, "URL or path", "the profiles folder",
            "where profiling artifacts are uploaded (fsspec URL such as `s3://bucket/prefix`, or a folder; `off`)"),
    Setting("ZOOMER_ARTIFACTS_QUEUE", _PROF, "sessions", "32", "upload jobs that may wait (more are refused and "
            "counted)"),
    Setting("ZOOMER_ARTIFACTS_RETRIES", _PROF, "attempts", "5", "further attempts after a failed upload"),
    # -- collector ------------------------------------------------------------------------------------------------
    Setting("ZOOMER_STORE", _COLL, "path", "`./zoomer-data/zoomer.duckdb`",
            "the DuckDB store of the embedded collector, `report` and `analyze`"),
    Setting("ZOOMER_COLLECTOR_TOKEN", _COLL, "", "none", "bearer token every export must carry"),
    Setting("ZOOMER_COLLECTOR_TLS_CERT", _COLL, "path", "none", "PEM certificate chain (`--tls-cert`)"),
    Setting("ZOOMER_COLLECTOR_TLS_KEY", _COLL, "path", "none", "PEM private key (`--tls-key`)"),
    Setting("ZOOMER_COLLECTOR_INSECURE_OPEN", _COLL, "", "`false`",
            "listen on a non-loopback address with neither token nor TLS (`--insecure-open`)"),
    Setting("ZOOMER_COLLECTOR_PARQUET_URL", _COLL, "URL or path", "none",
            "rotate the tables out as Parquet there (`--parquet-url`)"),
    Setting("ZOOMER_COLLECTOR_PARQUET_ROTATE_S", _COLL, "s", "60", "longest time between rotations"),
    Setting("ZOOMER_COLLECTOR_MAX_CONNECTIONS", _COLL, "connections", "4096", "open OTLP/HTTP connections"),
    Setting("ZOOMER_COLLECTOR_HEADER_TIMEOUT_S", _COLL, "s", "10", "deadline for a request's headers (and a TLS "
            "handshake)"),
    Setting("ZOOMER_COLLECTOR_BODY_TIMEOUT_S", _COLL, "s", "30", "deadline for a request's whole body"),
    Setting("ZOOMER_COLLECTOR_IDLE_TIMEOUT_S", _COLL, "s", "60", "idle connections close after this"),
    # -- load tests -----------------------------------------------------------------------------------------------
    Setting("ZOOMER_LOADTEST_TARGET", _LOAD, "host:port", "locust's `--host`", "the ProfilerControl address"),
    Setting("ZOOMER_LOADTEST_WARMUP_S", _LOAD, "s", "10", "after spawning completed, before profiling may start"),
    Setting("ZOOMER_LOADTEST_WARMUP_REQUESTS", _LOAD, "requests", "0",
            "after spawning completed, before profiling may start"),
    Setting("ZOOMER_LOADTEST_STABLE_CV", _LOAD, "ratio", "off", "profile once the coefficient of variation of "
            "locust's rolling median is at most this"),
    Setting("ZOOMER_LOADTEST_STABLE_SAMPLES", _LOAD, "samples", "5", "one-second samples the stability check uses"),
    Setting("ZOOMER_LOADTEST_PROFILE_REQUESTS", _LOAD, "requests", "100", "requests the session covers (0: bounded "
            "by duration only)"),
    Setting("ZOOMER_LOADTEST_PROFILE_DURATION_S", _LOAD, "s", "none (the server caps it at 60 s)",
            "session length"),
    Setting("ZOOMER_LOADTEST_CUDA", _LOAD, "", "`auto`", "capture CUDA kernels: `auto`, `on`, `off`"),
    Setting("ZOOMER_LOADTEST_STOP_WAIT_S", _LOAD, "s", "60", "at the end, wait this long for the server's trace"),
    Setting("ZOOMER_LOADTEST_SUMMARY_JSON", _LOAD, "path", "none", "write the run summary as JSON here"),
    Setting("ZOOMER_LOADTEST_TRANSPORT", _LOAD, "", "`grpc`", "the demo users' transport: `grpc` or `thrift`"),
    # -- internal -------------------------------------------------------------------------------------------------
    Setting("ZOOMER_CONFIGURE_ARGUMENTS", _INTERNAL, "JSON", "set by zoomer-serve",
            "the keyword arguments `zoomer_serve.configure()` was given, which it writes to `os.environ` (and "
            "removes when given none, and at `shutdown()`): a `multiprocessing` worker (spawn, forkserver) that records before "
            "configuring configures with them; other processes ignore it; do not set"),
    Setting("ZOOMER_WORKER_CONFIG", _INTERNAL, "JSON", "set by zoomer-serve",
            "the export helper's settings, passed from the server process to the helper it starts; do not set"),
    Setting("ZOOMER_PARENT_PID", _INTERNAL, "pid", "set by zoomer-serve",
            "the pid of the `demo` or `loadtest` that started this collector, server or locust, which it follows "
            "into death (Linux: SIGTERM when that command dies); taken out of the environment at start; do not "
            "set"),
)
