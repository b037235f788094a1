"""The fleet job's throughput and memory on this machine: artifacts per second with the local engine and with
Ray, and the driver's peak memory against fleet size.

For each size (default 100, 400 and 1600 replicas) a synthetic fleet is written to a temporary folder through
the real paths (:mod:`zoomer_serve.fleet.synthetic`: one Kineto trace per replica from a shared trace, uploaded
with manifests; span data through collectors rotating to Parquet), then ``run_fleet_job`` runs on it in a
fresh Python process per (size, engine), which reports:

- ``tasks_per_s``: traces analysed per second between the first result and the last (engine start-up left
  out), and ``startup_s``, the time to the first result (the pool's spawn, Ray's start);
- ``peak_rss_mb``: the driver's maximum resident set (``ru_maxrss``): imports, DuckDB reading the span data,
  the per-replica records; the workers are other processes and each holds one trace at a time;
- ``total_s`` and the timings of each step, the bytes of traces and of Parquet span data per replica;
- ``named`` (the outlier replicas) against the two injected slow ones: ``missed`` and ``also_named``.

    python benchmarks/fleet.py [--sizes 100,400,1600] [--ray-sizes 400] [--workers 2] [--trace PATH]
                               [--requests 100] [--json]

The default trace is ``shared/data/kineto/a100_alexnet_inference.json.gz`` (1408 events; a small inference
trace: per-trace costs dominate). ``--trace`` takes another (``a100_training_step.json.gz``, 35 MB of JSON,
shows the per-byte cost). Results: ``benchmarks/RESULTS.md`` ("The fleet job").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _bench_args import Range, parse  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "kineto" / "a100_alexnet_inference.json.gz"


def run_job(root: str, engine: str, workers: int) -> dict[str, Any]:
    """One job in this process (the child's side); the figures as a dict."""
    from zoomer_serve.fleet.job import FleetOptions, run_fleet_job

    t0 = time.monotonic()
    report = run_fleet_job(FleetOptions(root, engine=engine, workers=workers, drill_down=0))
    wall = time.monotonic() - t0
    t = report.timings
    analysed = report.counts["traces_analyzed"] + report.counts["traces_failed"]
    steady = max(t["tasks_s"] - t.get("first_result_s", 0.0), 1e-9)
    return {"engine": engine, "workers": workers, "traces": analysed, "replicas": report.counts["replicas"],
            "named": sorted(report.outlier_instances), "failed": report.counts["traces_failed"],
            "named_metrics": sorted({f"{o['instance']} {o['metric']}" for o in report.outliers}),
            "startup_s": round(t.get("first_result_s", 0.0), 2), "tasks_s": round(t["tasks_s"], 2),
            "tasks_per_s": round(max(analysed - 1, 0) / steady, 1),
            "tasks_per_s_with_startup": round(analysed / max(t["tasks_s"], 1e-9), 1),
            "spans_s": round(t["spans_s"] - t["tasks_s"], 2), "total_s": round(wall, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _child(root: str, engine: str, workers: int) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--child", root, engine, str(workers)], capture_output=True,
                          text=True, timeout=3600, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the {engine} job failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bytes(folder: Path, part: str) -> int:
    return sum(p.stat().st_size for p in (folder / part).rglob("*") if p.is_file()) if (folder / part).exists() else 0


def measure(size: int, engines: list[str], workers: int, trace: Path, requests: int, keep: bool) -> dict[str, Any]:
    from zoomer_serve.fleet.synthetic import FleetSpec, build_fleet

    folder = Path(tempfile.mkdtemp(prefix=f"zoomer-fleet-{size}-"))
    try:
        t0 = time.monotonic()
        spec = FleetSpec(replicas=size, slow=(3, size // 2), corrupt=(size // 3,), requests=requests,
                         metric_points=30)
        truth = build_fleet(str(folder), trace, spec)
        row: dict[str, Any] = {"replicas": size, "build_s": round(time.monotonic() - t0, 1),
                               "trace_bytes_per_replica": round(_bytes(folder, "artifacts") / size),
                               "span_rows": truth.span_rows,
                               "parquet_bytes": _bytes(folder, "spans") + _bytes(folder, "metric_points")}
        row["parquet_bytes_per_span_row"] = round(row["parquet_bytes"] / max(truth.span_rows, 1), 1)
        row["jobs"] = [_child(str(folder), engine, workers) for engine in engines]
        row["injected"] = sorted(truth.slow)
        for job in row["jobs"]:
            job["missed"] = sorted(truth.slow - set(job["named"]))
            job["also_named"] = sorted(set(job["named"]) - truth.slow)
        return row
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


RANGES = (Range("--workers", 1, 64), Range("--requests", 1, 100_000))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,400,1600")
    p.add_argument("--ray-sizes", default="400", help="sizes also run on Ray (needs the fleet extra); '' for none")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--requests", type=int, default=100, help="request spans per replica")
    p.add_argument("--keep", action="store_true", help="keep the fleets (their folders are printed)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", nargs=3, metavar=("ROOT", "ENGINE", "WORKERS"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv, RANGES)
    if args.child:
        print(json.dumps(run_job(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    ray_sizes = {int(s) for s in args.ray_sizes.split(",") if s.strip()}
    if ray_sizes:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("Ray is not installed (pip install 'zoomer-serve[fleet]'): local engine only", file=sys.stderr)
            ray_sizes = set()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        engines = ["local"] + (["ray"] if size in ray_sizes else [])
        rows.append(measure(size, engines, args.workers, args.trace, args.requests, args.keep))
        print(f"{size} replicas done", file=sys.stderr)
    out = {"trace": str(args.trace), "workers": args.workers, "load_average": os.getloadavg(), "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"trace {args.trace.name}, {args.workers} workers, load average {out['load_average'][0]:.1f}")
    print("| replicas | engine | traces/s (steady) | start-up s | tasks s | spans s | total s | driver peak RSS MB |"
          " trace KB/replica | Parquet B/span row | missed | also named |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        for j in r["jobs"]:
            print(f"| {r['replicas']} | {j['engine']} | {j['tasks_per_s']} | {j['startup_s']} | {j['tasks_s']} | "
                  f"{j['spans_s']} | {j['total_s']} | {j['peak_rss_mb']} | {r['trace_bytes_per_replica'] / 1024:.0f} | "
                  f"{r['parquet_bytes_per_span_row']} | {len(j['missed'])} | {', '.join(j['also_named']) or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
