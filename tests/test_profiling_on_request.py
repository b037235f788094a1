"""Profiling one request: the ``zoomer-profile`` metadata / Thrift header / ``zoomer.profile`` baggage ask, closed
by default like the admin service, on real demo servers (sync gRPC, grpc.aio with batching, Thrift), and the
"next request over a latency threshold" mode."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _profiling_support import TOKEN, read_chrome_trace, request_ranges

from interceptors import ZoomerServerInterceptor
from zoomer_serve.demo import ranker_pb2_grpc
from zoomer_serve.demo.load import make_request
from zoomer_serve.demo.model import build_model
from zoomer_serve.demo.service import ServiceConfig, build_server
from zoomer_serve.profiling import AdminConfig, ProfilerConfig, ProfilerController
from zoomer_serve.profiling.labels import parse_member_label
from zoomer_serve.profiling.on_request import (
    ASKED,
    BAGGAGE_KEY,
    CAPTURED,
    PROFILE_KEY,
    SESSION_ID,
    RequestProfiler,
    RequestProfilingConfig,
    token_allows,
)
from zoomer_serve.profiling.summary import summarize_events

PREDICT = "zoomer.demo.v1.Ranker/Predict"


def test_the_ask_follows_the_admin_rules() -> None:
    closed = AdminConfig()
    assert not token_allows(closed, TOKEN, loopback=True)  # no token configured, loopback not opened: refused
    with_token = AdminConfig(token=TOKEN)
    assert token_allows(with_token, TOKEN, loopback=False)
    assert token_allows(with_token, f"Bearer {TOKEN}", loopback=False)
    assert token_allows(with_token, TOKEN.encode(), loopback=False)
    assert not token_allows(with_token, "wrong", loopback=True)
    assert not token_allows(with_token, "", loopback=False) and not token_allows(with_token, None, loopback=False)
    opened = AdminConfig(open_loopback=True)
    assert token_allows(opened, "1", loopback=True) and not token_allows(opened, "1", loopback=False)


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(device="cpu")


@contextmanager
def _served(telemetry: Any, model: Any, tmp_path: Path, admin: AdminConfig, config: ServiceConfig | None = None,
            profiling: RequestProfilingConfig | None = None) -> Iterator[tuple[str, ProfilerController,
                                                                                RequestProfiler]]:
    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path / "profiles"), telemetry).attach()
    profiler = RequestProfiler(controller, admin, profiling).attach()
    server, port = build_server(model, interceptors=[ZoomerServerInterceptor(telemetry.recorder)], max_workers=4,
                                config=config)
    try:
        yield f"127.0.0.1:{port}", controller, profiler
    finally:
        profiler.close()
        controller.close(timeout_s=60)
        server.stop(None).wait(5)


def _predict(target: str, metadata: tuple[tuple[str, str], ...] = (), seed: int = 0) -> None:
    with grpc.insecure_channel(target) as channel:
        reply = ranker_pb2_grpc.RankerStub(channel).Predict(make_request(np.random.default_rng(seed), 8), timeout=60,
                                                            metadata=metadata)
    assert len(reply.scores) == 8


def _requests(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in spans if s["kind"] == "SERVER" and s["name"] == PREDICT]


@pytest.mark.slow
def test_an_ask_without_the_token_is_refused_and_starts_nothing(collector, telemetry, model, tmp_path) -> None:
    with _served(telemetry, model, tmp_path, AdminConfig(token=TOKEN)) as (target, controller, profiler):
        _predict(target, ((PROFILE_KEY, "not-the-token"),))
        _predict(target, ((PROFILE_KEY, "1"),))  # a loopback caller, but loopback is not opened
        _predict(target, (("baggage", f"{BAGGAGE_KEY}=1"),))  # baggage never carries the token
        assert profiler.refused == 3 and profiler.honoured == 0
        assert controller.last is None and controller.status().session is None
    spans = _requests(collector.spans())
    assert [s["attributes"].get(ASKED) for s in spans] == ["refused"] * 3
    assert not [s for s in collector.spans() if s["name"] == "zoomer.profile"]


@pytest.mark.slow
def test_an_ask_with_the_token_profiles_that_request_and_links_it(collector, telemetry, model, tmp_path) -> None:
    with _served(telemetry, model, tmp_path, AdminConfig(token=TOKEN)) as (target, controller, profiler):
        _predict(target)  # not asked: no session
        assert controller.last is None
        _predict(target, ((PROFILE_KEY, f"Bearer {TOKEN}"),), seed=1)
        assert controller.wait_idle(60)
        info = controller.last
    assert info is not None and info.outcome == "done" and info.trigger == "request", info
    assert info.stop_reason == "request_done" and info.requests == 1
    spans = collector.spans()
    plain, asked = _requests(spans)
    assert ASKED not in plain["attributes"]
    assert asked["attributes"][ASKED] == "covered" and asked["attributes"][SESSION_ID] == info.session_id
    (profile,) = [s for s in spans if s["name"] == "zoomer.profile"]
    assert [(lk["trace_id"], lk["span_id"]) for lk in profile["links"]] == [(asked["trace_id"], asked["span_id"])]
    assert profile["attributes"]["zoomer.profile.trigger.span_id"] == asked["span_id"]
    ranges = request_ranges(read_chrome_trace(Path(info.trace_path)))
    assert set(ranges) == {(int(asked["trace_id"], 16), int(asked["span_id"], 16))}


@pytest.mark.slow
def test_a_baggage_ask_from_loopback_is_honoured_when_loopback_is_open(collector, telemetry, model, tmp_path) -> None:
    with _served(telemetry, model, tmp_path, AdminConfig(open_loopback=True)) as (target, controller, _):
        _predict(target, (("baggage", f"{BAGGAGE_KEY}=1,other=x"),))
        assert controller.wait_idle(60)
        info = controller.last
    assert info is not None and info.outcome == "done" and info.requests == 1
    (asked,) = _requests(collector.spans())
    assert asked["attributes"][ASKED] == "covered"


@pytest.mark.slow
def test_an_aio_request_asks_and_its_batch_waits_for_the_profiler(collector, telemetry, model, tmp_path) -> None:
    """On an event loop the asking request cannot wait; its batch does, on the batching thread, and the request is
    covered through the batch's range: its share of the batch's operators."""
    from zoomer_serve.demo.aio_server import aio_server_in_thread

    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path / "profiles"), telemetry).attach()
    profiler = RequestProfiler(controller, AdminConfig(token=TOKEN)).attach()
    try:
        with aio_server_in_thread(model, grace_s=2.0, config=ServiceConfig(batch_max_size=4, batch_max_delay_ms=5)) \
                as port:
            _predict(f"127.0.0.1:{port}", ((PROFILE_KEY, TOKEN),), seed=2)
            assert controller.wait_idle(60)
    finally:
        profiler.close()
        controller.close(timeout_s=60)
    info = controller.last
    assert info is not None and info.outcome == "done" and info.requests == 1, info
    spans = collector.spans()
    (asked,) = _requests(spans)
    assert asked["attributes"][ASKED] == "covered" and asked["attributes"]["zoomer.batch.size"] == 1
    (profile,) = [s for s in spans if s["name"] == "zoomer.profile"]
    assert [(lk["trace_id"], lk["span_id"]) for lk in profile["links"]] == [(asked["trace_id"], asked["span_id"])]
    data = read_chrome_trace(Path(info.trace_path))
    ids = (int(asked["trace_id"], 16), int(asked["span_id"], 16))
    markers = [parse_member_label(e["name"]) for e in data["traceEvents"] if e.get("cat") == "user_annotation"
               and parse_member_label(e["name"])]
    assert [(t, s) for _, t, s, _ in markers] == [ids]
    assert summarize_events(data["traceEvents"]).requests[ids].cpu_op_count > 0
    (child,) = [s for s in spans if s["name"] == "zoomer.profile.request"]
    assert child["parent_span_id"] == asked["span_id"] and child["attributes"]["zoomer.profile.cpu_op.count"] > 0


@pytest.mark.slow
def test_a_thrift_header_asks_for_the_profile(collector, telemetry, model, tmp_path) -> None:
    from thriftpy2.contrib.tracking import TrackerBase

    from interceptors.thrift_client import TraceContextTracker, make_client
    from zoomer_serve.demo.thrift_load import to_thrift_request
    from zoomer_serve.demo.thrift_server import build_thrift_server, ranker_thrift

    class Asking(TraceContextTracker):
        def gen_header(self, header: Any) -> None:
            super().gen_header(header)
            header.meta[PROFILE_KEY] = TOKEN

    assert issubclass(Asking, TrackerBase)
    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path / "profiles"), telemetry).attach()
    profiler = RequestProfiler(controller, AdminConfig(token=TOKEN)).attach()
    server = build_thrift_server(model).start()
    try:
        client = make_client(ranker_thrift().Ranker, "127.0.0.1", server.port, timeout=60_000, tracker=Asking())
        try:
            reply = client.Predict(to_thrift_request(make_request(np.random.default_rng(3), 8)))
        finally:
            client.close()
        assert len(reply.scores) == 8
        assert controller.wait_idle(60)
    finally:
        server.stop(grace_s=5)
        profiler.close()
        controller.close(timeout_s=60)
    info = controller.last
    assert info is not None and info.outcome == "done" and info.requests == 1 and info.stop_reason == "request_done"
    (asked,) = _requests(collector.spans())
    assert asked["attributes"][ASKED] == "covered" and asked["attributes"][SESSION_ID] == info.session_id


@pytest.mark.slow
def test_the_next_request_over_the_threshold_is_captured(collector, telemetry, model, tmp_path) -> None:
    """A threshold of 1 µs: the first covered request is over it; the session ends there, linked to it."""
    cfg = RequestProfilingConfig(threshold_ms=0.001, threshold_window_ms=30_000)
    with _served(telemetry, model, tmp_path, AdminConfig(token=TOKEN), profiling=cfg) as (target, controller, profiler):
        deadline = time.monotonic() + 60
        while controller.status().state.value != "running" and time.monotonic() < deadline:
            time.sleep(0.01)
        for seed in range(3):
            _predict(target, seed=seed)
        assert controller.wait_idle(60)
        info = controller.last
        assert profiler.captured == 1
    assert info is not None and info.trigger == "latency_threshold" and info.stop_reason == "latency_threshold"
    spans = _requests(collector.spans())
    captured = [s for s in spans if s["attributes"].get(CAPTURED) == "latency_threshold"]
    assert len(captured) == 1 and captured[0]["attributes"][SESSION_ID] == info.session_id
    (profile,) = [s for s in collector.spans() if s["name"] == "zoomer.profile"]
    assert (captured[0]["trace_id"], captured[0]["span_id"]) in {(lk["trace_id"], lk["span_id"])
                                                                  for lk in profile["links"]}


@pytest.mark.slow
def test_the_threshold_mode_rearms_a_bounded_number_of_times(telemetry, tmp_path) -> None:
    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path / "profiles"), telemetry).attach()
    cfg = RequestProfilingConfig(threshold_ms=60_000, threshold_window_ms=200, threshold_attempts=2)
    profiler = RequestProfiler(controller, AdminConfig(token=TOKEN), cfg).attach()
    try:
        deadline = time.monotonic() + 90
        while controller.last is None or controller.last.number < 2 or controller.status().session is not None:
            assert time.monotonic() < deadline, "the threshold mode did not run its two sessions"
            time.sleep(0.05)
        assert controller.last.trigger == "latency_threshold" and controller.last.stop_reason == "duration"
        time.sleep(0.5)
        assert controller.status().session is None and profiler.captured == 0  # two attempts, then off
    finally:
        profiler.close()
        controller.close(timeout_s=60)


@pytest.mark.slow
def test_serve_demo_with_batching_honours_an_ask_with_the_token_only(collector, tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from zoomer_serve.processes import wait_for_event

    profiles = tmp_path / "profiles"
    env = dict({k: v for k, v in os.environ.items() if k != "ZOOMER_ADMIN_TOKEN"}, ZOOMER_ADMIN_TOKEN=TOKEN,
               OTEL_EXPORTER_OTLP_ENDPOINT=collector.grpc_endpoint, OTEL_BSP_SCHEDULE_DELAY="200")
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", "serve-demo", "--port", "0", "--profiles-dir",
                             str(profiles), "--batch-max-size", "4", "--batch-max-delay-ms", "3"],
                            stdout=subprocess.PIPE, env=env)
    try:
        ready = wait_for_event(proc, "ready", 120)
        assert ready is not None and ready["batch_max_size"] == 4
        target = f"127.0.0.1:{ready['port']}"
        _predict(target, ((PROFILE_KEY, "wrong"),))
        _predict(target, ((PROFILE_KEY, TOKEN),), seed=1)
        deadline = time.monotonic() + 60
        while not list(profiles.glob("*_request_*.pt.trace.json.gz")) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert wait_for_event(proc, "stopped", 90) is not None and proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    (trace,) = profiles.glob("*.pt.trace.json.gz")
    assert "_request_" in trace.name
    spans = collector.spans()
    refused, asked = sorted(_requests(spans), key=lambda s: s["start_ns"])
    assert refused["attributes"][ASKED] == "refused" and asked["attributes"][ASKED] == "covered"
    assert "zoomer.batch.id" in asked["attributes"]
