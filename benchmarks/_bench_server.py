"""Server process of the overhead benchmark: ``python benchmarks/_bench_server.py KIND CONFIG``.

Installs the configuration's instrumentation, starts the server kind on 127.0.0.1 (port 0), calls it
:data:`PRIME_CALLS` times itself (so that lazy start-up work, a model's first forward pass, the first export,
is done before any phase measures it) and prints one JSON line ``{"event": "ready", "pid": ..., "port": ...,
"helper_pids": [...], "primed": calls}`` (its child processes and any helper the instrumentation names). It
then serves until
stdin says ``stop`` (or closes): it flushes and stops the instrumentation, stops the server and prints
``{"event": "stopped", "instrumentation": {...counters}}``. Errors go to stderr with exit code 1.
The environment (``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_ENDPOINT``) is set by ``overhead.py``.
"""

from __future__ import annotations

import json
import os
import sys
import threading

from _bench_configs import ServerKind, configuration, server_kind
from _bench_proc import descendants

_MAX_SERVE_S = 900.0  # never outlive a lost parent by long
PRIME_CALLS = 32
"""Calls a server makes to itself before it says it is ready: the model's first forward pass alone took 1 to 2 s
under load, and landed in the first measured phase of its round."""


def prime(kind: ServerKind, port: int, calls: int = PRIME_CALLS) -> int:
    """Call the server ``calls`` times with the kind's payloads (round-robin); returns the calls that succeeded."""
    call, close = kind.caller(f"127.0.0.1:{port}")
    payloads = kind.payloads()
    ok = 0
    try:
        for i in range(calls):
            call(payloads[i % len(payloads)])
            ok += 1
    finally:
        close()
    return ok


def _emit(event: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _bench_server.py KIND CONFIG", file=sys.stderr)
        return 2
    kind, config = server_kind(argv[0]), configuration(argv[1])
    instrumentation = config.instrument(kind.transport)
    server = kind.start(instrumentation.interceptors)
    primed = prime(kind, server.port)
    helpers = descendants(os.getpid())
    helpers += [p for p in instrumentation.helper_pids() if p not in helpers]
    _emit({"event": "ready", "pid": os.getpid(), "port": server.port, "helper_pids": helpers, "primed": primed})
    done = threading.Event()

    def wait_for_stop() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        done.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    done.wait(_MAX_SERVE_S)
    counters = instrumentation.shutdown()
    server.stop()
    _emit({"event": "stopped", "instrumentation": counters})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
