"""Per-request thread CPU time (``zoomer.request.cpu_time_ns``) on real servers: the demo Ranker on the sync gRPC
server with its CPU-bound preprocessing step, the echo test service's sleeping handler, the same handler on a
grpc.aio server (no attribute: the event loop's thread runs many requests), exported over real OTLP."""

from __future__ import annotations

import statistics
import threading
from typing import Any

import grpc_echo
import grpc_echo_aio
import pytest
import torch

from interceptors import ZoomerAioServerInterceptor, ZoomerServerInterceptor
from zoomer_serve.demo.load import drive_load
from zoomer_serve.demo.model import DLRM, build_model
from zoomer_serve.demo.service import ServiceConfig, build_server
from zoomer_serve.host import RequestCpuTimeObserver
from zoomer_serve.host.names import REQUEST_CPU_TIME
from zoomer_serve.recording import records as r

PREDICT = "zoomer.demo.v1.Ranker/Predict"
SLOW_ITERATIONS = 40_000


@pytest.fixture(scope="module")
def model() -> DLRM:
    torch.set_num_threads(1)
    return build_model(device="cpu")


def cpu_share(span: dict[str, Any]) -> float:
    return span["attributes"][REQUEST_CPU_TIME] / span["duration_ns"]


def test_cpu_time_is_below_wall_time_and_tells_computing_from_waiting(model: DLRM, telemetry: Any,
                                                                       collector: Any) -> None:
    """CPU-bound demo requests (a pure-Python preprocessing step) spend most of their wall time on a CPU;
    echo requests that sleep 3 ms spend little. Every request span carries its CPU time, below its wall time."""
    server, port = build_server(model, interceptors=[ZoomerServerInterceptor(telemetry.recorder)], max_workers=2,
                                config=ServiceConfig(slow_preprocess_iterations=SLOW_ITERATIONS))
    echo, target = grpc_echo.start_server([ZoomerServerInterceptor(telemetry.recorder, excluded_methods=())])
    client = grpc_echo.Client(target)
    try:
        load = drive_load(f"127.0.0.1:{port}", 30.0, clients=1, batch_size=4, max_requests=20, stream_share=0.0,
                          invalid_share=0.0)
        assert load.unexpected == 0
        for _ in range(20):
            assert client.unary(b"phases", timeout=10) == b"ok"
    finally:
        client.close()
        echo.stop(None).wait(5)
        server.stop(None).wait(5)
    servers = collector.spans("SERVER")
    computing = [s for s in servers if s["name"] == PREDICT]
    waiting = [s for s in servers if s["name"] == "test.Echo/Unary"]
    assert len(computing) == 20 and len(waiting) == 20
    for span in computing + waiting:
        assert 0 < span["attributes"][REQUEST_CPU_TIME] < span["duration_ns"], span["attributes"]
    busy, idle = statistics.median(map(cpu_share, computing)), statistics.median(map(cpu_share, waiting))
    assert busy > 5 * idle, (busy, idle)
    assert busy > 0.5  # one client: the request's thread computes for most of its wall time


def test_no_cpu_time_on_an_event_loop(telemetry: Any, collector: Any) -> None:
    """On grpc.aio the thread runs every request's coroutine: its CPU time is not one request's, so none is set
    (and the observer keeps nothing open)."""
    server, target = grpc_echo_aio.start_server([ZoomerAioServerInterceptor(telemetry.recorder,
                                                                            excluded_methods=())])
    client = grpc_echo.Client(target)
    try:
        for _ in range(5):
            assert client.unary(b"phases", timeout=10) == b"ok"
    finally:
        client.close()
        server.stop(None)
    observer = telemetry.host.request_cpu
    assert observer.skipped_event_loop >= 5 and observer.open_spans == 0
    spans = [s for s in collector.spans("SERVER") if s["name"] == "test.Echo/Unary"]
    assert len(spans) == 5
    assert all(REQUEST_CPU_TIME not in s["attributes"] for s in spans)


