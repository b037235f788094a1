"""Host-telemetry rows for the overhead benchmark: what host telemetry costs the request path and the process,
and what the Python CPU sampler adds to the server's latency inside a profiling session, measured on the real
demo model server (CPU). Rows are ``{"what", "value", "unit"}``; run this file to print them.

- :func:`request_path_cost`: µs per request of ``RequestRecorder.start`` + ``RequestSpan.end`` without and
  with the per-request CPU time observer, measuring every request or its default 1-in-16 sample (timeit, best
  of ``repeat``; in a hot loop the reads cost little: their cost in a busy server is in benchmarks/RESULTS.md). The metrics add nothing per request:
  they are observed on the SDK reader's thread.
- :func:`collection_cost`: ms of CPU for one collection of every host metric (psutil, on the reader's thread,
  once per ``OTEL_METRIC_EXPORT_INTERVAL``), and µs added to a generation-0 garbage collection by the GC pause
  callback.
- :func:`host_latency_rows`: client-side ``Predict`` latency of the same load with host telemetry's request
  observer off and on (rounds interleaved).
- :func:`sampler_latency_rows`: client-side ``Predict`` latency inside profiling sessions that cover the same
  number of calls, without a CPU sampler, with py-spy, and with the in-process sampler (rounds interleaved),
  plus the helper processes' CPU (py-spy and the post-processing child) per session.
- :func:`sampler_cost`: py-spy's own CPU (share of a core) and the interpreter-lock time of one in-process
  sample, with the demo server under load in this process.
- :func:`host_rows`: all of them; the overhead benchmark's owner integrates them.
"""

from __future__ import annotations

import gc
import resource
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zoomer_serve.host.config import DEFAULT_RATE_HZ, DEFAULT_REQUEST_CPU_TIME_ONE_IN

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def request_path_cost(number: int = 50_000, repeat: int = 5, one_in: int = 1) -> dict[str, float]:
    """µs per request: ``off`` (no host observer), ``on`` (the CPU time observer measuring 1 in ``one_in``
    requests: 1, every one, as inside a profiling session), ``added``."""
    import zoomer_serve
    from zoomer_serve.host import RequestCpuTimeObserver

    telemetry = zoomer_serve.configure(service_name="bench-host", export_mode="none")
    recorder = telemetry.recorder
    for observer in recorder.observers:
        recorder.remove_observer(observer)

    def per_request_us() -> float:
        return min(timeit.repeat(lambda: recorder.start("bench.Service/Method").end(), number=number,
                                 repeat=repeat)) / number * 1e6

    off = per_request_us()
    recorder.add_observer(RequestCpuTimeObserver(one_in))
    on = per_request_us()
    zoomer_serve.shutdown()
    return {"off": off, "on": on, "added": on - off}


