"""What the overhead benchmark measures: server kinds and instrumentation configurations.

A row of the benchmark is one :class:`ServerKind` (the service and how a client calls it) run under one
:class:`Configuration` (the instrumentation in the server process). Adding a row is a few lines: write a
factory that returns an :class:`Instrumentation` and append a ``Configuration`` to :data:`CONFIGURATIONS`
(or a ``ServerKind`` to :data:`SERVER_KINDS`). Factories run inside the server process (instrumentation,
server) or the client process (payloads, callers), so they import what they need themselves.

The server process sets, before any factory runs: ``OTEL_SERVICE_NAME`` (unique per server process, so the
collector's store tells the processes apart), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the embedded collector's
OTLP/gRPC port) and ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``, and :data:`OTLP_HTTP_ENDPOINT_VAR` (the same collector's
OTLP/HTTP port, for the configurations that export over HTTP). Every other setting keeps its default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BARE = "bare"
CONTRIB = "contrib"
ZOOMER = "zoomer"
PYTHON_WORK = "python_work"
OFFLOAD_WORK = "offload_work"
OTLP_HTTP_ENDPOINT_VAR = "ZOOMER_BENCH_OTLP_HTTP_ENDPOINT"
"""The benchmark collector's OTLP/HTTP endpoint, set in every server process beside the OTLP/gRPC one."""

# Transports: how a configuration plugs into a server kind.
GRPC = "grpc"  # interceptors are grpc.ServerInterceptor objects for grpc.server(interceptors=...)
GRPC_AIO = "grpc_aio"  # grpc.aio.ServerInterceptor objects for grpc.aio.server(interceptors=...)
THRIFT = "thrift"  # thriftpy2 has no interceptor chain: the one "interceptor" is the server builder to use
ALL_TRANSPORTS = (GRPC, GRPC_AIO, THRIFT)


# -- instrumentation (runs in the server process) ------------------------------------------------------
@dataclass
class Instrumentation:
    """What a configuration installs in a server process.

    ``interceptors``: handed to the server kind's ``start`` (for :data:`THRIFT`: at most one, a callable with
    ``interceptors.make_thrift_server``'s signature that builds the server instead of thriftpy2's plain one). ``shutdown``: flushes and stops the
    instrumentation before the server stops (bounded in time); returns counters for the report.
    ``helper_pids``: processes the instrumentation runs besides the server (their CPU counts too; children
    of the server are found anyway, this names any that are not).
    """

    interceptors: list[Any] = field(default_factory=list)
    shutdown: Callable[[], dict[str, Any]] = lambda: {}
    helper_pids: Callable[[], list[int]] = lambda: []


def no_instrumentation(transport: str = GRPC) -> Instrumentation:
    return Instrumentation()


def _zoomer_adapter(transport: str) -> Any:
    """zoomer-serve's adapter for ``transport``, on the process's telemetry (configured from the environment
    on first use; the export helper has said it is ready when this returns)."""
    import interceptors
    import zoomer_serve

    zoomer_serve.get_telemetry()
    if transport == GRPC:
        return interceptors.ZoomerServerInterceptor()
    if transport == GRPC_AIO:
        return interceptors.ZoomerAioServerInterceptor()
    if transport == THRIFT:
        return interceptors.make_thrift_server
    raise ValueError(f"unknown transport {transport!r}; known: {', '.join(ALL_TRANSPORTS)}")


def zoomer_interceptor(transport: str = GRPC) -> Instrumentation:
    """zoomer-serve's adapter for the transport on zoomer-serve's default path: configured from the environment,
    records to the bounded queue, exports through the helper process over OTLP/gRPC. gRPC:
    ``ZoomerServerInterceptor()``; grpc.aio: ``ZoomerAioServerInterceptor()``; Thrift:
    ``interceptors.make_thrift_server`` (a ``TracedProcessor`` behind metered transports)."""
    import zoomer_serve

    interceptor = _zoomer_adapter(transport)

    def shutdown() -> dict[str, Any]:
        stats = zoomer_serve.shutdown(timeout_s=10.0)
        return {} if stats is None else {"exported": stats.exported, "dropped": stats.dropped,
                                         "last_error": stats.last_error}

    def helper_pids() -> list[int]:
        pipeline = zoomer_serve.get_telemetry().pipeline
        pid = pipeline.helper_pid if pipeline is not None else None
        return [pid] if pid else []

    return Instrumentation([interceptor], shutdown, helper_pids)


