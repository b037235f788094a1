"""Trace loading, analyzers and detectors on the real Kineto traces in shared/data/kineto (A100 and V100).

Expected figures are derived independently in the tests, by scanning the JSON with the standard library."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zoomer_serve.analysis import (
    analyze_trace,
    annotation_gpu_time,
    detect_trace,
    gpu_utilization,
    kernel_breakdown,
    kind_breakdown,
    launch_stats,
    load_trace,
    memcpy_bandwidth,
    request_gpu_time,
    request_label,
)
from zoomer_serve.analysis.findings import severity_for_share
from zoomer_serve.analysis.kineto import TraceFormatError, load_trace_bytes
from zoomer_serve.analysis.labels import parse_request_label
from zoomer_serve.analysis.timeline import idle_gaps
from zoomer_serve.intervals import merge_intervals, union_length

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
pytestmark = pytest.mark.skipif(not KINETO.is_dir(), reason=f"real Kineto traces not found at {KINETO}")

SMALL = ("a100_alexnet_inference", "a100_cuda_event_sync")
ALL = ("a100_alexnet_inference", "a100_cuda_event_sync", "v100_training_fwdbwd", "a100_training_step")
SYNC_APIS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def path(name: str) -> Path:
    return KINETO / f"{name}.json.gz"


_RAW: dict[str, dict[str, Any]] = {}
_LOADED: dict[str, Any] = {}


def raw(name: str) -> dict[str, Any]:
    if name not in _RAW:
        with gzip.open(path(name)) as fh:
            _RAW[name] = json.load(fh)
    return _RAW[name]


def loaded(name: str) -> Any:
    if name not in _LOADED:
        _LOADED[name] = load_trace(path(name))
    return _LOADED[name]


def events(name: str, cat: str) -> list[dict[str, Any]]:
    return [e for e in raw(name)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == cat]


# ---- loader --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.slow
def test_tables_hold_every_event_of_their_category(name: str) -> None:
    t = loaded(name)
    cats = Counter(e.get("cat") for e in raw(name)["traceEvents"] if e.get("ph") == "X")
    assert len(t.kernels) == cats["kernel"]
    assert len(t.memops) == cats["gpu_memcpy"] + cats["gpu_memset"]
    assert len(t.runtime) == cats["cuda_runtime"] + cats["cuda_driver"]
    assert len(t.syncs) == cats["cuda_sync"]
    assert len(t.cpu_ops) == cats["cpu_op"]
    assert len(t.annotations) == cats["user_annotation"] + cats["gpu_user_annotation"]
    assert t.event_count == len(raw(name)["traceEvents"])
    # nothing disappears silently: untabled events are counted
    assert t.skipped.get("Trace") == cats["Trace"]
    # kernel durations and ids as in the file; ts relative to the origin
    ks = events(name, "kernel")
    assert t.kernels["dur"].sum() == pytest.approx(sum(e["dur"] for e in ks), rel=1e-12)
    assert sorted(t.kernels["correlation"].tolist()) == sorted(e["args"]["correlation"] for e in ks)
    assert t.origin_us == min(e["ts"] for e in raw(name)["traceEvents"]
                              if e.get("ph") == "X" and e.get("cat") != "Trace")
    assert np.all(np.diff(t.kernels["ts"]) >= 0)
    assert t.metadata["deviceProperties"] == raw(name)["deviceProperties"]


def test_kernel_columns_and_memcpy_kinds() -> None:
    t = loaded("a100_alexnet_inference")
    first = min(events("a100_alexnet_inference", "kernel"), key=lambda e: (e["ts"], e["args"]["correlation"]))
    i = int(np.flatnonzero(t.kernels["correlation"] == first["args"]["correlation"])[0])
    a = first["args"]
    assert t.kernels["grid_blocks"][i] == int(np.prod(a["grid"]))
    assert t.kernels["block_threads"][i] == int(np.prod(a["block"]))
    assert t.kernels["registers_per_thread"][i] == a["registers per thread"]
    assert t.kernels["occupancy"][i] == a["est. achieved occupancy %"]
    assert t.kernels["stream"][i] == a["stream"] and t.kernels["device"][i] == a["device"]
    m = t.memops
    copies = m.take(m["op"] == "memcpy")
    assert set(zip(copies["direction"], copies["src"], copies["dst"])) == {("HtoD", "Pageable", "Device")}
    assert copies["bytes"].sum() == sum(e["args"]["bytes"] for e in events("a100_alexnet_inference", "gpu_memcpy"))
    assert t.device_properties[0]["numSms"] == 108


def test_flows_pair_launches_with_kernels() -> None:
    t = loaded("a100_cuda_event_sync")
    starts = {e["id"] for e in raw("a100_cuda_event_sync")["traceEvents"] if e.get("ph") == "s"}
    assert set(t.flows["id"].tolist()) == starts
    assert np.all(t.flows["end_ts"] >= t.flows["ts"])


def test_plain_minified_array_and_small_pieces_load_the_same(tmp_path: Path) -> None:
    """The same events from: the gzip file; plain pretty JSON; minified JSON with the keys after the
    events; the bare JSON-array format; and 2 KiB pieces (hundreds of cuts) all give identical tables."""
    name = "a100_alexnet_inference"
    doc = raw(name)
    ref = loaded(name)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(doc, indent=2))
    tail_first = {k: v for k, v in doc.items() if k != "traceEvents"}
    minified = tmp_path / "minified.json"
    minified.write_text(json.dumps({"traceEvents": doc["traceEvents"], **tail_first}, separators=(",", ":")))
    array = tmp_path / "array.json"
    array.write_text(json.dumps(doc["traceEvents"]))
    variants = [load_trace(plain), load_trace(minified), load_trace(array, chunk_bytes=4096),
                load_trace(path(name), chunk_bytes=2048), load_trace(minified, chunk_bytes=2048)]
    for t in variants:
        for table in ("kernels", "memops", "runtime", "syncs", "cpu_ops", "annotations", "flows"):
            a, b = getattr(ref, table), getattr(t, table)
            assert a.column_names == b.column_names
            for c in a.column_names:
                assert a[c].tolist() == b[c].tolist(), (table, c)
    assert variants[1].metadata["deviceProperties"] == doc["deviceProperties"]
    assert variants[2].metadata == {}


def test_odd_events_are_repaired_or_counted() -> None:
    """Ids as strings, a missing pid, non-ASCII names across piece boundaries, metadata and unknown
    categories: repaired where the meaning is clear, counted in ``skipped`` otherwise."""
    evs = [
        {"ph": "X", "cat": "kernel", "name": "gemm_ü", "pid": 0, "tid": "7", "ts": 10, "dur": 5,
         "args": {"device": "0", "stream": "7", "correlation": "42"}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 8, "dur": 3,
         "args": {"correlation": 42}},
        {"ph": "X", "cat": "python_function", "name": "f", "pid": 1, "tid": 1, "ts": 1, "dur": 1},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "dur": 1},
    ] + [{"ph": "X", "cat": "user_annotation", "name": "ÄÖÜ" * 50, "pid": 1, "tid": 1, "ts": 20 + i, "dur": 1}
         for i in range(200)]
    t = load_trace_bytes(json.dumps({"traceEvents": evs}).encode())
    assert t.kernels["stream"].tolist() == [7] and t.kernels["correlation"].tolist() == [42]
    assert t.runtime["pid"].tolist() == [-1]
    assert t.skipped["python_function"] == 1 and t.skipped["cpu_op without ts"] == 1
    assert t.process_names == {1: "python"}
    assert len(t.annotations) == 200 and t.origin_us == 8.0
    assert t.kernels["ts"].tolist() == [2.0]


def test_a_kernel_with_a_null_ts_is_skipped_with_a_warning() -> None:
    """A tabled event (here a kernel) whose ``ts`` is null or missing cannot be placed: it is left out, counted
    and named in the warnings the CLI prints, not dropped unsaid; a python_function without ts is only counted."""
    kernel = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "dur": 5,
              "args": {"device": 0, "stream": 7, "correlation": 1}}
    evs = [{**kernel, "ts": None}, {**kernel, "name": "k_missing"}, {**kernel, "name": "kept", "ts": 10},
           {**kernel, "name": "k_true", "ts": True},  # was read as ts 1: a window of 53 years
           {"ph": "X", "cat": "python_function", "name": "f", "pid": 1, "tid": 1, "dur": 1}]
    t = load_trace_bytes(json.dumps({"traceEvents": evs}).encode())
    assert t.kernels["name"].tolist() == ["kept"]
    assert t.skipped["kernel without ts"] == 3 and t.skipped["python_function without ts"] == 1
    assert [w for w in t.warnings if "without" in w] == [
        '3 kernel event(s) without a "ts" (missing, null or true/false) skipped']


@pytest.mark.parametrize("content,message", [
    (b"", "empty file"),
    (b'{"schemaVersion": 1}', "no top-level \"traceEvents\""),
    (b"[]", "holds no Kineto/Chrome trace events"),
    (b'[{"a": 1}]', "holds no Kineto/Chrome trace events"),
    (b'[1, "x", {"ph": null}]', "holds no Kineto/Chrome trace events"),
    (b'{"traceEvents": []}', "holds no Kineto/Chrome trace events"),
    (gzip.compress(b'{"traceEvents": [{"name": "x"}]}', mtime=0), "holds no Kineto/Chrome trace events"),
    (b'{"traceEvents": [{"ph": "X"}, {"ph": oops}]}', "invalid JSON"),
    (gzip.compress(b'{"traceEvents": [', mtime=0)[:-6], "no Kineto/Chrome trace events .* stream ends early"),
    (gzip.compress(b'{"traceEvents": [', mtime=0)[:8], "cannot decompress"),
    (gzip.compress(b'{"traceEvents": [', mtime=0)[:12], "no top-level .* stream ends early"),
])
def test_bad_files_raise_trace_format_error(tmp_path: Path, content: bytes, message: str) -> None:
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(p)
    assert "bad.json" in str(info.value)


@pytest.mark.parametrize("name,content,message", [
    ("corrupt.json", b"{nope", 'no top-level "traceEvents" array; not JSON either \\(unexpected character'),
    ("notgz.json.gz", b'{"a": 1}', 'no top-level "traceEvents" array \\(the name ends in .gz but the file is not gzip'),
])
def test_a_file_without_events_says_what_else_is_wrong(tmp_path: Path, name: str, content: bytes,
                                                       message: str) -> None:
    """Text that is not JSON, and a ``.gz`` name on a file that is not gzip, are said so (both said only that
    there was no "traceEvents" array)."""
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message):
        load_trace(p)


def test_a_gzip_file_cut_short_is_not_called_not_gzip(tmp_path: Path) -> None:
    """A real ``.json.gz`` cut short was said to be both "the compressed stream ends early" and "the name ends in
    .gz but the file is not gzip": it is gzip. Only the first is said."""
    p = tmp_path / "cut.json.gz"
    p.write_bytes(gzip.compress(b'{"traceEvents": [', mtime=0)[:12])
    with pytest.raises(TraceFormatError) as info:
        load_trace(p)
    assert "stream ends early" in str(info.value) and "not gzip" not in str(info.value)


