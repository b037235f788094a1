"""Per-request GPU memory and OOMs: the real observer and recorder over the fake CUDA memory source, and a
real gRPC server exporting through real OTLP into the embedded collector."""

from __future__ import annotations

import logging
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from interceptors import ZoomerServerInterceptor
from zoomer_serve.recording import RequestRecorder, Sampler, internal_error_counts
from zoomer_serve.recording import records as r
from zoomer_serve.telemetry import GpuMemoryObserver, GpuTelemetryConfig, attach_gpu_telemetry
from zoomer_serve.telemetry import names as n
from zoomer_serve.telemetry.gpu import install_gpu_telemetry

sys.path.insert(0, str(Path(__file__).parent))
from _fake_gpu import SEGMENT, FakeCudaMemory, FakeOutOfMemoryError

MiB = 1 << 20


def _recorder(sampler: Sampler | None = None):
    got: list = []
    return RequestRecorder(sink=got.append, sampler=sampler, otel_context=False), got


def _observer(fake: FakeCudaMemory, devices=(0,), peak=True):
    rec, got = _recorder()
    obs = GpuMemoryObserver(fake, devices, peak=peak)
    rec.add_observer(obs)
    return rec, got, obs


def _attrs(record):
    return record[r.R_ATTRS]


def test_one_request_alone_gets_exact_allocated_reserved_peak_and_counter_deltas():
    fake = FakeCudaMemory()
    keep = fake.allocate(1000)  # before the request: 1000 B allocated, one 2 MiB segment
    rec, got, _ = _observer(fake)
    span = rec.start("svc/M")
    tmp = fake.allocate(3 * MiB)  # needs a new segment: one more cudaMalloc
    out = fake.allocate(512)
    fake.free(tmp)
    span.end()
    a = _attrs(got[0])
    assert a[n.GPU_DEVICES] == [0]
    assert a[n.MEM_ALLOCATED_START] == 1000
    assert a[n.MEM_ALLOCATED_END] == 1000 + 512
    assert a[n.MEM_RESERVED_START] == SEGMENT
    assert a[n.MEM_RESERVED_END] == SEGMENT + 4 * MiB
    assert a[n.MEM_PEAK] == 1000 + 3 * MiB + 512
    assert a[n.MEM_PEAK_SHARED] is False
    assert a[n.MEM_DEVICE_ALLOCS] == 1
    assert a[n.MEM_ALLOC_RETRIES] == 0 and a[n.MEM_OOMS] == 0
    fake.free(out)
    fake.free(keep)


def test_peak_is_the_requests_own_even_after_a_bigger_earlier_peak():
    fake = FakeCudaMemory()
    rec, got, _ = _observer(fake)
    big = fake.allocate(100 * MiB)  # the process peak before any request
    fake.free(big)
    span = rec.start("svc/M")
    x = fake.allocate(MiB)
    fake.free(x)
    span.end()
    assert _attrs(got[0])[n.MEM_PEAK] == MiB  # not 100 MiB: reset at the request's start


def test_overlapping_requests_get_the_device_peak_over_their_window_and_are_marked_shared():
    fake = FakeCudaMemory()
    rec, got, _ = _observer(fake)
    a = rec.start("svc/A")
    xa = fake.allocate(10 * MiB)           # A alone: device at 10 MiB
    b = rec.start("svc/B")                 # B starts: device at 10 MiB
    xb = fake.allocate(30 * MiB)           # device at 40 MiB (inside both windows)
    fake.free(xb)
    b.end()                                # B's window saw 40 MiB
    fake.free(xa)
    c = rec.start("svc/C")                 # C starts after B ended but while A runs
    xc = fake.allocate(5 * MiB)
    fake.free(xc)
    c.end()
    a.end()
    d = rec.start("svc/D")                 # D alone, after everything
    xd = fake.allocate(2 * MiB)
    fake.free(xd)
    d.end()
    by_name = {rec_[r.R_NAME]: _attrs(rec_) for rec_ in got}
    assert by_name["svc/B"][n.MEM_PEAK] == 40 * MiB and by_name["svc/B"][n.MEM_PEAK_SHARED] is True
    assert by_name["svc/A"][n.MEM_PEAK] == 40 * MiB and by_name["svc/A"][n.MEM_PEAK_SHARED] is True
    # C overlapped only A, after the 40 MiB spike: its window's device peak is 5 MiB, not 40
    assert by_name["svc/C"][n.MEM_PEAK] == 5 * MiB and by_name["svc/C"][n.MEM_PEAK_SHARED] is True
    assert by_name["svc/D"][n.MEM_PEAK] == 2 * MiB and by_name["svc/D"][n.MEM_PEAK_SHARED] is False


