"""Kernel profiling of batches: a batch's range and member markers in the trace, and the trace summary that gives
each member its share of the batch's kernels (a synthetic trace with GPU events) and operators (a real CPU
profiling session on the batching demo server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from _profiling_support import (
    bounded_session_with_strays,
    check_profile_export,
    phase_ranges,
    read_chrome_trace,
    request_ranges,
    within,
)

from interceptors import ZoomerServerInterceptor
from zoomer_serve.demo.load import drive_load
from zoomer_serve.demo.model import build_model
from zoomer_serve.demo.service import ServiceConfig, build_server
from zoomer_serve.profiling import ProfilerConfig, ProfilerController, SessionOptions, request_label
from zoomer_serve.profiling.labels import (
    batch_label,
    member_label,
    parse_batch_label,
    parse_member_label,
    parse_request_label,
)
from zoomer_serve.profiling.summary import summarize_events, summary_from_json, summary_to_json

A, B, C = (0xA1, 0xA2), (0xB1, 0xB2), (0xC1, 0xC2)  # (trace_id, span_id) of three member requests
BATCH = (0xBA7C4, 0x5BA7C4)


def test_batch_and_member_labels_round_trip() -> None:
    label = batch_label(*BATCH)
    assert label == f"zoomer.batch/{BATCH[0]:032x}/{BATCH[1]:016x}"
    assert parse_batch_label(label) == BATCH and parse_request_label(label) is None
    marker = member_label(BATCH[1], A[0], A[1], 32)
    assert parse_member_label(marker) == (BATCH[1], A[0], A[1], 32)
    assert parse_batch_label(marker) is None and parse_member_label(label) is None
    assert parse_member_label(marker + "x") is None


def _x(name: str, cat: str, ts: float, dur: float, tid: int, pid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def _synthetic_batch_trace() -> list[dict[str, Any]]:
    """Members A (weight 3) and B (weight 1) have their own ranges on threads 1 and 2 (waiting); C (weight 4)
    started before the session (no range of its own). The batch runs on thread 3: two kernels and a copy launched
    inside its range; one more kernel launched outside any range."""
    return [
        _x(request_label(*A), "user_annotation", 0, 1000, tid=1),
        _x(request_label(*B), "user_annotation", 10, 990, tid=2),
        _x(batch_label(*BATCH), "user_annotation", 100, 500, tid=3),
        _x(member_label(BATCH[1], *A, 3), "user_annotation", 101, 0, tid=3),
        _x(member_label(BATCH[1], *B, 1), "user_annotation", 101, 0, tid=3),
        _x(member_label(BATCH[1], *C, 4), "user_annotation", 101, 0, tid=3),
        _x("aten::addmm", "cpu_op", 110, 50, tid=3, **{"External id": 1}),
        _x("cudaLaunchKernel", "cuda_runtime", 120, 10, tid=3, correlation=7),
        _x("aten::relu", "cpu_op", 200, 20, tid=3, **{"External id": 2}),
        _x("cudaLaunchKernel", "cuda_runtime", 205, 10, tid=3, correlation=8),
        _x("cudaMemcpyAsync", "cuda_runtime", 300, 10, tid=3, correlation=9),
        _x("gemm_kernel", "kernel", 130, 80, tid=7, pid=0, correlation=7),
        _x("relu_kernel", "kernel", 215, 40, tid=7, pid=0, correlation=8),
        _x("Memcpy DtoH", "gpu_memcpy", 310, 20, tid=7, pid=0, correlation=9, bytes=4096),
        _x("cudaLaunchKernel", "cuda_runtime", 900, 10, tid=4, correlation=10),  # outside any range
        _x("stray_kernel", "kernel", 920, 8, tid=7, pid=0, correlation=10),
    ]


def test_a_batch_range_shares_its_kernels_among_its_members_by_weight_to_the_last_microsecond() -> None:
    summary = summarize_events(_synthetic_batch_trace())
    assert summary.batches == 1
    assert set(summary.requests) == {A, B, C}  # C gets its share though it has no range of its own
    members = [summary.requests[k] for k in (A, B, C)]
    assert sum(m.kernel_time_us for m in members) == pytest.approx(120.0)  # 100 % of the batch's kernel time
    assert [m.kernel_time_us for m in members] == pytest.approx([45.0, 15.0, 60.0])
    assert sum(m.kernel_count for m in members) == 2 and sum(m.cuda_runtime_count for m in members) == 3
    assert sum(m.memcpy_bytes for m in members) == 4096 and [m.memcpy_bytes for m in members] == [1536, 512, 2048]
    assert sum(m.cpu_op_count for m in members) == 2
    assert sum(m.kernels["gemm_kernel"].time_us for m in members if "gemm_kernel" in m.kernels) == pytest.approx(80)
    assert summary.totals.kernel_time_us == pytest.approx(128.0)
    assert summary.attributed.kernel_time_us == pytest.approx(120.0)  # the stray kernel stays unattributed
    back = summary_from_json(summary_to_json(summary, top_n=10))
    assert back.batches == 1 and back.requests[C].kernel_time_us == pytest.approx(60.0)


def test_an_unfinished_batch_range_or_one_without_markers_is_not_shared() -> None:
    events = [e for e in _synthetic_batch_trace() if not e["name"].startswith("zoomer.batch.member/")]
    summary = summarize_events(events)
    assert summary.batches == 0 and C not in summary.requests
    assert summary.requests[A].kernel_time_us == 0.0
    unfinished = _synthetic_batch_trace()
    unfinished[2]["args"]["finished"] = False
    assert summarize_events(unfinished).batches == 0


@pytest.mark.slow
def test_a_profiling_session_on_the_batching_demo_attributes_every_batch_operator_to_its_members(
        collector: Any, telemetry: Any, tmp_path: Path) -> None:
    """On the CPU there are no kernels: the batch's ATen operators stand for them. Every operator inside a
    batch range goes to the batch's members (the requests its span links), the members' parts of each figure add
    up to the batch's, and every covered request is in the summary."""
    n = 12
    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path / "profiles"), telemetry).attach()
    server, port = build_server(build_model(device="cpu"), interceptors=[ZoomerServerInterceptor(telemetry.recorder)],
                                max_workers=6, config=ServiceConfig(batch_max_size=4, batch_max_delay_ms=10))
    try:
        assert controller.start(SessionOptions(max_requests=n)).session is not None
        result = drive_load(f"127.0.0.1:{port}", 60.0, clients=4, batch_size=8, max_requests=n, stream_share=0.0,
                            invalid_share=0.0)
        assert result.unexpected == 0
        assert controller.wait_idle(120)
    finally:
        controller.close(timeout_s=60)
        server.stop(None).wait(5)
    info = controller.last
    assert info is not None and info.outcome == "done" and info.requests == n, info
    data = read_chrome_trace(Path(info.trace_path))
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    batch_ranges = [e for e in events if e.get("cat") == "user_annotation" and parse_batch_label(e["name"])]
    markers = [parse_member_label(e["name"]) for e in events if e.get("cat") == "user_annotation"
               and parse_member_label(e["name"])]
    assert batch_ranges and len(markers) == n  # every request ran in exactly one batch
    inside = 0
    for b in batch_ranges:
        inside += sum(1 for e in events if e.get("cat") == "cpu_op" and (e["pid"], e["tid"]) == (b["pid"], b["tid"])
                      and b["ts"] <= e["ts"] <= b["ts"] + b["dur"])
    assert inside > 0
    own = summarize_events([e for e in data["traceEvents"]
                            if not str(e.get("name", "")).startswith(("zoomer.batch/", "zoomer.batch.member/"))])
    summary = summarize_events(data["traceEvents"])
    assert summary.batches == len(batch_ranges)
    assert len(summary.requests) == n
    shared = sum(p.cpu_op_count for p in summary.requests.values()) - sum(p.cpu_op_count for p in own.requests.values())
    assert shared == inside  # 100 % of the batches' operators went to requests
    spans = collector.spans()
    check_profile_export(spans, info.session_id, set(summary.requests), "on_demand")
    links = {(link["trace_id"], link["span_id"]) for s in spans if s["name"] == "process ranker" for link in s["links"]}
    assert {(f"{t:032x}", f"{s:016x}") for _, t, s, _ in markers} <= links