def test_a_file_with_only_metadata_events_still_loads(tmp_path: Path) -> None:
    """A trace whose only events are metadata (``ph: M``) holds trace events: it loads, with no kernels."""
    p = tmp_path / "meta.json"
    p.write_text(json.dumps([{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}}]))
    t = load_trace(p)
    assert t.event_count == 1 and len(t.kernels) == 0 and t.process_names == {1: "python"}


def test_broken_json_in_a_middle_piece_names_the_offset(tmp_path: Path) -> None:
    good = json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x" * 50, "pid": 1, "tid": 1,
                                        "ts": i, "dur": 1} for i in range(2000)]})
    broken = good.replace('"ts": 1000,', '"ts": 1000 oops,')
    p = tmp_path / "broken.json"
    p.write_text(broken)
    with pytest.raises(TraceFormatError, match=r"invalid JSON near byte (\d+)") as info:
        load_trace(p, chunk_bytes=4096)
    offset = int(str(info.value).split("near byte ")[1].split(":")[0])
    assert abs(offset - broken.index("oops")) < 64
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.json.gz")


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 22])  # the array in many pieces, or in one
@pytest.mark.parametrize(("tail", "bad"), [(', "traceName": oops}', "oops"), ("}xyz", "xyz")])
def test_broken_json_after_the_event_array_names_its_offset(tmp_path: Path, chunk_bytes: int, tail: str,
                                                            bad: str) -> None:
    """Bad text after the event array was reported at the offset where the array's last piece began (byte 3385
    of a 320 kB file whose error was at its end)."""
    good = json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x" * 50, "pid": 1, "tid": 1,
                                        "ts": i, "dur": 1} for i in range(2000)]})
    broken = good[:-1] + tail
    p = tmp_path / "broken.json"
    p.write_text(broken)
    with pytest.raises(TraceFormatError, match=r"after the event array near byte (\d+)") as info:
        load_trace(p, chunk_bytes=chunk_bytes)
    offset = int(str(info.value).split("near byte ")[1].split(":")[0])
    assert abs(offset - broken.index(bad)) <= 2, (offset, broken.index(bad))


