"""The merged timeline (``zoomer-serve analyze --perfetto``) and the trace time base it rests on (case C19):
Kineto traces of PyTorch >= 2.4 carry ``baseTimeNanoseconds`` and relative ``ts``; older ones epoch ``ts``.
Request spans from a real store, real traces (a CPU trace captured here with the pinned torch, and the shared
A100 trace), written as TrackEvent protobuf and as Chrome JSON, read back the way Perfetto pairs slices."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zoomer_serve.analysis import analyze
from zoomer_serve.analysis import labels as L
from zoomer_serve.analysis.kineto import load_trace, load_trace_bytes
from zoomer_serve.analysis.perfetto import (
    assign_lanes,
    linked_requests,
    ranges_outside_spans,
    read_timeline,
    write_perfetto,
)
from zoomer_serve.analysis.store import load_store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_analysis_store import MS, Req, normal, record_replica

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
EVENT_SYNC = KINETO / "a100_cuda_event_sync.json.gz"
needs_kineto = pytest.mark.skipif(not EVENT_SYNC.is_file(), reason=f"real Kineto traces not found at {KINETO}")
TOLERANCE_NS = 1_000_000  # 1 ms
FORMATS = ("merged.pftrace", "merged.pftrace.gz", "merged.json.gz")


def requests_inside_their_spans(path: Path) -> int:
    """Check that every request slice linked by a flow to a profiler range holds that range within 1 ms
    (the range is the one named for the request); returns how many were checked."""
    tl = read_timeline(path)
    for req, rng in linked_requests(tl):
        assert rng.name == L.request_label(req.args["trace_id"], req.args["span_id"])
    checked, outside = ranges_outside_spans(tl, TOLERANCE_NS)
    assert outside == []
    return checked


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.slow
def test_a_trace_of_the_pinned_torch_has_a_time_base_and_lines_up_with_its_requests(
        telemetry: Any, collector: Any, tmp_path: Path, torch: Any) -> None:
    """C19 end to end on CPU: the demo model server with the profiling controller records a real
    torch.profiler trace of 8 requests. The trace has ``baseTimeNanoseconds`` and small relative ``ts``; its
    Unix times fall inside the wall-clock window of the session; in the merged timeline (protobuf and JSON)
    every profiled request's range lies inside its span within 1 ms."""
    from _profiling_support import serve_with_profiling, traces

    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.demo.model import build_model
    from zoomer_serve.profiling import SessionOptions

    torch.set_num_threads(1)
    model = build_model(device="cpu")
    before_ns = time.time_ns()
    with serve_with_profiling(telemetry, model, tmp_path / "profiles") as served:
        served.controller.start(SessionOptions(max_requests=8))
        drive_load(served.target, 30.0, max_requests=24, clients=2, batch_size=8)
        assert served.controller.wait_idle(60)
    after_ns = time.time_ns()
    [trace_path] = traces(tmp_path / "profiles")
    collector.finish()

    raw = json.loads(gzip.decompress(trace_path.read_bytes()))
    assert isinstance(raw.get("baseTimeNanoseconds"), int)
    first_ts = min(e["ts"] for e in raw["traceEvents"] if e.get("ph") == "X")
    assert first_ts < 1e15  # relative: read as epoch microseconds it would be years off

    result = analyze([trace_path], collector.store_path)
    trace = result.traces[0].trace
    assert trace.base_time_ns == raw["baseTimeNanoseconds"] and trace.warnings == []
    cpu = trace.cpu_ops
    starts = trace.unix_ns(cpu["ts"])
    ends = trace.unix_ns(cpu["ts"] + cpu["dur"])
    assert before_ns <= int(starts.min()) and int(ends.max()) <= after_ns

    per_request = result.traces[0].tables["request_gpu_time"]
    assert len(per_request) == 8
    assert np.all(per_request["cpu_time_us"] > 0) and np.all(per_request["gpu_ops"] == 0)  # CPU only
    assert len(trace.cpu_ops) > 0 and len(trace.kernels) == 0
    assert not [f for f in result.findings if f.id.startswith(("gpu.", "cuda."))]
    stored = set(zip(result.store.requests["trace_id"].tolist(), result.store.requests["span_id"].tolist()))
    assert set(zip(per_request["trace_id"].tolist(), per_request["span_id"].tolist())) <= stored
    for name in FORMATS:
        out = tmp_path / name
        counts = write_perfetto(out, [trace], result.store)
        assert counts["linked_requests"] == 8
        assert requests_inside_their_spans(out) == 8
    # read as the analysis did before it knew the time base, the ranges sit about two months off
    epoch_misread = dataclasses.replace(trace, base_time_ns=0)
    write_perfetto(tmp_path / "misread.pftrace", [epoch_misread], result.store)
    checked, outside = ranges_outside_spans(read_timeline(tmp_path / "misread.pftrace"))
    assert checked == 8 and len(outside) == 8