def zoomer_http(transport: str = GRPC) -> Instrumentation:
    """The zoomer-serve interceptor on its default path but exporting over OTLP/HTTP
    (``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf``, the collector's HTTP port): against ``zoomer``, what the
    transport to the collector costs the helper and the collector."""
    os.environ.update(OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                      OTEL_EXPORTER_OTLP_ENDPOINT=os.environ[OTLP_HTTP_ENDPOINT_VAR])
    return zoomer_interceptor(transport)


def zoomer_record_only(transport: str = GRPC) -> Instrumentation:
    """The zoomer-serve interceptor with ``ZOOMER_EXPORT_MODE=none``: the request path records and drops each
    record (no queue, no writer thread, no helper). Isolates the recording cost."""
    os.environ["ZOOMER_EXPORT_MODE"] = "none"
    return zoomer_interceptor(transport)


def zoomer_thread_export(transport: str = GRPC) -> Instrumentation:
    """The zoomer-serve interceptor with ``ZOOMER_EXPORT_MODE=thread``: encoding and OTLP export in a thread
    of the server process instead of the helper process."""
    os.environ["ZOOMER_EXPORT_MODE"] = "thread"
    return zoomer_interceptor(transport)


def zoomer_no_cpu_time(transport: str = GRPC) -> Instrumentation:
    """The zoomer-serve interceptor on its default path but without the per-request thread CPU time
    (``ZOOMER_HOST_REQUEST_CPU_TIME=false``): against ``zoomer``, what the CPU time costs on its default sample
    (1 in 16 requests)."""
    os.environ["ZOOMER_HOST_REQUEST_CPU_TIME"] = "false"
    return zoomer_interceptor(transport)


def zoomer_cpu_time_every(transport: str = GRPC) -> Instrumentation:
    """The zoomer-serve interceptor with the per-request thread CPU time on every request
    (``ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN=1``, as inside a profiling session): against ``zoomer_no_cpu_time``,
    what the two thread-clock reads cost per measured request."""
    os.environ["ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN"] = "1"
    return zoomer_interceptor(transport)


def passthrough_interceptor(transport: str = GRPC, work_us: float = 0.0) -> Instrumentation:
    """A ``grpc.ServerInterceptor`` that wraps each unary-unary handler in a plain Python function and records
    nothing: the floor any Python server interceptor pays (grpc runs its interceptor pipeline and a wrapped
    handler). ``work_us``: µs of plain Python (an empty loop, calibrated at start) the wrapper runs before the
    handler (the ``passthrough_work`` control row). gRPC sync only."""

    if transport != GRPC:
        raise ValueError(f"the pass-through interceptor has no {transport!r} form")
    iterations = _spin_iterations(work_us) if work_us > 0 else 0

    def work() -> None:
        for _ in range(iterations):
            pass

    return Instrumentation([_wrapping_interceptor(work)], lambda: {"work_us": work_us, "loop_iterations": iterations})


def _wrapping_interceptor(before: Callable[[], None]) -> Any:
    """A ``grpc.ServerInterceptor`` that wraps each unary-unary handler in a plain function calling ``before()``
    and then the handler, and records nothing."""
    import grpc

    class PassThrough(grpc.ServerInterceptor):  # type: ignore[misc]
        def __init__(self) -> None:
            self._wrapped: dict[str, tuple[Any, Any]] = {}

        def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = continuation(details)
            if handler is None or handler.request_streaming or handler.response_streaming:
                return handler
            cached = self._wrapped.get(details.method)
            if cached is not None and cached[0] is handler:
                return cached[1]
            behavior = handler.unary_unary

            def call(request: Any, context: Any) -> Any:
                before()
                return behavior(request, context)

            wrapped = grpc.unary_unary_rpc_method_handler(call, handler.request_deserializer,
                                                          handler.response_serializer)
            self._wrapped[details.method] = (handler, wrapped)
            return wrapped

    return PassThrough()


def passthrough_work(transport: str = GRPC) -> Instrumentation:
    """A control row: :func:`passthrough_interceptor` running :data:`PASSTHROUGH_WORK_US` µs of plain Python per
    call. Set beside ``zoomer_record_only``: what that much Python in a hot loop costs the saturated server."""
    return passthrough_interceptor(transport, PASSTHROUGH_WORK_US)


