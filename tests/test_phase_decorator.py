"""``@phase(name)`` as a decorator on each kind of function, on real gRPC servers exporting to a real collector.

A decorated coroutine recorded about 0 ms (the sync wrapper timed the call that made the coroutine, not its
run), and so did a decorated generator; each kind of function is now timed while it runs, in the request of
the task or thread running it, with a phase of its own per call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import sys
from pathlib import Path

import pytest

from interceptors import ZoomerAioServerInterceptor, ZoomerServerInterceptor
from zoomer_serve.recording import RequestRecorder, phase
from zoomer_serve.recording import records as r

sys.path.insert(0, str(Path(__file__).parent))
import grpc_echo
import grpc_echo_aio

MS = 1_000_000


@pytest.fixture
def aio_client(telemetry):
    server, target = grpc_echo_aio.start_server([ZoomerAioServerInterceptor(excluded_methods=())])
    client = grpc_echo.Client(target)
    yield client
    client.close()
    server.stop(None)


@pytest.fixture
def sync_client(telemetry):
    server, target = grpc_echo.start_server([ZoomerServerInterceptor(excluded_methods=())])
    client = grpc_echo.Client(target)
    yield client
    client.close()
    server.stop(grace=None)


def _phases(spans, request):
    return [s for s in spans if "zoomer.phase" in s["attributes"] and s["trace_id"] == request["trace_id"]]


def test_decorated_coroutine_generator_and_async_generator_time_their_run_on_grpc_aio(aio_client, collector):
    """On a grpc.aio server the handler awaits a decorated coroutine sleeping 0.2 s, iterates a decorated
    generator sleeping 3 x 50 ms and a decorated async generator sleeping 2 x 50 ms: each is one phase span,
    child of the request span, lasting at least its sleeps (it stored 0.0 ms for the first two)."""
    assert aio_client.unary(b"decorated", timeout=10) == b"ok"
    spans = collector.spans()
    (req,) = [s for s in spans if s["kind"] == "SERVER"]
    phases = {s["name"]: s for s in _phases(spans, req)}
    assert set(phases) == {"async_deco", "gen_deco", "agen_deco"}
    assert all(p["parent_span_id"] == req["span_id"] for p in phases.values())
    assert all(p["status_code"] == "UNSET" for p in phases.values())
    assert phases["async_deco"]["duration_ns"] >= 200 * MS
    assert phases["gen_deco"]["duration_ns"] >= 150 * MS
    assert phases["agen_deco"]["duration_ns"] >= 100 * MS
    # one after the other: each starts when the handler starts running it, not before the previous ended
    assert phases["gen_deco"]["start_ns"] >= phases["async_deco"]["end_ns"]
    assert phases["agen_deco"]["start_ns"] >= phases["gen_deco"]["end_ns"]


def test_decorated_coroutines_gathered_in_one_request_are_siblings(aio_client, collector):
    """Two decorated coroutines of one request run at once (``asyncio.gather``) and the one entered second ends
    first: each is its own child of the request span, neither the parent of the other."""
    assert aio_client.unary(b"decogather", timeout=10) == b"ok"
    spans = collector.spans()
    (req,) = [s for s in spans if s["kind"] == "SERVER"]
    phases = {s["name"]: s for s in _phases(spans, req)}
    assert set(phases) == {"long", "short"}
    assert phases["long"]["span_id"] != phases["short"]["span_id"]
    assert phases["long"]["parent_span_id"] == req["span_id"]
    assert phases["short"]["parent_span_id"] == req["span_id"]
    assert phases["long"]["duration_ns"] >= 150 * MS
    assert phases["short"]["duration_ns"] >= 50 * MS


def test_decorated_function_in_two_threads_at_once_and_reentered(sync_client, collector):
    """On a sync server two requests run the same decorated function at the same time on two threads (they
    meet at a barrier inside it), and it calls itself once: each request gets its own two phase spans, the
    outer a child of that request's span, the inner a child of the outer."""
    grpc_echo.DECO_BARRIER.reset()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(sync_client.unary, b"decothreads", timeout=15) for _ in range(2)]
        assert [c.result() for c in calls] == [b"ok", b"ok"]
    spans = collector.spans()
    requests = [s for s in spans if s["kind"] == "SERVER"]
    assert len(requests) == 2 and requests[0]["trace_id"] != requests[1]["trace_id"]
    for req in requests:
        phases = _phases(spans, req)
        assert [p["name"] for p in phases] == ["sync_deco", "sync_deco"]
        (outer,) = [p for p in phases if p["parent_span_id"] == req["span_id"]]
        (inner,) = [p for p in phases if p is not outer]
        assert inner["parent_span_id"] == outer["span_id"]
        assert inner["duration_ns"] >= 50 * MS and outer["duration_ns"] >= inner["duration_ns"]
    assert len({p["span_id"] for p in spans if "zoomer.phase" in p["attributes"]}) == 4


