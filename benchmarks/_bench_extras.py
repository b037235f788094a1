"""The overhead benchmark's extra rows (``overhead.py --extras``), one section per process:
``python benchmarks/_bench_extras.py SECTION [--quick]`` prints one JSON line, a list of
``{"what", "value", "unit"}`` rows. Sections: ``gpu`` (:mod:`_bench_gpu`, request-path cost of GPU telemetry
over the fake sources), ``profiling`` (:mod:`_bench_profiling`, idle controller and latency inside a session),
``host`` (:mod:`_bench_host`, host telemetry and the CPU samplers). Each runs in its own process because
each configures zoomer-serve's telemetry and builds its own servers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SECTIONS = ("gpu", "profiling", "host")


def gpu_rows(quick: bool) -> list[dict[str, Any]]:
    """:func:`_bench_gpu.observer_cost` as rows (µs per request, best of the timeit runs)."""
    from _bench_gpu import observer_cost

    cost = observer_cost(number=20_000 if quick else 100_000, repeat=3 if quick else 7)
    labels = {"observer": "GPU memory observer on_start + on_end (fake source)",
              "recorder_off": "recorder start+end, GPU telemetry off",
              "recorder_on": "recorder start+end, GPU memory observer attached",
              "added": "added per request by GPU telemetry (on - off)"}
    return [{"what": labels[k], "value": round(v, 3), "unit": "µs"} for k, v in cost.items()]


def profiling_rows(quick: bool) -> list[dict[str, Any]]:
    from _bench_profiling import profiling_rows as rows

    return rows(n_requests=100 if quick else 200, rounds=2 if quick else 3)


def host_rows(quick: bool) -> list[dict[str, Any]]:
    from _bench_host import host_rows as rows

    return rows(quick=quick)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SECTIONS:
        print(f"usage: _bench_extras.py {{{','.join(SECTIONS)}}} [--quick]", file=sys.stderr)
        return 2
    quick = "--quick" in argv[1:]
    rows = {"gpu": gpu_rows, "profiling": profiling_rows, "host": host_rows}[argv[0]](quick)
    sys.stdout.write(json.dumps(rows) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
