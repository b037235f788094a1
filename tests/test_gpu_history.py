"""Allocation events per request: tagging, the background drain, child spans, recording windows (C06) and
snapshots in a busy server (C07), over the fake CUDA memory source; end to end through a real gRPC server
and the embedded collector."""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from zoomer_serve.recording import RequestRecorder
from zoomer_serve.recording import records as r
from zoomer_serve.telemetry import (
    AllocationHistory,
    GpuMemoryObserver,
    GpuTelemetryConfig,
    SnapshotError,
    SnapshotTimeout,
    attach_gpu_telemetry,
)
from zoomer_serve.telemetry import names as n
from zoomer_serve.telemetry.gpu import install_gpu_telemetry

sys.path.insert(0, str(Path(__file__).parent))
from _fake_gpu import SEGMENT, FakeCudaMemory, FakeNvml

MiB = 1 << 20


def _setup(fake: FakeCudaMemory, top_events: int = 5, max_entries: int = 10_000):
    got: list = []
    rec = RequestRecorder(sink=got.append, otel_context=False)
    history = AllocationHistory(fake, "python", max_entries, top_events)
    rec.add_observer(GpuMemoryObserver(fake, (0,), history=history))
    history.enable()
    return rec, history, got


def _children(got, parent):
    return [c for c in got if c[r.R_NAME] == n.EVENTS_SPAN and c[r.R_PARENT_ID] == parent.span_id]


def test_a_request_gets_one_child_span_with_counts_bytes_and_its_largest_entries():
    fake = FakeCudaMemory()
    rec, history, got = _setup(fake, top_events=2)
    span = rec.start("svc/M")
    a = fake.allocate(100)
    b = fake.allocate(3 * MiB)  # a second segment (4 MiB)
    c = fake.allocate(5000)
    fake.free(b)
    span.end()
    assert fake.current_metadata() == ""  # cleared at the end, on the request's thread
    history.drain()
    (child,) = _children(got, span)
    attrs = child[r.R_ATTRS]
    assert attrs[n.action_count("alloc")] == 3 and attrs[n.action_bytes("alloc")] == 100 + 3 * MiB + 5000
    assert attrs[n.action_count("segment_alloc")] == 2 and attrs[n.action_bytes("segment_alloc")] == SEGMENT + 4 * MiB
    assert attrs[n.action_count("free_requested")] == 1 and attrs[n.action_bytes("free_completed")] == 3 * MiB
    assert attrs[n.action_count("oom")] == 0 and attrs[n.action_count("segment_free")] == 0
    assert child[r.R_TRACE_ID] == span.trace_id and child[r.R_FLAGS] & r.F_SAMPLED
    sizes = [(e[2][n.EVENT_ACTION], e[2][n.EVENT_SIZE]) for e in child[r.R_EVENTS]]
    assert sizes == [("segment_alloc", 4 * MiB), ("alloc", 3 * MiB)]
    assert history.stats.attributed == 7 and history.stats.unattributed == 0
    fake.free(a)
    fake.free(c)


def test_concurrent_requests_on_their_own_threads_get_their_own_entries():
    fake = FakeCudaMemory(limit_bytes=1 << 40)
    rec, history, got = _setup(fake)
    barrier = threading.Barrier(3)
    spans = {}

    def work(k: int) -> None:
        span = rec.start(f"svc/{k}")
        spans[k] = span
        barrier.wait()
        for _ in range(k):
            fake.free(fake.allocate(k * 1000))
        barrier.wait()
        span.end()

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    history.drain()
    for k, span in spans.items():
        (child,) = _children(got, span)
        assert child[r.R_ATTRS][n.action_count("alloc")] == k
        assert child[r.R_ATTRS][n.action_bytes("alloc")] == k * k * 1000


