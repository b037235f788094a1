"""Request-level detectors over a real store: zoomer-serve request spans recorded with the real recorder,
exported over real OTLP/gRPC into the real embedded collector, one ``configure()`` per replica (its own
``service.instance.id``). Span timestamps are chosen by the test (``start(start_ns=...)``, ``end(end_ns)``,
``add_child``: what ``phase()`` records), so the latency figures the detectors see are known exactly."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import zoomer_serve
from zoomer_serve.analysis import analyze_store
from zoomer_serve.analysis import labels as L
from zoomer_serve.analysis.store import load_store, request_percentiles
from zoomer_serve.recording import records as r

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _finding_claims import check_finding, checked_ids

METHOD = "ranker.Ranker/Predict"
MS = 1_000_000
BASE_NS = 1_700_000_000_000_000_000


@dataclass
class Req:
    """One request to record: phases (name, ms) run back to back from the request start."""

    phases: list[tuple[str, float]]
    extra_ms: float = 0.5
    attrs: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    method: str = METHOD


def record_replica(collector: Any, instance: str, requests: Iterable[Req], t0_ns: int,
                   service: str = "ranker") -> list[tuple[str, float]]:
    """Configure telemetry as replica ``instance`` and record ``requests`` 10 ms apart; returns
    (trace_id hex, duration ms) per request."""
    zoomer_serve.configure(service_name=service, endpoint=collector.grpc_endpoint, protocol="grpc",
                           export_mode="thread", schedule_delay_ms=50, timeout_ms=5000,
                           resource_attributes={"service.instance.id": instance}, set_global_providers=False)
    rec = zoomer_serve.get_recorder()
    out = []
    t = t0_ns
    for req in requests:
        span = rec.start(req.method, attributes={"rpc.method": req.method, "rpc.system.name": "grpc",
                                                 **req.attrs}, start_ns=t)
        cursor = t
        for name, ms in req.phases:
            end = cursor + int(ms * MS)
            span.add_child(name, cursor, end, {L.PHASE_ATTRIBUTE: name})
            cursor = end
        end_ns = cursor + int(req.extra_ms * MS)
        if req.error:
            span.set_attribute("error.type", req.error)
            span.set_attribute("rpc.response.status_code", "RESOURCE_EXHAUSTED")
            span.set_status(r.STATUS_ERROR, req.error)
        else:
            span.set_attribute("rpc.response.status_code", "OK")
        span.end(end_ns)
        out.append((f"{span.trace_id:032x}", (end_ns - t) / MS))
        t += 10 * MS
    zoomer_serve.shutdown(timeout_s=5)
    return out


def normal(n: int, seed: int, pre: float = 0.4, fwd: float = 2.0, post: float = 0.3) -> list[Req]:
    rnd = random.Random(seed)
    return [Req([("preprocess", pre * rnd.uniform(0.9, 1.1)), ("forward", fwd * rnd.uniform(0.9, 1.1)),
                 ("postprocess", post * rnd.uniform(0.9, 1.1))]) for _ in range(n)]


def by_id(findings: list[Any], fid: str) -> list[Any]:
    return [f for f in findings if f.id == fid]


@pytest.mark.slow
def test_slow_replica_is_named_with_its_slow_phase(collector: Any) -> None:
    """Three replicas; replica-c's preprocess is 20x slower. It is named as the slow replica, with the
    preprocess phase as the difference, and no other replica is flagged."""
    record_replica(collector, "replica-a", normal(40, 1), BASE_NS)
    record_replica(collector, "replica-b", normal(40, 2), BASE_NS + 1000 * MS)
    record_replica(collector, "replica-c", normal(40, 3, pre=8.0), BASE_NS + 2000 * MS)
    collector.finish()

    data = load_store(collector.store_path)
    assert len(data.requests) == 120
    assert sorted(set(data.requests["instance"].tolist())) == ["replica-a", "replica-b", "replica-c"]
    assert len(data.phases) == 360

    findings = analyze_store(collector.store_path)
    assert checked_ids(findings, gpu=False) >= {"request.slow-replica", "request.cpu-bound-phase"}
    slow = by_id(findings, "request.slow-replica")
    assert [f.evidence["instance"] for f in slow] == ["replica-c"]
    ev = slow[0].evidence
    # medians: a, b ~ 0.4 + 2.0 + 0.3 + 0.5 = 3.2 ms; c ~ 8 + 2.3 + 0.5 = 10.8 ms
    assert 9.5 < ev["p50_ms"] < 12.0 and 2.9 < ev["others_p50_ms"] < 3.5
    assert ev["ratio"] > 3 and slow[0].severity == "high"
    assert ev["phase_difference"]["phase"] == "preprocess"
    assert [i["instance"] for i in slow[0].items][0] == "replica-c"
    assert "replica-c" in slow[0].scope and METHOD in slow[0].scope
    # the slow replica's preprocess (8 ms) outweighs its forward pass (2 ms) -> CPU-bound phase overall
    cpu = by_id(findings, "request.cpu-bound-phase")
    assert [f.evidence["phase"] for f in cpu] == ["preprocess"]
    assert cpu[0].evidence["ratio"] == pytest.approx((0.4 * 80 + 8.0 * 40) / 120 / 2.0, rel=0.05)


def test_cpu_bound_phase_states_the_sample_its_cpu_share_rests_on(collector: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-request CPU time is measured on a sample of requests (every request of a profiling session, 1 in N
    outside): the CPU-bound-phase finding gives the threads' CPU share of the requests that carry it and says on
    how many of the method's requests it rests. A method none of whose spans carry it gets no such sentence."""
    monkeypatch.setenv("ZOOMER_HOST_REQUEST_CPU_TIME", "false")  # the test sets the attribute itself
    sampled = [Req([("preprocess", 4.0), ("forward", 2.0), ("postprocess", 0.3)]) for _ in range(40)]
    for k in (0, 8, 16, 24, 32):
        sampled[k].attrs[L.REQUEST_CPU_TIME] = int(0.5 * 6.8 * MS)  # half of the 6.8 ms request
    unmeasured = [Req([("preprocess", 4.0), ("forward", 2.0), ("postprocess", 0.3)], method="ranker.Ranker/Other")
                  for _ in range(20)]
    record_replica(collector, "solo", sampled + unmeasured, BASE_NS)
    collector.finish()
    cpu = {f.scope: f for f in by_id(analyze_store(collector.store_path), "request.cpu-bound-phase")}
    measured, other = cpu[f"ranker {METHOD}"], cpu["ranker ranker.Ranker/Other"]
    assert measured.evidence["requests_count"] == 40 and measured.evidence["request_cpu_measured_count"] == 5
    assert measured.evidence["request_cpu_share"] == pytest.approx(0.5, abs=0.01)
    assert ("on a CPU for 50% of their time (thread CPU time measured on 5 of these 40 requests)"
            in measured.summary), measured.summary
    assert "request_cpu_share" not in other.evidence and "request_cpu_measured_count" not in other.evidence
    assert "on a CPU" not in other.summary


