"""Collector process of the overhead benchmark: ``python benchmarks/_bench_collector.py STORE [NICE]``.

Runs :class:`zoomer_serve.collector.EmbeddedCollector` with OTLP/gRPC and OTLP/HTTP on 127.0.0.1 (ports 0),
writing to the DuckDB file STORE, at niceness NICE (default 0). Prints ``{"event": "ready", "pid": ...,
"grpc_port": ..., "http_port": ...}``; when stdin closes (or
says ``stop``) it writes everything acknowledged to STORE and prints ``{"event": "stopped", ...counters}``.
"""

from __future__ import annotations

import json
import os
import sys

from zoomer_serve.collector import EmbeddedCollector


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: _bench_collector.py STORE [NICE]", file=sys.stderr)
        return 2
    if len(argv) == 2 and int(argv[1]):
        os.nice(int(argv[1]))
    collector = EmbeddedCollector(argv[0], host="127.0.0.1", grpc_port=0, http_port=0)
    collector.start()
    try:
        print(json.dumps({"event": "ready", "pid": os.getpid(), "grpc_port": collector.grpc_port,
                          "http_port": collector.http_port}), flush=True)
        for line in sys.stdin:
            if line.strip() == "stop":
                break
    finally:
        stats = collector.stop(timeout_s=10.0)
    print(json.dumps({"event": "stopped", **stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
