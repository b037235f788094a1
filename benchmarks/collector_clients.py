"""The embedded collector under 1,000 slow or idle OTLP/HTTP clients: export latency, threads, RSS (C20).

Usage::

    python benchmarks/collector_clients.py [--clients 1000] [--exports 20] [--baseline COMMIT] [--json out.json]

Starts ``python -m zoomer_serve collector`` (127.0.0.1, ports 0, a store in a temp folder) and measures it
twice, side by side in one run: *quiet* (no other client) and *loaded*, with ``--clients`` connections
held open to its OTLP/HTTP port, in three equal kinds: idle (connected, nothing sent), a stalled body (the
headers of a ``POST /v1/traces`` with ``Content-Length: 100`` and two bytes of body), and stalled headers
(the request line and one header). Deadlines are raised to 300 s so that no client is cut off during the
measurement (this measures holding them, not cutting them off; the deadlines are tested in
``tests/test_collector_clients.py``).

In each phase a well-behaved exporter sends ``--exports`` OTLP/HTTP requests of 512 spans (encoded by
the zoomer exporter's own encoder, one keep-alive connection, client timeout 10 s) and as many OTLP/gRPC
requests; the figures are the wall time of each request until its answer (the collector answers after its
rows are committed to the store), the collector process's thread count and RSS (psutil) after each phase,
and both again right after the clients connected (before the loaded phase's exports, whose stored rows grow
DuckDB's memory too). A phase stops after 3 failed exports.

``--baseline COMMIT`` runs the same against the collector of that git revision first (its package from
``git archive``; it is given no deadline flags, which it does not have).
Results: ``benchmarks/COLLECTOR.md``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_args import Range, parse
from collector_cost import EXPORT_METHOD, build_requests

ROOT = Path(__file__).resolve().parents[1]
HEAD = b"POST /v1/traces HTTP/1.1\r\nHost: collector\r\nContent-Type: application/x-protobuf\r\n"
KINDS = (b"", HEAD + b"Content-Length: 100\r\n\r\nab", b"POST /v1/traces HTTP/1.1\r\nHost: c\r\n")
MAX_FAILURES = 3  # a phase stops sending after this many failed exports (each may have waited 10 s)
LONG_DEADLINES = ["--header-timeout-s", "300", "--body-timeout-s", "300", "--idle-timeout-s", "300"]


def start(pythonpath: Path, store: Path, extra: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", "collector", "--store", str(store),
                             "--grpc-port", "0", "--http-port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, cwd=store.parent)  # not this tree's folder: -m puts cwd first
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"collector did not start: {proc.communicate(timeout=30)[1][-2000:]}")
    return proc, json.loads(line)


def http_exports(port: int, payloads: list[bytes]) -> tuple[list[float], int]:
    """Send each payload on one keep-alive connection; (seconds per answered request, failures)."""
    times, failures = [], 0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for payload in payloads:
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v1/traces", payload, {"Content-Type": "application/x-protobuf"})
            resp = conn.getresponse()
            resp.read()
            ok = resp.status == 200
        except (OSError, http.client.HTTPException):
            ok = False
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        if ok:
            times.append(time.perf_counter() - t0)
        else:
            failures += 1
            if failures >= MAX_FAILURES:
                break
    conn.close()
    return times, failures


def grpc_exports(port: int, payloads: list[bytes]) -> tuple[list[float], int]:
    times, failures = [], 0
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        export = channel.unary_unary(EXPORT_METHOD)
        for payload in payloads:
            t0 = time.perf_counter()
            try:
                export(payload, timeout=10)
                times.append(time.perf_counter() - t0)
            except grpc.RpcError:
                failures += 1
                if failures >= MAX_FAILURES:
                    break
    return times, failures


def http_connections(proc: psutil.Process, port: int) -> int:
    return sum(1 for c in proc.net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def phase(proc: psutil.Process, ready: dict[str, Any], payloads: list[bytes]) -> dict[str, Any]:
    h_times, h_fail = http_exports(ready["http_port"], payloads)
    g_times, g_fail = grpc_exports(ready["grpc_port"], payloads)

    def ms(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"median_ms": None, "max_ms": None}
        return {"median_ms": round(statistics.median(values) * 1e3, 1), "max_ms": round(max(values) * 1e3, 1)}

    return {"http": {**ms(h_times), "failed": h_fail}, "grpc": {**ms(g_times), "failed": g_fail},
            "threads": proc.num_threads(), "rss_mib": round(proc.memory_info().rss / 2**20, 1),
            "http_connections": http_connections(proc, ready["http_port"])}


def measure(pythonpath: Path, extra: list[str], clients: int, payloads: list[bytes]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zoomer-collector-clients-") as tmp:
        proc, ready = start(pythonpath, Path(tmp) / "s.duckdb", extra)
        ps = psutil.Process(proc.pid)
        socks: list[socket.socket] = []
        try:
            phase(ps, ready, payloads[:5])  # warm up: pools start their threads, caches fill
            quiet = phase(ps, ready, payloads)
            t0 = time.perf_counter()
            for i in range(clients):
                sock = socket.create_connection(("127.0.0.1", ready["http_port"]), timeout=30)
                if KINDS[i % 3]:
                    sock.sendall(KINDS[i % 3])
                socks.append(sock)
            deadline = time.monotonic() + 60
            while http_connections(ps, ready["http_port"]) < clients and time.monotonic() < deadline:
                time.sleep(0.1)
            connect_s = time.perf_counter() - t0
            held = {"threads": ps.num_threads(), "rss_mib": round(ps.memory_info().rss / 2**20, 1),
                    "http_connections": http_connections(ps, ready["http_port"])}
            loaded = phase(ps, ready, payloads)
        finally:
            for sock in socks:
                sock.close()
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
        stopped = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    return {"quiet": quiet, "clients_connected": held, "loaded": loaded, "connect_s": round(connect_s, 2), "exit_code": proc.returncode,
            "peak_connections": stopped.get("http_connections_peak"),
            "refused": stopped.get("http_connections_refused")}


RANGES = (Range("--clients", 1, 20_000), Range("--exports", 1, 1000))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=1000, help="slow or idle connections (default 1000)")
    ap.add_argument("--exports", type=int, default=20, help="exports per transport and phase (default 20)")
    ap.add_argument("--baseline", metavar="REV", help="measure the collector of git revision REV first")
    ap.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return ap


def main(argv: list[str]) -> int:
    args = parse(build_parser(), argv, RANGES)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < args.clients + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(args.clients + 512, hard), hard))
    payloads = build_requests(512 * args.exports, 512)
    result: dict[str, Any] = {"clients": args.clients, "exports": args.exports, "load_average": os.getloadavg()}
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="zoomer-collector-baseline-") as old:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, "zoomer_serve"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
            result["baseline"] = {"rev": args.baseline, **measure(Path(old), [], args.clients, payloads)}
    result["this tree"] = measure(ROOT, LONG_DEADLINES, args.clients, payloads)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    now = result["this tree"]
    ok = not now["loaded"]["http"]["failed"] and not now["loaded"]["grpc"]["failed"] and now["exit_code"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
