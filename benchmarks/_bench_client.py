"""Client process of the overhead benchmark: a closed-loop load generator driven by JSON lines on stdin.

Each command line is ``{"kind": K, "target": "127.0.0.1:P", "threads": N, "warmup_s": W, "window_s": D,
"server_pid": PID, "collector_pid": PID}``. N threads, each with its own channel, send one request at a time
(the kind's payloads, round-robin) until the run ends. After ``warmup_s`` the measured window starts: the CPU
of the server's process tree (``/proc``, the server itself plus its helper processes), of the collector and
of this client are read at both ends of a ``window_s`` second window. The answer is one JSON line:

``{"requests": completed in the window, "window_s": measured length, "latency_us": [each request completed
in the window, client-side µs], "server_cpu_s": ..., "helpers_cpu_s": ..., "collector_cpu_s": ...,
"client_cpu_s": ..., "total_ok": all successful calls of the run (warm-up and tail included), "errors":
{code: count}}``. An empty line or EOF ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from array import array
from typing import Any

from _bench_configs import ServerKind, server_kind
from _bench_proc import process_cpu_s, tree_cpu

_MAX_ERRORS = 200  # a thread stops after this many failed calls (the server is gone)


class _Worker(threading.Thread):
    def __init__(self, kind: ServerKind, target: str, payloads: list[bytes], offset: int,
                 stop: threading.Event) -> None:
        super().__init__(daemon=True, name=f"bench-client-{offset}")
        self.kind, self.target, self.payloads, self.offset, self.stop = kind, target, payloads, offset, stop
        self.latency_ns = array("q")
        self.end_ns = array("q")
        self.errors: dict[str, int] = {}
        self.ok = 0

    def run(self) -> None:
        call, close = self.kind.caller(self.target)
        payloads, n = self.payloads, len(self.payloads)
        clock = time.perf_counter_ns
        i = self.offset
        failures = 0
        try:
            while not self.stop.is_set() and failures < _MAX_ERRORS:
                payload = payloads[i % n]
                i += 1
                t0 = clock()
                try:
                    call(payload)
                except Exception as exc:  # grpc.RpcError and friends: count, never hide
                    failures += 1
                    code = getattr(exc, "code", None)
                    name = str(code()) if callable(code) else type(exc).__name__
                    self.errors[name] = self.errors.get(name, 0) + 1
                    continue
                t1 = clock()
                self.ok += 1
                self.latency_ns.append(t1 - t0)
                self.end_ns.append(t1)
        finally:
            close()


def run_once(cmd: dict[str, Any], payload_cache: dict[str, list[bytes]]) -> dict[str, Any]:
    kind = server_kind(cmd["kind"])
    if kind.name not in payload_cache:
        payload_cache[kind.name] = kind.payloads()
    stop = threading.Event()
    workers = [_Worker(kind, cmd["target"], payload_cache[kind.name], i * 7, stop)
               for i in range(int(cmd["threads"]))]
    server_pid, collector_pid, me = int(cmd["server_pid"]), int(cmd.get("collector_pid") or 0), os.getpid()
    for w in workers:
        w.start()
    try:
        time.sleep(float(cmd["warmup_s"]))
        server0, coll0, client0, t0 = tree_cpu(server_pid), process_cpu_s(collector_pid), process_cpu_s(me), \
            time.perf_counter_ns()
        time.sleep(float(cmd["window_s"]))
        server1, coll1, client1, t1 = tree_cpu(server_pid), process_cpu_s(collector_pid), process_cpu_s(me), \
            time.perf_counter_ns()
    finally:
        stop.set()
        for w in workers:
            w.join(15.0)
    latencies: list[int] = []
    errors: dict[str, int] = {}
    for w in workers:
        latencies.extend(lat // 1000 for lat, end in zip(w.latency_ns, w.end_ns) if t0 <= end <= t1)
        for code, count in w.errors.items():
            errors[code] = errors.get(code, 0) + count
    return {
        "requests": len(latencies),
        "window_s": (t1 - t0) / 1e9,
        "latency_us": latencies,
        "server_cpu_s": server1.main_s - server0.main_s,
        "helpers_cpu_s": server1.helpers_s - server0.helpers_s,
        "collector_cpu_s": coll1 - coll0,
        "client_cpu_s": client1 - client0,
        "total_ok": sum(w.ok for w in workers),
        "errors": errors,
    }


def main() -> int:
    cache: dict[str, list[bytes]] = {}
    sys.stdout.write(json.dumps({"event": "ready", "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        result = run_once(json.loads(line), cache)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