def collection_cost(collections: int = 20) -> dict[str, float]:
    """``collect_ms``: CPU ms (thread time) of one collection of every host metric, best of ``collections``;
    ``points``: data points per collection; ``gc_added_us``: µs the GC callback adds to one ``gc.collect(0)``
    (best of 2000)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from zoomer_serve.host import GcPauses, HostMetrics, known_metrics

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = HostMetrics(known_metrics(), provider)
    reader.get_metrics_data()  # first collection primes psutil's deltas
    best = float("inf")
    points = 0
    for _ in range(collections):
        t0 = time.thread_time_ns()
        data = reader.get_metrics_data()
        best = min(best, (time.thread_time_ns() - t0) / 1e6)
        if data is None:  # nothing collected this time
            continue
        points = sum(len(list(m.data.data_points)) for rm in data.resource_metrics for sm in rm.scope_metrics
                     for m in sm.metrics)
    metrics.close()
    provider.shutdown()

    def gc0_us() -> float:
        return min(timeit.repeat(lambda: gc.collect(0), number=200, repeat=10)) / 200 * 1e6

    bare = gc0_us()
    pauses = GcPauses()
    pauses.install()
    try:
        with_cb = gc0_us()
    finally:
        pauses.uninstall()
    return {"collect_ms": best, "points": points, "gc_added_us": with_cb - bare}


def _predict_latency(target: str, n_requests: int, clients: int, batch_size: int) -> tuple[float, float]:
    from zoomer_serve.demo.load import drive_load

    result = drive_load(target, 120.0, clients=clients, batch_size=batch_size, max_requests=n_requests,
                        stream_share=0.0, invalid_share=0.0)
    if result.unexpected:
        raise RuntimeError(f"{result.unexpected} calls failed during the host benchmark")
    return result.p50_ms, result.p99_ms


def _demo_server(telemetry: Any, slow_preprocess: int = 0) -> tuple[Any, str]:
    from interceptors import ZoomerServerInterceptor
    from zoomer_serve.demo.model import build_model
    from zoomer_serve.demo.service import ServiceConfig, build_server

    server, port = build_server(build_model(device="cpu"), interceptors=[ZoomerServerInterceptor(
        telemetry.recorder)], max_workers=4, config=ServiceConfig(slow_preprocess_iterations=slow_preprocess))
    return server, f"127.0.0.1:{port}"


def _median_rows(label: str, runs: dict[str, list[tuple[float, float]]], base: str) -> list[dict[str, Any]]:
    rows = []
    p50 = {k: statistics.median(v[0] for v in runs[k]) for k in runs}
    p99 = {k: statistics.median(v[1] for v in runs[k]) for k in runs}
    for k in runs:
        rows.append({"what": f"{label} p50, {k}", "value": round(p50[k], 3), "unit": "ms"})
        rows.append({"what": f"{label} p99, {k}", "value": round(p99[k], 3), "unit": "ms"})
    for k in runs:
        if k != base:
            rows.append({"what": f"{label} p50 added, {k} vs {base}",
                         "value": round((p50[k] - p50[base]) / p50[base] * 100, 2), "unit": "%"})
    return rows


def _paired_round_rows(label: str, runs: dict[str, list[tuple[float, float]]], base: str) -> list[dict[str, Any]]:
    """Per round, each configuration's p50 against the base's p50 of the same round (the rounds rotate the
    order, so neighbours in time are compared); the median and the spread of those ratios, in %."""
    rows = []
    for k in runs:
        if k == base:
            continue
        added = [(mine[0] / ref[0] - 1) * 100 for mine, ref in zip(runs[k], runs[base]) if ref[0] > 0]
        if not added:
            continue
        rows.append({"what": f"{label} p50 added per round (median of {len(added)}), {k} vs {base}",
                     "value": round(statistics.median(added), 2), "unit": "%"})
        rows.append({"what": f"{label} p50 added per round, lowest .. highest, {k} vs {base}",
                     "value": f"{min(added):.1f} .. {max(added):.1f}", "unit": "%"})
    return rows


def host_latency_rows(n_requests: int = 300, rounds: int = 3, clients: int = 4,
                      batch_size: int = 64) -> list[dict[str, Any]]:
    """``Predict`` latency with host telemetry's request observer off and on, ``rounds`` interleaved rounds of
    ``n_requests`` calls (the order alternating); the median of the rounds' p50 / p99 and the added p50 (%)."""
    import torch

    import zoomer_serve

    torch.set_num_threads(1)
    telemetry = zoomer_serve.configure(service_name="bench-host", export_mode="none")
    observer = telemetry.host.request_cpu
    server, target = _demo_server(telemetry)
    runs: dict[str, list[tuple[float, float]]] = {"host telemetry off": [], "host telemetry on": []}
    try:
        _predict_latency(target, n_requests, clients, batch_size)  # warm-up
        for i in range(rounds):
            for on in ((False, True) if i % 2 == 0 else (True, False)):  # alternate the order against drift
                if on:
                    telemetry.recorder.add_observer(observer)
                else:
                    telemetry.recorder.remove_observer(observer)
                key = "host telemetry on" if on else "host telemetry off"
                runs[key].append(_predict_latency(target, n_requests, clients, batch_size))
    finally:
        server.stop(None).wait(5)
        zoomer_serve.shutdown()
    return _median_rows("Predict", runs, "host telemetry off")


