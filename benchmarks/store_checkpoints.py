"""CPU of the collector's store as it grows: the writer's checkpoints per row group against DuckDB's own.

Usage::

    python benchmarks/store_checkpoints.py [--rows 600000] [--pad 0] [--repeat 1] [--json out.json]

Each run is a fresh process that opens a :class:`~zoomer_serve.collector.Store` in a temp folder and writes
``--rows`` span rows to it with :meth:`~zoomer_serve.collector.Store.write`, 512 rows per write, one write
after the other (what one exporter sending 512-span requests does). The rows have the gRPC interceptor's 12
attributes (peer ports, CPU times and ids vary per row) plus ``--pad`` attributes of 80 characters each, to
make the rows larger. Two modes alternate, ``--repeat`` pairs:

- ``duckdb``: ``StoreConfig(checkpoint_rows=0)``, DuckDB checkpoints when its log passes 16 MiB (the store
  before the writer checkpointed itself);
- ``row_group``: the default ``StoreConfig``, the writer checkpoints once per row group (122 880 rows).

Per run: the process's CPU time (``getrusage``: the writer thread, DuckDB's threads and this loop, the rows
built outside the timing) over the rows, the close (its checkpoint) included, the CPU of each write from the call until the next one (a writer's
checkpoint runs after the write returns, while this loop builds the next rows: their CPU is taken out
again), the median, p99 and largest of those, the
writes over 50 ms and their share of the CPU. Results: ``benchmarks/COLLECTOR.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_args import Range, parse

ROWS_PER_WRITE = 512
BURST_S = 0.05
MODES = {"duckdb": 0, "row_group": None}  # mode -> StoreConfig.checkpoint_rows (None: the default)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rows(start: int, pad: int, rng: random.Random) -> list[tuple[Any, ...]]:
    resource_attrs = json.dumps({"service.name": "ranker", "host.name": "bench", "process.pid": 4242,
                                 "telemetry.sdk.name": "zoomer-serve"}, separators=(",", ":"))
    rows = []
    for i in range(start, start + ROWS_PER_WRITE):
        attrs: dict[str, Any] = {
            "rpc.system.name": "grpc", "rpc.method": "bench.Echo/Echo", "server.address": "127.0.0.1",
            "server.port": 50051, "network.peer.address": "127.0.0.1",
            "network.peer.port": rng.randrange(30000, 60000), "rpc.response.status_code": "OK",
            "zoomer.rpc.request.messages": 1, "zoomer.rpc.response.messages": 1,
            "zoomer.rpc.request.bytes": 105, "zoomer.rpc.response.bytes": 107,
            "zoomer.request.cpu_time_ns": rng.randrange(10**5, 10**7)}
        attrs.update({f"bench.pad.{k}": f"{k:02d}" * 40 for k in range(pad)})
        start_ns = 1_700_000_000_000_000_000 + i * 370_000
        duration = 100_000 + i % 977
        rows.append((f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64):016x}", None, "bench.Echo/Echo",
                     "SERVER", start_ns, start_ns + duration, duration, "UNSET", None, "ranker", "abc",
                     "zoomer_serve", json.dumps(attrs, separators=(",", ":")), resource_attrs, None, None,
                     start_ns + 5_000_000))
    return rows


def run_one(mode: str, rows: int, pad: int) -> dict[str, Any]:
    """Write ``rows`` rows to a fresh store checkpointed as ``mode`` says; the figures of the module docstring."""
    from zoomer_serve.collector import Store, StoreConfig

    every = MODES[mode]
    config = StoreConfig() if every is None else StoreConfig(checkpoint_rows=every)
    rng = random.Random(7)
    costs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="zoomer-ckpt-") as tmp:
        store = Store(Path(tmp) / "s.duckdb", config)
        batch = _rows(0, pad, rng)
        for start in range(ROWS_PER_WRITE, rows + ROWS_PER_WRITE, ROWS_PER_WRITE):
            before = _cpu_s()
            store.write("spans", batch)
            built = time.thread_time()
            batch = _rows(start, pad, rng) if start < rows else []
            build_s = time.thread_time() - built  # this thread's; the writer's checkpoint may run meanwhile
            costs.append(_cpu_s() - before - build_s)
        before = _cpu_s()
        stats = store.close()  # its checkpoint: what neither mode had moved into the file yet
        close_s = _cpu_s() - before
    total = sum(costs) + close_s
    bursts = [c for c in costs if c > BURST_S]
    ordered = sorted(costs)
    return {"mode": mode, "rows": stats.written, "pad": pad, "checkpoints": stats.checkpoints,
            "cpu_s": round(total, 2), "close_cpu_s": round(close_s, 2), "cpu_us_per_row": round(total / max(1, stats.written) * 1e6, 2),
            "write_ms_median": round(statistics.median(costs) * 1e3, 2),
            "write_ms_p99": round(ordered[int(len(ordered) * 0.99)] * 1e3, 1),
            "write_ms_max": round(ordered[-1] * 1e3, 1), "writes_over_50ms": len(bursts),
            "cpu_share_over_50ms": round(sum(bursts) / total, 2) if total else 0.0}


RANGES = (Range("--rows", ROWS_PER_WRITE, 5_000_000), Range("--pad", 0, 100), Range("--repeat", 1, 10))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=600_000, help="rows per run (default 600000)")
    ap.add_argument("--pad", type=int, default=0, help="extra 80-character attributes per row (default 0)")
    ap.add_argument("--repeat", type=int, default=1, help="pairs of runs (default 1)")
    ap.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return ap


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(json.dumps(run_one(argv[1], int(argv[2]), int(argv[3]))))
        return 0
    args = parse(build_parser(), argv, RANGES)
    runs = []
    for _ in range(args.repeat):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--one", mode, str(args.rows), str(args.pad)],
                                 check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {k: statistics.median(r[k] for r in mine)
                         for k in ("cpu_us_per_row", "write_ms_p99", "write_ms_max", "writes_over_50ms",
                                   "cpu_share_over_50ms")}
    old, new = summary["duckdb"], summary["row_group"]
    summary["ratio_row_group_to_duckdb"] = {k: round(new[k] / old[k], 2) if old[k] else None
                                           for k in ("cpu_us_per_row", "write_ms_p99", "write_ms_max")}
    result = {"rows": args.rows, "pad": args.pad, "repeat": args.repeat, "load_average": os.getloadavg(),
              "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