def test_allocations_of_a_requests_phases_on_an_executor_thread_are_its_own():
    """A request whose model runs on an executor thread (as on the grpc.aio demo, ``asyncio.to_thread``): its
    phase there tags that thread with the request for the phase's duration, so those allocations are the
    request's; the executor thread is untagged again afterwards, and its allocations outside phases stay
    unattributed."""
    import contextvars

    from zoomer_serve.recording import phase

    fake = FakeCudaMemory()
    rec, history, got = _setup(fake)
    span = rec.start("svc/Aio")
    fake.free(fake.allocate(100))  # on the request's own thread

    def executor() -> None:
        span.activate()
        with phase("forward"), phase("inner"):
            fake.free(fake.allocate(2000))
            fake.free(fake.allocate(3000))
        span.deactivate()
        assert fake.current_metadata() == ""
        fake.allocate(7)  # this thread, outside the request's phases

    thread = threading.Thread(target=contextvars.copy_context().run, args=(executor,))
    thread.start()
    thread.join()
    span.end()
    history.drain()
    (child,) = _children(got, span)
    assert child[r.R_ATTRS][n.action_count("alloc")] == 3
    assert child[r.R_ATTRS][n.action_bytes("alloc")] == 100 + 2000 + 3000
    assert history.stats.unattributed == 1  # the allocation of 7 B outside the phases
    assert span.thread_joins == ()


def test_a_request_running_across_drains_is_sent_once_after_it_ends():
    fake = FakeCudaMemory()
    rec, history, got = _setup(fake)
    span = rec.start("svc/Long")
    fake.free(fake.allocate(10))
    history.drain()
    assert _children(got, span) == []  # still running: nothing sent yet
    fake.free(fake.allocate(20))
    span.end()
    history.drain()
    (child,) = _children(got, span)
    assert child[r.R_ATTRS][n.action_count("alloc")] == 2
    assert child[r.R_ATTRS][n.action_bytes("alloc")] == 30
    history.drain()
    assert len(_children(got, span)) == 1


def test_entries_outside_requests_are_counted_as_unattributed():
    fake = FakeCudaMemory()
    rec, history, got = _setup(fake)
    fake.free(fake.allocate(10))  # no request: 2 alloc/free entries + 2 (segment_alloc, free_completed)
    span = rec.start("svc/M")
    span.end()
    fake.free(fake.allocate(10))  # after the request ended on this thread: its tag was cleared
    history.drain()
    assert history.stats.unattributed == 7  # 1 segment_alloc + 2 x (alloc, free_requested, free_completed)
    assert _children(got, span) == []  # the request allocated nothing


def test_each_entry_is_read_once_even_when_entries_share_a_timestamp():
    now = [1_000]
    fake = FakeCudaMemory(clock_us=lambda: now[0])  # a coarse clock: bursts share time_us
    rec, history, got = _setup(fake)
    span = rec.start("svc/M")
    fake.allocate(10)
    fake.allocate(20)  # same time_us as the first
    history.drain()
    fake.allocate(30)  # still the same time_us, after a drain
    now[0] += 5
    fake.allocate(40)
    span.end()
    history.drain()
    (child,) = _children(got, span)
    assert child[r.R_ATTRS][n.action_count("alloc")] == 4
    assert child[r.R_ATTRS][n.action_bytes("alloc")] == 100
    assert history.stats.entries == 5  # 4 allocs and one segment_alloc, none twice


def test_a_ring_buffer_that_wrapped_between_drains_is_counted_and_logged_once(caplog):
    fake = FakeCudaMemory()
    rec, history, got = _setup(fake, max_entries=8)
    span = rec.start("svc/M")
    fake.free(fake.allocate(1))
    history.drain()
    with caplog.at_level(logging.WARNING, logger="zoomer_serve.telemetry"):
        for _ in range(2):
            for _ in range(10):  # 30 entries into a ring of 8
                fake.free(fake.allocate(1))
            history.drain()
    span.end()
    assert history.stats.overruns == 2
    assert len([m for m in caplog.messages if "wrapped" in m]) == 1