def sampler_latency_rows(n_requests: int = 200, rounds: int = 3, clients: int = 4, batch_size: int = 64,
                         slow_preprocess: int = 0, rate_hz: int = DEFAULT_RATE_HZ) -> list[dict[str, Any]]:
    """``Predict`` latency inside profiling sessions covering ``n_requests`` calls each: no CPU sampler, py-spy
    (when it can attach here; else that row is missing and a row says why), the in-process sampler; plus the
    CPU seconds of the helper processes (py-spy, post-processing) per session."""
    import torch

    import zoomer_serve
    from zoomer_serve.host import CpuProfiler, HostConfig
    from zoomer_serve.profiling import ProfilerConfig, ProfilerController, SessionOptions

    torch.set_num_threads(1)
    telemetry = zoomer_serve.configure(service_name="bench-host", export_mode="none")
    server, target = _demo_server(telemetry, slow_preprocess)
    samplers: dict[str, list[Any]] = {
        "no CPU sampler": [],
        "py-spy": [CpuProfiler(HostConfig(cpu_profile="py-spy", cpu_profile_rate_hz=rate_hz))],
        "in-process sampler": [CpuProfiler(HostConfig(cpu_profile="in-process", cpu_profile_rate_hz=rate_hz))],
    }
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in samplers}
    helper_cpu: dict[str, list[float]] = {k: [] for k in samplers}
    notes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        controller = ProfilerController(ProfilerConfig(profiles_dir=Path(tmp)), telemetry).attach()
        try:
            _predict_latency(target, n_requests, clients, batch_size)  # warm-up
            names = list(samplers)
            for i in range(rounds):
                for name in names[i % len(names):] + names[:i % len(names)]:  # rotate the order against drift
                    companions = samplers[name]
                    controller.companions = companions
                    before = _children_cpu_s()
                    controller.start(SessionOptions(max_requests=n_requests, cuda=False))
                    latency = _predict_latency(target, n_requests, clients, batch_size)
                    if not controller.wait_idle(120):
                        raise RuntimeError("the profiling session did not finish")
                    attrs = controller._last.extra_attributes if controller._last is not None else {}
                    if name == "py-spy" and attrs.get("zoomer.profile.cpu.sampler") != "py-spy":
                        notes = [{"what": "py-spy rows left out", "value": attrs.get(
                            "zoomer.profile.cpu.unavailable", "py-spy did not sample"), "unit": ""}]
                        continue
                    runs[name].append(latency)
                    helper_cpu[name].append(_children_cpu_s() - before)
        finally:
            controller.close()
            server.stop(None).wait(5)
            zoomer_serve.shutdown()
    runs = {k: v for k, v in runs.items() if v}
    label = f"Predict inside a session ({clients} clients, {rate_hz} Hz)"
    rows = _median_rows(label, runs, "no CPU sampler")
    rows += _paired_round_rows(label, runs, "no CPU sampler")
    for name in runs:
        rows.append({"what": f"helper-process CPU per session ({n_requests} calls), {name}",
                     "value": round(statistics.median(helper_cpu[name]), 3), "unit": "s"})
    return rows + notes