def _request_children(body):
    """Run ``body()`` inside an active request span of a recorder of its own; its phases' child records."""
    got = []
    span = RequestRecorder(sink=got.append, otel_context=False).start("s/m")
    span.activate()
    try:
        body()
    finally:
        span.deactivate()
        span.end()
    (record,) = got
    return span, r.child_records(record)


def test_decorated_generators_closed_early_or_raising_and_async_generators_forward_asend_athrow():
    """A consumer's early close of a decorated generator (sync or async) ends its phase normally; an exception
    leaving it marks the phase ERROR; ``send``/``asend`` values and ``athrow`` exceptions reach the inner
    generator; the wrappers keep the function's name and kind."""

    @phase("gen")
    def gen(fail):
        got = yield 1
        yield got
        if fail:
            raise KeyError("gen")

    @phase("agen")
    async def agen():
        got = yield 1
        try:
            yield got
        except ValueError:
            yield "caught"

    @phase("coro")
    async def coro(x):
        await asyncio.sleep(0)
        return x * 2

    assert gen.__name__ == "gen" and agen.__name__ == "agen" and coro.__name__ == "coro"
    assert inspect.isgeneratorfunction(gen) and inspect.isasyncgenfunction(agen)
    assert inspect.iscoroutinefunction(coro)

    def body():
        g = gen(False)
        assert next(g) == 1 and g.send("sent") == "sent"
        g.close()  # early: the phase ends normally
        with pytest.raises(KeyError):
            list(gen(True))

        async def main():
            a = agen()
            assert await a.__anext__() == 1
            assert await a.asend("asent") == "asent"
            assert await a.athrow(ValueError("in")) == "caught"
            await a.aclose()
            assert await asyncio.gather(coro(1), coro(2)) == [2, 4]

        asyncio.run(main())  # a copy of this context: the request is current there

    span, children = _request_children(body)
    assert [c[r.R_NAME] for c in children] == ["gen", "gen", "agen", "coro", "coro"]
    assert all(c[r.R_PARENT_ID] == span.span_id for c in children)
    assert [c[r.R_STATUS] for c in children] == [r.STATUS_UNSET, r.STATUS_ERROR, r.STATUS_UNSET,
                                                 r.STATUS_UNSET, r.STATUS_UNSET]
    assert children[1][r.R_ATTRS]["error.type"] == "KeyError"


def test_phase_closed_in_another_context_leaves_nesting_right():
    """A decorated generator started in one context and closed from a copy of it (as an event loop's
    finaliser or another task may): the phase still ends, and a phase opened afterwards in the first context
    is the request's child again, not the closed phase's."""

    @phase("gen")
    def gen():
        yield 1
        yield 2

    def body():
        g = gen()
        assert next(g) == 1
        contextvars.copy_context().run(g.close)
        with phase("after"):
            pass

    span, children = _request_children(body)
    names = {c[r.R_NAME]: c for c in children}
    assert set(names) == {"gen", "after"}
    assert names["gen"][r.R_PARENT_ID] == span.span_id
    assert names["after"][r.R_PARENT_ID] == span.span_id
