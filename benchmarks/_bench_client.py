"""Client process of the overhead benchmark: a closed-loop load generator driven by JSON lines on stdin.

One command runs one *phase*: the same number of client threads against several servers in turn, in short
time slices, so that whatever else the machine does hits every server alike::

    {"kind": K, "threads": N, "warmup_s": W, "slice_s": S, "cycles": C, "lead_s": L, "collector_pid": PID,
     "targets": [{"name": CONFIG, "target": "127.0.0.1:P", "server_pid": PID, "helper_pids": [PID]}, ...],
     "paired": false}

A target may name its own server kind (``"kind": K2``, e.g. the gRPC echo servers that a Thrift round's paired
phase measures side by side with its own): its calls then use that kind's client and payloads.

With ``"paired": true`` the measured part is one stretch of ``S × C × len(targets)`` seconds in which every
thread sends its calls to all servers in turn (A, B, C, A, ...): every server answers the same calls under the
same conditions at the same moments, which measures CPU per request far more steadily than slices do (latency
in a paired phase mixes the servers' effects on each other and is not a per-server figure).

N threads, each with its own channel to every server, send one request at a time (the kind's payloads,
round-robin) to the server of the current slice. First each server gets ``warmup_s`` of load (not
measured; in a paired phase all servers get one ``warmup_s`` together). Then C cycles run one ``slice_s``
slice per server, in an order that rotates every cycle, each slice after ``lead_s`` (default 0) of the same
server's load whose calls are not measured: what the previous slice's server still does after its slice (an
export helper's and the collector's work on its last half second of spans, a batch processor's last batch) falls
there, and the server's own export work runs in its measured slice as it does under steady load. The CPU
(``_bench_proc``: process CPU clocks, ns) of every server's process tree (the server plus its helper processes),
of the collector and of this client is read once when the measured part starts and once when it ends: a
server's CPU over the whole phase (its export work included, whenever it ran) goes with the calls it answered
between the two readings (``answered``). The answer is one JSON line::

    {"measured_s": ..., "collector_cpu_s": ..., "client_cpu_s": ...,
     "per_target": {CONFIG: {"requests": completed in measured slices, "slices_s": their total length,
                             "latency_us": [client-side µs of each], "server_cpu_s": ..., "helpers_cpu_s": ...,
                             "answered": successful calls between the two CPU readings (lead-ins included),
                             "total_ok": successful calls of the phase (warm-up included), "errors": {..}}}}

An empty line or EOF ends the process.
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
from _bench_proc import TreeCpu, process_cpu_s, tree_cpu

_MAX_ERRORS = 200  # a thread stops after this many failed calls (a server is gone)
PAIRED = -2  # switch.target in a paired phase: each thread sends its calls to the servers in turn


class _Switch:
    """Which target the client threads call now (-1: none, threads idle) and whether the calls count."""

    def __init__(self) -> None:
        self.target = -1
        self.measured = False
        self.stop = False


class _Worker(threading.Thread):
    def __init__(self, targets: list[tuple[ServerKind, str, list[bytes]]], offset: int, switch: _Switch) -> None:
        super().__init__(daemon=True, name=f"bench-client-{offset}")
        self.targets, self.offset, self.switch = targets, offset, switch  # (kind, address, payloads) each
        n = len(targets)
        self.latency_ns = [array("q") for _ in range(n)]
        self.ok = [0] * n
        self.errors: list[dict[str, int]] = [{} for _ in range(n)]
        self.failures = 0
        self.busy = False

    def run(self) -> None:
        callers = [kind.caller(address) for kind, address, _ in self.targets]
        payloads = [p for _, _, p in self.targets]
        clock = time.perf_counter_ns
        switch = self.switch
        i = self.offset
        try:
            while not switch.stop and self.failures < _MAX_ERRORS:
                self.busy = True  # before reading the target: the phase's end waits for this call
                index = switch.target
                if index == PAIRED:
                    index = i % len(callers)
                elif index < 0:
                    self.busy = False
                    time.sleep(0.001)
                    continue
                measured = switch.measured
                call = callers[index][0]
                payload = payloads[index][i % len(payloads[index])]
                i += 1
                t0 = clock()
                try:
                    call(payload)
                except Exception as exc:  # grpc.RpcError and friends: count, never hide
                    self.busy = False
                    self.failures += 1
                    code = getattr(exc, "code", None)
                    name = str(code()) if callable(code) else type(exc).__name__
                    self.errors[index][name] = self.errors[index].get(name, 0) + 1
                    continue
                t1 = clock()
                self.busy = False
                self.ok[index] += 1
                if measured:
                    self.latency_ns[index].append(t1 - t0)
        finally:
            for _, close in callers:
                close()


def _snapshot(pids: list[int], helpers: list[tuple[int, ...]]) -> list[TreeCpu]:
    return [tree_cpu(pid, extra) for pid, extra in zip(pids, helpers)]


def _answered(workers: list[_Worker], n: int) -> list[int]:
    """Successful calls so far per target, over all threads."""
    return [sum(w.ok[index] for w in workers) for index in range(n)]


def _slices(switch: _Switch, slice_s: float, cycles: int, slices_s: list[float], lead_s: float = 0.0) -> None:
    """The servers in turn, one slice each per cycle, the order rotating every cycle; each slice after ``lead_s``
    of unmeasured calls to the same server (a call counts for the slice it started in)."""
    for cycle in range(cycles):
        for k in range(len(slices_s)):
            index = (cycle + k) % len(slices_s)
            if lead_s > 0:
                switch.measured = False
                switch.target = index
                time.sleep(lead_s)
                switch.measured = True
            start = time.monotonic()
            switch.target = index
            time.sleep(slice_s)
            slices_s[index] += time.monotonic() - start


def _paired(switch: _Switch, total_s: float, slices_s: list[float]) -> None:
    """All servers at once for ``total_s``: every client thread sends its calls to them in turn (A, B, C, A, ...),
    so each server gets the same load at the same moments and whatever else the machine does hits all alike."""
    start = time.monotonic()
    switch.target = PAIRED  # already so since the warm-up
    time.sleep(total_s)
    for index in range(len(slices_s)):
        slices_s[index] = time.monotonic() - start


def run_phase(cmd: dict[str, Any], payload_cache: dict[str, list[bytes]]) -> dict[str, Any]:
    targets = cmd["targets"]
    kinds = [server_kind(t.get("kind", cmd["kind"])) for t in targets]
    for kind in kinds:
        if kind.name not in payload_cache:
            payload_cache[kind.name] = kind.payloads()
    calls = [(kind, t["target"], payload_cache[kind.name]) for kind, t in zip(kinds, targets)]
    names = [t["name"] for t in targets]
    pids = [int(t["server_pid"]) for t in targets]
    helpers = [tuple(int(p) for p in t.get("helper_pids", ())) for t in targets]
    collector_pid, me = int(cmd.get("collector_pid") or 0), os.getpid()
    slice_s, cycles = float(cmd["slice_s"]), int(cmd["cycles"])
    switch = _Switch()
    workers = [_Worker(calls, i * 7, switch) for i in range(int(cmd["threads"]))]
    for w in workers:
        w.start()
    slices_s = [0.0] * len(targets)
    try:
        for index in range(1 if cmd.get("paired") else len(targets)):  # paired: one warm-up, all servers
            switch.target = PAIRED if cmd.get("paired") else index
            time.sleep(float(cmd["warmup_s"]))
        switch.measured = True
        cpu0, coll0 = _snapshot(pids, helpers), process_cpu_s(collector_pid)
        client0, t0, ok0 = process_cpu_s(me), time.monotonic(), _answered(workers, len(targets))
        if cmd.get("paired"):
            _paired(switch, slice_s * cycles * len(targets), slices_s)
        else:
            _slices(switch, slice_s, cycles, slices_s, float(cmd.get("lead_s", 0.0)))
        switch.target = -1
        deadline = time.monotonic() + 15.0
        while any(w.busy for w in workers) and time.monotonic() < deadline:  # calls in flight finish first
            time.sleep(0.001)
        cpu1, coll1 = _snapshot(pids, helpers), process_cpu_s(collector_pid)
        client1, t1, ok1 = process_cpu_s(me), time.monotonic(), _answered(workers, len(targets))
    finally:
        switch.stop = True
        for w in workers:
            w.join(15.0)
    per_target: dict[str, Any] = {}
    total_ok = _answered(workers, len(targets))
    for index, name in enumerate(names):
        latencies = [lat // 1000 for w in workers for lat in w.latency_ns[index]]
        errors: dict[str, int] = {}
        for w in workers:
            for code, count in w.errors[index].items():
                errors[code] = errors.get(code, 0) + count
        per_target[name] = {
            "requests": len(latencies),
            "slices_s": slices_s[index],
            "latency_us": latencies,
            "server_cpu_s": cpu1[index].main_s - cpu0[index].main_s,
            "helpers_cpu_s": cpu1[index].helpers_s - cpu0[index].helpers_s,
            "answered": ok1[index] - ok0[index],
            "total_ok": total_ok[index],
            "errors": errors,
        }
    return {"measured_s": t1 - t0, "collector_cpu_s": coll1 - coll0, "client_cpu_s": client1 - client0,
            "per_target": per_target}


def main() -> int:
    cache: dict[str, list[bytes]] = {}
    sys.stdout.write(json.dumps({"event": "ready", "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        result = run_phase(json.loads(line), cache)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
