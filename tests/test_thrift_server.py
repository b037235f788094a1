"""The Thrift processors against real thriftpy2 servers on 127.0.0.1 (port 0), exporting over real OTLP to
the embedded collector: span counts and shape (the gRPC one), every C10 handler-error path, W3C propagation
from tracked clients, and bad bytes on the wire followed by a good call.

Most tests run twice: on the sync ``TThreadedServer`` (``TracedProcessor``) and on the
``thriftpy2.contrib.aio`` server (``TracedAsyncProcessor``) serving the same IDL; clients are thriftpy2's
sync clients (the wire is the same for both servers)."""

from __future__ import annotations

import asyncio
import io
import socket
import struct
import time
import tracemalloc

import pytest
import thriftpy2
from _span_wait import SpanWatch
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from thriftpy2.contrib.aio.transport.framed import TAsyncFramedTransportFactory
from thriftpy2.protocol import TBinaryProtocolFactory, TMultiplexedProtocolFactory
from thriftpy2.rpc import make_client as plain_client
from thriftpy2.server import TThreadedServer
from thriftpy2.thrift import TApplicationException, TMessageType, TProcessor
from thriftpy2.transport import TFramedTransportFactory, TMemoryBuffer, TTransportException

from interceptors.thrift_aio import make_aio_server
from interceptors.thrift_client import make_aio_client, make_client
from interceptors.thrift_common import MeteredTransportFactory, ThriftLimits, protocol_error_counts
from interceptors.thrift_server import (
    BoundServerSocket,
    ThriftBindError,
    TracedMultiplexedProcessor,
    TracedThreadedServer,
    make_server,
)
from zoomer_serve.recording import RequestRecorder, phase

IDL = """
exception Declined { 1: string reason }
service Echo {
    string echo(1: string text) throws (1: Declined declined)
    i32 plain(1: i32 n)
    oneway void fire(1: string text)
}
service EchoPlus {
    string echo(1: string text) throws (1: Declined declined)
    i32 plain(1: i32 n)
    oneway void fire(1: string text)
    string extra()
}
service Calc { i32 add(1: i32 a, 2: i32 b) }
"""
T = thriftpy2.load_fp(io.StringIO(IDL), module_name="zoomer_test_echo_thrift")
TIMEOUT_MS = 5000


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _behave(text: str, downstream_port: int) -> str:
    with phase("echo.work"):
        if text == "declined":
            raise T.Declined(reason="not today")
        if text == "app":
            raise TApplicationException(TApplicationException.INTERNAL_ERROR, "app says no")
        if text == "value":
            raise ValueError("bad value")
        if text == "downstream":  # a real downstream call to a port nobody listens on
            plain_client(T.Echo, "127.0.0.1", downstream_port, timeout=1000)
        if text.startswith("call:"):  # a downstream call to a traced server, from inside this request
            nested = make_client(T.Echo, "127.0.0.1", int(text[5:]), timeout=TIMEOUT_MS)
            try:
                return nested.echo("nested")
            finally:
                nested.close()
        return text


class Handler:
    def __init__(self) -> None:
        self.downstream_port = _closed_port()

    def echo(self, text: str) -> str:
        return _behave(text, self.downstream_port)

    def plain(self, n: int) -> int:
        with phase("plain.work"):
            return n + 1

    def fire(self, text: str) -> None:
        if text == "boom":
            raise RuntimeError("oneway failed")

    def add(self, a: int, b: int) -> int:
        return a + b


class AsyncHandler:
    def __init__(self) -> None:
        self._sync = Handler()

    async def echo(self, text: str) -> str:
        await asyncio.sleep(0)
        return self._sync.echo(text)

    async def plain(self, n: int) -> int:
        await asyncio.sleep(0)
        return self._sync.plain(n)

    async def fire(self, text: str) -> None:
        self._sync.fire(text)


@pytest.fixture(params=["sync", "aio"])
def mode(request) -> str:
    return request.param