def test_overlapping_requests_from_threads_each_see_at_least_their_own_allocation():
    fake = FakeCudaMemory(limit_bytes=1 << 40)
    rec, got, _ = _observer(fake)
    barrier = threading.Barrier(4)

    def work(size: int) -> None:
        span = rec.start(f"svc/{size}")
        barrier.wait()
        x = fake.allocate(size * MiB)
        barrier.wait()
        fake.free(x)
        span.end()

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4
    for record in got:
        a = _attrs(record)
        assert a[n.MEM_PEAK_SHARED] is True
        assert a[n.MEM_PEAK] == 10 * MiB  # all four were allocated at once, inside every window


def test_unsampled_requests_are_counted_not_read_and_make_sampled_ones_shared():
    fake = FakeCudaMemory()
    rec, got = _recorder(Sampler("traceidratio", 0.0))
    obs = GpuMemoryObserver(fake, (0,))
    rec.add_observer(obs)
    resets = fake.reset_calls
    unsampled = rec.start("svc/U")
    assert fake.reset_calls == resets  # nothing read or reset for an unsampled request
    rec.sampler = Sampler("always_on")
    sampled = rec.start("svc/S")
    x = fake.allocate(MiB)
    fake.free(x)
    sampled.end()
    unsampled.end()
    s_attrs = {rec_[r.R_NAME]: _attrs(rec_) for rec_ in got}
    assert n.MEM_PEAK not in s_attrs["svc/U"]
    assert s_attrs["svc/S"][n.MEM_PEAK_SHARED] is True


def test_several_devices_give_sums_and_per_device_lists():
    fake = FakeCudaMemory(devices=2)
    rec, got, _ = _observer(fake, devices=(0, 1))
    span = rec.start("svc/M")
    x0 = fake.allocate(MiB, device=0)
    x1 = fake.allocate(3 * MiB, device=1)
    fake.free(x0, device=0)
    span.end()
    a = _attrs(got[0])
    assert a[n.GPU_DEVICES] == [0, 1]
    assert a[n.MEM_ALLOCATED_END + n.BY_DEVICE_SUFFIX] == [0, 3 * MiB]
    assert a[n.MEM_ALLOCATED_END] == 3 * MiB
    assert a[n.MEM_PEAK + n.BY_DEVICE_SUFFIX] == [MiB, 3 * MiB]
    assert a[n.MEM_PEAK] == 4 * MiB
    assert a[n.MEM_DEVICE_ALLOCS + n.BY_DEVICE_SUFFIX] == [1, 1]
    fake.free(x1, device=1)