def test_the_analysis_gives_each_member_its_share_of_the_batch_gpu_time(tmp_path: Path) -> None:
    import json

    from zoomer_serve.analysis import load_trace, request_gpu_time

    path = tmp_path / "batch.json"
    path.write_text(json.dumps({"traceEvents": _synthetic_batch_trace()}))
    table = request_gpu_time(load_trace(path))
    rows = {(t, s): i for i, (t, s) in enumerate(zip(table["trace_id"].tolist(), table["span_id"].tolist()))}
    hexed = {k: (f"{k[0]:032x}", f"{k[1]:016x}") for k in (A, B, C)}
    assert set(rows) == set(hexed.values())
    gpu = {k: float(table["gpu_time_us"][rows[h]]) for k, h in hexed.items()}
    assert gpu == pytest.approx({A: 52.5, B: 17.5, C: 70.0})  # GPU ops: kernels 80 + 40 and the 20 µs copy, x 3/8 ...
    assert sum(int(table["gpu_ops"][i]) for i in rows.values()) == 3
    assert float(table["batch_gpu_time_us"][rows[hexed[C]]]) == pytest.approx(gpu[C])
    assert float(table["cpu_time_us"][rows[hexed[C]]]) == 0.0


@pytest.mark.slow
def test_a_bounded_session_on_the_batching_demo_records_only_the_batches_serving_its_requests(
        telemetry: Any, tmp_path: Path) -> None:
    """Requests sent one after another while the profiler runs outside the session's admission (as it starts and
    after its bound) each run in a batch of their own: neither those batches' ranges nor their ``forward`` phases
    nor the requests' own phases go into the trace; each phase range there lies in a request range of the
    session or in a batch range whose member is one."""
    import numpy as np

    from zoomer_serve.demo import ranker_pb2_grpc
    from zoomer_serve.demo.load import make_request

    bound = 3
    rng = np.random.default_rng(7)
    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path / "profiles"), telemetry).attach()
    server, port = build_server(build_model(device="cpu"), interceptors=[ZoomerServerInterceptor(telemetry.recorder)],
                                max_workers=4, config=ServiceConfig(batch_max_size=4, batch_max_delay_ms=1))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ranker_pb2_grpc.RankerStub(channel)

            def send(n: int) -> None:
                for _ in range(n):
                    assert len(stub.Predict(make_request(rng, 4), timeout=30).scores) == 4

            info = bounded_session_with_strays(controller, send, bound=bound, strays=2)
    finally:
        controller.close(timeout_s=60)
        server.stop(None).wait(5)
    assert info is not None and info.outcome == "done" and info.requests == bound, info
    data = read_chrome_trace(Path(info.trace_path))
    ranges = request_ranges(data)
    events = [e for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    batches = {parse_batch_label(e["name"]): e for e in events if parse_batch_label(e["name"])}
    members = {(m[1], m[2]) for m in (parse_member_label(e["name"]) for e in events) if m is not None}
    assert len(ranges) == bound and len(batches) == bound and members == set(ranges)
    phases = phase_ranges(data)
    assert {name: sum(ev["name"] == name for ev in phases) for name in ("preprocess", "forward", "postprocess")} \
        == {"preprocess": bound, "forward": bound, "postprocess": bound}
    assert all(any(within(ev, r) for r in (*ranges.values(), *batches.values())) for ev in phases)