def test_a_span_ended_on_another_thread_gets_no_cpu_time() -> None:
    """The recorder's observer protocol directly: a span that ends on another thread (a streaming response
    finished from gRPC's callback thread) is left without the attribute; a client span is not measured."""
    from zoomer_serve.recording import RequestRecorder

    recorder = RequestRecorder(otel_context=False)
    observer = RequestCpuTimeObserver()
    recorder.add_observer(observer)
    same = recorder.start("svc/Same")
    sum(range(20_000))
    same.end()
    other = recorder.start("svc/Other")
    ender = threading.Thread(target=other.end)
    ender.start()
    ender.join()
    client = recorder.start("svc/Client", kind=r.KIND_CLIENT)
    client.end()
    assert same.attributes[REQUEST_CPU_TIME] > 0
    assert REQUEST_CPU_TIME not in other.attributes and REQUEST_CPU_TIME not in client.attributes
    assert observer.skipped_other_thread == 1 and observer.open_spans == 0


def test_unsampled_spans_make_no_clock_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsampled span is not exported, so nothing would carry its CPU time: the observer reads no clock for it
    (each read is a system call that costs the demo model tens of µs in place, benchmarks/RESULTS.md) and counts
    it in ``skipped_unsampled``. Sampled spans in the same recorder still get the attribute."""
    from zoomer_serve.host import request_cpu
    from zoomer_serve.recording import RequestRecorder
    from zoomer_serve.recording.propagation import parse_traceparent
    from zoomer_serve.recording.sampling import Sampler

    reads: list[str] = []
    start_clock, end_clock = request_cpu._thread_time_ns, request_cpu.thread_cpu_ns
    monkeypatch.setattr(request_cpu, "_thread_time_ns", lambda: reads.append("start") or start_clock())
    monkeypatch.setattr(request_cpu, "thread_cpu_ns", lambda: reads.append("end") or end_clock())
    recorder = RequestRecorder(sampler=Sampler("parentbased_traceidratio", 0.0), otel_context=False)
    observer = RequestCpuTimeObserver()
    recorder.add_observer(observer)
    dropped = recorder.start("svc/Ratio0")  # a root span under ratio 0: not sampled
    not_sampled = recorder.start("svc/Child", parent=parse_traceparent(f"00-{'a' * 32}-{'b' * 16}-00"))
    sampled = recorder.start("svc/Child", parent=parse_traceparent(f"00-{'c' * 32}-{'d' * 16}-01"))
    for span in (dropped, not_sampled, sampled):
        span.end()
    assert not dropped.sampled and not not_sampled.sampled and sampled.sampled
    assert reads == ["start", "end"]
    assert REQUEST_CPU_TIME in sampled.attributes
    assert REQUEST_CPU_TIME not in dropped.attributes and REQUEST_CPU_TIME not in not_sampled.attributes
    assert observer.skipped_unsampled == 2 and observer.open_spans == 0


def test_the_clock_reads_this_threads_cpu_time_without_the_interpreter_lock() -> None:
    """On Linux the reader is the ctypes call (which releases the interpreter lock around the system call), not
    the ``time.thread_time_ns`` fallback, and it gives the same clock: each thread its own CPU time, in ns."""
    import sys
    import time

    from zoomer_serve.host import request_cpu

    if sys.platform.startswith("linux"):
        assert request_cpu.thread_cpu_ns is not time.thread_time_ns
    results: dict[str, tuple[int, int, int, int]] = {}

    def measure(name: str, spin: int) -> None:
        before = time.thread_time_ns()
        start = request_cpu.thread_cpu_ns()
        total = 0
        for i in range(spin):
            total += i
        end = request_cpu.thread_cpu_ns()
        results[name] = (before, start, end, time.thread_time_ns())

    threads = [threading.Thread(target=measure, args=("busy", 3_000_000)),
               threading.Thread(target=measure, args=("idle", 0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for before, start, end, after in results.values():
        assert before <= start <= end <= after
    busy, idle = results["busy"], results["idle"]
    assert busy[2] - busy[1] > 10_000_000  # 3 million loop steps: well over 10 ms of this thread's CPU
    assert idle[2] - idle[1] < 5_000_000  # the other thread's work is not counted in this one's clock
