"""The sync and aio client interceptors against real servers (sync and aio, with the zoomer server
interceptors), exporting over real OTLP to the embedded collector: one trace across client and server, the
client span the parent of the server span, the caller's current span the parent of the client span, W3C
headers on the wire, client-side status conventions, ``rpc.client.call.duration``."""

from __future__ import annotations

import asyncio
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry import baggage, context

import zoomer_serve
from interceptors import (
    ZoomerAioServerInterceptor,
    ZoomerClientInterceptor,
    ZoomerServerInterceptor,
    aio_client_interceptors,
)
from interceptors.grpc_client import parse_target
from zoomer_serve.recording import format_traceparent, parse_traceparent
from zoomer_serve.recording import records as rec

sys.path.insert(0, str(Path(__file__).parent))
import grpc_echo
import grpc_echo_aio
from _span_wait import SpanWatch

UNARY = "/test.Echo/Unary"


class Server:
    """test.Echo behind the zoomer server interceptor, on the sync or the aio server."""

    def __init__(self, kind: str, interceptors=None, setup=None) -> None:
        self.kind = kind
        if kind == "sync":
            interceptors = interceptors if interceptors is not None else [
                ZoomerServerInterceptor(server_address="127.0.0.1")]
            self.handle, self.target = grpc_echo.start_server(interceptors)
        else:
            interceptors = interceptors if interceptors is not None else [
                ZoomerAioServerInterceptor(server_address="127.0.0.1")]
            self.handle = grpc_echo_aio.AioServerThread(interceptors, setup)
            self.target = self.handle.target

    def run_aio(self, coro):
        """Run an aio client coroutine: on the aio server's loop (one loop for grpc.aio), else on a new one."""
        if self.kind == "aio":
            return self.handle.run(coro, timeout_s=30)
        return asyncio.run(asyncio.wait_for(coro, 30))

    def stop(self) -> None:
        self.handle.stop(None)


@pytest.fixture(params=["sync", "aio"])
def server(request, telemetry):
    srv = Server(request.param)
    yield srv
    srv.stop()


@pytest.fixture
def aio_server(telemetry):
    srv = Server("aio")
    yield srv
    srv.stop()


def _sync_channel(target: str, **kwargs) -> grpc.Channel:
    return grpc.intercept_channel(grpc.insecure_channel(target), ZoomerClientInterceptor(target=target, **kwargs))


def _call(server: Server, client_kind: str, method: str, payload, kind: str = "unary_unary", **kwargs):
    """One call through the zoomer client interceptor of ``client_kind``; returns the response(s), or the
    RpcError raised."""
    if client_kind == "sync":
        with _sync_channel(server.target) as channel:
            try:
                result = getattr(channel, kind)(method)(payload, timeout=10, **kwargs)
                return list(result) if kind.endswith("stream") else result
            except grpc.RpcError as err:
                return err

    async def go():
        async with grpc.aio.insecure_channel(server.target,
                                             interceptors=aio_client_interceptors(target=server.target)) as ch:
            try:
                call = getattr(ch, kind)(method)(payload, timeout=10, **kwargs)
                if kind.endswith("stream"):
                    return [m async for m in call]
                return await call
            except grpc.aio.AioRpcError as err:
                return err

    return server.run_aio(go())


def _pair(collector):
    spans = collector.spans()
    (client,) = [s for s in spans if s["kind"] == "CLIENT"]
    (srv,) = [s for s in spans if s["kind"] == "SERVER"]
    return client, srv


