"""A synthetic fleet for tests, benchmarks and demos, written through the real paths: each replica's Kineto
trace and session summary through the artifact uploader (:mod:`zoomer_serve.artifacts`), its span data
(request spans and NVML / process CPU metric points) through stores and Parquet rotation
(:mod:`zoomer_serve.collector.rotation`), several collectors side by side.

The traces are one real Kineto trace (the caller's, e.g. a trace of ``shared/data/kineto``) with every
kernel's duration scaled per replica (a small per-kernel jitter on every replica), and the span data is drawn
from log-normal latencies. Perturbations, chosen by replica index:

- ``slow``: latency x ``slow_latency`` and kernels x ``slow_kernels``;
- ``cpu_hot``: process CPU utilization x 2;
- ``alloc_retries``: one allocator retry in every tenth request;
- ``kernel_mix``: the three kernels with the most time renamed (another library's kernels), and another
  ``zoomer.torch.version`` in its resource;
- ``corrupt``: its uploaded trace overwritten with other bytes (the manifest's size and checksum no longer
  match); ``unparsable``: a trace whose bytes match its manifest but are not JSON; ``bad_manifest``: its
  manifest replaced by text that is not JSON.

A second peer group (``second_gpu_share`` of the replicas, GPU model ``second_gpu``) runs every kernel
``second_gpu_kernels`` times longer and serves ``second_gpu_latency`` times slower: slower than the first
group, yet none of them is an outlier among its peers.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from zoomer_serve.analysis import labels as L
from zoomer_serve.artifacts.layout import MANIFEST_SUFFIX, TRACE_SUFFIX
from zoomer_serve.artifacts.session import SessionArtifacts
from zoomer_serve.artifacts.storage import filesystem, join, url_of
from zoomer_serve.artifacts.uploader import ArtifactUploader
from zoomer_serve.collector.rotation import ParquetConfig, ParquetRotator
from zoomer_serve.collector.store import SPAN_COLUMNS, Store, StoreConfig

METHOD = "zoomer.demo.v1.Ranker/Predict"
START_NS = 1_795_000_000_000_000_000  # 2026-11-18, a fixed time: the same fleet every run
WINDOW_NS = 3600 * 10**9
TORCH = "2.13.0"
OTHER_TORCH = "2.14.0.dev"
GPU = "NVIDIA A100-SXM4-80GB"


@dataclass
class FleetSpec:
    """What to build (see the module docstring); replica ``i`` is named ``replica-<i:04d>``."""

    replicas: int = 120
    service: str = "ranker"
    slow: tuple[int, ...] = ()
    cpu_hot: tuple[int, ...] = ()
    alloc_retries: tuple[int, ...] = ()
    kernel_mix: tuple[int, ...] = ()
    corrupt: tuple[int, ...] = ()
    unparsable: tuple[int, ...] = ()
    bad_manifest: tuple[int, ...] = ()
    slow_latency: float = 2.5
    slow_kernels: float = 1.8
    second_gpu: str = "NVIDIA V100-SXM2-32GB"
    second_gpu_share: float = 0.1
    second_gpu_kernels: float = 1.6
    second_gpu_latency: float = 1.3
    requests: int = 400
    requests_profiled: int = 10
    latency_ms: float = 12.0
    collectors: int = 4
    metric_points: int = 60
    spans: bool = True
    seed: int = 7


@dataclass
class FleetTruth:
    """What was injected, by instance: ``slow`` (every perturbation that should make an outlier), ``kernel_mix``,
    ``second_gpu`` (the other peer group), and the artifacts that must fail (``failed_traces``: trace URLs whose
    manifests are intact; ``failed_manifests``: manifest URLs)."""

    instances: list[str] = field(default_factory=list)
    slow: set[str] = field(default_factory=set)
    kernel_mix: set[str] = field(default_factory=set)
    second_gpu: set[str] = field(default_factory=set)
    failed_traces: set[str] = field(default_factory=set)
    failed_manifests: set[str] = field(default_factory=set)
    trace_bytes: int = 0
    span_rows: int = 0


def instance_name(i: int) -> str:
    return f"replica-{i:04d}"


def build_fleet(root: str, base_trace: str | Path, spec: FleetSpec) -> FleetTruth:
    """Write the fleet under ``root`` (URL or folder) and return what was injected."""
    rng = np.random.default_rng(spec.seed)
    base = json.loads(gzip.decompress(Path(base_trace).read_bytes()))
    truth = FleetTruth()
    second = set(range(spec.replicas - int(round(spec.replicas * spec.second_gpu_share)), spec.replicas))
    uploader = ArtifactUploader(max_pending=spec.replicas + 8, retries=2, backoff_s=0.05)
    with tempfile.TemporaryDirectory(prefix="zoomer-synthetic-") as tmp:
        folder = Path(tmp)
        for i in range(spec.replicas):
            inst = instance_name(i)
            truth.instances.append(inst)
            if i in spec.slow or i in spec.cpu_hot or i in spec.alloc_retries:
                truth.slow.add(inst)
            if i in spec.kernel_mix:
                truth.kernel_mix.add(inst)
            if i in second:
                truth.second_gpu.add(inst)
            resource = _resource(spec, i, second)
            files = _replica_files(folder, base, spec, i, second, rng)
            truth.trace_bytes += files[0].stat().st_size
            job = SessionArtifacts(root, uploader, resource).job(files[0].name.split(".")[0], files,
                                                                 START_NS + i * 10**9, START_NS + i * 10**9 + 5 * 10**9)
            if not uploader.submit(job):
                raise RuntimeError("synthetic fleet: upload queue full")
        uploader.close(timeout_s=600)
        if uploader.stats().files_failed:
            raise RuntimeError(f"synthetic fleet: uploads failed: {uploader.stats()}")
        _damage(root, spec, truth)
        if spec.spans:
            truth.span_rows = _write_spans(root, spec, second, rng, folder)
    return truth


def _resource(spec: FleetSpec, i: int, second: set[int]) -> dict[str, Any]:
    return {"service.name": spec.service, "service.instance.id": instance_name(i), "host.name": f"host-{i // 8:03d}",
            "process.pid": 1000 + i, "zoomer.gpu.model": spec.second_gpu if i in second else GPU,
            "zoomer.torch.version": OTHER_TORCH if i in spec.kernel_mix else TORCH,
            "zoomer.gpu.driver_version": "580.65.06", "service.version": "1.4.2"}


def _replica_files(folder: Path, base: dict[str, Any], spec: FleetSpec, i: int, second: set[int],
                   rng: np.random.Generator) -> list[Path]:
    scale = math.exp(rng.normal(0, 0.02))
    if i in spec.slow:
        scale *= spec.slow_kernels
    if i in second:
        scale *= spec.second_gpu_kernels
    events = []
    kernels = [e for e in base["traceEvents"] if e.get("cat") == "kernel"]
    by_time: dict[str, float] = {}
    for e in kernels:
        by_time[e["name"]] = by_time.get(e["name"], 0.0) + float(e.get("dur", 0))
    renamed = {n: f"cutlass3x_sm80_tensorop_s1688gemm_f32_{k}_align4" for k, n in
               enumerate(sorted(by_time, key=lambda n: -by_time[n])[:3])} if i in spec.kernel_mix else {}
    jitter: dict[str, float] = {}
    for e in base["traceEvents"]:
        if e.get("cat") == "kernel":
            e = dict(e)
            j = jitter.setdefault(e["name"], math.exp(rng.normal(0, 0.01)))
            e["dur"] = float(e["dur"]) * scale * j
            e["name"] = renamed.get(e["name"], e["name"])
        events.append(e)
    trace = dict(base, traceEvents=events)
    session = f"{spec.service}_replica{i:04d}_on_demand_1"
    path = folder / f"{session}{TRACE_SUFFIX}"
    if i in spec.unparsable:
        path.write_bytes(gzip.compress(b'{"traceEvents": [ {"ph": "X", "name": broken', compresslevel=1))
    else:
        path.write_bytes(gzip.compress(orjson.dumps(trace), compresslevel=1))
    summary = folder / f"{session}.summary.json"
    keys = [[f"{(i + 1) << 64 | k:032x}", f"{k + 1:016x}"] for k in range(spec.requests_profiled)]
    summary.write_text(json.dumps({"requests": [{"key": key} for key in keys]}), encoding="utf-8")
    return [path, summary]


def _damage(root: str, spec: FleetSpec, truth: FleetTruth) -> None:
    fs, base = filesystem(root)
    for path in sorted(fs.glob(join(base, "artifacts", "*", "*", "*", "*", "*" + TRACE_SUFFIX + MANIFEST_SUFFIX))):
        manifest = json.loads(fs.cat_file(path))
        i = int(manifest["instance"].rsplit("-", 1)[1])
        if i in spec.corrupt:
            fs.pipe_file(path[: -len(MANIFEST_SUFFIX)], b"\x1f\x8b not the file the manifest describes")
            truth.failed_traces.add(manifest["url"])
        elif i in spec.unparsable:
            truth.failed_traces.add(manifest["url"])
        elif i in spec.bad_manifest:
            fs.pipe_file(path, b"{ this is not a manifest")
            truth.failed_manifests.add(url_of(fs, path))


def _write_spans(root: str, spec: FleetSpec, second: set[int], rng: np.random.Generator, folder: Path) -> int:
    """Request spans and metric points of every replica, through ``spec.collectors`` stores rotating to Parquet."""
    collectors = []
    for c in range(spec.collectors):
        store = Store(folder / f"collector-{c}.duckdb", StoreConfig(max_queued_rows=10**7, batch_rows=50_000))
        collectors.append((store, ParquetRotator(store, ParquetConfig(root, rotate_s=3600))))
    rows = 0
    try:
        for i in range(spec.replicas):
            store = collectors[i % spec.collectors][0]
            spans = _spans(spec, i, second, rng)
            points = _points(spec, i, rng)
            store.submit("spans", spans)
            store.submit("metric_points", points)
            rows += len(spans) + len(points)
        for store, rotator in collectors:
            store.flush()
            rotator.stop()
            if rotator.stats().failed:
                raise RuntimeError(f"synthetic fleet: rotation failed: {rotator.stats().last_error}")
    finally:
        for store, _ in collectors:
            store.close()
    return rows


def _spans(spec: FleetSpec, i: int, second: set[int], rng: np.random.Generator) -> list[tuple[Any, ...]]:
    inst = instance_name(i)
    factor = math.exp(rng.normal(0, 0.03))
    if i in spec.slow:
        factor *= spec.slow_latency
    if i in second:
        factor *= spec.second_gpu_latency
    n = spec.requests
    durations = rng.lognormal(math.log(spec.latency_ms * 1e6 * factor), 0.2, n).astype(np.int64)
    starts = START_NS + np.sort(rng.integers(0, WINDOW_NS, n))
    resource = json.dumps(_resource(spec, i, second))
    out = []
    for k in range(n):
        attrs: dict[str, Any] = {L.RPC_METHOD: METHOD, L.RPC_STATUS: "OK"}
        if i in spec.alloc_retries and k % 10 == 0:
            attrs[L.GPU_MEMORY_ALLOC_RETRIES] = 1
        row = {"trace_id": f"{(i + 1) << 64 | k:032x}", "span_id": f"{k + 1:016x}", "parent_span_id": None,
               "name": METHOD, "kind": "SERVER", "start_ns": int(starts[k]), "end_ns": int(starts[k] + durations[k]),
               "duration_ns": int(durations[k]), "status_code": "UNSET", "status_message": "",
               "service_name": spec.service, "service_instance_id": inst, "scope_name": "zoomer_serve",
               "attributes": json.dumps(attrs), "resource_attributes": resource, "events": "[]", "links": "[]",
               "received_ns": int(starts[k] + durations[k])}
        out.append(tuple(row[c] for c, _, _ in SPAN_COLUMNS))
    return out


def _points(spec: FleetSpec, i: int, rng: np.random.Generator) -> list[tuple[Any, ...]]:
    from zoomer_serve.collector.store import METRIC_COLUMNS

    inst = instance_name(i)
    cpu = 0.35 * math.exp(rng.normal(0, 0.04)) * (2.0 if i in spec.cpu_hot else 1.0)
    gpu = 0.6 * math.exp(rng.normal(0, 0.03))
    out = []
    step = WINDOW_NS // spec.metric_points
    for k in range(spec.metric_points):
        t = START_NS + k * step
        for name, value, attrs in ((L.METRIC_GPU_UTILIZATION, gpu * math.exp(rng.normal(0, 0.02)), {L.METRIC_HW_ID: "0"}),
                                   ("process.cpu.utilization", cpu * math.exp(rng.normal(0, 0.02)), {})):
            row = {"metric_name": name, "description": "", "unit": "1", "metric_type": "gauge",
                   "service_name": spec.service, "service_instance_id": inst, "scope_name": "zoomer_serve",
                   "start_ns": None, "time_ns": t, "attributes": json.dumps(attrs), "resource_attributes": "{}",
                   "value": float(value), "count": None, "sum": None, "min": None, "max": None,
                   "bucket_counts": None, "explicit_bounds": None, "is_monotonic": None,
                   "aggregation_temporality": None, "quantile_values": None, "exponential_buckets": None,
                   "received_ns": t}
            out.append(tuple(row[c] for c, _, _ in METRIC_COLUMNS))
    return out


def remove(root: str) -> None:
    """Remove a local synthetic fleet."""
    shutil.rmtree(root, ignore_errors=True)
