"""Checks that what a finding says matches its evidence table: one checker per detector, plus the rules every
finding follows (severity from the share at stake, no row shown twice, no "below"/"above" pointing at a table,
no GPU advice without a GPU). Used by tests/test_findings_evidence.py and by the demo run's test."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import pytest

from zoomer_serve.analysis.findings import AT_STAKE, DETECTOR_IDS, Finding, severity_for_share
from zoomer_serve.analysis.render import fmt_item
from zoomer_serve.analysis.store import OUTSIDE_PHASES

POSITIONAL = re.compile(r"\b(?:listed|shown)\s+(?:below|above)\b|\b(?:below|above)\s*(?:[.,;:)]|$)")
"""A reference to where something is on the page ("listed below", "the fill time above;"). The terminal shows
a finding's items before its recommendation and the HTML report after it, so a finding may not point up or
down; "below 25%" and "far above what tensors use" are comparisons, not positions."""

GPU_WORDS = re.compile(r"\bGPU\b|\bCUDA\b|\bcuda\b|tensor cores")


def shown_rows(finding: Finding) -> list[tuple[str, ...]]:
    """The finding's items as the report shows them (formatted cells)."""
    return [tuple(f"{k}={fmt_item(k, v)}" for k, v in item.items()) for item in finding.items]


def check_common(finding: Finding, gpu: bool) -> None:
    assert finding.id in DETECTOR_IDS
    share = finding.evidence[AT_STAKE]
    assert 0.0 <= share <= 1.0 + 1e-9, (finding.id, share)
    assert finding.severity == severity_for_share(share), (finding.id, finding.severity, share)
    rows = shown_rows(finding)
    assert len(rows) == len(set(rows)), f"{finding.id}: a row is shown twice: {Counter(rows).most_common(1)}"
    for text in (finding.title, finding.summary, finding.recommendation):
        assert POSITIONAL.search(text) is None, (finding.id, text)
    if not gpu:
        for text in (finding.title, finding.summary, finding.recommendation):
            assert GPU_WORDS.search(text) is None, f"{finding.id} gives GPU advice without a GPU: {text}"


def _low_utilization(f: Finding) -> None:
    ev = f.evidence
    split = {"host wait": ev["host_wait_us"], "kernel wait": ev["kernel_wait_us"], "other": ev["other_idle_us"]}
    dominant = max(split, key=lambda k: split[k])
    assert f"of the idle time is {dominant}," in f.summary
    assert ev["busy_us"] + ev["idle_us"] == pytest.approx(ev["window_us"], rel=1e-6)
    assert all(it["gap_us"] <= ev["longest_gap_us"] + 1e-6 for it in f.items)


def _launch_bound(f: Finding) -> None:
    ev = f.evidence
    elementwise = [it for it in f.items if it["kind"] == "elementwise"]
    if elementwise:
        assert f"fuse the {len(elementwise)} elementwise kernels among the listed ones" in f.recommendation
    else:
        assert "elementwise" not in f.recommendation
    assert sum(it["count"] for it in f.items) <= ev["short_kernels_count"]
    assert all(it["median_us"] < ev["short_threshold_us"] for it in f.items)


def _host_sync(f: Finding) -> None:
    ev = f.evidence
    assert f.summary.startswith(f"{ev['sync_calls_count']} synchronising CUDA calls")
    for api, n in ev["calls_by_api"].items():
        assert f"{api} x{n}" in f.summary
    assert {it["api"] for it in f.items} <= set(ev["calls_by_api"])
    assert sum(it["count"] for it in f.items) <= ev["sync_calls_count"]


def _pageable(f: Finding) -> None:
    ev = f.evidence
    assert f.summary.startswith(f"{ev['copies_count']} copies")
    assert {it["direction"] for it in f.items} <= set(ev["by_direction"])
    if len(f.items) < 10:
        assert sum(it["count"] for it in f.items) == ev["copies_count"]


def _fp32(f: Finding) -> None:
    ev = f.evidence
    kinds = int(re.search(r"kernels of (\d+) kinds", f.summary).group(1))  # type: ignore[union-attr]
    assert kinds >= len(f.items) and (kinds == len(f.items) or len(f.items) == 10)
    assert f.summary.startswith(f"{ev['kernels_count']} kernels")
    if kinds == len(f.items):
        assert sum(it["count"] for it in f.items) == ev["kernels_count"]
    major = int(ev["compute_capability"].split(".")[0])
    if major >= 7:
        assert ev["compute_capability"] in f.recommendation


def _low_occupancy(f: Finding) -> None:
    limits = Counter(it["likely_limit"] for it in f.items)
    assert f.summary.endswith(f"most common limit: {limits.most_common(1)[0][0]}.")
    assert all(it["occupancy_pct"] < f.evidence["occupancy_threshold_pct"] for it in f.items)


