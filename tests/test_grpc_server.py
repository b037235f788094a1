"""The gRPC server interceptors against real servers, exporting over real OTLP to the embedded collector:
span counts, names, status codes, parentage, streaming lifetimes, fail-open behaviour.

Every test runs twice, on the sync ``grpc.server`` (``ZoomerServerInterceptor``) and on the asyncio
``grpc.aio.server`` (``ZoomerAioServerInterceptor``) serving the same ``test.Echo`` service with async
handlers (``grpc_echo_aio``): one test body, both servers."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

import zoomer_serve
from interceptors import ZoomerAioServerInterceptor, ZoomerServerInterceptor
from zoomer_serve.recording import format_traceparent, internal_error_counts

sys.path.insert(0, str(Path(__file__).parent))
import grpc_echo
import grpc_echo_aio
from _span_wait import SpanWatch

METHOD = "test.Echo/Unary"


@pytest.fixture(params=["sync", "aio"])
def start_echo(request):
    """Starts ``test.Echo`` behind the zoomer interceptor built with the given arguments, on the sync or the
    aio server (the test runs once with each); returns ``(server, target)`` like ``grpc_echo.start_server``.
    Servers still running at the end are stopped."""
    servers = []

    def start(*args, **kwargs):
        if request.param == "sync":
            server, target = grpc_echo.start_server([ZoomerServerInterceptor(*args, **kwargs)])
        else:
            server, target = grpc_echo_aio.start_server([ZoomerAioServerInterceptor(*args, **kwargs)])
        servers.append(server)
        return server, target

    yield start
    for server in servers:
        server.stop(None)


@pytest.fixture
def echo(telemetry, start_echo):
    server, target = start_echo(server_address="127.0.0.1")
    client = grpc_echo.Client(target)
    yield client
    client.close()
    server.stop(grace=None)


def _by_name(spans, name):
    return [s for s in spans if s["name"] == name]


def _code(span):
    return span["attributes"].get("rpc.response.status_code")


def test_n_unary_calls_give_n_server_spans(echo, collector):
    for i in range(25):
        assert echo.unary(b"hello-%d" % i) == b"hello-%d" % i
    spans = collector.spans("SERVER")
    assert len(spans) == 25
    for span in spans:
        attrs = span["attributes"]
        assert span["name"] == METHOD
        assert attrs["rpc.method"] == METHOD
        assert attrs["rpc.system.name"] == "grpc"
        assert attrs["rpc.response.status_code"] == "OK"
        assert attrs["server.address"] == "127.0.0.1"
        assert attrs["network.peer.address"] == "127.0.0.1"
        assert isinstance(attrs["network.peer.port"], int)
        assert attrs["zoomer.rpc.request.messages"] == 1 and attrs["zoomer.rpc.response.messages"] == 1
        assert span["status_code"] == "UNSET"
        assert span["parent_span_id"] is None
        assert span["service_name"] == "test-svc"
        assert span["end_ns"] > span["start_ns"]
    assert len({s["trace_id"] for s in spans}) == 25
    sent = sum(len(b"hello-%d" % i) for i in range(25))
    assert sum(s["attributes"]["zoomer.rpc.request.bytes"] for s in spans) == sent
    assert sum(s["attributes"]["zoomer.rpc.response.bytes"] for s in spans) == sent


@pytest.mark.slow
def test_client_traceparent_makes_server_span_its_child(echo, collector):
    trace_id, parent_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    md = (("traceparent", format_traceparent(trace_id, parent_id, 1)), ("tracestate", "vendor=abc"))
    assert echo.unary(b"x", metadata=md) == b"x"
    (span,) = collector.spans("SERVER")
    assert span["trace_id"] == f"{trace_id:032x}"
    assert span["parent_span_id"] == f"{parent_id:016x}"


@pytest.mark.parametrize("garbage", ["00-zzzz", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                     "00-00000000000000000000000000000000-00f067aa0ba902b7-01", "x" * 600,
                                     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"])
@pytest.mark.slow
def test_garbage_traceparent_starts_a_new_trace_and_never_fails_the_call(echo, collector, garbage):
    assert echo.unary(b"x", metadata=(("traceparent", garbage),)) == b"x"
    (span,) = collector.spans("SERVER")
    assert span["parent_span_id"] is None
    assert _code(span) == "OK"


@pytest.mark.slow
def test_unsampled_parent_exports_no_span_but_counts_the_call(echo, collector):
    md = (("traceparent", format_traceparent(0xABC, 0xDEF, 0)),)
    for _ in range(3):
        echo.unary(b"x", metadata=md)
    echo.unary(b"y")
    spans = collector.spans("SERVER")
    assert len(spans) == 1
    points = [p for p in collector.metric_points("rpc.server.call.duration")
              if p["attributes"].get("rpc.method") == METHOD]
    assert points and max(p["count"] for p in points) == 4


@pytest.mark.parametrize(("request_bytes", "code", "span_status", "error_type"), [
    (b"invalid", grpc.StatusCode.INVALID_ARGUMENT, "UNSET", None),
    (b"setcode", grpc.StatusCode.NOT_FOUND, "UNSET", None),
    (b"abortstatus", grpc.StatusCode.FAILED_PRECONDITION, "UNSET", None),
    (b"internal", grpc.StatusCode.INTERNAL, "ERROR", "INTERNAL"),
    (b"raise", grpc.StatusCode.UNKNOWN, "ERROR", "ValueError"),
])
@pytest.mark.slow
def test_status_paths(echo, collector, request_bytes, code, span_status, error_type):
    with pytest.raises(grpc.RpcError) as info:
        echo.unary(request_bytes)
    assert info.value.code() == code
    (span,) = collector.spans("SERVER")
    assert _code(span) == code.name
    assert span["status_code"] == span_status
    assert span["attributes"].get("error.type") == error_type
    events = [e["name"] for e in span["events"]]
    assert events == (["exception"] if request_bytes == b"raise" else [])


@pytest.mark.slow
def test_abort_with_status_passes_trailing_metadata_unchanged(echo, collector):
    with pytest.raises(grpc.RpcError) as info:
        echo.unary(b"abortstatus")
    assert info.value.details() == "model not loaded"
    assert ("retry-after-ms", "250") in tuple(info.value.trailing_metadata())
    (span,) = collector.spans("SERVER")
    assert _code(span) == "FAILED_PRECONDITION"


@pytest.mark.slow
def test_exception_is_recorded_then_reraised_unchanged(echo, collector):
    with pytest.raises(grpc.RpcError) as info:
        echo.unary(b"raise")
    assert "handler exploded" in info.value.details()  # grpc's own message, from the original exception
    (span,) = collector.spans("SERVER")
    (event,) = span["events"]
    assert event["attributes"]["exception.type"] == "ValueError"
    assert event["attributes"]["exception.message"] == "handler exploded"
    assert "handler exploded" in span["status_message"]


@pytest.mark.slow
def test_deadline_exceeded(echo, collector, telemetry):
    watch = SpanWatch(telemetry.recorder)
    with pytest.raises(grpc.RpcError) as info:
        echo.unary(b"sleep", timeout=0.2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert watch.wait_ended(1)  # the handler noticed and returned
    (span,) = collector.spans("SERVER")
    assert _code(span) == "DEADLINE_EXCEEDED"
    assert span["status_code"] == "ERROR"


class _HoldingProxy:
    """A TCP proxy on 127.0.0.1 that can hold the next bytes from the client for ``hold_s`` seconds before passing
    them on (bytes behind them wait too, in order); bytes from the server pass straight through."""

    def __init__(self, upstream: str, hold_s: float) -> None:
        self.upstream = upstream
        self.hold_s = hold_s
        self.hold_next = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            host, port = self.upstream.rsplit(":", 1)
            server = socket.create_connection((host, int(port)))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                if from_client and self.hold_next.is_set():
                    self.hold_next.clear()
                    time.sleep(self.hold_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.slow
def test_deadline_passed_at_the_client_first_is_deadline_exceeded(telemetry, start_echo, collector):
    """The server's deadline is the client's plus the request's way there (grpc sends the time left), so a slow
    way in lets the cancel that the client sends at its own deadline reach the server first, with time left on
    the server's clock. That call still ended by its deadline (the CI run of dff414b saw CANCELLED here)."""
    server, target = start_echo(server_address="127.0.0.1")
    watch = SpanWatch(telemetry.recorder)
    proxy = _HoldingProxy(target, hold_s=0.04)
    client = grpc_echo.Client(proxy.target)
    try:
        assert client.unary(b"warm") == b"warm"  # the connection is up; only the next call's bytes are held
        time.sleep(0.2)
        proxy.hold_next.set()
        with pytest.raises(grpc.RpcError) as info:
            client.unary(b"sleep", timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert watch.wait_ended(2)  # the handler noticed and returned
    finally:
        client.close()
        proxy.close()
    spans = collector.spans("SERVER")
    assert [_code(s) for s in spans] == ["OK", "DEADLINE_EXCEEDED"]
    assert spans[1]["status_code"] == "ERROR"


@pytest.mark.slow
def test_client_cancellation(echo, collector, telemetry):
    watch = SpanWatch(telemetry.recorder)
    future = echo.unary.future(b"sleep")
    assert watch.wait_started(1)  # the call reached the server
    future.cancel()
    assert watch.wait_ended(1)
    (span,) = collector.spans("SERVER")
    assert _code(span) == "CANCELLED"
    assert span["status_code"] == "UNSET"


@pytest.mark.slow
def test_unknown_method_passes_through_as_unimplemented(echo, collector):
    """C02: a call to a method that no servicer registered."""
    before = sum(internal_error_counts().values())
    with pytest.raises(grpc.RpcError) as info:
        echo.unknown(b"x")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    reflection = echo.channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
    with pytest.raises(grpc.RpcError) as info2:
        list(reflection(iter([b""])))
    assert info2.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert echo.unary(b"after") == b"after"
    assert sum(internal_error_counts().values()) == before
    spans = collector.spans("SERVER")
    assert [s["name"] for s in spans] == [METHOD]  # no span for the unknown methods, none with a wrong code


@pytest.mark.slow
def test_server_stream_span_ends_after_last_message(echo, collector, telemetry):
    """Not when the handler first returned (it returns a generator at once): the span counted all four messages
    as they were handed to gRPC, so it ended after the last, and it lasted the handler's four 50 ms sleeps. (A
    comparison with the client's clock when the last message arrived failed under CPU load: this test's client
    thread took that message up to 160 ms after the server's span had ended.)"""
    watch = SpanWatch(telemetry.recorder)
    assert list(echo.server_stream(b"slow:4")) == [b"m0", b"m1", b"m2", b"m3"]
    assert watch.wait_ended(1)
    (span,) = collector.spans("SERVER")
    assert span["name"] == "test.Echo/ServerStream"
    assert span["attributes"]["zoomer.rpc.response.messages"] == 4
    assert _code(span) == "OK"
    assert span["duration_ns"] >= 4 * 50_000_000 * 0.9


def test_server_stream_error_after_messages(echo, collector):
    with pytest.raises(grpc.RpcError) as info:
        list(echo.server_stream(b"fail:2"))
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    (span,) = collector.spans("SERVER")
    assert span["attributes"]["zoomer.rpc.response.messages"] == 2
    assert span["attributes"]["error.type"] == "RuntimeError"


@pytest.mark.slow
def test_server_stream_cancelled_mid_stream(echo, collector, telemetry):
    watch = SpanWatch(telemetry.recorder)
    call = echo.server_stream(b"slow:40")
    next(call)
    call.cancel()
    assert watch.wait_ended(1)
    (span,) = collector.spans("SERVER")
    assert _code(span) == "CANCELLED"
    assert span["attributes"]["zoomer.rpc.response.messages"] < 40


@pytest.mark.slow
def test_client_and_bidi_streams(echo, collector, telemetry):
    """A streamed request's span ends in grpc's done callback, once the status has gone: it may end just after
    the client has its last message (a CI run read the store in between), so the test waits for both."""
    watch = SpanWatch(telemetry.recorder)
    assert echo.client_stream(iter([b"a", b"bb", b"ccc"])) == b"a|bb|ccc"
    assert list(echo.bidi(iter([b"x", b"y"]))) == [b"X", b"Y"]
    assert watch.wait_ended(2)
    spans = {s["name"]: s for s in collector.spans("SERVER")}
    cs = spans["test.Echo/ClientStream"]["attributes"]
    assert (cs["zoomer.rpc.request.messages"], cs["zoomer.rpc.request.bytes"]) == (3, 6)
    bd = spans["test.Echo/BidiStream"]["attributes"]
    assert (bd["zoomer.rpc.request.messages"], bd["zoomer.rpc.response.messages"]) == (2, 2)
    assert {_code(s) for s in spans.values()} == {"OK"}


@pytest.mark.slow
def test_phases_are_child_spans(echo, collector):
    assert echo.unary(b"phases") == b"ok"
    spans = collector.spans()
    (req,) = [s for s in spans if s["kind"] == "SERVER"]
    phases = {s["name"]: s for s in spans if "zoomer.phase" in s["attributes"]}
    assert set(phases) == {"preprocess", "forward", "inner"}
    assert phases["preprocess"]["parent_span_id"] == req["span_id"]
    assert phases["forward"]["parent_span_id"] == req["span_id"]
    assert phases["inner"]["parent_span_id"] == phases["forward"]["span_id"]
    assert all(p["trace_id"] == req["trace_id"] for p in phases.values())
    assert phases["preprocess"]["duration_ns"] >= 2_000_000


def test_an_abort_inside_a_phase_is_not_the_phases_error(echo, collector):
    """``context.abort()`` inside ``phase("preprocess")``: grpc ends the handler with a bare ``Exception()``, which
    marked the phase span ERROR with ``error.type=Exception`` while its server span was INVALID_ARGUMENT and UNSET
    (a status the handler chose, not a failure). The phase now ends as its request does; an exception the handler
    raises still marks it ERROR."""
    with pytest.raises(grpc.RpcError) as aborted:
        echo.unary(b"phaseabort")
    assert aborted.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as raised:
        echo.unary(b"phaseraise")
    assert raised.value.code() is grpc.StatusCode.UNKNOWN
    spans = collector.spans()
    servers = {s["span_id"]: s for s in spans if s["kind"] == "SERVER"}
    phases = [s for s in spans if "zoomer.phase" in s["attributes"]]
    assert len(servers) == 2 and len(phases) == 2
    by_status = {servers[p["parent_span_id"]]["attributes"]["rpc.response.status_code"]: p for p in phases}
    assert by_status["INVALID_ARGUMENT"]["status_code"] == "UNSET"
    assert "error.type" not in by_status["INVALID_ARGUMENT"]["attributes"]
    assert by_status["UNKNOWN"]["status_code"] == "ERROR"
    assert by_status["UNKNOWN"]["attributes"]["error.type"] == "ValueError"


@pytest.mark.slow
def test_user_otel_spans_become_children(echo, collector, telemetry):
    grpc_echo._TRACER_PROVIDER[0] = telemetry.tracer_provider
    assert echo.unary(b"user_span") == b"ok"
    spans = collector.spans()
    (req,) = [s for s in spans if s["kind"] == "SERVER"]
    (user,) = [s for s in spans if s["name"] == "user.work"]
    assert user["trace_id"] == req["trace_id"]
    assert user["parent_span_id"] == req["span_id"]


@pytest.mark.slow
def test_excluded_methods_are_not_traced(telemetry, collector, start_echo):
    server, target = start_echo(excluded_methods=("test.Echo/Server*",))
    client = grpc_echo.Client(target)
    try:
        assert list(client.server_stream(b"n:2")) == [b"m0", b"m1"]
        client.unary(b"x")
    finally:
        client.close()
        server.stop(None)
    assert [s["name"] for s in collector.spans("SERVER")] == [METHOD]


def test_duration_metric_counts_every_call(echo, collector):
    for _ in range(7):
        echo.unary(b"x")
    with pytest.raises(grpc.RpcError):
        echo.unary(b"invalid")
    points = collector.metric_points("rpc.server.call.duration")
    by_code = {}
    for p in points:
        if p["attributes"].get("rpc.method") == METHOD:
            by_code[p["attributes"]["rpc.response.status_code"]] = max(p["count"], by_code.get(
                p["attributes"]["rpc.response.status_code"], 0))
    assert by_code == {"OK": 7, "INVALID_ARGUMENT": 1}
    ok = next(p for p in points if p["attributes"].get("rpc.response.status_code") == "OK")
    assert ok["unit"] == "s"
    assert ok["explicit_bounds"][:3] == [0.005, 0.01, 0.025]


def test_broken_sink_fails_open(start_echo):
    """A recorder whose sink raises must not break a single call."""
    def boom(record):
        raise RuntimeError("sink down")

    recorder = zoomer_serve.RequestRecorder(sink=boom)
    server, target = start_echo(recorder, excluded_methods=(), semconv_dup=False)
    client = grpc_echo.Client(target)
    try:
        before = internal_error_counts().get("sink", 0)
        assert [client.unary(b"%d" % i) for i in range(5)] == [b"%d" % i for i in range(5)]
        assert internal_error_counts()["sink"] == before + 5
    finally:
        client.close()
        server.stop(None)


@pytest.mark.slow
def test_collector_down_every_rpc_succeeds_and_shutdown_is_bounded(caplog, tmp_path, start_echo):
    """C03: the OTLP exporter points at a closed loopback port while requests flow, then shutdown."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    tel = zoomer_serve.configure(service_name="c03", endpoint=f"http://127.0.0.1:{closed_port}",
                                 export_mode="process", schedule_delay_ms=100, timeout_ms=1500,
                                 set_global_providers=False)
    server, target = start_echo(server_address="127.0.0.1")
    client = grpc_echo.Client(target)
    try:
        for i in range(300):
            assert client.unary(b"%d" % i) == b"%d" % i
    finally:
        client.close()
        server.stop(None)
    caplog.set_level(logging.WARNING, logger="zoomer_serve")
    start = time.monotonic()
    stats = zoomer_serve.shutdown()
    elapsed = time.monotonic() - start
    assert elapsed < 1.5 + 1.0 + 0.5  # the export timeout plus one second (and scheduling slack)
    assert stats is not None and stats.exported == 0
    assert stats.dropped == 300
    dropped_logs = [r for r in caplog.records if "could not be exported" in r.getMessage()]
    assert len(dropped_logs) == 1
    assert tel.pipeline is not None and tel.pipeline.helper_pid is not None


@pytest.mark.slow
def test_dup_semconv_emits_old_names_too(telemetry, collector, start_echo):
    server, target = start_echo(semconv_dup=True)
    client = grpc_echo.Client(target)
    try:
        with pytest.raises(grpc.RpcError):
            client.unary(b"invalid")
    finally:
        client.close()
        server.stop(None)
    (span,) = collector.spans("SERVER")
    attrs = span["attributes"]
    assert attrs["rpc.system"] == "grpc" and attrs["rpc.service"] == "test.Echo"
    assert attrs["rpc.grpc.status_code"] == 3 and attrs["rpc.response.status_code"] == "INVALID_ARGUMENT"


@pytest.mark.slow
def test_request_bytes_are_the_bytes_received_not_the_message_encoded_again(telemetry, collector):
    """Sync server, protobuf request: ``zoomer.rpc.request.bytes`` is the size of the request as received (grpc
    hands those bytes to the deserializer), not ``ByteSize()`` of the parsed message, which encodes it again
    (about 4 µs for the demo's 1.6 KB request). The two differ for a varint written in more bytes than needed."""
    from concurrent import futures

    from google.protobuf.wrappers_pb2 import Int64Value

    handler = grpc.method_handlers_generic_handler("test.Sized", {"Echo": grpc.unary_unary_rpc_method_handler(
        lambda request, context: request, request_deserializer=Int64Value.FromString,
        response_serializer=Int64Value.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[ZoomerServerInterceptor()],
                         handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        padded = b"\x08\x85\x80\x00"  # field 1 = 5, its varint padded to 3 bytes
        assert Int64Value.FromString(padded).ByteSize() == 2
        assert channel.unary_unary("/test.Sized/Echo")(padded, timeout=10) == b"\x08\x05"
    finally:
        channel.close()
        server.stop(None)
    (span,) = collector.spans("SERVER")
    attrs = span["attributes"]
    assert (attrs["zoomer.rpc.request.messages"], attrs["zoomer.rpc.request.bytes"]) == (1, 4)
    assert (attrs["zoomer.rpc.response.messages"], attrs["zoomer.rpc.response.bytes"]) == (1, 2)


def test_an_interceptor_built_before_configure_records_into_the_configured_telemetry(start_echo, collector,
                                                                                    monkeypatch):
    """An interceptor built first configures telemetry from the environment and keeps its recorder; the
    ``configure()`` that followed (the usual order in a server's main) replaced that telemetry, and every call
    was lost uncounted (ExportStats records=0). One recorder now serves each telemetry in turn; a call after
    ``shutdown()`` is counted as dropped."""
    zoomer_serve.shutdown(timeout_s=2)
    monkeypatch.setenv("ZOOMER_EXPORT_MODE", "none")  # what the environment gives: nothing sent
    server, target = start_echo(server_address="127.0.0.1")
    tel = zoomer_serve.configure(service_name="late", endpoint=collector.grpc_endpoint, export_mode="process",
                                 schedule_delay_ms=50, set_global_providers=False)
    watch = SpanWatch(tel.recorder)
    client = grpc_echo.Client(target)
    try:
        for i in range(12):
            assert client.unary(b"m%d" % i) == b"m%d" % i
        assert watch.wait_ended(12)
        stats = zoomer_serve.shutdown(timeout_s=5)
        dropped = zoomer_serve.records_after_shutdown()
        assert client.unary(b"after") == b"after"
    finally:
        client.close()
        server.stop(None)
    assert stats is not None and stats.records == 12 and stats.exported == 12
    assert zoomer_serve.records_after_shutdown() == dropped + 1
    spans = collector.spans("SERVER")
    assert len(spans) == 12 and {s["service_name"] for s in spans} == {"late"}
