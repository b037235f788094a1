"""CPU cost per span of the embedded OTLP collector (receive, parse, decode, store).

Usage::

    python benchmarks/collector_cost.py [--spans 20000] [--batch 512] [--rate 1700] [--senders 1] [--linger S]
                                        [--protocol grpc|http/protobuf]
                                        [--json out.json]
    python benchmarks/collector_cost.py --baseline COMMIT [--repeat 3]   # side by side with an older collector

To measure an older collector, ``--baseline COMMIT`` exports its package (``git archive``) and alternates
runs of it and of this tree in fresh processes, for three scenarios: paced at 1700 spans/s by one sender (the
CPU-per-span figure), and unpaced (each sender's next call as soon as the last is answered) with 1 and with
4 senders (throughput); it prints the medians and this tree's ratios to the baseline.
Results and how to read them: ``benchmarks/COLLECTOR.md``.

This process runs an :class:`~zoomer_serve.collector.EmbeddedCollector` (OTLP/gRPC on 127.0.0.1 port 0, no
HTTP receiver) with a DuckDB store in a temp folder. A child process builds ``--spans`` gRPC SERVER span
records the way the recorder does (14 attributes each: the gRPC interceptor's, the message and byte counts
and ``zoomer.request.cpu_time_ns``; byte counts, durations and CPU times vary per span, peer ports come from
8 client connections), encodes them with the exporter's own encoder
(:class:`~zoomer_serve.export.otlp_wire.SpanEncoder`) into requests of ``--batch`` spans, and sends them
over real OTLP/gRPC (or OTLP/HTTP with ``--protocol http/protobuf``: ``POST /v1/traces`` on a keep-alive
connection; the collector then opens only its HTTP receiver), one call at a time, paced at ``--rate`` spans/s.
The encoding happens before the measurement starts; the child's CPU is never counted.

What is counted: the CPU time (user + system, ``getrusage(RUSAGE_SELF)``) of this process, i.e. of the
collector alone, from the first request until every span is written to the store (``flush``), divided by
the number of spans. Closing the store (DuckDB checkpoint) is printed apart. The breakdown is per-thread CPU
(``pthread_getcpuclockid``): the handler threads (``handler_us_per_span``: the gRPC handlers, or the HTTP
receiver's ingest threads; parse + decode + queue), the store writer thread (batching + DuckDB insert), and the
rest (grpc-core's threads or the HTTP receiver's event loop, and DuckDB's own threads). An offline pass then times
the collector's parse and :func:`~zoomer_serve.collector.decode.span_rows` alone on the same kind of requests.

Profile it with py-spy: ``py-spy record -f raw -o collector.txt -- python benchmarks/collector_cost.py``.
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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_args import Range, parse

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


def _grpc_exporter(port: int) -> tuple[Callable[[bytes], None], Callable[[], None]]:
    """(export one payload, close) over OTLP/gRPC: a channel of its own, one call at a time.

    Raises:
        RuntimeError: the export failed (its gRPC status code in the message).
    """
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    call = channel.unary_unary(EXPORT_METHOD)  # bytes in, bytes out

    def export(payload: bytes) -> None:
        try:
            call(payload, timeout=30)
        except grpc.RpcError as exc:
            raise RuntimeError(str(exc.code())) from exc

    return export, channel.close


def _http_exporter(port: int) -> tuple[Callable[[bytes], None], Callable[[], None]]:
    """(export one payload, close) over OTLP/HTTP: ``POST /v1/traces`` on a keep-alive connection of its own.

    Raises:
        RuntimeError: the collector did not answer 200 (the status in the message).
    """
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def export(payload: bytes) -> None:
        conn.request("POST", "/v1/traces", body=payload, headers={"Content-Type": "application/x-protobuf"})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")

    return export, conn.close


def send_main(port: int, n_spans: int, batch: int, rate: float, senders: int = 1, protocol: str = "grpc") -> int:
    """Child: encode, say ready, wait for ``go`` on stdin, send (paced at ``rate`` spans/s in all, or as fast
    as the collector answers when ``rate`` is 0) from ``senders`` threads with a connection (``protocol``:
    ``grpc`` or ``http/protobuf``) and one call in flight each, report."""
    payloads = build_requests(n_spans, batch)
    make = _grpc_exporter if protocol == "grpc" else _http_exporter
    exporters = [make(port) for _ in range(senders)]
    print(json.dumps({"event": "ready"}), flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    counts = {"sent": 0, "failed": 0}
    lock = threading.Lock()

    def send(k: int) -> None:
        export = exporters[k][0]
        for i in range(k, len(payloads), senders):
            if rate > 0:
                delay = t0 + i * batch / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            try:
                export(payloads[i])
                ok = True
            except (RuntimeError, OSError) as exc:
                ok = False
                print(f"export failed: {exc}", file=sys.stderr)
            with lock:
                counts["sent" if ok else "failed"] += 1

    threads = [threading.Thread(target=send, args=(k,)) for k in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    send_s = time.monotonic() - t0
    for _, close in exporters:
        close()
    print(json.dumps({"event": "done", "requests": counts["sent"], "failed": counts["failed"],
                      "send_s": send_s}), flush=True)
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


def measure(n_spans: int, batch: int, rate: float, linger_s: float | None = None,
            senders: int = 1, protocol: str = "grpc") -> dict[str, Any]:
    """Run the collector, let the child send, return CPU figures (seconds and µs per span) and the
    throughput (spans per wall second from the first request until all are stored).

    ``linger_s``: the store writer's linger (None: the :class:`StoreConfig` default); ``protocol``: the OTLP
    transport the child sends over (``grpc`` or ``http/protobuf``; the collector opens only that receiver)."""
    from zoomer_serve.collector import EmbeddedCollector, StoreConfig
    from zoomer_serve.collector.store import open_readonly

    with tempfile.TemporaryDirectory(prefix="zoomer-collector-cost-") as tmp:
        store_path = Path(tmp) / "cost.duckdb"
        store_config = StoreConfig() if linger_s is None else StoreConfig(linger_s=linger_s)
        grpc_on = protocol == "grpc"
        collector = EmbeddedCollector(store_path, grpc_port=0 if grpc_on else None, http_port=None if grpc_on else 0,
                                      store_config=store_config).start()
        port = collector.grpc_port if grpc_on else collector.http_port
        child = subprocess.Popen(
            [sys.executable, __file__, "--send", str(port), str(n_spans), str(batch), str(rate), str(senders),
             protocol],
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
    handlers = _group_delta(threads0, threads1, "otlp-grpc" if protocol == "grpc" else "otlp-http_")
    writer = _group_delta(threads0, threads1, "zoomer-store-writer")
    per_span = 1e6 / n_spans
    return {
        "spans": n_spans, "batch": batch, "rate_spans_s": rate, "senders": senders, "protocol": protocol,
        "linger_s": store_config.linger_s, "stored": stored,
        "failed_requests": done["failed"], "store_batches": stats["store_batches"],
        "wall_s": round(wall1 - wall0, 2), "spans_per_s": round(n_spans / (wall1 - wall0)),
        "cpu_s": round(total, 3),
        "cpu_us_per_span": round(total * per_span, 1),
        "handler_us_per_span": round(handlers * per_span, 1),
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
    parse_traces: Any = getattr(decode, "parse_traces", ExportTraceServiceRequest.FromString)
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


# -- side by side against an older commit -----------------------------------------------------------------
SCENARIOS: dict[str, tuple[float, int]] = {  # name -> (rate in spans/s, 0 = unpaced; senders)
    "paced": (1700.0, 1),
    "unpaced-1": (0.0, 1),
    "unpaced-4": (0.0, 4),
}


def _run_child(pythonpath: Path, args: list[str]) -> dict[str, Any]:
    """This script in a fresh process with ``pythonpath`` first on the path; returns its JSON figures."""
    with tempfile.TemporaryDirectory(prefix="zoomer-collector-cost-run-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
        proc = subprocess.run([sys.executable, __file__, *args, "--json", str(out)], env=env,
                              capture_output=True, text=True, timeout=600)
        if not out.exists():
            raise RuntimeError(f"run {args} with {pythonpath} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        result["exit_code"] = proc.returncode
        return result


def compare(baseline: str, spans: int, batch: int, repeat: int) -> dict[str, Any]:
    """Alternate runs of the collector at git revision ``baseline`` and of this tree (``repeat`` pairs for
    each of :data:`SCENARIOS`); returns every run and, per scenario, the medians and this tree's ratio to
    the baseline (CPU per span: < 1 is cheaper; throughput: > 1 is faster)."""
    root = Path(__file__).resolve().parents[1]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zoomer-collector-baseline-") as old:
        archive = subprocess.run(["git", "-C", str(root), "archive", baseline, "zoomer_serve"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        for i in range(repeat):
            for name, (rate, senders) in SCENARIOS.items():
                args = ["--spans", str(spans), "--batch", str(batch), "--rate", str(rate),
                        "--senders", str(senders), "--no-offline"]
                for version, path in (("baseline", Path(old)), ("this tree", root)):
                    result = _run_child(path, args)
                    result.update(scenario=name, version=version, round=i + 1)
                    runs.append(result)
                    print(f"{name:10} {version:10} round {i + 1}: {result['cpu_us_per_span']:6.1f} us/span, "
                          f"{result['spans_per_s']:6d} spans/s, {result['store_batches']} INSERTs, "
                          f"stored {result['stored']}/{spans}, failed requests {result['failed_requests']}",
                          flush=True)
    summary: dict[str, Any] = {}
    for name in SCENARIOS:
        med = {v: {k: statistics.median(r[k] for r in runs if r["scenario"] == name and r["version"] == v)
                   for k in ("cpu_us_per_span", "spans_per_s", "store_batches")}
               for v in ("baseline", "this tree")}
        summary[name] = {**med, "cpu_ratio": round(med["this tree"]["cpu_us_per_span"]
                                                   / med["baseline"]["cpu_us_per_span"], 2),
                         "throughput_ratio": round(med["this tree"]["spans_per_s"]
                                                   / med["baseline"]["spans_per_s"], 2)}
    return {"baseline": baseline, "spans": spans, "batch": batch, "repeat": repeat,
            "load_average": os.getloadavg(), "summary": summary, "runs": runs}


RANGES = (Range("--spans", 1, 200_000), Range("--batch", 1, 10_000), Range("--rate", 0, 10_000_000),
          Range("--senders", 1, 64), Range("--linger", 0, 60), Range("--repeat", 1, 20))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    from zoomer_serve.config import PROTOCOLS  # here, not at the top: --baseline children load another tree

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spans", type=int, default=20_000, help="spans to send (default 20000)")
    ap.add_argument("--batch", type=int, default=512, help="spans per export request (default 512)")
    ap.add_argument("--rate", type=float, default=1700.0,
                    help="spans per second in all (default 1700; 0 = as fast as the collector answers)")
    ap.add_argument("--senders", type=int, default=1, help="sending threads, one call in flight each (default 1)")
    ap.add_argument("--linger", type=float, help="store writer linger in s (default: StoreConfig's)")
    ap.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                    help="OTLP transport to the collector (default grpc; the baseline comparison always uses grpc)")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline parse/decode timing")
    ap.add_argument("--baseline", metavar="REV",
                    help="compare with the collector of git revision REV: alternate runs of both, "
                         f"--repeat pairs of each scenario ({', '.join(SCENARIOS)})")
    ap.add_argument("--repeat", type=int, default=3, help="pairs per scenario with --baseline (default 3)")
    ap.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return ap


def main(argv: list[str]) -> int:
    if argv[:1] == ["--send"]:
        return send_main(int(argv[1]), int(argv[2]), int(argv[3]), float(argv[4]), int(argv[5]), argv[6])
    args = parse(build_parser(), argv, RANGES)
    if args.baseline:
        result = compare(args.baseline, args.spans, args.batch, args.repeat)
        text = json.dumps(result["summary"], indent=2)
        ok = all(r["stored"] == args.spans and not r["failed_requests"] for r in result["runs"])
    else:
        result = measure(args.spans, args.batch, args.rate, args.linger, args.senders, args.protocol)
        if not args.no_offline:
            result.update(offline_decode(args.batch))
        text = json.dumps(result, indent=2)
        ok = result["stored"] == args.spans and not result["failed_requests"]
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