def _small_batches(f: Finding) -> None:
    if len(f.items) < 10:
        assert sum(it["count"] for it in f.items) == f.evidence["kernels_count"]


def _cpu_bound_phase(f: Finding) -> None:
    ev = f.evidence
    assert f.title.startswith(f"{ev['phase']} outweighs the forward pass")
    means = {it["phase"]: it["mean_ms"] for it in f.items}
    assert means[ev["phase"]] == pytest.approx(ev["phase_mean_ms"])
    assert means["forward"] == pytest.approx(ev["forward_mean_ms"])
    assert means[ev["phase"]] >= means["forward"]
    assert ("The GPU waits" in f.recommendation) == bool(ev["gpu"])


def _tail_latency(f: Finding) -> None:
    ev = f.evidence
    slow = [it for it in f.items if it["slowest_1pct"]]
    assert len(slow) == ev["slow_requests_count"]
    assert all(it["duration_ms"] >= ev["p99_ms"] for it in slow)
    assert [it["duration_ms"] for it in f.items] == sorted((it["duration_ms"] for it in f.items), reverse=True)
    named = re.search(r"more time in phase (\S+)", f.summary)
    if named:
        largest = Counter(it["largest_phase"] for it in slow)
        assert largest[named.group(1)] * 2 > len(slow), (named.group(1), largest)
        assert named.group(1) != OUTSIDE_PHASES
    for t in ev["shared_traits"]:
        if t["kind"] == "numeric":
            assert not t["key"].endswith(("_ns", "_us", "_ms", "_s")), t


def _slow_replica(f: Finding) -> None:
    assert f.items[0]["instance"] == f.evidence["instance"]
    assert f.evidence["instance"] in f.scope and f.evidence["instance"] in f.title


def _queue_wait(f: Finding) -> None:
    assert f"spent {f.evidence['queue_wait_share']:.0%} of their time waiting" in f.summary


def _under_filled(f: Finding) -> None:
    ev = f.evidence
    if ev["fill_time_ms"] == ev["fill_time_ms"]:  # not NaN
        assert f"toward the {ev['fill_time_ms']:.1f} ms" in f.recommendation
    assert all(it["cut_reason"] for it in f.items)


def _share_outlier(f: Finding) -> None:
    if "method" in f.evidence:
        assert f.items[0]["method"] == f.evidence["method"] and f.evidence["method"] in f.title
    else:
        assert all(it["times_batch_median"] >= f.evidence["outlier_ratio_threshold"] for it in f.items)


def _rank(f: Finding) -> None:
    assert f.scope == f"rank {f.evidence['rank']}"


def _straggler(f: Finding) -> None:
    _rank(f)
    ev = f.evidence
    assert f"started {ev['last_count']} of {ev['matched_count']} collectives last" in f.summary
    assert f"waited {ev['others_waited_us'] / 1e3:.1f} ms" in f.summary


def _exposed(f: Finding) -> None:
    _rank(f)
    ev = f.evidence
    assert f.summary.startswith(f"{ev['exposed_us'] / 1e3:.1f} ms of {ev['communication_us'] / 1e3:.1f} ms")


def _replica_scope(f: Finding) -> None:
    assert f.scope.startswith(("replica ", "all replicas"))


CHECKS: dict[str, Callable[[Finding], None]] = {
    "gpu.low-utilization": _low_utilization,
    "gpu.launch-bound": _launch_bound,
    "cuda.host-sync": _host_sync,
    "cuda.pageable-copy": _pageable,
    "gpu.fp32-no-tensor-cores": _fp32,
    "gpu.low-occupancy": _low_occupancy,
    "batch.small-for-gpu": _small_batches,
    "request.cpu-bound-phase": _cpu_bound_phase,
    "request.tail-latency": _tail_latency,
    "request.slow-replica": _slow_replica,
    "batch.queue-wait": _queue_wait,
    "batch.under-filled": _under_filled,
    "batch.share-outlier": _share_outlier,
    "collective.straggler": _straggler,
    "collective.exposed-communication": _exposed,
    "gpu.oom": _replica_scope,
    "gpu.alloc-retries": _replica_scope,
    "gpu.memory-fragmentation": _replica_scope,
}
"""One claim checker per detector id."""


def check_finding(finding: Finding, gpu: bool = True) -> None:
    """Every rule for ``finding``; ``gpu``: whether its source ran on a GPU."""
    check_common(finding, gpu)
    CHECKS[finding.id](finding)


def checked_ids(findings: list[Finding], gpu: bool = True) -> set[str]:
    """Check every finding; returns the detector ids seen."""
    for f in findings:
        check_finding(f, gpu)
    return {f.id for f in findings}