@pytest.mark.parametrize("client_kind", ["sync", "aio"])
@pytest.mark.slow
def test_client_span_is_parent_of_server_span_in_one_trace(server, collector, client_kind):
    assert _call(server, client_kind, UNARY, b"hello") == b"hello"
    client, srv = _pair(collector)
    assert client["trace_id"] == srv["trace_id"]
    assert srv["parent_span_id"] == client["span_id"]
    assert client["parent_span_id"] is None
    assert client["name"] == srv["name"] == "test.Echo/Unary"
    attrs = client["attributes"]
    port = int(server.target.rsplit(":", 1)[1])
    assert (attrs["rpc.system.name"], attrs["rpc.method"]) == ("grpc", "test.Echo/Unary")
    assert (attrs["server.address"], attrs["server.port"]) == ("127.0.0.1", port)
    assert attrs["rpc.response.status_code"] == "OK" and client["status_code"] == "UNSET"
    assert (attrs["zoomer.rpc.request.messages"], attrs["zoomer.rpc.request.bytes"]) == (1, 5)
    assert (attrs["zoomer.rpc.response.messages"], attrs["zoomer.rpc.response.bytes"]) == (1, 5)
    assert client["start_ns"] <= srv["start_ns"] and client["end_ns"] >= srv["end_ns"]


@pytest.mark.parametrize("client_kind", ["sync", "aio"])
@pytest.mark.slow
def test_error_code_makes_client_span_error_but_not_server_span(server, collector, client_kind):
    err = _call(server, client_kind, UNARY, b"invalid")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    client, srv = _pair(collector)
    assert client["attributes"]["rpc.response.status_code"] == "INVALID_ARGUMENT"
    assert client["status_code"] == "ERROR"
    assert client["attributes"]["error.type"] == "INVALID_ARGUMENT"
    assert srv["status_code"] == "UNSET"
    assert srv["parent_span_id"] == client["span_id"]


@pytest.mark.parametrize("client_kind", ["sync", "aio"])
@pytest.mark.slow
def test_streaming_kinds_count_messages_and_keep_parentage(aio_server, collector, client_kind):
    assert _call(aio_server, client_kind, "/test.Echo/ServerStream", b"n:3", "unary_stream") == [b"m0", b"m1", b"m2"]
    assert _call(aio_server, client_kind, "/test.Echo/ClientStream", iter([b"a", b"bb"]), "stream_unary") == b"a|bb"
    assert _call(aio_server, client_kind, "/test.Echo/BidiStreamRW", iter([b"x", b"y"]), "stream_stream") == [
        b"X", b"Y"]
    spans = collector.spans()
    clients = {s["name"]: s for s in spans if s["kind"] == "CLIENT"}
    servers = {s["name"]: s for s in spans if s["kind"] == "SERVER"}
    assert set(clients) == set(servers) == {"test.Echo/ServerStream", "test.Echo/ClientStream",
                                            "test.Echo/BidiStreamRW"}
    for name, client in clients.items():
        assert servers[name]["parent_span_id"] == client["span_id"]
        assert servers[name]["trace_id"] == client["trace_id"]
        assert client["attributes"]["rpc.response.status_code"] == "OK"
    assert clients["test.Echo/ServerStream"]["attributes"]["zoomer.rpc.response.messages"] == 3
    assert clients["test.Echo/ClientStream"]["attributes"]["zoomer.rpc.request.messages"] == 2
    bidi = clients["test.Echo/BidiStreamRW"]["attributes"]
    assert (bidi["zoomer.rpc.request.messages"], bidi["zoomer.rpc.response.messages"]) == (2, 2)


@pytest.mark.parametrize("client_kind", ["sync", "aio"])
@pytest.mark.slow
def test_client_cancelling_a_stream(aio_server, collector, telemetry, client_kind):
    watch = SpanWatch(telemetry.recorder)
    if client_kind == "sync":
        with _sync_channel(aio_server.target) as channel:
            call = channel.unary_stream("/test.Echo/ServerStream")(b"slow:40", timeout=10)
            assert next(call) == b"m0"
            call.cancel()
    else:
        async def go():
            async with grpc.aio.insecure_channel(
                    aio_server.target, interceptors=aio_client_interceptors(target=aio_server.target)) as ch:
                call = ch.unary_stream("/test.Echo/ServerStream")(b"slow:40", timeout=10)
                assert await call.read() == b"m0"
                call.cancel()
                await asyncio.sleep(0.2)
        aio_server.run_aio(go())
    assert watch.wait_ended(1, "CLIENT") and watch.wait_ended(1, "SERVER")
    client, srv = _pair(collector)
    assert client["attributes"]["rpc.response.status_code"] == "CANCELLED"
    assert client["attributes"]["zoomer.rpc.response.messages"] == 1
    assert srv["attributes"]["rpc.response.status_code"] == "CANCELLED"
    assert srv["parent_span_id"] == client["span_id"]