def contrib_interceptor(transport: str = GRPC) -> Instrumentation:
    """``opentelemetry-instrumentation-grpc``'s ``server_interceptor()`` (grpc.aio: ``aio_server_interceptor()``)
    set up as its documentation shows: an SDK ``TracerProvider`` with a ``BatchSpanProcessor`` over ``OTLPSpanExporter``, and a ``MeterProvider``
    with a ``PeriodicExportingMetricReader`` over ``OTLPMetricExporter`` (SDK defaults otherwise)."""
    from opentelemetry import metrics, trace
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, server_interceptor
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

    if transport not in (GRPC, GRPC_AIO):
        raise ValueError(f"the contrib interceptor has no {transport!r} form")
    return Instrumentation([server_interceptor() if transport == GRPC else aio_server_interceptor()], shutdown)


PYTHON_WORK_US = 15.0
"""The plain Python work per call of the ``python_work`` control row, in µs of a hot loop: about what
zoomer-serve's Thrift adapter costs per call in a hot loop (traced processor and metered transport over
thriftpy2's plain ones, recording included: 14 µs on the benchmark machine, 2026-11-29)."""


PASSTHROUGH_WORK_US = 8.0
"""The plain Python work per call of the ``passthrough_work`` control row, in µs of a hot loop: about what
zoomer-serve's gRPC interceptor and the demo model's three phases add per call in a hot loop over a pass-through
wrapper (``request_path.py``'s model kind with the phases: 16.0 µs against 7.5 µs, 2026-12-03)."""


def _spin_iterations(us: float) -> int:
    """Iterations of an empty ``for`` loop that take ``us`` µs on this machine now (best of 20 timings)."""
    import time

    n, best = 20_000, float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(n):
            pass
        best = min(best, time.perf_counter() - t0)
    return max(1, round(us * 1e-6 / (best / n)))


def python_work_thrift(transport: str = THRIFT) -> Instrumentation:
    """A control row, not instrumentation: thriftpy2's plain server whose processor runs :data:`PYTHON_WORK_US`
    µs of plain Python (an empty loop, calibrated when the server starts) in each call, between decoding the
    request and running the handler. What that much Python per call costs the server, to set beside the zoomer
    row (in particular when client threads saturate the server: the convoy on the interpreter lock multiplies
    every µs added to a call). Its counters (``meta.instrumentation_counters``) give the calibrated loop.
    Thrift only."""
    from thriftpy2.thrift import TProcessor

    if transport != THRIFT:
        raise ValueError(f"the python_work control row has no {transport!r} form")
    iterations = _spin_iterations(PYTHON_WORK_US)

    class PythonWorkProcessor(TProcessor):  # type: ignore[misc]
        def process_in(self, iprot: Any) -> Any:
            decoded = super().process_in(iprot)
            for _ in range(iterations):
                pass
            return decoded

    def build(service: Any, handler: object, host: str, port: int, client_timeout: int) -> PlainThriftServer:
        return PlainThriftServer(service, handler, host, port, PythonWorkProcessor, client_timeout=client_timeout)

    return Instrumentation([build], lambda: {"python_work_us": PYTHON_WORK_US, "loop_iterations": iterations})


OFFLOAD_WORK_US = 15.0
"""The work per call that the ``offload_work`` control row hands to a child process, in µs of a hot loop. In the
saturated benchmark the child's loop costs about twice that in CPU (59 µs per call for 30 in a run of 2026-12-02),
so 15 come to about what zoomer-serve's export helper spends per Thrift span there (22 to 28 µs)."""
OFFLOAD_CALLS_PER_BYTE = 64  # the server writes one byte to the child per this many calls

_OFFLOAD_CHILD = """
import os, sys
os.nice(5)  # as zoomer-serve's export helper
iterations = int(sys.argv[1])
while True:
    chunk = os.read(0, 4096)
    if not chunk:
        break
    for _ in range(len(chunk) * iterations):
        pass
"""


def _children_cpu_s(who: int) -> float:
    """User + system CPU seconds of the waited-for child processes (``resource.getrusage``)."""
    import resource

    usage = resource.getrusage(who)
    return round(usage.ru_utime + usage.ru_stime, 4)


