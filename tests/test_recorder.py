"""The request recorder on its own: records, phases, sampling, observers, exactly-once end."""

from __future__ import annotations

import threading

import pytest

from zoomer_serve.recording import (
    ParentContext,
    RequestRecorder,
    RequestSpan,
    Sampler,
    current_request,
    internal_error_counts,
    parse_traceparent,
    phase,
)
from zoomer_serve.recording import records as r


def test_end_is_exactly_once_even_from_many_threads():
    got = []
    span = RequestRecorder(sink=got.append, otel_context=False).start("s/m")
    results = []
    threads = [threading.Thread(target=lambda: results.append(span.end())) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1 and len(got) == 1


def test_held_requests_start_only_once_released_and_in_flight_counts_open_spans():
    """C12: a process about to end on SIGTERM holds the requests that start after its last count (off the main
    thread); ``in_flight`` says how many are still open; released (the process did not end), they go on."""
    got = []
    recorder = RequestRecorder(sink=got.append, otel_context=False)
    open_span = recorder.start("s/open")
    recorder.start("s/done").end()
    assert recorder.in_flight == 1
    recorder.hold_new_requests()
    recorder.start("s/main").end()  # the main thread (the signal handler's) is never held
    started = threading.Event()
    thread = threading.Thread(target=lambda: (recorder.start("s/held").end(), started.set()))
    thread.start()
    assert not started.wait(0.3)
    open_span.end()
    assert recorder.in_flight == 0 and [rec[r.R_NAME] for rec in got] == ["s/done", "s/main", "s/open"]
    recorder.release_requests()
    assert started.wait(30)
    thread.join()
    assert recorder.in_flight == 0 and got[-1][r.R_NAME] == "s/held"


def test_phase_outside_a_request_records_nothing_and_inside_makes_children():
    got = []
    rec = RequestRecorder(sink=got.append, otel_context=False)
    with phase("preprocess"):
        pass
    assert got == []
    span = rec.start("s/m")
    span.activate()
    assert current_request() is span

    @phase("forward")
    def forward(x):
        return x * 2

    assert forward(21) == 42
    with pytest.raises(KeyError):
        with phase("postprocess"):
            raise KeyError("x")
    span.deactivate()
    assert current_request() is None
    span.end()
    (record,) = got
    children = r.child_records(record)
    assert [c[r.R_NAME] for c in children] == ["forward", "postprocess"]
    assert all(c[r.R_PARENT_ID] == span.span_id for c in children)
    assert children[1][r.R_STATUS] == r.STATUS_ERROR
    assert children[1][r.R_ATTRS]["error.type"] == "KeyError"


def test_phase_after_request_left_is_sent_on_its_own():
    got = []
    span = RequestRecorder(sink=got.append, otel_context=False).start("s/m")
    span.activate()
    p = phase("late")
    p.__enter__()
    span.end()
    p.__exit__(None, None, None)
    span.deactivate()
    assert [g[r.R_NAME] for g in got] == ["s/m", "late"]
    assert got[1][r.R_PARENT_ID] == span.span_id


def test_traceidratio_sampler_matches_the_sdk():
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    ours, sdk = Sampler("traceidratio", 0.3), TraceIdRatioBased(0.3)
    for trace_id in range(1, 1 << 64, (1 << 64) // 997):
        expected = sdk.should_sample(None, trace_id, "x").decision.is_sampled()
        assert ours.should_sample(trace_id, None) == expected


def test_parent_based_follows_the_callers_flag():
    s = Sampler("parentbased_traceidratio", 0.0)
    assert s.should_sample(5, ParentContext(5, 6, 1)) is True
    assert s.should_sample(5, ParentContext(5, 6, 0)) is False
    assert s.should_sample(5, None) is False
    with pytest.raises(ValueError, match="unknown sampler"):
        Sampler("sometimes")


def test_unsampled_span_is_still_a_request_record():
    got = []
    rec = RequestRecorder(sink=got.append, sampler=Sampler("always_off"), otel_context=False)
    rec.start("s/m").end()
    assert got[0][r.R_FLAGS] == r.F_REQUEST


@pytest.mark.parametrize("value", [None, "", "00", "00-abc-def-01", b"\xff\xfe", "00-" + "g" * 32 + "-" + "1" * 16 + "-01"])
def test_parse_traceparent_rejects_garbage(value):
    assert parse_traceparent(value) is None


def test_parse_traceparent_accepts_future_versions_with_extra_fields():
    parent = parse_traceparent("01-" + "a" * 32 + "-" + "b" * 16 + "-01-future", "k=v")
    assert parent is not None and parent.sampled and parent.trace_state == "k=v"


class _Observer:
    def __init__(self, fail: bool = False) -> None:
        self.events = []
        self.fail = fail

    def on_start(self, span):
        self.events.append(("start", span.name))
        if self.fail:
            raise RuntimeError("observer bug")

    def on_end(self, span):
        span.set_attribute("observed", True)
        self.events.append(("end", span.name))


def test_observers_see_start_and_end_and_their_failures_are_contained():
    got = []
    rec = RequestRecorder(sink=got.append, otel_context=False)
    good, bad = _Observer(), _Observer(fail=True)
    rec.add_observer(bad)
    rec.add_observer(good)
    before = internal_error_counts().get("observer.on_start:_Observer", 0)
    span = rec.start("s/m")
    span.end()
    assert good.events == [("start", "s/m"), ("end", "s/m")]
    assert got[0][r.R_ATTRS]["observed"] is True
    assert internal_error_counts()["observer.on_start:_Observer"] == before + 1
    rec.remove_observer(good)
    rec.remove_observer(bad)
    rec.start("x").end()
    assert len(good.events) == 2


@pytest.mark.parametrize("direct", [True, False], ids=["direct-contextvar", "otel-api"])
def test_activation_makes_the_request_the_current_otel_span_and_restores_the_caller_context(direct: bool) -> None:
    """Both ways of attaching the request span to OpenTelemetry's context (setting OpenTelemetry's context
    variable directly, and the ``context.attach`` API used where the runtime context is not the default one)
    make the request the current span with the caller's baggage visible, nest, and restore what was there."""
    from opentelemetry import baggage, trace
    from opentelemetry import context as otel_context

    recorder = RequestRecorder()
    if not direct:
        recorder = RequestRecorder(otel_context=False)
        recorder._setup_otel_bridge()
        from zoomer_serve.recording import recorder as module

        assert module._direct_otel_context(module._otel_bridge_class()) is not None  # the default runtime
        set_span, attach = trace.set_span_in_context, otel_context.attach
        recorder.otel_attach = lambda span: attach(set_span(module._otel_bridge_class()(span),
                                                            span.otel_parent_context))
        recorder.otel_detach = otel_context.detach
    outer_token = otel_context.attach(baggage.set_baggage("tenant", "outer"))
    try:
        before = otel_context.get_current()
        outer = recorder.start("svc/Outer")
        outer.otel_parent_context = baggage.set_baggage("tenant", "acme", otel_context.Context())
        outer.activate()
        assert trace.get_current_span().get_span_context().span_id == outer.span_id
        assert trace.get_current_span().get_span_context().trace_id == outer.trace_id
        assert baggage.get_baggage("tenant") == "acme"
        inner = recorder.start("svc/Inner")
        inner.activate()
        assert trace.get_current_span().get_span_context().span_id == inner.span_id
        assert baggage.get_baggage("tenant") == "acme"  # no caller context: the current one (outer's) is the base
        inner.deactivate()
        assert trace.get_current_span().get_span_context().span_id == outer.span_id
        outer.deactivate()
        assert otel_context.get_current() is before
        assert not trace.get_current_span().get_span_context().is_valid
    finally:
        otel_context.detach(outer_token)


def test_plain_phases_are_phase_entries_and_others_full_child_records() -> None:
    """A plain phase (ended normally, no attributes of its own) is recorded as a phase entry, the short form that
    the encoder writes directly; a phase with attributes of its own or that raised is a full child record. Both
    expand to the same full records (``child_records``), on the record and on the span alike."""
    records: list[tuple] = []
    recorder = RequestRecorder(records.append, otel_context=False)
    for _ in range(2):
        span = recorder.start("svc/M")
        span.activate()
        with phase("forward"):
            with phase("inner"):
                pass
        with phase("forward", {"batch": 4}):
            pass
        with pytest.raises(ValueError), phase("forward"):
            raise ValueError("x")
        span.deactivate()
        on_span = span.child_records()
        span.end()
        assert r.child_records(records[-1]) == on_span
    for rec in records:
        raw = rec[r.R_CHILDREN]
        assert [len(c) for c in raw] == [r.PHASE_ENTRY_LEN, r.PHASE_ENTRY_LEN, len(rec), len(rec)]
        inner, outer = raw[0], raw[1]
        assert (inner[r.PH_NAME], inner[r.PH_PARENT_ID]) == ("inner", outer[r.PH_SPAN_ID])
        assert (outer[r.PH_NAME], outer[r.PH_PARENT_ID]) == ("forward", rec[r.R_SPAN_ID])
        assert rec[r.R_START_NS] <= outer[r.PH_START_NS] <= inner[r.PH_START_NS] <= inner[r.PH_END_NS] \
            <= outer[r.PH_END_NS] <= rec[r.R_END_NS]
        full = r.child_records(rec)
        assert [c[r.R_ATTRS] for c in full] == [
            {"zoomer.phase": "inner"}, {"zoomer.phase": "forward"}, {"zoomer.phase": "forward", "batch": 4},
            {"zoomer.phase": "forward", "error.type": "ValueError"}]
        assert [c[r.R_STATUS] for c in full] == [r.STATUS_UNSET] * 3 + [r.STATUS_ERROR]
        for c in full:
            assert len(c) == len(rec)
            assert (c[r.R_TRACE_ID], c[r.R_TRACE_FLAGS], c[r.R_KIND], c[r.R_FLAGS]) == (
                rec[r.R_TRACE_ID], rec[r.R_TRACE_FLAGS], r.KIND_INTERNAL, r.F_SAMPLED)
        assert full[0][r.R_SPAN_ID] == inner[r.PH_SPAN_ID] and full[0][r.R_END_NS] == inner[r.PH_END_NS]


def test_thread_joins_follow_a_request_to_the_other_threads_its_phases_run_on() -> None:
    """A thread join added on the request's own thread is entered by the request's outermost phase on each
    other thread (once, however the phases nest) and exited there; phases on the request's own thread, and
    after the join is removed, do not touch it; a join whose enter raises is counted, and the phase goes on."""
    import contextvars

    calls: list[tuple[str, str, int]] = []

    class Join:
        def __init__(self, name: str) -> None:
            self.name = name

        def enter(self) -> str:
            calls.append(("enter", self.name, threading.get_ident()))
            return f"token-{self.name}"

        def exit(self, token: str) -> None:
            calls.append(("exit", token, threading.get_ident()))

    class Broken:
        def enter(self) -> None:
            raise RuntimeError("enter failed")

        def exit(self, token: None) -> None:
            raise AssertionError("never entered, never exited")

    got: list[tuple] = []
    rec = RequestRecorder(sink=got.append, otel_context=False)
    span = rec.start("svc/M")
    a, b = Join("a"), Join("b")
    span.add_thread_join(a)
    span.add_thread_join(Broken())
    span.add_thread_join(b)
    before = internal_error_counts().get("thread_join.enter:Broken", 0)
    span.activate()
    with phase("home"):
        pass
    span.deactivate()
    assert calls == []

    def work() -> int:
        span.activate()
        with phase("outer"), phase("inner"):
            assert calls[-1][0] == "enter"  # entered before the body runs
        with phase("again"):
            pass
        span.deactivate()
        return threading.get_ident()

    worker = []
    thread = threading.Thread(target=lambda: worker.append(contextvars.copy_context().run(work)))
    thread.start()
    thread.join()
    assert calls == [("enter", "a", worker[0]), ("enter", "b", worker[0]), ("exit", "token-b", worker[0]),
                     ("exit", "token-a", worker[0])] * 2
    assert internal_error_counts()["thread_join.enter:Broken"] == before + 2
    span.remove_thread_join(a)
    calls.clear()
    thread = threading.Thread(target=lambda: worker.append(contextvars.copy_context().run(work)))
    thread.start()
    thread.join()
    assert [c[:2] for c in calls] == [("enter", "b"), ("exit", "token-b")] * 2
    span.end()
    assert sorted(c[r.R_NAME] for c in r.child_records(got[0])) == ["again", "again", "home", "inner", "inner", "outer", "outer"]


def test_phases_on_another_thread_open_the_requests_profiler_range_there(tmp_path) -> None:
    """While a session covers a request (its range is a thread join of the span), a phase on another thread
    opens the request's range there, once per thread however the phases nest; phases on the range's own
    thread, and phases of a request no session covers, open only their own ranges (a real Kineto capture of
    all threads)."""
    import contextvars
    import json

    import torch

    from zoomer_serve.profiling.capture import Activities, Capture
    from zoomer_serve.profiling.config import SessionOptions
    from zoomer_serve.profiling.session import RequestRange

    rec = RequestRecorder()
    covered, plain = rec.start("svc/Covered"), rec.start("svc/Plain")
    covered.add_thread_join(RequestRange("zoomer.request/covered"))
    def executor_work(span: RequestSpan, name: str) -> None:
        span.activate()
        with phase(f"{name}.outer"), phase(f"{name}.inner"):
            torch.ones(4) * 2
        with phase(f"{name}.after"):
            torch.ones(4) + 1
        span.deactivate()

    capture = Capture(SessionOptions(cuda=False), Activities(cuda=False))
    capture.start()
    try:
        covered.activate()
        with phase("covered.here"):
            torch.ones(4) - 1
        covered.deactivate()
        for span, name in ((covered, "covered"), (plain, "plain")):
            thread = threading.Thread(target=contextvars.copy_context().run, args=(executor_work, span, name))
            thread.start()
            thread.join()
    finally:
        capture.stop()
    capture.export_json(tmp_path / "trace.json")
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
              if e.get("cat") == "user_annotation" and e["name"].startswith(("zoomer.request/", "covered", "plain"))]
    tid = {e["name"]: e["tid"] for e in events}
    labels = [e for e in events if e["name"] == "zoomer.request/covered"]
    # opened by the phases at the top of the executor thread (outer, after), on that thread only
    assert len(labels) == 2 and {e["tid"] for e in labels} == {tid["covered.outer"]}
    assert tid["covered.outer"] != tid["covered.here"]
    assert sorted(e["name"] for e in events) == sorted([
        "zoomer.request/covered", "zoomer.request/covered", "covered.here", "covered.outer", "covered.inner",
        "covered.after", "plain.outer", "plain.inner", "plain.after"])
    for name in ("covered.inner", "covered.after"):
        ev = next(e for e in events if e["name"] == name)
        assert any(r["ts"] <= ev["ts"] and ev["ts"] + ev["dur"] <= r["ts"] + r["dur"] for r in labels), name
