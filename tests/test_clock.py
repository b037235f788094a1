"""Span times: the wall clock is read once per span, at its start; its end, its phases and its events are that
start plus a monotonic delta, so a step of the wall clock during a request (an NTP correction, a VM resumed)
never gives a negative or a 30-second duration."""

from __future__ import annotations

import time
from concurrent import futures
from typing import Any

import grpc
import pytest

from interceptors import ZoomerServerInterceptor
from zoomer_serve import phase
from zoomer_serve.recording import recorder as recorder_mod

STEP_NS = 30 * 1_000_000_000


@pytest.mark.parametrize("step_ns", [-STEP_NS, STEP_NS], ids=["back", "forward"])
def test_a_wall_clock_step_during_a_request_changes_no_duration(telemetry, collector, monkeypatch, step_ns):
    """The wall clock jumps by 30 s (back, then forward) in the middle of each request on a real server: the
    stored span and its phases keep their real (monotonic) durations, and the phases lie inside the span."""
    offset = [0]
    real = time.time_ns
    monkeypatch.setattr(recorder_mod, "_time_ns", lambda: real() + offset[0])

    def handler(request: bytes, context: Any) -> bytes:
        with phase("before-step"):
            time.sleep(0.02)
        offset[0] += step_ns  # the step: anything that reads the wall clock from now on is 30 s off
        with phase("after-step"):
            time.sleep(0.02)
        return request

    generic = grpc.method_handlers_generic_handler("t.Clock", {"Tick": grpc.unary_unary_rpc_method_handler(handler)})
    server = grpc.server(futures.ThreadPoolExecutor(2),
                         interceptors=[ZoomerServerInterceptor(recorder=telemetry.recorder)])
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(3):
                start = time.monotonic_ns()
                channel.unary_unary("/t.Clock/Tick")(b"x", timeout=30)
                assert time.monotonic_ns() - start < STEP_NS  # the calls themselves took no 30 s
    finally:
        server.stop(None)
    spans = collector.spans()
    requests = [s for s in spans if s["kind"] == "SERVER"]
    assert len(requests) == 3
    for req in requests:
        assert 40_000_000 <= req["duration_ns"] < STEP_NS // 2, req["duration_ns"]
        phases = [s for s in spans if s["parent_span_id"] == req["span_id"]]
        assert sorted(p["name"] for p in phases) == ["after-step", "before-step"]
        for p in phases:
            assert 20_000_000 <= p["duration_ns"] < STEP_NS // 2
            assert req["start_ns"] <= p["start_ns"] <= p["end_ns"] <= req["end_ns"]


def test_a_profiled_request_span_lies_inside_its_request_when_the_wall_clock_steps_back(
        telemetry, collector, monkeypatch, tmp_path):
    """A profiling session's ``zoomer.profile.request`` span (made after the fact, child of the request span)
    ends on its request's clock: the wall clock stepping back 30 s during the request leaves it inside the
    request span. It read the wall clock at the request's end, which on a loaded CI machine put it a few µs past
    its parent's end now and then, and 30 s before its own start after this step."""
    from zoomer_serve.profiling import ProfilerConfig, ProfilerController, SessionOptions

    offset = [0]
    real = time.time_ns
    monkeypatch.setattr(recorder_mod, "_time_ns", lambda: real() + offset[0])
    monkeypatch.setattr(time, "time_ns", lambda: real() + offset[0])

    def handler(request: bytes, context: Any) -> bytes:
        with phase("before-step"):
            time.sleep(0.01)
        offset[0] -= STEP_NS
        return request

    generic = grpc.method_handlers_generic_handler("t.Clock", {"Tick": grpc.unary_unary_rpc_method_handler(handler)})
    server = grpc.server(futures.ThreadPoolExecutor(2),
                         interceptors=[ZoomerServerInterceptor(recorder=telemetry.recorder)])
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path), telemetry).attach()
    try:
        controller.start(SessionOptions(max_requests=3, cuda=False))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(3):
                channel.unary_unary("/t.Clock/Tick")(b"x", timeout=30)
        assert controller.wait_idle(60)
        assert controller.last is not None and controller.last.outcome == "done", controller.last
    finally:
        controller.close(timeout_s=60)
        server.stop(None)
    spans = collector.spans()
    requests = {s["span_id"]: s for s in spans if s["kind"] == "SERVER"}
    children = [s for s in spans if s["name"] == "zoomer.profile.request"]
    assert len(requests) == 3 and len(children) == 3
    for child in children:
        parent = requests[child["parent_span_id"]]
        assert parent["start_ns"] <= child["start_ns"] < child["end_ns"] <= parent["end_ns"], (parent, child)


def test_the_latency_triggers_see_a_request_s_duration_on_its_clock(telemetry, monkeypatch, tmp_path):
    """The latency triggers (SLO, steady state) take each ended request's duration from its own clock: the wall
    clock stepping forward 30 s during a 5 ms request does not feed them a 30 s request (which would start an
    SLO profiling session for nothing)."""
    from zoomer_serve.profiling import LatencySloConfig, ProfilerConfig, ProfilerController

    offset = [0]
    real = time.time_ns
    monkeypatch.setattr(recorder_mod, "_time_ns", lambda: real() + offset[0])
    monkeypatch.setattr(time, "time_ns", lambda: real() + offset[0])
    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path, latency_slo=LatencySloConfig(p99_ms=100)),
                                    telemetry).attach()
    fed: list[int] = []
    monitor_feed = controller._feed  # the trigger monitor's queue, which this test reads through
    assert monitor_feed is not None
    controller._feed = lambda span, end_ns: (fed.append(end_ns - span.start_ns), monitor_feed(span, end_ns))
    try:
        span = telemetry.recorder.start("t.Clock/Tick")
        time.sleep(0.005)
        offset[0] += STEP_NS
        controller.on_end(span)
    finally:
        controller.close(timeout_s=30)
    assert len(fed) == 1 and 5_000_000 <= fed[0] < STEP_NS // 2, fed