class _OffloadChild:
    """The ``offload_work`` row's child process and the server's end of its pipe: :meth:`call` once per call."""

    def __init__(self) -> None:
        import itertools
        import subprocess
        import sys

        self.iterations = _spin_iterations(OFFLOAD_WORK_US)
        self.child = subprocess.Popen([sys.executable, "-c", _OFFLOAD_CHILD,
                                       str(self.iterations * OFFLOAD_CALLS_PER_BYTE)],
                                      stdin=subprocess.PIPE, close_fds=True)
        assert self.child.stdin is not None
        self._fd = self.child.stdin.fileno()
        os.set_blocking(self._fd, False)
        self._calls = itertools.count(1)
        self.skipped = 0

    def call(self) -> None:
        """Count a call; every :data:`OFFLOAD_CALLS_PER_BYTE`-th writes the child a byte (never waits: a byte that
        does not fit is counted as skipped)."""
        if next(self._calls) % OFFLOAD_CALLS_PER_BYTE == 0:
            try:
                os.write(self._fd, b"w")
            except BlockingIOError:
                self.skipped += 1

    def shutdown(self) -> dict[str, Any]:
        import resource
        import subprocess

        assert self.child.stdin is not None
        self.child.stdin.close()
        try:
            self.child.wait(10.0)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
        return {"offload_work_us": OFFLOAD_WORK_US, "loop_iterations": self.iterations,
                "calls": next(self._calls) - 1, "bytes_skipped": self.skipped,
                "child_cpu_s": _children_cpu_s(resource.RUSAGE_CHILDREN)}


def offload_work(transport: str = THRIFT) -> Instrumentation:
    """A control row, not instrumentation: the plain server (thriftpy2's processor, or for gRPC a pass-through
    interceptor) handing work to a child process, as zoomer-serve hands its export to a helper process, and
    recording nothing. The server counts its calls and writes one byte to the child's stdin per
    :data:`OFFLOAD_CALLS_PER_BYTE` calls (a non-blocking pipe: a byte that does not fit is counted in
    ``bytes_skipped``, never waited for); the child, at niceness 5 as the export helper, runs
    :data:`OFFLOAD_WORK_US` µs of plain Python (an empty loop, calibrated when the server starts) per call for
    each byte: work in small, even pieces, where the export comes every half second. Like the export helper's,
    the child's work runs partly after its slice of the benchmark has ended, in the next row's slice (the next
    configuration in ``--configs``; after the last, the first). What that much CPU per call in another process
    costs the server's latency, to set beside the zoomer row's: on a machine whose cores the client and server
    already fill, work in any other process takes CPU time from them whatever its priority. The child is the
    server's descendant, so its CPU counts in the row's CPU per request; its counters give the calls, the bytes
    skipped and the child's CPU seconds once it has exited (``child_cpu_s``). Thrift and gRPC sync."""
    if transport == GRPC:
        offload = _OffloadChild()
        return Instrumentation([_wrapping_interceptor(offload.call)], offload.shutdown)
    if transport != THRIFT:
        raise ValueError(f"the offload_work control row has no {transport!r} form")
    from thriftpy2.thrift import TProcessor

    offload = _OffloadChild()

    class OffloadProcessor(TProcessor):  # type: ignore[misc]
        def process_in(self, iprot: Any) -> Any:
            decoded = super().process_in(iprot)
            offload.call()
            return decoded

    def build(service: Any, handler: object, host: str, port: int, client_timeout: int) -> PlainThriftServer:
        return PlainThriftServer(service, handler, host, port, OffloadProcessor, client_timeout=client_timeout)

    return Instrumentation([build], offload.shutdown)


@dataclass(frozen=True)
class Configuration:
    """One instrumentation setup: ``name`` (a JSON key), ``label`` (for tables), ``instrument`` (factory run
    in the server process before the server is built, given the server kind's transport), ``exports`` (one
    SERVER span per request should reach the collector), ``default`` (measured unless ``--configs`` names the
    configurations to run), ``transports`` (the server kinds it applies to; other kinds skip it)."""

    name: str
    label: str
    instrument: Callable[[str], Instrumentation]
    exports: bool = True
    default: bool = True
    transports: tuple[str, ...] = ALL_TRANSPORTS


CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration(BARE, "bare (no interceptor)", no_instrumentation, exports=False),
    Configuration(ZOOMER, "zoomer-serve interceptor, helper-process OTLP export", zoomer_interceptor),
    Configuration(CONTRIB, "OTel contrib interceptor + SDK BatchSpanProcessor + OTLP", contrib_interceptor,
                  transports=(GRPC, GRPC_AIO)),
    Configuration("zoomer_record_only", "zoomer-serve interceptor, records dropped (ZOOMER_EXPORT_MODE=none)",
                  zoomer_record_only, exports=False, default=False),
    Configuration("passthrough", "pass-through interceptor (wraps the handler, records nothing)",
                  passthrough_interceptor, exports=False, default=False, transports=(GRPC,)),
    Configuration("passthrough_work", f"control: pass-through interceptor + {PASSTHROUGH_WORK_US:.0f} µs of plain "
                  "Python per call", passthrough_work, exports=False, default=False, transports=(GRPC,)),
    Configuration("zoomer_http", "zoomer-serve interceptor, helper-process export over OTLP/HTTP "
                  "(OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf)", zoomer_http, default=False),
    Configuration("zoomer_thread", "zoomer-serve interceptor, in-process export thread (ZOOMER_EXPORT_MODE=thread)",
                  zoomer_thread_export, default=False),
    Configuration("zoomer_no_cpu_time", "zoomer-serve interceptor without per-request CPU time "
                  "(ZOOMER_HOST_REQUEST_CPU_TIME=false)", zoomer_no_cpu_time, default=False),
    Configuration("zoomer_cpu_time_every", "zoomer-serve interceptor with per-request CPU time on every request "
                  "(ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN=1)", zoomer_cpu_time_every, default=False),
    Configuration(PYTHON_WORK, f"control: plain processor + {PYTHON_WORK_US:.0f} µs of plain Python per call",
                  python_work_thrift, exports=False, transports=(THRIFT,)),
    Configuration(OFFLOAD_WORK, f"control: plain server + {OFFLOAD_WORK_US:.0f} µs of CPU per call in a child "
                  "process (niceness 5)", offload_work, exports=False, default=False, transports=(THRIFT, GRPC)),
)


def _with_gpu_rows(configs: tuple[Configuration, ...]) -> tuple[Configuration, ...]:
    from _bench_gpu import gpu_configurations  # its rows are built on Configuration (defined above)

    return configs + tuple(gpu_configurations())


CONFIGURATIONS = _with_gpu_rows(CONFIGURATIONS)


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


def start_echo_aio(interceptors: list[Any]) -> RunningServer:
    """A ``grpc.aio`` server with the same raw-bytes unary echo (an ``async def`` handler), served by an event
    loop that runs in a thread of the server process (the process's only event loop)."""
    import asyncio
    import threading

    import grpc

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()

    async def serve() -> None:
        server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            ECHO_SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        ready["port"] = server.add_insecure_port("127.0.0.1:0")
        ready["stop"] = asyncio.Event()
        await server.start()
        started.set()
        await ready["stop"].wait()
        await server.stop(1.0)

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:  # reported to the starting thread
            ready["error"] = exc
            started.set()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="bench-aio-loop", daemon=True)
    thread.start()
    if not started.wait(60) or "error" in ready:
        raise RuntimeError(f"the grpc.aio echo server did not start: {ready.get('error', 'timeout')}")

    def stop() -> None:
        loop.call_soon_threadsafe(ready["stop"].set)
        thread.join(10.0)

    return RunningServer(ready["port"], stop)


THRIFT_IDL = Path(__file__).resolve().parent / "bench_echo.thrift"


def _echo_thrift() -> Any:
    import thriftpy2

    return thriftpy2.load(str(THRIFT_IDL), module_name="bench_echo_thrift")


class _ThriftEcho:
    def echo(self, payload: bytes) -> bytes:
        return payload


class PlainThriftServer:
    """thriftpy2's own server as ``thriftpy2.rpc.make_server`` builds it (``TThreadedServer`` over a
    ``TProcessor``, its default binary protocol and buffered transport), except that the socket binds to port 0
    before serving (thriftpy2's helper refuses port 0). ``processor_cls``: a
    ``TProcessor`` subclass to serve with instead; ``client_timeout``: each connection's socket timeout in ms.
    Has the ``start`` / ``port`` / ``stop`` of ``interceptors.make_thrift_server``'s servers."""

    def __init__(self, service: Any, handler: object, host: str, port: int, processor_cls: Any = None, *,
                 client_timeout: int = 3000) -> None:
        import threading

        from thriftpy2.server import TThreadedServer
        from thriftpy2.thrift import TProcessor

        from interceptors.thrift_server import BoundServerSocket

        sock = BoundServerSocket(host=host, port=port, client_timeout=client_timeout)
        sock.listen()
        self.port = int(sock.port or 0)
        self._server = TThreadedServer((processor_cls or TProcessor)(service, handler), sock, daemon=True)
        self._thread = threading.Thread(target=self._server.serve, name="bench-thrift-accept", daemon=True)

    def start(self) -> PlainThriftServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        import socket

        self._server.close()
        try:  # wake the blocked accept() so that the loop sees ``closed``
            socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
        except OSError:
            pass
        self._thread.join(5.0)
        self._server.trans.close()