# ---- analyzers --------------------------------------------------------------------------------------------


def test_interval_union() -> None:
    s, e = merge_intervals(np.array([5.0, 0.0, 2.0, 10.0]), np.array([6.0, 3.0, 4.0, 11.0]))
    assert s.tolist() == [0.0, 5.0, 10.0] and e.tolist() == [4.0, 6.0, 11.0]
    assert union_length(np.array([0.0, 1.0]), np.array([10.0, 2.0])) == 10.0


def _reference_busy_idle(name: str) -> tuple[float, float]:
    """Busy and window of the device from the JSON, by a plain sweep over (ts, ts+dur) of GPU ops (times
    taken relative to the first op before adding durations: absolute microsecond floats near 1.7e15 keep
    only quarter-microsecond precision)."""
    gpu = [e for e in raw(name)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    t0 = min(e["ts"] for e in gpu)
    ops = sorted((e["ts"] - t0, e["ts"] - t0 + e["dur"]) for e in gpu)
    busy, cur_s, cur_e = 0.0, ops[0][0], ops[0][1]
    for s, e in ops[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy, max(e for _, e in ops) - ops[0][0]


@pytest.mark.parametrize("name", ALL)
def test_every_analyzer_runs_on_real_traces(name: str) -> None:
    t = loaded(name)
    report = analyze_trace(t)
    for key in ("gpu_utilization", "kind_breakdown", "kernel_breakdown", "launch_stats", "memcpy_bandwidth",
                "annotation_gpu_time", "request_gpu_time"):
        assert key in report.tables
    util = gpu_utilization(t)
    dev = util.take(util["stream"] == -1).rows()[0]
    busy, window = _reference_busy_idle(name)
    assert dev["busy_us"] == pytest.approx(busy, rel=1e-9)
    assert dev["window_us"] == pytest.approx(window, rel=1e-9)
    assert dev["host_wait_us"] + dev["kernel_wait_us"] + dev["other_idle_us"] == pytest.approx(dev["idle_us"], rel=1e-6)
    streams = util.take(util["stream"] >= 0)
    assert set(streams["stream"].tolist()) == {e["args"]["stream"] for c in ("kernel", "gpu_memcpy", "gpu_memset")
                                               for e in events(name, c)}
    kb = kernel_breakdown(t)
    assert kb["total_us"].sum() == pytest.approx(
        sum(e["dur"] for c in ("kernel", "gpu_memcpy", "gpu_memset") for e in events(name, c)), rel=1e-9)
    assert kb["share"].sum() == pytest.approx(1.0)
    kinds = kind_breakdown(t)
    assert kinds["total_us"].sum() == pytest.approx(kb["total_us"].sum())
    ls = launch_stats(t).rows()[0]
    assert ls["kernels"] == len(events(name, "kernel"))
    assert ls["launched"] == ls["kernels"]  # every kernel's launch call is in these traces
    short = sum(1 for e in events(name, "kernel") if e["dur"] < 10)
    assert ls["short_kernels"] == short
    bw = memcpy_bandwidth(t)
    assert bw["bytes"].sum() == sum(e["args"]["bytes"] for c in ("gpu_memcpy", "gpu_memset") for e in events(name, c))
    gaps = idle_gaps(t)
    assert gaps["gap_us"].sum() == pytest.approx(dev["idle_us"], rel=1e-6)
    assert report.trace is t


def test_kernel_kinds_on_real_names() -> None:
    kb = kernel_breakdown(loaded("a100_training_step"))
    kinds = dict(zip(kb["name"].tolist(), kb["kind"].tolist()))
    assert kinds["ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)"] == "communication"
    assert kinds["ampere_sgemm_128x128_tn"] == "gemm"
    assert kinds["Memset (Device)"] == "memset"
    assert kinds["Memcpy HtoD (Pinned -> Device)"] == "memcpy"
    v = dict(zip(*[kernel_breakdown(loaded("v100_training_fwdbwd"))[c].tolist() for c in ("name", "kind")]))
    assert v["cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1"] == "convolution"
    assert any(k == "reduction" and "bn_fw" in n for n, k in v.items())
    assert any(k == "elementwise" and "vectorized_elementwise_kernel" in n for n, k in v.items())


def test_idle_split_follows_the_hta_definition_on_a_hand_checked_trace() -> None:
    """a100_cuda_event_sync: 5 GPU ops on stream 7; every gap ends with an op launched after the previous
    op ended, so all idle time is host wait (checked by hand against the JSON)."""
    t = loaded("a100_cuda_event_sync")
    rows = gpu_utilization(t).rows()
    assert rows[0]["busy_us"] == 51.0 and rows[0]["window_us"] == 263.0
    assert rows[0]["host_wait_us"] == 212.0 and rows[0]["kernel_wait_us"] == 0.0
    gaps = idle_gaps(t).rows()
    assert gaps[0]["gap_us"] == 100.0 and gaps[0]["next_op"].startswith("at::cuda::")


def test_overlapping_operations_on_a_stream_give_no_negative_idle_and_a_warning() -> None:
    """Kernels that overlap on one stream (duplicated events: a stream runs one at a time) made negative gaps:
    kernel wait -50 us against 50 us idle. The gaps are taken between merged intervals then, so the split adds
    up to the idle time, and the reader says how many overlapped."""
    evs = []
    for ts, dur, c in ((100, 100, 1), (150, 100, 2), (300, 50, 3)):
        evs.append({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                    "args": {"device": 0, "stream": 7, "correlation": c}})
        evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                    "ts": ts - 10, "dur": 5, "args": {"correlation": c}})
    t = load_trace_bytes(json.dumps({"traceEvents": evs}).encode())
    assert [w for w in t.warnings if "same stream" in w] == [
        "1 GPU operation(s) start before the one ahead of them on the same stream has ended (a stream runs one at "
        "a time: duplicated events?); busy and idle time count the overlap once"]
    for row in gpu_utilization(t).rows():  # the device row and the stream row alike
        assert (row["busy_us"], row["idle_us"]) == (200.0, 50.0)
        assert row["host_wait_us"] + row["kernel_wait_us"] + row["other_idle_us"] == 50.0
        assert min(row["host_wait_us"], row["kernel_wait_us"], row["other_idle_us"]) >= 0.0
    real = loaded("a100_cuda_event_sync")
    assert not [w for w in real.warnings if "same stream" in w]


