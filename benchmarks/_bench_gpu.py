"""GPU telemetry rows for the overhead benchmark, on a CPU machine (the fake CUDA memory source and fake NVML
of ``tests/_fake_gpu.py`` stand in for the GPU; on a GPU use ``benchmarks/gpu_check.py``).

- :func:`gpu_configurations`: configurations to append to ``_bench_configs.CONFIGURATIONS``: the zoomer
  interceptor with GPU telemetry on (fake sources). Compare with the ``zoomer`` row (GPU telemetry off).
- :func:`observer_cost`: the request-path cost of the GPU memory observer alone (``on_start`` + ``on_end``
  with the fake source, timeit), and of a recorder start/end with and without it. Run this file to print it.
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GPU_FAKE = "zoomer_gpu_fake"


def _fakes() -> Any:
    tests = str(HERE.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import _fake_gpu

    return _fake_gpu


def zoomer_gpu_fake_interceptor(transport: str = "grpc") -> Any:
    """The ``zoomer`` configuration plus GPU telemetry over the fake sources: per-request memory attributes,
    peak resets, OOM observer, NVML sampler (1 s) and the per-request utilization attribute."""
    from _bench_configs import zoomer_interceptor

    import zoomer_serve
    from zoomer_serve.telemetry import GpuTelemetryConfig, attach_gpu_telemetry

    fakes = _fakes()
    instrumentation = zoomer_interceptor(transport)
    attach_gpu_telemetry(zoomer_serve.get_telemetry(), GpuTelemetryConfig(mode="on"),
                         memory_source=fakes.FakeCudaMemory(), nvml=fakes.FakeNvml())
    return instrumentation


def gpu_configurations() -> tuple[Any, ...]:
    """Rows for ``_bench_configs.CONFIGURATIONS``: not in the default run (``overhead.py --gpu`` or
    ``--configs`` adds them), sync gRPC kinds only."""
    from _bench_configs import GRPC, Configuration

    return (Configuration(GPU_FAKE, "zoomer-serve + GPU telemetry (fake CUDA/NVML, CPU)",
                          zoomer_gpu_fake_interceptor, default=False, transports=(GRPC,)),)


def observer_cost(number: int = 100_000, repeat: int = 7) -> dict[str, float]:
    """Per-request request-path costs in µs (best of ``repeat`` runs of ``number``):

    ``observer``: ``GpuMemoryObserver.on_start`` + ``on_end`` on one device (fake source; the real source
    adds one ``torch._C._cuda_memoryStats`` and one peak reset per boundary); ``recorder_off`` /
    ``recorder_on``: ``RequestRecorder.start`` + ``RequestSpan.end`` without / with the observer;
    ``added``: their difference (what GPU telemetry adds per request).
    """
    from zoomer_serve.recording import RequestRecorder
    from zoomer_serve.telemetry import GpuMemoryObserver

    fakes = _fakes()
    observer = GpuMemoryObserver(fakes.FakeCudaMemory(), (0,))
    observer.utilization = {0: 0.5}
    span = RequestRecorder(otel_context=False).start("bench/Observer")

    def both() -> None:
        observer.on_start(span)
        observer.on_end(span)

    off = RequestRecorder(otel_context=False)
    on = RequestRecorder(otel_context=False)
    on.add_observer(observer)

    def best(fn: Any) -> float:
        return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6

    out = {"observer": best(both), "recorder_off": best(lambda: off.start("bench/M").end()),
           "recorder_on": best(lambda: on.start("bench/M").end())}
    out["added"] = out["recorder_on"] - out["recorder_off"]
    return out


if __name__ == "__main__":
    for key, value in observer_cost().items():
        print(f"{key:14s} {value:7.2f} µs")
