"""The figures Holistic Trace Analysis (HTA) also computes, checked against HTA itself on the same real
traces: GPU time per kernel and in total, idle time per stream split into host wait / kernel wait / other,
and the device's idle time and window. They must agree within 1%.

HTA runs here with ``HTA_DISABLE_NS_ROUNDING=1``: by default it rounds traces with sub-microsecond
timestamps (the V100 trace) to whole microseconds (start rounded up, end down), shortening every kernel by up
to 1 us; we keep the file's timestamps. ``include_last_profiler_step=True`` makes HTA keep the whole trace.
The largest trace (a100_training_step) is compared in benchmarks/analysis_speed.py, which loads it with both.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zoomer_serve.analysis import gpu_utilization, kernel_breakdown, load_trace
from zoomer_serve.intervals import union_length

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
if not KINETO.is_dir():
    pytest.skip(f"real Kineto traces not found at {KINETO}", allow_module_level=True)
hta_trace_analysis = pytest.importorskip(
    "hta.trace_analysis", reason="HolisticTraceAnalysis is not installed (pip install -e '.[dev]')")

pytestmark = pytest.mark.filterwarnings("ignore:::hta")  # pandas deprecation warnings inside HTA

TRACES = ("a100_cuda_event_sync", "a100_alexnet_inference", "v100_training_fwdbwd")
REL = 0.01


@pytest.fixture(scope="module")
def hta_results() -> dict[str, dict[str, Any]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    logging.getLogger("hta").setLevel(logging.ERROR)
    out = {}
    try:
        for name in TRACES:
            ta = hta_trace_analysis.TraceAnalysis(trace_files={0: str(KINETO / f"{name}.json.gz")},
                                                  trace_dir=str(KINETO), include_last_profiler_step=True)
            _, kernels = ta.get_gpu_kernel_breakdown(visualize=False, num_kernels=10**9, duration_ratio=1.0,
                                                     include_memory_kernels=True)
            idle, _ = ta.get_idle_time_breakdown(visualize=False)
            temporal = ta.get_temporal_breakdown(visualize=False)
            out[name] = {"kernels": kernels, "idle": idle, "temporal": temporal}
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("name", TRACES)
def test_gpu_time_per_kernel_and_total_match_hta(name: str, hta_results: dict[str, Any]) -> None:
    ours = kernel_breakdown(load_trace(KINETO / f"{name}.json.gz"))
    ref = hta_results[name]["kernels"]
    hta = {row["name"]: row for row in ref.to_dict("records")}
    mine = {row["name"]: row for row in ours.rows()}
    assert set(mine) <= set(hta)
    # HTA also lists CUPTI cuda_sync records that carry a stream (e.g. "Stream Wait Event") as kernels;
    # they are synchronisation records, not GPU work, and are the only names it has beyond ours.
    trace = load_trace(KINETO / f"{name}.json.gz")
    assert set(hta) - set(mine) <= set(trace.syncs["kind"].tolist())
    for kname, row in mine.items():
        h = hta[kname]
        assert row["total_us"] == pytest.approx(h["sum (us)"], rel=REL), kname
        assert row["max_us"] == pytest.approx(h["max (us)"], rel=REL), kname
        assert row["min_us"] == pytest.approx(h["min (us)"], rel=REL), kname
        assert row["mean_us"] == pytest.approx(h["mean (us)"], rel=REL), kname
    total_hta = sum(hta[k]["sum (us)"] for k in mine)
    assert sum(r["total_us"] for r in mine.values()) == pytest.approx(total_hta, rel=REL)
    assert total_hta > 0


@pytest.mark.parametrize("name", TRACES)
def test_idle_time_per_stream_and_category_matches_hta(name: str, hta_results: dict[str, Any]) -> None:
    util = gpu_utilization(load_trace(KINETO / f"{name}.json.gz"))
    ref = hta_results[name]["idle"]
    compared = 0
    for row in util.rows():
        if row["stream"] < 0:
            continue
        for category, col in (("host_wait", "host_wait_us"), ("kernel_wait", "kernel_wait_us"), ("other", "other_idle_us")):
            h = ref[(ref["stream"] == row["stream"]) & (ref["idle_category"] == category)]["idle_time"]
            expected = float(h.iloc[0]) if len(h) else 0.0
            # HTA rounds this table to 2 decimals
            assert row[col] == pytest.approx(expected, rel=REL, abs=0.01), (row["stream"], category)
            compared += 1
    assert compared == 3 * len(set(ref["stream"]))


@pytest.mark.parametrize("name", TRACES)
def test_device_idle_time_matches_hta_temporal_breakdown(name: str, hta_results: dict[str, Any]) -> None:
    """HTA's temporal breakdown also counts CUPTI ``cuda_sync`` records that sit on a stream as busy GPU
    time (and in the window); we do not (a sync record is the host waiting). Where a trace has such
    records the two differ by exactly that union, which is checked here; without them they agree."""
    trace = load_trace(KINETO / f"{name}.json.gz")
    dev = gpu_utilization(trace).take(np.array([0])).rows()[0]
    assert dev["stream"] == -1
    temporal = hta_results[name]["temporal"].iloc[0]
    hta_idle, hta_window = float(temporal["idle_time(us)"]), float(temporal["kernel_time(us)"])
    s = trace.syncs.take(trace.syncs["stream"] >= 0)
    ops = trace.gpu_ops()
    starts = np.concatenate([ops["ts"], s["ts"]])
    ends = np.concatenate([ops["ts"] + ops["dur"], s["ts"] + s["dur"]])
    with_syncs_window = float(ends.max() - starts.min())
    with_syncs_idle = with_syncs_window - union_length(starts, ends)
    assert with_syncs_idle == pytest.approx(hta_idle, rel=REL)
    assert with_syncs_window == pytest.approx(hta_window, rel=REL)
    if len(s) == 0:
        assert dev["idle_us"] == pytest.approx(hta_idle, rel=REL)
        assert dev["window_us"] == pytest.approx(hta_window, rel=REL)
    else:
        assert dev["idle_us"] > hta_idle * (1 - REL) - 1e-9