@pytest.fixture
def serve(mode):
    """``serve(framed=False, **kwargs)`` starts the traced Echo server (sync or aio, the test runs with
    both); servers still running at the end are stopped."""
    servers = []

    def start(framed: bool = False, **kwargs):
        if mode == "sync":
            factory = TFramedTransportFactory() if framed else None
            kw = {"trans_factory": factory} if factory else {}
            server = make_server(T.Echo, Handler(), "127.0.0.1", 0, **kw, **kwargs)
        else:
            kw = {"trans_factory": TAsyncFramedTransportFactory()} if framed else {}
            server = make_aio_server(T.Echo, AsyncHandler(), "127.0.0.1", 0, client_timeout=None, **kw, **kwargs)
        servers.append(server.start())
        return server

    yield start
    for server in servers:
        server.stop()


def _client(port: int, service=T.Echo, framed: bool = False):
    kw = {"trans_factory": TFramedTransportFactory()} if framed else {}
    return plain_client(service, "127.0.0.1", port, timeout=TIMEOUT_MS, **kw)


def _wire_bytes(name: str, mtype: int, payload) -> int:
    """Bytes of one binary-protocol message, encoded independently of the server."""
    buf = TMemoryBuffer()
    proto = TBinaryProtocolFactory().get_protocol(buf)
    proto.write_message_begin(name, mtype, 0)
    proto.write_struct(payload)
    proto.write_message_end()
    return len(buf.getvalue())


def _wait_closed_by_server(client) -> None:
    """Block until the server closes the client's connection (its read ends)."""
    with pytest.raises(TTransportException):
        client._iprot.trans.read(1)
    client.close()


def _calls(spans, name):
    return [s for s in spans if s["kind"] == "SERVER" and s["name"] == name]


def test_n_calls_give_n_spans_with_the_grpc_shape(serve, telemetry, collector):
    watch = SpanWatch(telemetry.recorder)
    server = serve()
    client = _client(server.port)
    for i in range(20):
        assert client.plain(i) == i + 1
    client.close()
    server.stop()
    assert watch.wait_ended(20)  # a span ends just after its reply is sent: the last may still be ending
    spans = collector.spans()
    calls = _calls(spans, "Echo/plain")
    assert len(calls) == 20 and len([s for s in spans if s["kind"] == "SERVER"]) == 20
    request_bytes = _wire_bytes("plain", TMessageType.CALL, T.Echo.plain_args(n=1))
    response_bytes = _wire_bytes("plain", TMessageType.REPLY, T.Echo.plain_result(success=2))
    for span in calls:
        attrs = span["attributes"]
        assert attrs["rpc.method"] == "Echo/plain"
        assert attrs["rpc.system.name"] == "thrift"
        assert attrs["rpc.response.status_code"] == "OK"
        assert "error.type" not in attrs
        assert span["status_code"] == "UNSET"
        assert attrs["zoomer.rpc.thrift.oneway"] is False
        assert attrs["zoomer.rpc.thrift.seqid"] == 0
        assert attrs["server.address"] == "127.0.0.1" and attrs["server.port"] == server.port
        assert attrs["network.peer.address"] == "127.0.0.1" and isinstance(attrs["network.peer.port"], int)
        assert attrs["zoomer.rpc.request.messages"] == 1 and attrs["zoomer.rpc.response.messages"] == 1
        assert attrs["zoomer.rpc.request.bytes"] == request_bytes
        assert attrs["zoomer.rpc.response.bytes"] == response_bytes
        assert span["parent_span_id"] is None
        (work,) = [s for s in spans if s["parent_span_id"] == span["span_id"]]
        assert work["name"] == "plain.work" and work["attributes"]["zoomer.phase"] == "plain.work"
        assert span["start_ns"] <= work["start_ns"] <= work["end_ns"] <= span["end_ns"]
    points = [p for p in collector.metric_points("rpc.server.call.duration")
              if p["attributes"].get("rpc.method") == "Echo/plain"]
    assert max(p["count"] for p in points) == 20
    assert points[0]["attributes"]["rpc.system.name"] == "thrift"
    sizes = [p for p in collector.metric_points("rpc.server.request.size")
             if p["attributes"].get("rpc.method") == "Echo/plain"]
    assert max(p["sum"] for p in sizes) == 20 * request_bytes


