"""Collector process of the overhead benchmark: ``python benchmarks/_bench_collector.py STORE``.

Runs :class:`zoomer_serve.collector.EmbeddedCollector` with OTLP/gRPC only, on 127.0.0.1 (port 0), writing
to the DuckDB file STORE. Prints ``{"event": "ready", "pid": ..., "grpc_port": ...}``; when stdin closes (or
says ``stop``) it writes everything acknowledged to STORE and prints ``{"event": "stopped", ...counters}``.
"""

from __future__ import annotations

import json
import os
import sys

from zoomer_serve.collector import EmbeddedCollector


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: _bench_collector.py STORE", file=sys.stderr)
        return 2
    collector = EmbeddedCollector(argv[0], host="127.0.0.1", grpc_port=0, http_port=None)
    collector.start()
    try:
        print(json.dumps({"event": "ready", "pid": os.getpid(), "grpc_port": collector.grpc_port}), flush=True)
        for line in sys.stdin:
            if line.strip() == "stop":
                break
    finally:
        stats = collector.stop(timeout_s=10.0)
    print(json.dumps({"event": "stopped", **stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