def sampler_cost(rate_hz: int = DEFAULT_RATE_HZ, seconds: float = 4.0, clients: int = 2,
                 batch_size: int = 64) -> list[dict[str, Any]]:
    """What each sampler costs while the demo server (in this process) answers load: py-spy's own CPU as a share
    of one core (a separate, niced process; startup included), and the interpreter-lock time of one in-process
    sample of every thread (µs) with the share of a core it adds at ``rate_hz``."""
    import os
    import threading

    import torch

    import zoomer_serve
    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.host import HostConfig, InProcessSampler, PySpySampler, SamplerUnavailable

    torch.set_num_threads(1)
    telemetry = zoomer_serve.configure(service_name="bench-host", export_mode="none")
    server, target = _demo_server(telemetry)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            drive_load(target, 1.0, clients=clients, batch_size=batch_size, stream_share=0.0, invalid_share=0.0)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(1.0)
        threads = len(os.listdir(f"/proc/{os.getpid()}/task"))
        before = _children_cpu_s()
        try:
            pyspy = PySpySampler.start(HostConfig(cpu_profile_rate_hz=rate_hz), os.getpid(), seconds + 60)
            time.sleep(seconds)
            pyspy.stop()
            with tempfile.TemporaryDirectory() as tmp:
                pyspy.write(Path(tmp) / "p.json")
            share = (_children_cpu_s() - before) / seconds * 100
            rows.append({"what": f"py-spy helper CPU at {rate_hz} Hz, {threads} threads", "value": round(share, 2),
                         "unit": "% of a core"})
        except SamplerUnavailable as exc:
            rows.append({"what": "py-spy helper CPU", "value": f"not measured: {exc}", "unit": ""})
        sampler = InProcessSampler(rate_hz, 60)
        sampler._me = threading.get_ident()
        costs = []
        for _ in range(int(seconds * rate_hz)):
            t0 = time.thread_time_ns()
            sampler.sample()
            costs.append((time.thread_time_ns() - t0) / 1e3)
            time.sleep(1 / rate_hz)
        per = statistics.median(costs)
        rows.append({"what": f"in-process sampler, one sample of {threads} threads (lock held)",
                     "value": round(per, 1), "unit": "µs"})
        rows.append({"what": f"in-process sampler at {rate_hz} Hz", "value": round(per * rate_hz / 1e4, 2),
                     "unit": "% of a core"})
    finally:
        stop.set()
        thread.join(30)
        server.stop(None).wait(5)
        zoomer_serve.shutdown()
    return rows


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def host_rows(quick: bool = False) -> list[dict[str, Any]]:
    """Every host row (``quick``: fewer calls and rounds)."""
    rounds = 2 if quick else 3
    cost = request_path_cost(number=10_000 if quick else 50_000)
    sampled = request_path_cost(number=10_000 if quick else 50_000, one_in=DEFAULT_REQUEST_CPU_TIME_ONE_IN)
    coll = collection_cost()
    rows = [
        {"what": "recorder start+end, no host observer", "value": round(cost["off"], 3), "unit": "µs"},
        {"what": "added by the request CPU time observer, every request measured", "value": round(cost["added"], 3),
         "unit": "µs"},
        {"what": f"added by the request CPU time observer, 1 in {DEFAULT_REQUEST_CPU_TIME_ONE_IN} (the default)",
         "value": round(sampled["added"], 3), "unit": "µs"},
        {"what": "one collection of every host metric (reader thread)", "value": round(coll["collect_ms"], 3),
         "unit": "ms CPU"},
        {"what": "host metric data points per collection", "value": coll["points"], "unit": "points"},
        {"what": "added to gc.collect(0) by the GC pause callback", "value": round(coll["gc_added_us"], 3),
         "unit": "µs"},
    ]
    rows += host_latency_rows(n_requests=150 if quick else 300, rounds=rounds)
    rows += sampler_cost(seconds=2.0 if quick else 4.0)  # at the default rate ...
    rows += sampler_cost(rate_hz=100, seconds=2.0 if quick else 4.0)  # ... and at py-spy's own default
    rows += sampler_latency_rows(n_requests=100 if quick else 150, rounds=rounds if quick else 8)
    return rows


def _print(rows: list[dict[str, Any]], out: Callable[[str], None] = print) -> None:
    for row in rows:
        out(f"{row['what']:<64} {row['value']!s:>12} {row['unit']}")


if __name__ == "__main__":
    _print(host_rows(quick="--quick" in sys.argv))