def test_c10_handler_errors_of_every_kind(serve, telemetry, collector):
    """C10: a declared exception is a normal reply (business error, not ERROR); a TApplicationException
    reaches the client as an exception message (ERROR with its type); an undeclared exception and a transport
    error from a downstream call are ERROR, recorded before the server loop swallows them; a oneway call
    ends its span without a reply, and its error is ERROR; a clean disconnect between calls is no error."""
    server = serve()
    protocol_errors = protocol_error_counts()
    client = _client(server.port)
    with pytest.raises(T.Declined) as declined:
        client.echo("declined")
    assert declined.value.reason == "not today"
    with pytest.raises(TApplicationException) as app:
        client.echo("app")
    assert app.value.type == TApplicationException.INTERNAL_ERROR and app.value.message == "app says no"
    client.fire("fine")
    assert client.plain(1) == 2  # same connection: declared and application exceptions keep it open
    client.close()  # clean disconnect between calls
    for text in ("value", "downstream"):
        client = _client(server.port)
        with pytest.raises(TTransportException):  # thriftpy2 closes the connection
            client.echo(text)
        client.close()
    client = _client(server.port)
    client.fire("boom")
    _wait_closed_by_server(client)
    assert _client(server.port).plain(5) == 6  # the server still serves
    server.stop()
    assert protocol_error_counts() == protocol_errors

    spans = collector.spans()
    echo = _calls(spans, "Echo/echo")
    assert [s["attributes"].get("rpc.response.status_code") for s in echo] == [
        "Declined", "INTERNAL_ERROR", None, None]
    assert [s["status_code"] for s in echo] == ["UNSET", "ERROR", "ERROR", "ERROR"]
    assert [s["attributes"].get("error.type") for s in echo] == [
        None, "INTERNAL_ERROR", "ValueError", "TTransportException"]
    assert echo[0]["attributes"]["zoomer.rpc.business_error"] == "Declined"
    assert echo[0]["events"] == [] and echo[0]["attributes"]["zoomer.rpc.response.messages"] == 1
    assert echo[1]["status_message"] == "app says no"
    for span, exc_type, message in ((echo[1], "TApplicationException", "app says no"),
                                    (echo[2], "ValueError", "bad value")):
        (event,) = span["events"]
        assert event["attributes"]["exception.type"] == exc_type
        assert event["attributes"]["exception.message"] == message
    for span in echo[2:]:  # no reply was written
        assert span["attributes"]["zoomer.rpc.response.messages"] == 0
        assert span["attributes"]["zoomer.rpc.response.bytes"] == 0
    fire = _calls(spans, "Echo/fire")
    assert [s["status_code"] for s in fire] == ["UNSET", "ERROR"]
    assert [s["attributes"].get("error.type") for s in fire] == [None, "RuntimeError"]
    for span in fire:
        assert span["attributes"]["zoomer.rpc.thrift.oneway"] is True
        assert span["attributes"]["zoomer.rpc.response.messages"] == 0
        assert span["attributes"]["zoomer.rpc.response.bytes"] == 0
    assert len(_calls(spans, "Echo/plain")) == 2
    assert len([s for s in spans if s["kind"] == "SERVER"]) == 8
    phases = [s for s in spans if s["name"] == "echo.work"]
    assert len(phases) == 4 and {p["parent_span_id"] for p in phases} == {s["span_id"] for s in echo}


