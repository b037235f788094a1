"""Resident memory of a model server through many on-demand profiling rounds, before and after the session
thread fix, side by side in one run.

Three server processes (``benchmarks/_bench_profiling_memory.py``: the demo Ranker as ``zoomer-serve
serve-demo`` runs it, exporting over OTLP/gRPC to one embedded collector process) are driven in turns through
the same rounds over their ``ProfilerControl`` admin service: start a session bounded to ``--requests``
requests, send exactly those ``Predict`` calls (2 client threads, batch 8, from this process), wait until the
session has written its trace, then read the server's RSS (``VmRSS`` of ``/proc/<pid>/status``, MiB). The
variants:

- ``thread_per_session``: every session on a new thread (the controller before the fix);
- ``thread_per_session_arena_max_1``: the same with ``MALLOC_ARENA_MAX=1`` (one glibc malloc arena for every
  thread): the diagnostic that names the cause;
- ``one_thread``: every session on the controller's one long-lived session thread (zoomer-serve now).

Growth is counted from the end of round 5 (the first rounds build lazily made state); the target is at most
20 MB over 30 rounds. Results: ``benchmarks/RESULTS.md``.

    python benchmarks/profiling_memory.py [--rounds 30] [--requests 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

sys.path.insert(0, str(HERE))
from _bench_args import Range, parse  # noqa: E402

from zoomer_serve.demo.load import drive_load  # noqa: E402
from zoomer_serve.processes import start_zoomer_command, stop_process, wait_for_event  # noqa: E402
from zoomer_serve.profiling.client import ProfilerClient  # noqa: E402

TOKEN = "bench-profiling-memory"
SETTLED_ROUND = 5
VARIANTS: dict[str, dict[str, str]] = {  # variant -> its extra environment
    "thread_per_session": {},
    "thread_per_session_arena_max_1": {"MALLOC_ARENA_MAX": "1"},
    "one_thread": {},
}
LOAD = {"clients": 2, "batch_size": 8, "stream_share": 0.0, "invalid_share": 0.0}


def rss_mb(pid: int) -> float:
    """``VmRSS`` of ``/proc/<pid>/status`` in MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


@dataclass
class Server:
    variant: str
    proc: subprocess.Popen[bytes]
    target: str
    client: ProfilerClient
    rss: list[float]

    def round(self, number: int, requests: int) -> None:
        reply = self.client.start(max_requests=requests)
        if reply.session is None or reply.session.number != number:
            raise RuntimeError(f"{self.variant}: round {number} did not start: {reply.message}")
        if drive_load(self.target, 60.0, max_requests=requests, **LOAD).unexpected:
            raise RuntimeError(f"{self.variant}: calls failed in round {number}")
        info = self.client.wait_finished(number, 120)
        if info is None or info.outcome != "done":
            raise RuntimeError(f"{self.variant}: round {number} did not finish: {info}")
        self.rss.append(rss_mb(self.proc.pid))


def start_server(variant: str, env: dict[str, str], folder: Path) -> Server:
    server_variant = "one_thread" if variant == "one_thread" else "thread_per_session"
    proc = subprocess.Popen([sys.executable, str(HERE / "_bench_profiling_memory.py"), server_variant,
                             str(folder / variant)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(env, **VARIANTS[variant]))
    ready = wait_for_event(proc, "ready", 180)
    if ready is None:
        proc.kill()
        raise RuntimeError(f"the {variant} server did not start")
    target = f"127.0.0.1:{ready['port']}"
    return Server(variant, proc, target, ProfilerClient(target, token=TOKEN), [])


def stop_server(server: Server) -> None:
    server.client.close()
    assert server.proc.stdin is not None
    try:
        server.proc.stdin.write(b"stop\n")
        server.proc.stdin.close()
        server.proc.wait(90)
    except (OSError, subprocess.TimeoutExpired):
        server.proc.kill()
        server.proc.wait()


def run(rounds: int, requests: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zoomer-profiling-memory-") as tmp:
        folder = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ZOOMER_", "MALLOC_"))}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p)
        collector, ready = start_zoomer_command(["collector", "--store", str(folder / "store.duckdb"), "--grpc-port",
                                                 "0", "--http-port", "0"], env, "embedded collector")
        env.update(ZOOMER_ADMIN_TOKEN=TOKEN, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{ready['grpc_port']}",
                   OTEL_SERVICE_NAME="bench-profiling-memory")
        servers: list[Server] = []
        try:
            for variant in VARIANTS:
                servers.append(start_server(variant, env, folder))
            for server in servers:  # warm-up
                drive_load(server.target, 60.0, max_requests=4 * requests, **LOAD)
            for number in range(1, rounds + 1):
                for server in servers[number % len(servers):] + servers[:number % len(servers)]:  # rotate order
                    server.round(number, requests)  # its traces stay until the end: the server may still be
                    # copying them into artifacts/ (deleting them here raced with that copy)
                print(f"round {number}: " + ", ".join(f"{s.variant} {s.rss[-1]:.0f} MB" for s in servers),
                      file=sys.stderr, flush=True)
        finally:
            for server in servers:
                stop_server(server)
            stop_process(collector, 60)
    return {"rounds": rounds, "requests_per_round": requests, "settled_round": SETTLED_ROUND,
            "cpu_count": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2),
            "rss_mb": {s.variant: [round(mb, 1) for mb in s.rss] for s in servers}}


def growth(rss: list[float], settled: int = SETTLED_ROUND) -> tuple[float, float]:
    """(last - round ``settled``, max after round ``settled`` - round ``settled``), MiB."""
    base = rss[settled - 1]
    return rss[-1] - base, max(rss[settled:]) - base


def print_table(result: dict[str, Any]) -> None:
    table = result["rss_mb"]
    names = list(table)
    print("| round | " + " | ".join(f"{n} RSS MB" for n in names) + " |")
    print("| --- | " + " | ".join("---" for _ in names) + " |")
    for i in range(result["rounds"]):
        print(f"| {i + 1} | " + " | ".join(f"{table[n][i]:.1f}" for n in names) + " |")
    if result["rounds"] > SETTLED_ROUND:
        for label, index in (("growth, round 5 to last", 0), ("largest growth after round 5", 1)):
            print(f"| {label} | " + " | ".join(f"{growth(table[n])[index]:+.1f}" for n in names) + " |")


RANGES = (Range("--rounds", 1, 1000), Range("--requests", 1, 10_000))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--requests", type=int, default=20, help="requests each session covers (20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv, RANGES)
    result = run(args.rounds, args.requests)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.rounds} rounds of {args.requests} requests, {result['cpu_count']} CPUs, "
              f"load average {result['load_1min']} at the end")
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