def _overlapping_script(devices: int, peak: bool) -> dict[str, dict]:
    """Overlapping sampled requests, an unsampled one, a cudaMalloc, an allocator retry and an OOM, all on
    device 0 of a fake with ``devices`` devices, watched with ``devices=range(devices)``. Returns the
    attributes by span name."""
    fake = FakeCudaMemory(devices=devices, limit_bytes=63 * MiB)
    rec, got = _recorder()
    obs = GpuMemoryObserver(fake, tuple(range(devices)), peak=peak)
    obs.utilization = {0: 0.25}
    rec.add_observer(obs)
    keep = fake.allocate(MiB)                      # before any request: 1 MiB in one 2 MiB segment
    a = rec.start("svc/A")
    xa = fake.allocate(10 * MiB)                   # a new segment
    rec.sampler = Sampler("traceidratio", 0.0)
    u = rec.start("svc/U")                         # unsampled: only counted
    rec.sampler = Sampler("always_on")
    b = rec.start("svc/B")
    xb = fake.allocate(30 * MiB)                   # device at 41 MiB, inside A's and B's windows
    fake.free(xb)
    b.end()
    u.end()
    c = rec.start("svc/C")                         # overlaps A only, after the 41 MiB spike
    with pytest.raises(FakeOutOfMemoryError):
        fake.allocate(100 * MiB)                   # num_ooms + 1
    c.end()
    fake.free(xa)
    a.end()
    fake.empty_cache()                             # reserved = allocated = 1 MiB
    d = rec.start("svc/D")                         # alone
    big = fake.allocate(59 * MiB)                  # a 60 MiB segment: reserved 61 MiB
    extra = fake.allocate(2 * MiB + MiB // 2)      # a 4 MiB segment would pass 63 MiB: num_alloc_retries + 1
    fake.free(big)
    fake.free(extra)
    d.end()
    e = rec.start("svc/E")
    fake.free(fake.allocate(5 * MiB))              # E's peak, before F: E has it from F's start boundary
    f = rec.start("svc/F")                         # E learns that it shares the device only from F's start
    f.end()
    e.end()
    fake.free(keep)
    return {record[r.R_NAME]: _attrs(record) for record in got}


@pytest.mark.parametrize("peak", [True, False])
def test_the_one_device_path_sets_what_the_several_device_path_gives_for_that_device(peak):
    """One watched device takes a path of its own (no per-device lists); the same requests watched with a
    second, idle device (the general path) give the same sums, and the same figures in ``.by_device[0]``."""
    one = _overlapping_script(devices=1, peak=peak)
    two = _overlapping_script(devices=2, peak=peak)
    assert set(one) == set(two) == {"svc/A", "svc/B", "svc/C", "svc/D", "svc/E", "svc/F", "svc/U"}
    assert not any(k.startswith("zoomer.gpu") for k in one["svc/U"])  # unsampled: nothing read or set
    figures = [n.MEM_ALLOCATED_START, n.MEM_ALLOCATED_END, n.MEM_RESERVED_START, n.MEM_RESERVED_END,
               n.MEM_ALLOC_RETRIES, n.MEM_OOMS, n.MEM_DEVICE_ALLOCS] + ([n.MEM_PEAK] if peak else [])
    for name in ("svc/A", "svc/B", "svc/C", "svc/D", "svc/E", "svc/F"):
        o, t = one[name], two[name]
        assert o[n.GPU_DEVICES] == [0] and t[n.GPU_DEVICES] == [0, 1]
        assert set(o) == set(figures) | {n.GPU_DEVICES, n.GPU_UTILIZATION} | ({n.MEM_PEAK_SHARED} if peak else set())
        for key in figures:
            assert o[key] == t[key] == t[key + n.BY_DEVICE_SUFFIX][0], (name, key)
            assert t[key + n.BY_DEVICE_SUFFIX][1] == 0
        assert o[n.GPU_UTILIZATION] == t[n.GPU_UTILIZATION] == 0.25
        if peak:
            assert o[n.MEM_PEAK_SHARED] is t[n.MEM_PEAK_SHARED]
    # the script does reach every figure (the comparison above is not between zeros)
    assert one["svc/A"][n.MEM_DEVICE_ALLOCS] == 2 and one["svc/C"][n.MEM_OOMS] == 1
    assert one["svc/D"][n.MEM_ALLOC_RETRIES] == 1
    if peak:
        assert {x: one[f"svc/{x}"][n.MEM_PEAK] for x in "ABCDEF"} == {
            "A": 41 * MiB, "B": 41 * MiB, "C": 11 * MiB, "D": 62 * MiB + MiB // 2, "E": 6 * MiB, "F": MiB}
        assert {x: one[f"svc/{x}"][n.MEM_PEAK_SHARED] for x in "ABCDEF"} == {
            "A": True, "B": True, "C": True, "D": False, "E": True, "F": True}


def test_without_the_peak_no_reset_happens_and_no_peak_attribute():
    fake = FakeCudaMemory()
    rec, got, _ = _observer(fake, peak=False)
    span = rec.start("svc/M")
    span.end()
    assert fake.reset_calls == 0
    assert n.MEM_PEAK not in _attrs(got[0]) and n.MEM_ALLOCATED_END in _attrs(got[0])


def test_a_broken_source_is_counted_and_the_request_still_ends():
    class Broken(FakeCudaMemory):
        def counters(self, device):
            raise RuntimeError("driver went away")

    rec, got, _ = _observer(Broken())
    span = rec.start("svc/M")
    assert span.end() is True
    assert len(got) == 1
    assert internal_error_counts().get("observer.on_start:GpuMemoryObserver", 0) >= 1


def test_oom_in_a_request_marks_its_span_counts_it_and_the_next_request_is_served():
    fake = FakeCudaMemory(limit_bytes=64 * MiB)
    rec, got = _recorder()
    gpu = install_gpu_telemetry(GpuTelemetryConfig(mode="on"), rec, None, memory_source=fake, nvml=_no_nvml())
    try:
        span = rec.start("svc/Big")
        span.activate()
        with pytest.raises(FakeOutOfMemoryError):
            fake.allocate(100 * MiB)
        span.deactivate()  # the handler caught the OOM and answered
        span.end()
        ok = rec.start("svc/Small")
        ok.activate()
        x = fake.allocate(MiB)
        fake.free(x)
        ok.deactivate()
        ok.end()
    finally:
        gpu.shutdown()
    big, small = got
    (event,) = [e for e in big[r.R_EVENTS] if e[1] == n.OOM_EVENT]
    assert event[2] == {n.OOM_DEVICE: 0, n.OOM_REQUESTED_BYTES: 100 * MiB, n.OOM_DEVICE_FREE_BYTES: 64 * MiB,
                        n.OOM_DEVICE_LIMIT_BYTES: 64 * MiB}
    assert big[r.R_STATUS] == r.STATUS_ERROR and "CUDA out of memory" in big[r.R_STATUS_MSG]
    assert _attrs(big)["error.type"] == n.OOM_ERROR_TYPE
    assert _attrs(big)[n.MEM_OOMS] == 1
    assert small[r.R_STATUS] == r.STATUS_UNSET and _attrs(small)[n.MEM_OOMS] == 0
    assert gpu.observer.oom_count == 1


def test_oom_outside_any_request_is_counted_and_logged_once(caplog):
    fake = FakeCudaMemory(limit_bytes=MiB)
    rec, _got = _recorder()
    gpu = install_gpu_telemetry(GpuTelemetryConfig(mode="on"), rec, None, memory_source=fake, nvml=_no_nvml())
    try:
        with caplog.at_level(logging.WARNING, logger="zoomer_serve.telemetry"):
            for _ in range(3):
                with pytest.raises(FakeOutOfMemoryError):
                    fake.allocate(2 * MiB)
    finally:
        gpu.shutdown()
    assert gpu.observer.oom_count == 3 and gpu.observer.oom_unattributed == 3
    assert len([m for m in caplog.messages if "outside any request" in m]) == 1


def test_oom_observer_waits_until_the_application_initialises_cuda():
    fake = FakeCudaMemory(limit_bytes=MiB)
    fake.initialized = False
    rec, _got = _recorder()
    gpu = install_gpu_telemetry(GpuTelemetryConfig(mode="on"), rec, None, memory_source=fake, nvml=_no_nvml())
    try:
        assert gpu.armed is False and fake._oom_callbacks == []
        fake.initialized = True
        gpu.tick_arm()
        assert gpu.armed is True and fake._oom_callbacks == [gpu.observer.on_oom]
        assert gpu.observer.device_attributes[0] == {n.HW_TYPE: "gpu", n.HW_ID: "GPU-fake-0000"}
    finally:
        gpu.shutdown()
    assert fake._oom_callbacks == []  # detached on shutdown


def _no_nvml():
    from _fake_gpu import FakeNvml

    nvml = FakeNvml()
    nvml.fail[("*", "nvmlInit")] = 12  # NVML_ERROR_LIBRARY_NOT_FOUND
    return nvml


# -- end to end: real gRPC server, real OTLP export, embedded collector -----------------------------------
SERVICE = "test.Gpu"


def _gpu_server(fake: FakeCudaMemory):
    def work(request: bytes, context: grpc.ServicerContext) -> bytes:
        cmd, _, arg = request.partition(b":")
        if cmd == b"alloc":
            x = fake.allocate(int(arg))
            fake.free(x)
            return b"ok"
        if cmd == b"oom":
            try:
                fake.allocate(int(arg))
            except FakeOutOfMemoryError:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of GPU memory")
        return b"noop"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[ZoomerServerInterceptor()],
                         options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Work": grpc.unary_unary_rpc_method_handler(work)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_grpc_requests_carry_memory_attributes_and_an_oom_is_reported_in_the_store(telemetry, collector):
    fake = FakeCudaMemory(limit_bytes=256 * MiB)
    gpu = attach_gpu_telemetry(telemetry, GpuTelemetryConfig(mode="on"), memory_source=fake, nvml=_no_nvml())
    others = tuple(o for o in telemetry.recorder.observers if o is not getattr(telemetry.host, "request_cpu", None))
    assert gpu is not None and others == (gpu.observer,)  # the host's CPU time observer may be there too
    server, target = _gpu_server(fake)
    try:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary(f"/{SERVICE}/Work")
            for size in (MiB, 8 * MiB, 3 * MiB):
                assert call(b"alloc:%d" % size, timeout=10) == b"ok"
            with pytest.raises(grpc.RpcError) as err:
                call(b"oom:%d" % (512 * MiB), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert call(b"alloc:%d" % MiB, timeout=10) == b"ok"  # still serving
    finally:
        server.stop(None)
    spans = [s for s in collector.spans() if s["name"] == f"{SERVICE}/Work"]
    assert len(spans) == 5
    peaks = [s["attributes"][n.MEM_PEAK] for s in spans]
    assert peaks == [MiB, 8 * MiB, 3 * MiB, 0, MiB]
    assert all(s["attributes"][n.MEM_PEAK_SHARED] is False for s in spans)
    oom = spans[3]
    assert oom["status_code"] == "ERROR"
    assert oom["attributes"]["error.type"] == n.OOM_ERROR_TYPE
    assert oom["attributes"][n.MEM_OOMS] == 1
    (event,) = [e for e in oom["events"] if e["name"] == n.OOM_EVENT]
    assert event["attributes"][n.OOM_REQUESTED_BYTES] == 512 * MiB
    points = collector.metric_points(n.GPU_OOM_COUNT)
    assert points and points[-1]["value"] == 1
    assert points[-1]["attributes"][n.HW_ID] == "GPU-fake-0000"