def test_history_windows_on_and_off_leave_the_allocator_as_it_was():
    """C06: recording is switched on and off around an allocate/free loop (bytes to megabytes), many times.
    After each window, recording is fully off (the allocator records nothing, the ring is empty, requests are
    no longer tagged), every window starts with the same bounded settings, and nothing grows with the number
    of windows. The throughput half of C06 needs a GPU: benchmarks/gpu_check.py step C06."""
    fake = FakeCudaMemory(limit_bytes=1 << 40)
    got: list = []
    rec = RequestRecorder(sink=got.append, otel_context=False)
    history = AllocationHistory(fake, "python", 1000, 5)
    rec.add_observer(GpuMemoryObserver(fake, (0,), history=history))
    sizes = [1, 512, 64 << 10, MiB, 8 * MiB]

    def loop() -> None:
        span = rec.start("svc/loop")
        for size in sizes:
            fake.free(fake.allocate(size))
        span.end()

    for _ in range(50):
        with history.window():
            assert fake.recording is True
            loop()
        assert fake.recording is False and len(fake.devices[0].trace) == 0
        loop()  # recording off: no entries, no tag
        assert len(fake.devices[0].trace) == 0 and fake.current_metadata() == ""
    assert fake.history_calls == [(True, "python", 1000), (False, "python", 1000)] * 50
    assert history._tags == {} and len(history._watermarks) == 1  # nothing accumulates across windows
    windows = [c for c in got if c[r.R_NAME] == n.EVENTS_SPAN]
    assert len(windows) == 50  # one per window's request, none for the requests outside windows
    assert all(c[r.R_ATTRS][n.action_count("alloc")] == len(sizes) for c in windows)


@pytest.mark.parametrize("clear_on_disable", [True, False])
def test_entries_of_an_earlier_window_are_not_read_again(clear_on_disable):
    fake = FakeCudaMemory()
    fake.clear_on_disable = clear_on_disable
    rec, history, got = _setup(fake)
    first = rec.start("svc/First")
    fake.free(fake.allocate(100))
    first.end()
    history.disable()
    history.enable()
    second = rec.start("svc/Second")
    fake.free(fake.allocate(200))
    second.end()
    history.drain()
    for span, size in ((first, 100), (second, 200)):
        (child,) = _children(got, span)
        assert child[r.R_ATTRS][n.action_bytes("alloc")] == size
        assert child[r.R_ATTRS][n.action_count("alloc")] == 1
    assert history.stats.unattributed == 0


def test_history_defaults_are_python_stacks_and_a_bounded_ring():
    """C07 (defaults): Python-only stacks and a bounded ring buffer unless configured otherwise."""
    cfg = GpuTelemetryConfig.from_env({"ZOOMER_GPU_MEMORY_HISTORY": "true"})
    assert cfg.history and cfg.history_stacks == "python" and cfg.history_max_entries == 10_000
    fake = FakeCudaMemory()
    gpu = install_gpu_telemetry(cfg, RequestRecorder(otel_context=False), None, memory_source=fake,
                                nvml=_no_nvml())
    try:
        assert fake.history_calls == [(True, "python", 10_000)]
    finally:
        gpu.shutdown()
    assert fake.history_calls[-1][0] is False  # shutdown stops the recording it started


def test_snapshot_in_a_busy_server_is_written_off_the_request_path_within_its_budget(tmp_path):
    """C07: history on, requests flowing on other threads, a snapshot is asked for: it is taken and written
    by a worker thread while requests keep completing, and the pickle has the structure memory_viz reads."""
    fake = FakeCudaMemory(limit_bytes=1 << 40)
    rec, history, got = _setup(fake)
    fake.snapshot_delay_s = 0.3  # a slow snapshot: requests must not wait for it
    stop = threading.Event()
    done = [0]

    def serve() -> None:
        while not stop.is_set():
            span = rec.start("svc/M")
            fake.free(fake.allocate(4096))
            span.end()
            done[0] += 1
            time.sleep(0.001)

    worker = threading.Thread(target=serve)
    worker.start()
    try:
        before = done[0]
        result = history.dump_snapshot(tmp_path / "snap" / "memory.pickle", timeout_s=10)
        during = done[0] - before
    finally:
        stop.set()
        worker.join()
    assert during > 0  # requests completed while the snapshot was being taken
    assert result.path.is_file() and result.bytes == result.path.stat().st_size > 0
    with open(result.path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}
    entry = snap["device_traces"][0][-1]
    assert set(entry) >= {"action", "addr", "size", "stream", "time_us", "user_metadata", "frames"}
    assert result.trace_entries == sum(len(t) for t in snap["device_traces"])