@pytest.mark.slow
def test_current_otel_span_is_parent_of_client_span(server, collector, telemetry):
    tracer = telemetry.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("locust.task") as outer:
        assert _call(server, "sync", UNARY, b"x") == b"x"
    outer_ctx = outer.get_span_context()
    spans = collector.spans()
    (user,) = [s for s in spans if s["name"] == "locust.task"]
    client, srv = ([s for s in spans if s["kind"] == k][0] for k in ("CLIENT", "SERVER"))
    assert user["span_id"] == f"{outer_ctx.span_id:016x}"
    assert client["parent_span_id"] == user["span_id"]
    assert srv["parent_span_id"] == client["span_id"]
    assert len({user["trace_id"], client["trace_id"], srv["trace_id"]}) == 1


@pytest.mark.slow
def test_server_calling_another_server_one_trace(telemetry, collector):
    """An aio front server whose handler calls a sync back server through the aio client interceptors:
    front SERVER -> CLIENT -> back SERVER, one trace."""
    back = Server("sync")
    channels = []

    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if not channels:
            channels.append(grpc.aio.insecure_channel(back.target,
                                                      interceptors=aio_client_interceptors(target=back.target)))
        return await channels[0].unary_unary(UNARY)(request, timeout=10)

    async def setup(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Relay", {"Call": grpc.unary_unary_rpc_method_handler(relay)}),))

    front = Server("aio", setup=setup)
    try:
        with grpc.insecure_channel(front.target) as channel:
            assert channel.unary_unary("/test.Relay/Call")(b"via-front", timeout=10) == b"via-front"
        if channels:
            front.run_aio(channels[0].close())
    finally:
        front.stop()
        back.stop()
    spans = collector.spans()
    (front_span,) = [s for s in spans if s["name"] == "test.Relay/Call"]
    (client,) = [s for s in spans if s["kind"] == "CLIENT"]
    (back_span,) = [s for s in spans if s["kind"] == "SERVER" and s["name"] == "test.Echo/Unary"]
    assert len({front_span["trace_id"], client["trace_id"], back_span["trace_id"]}) == 1
    assert client["parent_span_id"] == front_span["span_id"]
    assert back_span["parent_span_id"] == client["span_id"]


def test_current_request_span_is_parent_without_otel_context():
    """With the OpenTelemetry context bridge off, the current zoomer request span is still the parent."""
    records = []
    recorder = zoomer_serve.RequestRecorder(sink=records.append, otel_context=False)
    server, target = grpc_echo.start_server([])
    try:
        outer = recorder.start("outer.request")
        outer.activate()
        try:
            with grpc.intercept_channel(grpc.insecure_channel(target),
                                        ZoomerClientInterceptor(recorder, target=target)) as channel:
                assert channel.unary_unary(UNARY)(b"x", timeout=10) == b"x"
        finally:
            outer.deactivate()
            outer.end()
    finally:
        server.stop(None)
    client_rec, outer_rec = records
    assert client_rec[rec.R_KIND] == rec.KIND_CLIENT
    assert client_rec[rec.R_TRACE_ID] == outer_rec[rec.R_TRACE_ID]
    assert client_rec[rec.R_PARENT_ID] == outer_rec[rec.R_SPAN_ID]
    assert client_rec[rec.R_PARENT_REMOTE] is False


def _metadata_server():
    """A plain server (no interceptor) whose handler returns the invocation metadata it got."""
    def get(request: bytes, context: grpc.ServicerContext) -> bytes:
        return "\n".join(f"{k}={v}" for k, v in context.invocation_metadata()
                         if not k.startswith(("user-agent", "grpc-"))).encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Meta", {"Get": grpc.unary_unary_rpc_method_handler(get)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("client_kind", ["sync", "aio"])
def test_w3c_headers_on_the_wire(client_kind):
    """traceparent (the client span), tracestate (the parent's), baggage (current OpenTelemetry baggage)
    are sent; a stale traceparent in the caller's metadata is replaced; the caller's own baggage is kept."""
    records = []
    recorder = zoomer_serve.RequestRecorder(sink=records.append)
    server, target = _metadata_server()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    from zoomer_serve.recording import ParentContext

    outer = recorder.start("outer", parent=ParentContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331,
                                                         1, "vendor=abc"))
    stale = (("traceparent", "00-11111111111111111111111111111111-2222222222222222-01"), ("x-user", "42"))

    def sync_get(metadata):
        with grpc.intercept_channel(grpc.insecure_channel(target),
                                    ZoomerClientInterceptor(recorder, target=target)) as channel:
            return channel.unary_unary("/test.Meta/Get")(b"", metadata=metadata, timeout=10)

    async def aio_get(metadata):
        async with grpc.aio.insecure_channel(target, interceptors=aio_client_interceptors(recorder, target=target)) \
                as channel:
            return await channel.unary_unary("/test.Meta/Get")(b"", metadata=metadata, timeout=10)

    def get(metadata):
        raw = sync_get(metadata) if client_kind == "sync" else asyncio.run(aio_get(metadata))
        return dict(line.split("=", 1) for line in raw.decode().splitlines())

    token = context.attach(baggage.set_baggage("tenant", "acme"))
    outer.activate()
    try:
        got = get(stale)
        got_own_baggage = get((("baggage", "tenant=caller"),))
    finally:
        outer.deactivate()
        context.detach(token)
        server.stop(None)
    client_rec = records[0]
    assert parse_traceparent(got["traceparent"]).span_id == client_rec[rec.R_SPAN_ID]
    assert got["traceparent"] == format_traceparent(client_rec[rec.R_TRACE_ID], client_rec[rec.R_SPAN_ID], 1)
    assert got["traceparent"].split("-")[1] == parent.split("-")[1]
    assert got["tracestate"] == "vendor=abc"
    assert got["baggage"] == "tenant=acme"
    assert got["x-user"] == "42"
    assert got_own_baggage["baggage"] == "tenant=caller"


