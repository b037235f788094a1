"""What newer Kineto writes: counter tracks (``ph`` "C" samples, as CUPTI PM sampling puts on a "GPU N
Counters" track) are loaded, summarised and drawn in the merged timeline; kernels replayed from CUDA graphs
(one ``cudaGraphLaunch`` for many kernels, each with a ``graph node id``) are counted and attributed like
others, and a graph is not taken for launch-bound work."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from zoomer_serve.analysis import analyze, analyze_trace, load_trace
from zoomer_serve.analysis.html import render_html
from zoomer_serve.analysis.kineto import load_trace_bytes
from zoomer_serve.analysis.labels import request_label
from zoomer_serve.analysis.perfetto import read_timeline, write_perfetto

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
pytestmark = pytest.mark.skipif(not KINETO.is_dir(), reason=f"real Kineto traces not found at {KINETO}")
EVENT_SYNC = KINETO / "a100_cuda_event_sync.json.gz"
SM = "sm__throughput.avg.pct_of_peak_sustained_elapsed"


@pytest.fixture(scope="module")
def with_counters(tmp_path_factory: Any) -> dict[str, Any]:
    """The real A100 event-sync trace with PM-sampling counter samples on its GPU every 10 us: one counter
    per event, and one event carrying two series."""
    doc = json.loads(gzip.decompress(EVENT_SYNC.read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    dev = kernels[0]["args"]["device"]
    t0 = min(k["ts"] for k in kernels)
    samples = []
    for i in range(20):
        ts = t0 + 10 * i
        samples.append({"ph": "C", "name": SM, "pid": dev, "tid": f"GPU {dev} Counters", "ts": ts,
                        "args": {SM: float(i)}})
        samples.append({"ph": "C", "name": f"GPU {dev} Counters", "pid": dev, "tid": f"GPU {dev} Counters",
                        "ts": ts, "args": {"dram__throughput": 2.0 * i, "sm__inst_executed": 100 + i}})
    doc["traceEvents"].extend(samples)
    path = tmp_path_factory.mktemp("counters") / "counters.json"
    path.write_text(json.dumps(doc))
    return {"path": path, "device": dev, "t0": t0}


def test_counter_samples_are_loaded_and_summarised(with_counters: dict[str, Any]) -> None:
    trace = load_trace(with_counters["path"])
    assert len(trace.counters) == 60 and "counter" not in " ".join(trace.skipped)
    table = analyze_trace(trace).tables["counters"]
    rows = {(r["counter"], r["name"]): r for r in table.rows()}
    sm = rows[(SM, SM)]
    assert sm["device"] == with_counters["device"] and sm["samples"] == 20
    assert (sm["min"], sm["mean"], sm["max"]) == (0.0, 9.5, 19.0)
    dram = rows[(f"GPU {with_counters['device']} Counters", "dram__throughput")]
    assert dram["max"] == 38.0 and dram["last_us"] - dram["first_us"] == pytest.approx(190.0)


@pytest.mark.parametrize("name", ["t.pftrace", "t.json.gz"])
@pytest.mark.slow
def test_counter_tracks_in_the_merged_timeline_and_the_report(with_counters: dict[str, Any], tmp_path: Path,
                                                              name: str) -> None:
    trace = load_trace(with_counters["path"])
    write_perfetto(tmp_path / name, [trace])
    tl = read_timeline(tmp_path / name)
    by_name = {tl.track_names[uuid]: points for uuid, points in tl.counters.items()}
    track = next(k for k in by_name if k.endswith(SM))
    points = by_name[track]
    assert [v for _, v in points] == [float(i) for i in range(20)]
    first_ns = with_counters["t0"] * 1000  # the 2024 trace: epoch microseconds
    assert points[0][0] == pytest.approx(first_ns, abs=1) and points[1][0] - points[0][0] == 10_000
    assert any("dram__throughput" in k for k in by_name)
    if name.endswith(".pftrace"):
        gpu = [u for u, n in tl.track_names.items() if " · GPU " in n]
        assert any(tl.track_parents[u] in gpu for u in tl.counters)  # under its GPU
    page = render_html(analyze([with_counters["path"]]))
    assert 'data-table="counters"' in page and "dram__throughput" in page


def _graph_trace(graph: bool) -> bytes:
    """A forward pass inside a request range: 60 kernels of 2 us on one stream, launched by one
    cudaGraphLaunch (20 us) when ``graph``, else by one cudaLaunchKernel (8 us) each."""
    label = request_label(7, 9)
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "user_annotation", "name": label, "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "forward", "pid": 1, "tid": 1, "ts": 1, "dur": 998}]
    for i in range(60):
        corr = 100 if graph else 100 + i
        if not graph or i == 0:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch" if graph else "cudaLaunchKernel",
                           "pid": 1, "tid": 1, "ts": 10 + (0 if graph else 9 * i), "dur": 20 if graph else 8,
                           "args": {"correlation": corr}})
        args = {"device": 0, "stream": 7, "correlation": corr, **({"graph node id": 1000 + i} if graph else {})}
        events.append({"ph": "X", "cat": "kernel", "name": f"void fused_kernel_{i % 3}<float>", "pid": 0, "tid": 7,
                       "ts": 40 + (3 if graph else 9) * i, "dur": 2, "args": args})
    return json.dumps({"baseTimeNanoseconds": 1_790_857_026_000_000_000, "traceEvents": events}).encode()


def test_cuda_graph_kernels_are_counted_and_attributed() -> None:
    report = analyze_trace(load_trace_bytes(_graph_trace(graph=True)))
    t = report.tables
    assert len(report.trace.kernels) == 60 and report.trace.kernels["graph_node_id"].min() == 1000
    forward = next(r for r in t["annotation_gpu_time"].rows() if r["name"] == "forward")
    assert forward["gpu_ops"] == 60 and forward["gpu_time_us"] == pytest.approx(120.0)
    req = t["request_gpu_time"].rows()[0]
    assert req["gpu_ops"] == 60 and req["gpu_time_us"] == pytest.approx(120.0)
    ls = t["launch_stats"].rows()[0]
    assert (ls["kernels"], ls["launched"], ls["launch_calls"], ls["graph_kernels"]) == (60, 60, 1, 60)
    assert ls["launch_total_us"] == 20.0 and ls["launch_exceeds_kernel_share"] == 0.0
    assert not [f for f in report.findings if f.id == "gpu.launch-bound"]


def test_the_same_kernels_launched_one_by_one_are_launch_bound() -> None:
    report = analyze_trace(load_trace_bytes(_graph_trace(graph=False)))
    ls = report.tables["launch_stats"].rows()[0]
    assert (ls["launch_calls"], ls["graph_kernels"], ls["launch_total_us"]) == (60, 0, 480.0)
    assert ls["launch_exceeds_kernel_share"] == 1.0
    [finding] = [f for f in report.findings if f.id == "gpu.launch-bound"]
    assert "CUDA graph" in finding.recommendation