THRIFT_CLIENT_TIMEOUT_MS = 30_000
"""The Thrift servers' idle timeout per connection (every row alike). thriftpy2's default, 3 s, is shorter than
the longest pause of one client connection while the other rows take their slices (up to 2 × (rows - 1)
slices), after which the server would close it and the next calls fail."""


def start_thrift_echo(interceptors: list[Any]) -> RunningServer:
    """A thriftpy2 threaded server (a thread per connection) with one method, ``Echo.echo(binary) -> binary``
    (``benchmarks/bench_echo.thrift``). Bare: thriftpy2's plain processor (:class:`PlainThriftServer`); other
    rows: the builder the configuration hands over (``interceptors.make_thrift_server`` for zoomer)."""
    if len(interceptors) > 1:
        raise ValueError("a Thrift server kind takes at most one server builder")
    build = interceptors[0] if interceptors else PlainThriftServer
    server = build(_echo_thrift().Echo, _ThriftEcho(), "127.0.0.1", 0, client_timeout=THRIFT_CLIENT_TIMEOUT_MS)
    server.start()
    return RunningServer(int(server.port), server.stop)


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


def thrift_echo_caller(target: str) -> tuple[Callable[[bytes], Any], Callable[[], None]]:
    """A thriftpy2 client (``thriftpy2.rpc.make_client``, its default protocol and transport) of the echo."""
    from thriftpy2.rpc import make_client

    host, port = target.rsplit(":", 1)
    client = make_client(_echo_thrift().Echo, host, int(port), timeout=10_000)
    return client.echo, client.close


MODEL_PAIRED_SCALE = 3.0
"""In the full run the model's paired phases last three times the mode's seconds per server. A model call costs
~1.7 ms of server CPU, of which zoomer-serve's share is ~120 µs: in 3 s per server (~3 000 calls) the per-round
overhead ratio's standard deviation was 0.13 in two runs (4 and 8 rounds, 0.20 to 0.80); in 8 to 12 s per server,
0.05 to 0.11 in three runs of 3 or 4 rounds (benchmarks/RESULTS.md, runs of 2026-12-03)."""


@dataclass(frozen=True)
class ServerKind:
    """A service under test: ``start`` (server process: interceptors -> RunningServer), ``payloads``
    (client process: the request bodies, sent round-robin), ``caller`` (client process, one per client
    thread: target -> (call(payload), close()); a failed call raises), ``transport`` (what the
    configurations' instrumentation must produce for ``start``; configurations without it are skipped),
    ``paired_scale`` (how many times the mode's paired seconds per server this kind's paired phases last)."""

    name: str
    label: str
    start: Callable[[list[Any]], RunningServer]
    payloads: Callable[[], list[bytes]]
    caller: Callable[[str], tuple[Callable[[bytes], Any], Callable[[], None]]]
    transport: str = GRPC
    paired_scale: float = 1.0

    def runs(self, config: Configuration) -> bool:
        """Whether ``config`` applies to this kind."""
        return self.transport in config.transports


SERVER_KINDS: tuple[ServerKind, ...] = (
    ServerKind("echo", f"gRPC unary echo, {ECHO_PAYLOAD_BYTES} B raw bytes", start_echo, echo_payloads,
               grpc_unary_caller(ECHO_METHOD)),
    ServerKind("model", f"demo DLRM Ranker.Predict, {MODEL_CANDIDATES} candidates, 1 torch thread", start_model,
               model_payloads, grpc_unary_caller(MODEL_METHOD), paired_scale=MODEL_PAIRED_SCALE),
    ServerKind("echo_aio", f"grpc.aio unary echo, {ECHO_PAYLOAD_BYTES} B raw bytes, async handler", start_echo_aio,
               echo_payloads, grpc_unary_caller(ECHO_METHOD), GRPC_AIO),
    ServerKind("thrift_echo", f"thriftpy2 threaded server, Echo.echo({ECHO_PAYLOAD_BYTES} B binary)",
               start_thrift_echo, echo_payloads, thrift_echo_caller, THRIFT),
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