def test_balanced_fleet_has_no_request_findings(collector: Any) -> None:
    """Three equal replicas, preprocess < forward, no tail: no slow replica, no CPU-bound phase, no tail."""
    for k, inst in enumerate(("a", "b", "c")):
        record_replica(collector, inst, normal(30, 10 + k), BASE_NS + k * 1000 * MS)
    collector.finish()
    findings = analyze_store(collector.store_path)
    assert findings == []
    pct = request_percentiles(load_store(collector.store_path))
    assert pct.rows()[0]["count"] == 90
    assert 3.0 < pct.rows()[0]["p50_ms"] < 3.5


def test_tail_latency_names_the_slowest_traces_and_their_shared_trait(collector: Any) -> None:
    """One replica, 200 requests; 4 of them carry a large batch and spend 60 ms in forward. The tail finding
    lists those traces first and says they share a larger batch size and the forward phase."""
    reqs = normal(200, 7)
    for req in reqs:
        req.attrs["app.batch_size"] = 8
    slow_at = [20, 70, 120, 170]
    for i in slow_at:
        reqs[i] = Req([("preprocess", 0.4), ("forward", 60.0), ("postprocess", 0.3)], attrs={"app.batch_size": 512})
    recorded = record_replica(collector, "solo", reqs, BASE_NS)
    collector.finish()
    findings = analyze_store(collector.store_path)
    tail = by_id(findings, "request.tail-latency")
    assert len(tail) == 1
    f = tail[0]
    check_finding(f, gpu=False)
    assert f.evidence["p99_over_p50"] > 10
    slow_ids = {recorded[i][0] for i in slow_at}
    assert {item["trace_id"] for item in f.items[:4]} == slow_ids
    assert f.items[0]["largest_phase"] == "forward"
    traits = {t["kind"]: t for t in f.evidence["shared_traits"]}
    assert traits["numeric"]["key"] == "app.batch_size" and traits["numeric"]["median_slow"] == 512
    assert traits["phase"]["phase"] == "forward"
    assert "app.batch_size" in f.summary