@pytest.mark.slow
@needs_kineto
def test_a_trace_without_a_time_base_keeps_its_epoch_times(collector: Any, tmp_path: Path) -> None:
    """The shared 2024 A100 trace has no ``baseTimeNanoseconds``: its ``ts`` are epoch microseconds, so its
    first kernel stays at 1707417525512145 us; a request labelled in a copy of it is linked to its span and
    lies inside it."""
    trace_start_ns = 1707417525509335 * 1000
    record_replica(collector, "fast", normal(25, 1), trace_start_ns - 100 * MS)
    collector.finish()
    store = load_store(collector.store_path)
    req = store.requests
    i = int(np.flatnonzero(req["start_ns"] >= trace_start_ns)[0])
    doc = json.loads(gzip.decompress(EVENT_SYNC.read_bytes()))
    assert "baseTimeNanoseconds" not in doc
    start_us = req["start_ns"][i] / 1000.0
    doc["traceEvents"].append({"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 1, "ts": start_us + 100.0,
                               "dur": 500.0, "name": L.request_label(req["trace_id"][i], req["span_id"][i])})
    linked = tmp_path / "linked.json"
    linked.write_text(json.dumps(doc))
    trace = load_trace(linked)
    assert trace.base_time_ns == 0
    for name in FORMATS:
        out = tmp_path / name
        counts = write_perfetto(out, [trace], store)
        assert counts["linked_requests"] == 1 and counts["requests"] == 25
        assert requests_inside_their_spans(out) == 1
        tl = read_timeline(out)
        kernels = [s for s in tl.slices if s.category == "kernel"]
        assert len(kernels) == 4
        assert min(s.start_ns for s in kernels) == 1707417525512145 * 1000


@needs_kineto
def test_all_requests_are_drawn_when_none_overlap_the_trace(collector: Any, tmp_path: Path) -> None:
    """A store recorded at another time than the trace: the merged timeline still holds every request."""
    record_replica(collector, "early", [Req([("forward", 1.0)])], 1_700_000_000_000_000_000)
    collector.finish()
    counts = write_perfetto(tmp_path / "m.pftrace", [load_trace(EVENT_SYNC)], load_store(collector.store_path))
    assert counts["requests"] == 1 and counts["linked_requests"] == 0
    assert len([s for s in read_timeline(tmp_path / "m.pftrace").slices if s.category == "request"]) == 1


def _events(base: int | None, ts: list[float], extra: dict[str, Any] | None = None) -> bytes:
    doc: dict[str, Any] = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": f"op{k}", "pid": 1, "tid": 1,
                                            "ts": t, "dur": 1.5} for k, t in enumerate(ts)]}
    if base is not None:
        doc["baseTimeNanoseconds"] = base
    doc.update(extra or {})
    return json.dumps(doc).encode()


def test_base_time_turns_relative_ts_into_unix_ns() -> None:
    """C19: Unix ns = baseTimeNanoseconds + ts * 1000, to the nanosecond (the figures of the pinned torch:
    base 1790857026000000000, ts about 5.27e12 us)."""
    base = 1_790_857_026_000_000_000
    t = load_trace_bytes(_events(base, [5_279_820_895_713.681, 5_279_820_898_329.119]))
    assert t.base_time_ns == base and t.warnings == []
    assert t.origin_unix_ns == base + 5_279_820_895_713_681
    assert t.unix_ns(t.cpu_ops["ts"]).tolist() == [base + 5_279_820_895_713_681, base + 5_279_820_898_329_119]
    assert t.summary()["start_unix_ns"] == t.origin_unix_ns
    old = load_trace_bytes(_events(None, [1_707_417_525_512_145.0]))
    assert old.base_time_ns == 0 and int(old.unix_ns(0.0)) == 1_707_417_525_512_145_000


