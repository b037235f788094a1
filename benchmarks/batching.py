"""Batching benchmark: the batching demo server against the unbatched one, and the cost of batch recording.

Usage::

    python benchmarks/batching.py                 # about 2 minutes on 2 cores
    python benchmarks/batching.py --quick --json  # shorter rounds, JSON on the last line

Two parts, each measured side by side in one run (the machine may be shared: read the ratios, not the absolute
figures; each result names the load average it ran under):

1. **Serving** (:func:`serving`): two ``zoomer-serve serve-demo`` processes run at the same time, one with one
   forward pass per request and one with the dynamic batcher (``--batch-max-size 32 --batch-max-delay-ms 2``),
   both exporting over OTLP to one embedded collector process. For 8 and then 32 client threads, rounds alternate
   between the two servers (unary Predict calls of 32 candidates, no invalid ones): requests per second, p50 and
   p99 client latency, and the server's CPU per request (``/proc``), with batched / unbatched ratios.
2. **Recording cost** (:func:`recording_cost`): in this process, the request-side recording work of one request
   on the unbatched path (its span, made current, its ``forward`` phase, its end) against the batched path (its
   span, made current, its enqueue, its end, plus its part of one batch of B: the batch span, its ``forward``
   phase, the links, and the member figures, the ``queue`` and phase children of every member); the difference
   is what batch recording adds per request (target: under 10 µs). Thread CPU time (``time.thread_time_ns``:
   time spent waiting for a CPU on a busy machine is left out), alternating repetitions, the median per
   configuration. No model runs: this is the recorder's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _bench_args import Range, parse  # noqa: E402

BATCH_MAX_SIZE = 32
BATCH_MAX_DELAY_MS = 2.0
CANDIDATES = 32
CLIENT_COUNTS = (8, 32)
BATCH_SIZES = (1, 8, 32)
TARGET_ADDED_US = 10.0


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


# -- 1. serving ------------------------------------------------------------------------------------------------
def serving(seconds: float, rounds: int) -> list[dict[str, Any]]:
    """Rows per client count: for each server, req/s, p50 / p99 ms and server CPU µs per request (summed over
    its rounds), and the batched / unbatched ratios."""
    import tempfile

    from _bench_proc import process_cpu_s

    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.processes import start_zoomer_command, stop_process

    env = dict(os.environ)
    folder = Path(tempfile.mkdtemp(prefix="zoomer-batching-bench-"))
    procs = []
    try:
        collector, col = start_zoomer_command(["collector", "--store", str(folder / "store.duckdb"), "--grpc-port",
                                               "0", "--http-port", "0"], env, "embedded collector")
        procs.append(collector)
        server_env = dict(env, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{col['grpc_port']}",
                          OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_BSP_SCHEDULE_DELAY="500")
        servers = {}
        for name, size in (("unbatched", 0), ("batched", BATCH_MAX_SIZE)):
            proc, ready = start_zoomer_command(
                ["serve-demo", "--port", "0", "--batch-max-size", str(size), "--batch-max-delay-ms",
                 str(BATCH_MAX_DELAY_MS)], dict(server_env, OTEL_SERVICE_NAME=f"bench-{name}"), f"{name} server")
            procs.append(proc)
            servers[name] = (proc, f"127.0.0.1:{ready['port']}")
        for _, target in servers.values():  # warm-up
            drive_load(target, 2.0, clients=4, batch_size=CANDIDATES, stream_share=0.0, invalid_share=0.0)
        rows = []
        for clients in CLIENT_COUNTS:
            acc: dict[str, dict[str, list[float]]] = {n: {"calls": [], "s": [], "p50": [], "p99": [], "cpu": []}
                                                      for n in servers}
            for _ in range(rounds):
                for name, (proc, target) in servers.items():
                    cpu0 = process_cpu_s(proc.pid)
                    res = drive_load(target, seconds, clients=clients, batch_size=CANDIDATES, stream_share=0.0,
                                     invalid_share=0.0, rpc_timeout_s=30.0)
                    a = acc[name]
                    a["cpu"].append(process_cpu_s(proc.pid) - cpu0)
                    a["calls"].append(res.total_calls)
                    a["s"].append(res.duration_s)
                    a["p50"].append(res.p50_ms)
                    a["p99"].append(res.p99_ms)
            row: dict[str, Any] = {"clients": clients, "load": _load()}
            for name, a in acc.items():
                calls = sum(a["calls"])
                row[name] = {"req_per_s": calls / sum(a["s"]), "p50_ms": statistics.median(a["p50"]),
                             "p99_ms": statistics.median(a["p99"]),
                             "cpu_us_per_req": sum(a["cpu"]) / calls * 1e6 if calls else float("nan"),
                             "calls": calls, "rounds_req_per_s": [c / s for c, s in zip(a["calls"], a["s"])]}
            b, u = row["batched"], row["unbatched"]
            row["ratios"] = {"req_per_s": b["req_per_s"] / u["req_per_s"], "p99": b["p99_ms"] / u["p99_ms"],
                             "cpu_per_req": b["cpu_us_per_req"] / u["cpu_us_per_req"]}
            rows.append(row)
        return rows
    finally:
        for proc in reversed(procs):
            stop_process(proc, 30)


# -- 2. recording cost -------------------------------------------------------------------------------------------
def recording_cost(batch_size: int, requests: int = 2048, repeats: int = 7) -> dict[str, Any]:
    """Median µs per request of the unbatched and the batched path's recording (see the module docstring)."""
    from zoomer_serve.batching import BatchRecorder
    from zoomer_serve.recording import RequestRecorder, phase

    rec = RequestRecorder(sink=lambda record: None)  # the export pipeline's hand-off is measured elsewhere
    batching = BatchRecorder("bench", max_size=batch_size, max_delay_ms=2, recorder=rec)
    name = "bench.Ranker/Predict"

    def unbatched() -> None:
        for _ in range(requests):
            span = rec.start(name)
            span.activate()
            with phase("forward"):
                pass
            span.deactivate()
            span.end()

    def batched() -> None:
        for _ in range(requests // batch_size):
            spans, tickets = [], []
            for _ in range(batch_size):  # the requests arrive: span, made current, enqueue
                span = rec.start(name)
                span.activate()
                tickets.append(batching.enqueue(items=CANDIDATES))
                span.deactivate()
                spans.append(span)
            with batching.begin(tickets, "full"), phase("forward"):
                pass
            for span in spans:  # the requests leave
                span.end()

    times: dict[str, list[float]] = {"unbatched": [], "batched": []}
    unbatched()
    batched()  # warm-up
    for _ in range(repeats):
        for label, fn in (("unbatched", unbatched), ("batched", batched)):
            t0 = time.thread_time_ns()  # CPU time of this thread: waiting for a CPU on a busy machine is not counted
            fn()
            times[label].append((time.thread_time_ns() - t0) / 1000 / (requests // batch_size * batch_size
                                                                        if label == "batched" else requests))
    u, b = statistics.median(times["unbatched"]), statistics.median(times["batched"])
    return {"batch_size": batch_size, "unbatched_us": u, "batched_us": b, "added_us": b - u,
            "rounds_added_us": [bb - uu for uu, bb in zip(times["unbatched"], times["batched"])],
            "meets_target": b - u < TARGET_ADDED_US, "load": _load()}


RANGES = (Range("--seconds", 0, 600, low_open=True), Range("--rounds", 1, 50))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="one round of load (s)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per server and client count")
    parser.add_argument("--quick", action="store_true", help="2 s rounds, one round each")
    parser.add_argument("--skip-serving", action="store_true", help="only the recording cost")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv, RANGES)
    seconds, rounds = (2.0, 1) if args.quick else (args.seconds, args.rounds)
    print(f"batching benchmark; load average at start {_load()}", flush=True)
    costs = [recording_cost(b) for b in BATCH_SIZES]
    print("\nrecording cost per request (thread CPU µs, median of alternating repetitions)")
    print(f"{'batch size':>10}  {'unbatched':>10}  {'batched':>10}  {'added':>8}  target < {TARGET_ADDED_US:g}")
    for c in costs:
        print(f"{c['batch_size']:>10}  {c['unbatched_us']:>10.2f}  {c['batched_us']:>10.2f}  {c['added_us']:>8.2f}  "
              f"{'met' if c['meets_target'] else 'NOT met'}")
    rows = [] if args.skip_serving else serving(seconds, rounds)
    if rows:
        print(f"\nserving: demo Predict, {CANDIDATES} candidates per request, batcher {BATCH_MAX_SIZE} / "
              f"{BATCH_MAX_DELAY_MS:g} ms, {rounds} round(s) of {seconds:g} s per server")
        print(f"{'clients':>7}  {'server':>9}  {'req/s':>7}  {'p50 ms':>7}  {'p99 ms':>7}  {'CPU µs/req':>10}")
        for row in rows:
            for name in ("unbatched", "batched"):
                r = row[name]
                print(f"{row['clients']:>7}  {name:>9}  {r['req_per_s']:>7.1f}  {r['p50_ms']:>7.2f}  {r['p99_ms']:>7.2f}  "
                      f"{r['cpu_us_per_req']:>10.0f}")
            q = row["ratios"]
            print(f"{'':>7}  {'ratio':>9}  {q['req_per_s']:>7.2f}  {'':>7}  {q['p99']:>7.2f}  {q['cpu_per_req']:>10.2f}"
                  f"   (load {row['load']})")
    if args.json:
        print(json.dumps({"recording_cost": costs, "serving": rows}))
    return 0 if all(c["meets_target"] for c in costs) else 1


if __name__ == "__main__":
    sys.exit(main())