def test_tracked_client_propagates_w3c_context(serve, mode, telemetry, collector):
    server = serve()
    trace_id, span_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    parent = NonRecordingSpan(SpanContext(trace_id, span_id, True, TraceFlags(1),
                                          TraceState([("vendor", "opaque")])))
    token = otel_context.attach(otel_trace.set_span_in_context(parent))
    try:
        tracked = make_client(T.Echo, "127.0.0.1", server.port, timeout=TIMEOUT_MS)
        assert tracked.echo("a") == "a" and tracked.plain(1) == 2
        tracked.fire("x")
        assert tracked.echo("b") == "b"
        tracked.close()

        async def aio_call() -> str:
            aclient = await make_aio_client(T.Echo, "127.0.0.1", server.port, timeout=TIMEOUT_MS)
            try:
                return await aclient.echo("from-aio")
            finally:
                aclient.close()

        assert asyncio.run(aio_call()) == "from-aio"
    finally:
        otel_context.detach(token)
    untracked = _client(server.port)
    assert untracked.echo("plain") == "plain"
    untracked.close()
    server.stop()
    spans = [s for s in collector.spans("SERVER")]
    assert len(spans) == 6
    for span in spans[:5]:
        assert span["trace_id"] == f"{trace_id:032x}"
        assert span["parent_span_id"] == f"{span_id:016x}"
    assert spans[5]["trace_id"] != f"{trace_id:032x}" and spans[5]["parent_span_id"] is None


def test_a_handler_calling_a_traced_server_continues_the_trace(serve, telemetry, collector):
    downstream = serve()
    upstream = serve()
    client = _client(upstream.port)
    assert client.echo(f"call:{downstream.port}") == "nested"
    client.close()
    upstream.stop()
    downstream.stop()
    outer, inner = sorted(collector.spans("SERVER"), key=lambda s: s["start_ns"])
    assert inner["trace_id"] == outer["trace_id"]
    work = next(s for s in collector.spans() if s["name"] == "echo.work" and s["parent_span_id"] == outer["span_id"])
    assert inner["parent_span_id"] in (outer["span_id"], work["span_id"])


@pytest.mark.parametrize("tracked", [False, True])
def test_unknown_method_span_is_other_and_the_connection_goes_on(serve, telemetry, collector, tracked):
    """With a tracked client the exception reply, too, is preceded by the response header it expects."""
    server = serve()
    if tracked:
        client = make_client(T.EchoPlus, "127.0.0.1", server.port, timeout=TIMEOUT_MS)
    else:
        client = _client(server.port, service=T.EchoPlus)
    with pytest.raises(TApplicationException) as info:
        client.extra()
    assert info.value.type == TApplicationException.UNKNOWN_METHOD
    assert client.plain(1) == 2
    client.close()
    server.stop()
    other, plain = collector.spans("SERVER")
    assert other["name"] == "_OTHER"
    assert other["attributes"]["rpc.method"] == "_OTHER"
    assert other["attributes"]["rpc.method_original"] == "extra"
    assert other["attributes"]["rpc.response.status_code"] == "UNKNOWN_METHOD"
    assert other["attributes"]["error.type"] == "UNKNOWN_METHOD" and other["status_code"] == "ERROR"
    assert plain["name"] == "Echo/plain"


GARBAGE = b"GET / HTTP/1.1\r\nHost: thrift\r\n\r\n"
# a valid version header, then a method name that claims 1 GiB
HUGE_NAME = b"\x80\x01\x00\x01" + struct.pack("!i", 1 << 30) + b"abc"
# a frame header claiming 2 GiB - 1
HUGE_FRAME = struct.pack("!i", 0x7FFFFFFF) + b"\x80\x01\x00\x01"


def _truncated() -> bytes:
    buf = TMemoryBuffer()
    proto = TBinaryProtocolFactory().get_protocol(buf)
    proto.write_message_begin("echo", TMessageType.CALL, 0)
    proto.write_struct(T.Echo.echo_args(text="x" * 100))
    return buf.getvalue()[:40]