@pytest.mark.parametrize("base, ts, warning", [
    (1_790_857_026_000_000_000, 1_707_417_525_512_145.0, "already Unix epoch microseconds"),
    ("soon", 5.0, "not a Unix time"),
    (-5, 5.0, "not a Unix time"),
])
def test_an_unusable_time_base_is_ignored_with_a_warning(base: Any, ts: float, warning: str) -> None:
    t = load_trace_bytes(_events(0, [ts], {"baseTimeNanoseconds": base}))
    assert t.base_time_ns == 0
    assert len(t.warnings) == 1 and warning in t.warnings[0]


def test_overlapping_requests_and_kernels_get_lanes_and_every_track_nests(collector: Any, tmp_path: Path) -> None:
    """Concurrent requests of one replica, and two kernels whose times overlap on one stream, go on extra
    lanes of their track: the file reads back with every begin matched by its end, nothing dropped."""
    base = 1_790_857_026_000_000_000
    t0_ns = base + 5_000_000_000
    record_replica(collector, "r1", [Req([("forward", 15.0)]) for _ in range(4)], t0_ns)  # 10 ms apart, 15.5 long
    collector.finish()
    store = load_store(collector.store_path)
    ts0 = 5_000_000.0  # us after the base: the first request's start
    events = [
        {"ph": "X", "cat": "kernel", "name": "k1", "pid": 0, "tid": 7, "ts": ts0 + 10, "dur": 5.0,
         "args": {"device": 0, "stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": ts0 + 14.999, "dur": 5.0,
         "args": {"device": 0, "stream": 7, "correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": ts0 + 1, "dur": 3.0,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": ts0 + 5, "dur": 3.0,
         "args": {"correlation": 2}},
    ]
    trace = load_trace_bytes(json.dumps({"baseTimeNanoseconds": base, "traceEvents": events}).encode())
    for name in FORMATS:
        out = tmp_path / name
        counts = write_perfetto(out, [trace], store)
        tl = read_timeline(out)
        requests = [s for s in tl.slices if s.category == "request"]
        phases = [s for s in tl.slices if s.category == "phase"]
        kernels = sorted((s for s in tl.slices if s.category == "kernel"), key=lambda s: s.start_ns)
        assert counts["requests"] == len(requests) == 4 and len(phases) == 4
        assert sorted(s.start_ns - t0_ns for s in requests) == [0, 10 * MS, 20 * MS, 30 * MS]
        assert len({s.track for s in requests}) == 2  # two lanes: each request overlaps the next
        assert kernels[0].track != kernels[1].track and kernels[1].start_ns == base + round((ts0 + 14.999) * 1000)
        launches = {fid for s in tl.slices if s.name == "cudaLaunchKernel" for fid in s.flows_out}
        assert launches == {fid for k in kernels for fid in k.flows_in} and len(launches) == 2


def test_lanes_nest_and_are_first_fit() -> None:
    rnd = random.Random(20)
    for _ in range(50):
        n = rnd.randint(1, 60)
        iv = sorted(((s := rnd.randint(0, 100)), s + rnd.randint(0, 40)) for _ in range(n))
        iv.sort(key=lambda x: (x[0], -x[1]))
        lanes = assign_lanes(iv)
        for lane in set(lanes):
            mine = [iv[k] for k in range(n) if lanes[k] == lane]
            for a in mine:
                for b in mine:
                    disjoint = a[1] <= b[0] or b[1] <= a[0]
                    nested = (a[0] <= b[0] and b[1] <= a[1]) or (b[0] <= a[0] and a[1] <= b[1])
                    assert disjoint or nested, (a, b)
    assert assign_lanes([(0, 10), (2, 5), (5, 10), (8, 12), (12, 13)]) == [0, 0, 0, 1, 0]


@pytest.mark.slow
def test_gpu_check_runs_the_timeline_rows_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py --cpu: a CPU profiling session of the demo server, then step 7 (batching) and step
    9 (C19) up to their CUDA-only rows: the batches' operators shared out in full, every covered request's range
    inside its span, the kernel and GPU memory rows marked not checked."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--cpu", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    inside = [line for line in proc.stdout.splitlines() if "ranges inside their spans" in line]
    assert len(inside) == 1 and "12 of 12" in inside[0] and inside[0].rstrip().endswith("PASS")
    assert "needs CUDA: not checked" in proc.stdout and "FAIL" not in proc.stdout
    shares = [line for line in proc.stdout.splitlines() if "shares of the CPU operators" in line]
    assert len(shares) == 1 and "(100.0%)" in shares[0] and shares[0].rstrip().endswith("PASS")
    assert (tmp_path / "merged.pftrace").is_file()