@pytest.mark.slow
def test_a_failed_snapshot_is_an_error_and_a_hung_one_times_out_without_leaving_a_file(tmp_path):
    """C07: a failing dump raises SnapshotError, an empty one too, a hanging one SnapshotTimeout within its
    budget (and its partial file is removed when the worker finishes)."""
    fake = FakeCudaMemory()
    history = AllocationHistory(fake)
    with pytest.raises(SnapshotError, match="empty memory snapshot"):
        history.dump_snapshot(tmp_path / "empty.pickle", timeout_s=5)
    history.enable()
    fake.allocate(10)
    fake.snapshot_error = RuntimeError("CUDA error: an illegal memory access")
    with pytest.raises(SnapshotError, match="illegal memory access"):
        history.dump_snapshot(tmp_path / "failed.pickle", timeout_s=5)
    fake.snapshot_error = None
    fake.snapshot_delay_s = 1.0
    with pytest.raises(SnapshotTimeout):
        history.dump_snapshot(tmp_path / "slow.pickle", timeout_s=0.1)
    for worker in [t for t in threading.enumerate() if t.name == "zoomer-gpu-snapshot"]:
        worker.join(30)  # the abandoned worker finishes and cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_history_starts_only_once_cuda_is_initialised():
    fake = FakeCudaMemory()
    fake.initialized = False
    cfg = GpuTelemetryConfig(mode="on", history=True)
    gpu = install_gpu_telemetry(cfg, RequestRecorder(otel_context=False), None, memory_source=fake,
                                nvml=_no_nvml())
    try:
        assert fake.history_calls == []
        fake.initialized = True
        gpu.tick_arm()
        assert fake.history_calls == [(True, "python", 10_000)]
    finally:
        gpu.shutdown()


def _no_nvml() -> FakeNvml:
    nvml = FakeNvml()
    nvml.fail[("*", "nvmlInit")] = 12  # NVML_ERROR_LIBRARY_NOT_FOUND
    return nvml


def test_grpc_requests_get_allocation_event_children_in_the_store(telemetry, collector):
    from test_gpu_memory import SERVICE, _gpu_server

    fake = FakeCudaMemory(limit_bytes=1 << 40)
    cfg = GpuTelemetryConfig(mode="on", history=True, history_drain_ms=50, history_top_events=3)
    gpu = attach_gpu_telemetry(telemetry, cfg, memory_source=fake, nvml=_no_nvml())
    assert gpu is not None and gpu.history is not None and gpu.history.recording
    server, target = _gpu_server(fake)
    try:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary(f"/{SERVICE}/Work")
            for size in (MiB, 2 * MiB, 3 * MiB):
                assert call(b"alloc:%d" % size, timeout=10) == b"ok"
    finally:
        server.stop(None)
    spans = collector.spans()
    requests = [s for s in spans if s["name"] == f"{SERVICE}/Work"]
    children = [s for s in spans if s["name"] == n.EVENTS_SPAN]
    assert len(requests) == 3 and len(children) == 3
    by_parent = {c["parent_span_id"]: c for c in children}
    for req, size in zip(requests, (MiB, 2 * MiB, 3 * MiB)):
        child = by_parent[req["span_id"]]
        assert child["trace_id"] == req["trace_id"]
        assert child["attributes"][n.action_count("alloc")] == 1
        assert child["attributes"][n.action_bytes("alloc")] == size
        assert child["attributes"][n.action_bytes("free_completed")] == size
        assert 1 <= len(child["events"]) <= 3
        assert all(e["name"] == n.EVENT_NAME for e in child["events"])