@pytest.mark.parametrize(("case", "payload", "framed", "kinds"), [
    ("garbage", GARBAGE, False, ("ProtocolError", "TProtocolException")),
    ("truncated", _truncated(), False, ("truncated",)),
    ("huge_name", HUGE_NAME, False, ("truncated", "message_too_large")),
    ("huge_frame", HUGE_FRAME, True, ("message_too_large",)),
])
def test_bad_bytes_close_only_that_connection(serve, telemetry, collector, case, payload, framed, kinds):
    server = serve(framed=framed)
    good = _client(server.port, framed=framed)  # open before, still served after
    assert good.plain(1) == 2
    before = protocol_error_counts()
    tracemalloc.start()
    try:
        bad = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        bad.sendall(payload)
        if case in ("garbage", "huge_frame"):  # the server closes the connection by itself
            assert bad.recv(64) == b""
        bad.close()
        deadline = time.monotonic() + 5
        while protocol_error_counts() == before and time.monotonic() < deadline:
            time.sleep(0.02)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"{peak} bytes allocated for {case}"
    after = protocol_error_counts()
    grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert sum(grown.values()) == 1 and next(iter(grown)) in kinds
    assert good.plain(2) == 3
    good.close()
    fresh = _client(server.port, framed=framed)
    assert fresh.echo("after") == "after"
    fresh.close()
    server.stop()
    spans = collector.spans("SERVER")
    assert [s["name"] for s in spans] == ["Echo/plain", "Echo/plain", "Echo/echo"]
    counters = [p for p in collector.metric_points("zoomer.rpc.server.protocol_errors")
                if p["attributes"].get("error.type") == next(iter(grown))]
    assert counters and counters[-1]["value"] >= 1
    assert counters[-1]["attributes"]["rpc.system.name"] == "thrift"


def test_multiplexed_services_are_named(telemetry, collector):
    processor = TracedMultiplexedProcessor(server_address="127.0.0.1")
    processor.register_processor("alpha.Echo", TProcessor(T.Echo, Handler()))
    processor.register_processor("beta.Calc", TProcessor(T.Calc, Handler()))
    sock = BoundServerSocket(host="127.0.0.1", port=0)
    sock.listen()
    server = TracedThreadedServer(processor, sock, itrans_factory=MeteredTransportFactory(
        thriftpy2.transport.TBufferedTransportFactory()), daemon=True).start()
    try:
        echo = plain_client(T.Echo, "127.0.0.1", server.port, timeout=TIMEOUT_MS,
                            proto_factory=TMultiplexedProtocolFactory(TBinaryProtocolFactory(), "alpha.Echo"))
        calc = plain_client(T.Calc, "127.0.0.1", server.port, timeout=TIMEOUT_MS,
                            proto_factory=TMultiplexedProtocolFactory(TBinaryProtocolFactory(), "beta.Calc"))
        assert echo.plain(1) == 2 and calc.add(2, 3) == 5
        echo.close()
        calc.close()
    finally:
        server.stop()
    names = sorted(s["name"] for s in collector.spans("SERVER"))
    assert names == ["alpha.Echo/plain", "beta.Calc/add"]


def test_plain_thriftpy2_server_with_the_processor_and_no_meter_still_records():
    """A server built without the metered transport: spans, no byte counts."""
    records = []
    from interceptors.thrift_server import TracedProcessor

    processor = TracedProcessor(T.Echo, Handler(), recorder=RequestRecorder(records.append, otel_context=False))
    sock = BoundServerSocket(host="127.0.0.1", port=0)
    sock.listen()
    server = TThreadedServer(processor, sock, daemon=True)
    import threading

    threading.Thread(target=server.serve, daemon=True).start()
    client = _client(sock.port)
    assert client.plain(41) == 42
    client.close()
    deadline = time.monotonic() + 5
    while not records and time.monotonic() < deadline:  # the span ends just after the reply is sent
        time.sleep(0.01)
    server.close()
    (record,) = records
    attrs = record[12]
    assert record[6] == "Echo/plain" and attrs["rpc.response.status_code"] == "OK"
    assert "zoomer.rpc.request.bytes" not in attrs and attrs["zoomer.rpc.request.messages"] == 1


def test_bind_failure_and_bad_limits_are_named():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ThriftBindError, match=f"127.0.0.1:{port}"):
            make_server(T.Echo, Handler(), "127.0.0.1", port, recorder=RequestRecorder(otel_context=False))
    with pytest.raises(ValueError, match="max_message_bytes"):
        ThriftLimits(max_message_bytes=0)
    with pytest.raises(ValueError, match="host and port"):
        make_server(T.Echo, Handler(), "", None, recorder=RequestRecorder(otel_context=False))
