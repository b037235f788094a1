"""What is particular to the grpc.aio server interceptor (the behaviour it shares with the sync one is tested on
both servers in test_grpc_server.py): read/write-style and async-generator streaming (C01), the async health
service, abort before the status leaves, many concurrent streams with cancellations, the per-method handler
cache, and the demo model on the aio server. Real aio servers on 127.0.0.1, real OTLP into the collector."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import zoomer_serve
from interceptors import ZoomerAioServerInterceptor
from zoomer_serve.recording import format_traceparent, internal_error_counts
from zoomer_serve.recording import records as rec

sys.path.insert(0, str(Path(__file__).parent))
import grpc_echo
import grpc_echo_aio
from _span_wait import SpanWatch


@pytest.fixture
def aio_echo(telemetry):
    server, target = grpc_echo_aio.start_server([ZoomerAioServerInterceptor(excluded_methods=())],
                                                with_health=True)
    client = grpc_echo.Client(target)
    yield server, client, target
    client.close()
    server.stop(None)


def _server_spans(collector):
    return collector.spans("SERVER")


@pytest.mark.parametrize("method", ["BidiStreamRW", "BidiStream"])
@pytest.mark.slow
def test_c01_bidi_stream_both_handler_styles(aio_echo, collector, method):
    """C01: stream-stream in read/write style (await context.read()/write(), returns nothing) and as an async
    generator: every message delivered unchanged, OK, exactly one span per call, ended after the last message
    (each reply is written 10 ms after its request arrives, so a span that ended when the handler first
    returned would be far shorter than 10 ms per message)."""
    _, client, _ = aio_echo
    requests = [b"msg-%d" % i for i in range(6)]
    call = client.channel.stream_stream(f"/test.Echo/{method}")
    assert list(call(iter(requests), timeout=10)) == [r.upper() for r in requests]
    assert list(call(iter(requests[:2]), timeout=10)) == [b"MSG-0", b"MSG-1"]
    spans = _server_spans(collector)
    assert [s["name"] for s in spans] == [f"test.Echo/{method}"] * 2
    first, second = spans
    for span, n in ((first, 6), (second, 2)):
        attrs = span["attributes"]
        assert attrs["rpc.response.status_code"] == "OK"
        assert span["status_code"] == "UNSET"
        assert (attrs["zoomer.rpc.request.messages"], attrs["zoomer.rpc.response.messages"]) == (n, n)
        assert attrs["zoomer.rpc.request.bytes"] == attrs["zoomer.rpc.response.bytes"] == 5 * n
        assert span["duration_ns"] >= n * 10_000_000
    assert first["span_id"] != second["span_id"]


@pytest.mark.parametrize("method", ["ServerStreamRW", "ServerStream"])
@pytest.mark.slow
def test_c01_server_stream_both_handler_styles(aio_echo, collector, method):
    """C01: unary-stream written through context.write() (returning None) or yielded: the span counts the
    messages and ends after the last one (4 messages, 50 ms apart)."""
    _, client, _ = aio_echo
    assert list(client.channel.unary_stream(f"/test.Echo/{method}")(b"slow:4", timeout=10)) == [
        b"m0", b"m1", b"m2", b"m3"]
    (span,) = _server_spans(collector)
    assert span["attributes"]["zoomer.rpc.response.messages"] == 4
    assert span["attributes"]["rpc.response.status_code"] == "OK"
    assert span["duration_ns"] >= 4 * 50_000_000


@pytest.mark.slow
def test_c01_client_stream_read_style(aio_echo, collector):
    """C01: stream-unary that reads with await context.read() until EOF: the reads are counted."""
    _, client, _ = aio_echo
    assert client.channel.stream_unary("/test.Echo/ClientStreamRW")(iter([b"a", b"bb", b"ccc"]), timeout=10) \
        == b"a|bb|ccc"
    (span,) = _server_spans(collector)
    attrs = span["attributes"]
    assert (attrs["zoomer.rpc.request.messages"], attrs["zoomer.rpc.request.bytes"]) == (3, 6)
    assert (attrs["zoomer.rpc.response.messages"], attrs["zoomer.rpc.response.bytes"]) == (1, 8)


@pytest.mark.slow
def test_c01_async_health_watch_stream(aio_echo, collector, telemetry):
    """C01: the async health service (grpc_health.v1.health.aio) traced: Watch writes through
    context.write() until the client cancels; Check answers or aborts NOT_FOUND without details."""
    server, client, _ = aio_echo
    spans_watch = SpanWatch(telemetry.recorder)
    stub = health_pb2_grpc.HealthStub(client.channel)
    assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    server.run(server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()
    assert spans_watch.wait_ended(3)
    spans = {s["name"] + ":" + s["attributes"]["rpc.response.status_code"]: s for s in _server_spans(collector)}
    assert set(spans) == {"grpc.health.v1.Health/Check:OK", "grpc.health.v1.Health/Check:NOT_FOUND",
                          "grpc.health.v1.Health/Watch:CANCELLED"}
    assert spans["grpc.health.v1.Health/Watch:CANCELLED"]["attributes"]["zoomer.rpc.response.messages"] == 2
    assert spans["grpc.health.v1.Health/Check:NOT_FOUND"]["status_code"] == "UNSET"


@pytest.mark.parametrize(("cmd", "code", "details", "trailers"), [
    (b"invalid", grpc.StatusCode.INVALID_ARGUMENT, "bad feature count: expected 13, got 2", ()),
    (b"aborttrailers", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", (("retry-after-ms", "100"),)),
    (b"abortstatus", grpc.StatusCode.FAILED_PRECONDITION, "model not loaded", (("retry-after-ms", "250"),)),
    (b"internal", grpc.StatusCode.INTERNAL, "model crashed", ()),
])
def test_abort_reaches_client_unchanged_and_the_span_is_ended_first(cmd, code, details, trailers):
    """abort() / abort_with_status(), with and without trailing metadata: the client gets code, details
    and trailing metadata unchanged; grpc.aio sends them inside abort(), so the span must already be ended
    (its record handed over) when the client sees the error: checked with no wait at all."""
    records = []
    recorder = zoomer_serve.RequestRecorder(sink=records.append)
    server, target = grpc_echo_aio.start_server([ZoomerAioServerInterceptor(recorder, excluded_methods=(),
                                                                            semconv_dup=False)])
    client = grpc_echo.Client(target)
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.unary(cmd, timeout=10)
        assert len(records) == 1  # no sleep: ended before the status left the server
        assert (info.value.code(), info.value.details()) == (code, details)
        assert tuple((m.key, m.value) for m in info.value.trailing_metadata()) == trailers
    finally:
        client.close()
        server.stop(None)
    attrs = records[0][rec.R_ATTRS]
    assert attrs["rpc.response.status_code"] == code.name
    assert attrs["zoomer.rpc.response.messages"] == 0
    assert records[0][rec.R_EVENTS] is None  # an abort is not an exception of the handler
    if code is grpc.StatusCode.INTERNAL:
        assert records[0][rec.R_STATUS] == rec.STATUS_ERROR
        assert records[0][rec.R_STATUS_MSG] == details
    else:
        assert records[0][rec.R_STATUS] == rec.STATUS_UNSET


@pytest.mark.slow
def test_200_concurrent_streams_some_cancelled_mid_stream(aio_echo, collector, telemetry):
    """200 concurrent server-streaming calls (both handler styles) from an aio client; every third is
    cancelled by the client after its first message (counted on the server: a message handed to grpc counts,
    as on the sync server). Afterwards no span is left open (all 200 were exported,
    only an ended span is) and each has its call's final status."""
    server, _, target = aio_echo
    watch = SpanWatch(telemetry.recorder)
    n_calls, cancel_every = 200, 3
    errors_before = sum(internal_error_counts().values())

    async def one(channel: grpc.aio.Channel, i: int) -> list[bytes]:
        method = "ServerStreamRW" if i % 2 else "ServerStream"
        md = (("traceparent", format_traceparent(0x1000 + i, 0x2000 + i, 1)),)
        if i % cancel_every == 0:
            call = channel.unary_stream(f"/test.Echo/{method}")(b"slow:40", metadata=md, timeout=30)
            first = await call.read()
            call.cancel()
            return [first]
        call = channel.unary_stream(f"/test.Echo/{method}")(b"n:5", metadata=md, timeout=30)
        return [m async for m in call]

    async def run_all() -> list[list[bytes]]:
        async with grpc.aio.insecure_channel(target) as channel:
            return await asyncio.wait_for(asyncio.gather(*(one(channel, i) for i in range(n_calls))), 60)

    results = server.run(run_all(), timeout_s=90)  # the client on the server's loop: one loop for grpc.aio
    assert [len(r) for r in results] == [1 if i % cancel_every == 0 else 5 for i in range(n_calls)]
    assert watch.wait_ended(n_calls)  # the server noticed the last cancellations
    spans = _server_spans(collector)
    assert len(spans) == n_calls
    by_call = {int(s["trace_id"], 16) - 0x1000: s for s in spans}
    assert sorted(by_call) == list(range(n_calls))
    for i, span in by_call.items():
        attrs = span["attributes"]
        assert span["parent_span_id"] == f"{0x2000 + i:016x}"
        assert span["name"] == ("test.Echo/ServerStreamRW" if i % 2 else "test.Echo/ServerStream")
        if i % cancel_every == 0:
            assert attrs["rpc.response.status_code"] == "CANCELLED", i
            assert 1 <= attrs["zoomer.rpc.response.messages"] < 40
        else:
            assert attrs["rpc.response.status_code"] == "OK", i
            assert attrs["zoomer.rpc.response.messages"] == 5
    assert sum(internal_error_counts().values()) == errors_before


