"""CPU cost per span of the embedded OTLP collector (receive, parse, decode, store).

Usage::

    python benchmarks/collector_cost.py [--spans 20000] [--batch 512] [--rate 1700] [--linger S] [--json out.json]

To measure an older collector, export its package and put it first on the path (the sender uses it too):
``git archive COMMIT zoomer_serve | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python benchmarks/collector_cost.py``.
Results and how to read them: ``benchmarks/COLLECTOR.md``.

This process runs an :class:`~zoomer_serve.collector.EmbeddedCollector` (OTLP/gRPC on 127.0.0.1 port 0, no
HTTP receiver) with a DuckDB store in a temp folder. A child process builds ``--spans`` gRPC SERVER span
records the way the recorder does (14 attributes each: the gRPC interceptor's, the message and byte counts
and ``zoomer.request.cpu_time_ns``; byte counts, durations and CPU times vary per span, peer ports come from
8 client connections), encodes them with the exporter's own encoder
(:class:`~zoomer_serve.export.otlp_wire.SpanEncoder`) into requests of ``--batch`` spans, and sends them
over real OTLP/gRPC, one call at a time, paced at ``--rate`` spans/s. The encoding happens before the
measurement starts; the child's CPU is never counted.

What is counted: the CPU time (user + system, ``getrusage(RUSAGE_SELF)``) of this process, i.e. of the
collector alone, from the first request until every span is written to the store (``flush``), divided by
the number of spans. Closing the store (DuckDB checkpoint) is printed apart. The breakdown is per-thread CPU
(``pthread_getcpuclockid``): the gRPC handler threads (parse + decode + queue), the store writer thread
(batching + DuckDB insert), and the rest (grpc-core and DuckDB's own threads). An offline pass then times
the collector's parse and :func:`~zoomer_serve.collector.decode.span_rows` alone on the same kind of requests.

Profile it with py-spy: ``py-spy record -f raw -o collector.txt -- python benchmarks/collector_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PEER_PORTS = (41822, 41830, 41846, 41852, 45310, 45318, 51904, 51912)  # clients keep their connections
RESOURCE_ATTRIBUTES = {
    "service.name": "ranker", "service.instance.id": "5f0c6c1e-8a4b-4a53-9d1e-2f1b6f3c9a10",
    "host.name": "bench-host", "process.pid": 4242, "process.runtime.name": "cpython",
    "process.runtime.version": "3.11.7", "telemetry.sdk.name": "zoomer-serve",
    "telemetry.sdk.language": "python", "telemetry.sdk.version": "0.1.0", "zoomer.torch.version": "2.6.0",
}


# -- spans (child side) ------------------------------------------------------------------------------------
def server_record(rng: random.Random, start_ns: int) -> tuple[Any, ...]:
    """One finished gRPC SERVER span record, laid out as ``RequestSpan.end`` lays it out."""
    from zoomer_serve.recording import records as r

    duration = rng.randint(1_000_000, 20_000_000)
    attrs = {
        "rpc.system.name": "grpc", "rpc.method": "ranker.Ranker/Rank",
        "server.address": "127.0.0.1", "server.port": 50051,
        "network.peer.address": "127.0.0.1", "network.peer.port": rng.choice(PEER_PORTS),
        "network.type": "ipv4", "network.transport": "tcp", "rpc.response.status_code": "OK",
        "zoomer.rpc.request.messages": 1, "zoomer.rpc.request.bytes": rng.randint(200, 4000),
        "zoomer.rpc.response.messages": 1, "zoomer.rpc.response.bytes": rng.randint(40, 800),
        "zoomer.request.cpu_time_ns": rng.randint(200_000, duration),
    }
    parent = rng.getrandbits(64) if rng.random() < 0.5 else 0
    return (rng.getrandbits(128) | 1, rng.getrandbits(64) | 1, parent, bool(parent), 1, None,
            "ranker.Ranker/Rank", r.KIND_SERVER, start_ns, start_ns + duration, r.STATUS_UNSET, None, attrs,
            None, None, None, r.F_SAMPLED | r.F_REQUEST)


def build_requests(n_spans: int, batch: int, seed: int = 7) -> list[bytes]:
    """``n_spans`` span records encoded into ExportTraceServiceRequest payloads of ``batch`` spans."""
    from zoomer_serve.export.otlp_wire import SpanEncoder

    rng = random.Random(seed)
    enc = SpanEncoder(RESOURCE_ATTRIBUTES, "zoomer_serve", "0.1.0")
    start = time.time_ns()
    spans = [enc.encode_span(server_record(rng, start + i * 500_000)) for i in range(n_spans)]
    return [enc.encode_request(spans[i:i + batch]) for i in range(0, n_spans, batch)]


def send_main(port: int, n_spans: int, batch: int, rate: float) -> int:
    """Child: encode, say ready, wait for ``go`` on stdin, send paced, report."""
    import grpc

    payloads = build_requests(n_spans, batch)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        export = channel.unary_unary(EXPORT_METHOD)  # bytes in, bytes out
        grpc.channel_ready_future(channel).result(timeout=10)
        print(json.dumps({"event": "ready"}), flush=True)
        sys.stdin.readline()
        t0, sent, failed = time.monotonic(), 0, 0
        for i, payload in enumerate(payloads):
            delay = t0 + i * batch / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                export(payload, timeout=10)
                sent += 1
            except grpc.RpcError as exc:
                failed += 1
                print(f"export failed: {exc.code()}", file=sys.stderr)
        print(json.dumps({"event": "done", "requests": sent, "failed": failed,
                          "send_s": time.monotonic() - t0}), flush=True)
    return 0


# -- collector (this process) ------------------------------------------------------------------------------
def _process_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds per live Python thread, keyed by ``name:ident``."""
    out = {}
    for t in threading.enumerate():
        if t.ident is not None:
            try:
                out[f"{t.name}:{t.ident}"] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # the thread ended in between
                pass
    return out


