"""Kernel-profiling rows for the overhead benchmark: what the profiling controller costs a request outside
a session (the state check) and inside one (the request range, the Kineto step, and the profiler's own
per-operator recording), measured on the real demo model server.

- :func:`observer_cost`: request-path µs of ``RequestRecorder.start`` + ``RequestSpan.end`` without and with
  an idle controller attached (timeit, best of ``repeat``), and of one request range plus Kineto step inside
  a running CPU session.
- :func:`session_latency_rows`: client-side latency of the same load of ``Predict`` calls outside a session and
  inside a session that covers exactly those calls (rounds interleaved). Works on CPU and on CUDA
  (``benchmarks/gpu_check.py`` calls it).
- :func:`profiling_rows`: both on the CPU demo server; returns rows ``{"what", "value", "unit"}``. Run this
  file to print them.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def observer_cost(number: int = 50_000, repeat: int = 5) -> dict[str, float]:
    """µs per request: ``recorder_off`` / ``recorder_idle``: a recorder start + end without / with an idle
    controller attached; ``idle_added``: their difference (the state checks); ``in_session``: one request
    range (enter + exit) and Kineto step inside a running CPU session (the profiler's per-operator cost of
    the request's own work comes on top; see :func:`session_latency_rows`)."""
    import zoomer_serve
    from zoomer_serve.profiling import ProfilerConfig, ProfilerController, SessionOptions

    telemetry = zoomer_serve.configure(service_name="bench-profiling", export_mode="none")
    recorder = telemetry.recorder

    def per_request_us(n: int = number, runs: int = repeat) -> float:
        return min(timeit.repeat(lambda: recorder.start("bench.Service/Method").end(), number=n, repeat=runs)) / n * 1e6

    off = per_request_us()
    with tempfile.TemporaryDirectory() as tmp:
        controller = ProfilerController(ProfilerConfig(profiles_dir=Path(tmp)), telemetry).attach()
        idle = per_request_us()
        controller.start(SessionOptions(max_requests=1000, cuda=False))
        inside = per_request_us(900, 1)  # within the session's bound, so every one is covered
        controller.close(timeout_s=120)
    zoomer_serve.shutdown()
    return {"recorder_off": off, "recorder_idle": idle, "idle_added": idle - off, "in_session": inside - off}


def session_latency_rows(target: str, controller: Any, n_requests: int = 200, clients: int = 4,
                         batch_size: int = 64, rounds: int = 3, cuda: bool | None = None) -> list[dict[str, Any]]:
    """Client-side ``Predict`` latency (ms) of ``n_requests`` calls outside a session and inside a session
    bounded to exactly those calls, ``rounds`` times interleaved; the median of the rounds' p50 / p99 and the
    added p50 in µs. ``controller`` is attached to the server at ``target`` (and idle)."""
    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.profiling import SessionOptions

    def run() -> tuple[float, float]:
        result = drive_load(target, 120.0, clients=clients, batch_size=batch_size, max_requests=n_requests,
                            stream_share=0.0, invalid_share=0.0)
        if result.unexpected:
            raise RuntimeError(f"{result.unexpected} calls failed during the profiling benchmark")
        return result.p50_ms, result.p99_ms

    run()  # warm-up
    outside, inside = [], []
    for _ in range(rounds):
        outside.append(run())
        controller.start(SessionOptions(max_requests=n_requests, cuda=cuda))
        inside.append(run())
        if not controller.wait_idle(120):
            raise RuntimeError("the profiling session did not finish")
    p50_out, p99_out = (statistics.median(v) for v in zip(*outside))
    p50_in, p99_in = (statistics.median(v) for v in zip(*inside))
    last = controller.last
    return [
        {"what": "Predict p50, no session", "value": round(p50_out, 3), "unit": "ms"},
        {"what": "Predict p50, inside a session", "value": round(p50_in, 3), "unit": "ms"},
        {"what": "Predict p99, no session", "value": round(p99_out, 3), "unit": "ms"},
        {"what": "Predict p99, inside a session", "value": round(p99_in, 3), "unit": "ms"},
        {"what": "added p50 inside a session", "value": round((p50_in - p50_out) * 1000), "unit": "µs"},
        {"what": "requests covered by the last session", "value": last.requests if last else 0, "unit": "requests"},
    ]


def profiling_rows(n_requests: int = 200, rounds: int = 3) -> list[dict[str, Any]]:
    """:func:`observer_cost` and :func:`session_latency_rows` on the CPU demo server (4 workers, batch 64)."""
    import torch

    import zoomer_serve
    from interceptors import ZoomerServerInterceptor
    from zoomer_serve.demo.model import build_model
    from zoomer_serve.demo.service import build_server
    from zoomer_serve.profiling import ProfilerConfig, ProfilerController

    cost = observer_cost()
    rows = [{"what": "recorder start+end, no controller", "value": round(cost["recorder_off"], 3), "unit": "µs"},
            {"what": "added by an idle controller (state checks)", "value": round(cost["idle_added"], 3),
             "unit": "µs"},
            {"what": "added inside a session (range + Kineto step)", "value": round(cost["in_session"], 3),
             "unit": "µs"}]
    torch.set_num_threads(1)
    telemetry = zoomer_serve.configure(service_name="bench-profiling", export_mode="none")
    with tempfile.TemporaryDirectory() as tmp:
        controller = ProfilerController(ProfilerConfig(profiles_dir=Path(tmp)), telemetry).attach()
        server, port = build_server(build_model(device="cpu"), interceptors=[ZoomerServerInterceptor(
            telemetry.recorder)], max_workers=4)
        try:
            rows += session_latency_rows(f"127.0.0.1:{port}", controller, n_requests, rounds=rounds, cuda=False)
        finally:
            controller.close()
            server.stop(None).wait(5)
    zoomer_serve.shutdown()
    return rows


if __name__ == "__main__":
    for row in profiling_rows():
        print(f"{row['what']:<48} {row['value']:>12} {row['unit']}")
