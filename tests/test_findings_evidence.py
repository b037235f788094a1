"""Findings fit their evidence: each detector's text against its own evidence table, on the real Kineto traces
and on stores filled over real OTLP (the rules: tests/_finding_claims.py). The store detectors' other inputs
(replicas, GPU memory, batching, collectives) are checked where their tests build them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from zoomer_serve.analysis import analyze, analyze_store
from zoomer_serve.analysis import labels as L
from zoomer_serve.analysis.findings import (
    AT_STAKE_MEANING,
    DETECTOR_IDS,
    SEVERITY_THRESHOLDS,
    severity_for_share,
)
from zoomer_serve.analysis.kineto import load_trace
from zoomer_serve.analysis.render import short_kernel_name
from zoomer_serve.analysis.store import load_store
from zoomer_serve.analysis.trace_detectors import detect_host_syncs, detect_launch_bound, detect_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _finding_claims import POSITIONAL, check_finding, checked_ids, shown_rows
from test_analysis_store import BASE_NS, Req, by_id, normal, record_replica

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
TRACES = sorted(KINETO.glob("*.json.gz"))
needs_traces = pytest.mark.skipif(not TRACES, reason=f"real Kineto traces not found at {KINETO}")


def test_severity_thresholds_are_one_rule_for_every_detector() -> None:
    assert set(AT_STAKE_MEANING) == set(DETECTOR_IDS)
    assert [s for s, _ in SEVERITY_THRESHOLDS] == ["high", "medium", "low"]
    assert [severity_for_share(x) for x in (0.9, 0.25, 0.2, 0.05, 0.01, 0.005, 0.001, 0.0, float("nan"))] == [
        "high", "high", "medium", "medium", "low", "low", "info", "info", "info"]


def test_positional_words_are_caught_and_comparisons_are_not() -> None:
    """The texts the report used to print ("fuse the elementwise chains listed below", "the fill time above;")
    are caught: the terminal lists items above the recommendation, the HTML report below it."""
    assert POSITIONAL.search("let torch.compile fuse the elementwise chains listed below, or batch more")
    assert POSITIONAL.search("raise the delay toward the fill time above; otherwise")
    assert not POSITIONAL.search("4 kernels ran below 25% estimated achieved occupancy")
    assert not POSITIONAL.search("Reserved GPU memory far above what tensors use")


@needs_traces
@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_every_trace_finding_says_what_its_evidence_shows(path: Path) -> None:
    findings = detect_trace(load_trace(path))
    assert findings
    checked_ids(findings, gpu=True)


@needs_traces
def test_the_trace_detectors_are_all_exercised_on_the_real_traces() -> None:
    seen: set[str] = set()
    for path in TRACES:
        seen |= {f.id for f in detect_trace(load_trace(path))}
    assert seen >= {"gpu.low-utilization", "gpu.launch-bound", "cuda.host-sync", "cuda.pageable-copy",
                    "gpu.fp32-no-tensor-cores", "gpu.low-occupancy"}


@needs_traces
def test_210_us_of_syncs_in_a_long_window_is_info_not_medium() -> None:
    """61 synchronising calls blocked the CPU for 210 us, under 0.1% of the window: not worth a medium."""
    (sync,) = detect_host_syncs(load_trace(KINETO / "a100_training_step.json.gz"))
    assert sync.evidence["blocked_us"] == pytest.approx(210, abs=1)
    assert sync.evidence["at_stake_share"] < 0.001 and sync.severity == "info"


@needs_traces
def test_a_kernel_is_listed_once_with_its_variants() -> None:
    """Two instantiations of vectorized_elementwise_kernel<..., CUDAFunctor_add<float>> (vector width 4 and 2)
    read alike in the report: they are one row (with its variants counted), not two rows."""
    (f,) = detect_launch_bound(load_trace(KINETO / "a100_training_step.json.gz"))
    shown = [short_kernel_name(it["kernel"]) for it in f.items]
    assert len(shown) == len(set(shown))
    (add,) = [it for it in f.items if shown[f.items.index(it)] == "vectorized_elementwise_kernel<CUDAFunctor_add>"]
    assert add["variants"] >= 2 and add["count"] >= 563 + 551
    assert len(shown_rows(f)) == len(set(shown_rows(f)))
    check_finding(f)


def test_tail_names_a_phase_only_where_the_listed_traces_spend_their_time(collector: Any) -> None:
    """The slow requests' preprocess grows most (0.4 -> 10 ms) but forward (12 ms) is still their largest part:
    the finding does not blame preprocess, and what it lists says forward."""
    reqs = normal(200, 3, fwd=3.0)
    slow_at = [30, 90, 150]
    for i in slow_at:
        reqs[i] = Req([("preprocess", 10.0), ("forward", 12.0), ("postprocess", 0.3)])
    record_replica(collector, "solo", reqs, BASE_NS)
    collector.finish()
    (tail,) = by_id(analyze_store(collector.store_path), "request.tail-latency")
    slow = [it for it in tail.items if it["slowest_1pct"]]
    assert slow and {it["largest_phase"] for it in slow} == {"forward"}
    assert "phase preprocess" not in tail.summary and "phase preprocess" not in tail.recommendation
    check_finding(tail, gpu=False)


def _cpu_bound_store(collector: Any, gpu: bool) -> Any:
    reqs = normal(40, 4, pre=6.0)
    if gpu:
        for k, req in enumerate(reqs):
            req.attrs.update({L.GPU_DEVICES: [0], L.GPU_MEMORY_RESERVED: 1 << 30,
                              L.GPU_MEMORY_ALLOCATED: 1 << 29, L.GPU_MEMORY_PEAK: (1 << 29) + k})
    record_replica(collector, "one", reqs, BASE_NS)
    collector.finish()
    return collector.store_path


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-only", "gpu"])
def test_cpu_bound_phase_advice_follows_the_device(collector: Any, gpu: bool) -> None:
    """Without GPU attributes in the store (a CPU-only run) the finding says nothing about a GPU waiting; with
    them it does."""
    store = _cpu_bound_store(collector, gpu)
    assert load_store(store).gpu is gpu
    (cpu,) = by_id(analyze_store(store), "request.cpu-bound-phase")
    assert cpu.evidence["phase"] == "preprocess" and cpu.evidence["gpu"] is gpu
    assert ("The GPU waits while preprocess runs on the CPU" in cpu.recommendation) is gpu
    assert "keep results on the GPU" not in cpu.recommendation  # that is postprocess advice
    # preprocess ~6 ms of ~9.2 ms: over a quarter of the request time is at stake
    assert cpu.evidence["at_stake_share"] == pytest.approx(cpu.evidence["phase_share"]) and cpu.severity == "high"
    check_finding(cpu, gpu=gpu)


@needs_traces
def test_a_gpu_trace_analysed_with_the_store_says_the_service_has_a_gpu(collector: Any) -> None:
    """A store without GPU telemetry, analysed together with a trace that ran kernels: the GPU advice applies."""
    store = _cpu_bound_store(collector, gpu=False)
    result = analyze([KINETO / "a100_cuda_event_sync.json.gz"], store)
    assert result.store is not None and result.store.gpu is True
    (cpu,) = [f for f in result.findings if f.id == "request.cpu-bound-phase"]
    assert "The GPU waits while preprocess runs on the CPU" in cpu.recommendation
    check_finding(cpu, gpu=True)