def _group_delta(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix))


def measure(n_spans: int, batch: int, rate: float, linger_s: float | None = None) -> dict[str, Any]:
    """Run the collector, let the child send, return CPU figures (seconds and µs per span).

    ``linger_s``: the store writer's linger (None: the :class:`StoreConfig` default)."""
    from zoomer_serve.collector import EmbeddedCollector, StoreConfig
    from zoomer_serve.collector.store import open_readonly

    with tempfile.TemporaryDirectory(prefix="zoomer-collector-cost-") as tmp:
        store_path = Path(tmp) / "cost.duckdb"
        store_config = StoreConfig() if linger_s is None else StoreConfig(linger_s=linger_s)
        collector = EmbeddedCollector(store_path, grpc_port=0, http_port=None, store_config=store_config).start()
        child = subprocess.Popen(
            [sys.executable, __file__, "--send", str(collector.grpc_port), str(n_spans), str(batch), str(rate)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdin is not None and child.stdout is not None
            _expect(child, "ready")
            cpu0, threads0, wall0 = _process_cpu_s(), _thread_cpu_s(), time.monotonic()
            child.stdin.write("go\n")
            child.stdin.flush()
            done = _expect(child, "done")
            if not collector.flush(timeout_s=60):
                raise RuntimeError("store did not catch up within 60 s")
            cpu1, threads1, wall1 = _process_cpu_s(), _thread_cpu_s(), time.monotonic()
            stats = collector.stop()
            cpu2 = _process_cpu_s()
        finally:
            child.kill()
            child.wait()
            collector.stop()
        con = open_readonly(store_path)
        stored = con.execute("SELECT count(*) FROM spans").fetchone()[0]
        con.close()
    total = cpu1 - cpu0
    handlers = _group_delta(threads0, threads1, "otlp-grpc")
    writer = _group_delta(threads0, threads1, "zoomer-store-writer")
    per_span = 1e6 / n_spans
    return {
        "spans": n_spans, "batch": batch, "rate_spans_s": rate, "linger_s": store_config.linger_s, "stored": stored,
        "failed_requests": done["failed"], "store_batches": stats["store_batches"],
        "wall_s": round(wall1 - wall0, 2), "cpu_s": round(total, 3),
        "cpu_us_per_span": round(total * per_span, 1),
        "grpc_handler_us_per_span": round(handlers * per_span, 1),
        "store_writer_us_per_span": round(writer * per_span, 1),
        "other_threads_us_per_span": round((total - handlers - writer) * per_span, 1),
        "close_cpu_s": round(cpu2 - cpu1, 3),
    }


def _expect(child: subprocess.Popen[str], event: str) -> dict[str, Any]:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"sender exited (code {child.wait()}) before {event!r}")
    msg = json.loads(line)
    if msg.get("event") != event:
        raise RuntimeError(f"sender said {msg}, expected {event!r}")
    return msg


def offline_decode(batch: int, requests: int = 8) -> dict[str, float]:
    """µs per span of the collector's parse (``parse_traces``) and decode (``span_rows``) alone, on
    ``requests`` payloads (the attribute cache is warm after the live run, as in a running collector)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from zoomer_serve.collector import decode

    # Collectors before parse_traces (commit a9c3daf and older) parsed the official message.
    parse_traces = getattr(decode, "parse_traces", ExportTraceServiceRequest.FromString)
    span_rows = decode.span_rows
    payloads = build_requests(batch * requests, batch, seed=11)
    t0 = time.process_time()
    parsed = [parse_traces(p) for p in payloads]
    t1 = time.process_time()
    for req in parsed:
        span_rows(req, time.time_ns())
    t2 = time.process_time()
    n = batch * requests
    return {"parse_us_per_span": round((t1 - t0) * 1e6 / n, 1),
            "decode_us_per_span": round((t2 - t1) * 1e6 / n, 1)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--send"]:
        return send_main(int(argv[1]), int(argv[2]), int(argv[3]), float(argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spans", type=int, default=20_000, help="spans to send (default 20000)")
    ap.add_argument("--batch", type=int, default=512, help="spans per export request (default 512)")
    ap.add_argument("--rate", type=float, default=1700.0, help="spans per second (default 1700)")
    ap.add_argument("--linger", type=float, help="store writer linger in s (default: StoreConfig's)")
    ap.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if not 0 < args.spans <= 200_000 or not 0 < args.batch <= 10_000 or args.rate <= 0:
        ap.error("need 0 < --spans <= 200000, 0 < --batch <= 10000, --rate > 0")
    result = measure(args.spans, args.batch, args.rate, args.linger)
    result.update(offline_decode(args.batch))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["stored"] == args.spans and not result["failed_requests"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