@pytest.mark.slow
def test_client_duration_metric(server, collector):
    for _ in range(4):
        assert _call(server, "sync", UNARY, b"x") == b"x"
    err = _call(server, "sync", UNARY, b"invalid")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    points = [p for p in collector.metric_points("rpc.client.call.duration")
              if p["attributes"].get("rpc.method") == "test.Echo/Unary"]
    by_code = {}
    for p in points:
        code = p["attributes"]["rpc.response.status_code"]
        by_code[code] = max(by_code.get(code, 0), p["count"])
    assert by_code == {"OK": 4, "INVALID_ARGUMENT": 1}
    assert points[0]["unit"] == "s"
    assert points[0]["attributes"]["server.address"] == "127.0.0.1"


@pytest.mark.parametrize(("target", "expected"), [
    ("127.0.0.1:50051", ("127.0.0.1", 50051)),
    ("dns:///ranker.svc:443", ("ranker.svc", 443)),
    ("dns://8.8.8.8/ranker.svc:8080", ("ranker.svc", 8080)),
    ("ipv4:10.0.0.1:9000,10.0.0.2:9000", ("10.0.0.1", 9000)),
    ("[::1]:50051", ("::1", 50051)),
    ("ipv6:[::1]:7", ("::1", 7)),
    ("unix:///tmp/ranker.sock", ("/tmp/ranker.sock", None)),
    ("localhost", ("localhost", None)),
    (None, (None, None)),
])
def test_parse_target(target, expected):
    assert parse_target(target) == expected
