"""What the overhead benchmark measures: server kinds and instrumentation configurations.

A row of the benchmark is one :class:`ServerKind` (the service and how a client calls it) run under one
:class:`Configuration` (the instrumentation in the server process). Adding a row is a few lines: write a
factory that returns an :class:`Instrumentation` and append a ``Configuration`` to :data:`CONFIGURATIONS`
(or a ``ServerKind`` to :data:`SERVER_KINDS`). Factories run inside the server process (instrumentation,
server) or the client process (payloads, callers), so they import what they need themselves.

The server process sets, before any factory runs: ``OTEL_SERVICE_NAME`` (unique per server process, so the
collector's store tells the processes apart), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the embedded collector's
OTLP/gRPC port) and ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``. Every other setting keeps its default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BARE = "bare"
CONTRIB = "contrib"
ZOOMER = "zoomer"


# -- instrumentation (runs in the server process) ------------------------------------------------------
@dataclass
class Instrumentation:
    """What a configuration installs in a server process.

    ``interceptors``: handed to the server kind's ``start``. ``shutdown``: flushes and stops the
    instrumentation before the server stops (bounded in time); returns counters for the report.
    ``helper_pids``: processes the instrumentation runs besides the server (their CPU counts too; children
    of the server are found anyway, this names any that are not).
    """

    interceptors: list[Any] = field(default_factory=list)
    shutdown: Callable[[], dict[str, Any]] = lambda: {}
    helper_pids: Callable[[], list[int]] = lambda: []


def no_instrumentation() -> Instrumentation:
    return Instrumentation()


def zoomer_interceptor() -> Instrumentation:
    """``ZoomerServerInterceptor()`` on zoomer-serve's default path: configured from the environment on
    construction, records to the bounded queue, exports through the helper process over OTLP/gRPC."""
    import zoomer_serve
    from interceptors import ZoomerServerInterceptor

    interceptor = ZoomerServerInterceptor()

    def shutdown() -> dict[str, Any]:
        stats = zoomer_serve.shutdown(timeout_s=10.0)
        return {} if stats is None else {"exported": stats.exported, "dropped": stats.dropped,
                                         "last_error": stats.last_error}

    def helper_pids() -> list[int]:
        pipeline = zoomer_serve.get_telemetry().pipeline
        pid = pipeline.helper_pid if pipeline is not None else None
        return [pid] if pid else []

    return Instrumentation([interceptor], shutdown, helper_pids)


def zoomer_record_only() -> Instrumentation:
    """The zoomer-serve interceptor with ``ZOOMER_EXPORT_MODE=none``: the request path records and drops each
    record (no queue, no writer thread, no helper). Isolates the recording cost."""
    os.environ["ZOOMER_EXPORT_MODE"] = "none"
    return zoomer_interceptor()


def zoomer_thread_export() -> Instrumentation:
    """The zoomer-serve interceptor with ``ZOOMER_EXPORT_MODE=thread``: encoding and OTLP export in a thread
    of the server process instead of the helper process."""
    os.environ["ZOOMER_EXPORT_MODE"] = "thread"
    return zoomer_interceptor()


def contrib_interceptor() -> Instrumentation:
    """``opentelemetry-instrumentation-grpc``'s ``server_interceptor()`` set up as its documentation shows:
    an SDK ``TracerProvider`` with a ``BatchSpanProcessor`` over ``OTLPSpanExporter``, and a ``MeterProvider``
    with a ``PeriodicExportingMetricReader`` over ``OTLPMetricExporter`` (SDK defaults otherwise)."""
    from opentelemetry import metrics, trace
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import server_interceptor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    endpoint = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
    resource = Resource.create({"service.name": os.environ["OTEL_SERVICE_NAME"]})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True))
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    metrics.set_meter_provider(meter_provider)

    def shutdown() -> dict[str, Any]:
        flushed = tracer_provider.force_flush(10_000)
        tracer_provider.shutdown()
        meter_provider.shutdown(timeout_millis=5_000)
        return {"flushed": bool(flushed)}

    return Instrumentation([server_interceptor()], shutdown)


@dataclass(frozen=True)
class Configuration:
    """One instrumentation setup: ``name`` (a JSON key), ``label`` (for tables), ``instrument`` (factory
    run in the server process before the server is built), ``exports`` (one SERVER span per request should
    reach the collector), ``default`` (measured unless ``--configs`` names the configurations to run)."""

    name: str
    label: str
    instrument: Callable[[], Instrumentation]
    exports: bool = True
    default: bool = True


CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration(BARE, "bare (no interceptor)", no_instrumentation, exports=False),
    Configuration(ZOOMER, "zoomer-serve interceptor, helper-process OTLP export", zoomer_interceptor),
    Configuration(CONTRIB, "OTel contrib interceptor + SDK BatchSpanProcessor + OTLP", contrib_interceptor),
    Configuration("zoomer_record_only", "zoomer-serve interceptor, records dropped (ZOOMER_EXPORT_MODE=none)",
                  zoomer_record_only, exports=False, default=False),
    Configuration("zoomer_thread", "zoomer-serve interceptor, in-process export thread (ZOOMER_EXPORT_MODE=thread)",
                  zoomer_thread_export, default=False),
)


# -- server kinds ----------------------------------------------------------------------------------------
@dataclass
class RunningServer:
    """A started server: ``port`` on 127.0.0.1, ``stop()`` stops it."""

    port: int
    stop: Callable[[], None]


ECHO_SERVICE = "bench.Echo"
ECHO_METHOD = f"/{ECHO_SERVICE}/Echo"
ECHO_PAYLOAD_BYTES = 1024
MODEL_METHOD = "/zoomer.demo.v1.Ranker/Predict"
MODEL_CANDIDATES = 16
MODEL_DISTINCT_REQUESTS = 32
SERVER_WORKERS = 8


def start_echo(interceptors: list[Any]) -> RunningServer:
    """A sync ``grpc.server`` (8 workers) with one raw-bytes unary method that returns its request."""
    from concurrent import futures

    import grpc

    def echo(request: bytes, context: Any) -> bytes:
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=SERVER_WORKERS), interceptors=interceptors,
                         options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        ECHO_SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return RunningServer(port, lambda: server.stop(1.0).wait(5.0))


def start_model(interceptors: list[Any]) -> RunningServer:
    """The demo DLRM ``Ranker`` server (``zoomer_serve.demo.service.build_server``, 8 workers) on the CPU with
    one torch thread (intra- and inter-op)."""
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # inter-op work already started (torch imported and used before): keep its pool
        pass
    from zoomer_serve.demo.model import build_model
    from zoomer_serve.demo.service import build_server

    model = build_model(device="cpu")
    server, port = build_server(model, "127.0.0.1", 0, interceptors=interceptors, max_workers=SERVER_WORKERS)
    return RunningServer(port, lambda: server.stop(1.0).wait(5.0))


def echo_payloads() -> list[bytes]:
    return [bytes([i]) * ECHO_PAYLOAD_BYTES for i in range(8)]


def model_payloads() -> list[bytes]:
    """Serialized valid ``PredictRequest`` messages, ``MODEL_CANDIDATES`` candidates each (fixed seed)."""
    import numpy as np

    from zoomer_serve.demo.load import make_request

    rng = np.random.default_rng(1234)
    return [make_request(rng, MODEL_CANDIDATES, request_id=f"bench-{i}").SerializeToString()
            for i in range(MODEL_DISTINCT_REQUESTS)]


def grpc_unary_caller(method: str) -> Callable[[str], tuple[Callable[[bytes], Any], Callable[[], None]]]:
    """A client factory for a unary method called with raw bytes: ``(target) -> (call, close)``."""

    def make(target: str) -> tuple[Callable[[bytes], Any], Callable[[], None]]:
        import grpc

        channel = grpc.insecure_channel(target)
        stub = channel.unary_unary(method)

        def call(payload: bytes) -> Any:
            return stub(payload, timeout=10.0)

        return call, channel.close

    return make


@dataclass(frozen=True)
class ServerKind:
    """A service under test: ``start`` (server process: interceptors -> RunningServer), ``payloads``
    (client process: the request bodies, sent round-robin), ``caller`` (client process, one per client
    thread: target -> (call(payload), close()); a failed call raises)."""

    name: str
    label: str
    start: Callable[[list[Any]], RunningServer]
    payloads: Callable[[], list[bytes]]
    caller: Callable[[str], tuple[Callable[[bytes], Any], Callable[[], None]]]


SERVER_KINDS: tuple[ServerKind, ...] = (
    ServerKind("echo", f"gRPC unary echo, {ECHO_PAYLOAD_BYTES} B raw bytes", start_echo, echo_payloads,
               grpc_unary_caller(ECHO_METHOD)),
    ServerKind("model", f"demo DLRM Ranker.Predict, {MODEL_CANDIDATES} candidates, 1 torch thread", start_model,
               model_payloads, grpc_unary_caller(MODEL_METHOD)),
)


def configuration(name: str) -> Configuration:
    for c in CONFIGURATIONS:
        if c.name == name:
            return c
    raise KeyError(f"unknown configuration {name!r}; known: {', '.join(c.name for c in CONFIGURATIONS)}")


def server_kind(name: str) -> ServerKind:
    for k in SERVER_KINDS:
        if k.name == name:
            return k
    raise KeyError(f"unknown server kind {name!r}; known: {', '.join(k.name for k in SERVER_KINDS)}")