def test_each_method_handler_is_wrapped_once():
    """The per-call cost stays a cache lookup: handlers are wrapped once per method, not per call."""
    wraps = []

    class Counting(ZoomerAioServerInterceptor):
        def _wrap(self, handler, method):
            wraps.append(method)
            return super()._wrap(handler, method)

    recorder = zoomer_serve.RequestRecorder(sink=lambda record: None)
    server, target = grpc_echo_aio.start_server([Counting(recorder, excluded_methods=(), semconv_dup=False)])
    client = grpc_echo.Client(target)
    try:
        for i in range(20):
            assert client.unary(b"%d" % i, timeout=10) == b"%d" % i
        for _ in range(5):
            assert list(client.server_stream(b"n:2", timeout=10)) == [b"m0", b"m1"]
    finally:
        client.close()
        server.stop(None)
    assert sorted(wraps) == ["/test.Echo/ServerStream", "/test.Echo/Unary"]


# -- the demo model on the aio server -----------------------------------------------------------------------

@pytest.mark.slow
def test_demo_ranker_on_aio_server_same_spans_and_phases(telemetry, collector):
    """serve_aio_forever (the CLI's entry) serves the demo Ranker: the same responses and errors as the sync
    server, a request span per call with server.port, and the model's phases as its children (the model runs
    in the default executor with the request span current)."""
    from zoomer_serve.demo import ranker_pb2_grpc
    from zoomer_serve.demo.aio_server import aio_server_in_thread
    from zoomer_serve.demo.load import InvalidKind, make_request
    from zoomer_serve.demo.model import DLRMConfig, build_model

    cfg = DLRMConfig(table_sizes=(1000, 500, 100), embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,))
    model = build_model(cfg, device="cpu")
    rng = np.random.default_rng(0)
    with aio_server_in_thread(model, grace_s=1.0) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ranker_pb2_grpc.RankerStub(channel)
        request = make_request(rng, 8, cfg, request_id="r1")
        first = stub.Predict(request, timeout=10)
        assert first.request_id == "r1" and len(first.scores) == 8
        assert list(stub.Predict(request, timeout=10).scores) == list(first.scores)
        streamed = list(stub.PredictStream(iter([request, make_request(rng, 3, cfg)]), timeout=10))
        assert [len(r.scores) for r in streamed] == [8, 3]
        assert list(streamed[0].scores) == list(first.scores)
        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(make_request(rng, 2, cfg, InvalidKind.ID_OUT_OF_RANGE), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "out of range" in info.value.details()
    spans = collector.spans()
    requests = [s for s in spans if s["kind"] == "SERVER"]
    assert [(s["name"], s["attributes"]["rpc.response.status_code"]) for s in requests] == [
        ("zoomer.demo.v1.Ranker/Predict", "OK"), ("zoomer.demo.v1.Ranker/Predict", "OK"),
        ("zoomer.demo.v1.Ranker/PredictStream", "OK"), ("zoomer.demo.v1.Ranker/Predict", "INVALID_ARGUMENT")]
    assert all(s["attributes"]["server.port"] == port for s in requests)
    assert requests[2]["attributes"]["zoomer.rpc.response.messages"] == 2
    first_span = requests[0]
    phases = {s["name"]: s for s in spans if s["trace_id"] == first_span["trace_id"] and s["kind"] != "SERVER"}
    assert set(phases) == {"preprocess", "forward", "postprocess"}
    assert all(p["parent_span_id"] == first_span["span_id"] for p in phases.values())
    stream_phases = [s for s in spans if s["trace_id"] == requests[2]["trace_id"] and s["name"] == "forward"]
    assert len(stream_phases) == 2


@pytest.mark.parametrize("implemented", [False, True])
def test_a_method_left_to_the_generated_servicer_is_named_unimplemented_not_sync(telemetry, caplog,
                                                                                  implemented):
    """A servicer that does not override a generated method leaves the generated default (a plain ``def`` that
    answers UNIMPLEMENTED, C02): the client gets UNIMPLEMENTED, and the one warning says the method is not
    implemented, not that it has "a sync handler". A real sync handler on the aio server is still called
    one."""
    from zoomer_serve.profiling import profiler_control_pb2, profiler_control_pb2_grpc

    class Servicer(profiler_control_pb2_grpc.ProfilerControlServicer):
        if implemented:
            def Start(self, request, context):
                context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                raise RuntimeError("sync")

    async def setup(server):
        profiler_control_pb2_grpc.add_ProfilerControlServicer_to_server(Servicer(), server)

    thread = grpc_echo_aio.AioServerThread([ZoomerAioServerInterceptor(excluded_methods=())], setup)
    caplog.set_level("WARNING", logger="zoomer_serve")
    try:
        with grpc.insecure_channel(thread.target) as channel:
            stub = profiler_control_pb2_grpc.ProfilerControlStub(channel)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Start(profiler_control_pb2.StartRequest(), timeout=10)
                assert info.value.code() == (grpc.StatusCode.RESOURCE_EXHAUSTED if implemented
                                             else grpc.StatusCode.UNIMPLEMENTED)
    finally:
        thread.stop(None)
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "zoomer_serve" and "ProfilerControl/Start" in r.getMessage()]
    assert len(warnings) == 1, warnings
    if implemented:
        assert "has a sync handler on a grpc.aio server; it is not traced" in warnings[0]
    else:
        assert "sync" not in warnings[0]
        assert "is not implemented by its servicer" in warnings[0] and "UNIMPLEMENTED" in warnings[0]