def test_gpu_memory_findings_from_span_attributes(collector: Any) -> None:
    """GPU memory attributes as the GPU telemetry writes them: replica gpu-1 reserves 6 GiB for a 1 GiB peak
    and hit allocator retries and one OOM request; replica gpu-0 is healthy."""
    gib = 1 << 30

    def mem(reserved: int, allocated: int, peak: int, retries: int = 0, ooms: int = 0) -> dict[str, Any]:
        return {L.GPU_MEMORY_RESERVED: reserved, L.GPU_MEMORY_ALLOCATED: allocated, L.GPU_MEMORY_PEAK: peak,
                L.GPU_MEMORY_ALLOC_RETRIES: retries, L.GPU_MEMORY_OOMS: ooms}

    healthy = normal(20, 5)
    for req in healthy:
        req.attrs.update(mem(int(1.2 * gib), gib // 2, gib))
    bad = normal(20, 6)
    for k, req in enumerate(bad):
        req.attrs.update(mem(6 * gib, gib // 2, gib, retries=2 if k in (3, 9) else 0, ooms=1 if k == 15 else 0))
    bad[15].error = "torch.OutOfMemoryError"
    record_replica(collector, "gpu-0", healthy, BASE_NS)
    record_replica(collector, "gpu-1", bad, BASE_NS + 1000 * MS)
    collector.finish()

    findings = analyze_store(collector.store_path)
    assert checked_ids(findings, gpu=True) >= {"gpu.memory-fragmentation", "gpu.alloc-retries", "gpu.oom"}
    frag = by_id(findings, "gpu.memory-fragmentation")
    assert [f.scope for f in frag] == ["replica gpu-1"]
    assert frag[0].evidence["reserved_over_peak"] == pytest.approx(6.0)
    assert frag[0].evidence["unused_reserved_bytes"] == 5 * gib
    assert "expandable_segments" in frag[0].recommendation
    retries = by_id(findings, "gpu.alloc-retries")
    assert [(f.scope, f.evidence["alloc_retries"], f.evidence["requests_with_retries_count"]) for f in retries] == [
        ("replica gpu-1", 4, 2)]
    oom = by_id(findings, "gpu.oom")
    assert [(f.scope, f.evidence["oom_requests_count"], f.evidence["num_ooms"]) for f in oom] == [
        ("replica gpu-1", 1, 1)]


def test_store_errors_are_clear(tmp_path: Any) -> None:
    from zoomer_serve.analysis.store import StoreAnalysisError

    with pytest.raises(FileNotFoundError):
        analyze_store(tmp_path / "missing.duckdb")
    bad = tmp_path / "not-a-store.duckdb"
    bad.write_bytes(b"this is not duckdb")
    with pytest.raises(StoreAnalysisError, match="not-a-store"):
        analyze_store(bad)