def test_annotation_gpu_time_matches_a_direct_scan() -> None:
    """GPU time under each ProfilerStep of the V100 trace = durations of the GPU ops whose launch call
    (same correlation) started on the step's thread within the step."""
    name = "v100_training_fwdbwd"
    d = raw(name)["traceEvents"]
    steps = [e for e in d if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep")]
    launches = {e["args"]["correlation"]: e for e in d if e.get("cat") == "cuda_runtime"}
    gpu = [e for e in d if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    expected = {}
    for s in steps:
        total = 0.0
        for g in gpu:
            launch = launches.get(g["args"]["correlation"])
            if launch and launch["tid"] == s["tid"] and s["ts"] <= launch["ts"] <= s["ts"] + s["dur"]:
                total += g["dur"]
        expected[s["name"]] = total
    table = annotation_gpu_time(loaded(name), pattern=r"^ProfilerStep")
    got = dict(zip(table["name"].tolist(), table["gpu_time_us"].tolist()))
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-6)
    assert sum(expected.values()) > 0


@pytest.mark.slow
def test_request_labels_round_trip_and_give_gpu_time_per_request(tmp_path: Path) -> None:
    """Request ranges named with :func:`request_label` inserted into the real V100 trace (around each
    ProfilerStep, on the same thread) are found and get the same GPU time as the step they wrap."""
    assert request_label(0xABC, 0x12) == "zoomer.request/" + "0" * 29 + "abc/" + "0" * 14 + "12"
    assert parse_request_label(request_label("A" * 32, "b" * 16)) == ("a" * 32, "b" * 16)
    assert parse_request_label("zoomer.request/xyz/1") is None and parse_request_label("forward") is None
    with pytest.raises(ValueError):
        request_label(-1, 1)
    doc = json.loads(json.dumps(raw("v100_training_fwdbwd")))
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep")]
    ids = {}
    for k, s in enumerate(steps):
        label = request_label(k + 1, k + 100)
        ids[label] = s["name"]
        doc["traceEvents"].append({**s, "name": label, "args": {}})
    p = tmp_path / "with_requests.json.gz"
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    t = load_trace(p)
    per_request = request_gpu_time(t)
    assert len(per_request) == len(steps)
    step_gpu = dict(zip(*[annotation_gpu_time(t, pattern="^ProfilerStep")[c].tolist() for c in ("name", "gpu_time_us")]))
    for row in per_request.rows():
        label = request_label(row["trace_id"], row["span_id"])
        assert row["gpu_time_us"] == pytest.approx(step_gpu[ids[label]])
        assert row["gpu_ops"] > 0 and row["gpu_span_us"] >= row["gpu_time_us"] * 0.5
    # the trace's one cudaDeviceSynchronize runs after the last step: not in the request path ...
    [sync] = [e for e in doc["traceEvents"] if e.get("cat") == "cuda_runtime" and e["name"] in SYNC_APIS]
    found = by_id(detect_trace(t), "cuda.host-sync")[0]
    assert found.evidence["in_requests_count"] == 0 and found.evidence["requests_in_trace_count"] == len(steps)
    assert found.severity == "medium" and found.evidence["at_stake_share"] == found.evidence["blocked_share"]
    # ... until a request range covers it: then it is, and the share of the requests' time it blocked is at
    # stake (the larger share sets the severity)
    doc["traceEvents"].append({"ph": "X", "cat": "user_annotation", "name": request_label(99, 99), "pid": sync["pid"],
                               "tid": sync["tid"], "ts": sync["ts"] - 5, "dur": sync["dur"] + 10, "args": {}})
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    found = by_id(detect_trace(load_trace(p)), "cuda.host-sync")[0]
    assert found.evidence["in_requests_count"] == 1 and found.evidence["requests_with_sync_count"] == 1
    assert "inside 1 of 6 requests" in found.summary
    ev = found.evidence
    assert ev["blocked_in_requests_us"] == pytest.approx(sync["dur"])
    assert ev["at_stake_share"] == ev["blocked_request_share"] > ev["blocked_share"]
    assert found.severity == severity_for_share(ev["blocked_request_share"])


def test_a_request_with_ranges_on_two_threads_is_one_request() -> None:
    """A request whose model ran in an executor thread has its range on the loop thread and one on the executor
    thread (opened by its phases): one row of GPU time with the launches of both, its time counted once, and one
    request for the host-sync finding, which finds the executor thread's sync inside it."""
    a, b = request_label(1, 1), request_label(2, 2)

    def x(cat: str, name: str, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}

    evs = [
        x("user_annotation", a, 1, 0, 100), x("user_annotation", a, 2, 10, 50),  # loop thread, executor
        x("user_annotation", b, 1, 200, 50),
        x("cuda_runtime", "cudaLaunchKernel", 2, 12, 2, correlation=1),
        x("cuda_runtime", "cudaLaunchKernel", 2, 20, 2, correlation=2),
        x("cuda_runtime", "cudaDeviceSynchronize", 2, 30, 20, correlation=3),
        x("cuda_runtime", "cudaLaunchKernel", 1, 210, 2, correlation=4),
        {**x("kernel", "gemm", 7, 15, 20, correlation=1, device=0, stream=7), "pid": 0},
        {**x("kernel", "relu", 7, 40, 30, correlation=2, device=0, stream=7), "pid": 0},
        {**x("kernel", "add", 7, 215, 5, correlation=4, device=0, stream=7), "pid": 0},
    ]
    t = load_trace_bytes(json.dumps({"traceEvents": evs}).encode())
    rows = {(r["trace_id"], r["span_id"]): r for r in request_gpu_time(t).rows()}
    assert len(rows) == 2
    first = rows[("0" * 31 + "1", "0" * 15 + "1")]
    assert (first["start_us"], first["cpu_time_us"], first["gpu_time_us"], first["gpu_ops"]) == (0.0, 100.0, 50.0, 2)
    assert (first["gpu_span_us"], first["tid"]) == (55.0, 1)
    second = rows[("0" * 31 + "2", "0" * 15 + "2")]
    assert (second["cpu_time_us"], second["gpu_time_us"], second["gpu_ops"]) == (50.0, 5.0, 1)
    found = by_id(detect_trace(t), "cuda.host-sync")[0]
    assert found.evidence["in_requests_count"] == 1 and found.evidence["requests_with_sync_count"] == 1
    assert found.evidence["requests_in_trace_count"] == 2 and "inside 1 of 2 requests" in found.summary


# ---- detectors --------------------------------------------------------------------------------------------


def by_id(findings: list[Any], fid: str) -> list[Any]:
    return [f for f in findings if f.id == fid]


@pytest.mark.parametrize("name", SMALL)
def test_sync_detector_counts_blocking_calls(name: str) -> None:
    expected = Counter(e["name"] for e in events(name, "cuda_runtime") if e["name"] in SYNC_APIS)
    found = by_id(detect_trace(loaded(name)), "cuda.host-sync")
    assert len(found) == 1
    ev = found[0].evidence
    assert ev["sync_calls_count"] == sum(expected.values()) > 0
    assert ev["calls_by_api"] == dict(expected)
    assert ev["blocked_us"] == pytest.approx(sum(e["dur"] for e in events(name, "cuda_runtime")
                                                 if e["name"] in SYNC_APIS))


def test_sync_detector_traces_item_calls_to_their_cpu_op() -> None:
    """In the event-sync trace, the stream sync comes from aten::is_nonzero -> item -> _local_scalar_dense."""
    f = by_id(detect_trace(loaded("a100_cuda_event_sync")), "cuda.host-sync")[0]
    assert f.evidence["item_like_count"] == 1
    assert {"cpu_op": "aten::is_nonzero", "innermost_op": "aten::_local_scalar_dense",
            "api": "cudaStreamSynchronize", "count": 1, "blocked_us": 6.0} in f.items


@pytest.mark.parametrize("name,direction", [("a100_alexnet_inference", "HtoD"), ("a100_cuda_event_sync", "DtoH")])
def test_pageable_copy_detector_counts_pageable_copies(name: str, direction: str) -> None:
    copies = [e for e in events(name, "gpu_memcpy") if "Pageable" in e["name"]]
    found = by_id(detect_trace(loaded(name)), "cuda.pageable-copy")
    assert len(found) == 1
    ev = found[0].evidence
    assert ev["copies_count"] == len(copies) > 0
    assert ev["bytes"] == sum(e["args"]["bytes"] for e in copies)
    assert set(ev["by_direction"]) == {direction}
    assert "pin_memory" in found[0].recommendation


def test_traces_without_a_pattern_have_no_finding_for_it(tmp_path: Path) -> None:
    """V100 has no pageable copies; the AlexNet trace with its synchronising calls (and their CUPTI sync
    records) removed has no sync finding; V100 runs at 98% utilisation and has no idle finding."""
    v100 = detect_trace(loaded("v100_training_fwdbwd"))
    assert not by_id(v100, "cuda.pageable-copy")
    assert not by_id(v100, "gpu.low-utilization")
    assert not by_id(detect_trace(loaded("a100_cuda_event_sync")), "gpu.launch-bound")  # 4 kernels
    doc = json.loads(json.dumps(raw("a100_alexnet_inference")))
    doc["traceEvents"] = [e for e in doc["traceEvents"]
                          if not (e.get("name") in SYNC_APIS or e.get("cat") == "cuda_sync")]
    p = tmp_path / "nosync.json"
    p.write_text(json.dumps(doc))
    found = detect_trace(load_trace(p))
    assert not by_id(found, "cuda.host-sync")
    assert by_id(found, "cuda.pageable-copy")  # the rest still fires


def test_other_detectors_on_real_traces() -> None:
    alex = detect_trace(loaded("a100_alexnet_inference"))
    low = by_id(alex, "gpu.low-utilization")[0]
    busy, window = _reference_busy_idle("a100_alexnet_inference")
    assert low.severity == "high" and low.evidence["utilization_share"] == pytest.approx(busy / window)
    assert low.items[0]["gap_us"] == low.evidence["longest_gap_us"]
    fp32 = by_id(alex, "gpu.fp32-no-tensor-cores")[0]
    names = {i["kernel"] for i in fp32.items}
    assert "ampere_sgemm_32x32_sliced1x4_tn" in names
    assert not any("tensorop" in n or "tf32" in n for n in names)
    assert "set_float32_matmul_precision" in fp32.recommendation  # A100: TF32 advice
    v100_fp32 = by_id(detect_trace(loaded("v100_training_fwdbwd")), "gpu.fp32-no-tensor-cores")[0]
    assert "float16" in v100_fp32.recommendation and "7.0" in v100_fp32.evidence["compute_capability"]
    assert not by_id(detect_trace(loaded("a100_cuda_event_sync")), "gpu.fp32-no-tensor-cores")
    occ = by_id(detect_trace(loaded("v100_training_fwdbwd")), "gpu.low-occupancy")[0]
    assert all(0 < i["occupancy_pct"] < 25 for i in occ.items)
    assert occ.evidence["sm_count"] == 80


def test_launch_bound_on_the_training_step() -> None:
    """The A100 training step (8.5k kernels, half under 10 us) is launch-bound; evidence from the JSON."""
    name = "a100_training_step"
    f = by_id(detect_trace(loaded(name)), "gpu.launch-bound")
    assert len(f) == 1
    ks = events(name, "kernel")
    launches = {e["args"]["correlation"]: e["dur"] for e in events(name, "cuda_runtime")}
    assert f[0].evidence["short_kernels_count"] == sum(1 for e in ks if e["dur"] < 10)
    exceeds = sum(1 for e in ks if launches[e["args"]["correlation"]] > e["dur"]) / len(ks)
    assert f[0].evidence["launch_exceeds_kernel_share"] == pytest.approx(exceeds)
    assert "CUDA graph" in f[0].recommendation
