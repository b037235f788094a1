"""Overhead benchmark: what zoomer-serve's interceptors cost a server, against a bare server and against
the OpenTelemetry contrib gRPC interceptor, both exporting over real OTLP to the same embedded collector.

Server kinds: sync gRPC echo, the demo DLRM model server, grpc.aio echo, thriftpy2 echo (no contrib row: the
contrib project has no Thrift interceptor; its zoomer overhead is compared with the gRPC echo's, judged in its
round's paired phase, which measures a gRPC echo bare and zoomer server side by side with the Thrift rows, beside
a ``python_work`` control row that adds plain Python to each call and records nothing, and an ``offload_work``
control row that hands as much CPU per call as zoomer-serve's export costs to a child process; its p99 ÷ bare
with the gRPC echo's in the same run). Extra rows
(``--extras``, ``{"what", "value", "unit"}`` each, under ``extra_rows`` in the JSON): GPU telemetry over fake
sources (``_bench_gpu.py``), the profiler idle and inside a session (``_bench_profiling.py``), host telemetry
and the CPU samplers (``_bench_host.py``).

Usage::

    python benchmarks/overhead.py            # full run with the extra rows
    python benchmarks/overhead.py --quick    # under 2 minutes, no extra rows
    python benchmarks/overhead.py --quick --json   # one JSON object on stdout, progress on stderr
    python benchmarks/overhead.py --gpu      # + the zoomer_gpu_fake row on the sync gRPC kinds
    python benchmarks/overhead.py --kinds thrift_echo --configs bare,zoomer_record_only,python_work,zoomer,offload_work

Method (see benchmarks/RESULTS.md for figures):

- Three kinds of process, all started as subprocesses (fork+exec, never a bare fork): the embedded OTLP
  collector (``_bench_collector.py``), one server process per configuration per round (``_bench_server.py``),
  and one closed-loop client process (``_bench_client.py``) that runs 1 and 8 client threads per server.
- Each round every configuration gets a fresh server (the previous round's servers flush and stop while these
  start; neither is measured). Then, for each client thread count (their order alternates between rounds):
- Paired phases (CPU): after one warm-up, ``n`` client threads per server each call all the round's servers
  in turn (A, B, C, A, ...), so that every server answers the same calls at the same moments and whatever else
  the machine does hits all alike (in the full run the model's last three times as long: ``MODEL_PAIRED_SCALE``). A Thrift round's paired phases also call a gRPC echo server bare and with
  zoomer's interceptor (the reference rows ``echo:bare``, ``echo:zoomer``): the Thrift overhead target is judged
  there. CPU per request = CPU of the server process and of every helper process it started (zoomer-serve's
  export helper), read from their process CPU clocks (ns; ``_bench_proc.py``) when the measured part starts and
  ends, divided by the calls it answered. Overhead (µs) = CPU per request of a configuration − that of the bare
  server in the same round; the tables and ``overhead_us`` give the median over rounds (each round in
  ``overhead_us_rounds``), ``overhead_ratio_vs_contrib`` the median over rounds of zoomer's overhead ÷
  contrib's in the same round (``_rounds``, ``_spread``: lowest and highest).
- Slices (latency, throughput): after a warm-up per server, the client cycles through the servers in short
  slices (``--slice`` seconds, ``--cycles`` per server, the order rotating every cycle), so that drift and the
  neighbours' load hit all configurations alike, and one server at a time has the load. Each slice follows a
  lead-in (``--lead`` seconds) of the same server's load that is not measured: the previous row's leftover export
  work falls there, and the row's own runs in its slice as under steady load (see ``MODES``). Latency
  percentiles are client-side, over every measured request of every round. The collector's CPU counts for no configuration
  (shown per phase).
- After the run, the collector's store is read: for each server process, SERVER spans stored versus
  requests it answered (``spans_lost``).

The configurations and server kinds are declared in ``_bench_configs.py``; new rows are a few lines there.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _bench_args import Range, parse  # noqa: E402
from _bench_configs import (  # noqa: E402
    BARE,
    CONFIGURATIONS,
    CONTRIB,
    OFFLOAD_WORK,
    OFFLOAD_WORK_US,
    OTLP_HTTP_ENDPOINT_VAR,
    PYTHON_WORK,
    PYTHON_WORK_US,
    SERVER_KINDS,
    THRIFT,
    THRIFT_CLIENT_TIMEOUT_MS,
    ZOOMER,
    configuration,
    server_kind,
)
from _bench_gpu import GPU_FAKE  # noqa: E402

TARGET_OVERHEAD_RATIO_VS_CONTRIB = 0.5
TARGET_P99_RATIO_VS_BARE = 1.3
TARGET_P99_THREADS = 8
TARGET_THRIFT_OVERHEAD_RATIO_VS_GRPC = 1.1  # Thrift zoomer overhead within 10 % of the sync gRPC echo's
CONTROL_ROWS = {  # the Thrift kind's control rows: what each adds to a plain server's call
    PYTHON_WORK: f"plain processor, {PYTHON_WORK_US:.0f} µs of plain Python per call",
    OFFLOAD_WORK: f"plain server, {OFFLOAD_WORK_US:.0f} µs of CPU per call in a child process at niceness 5",
}
TARGET_THRIFT_P99_RATIO_VS_GRPC = 1.3  # Thrift zoomer p99 ÷ bare, 8 client threads: within 1.3 × the gRPC echo's
GRPC_REFERENCE_KIND = "echo"  # the gRPC interceptor's overhead the Thrift row is compared with
REFERENCE_SEP = ":"  # a reference row of a Thrift round's paired phase: "echo:bare", "echo:zoomer"
EXTRA_SECTIONS = ("gpu", "profiling", "host")  # _bench_extras.py sections (--extras)
EXTRA_TIMEOUT_S = 600.0
SCHEMA = "zoomer-serve/benchmarks/overhead/v1"


@dataclass(frozen=True)
class Plan:
    """How long and how often to measure. Times in seconds."""

    mode: str
    rounds: int
    warmup_s: float
    slice_s: float
    cycles: int
    threads: tuple[int, ...]
    kinds: tuple[str, ...]
    configs: tuple[str, ...]
    collector_nice: int = 0
    extras: tuple[str, ...] = ()  # sections of extra rows to measure (--extras, --extra-sections)
    paired_s: float | None = None  # seconds of each paired phase (--paired-s); None: paired_per_server_s per server
    paired_per_server_s: float = 3.0
    lead_s: float = 0.0  # seconds of unmeasured load before each slice, on the slice's server (--lead)
    scale_paired: bool = False  # paired phases last the kind's paired_scale times as long (the full run)

    def paired_seconds(self, rows: int, kind: str | None = None) -> float:
        """How long one paired phase of ``rows`` servers (of ``kind``) measures: ``--paired-s``, else
        ``paired_per_server_s`` per server, in the full run times the kind's ``paired_scale`` (the model's: 3;
        the quick run stays under two minutes without it)."""
        if self.paired_s is not None:
            return self.paired_s
        return self.paired_per_server_s * rows * (1.0 if kind is None else self.paired_scale(kind))

    def paired_scale(self, kind: str) -> float:
        """How many times ``paired_per_server_s`` a ``kind`` server gets in a paired phase: the kind's
        ``paired_scale`` in the full run, else 1."""
        return server_kind(kind).paired_scale if self.scale_paired else 1.0

    def kind_configs(self, kind: str) -> tuple[str, ...]:
        """The configurations that apply to ``kind`` (a Thrift server has no contrib row), in plan order."""
        k = server_kind(kind)
        return tuple(c for c in self.configs if k.runs(configuration(c)))

    def longest_pause_s(self, kind: str) -> float:
        """The longest time one client connection to a ``kind`` server waits while the other rows take their
        turn: the others' warm-ups, or 2 × (rows − 1) slices with their lead-ins when the rotating order puts a
        row first in one cycle and last in the next."""
        others = len(self.kind_configs(kind)) - 1
        return max(2 * others * (self.lead_s + self.slice_s), others * self.warmup_s)

    def reference_rows(self, kind: str) -> tuple[str, ...]:
        """The rows of :data:`GRPC_REFERENCE_KIND` servers that a Thrift round also starts and measures in its
        paired phase, side by side with its own (``echo:bare``, ``echo:zoomer``): the Thrift target compares two
        overheads, and measured in the same seconds on the same client threads, the drift between runs (20 to
        30 % of each overhead on the benchmark machine) hits both alike. Empty for gRPC kinds and for plans
        without both ``bare`` and ``zoomer``."""
        if server_kind(kind).transport != THRIFT or not {BARE, ZOOMER} <= set(self.kind_configs(kind)):
            return ()
        return tuple(reference_row(c) for c in (BARE, ZOOMER))


def reference_row(config: str) -> str:
    """The name of a reference row: ``echo:zoomer`` for the :data:`GRPC_REFERENCE_KIND` server with ``config``."""
    return f"{GRPC_REFERENCE_KIND}{REFERENCE_SEP}{config}"


def row_kind_config(kind: str, row: str) -> tuple[str, str]:
    """The server kind and configuration of a row of ``kind``'s round: ``("echo", "zoomer")`` for the reference
    row ``echo:zoomer``, else ``(kind, row)``."""
    if REFERENCE_SEP in row:
        ref_kind, config = row.split(REFERENCE_SEP, 1)
        return ref_kind, config
    return kind, row


MODES = {  # mode -> (rounds, warmup_s, slice_s, cycles, paired seconds per server, lead_s)
    "full": (4, 1.0, 0.5, 8, 3.0, 0.5),
    "quick": (2, 0.0, 0.25, 2, 0.3, 0.5),
    "smoke": (1, 0.2, 0.2, 1, 0.1, 0.1),
}
"""Many short slices rather than a few long ones: a burst of the neighbours' load then falls on every row's
slices alike instead of on one row's (the p99 at 8 client threads moved by up to 2x between quick runs with 3
slices of 0.4 s). A paired phase lasts its servers' count times the fifth figure, in the full run times
the kind's ``paired_scale`` (the model's 3; ``--paired-s`` overrides both).

Each slice starts with ``lead_s`` of its own server's load that is not measured (``--lead`` overrides). A server
with an export helper leaves work behind when its slice ends: its writer hands the records of up to its last
500 ms to the helper, which encodes and sends them, and the collector stores them; a contrib server's batch
processor exports its last batch. Without a lead-in that work ran in the next row's measured slice, always the
same row's (the order rotates, so the successor stays the same), and the row's own export only partly ran in
its own slices: zoomer's gRPC echo p99 at 8 client threads read 0.96 to 1.18 × bare in quick runs whose slices
had no lead-in, 1.25 to 1.98 × with 0.6 s (benchmarks/RESULTS.md, runs of 2026-12-02 from 22:00). Half a second
covers the writer's period. The lead-ins cost time: the full run has 8 slices of 0.5 s where it had 12, the quick
run 2 of 0.25 s where it had 5 of 0.2 s, and no warm-up (the first lead-in is one), to stay under two minutes."""


# -- child processes ---------------------------------------------------------------------------------------
class Child:
    """A subprocess that talks JSON lines: commands on stdin, answers on stdout; stderr is passed through."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, name: str = "") -> None:
        self.name = name or Path(args[1]).stem
        self.proc = subprocess.Popen(list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, env=env, cwd=str(HERE), close_fds=True)
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(json.loads(line))
            else:
                sys.stderr.write(f"[{self.name}] {line}")
        self._lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, timeout_s: float, event: str | None = None) -> dict[str, Any]:
        """The next JSON line (with ``"event": event`` when given); RuntimeError on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: no answer within {timeout_s:.0f} s") from None
            if msg is None:
                raise RuntimeError(f"{self.name}: exited with code {self.proc.wait()} before answering")
            if event is None or msg.get("event") == event:
                return msg

    def close(self, timeout_s: float = 15.0) -> None:
        """Close stdin, wait up to ``timeout_s``, then kill."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _python(script: str) -> list[str]:
    return [sys.executable, str(HERE / script)]


def _server_env(service_name: str, grpc_port: int, http_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ZOOMER_"))}
    env.update(OTEL_SERVICE_NAME=service_name, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{grpc_port}",
               OTEL_EXPORTER_OTLP_PROTOCOL="grpc", PYTHONUNBUFFERED="1")
    env[OTLP_HTTP_ENDPOINT_VAR] = f"http://127.0.0.1:{http_port}"
    return env


# -- measurements --------------------------------------------------------------------------------------------
@dataclass
class Cell:
    """Everything measured for one (kind, configuration, threads) over all rounds."""

    requests: int = 0
    slices_s: float = 0.0
    latency_us: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    rounds: list[dict[str, float]] = field(default_factory=list)  # per round: cpu_us_per_request, requests_per_s, p99_us

    def add(self, run: dict[str, Any]) -> None:
        """Add one phase's figures of this configuration (a ``per_target`` entry of the client's answer). Its CPU
        per request (the progress line's; the rows' CPU figures come from the paired phases) divides the CPU
        between the phase's two readings by the calls answered between them, lead-ins included."""
        self.requests += run["requests"]
        self.slices_s += run["slices_s"]
        self.latency_us.extend(run["latency_us"])
        for code, count in run["errors"].items():
            self.errors[code] = self.errors.get(code, 0) + count
        self.rounds.append({"cpu_us_per_request": (run["server_cpu_s"] + run["helpers_cpu_s"])
                            / max(1, run["answered"]) * 1e6,
                            "requests_per_s": run["requests"] / max(1e-9, run["slices_s"]),
                            "p99_us": percentile(run["latency_us"], 99)})

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.slices_s if self.slices_s else 0.0


@dataclass
class Phase:
    """Figures of all configurations together for one (kind, threads): the collector's and the client's CPU, and
    the calls answered while they were read (lead-ins included)."""

    requests: int = 0
    collector_cpu_s: float = 0.0
    client_cpu_s: float = 0.0


def percentile(values: list[int], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return float(ordered[rank - 1])


@dataclass
class Results:
    plan: Plan
    cells: dict[tuple[str, str, int], Cell] = field(default_factory=dict)
    phases: dict[tuple[str, int], Phase] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)  # service name -> successful calls
    services: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (kind, config) -> service names
    stored_server_spans: dict[str, int] = field(default_factory=dict)
    instrumentation: dict[str, dict[str, Any]] = field(default_factory=dict)
    helper_pids: dict[str, list[int]] = field(default_factory=dict)  # service name -> helper processes counted
    collector_stats: dict[str, Any] = field(default_factory=dict)
    extra_rows: dict[str, list[dict[str, Any]]] | None = None  # --extras: section -> {"what","value","unit"} rows
    # paired phases, per (kind, row, calls in flight per server): [server s, helpers s, calls] and CPU µs/req per round
    paired: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    paired_rounds: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    started: str = ""
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    elapsed_s: float = 0.0


_T0 = time.monotonic()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _log_step(msg: str) -> None:
    """A progress line with the seconds since the benchmark started (where the run's time goes)."""
    _log(f"{msg} [{time.monotonic() - _T0:.1f} s]")


def measure(plan: Plan) -> Results:
    """Run every round; returns the raw results (see :func:`summarise`)."""
    res = Results(plan, started=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  load_before=os.getloadavg())
    t_start = time.monotonic()
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="zoomer-bench-") as tmp:
        store = Path(tmp) / "bench.duckdb"
        try:
            collector = Child(_python("_bench_collector.py") + [str(store), str(plan.collector_nice)],
                              name="collector")
            children.append(collector)
            col = collector.expect(60, "ready")
            client = Child(_python("_bench_client.py"), name="client")
            children.append(client)
            client.expect(60, "ready")
            stopping: Stopping = []
            for rnd in range(plan.rounds):
                for kind in plan.kinds:
                    _one_round(res, kind, rnd, col, client, children, stopping)
            _finish_stopping(res, stopping, children)
            collector.send("stop")
            res.collector_stats = collector.expect(60, "stopped")
        finally:
            for child in reversed(children):
                child.close()
        res.stored_server_spans = _stored_server_spans(store)
    if plan.extras:
        res.extra_rows = extra_rows(plan.extras, plan.mode != "full")
    res.load_after = os.getloadavg()
    res.elapsed_s = time.monotonic() - t_start
    return res



def extra_rows(sections: Sequence[str], quick: bool) -> dict[str, list[dict[str, Any]]]:
    """The extra rows (``--extras``): each section of ``_bench_extras.py`` in its own process, one after the
    other, after the servers have stopped (``quick``: fewer calls and rounds). A section that fails gives one
    row saying why (the run goes on)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for section in sections:
        _log(f"extra rows: {section} ...")
        args = _python("_bench_extras.py") + [section] + (["--quick"] if quick else [])
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=EXTRA_TIMEOUT_S, cwd=str(HERE))
        except subprocess.TimeoutExpired:
            out[section] = [{"what": f"{section} rows not measured", "value": f"timed out after {EXTRA_TIMEOUT_S:.0f} s",
                             "unit": ""}]
            continue
        lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
        if proc.returncode != 0 or not lines:
            _log(proc.stderr[-2000:])
            out[section] = [{"what": f"{section} rows not measured",
                             "value": f"exit code {proc.returncode}: {proc.stderr.strip()[-300:]}", "unit": ""}]
            continue
        out[section] = json.loads(lines[-1])
    return out


Stopping = list[tuple[Child, str]]  # servers told to stop, with their service names


def _finish_stopping(res: Results, stopping: Stopping, children: list[Child]) -> None:
    """Collect the counters of servers told to stop and close them."""
    try:
        for server, service in stopping:
            res.instrumentation[service] = server.expect(60, "stopped").get("instrumentation", {})
    finally:
        for server, _ in stopping:
            server.close()
            children.remove(server)
        stopping.clear()


def _one_round(res: Results, kind: str, rnd: int, col: dict[str, Any], client: Child,
               children: list[Child], stopping: Stopping) -> None:
    """One round of one server kind: a fresh server process per configuration (and per reference row, see
    :meth:`Plan.reference_rows`), then one paired phase per client thread count (CPU), then one interleaved
    phase of slices per client thread count (latency, throughput), each in an order that alternates between
    rounds, then the servers are told to stop. ``stopping``: the previous round's servers, still flushing
    while this round's start (neither is measured); they are collected before this round measures, and this
    round's are left in it."""
    plan = res.plan
    configs = plan.kind_configs(kind)
    shift = rnd % len(configs)
    order = configs[shift:] + configs[:shift]
    servers: dict[str, tuple[Child, dict[str, Any], str]] = {}
    started: dict[str, tuple[Child, str]] = {}
    rows = (*order, *plan.reference_rows(kind))
    try:
        for config in rows:  # all start at once (start-up is not measured)
            service = f"bench-{kind}-{config.replace(REFERENCE_SEP, '-')}-r{rnd}"
            res.services.setdefault((kind, config), []).append(service)
            server = Child(_python("_bench_server.py") + list(row_kind_config(kind, config)),
                           env=_server_env(service, col["grpc_port"], col["http_port"]), name=f"server {kind}/{config}")
            children.append(server)
            started[config] = (server, service)
            res.answered[service] = 0
        for config, (server, service) in started.items():
            servers[config] = (server, server.expect(180, "ready"), service)
            res.answered[service] += servers[config][1].get("primed", 0)  # its spans are stored too
            res.helper_pids[service] = servers[config][1]["helper_pids"]
        _finish_stopping(res, stopping, children)
        _log_step(f"round {rnd + 1}/{plan.rounds}  {kind:<6} {len(servers)} servers ready")
        threads = plan.threads if rnd % 2 == 0 else tuple(reversed(plan.threads))
        for n in threads:
            _paired_phase(res, kind, rnd, rows, servers, col, client, n)
        for n in threads:
            _log_step(f"round {rnd + 1}/{plan.rounds}  {kind:<6} {n} client thread(s): {', '.join(order)} ...")
            targets = _client_targets(kind, order, servers)
            client.send(json.dumps({"kind": kind, "threads": n, "warmup_s": plan.warmup_s, "slice_s": plan.slice_s,
                                    "cycles": plan.cycles, "lead_s": plan.lead_s, "collector_pid": col["pid"],
                                    "targets": targets}))
            budget = len(order) * (plan.warmup_s + (plan.lead_s + plan.slice_s) * plan.cycles) + 60
            phase = client.expect(budget)
            total = res.phases.setdefault((kind, n), Phase())
            total.collector_cpu_s += phase["collector_cpu_s"]
            total.client_cpu_s += phase["client_cpu_s"]
            for config, run in phase["per_target"].items():
                res.answered[servers[config][2]] += run["total_ok"]
                total.requests += run["answered"]
                cell = res.cells.setdefault((kind, config, n), Cell())
                cell.add(run)
                last = cell.rounds[-1]
                _log(f"    {config:<8} {run['requests']:6d} requests, {last['requests_per_s']:5.0f}/s, "
                     f"{last['cpu_us_per_request']:5.0f} µs CPU/request (helpers {run['helpers_cpu_s']:.2f} s), "
                     f"p99 {last['p99_us']:.0f} µs, errors {run['errors'] or 0}")
        for server, _, _ in servers.values():
            server.send("stop")
        stopping.extend((server, service) for server, _, service in servers.values())
        started.clear()
    finally:
        for server, _ in started.values():  # left here only when the round failed
            server.close()
            children.remove(server)


def _client_targets(kind: str, order: Sequence[str], servers: dict[str, tuple[Child, dict[str, Any], str]]
                    ) -> list[dict[str, Any]]:
    """The ``targets`` of a client phase command: each server of ``kind``'s round, in ``order``, with its server
    kind (a reference row's is not the round's)."""
    return [{"name": c, "kind": row_kind_config(kind, c)[0], "target": f"127.0.0.1:{servers[c][1]['port']}",
             "server_pid": servers[c][1]["pid"], "helper_pids": servers[c][1]["helper_pids"]} for c in order]


def _paired_phase(res: Results, kind: str, rnd: int, order: list[str] | tuple[str, ...],
                  servers: dict[str, tuple[Child, dict[str, Any], str]], col: dict[str, Any], client: Child,
                  per_server: int) -> None:
    """One paired phase of the round (see ``_bench_client.py``): ``per_server`` client threads *per server* (so
    each server has as many calls in flight as in the slices of that thread count), every thread calling all
    servers in turn (``order``: the round's configurations and reference rows), after one warm-up of
    ``plan.warmup_s``, for half as long as the slices of one phase take. Only CPU per request is taken from it:
    the rows' CPU figures and overheads at that thread count.

    The paired phases run first, on the round's fresh servers, so that they start with no export work left over
    from the slices: after the slices (until 5cad21c) the paired phase began with whatever a zoomer server had
    not yet handed to its export helper (up to half a second of records, made at the slices' rate) and
    contrib's unexported batch, and the reference rows, idle during the slices, had none. What the paired
    phases leave behind, the slices' warm-ups absorb. (Moving it changed the Thrift ratio little;
    benchmarks/RESULTS.md.)"""
    plan = res.plan
    n = per_server * len(order)
    seconds = plan.paired_seconds(len(order), kind)
    _log_step(f"round {rnd + 1}/{plan.rounds}  {kind:<6} paired phase, {n} client thread(s) ({per_server} per "
              f"server), {plan.warmup_s:g} s warm-up, {seconds:.1f} s: {', '.join(order)} ...")
    targets = _client_targets(kind, order, servers)
    client.send(json.dumps({"kind": kind, "threads": n, "warmup_s": plan.warmup_s, "slice_s": seconds / len(order),
                            "cycles": 1, "collector_pid": col["pid"], "targets": targets, "paired": True}))
    phase = client.expect(seconds + 60)
    for config, run in phase["per_target"].items():
        res.answered[servers[config][2]] += run["total_ok"]
        total = res.paired.setdefault((kind, config, per_server), [0.0, 0.0, 0])
        total[0] += run["server_cpu_s"]
        total[1] += run["helpers_cpu_s"]
        total[2] += run["requests"]
        cpu_us = (run["server_cpu_s"] + run["helpers_cpu_s"]) / max(1, run["requests"]) * 1e6
        res.paired_rounds.setdefault((kind, config, per_server), []).append(cpu_us)


def _paired_summary(res: Results, kind: str, per_server: int) -> dict[str, Any]:
    """The paired phases at ``per_server`` calls in flight per server (all rounds): each row's CPU per request
    (totals), its overhead over its own kind's bare row (``echo:bare`` for ``echo:zoomer``) per round and their
    median (``overhead_us``), and, for the instrumented rows, that overhead ÷ contrib's in the same round
    (``overhead_ratio_vs_contrib_rounds``; null for a round where contrib's is not positive) with the median of
    those (``overhead_ratio_vs_contrib``) and their lowest and highest (``overhead_ratio_vs_contrib_spread``).
    Reference rows also say whether their spans all arrived (``spans_lost``)."""
    per: dict[str, dict[str, Any]] = {}
    for (k, config, m), (server_s, helpers_s, calls) in res.paired.items():
        if k == kind and m == per_server and calls:
            per[config] = {"requests": calls, "cpu_us_per_request": round((server_s + helpers_s) / calls * 1e6, 1),
                           "server_cpu_us_per_request": round(server_s / calls * 1e6, 1),
                           "helpers_cpu_us_per_request": round(helpers_s / calls * 1e6, 1)}
    for config, row in per.items():
        is_reference = row_kind_config(kind, config)[0] != kind
        bare_name = reference_row(BARE) if is_reference else BARE
        rounds = [] if bare_name not in per else [
            round(a - b, 1) for a, b in zip(res.paired_rounds[(kind, config, per_server)],
                                            res.paired_rounds[(kind, bare_name, per_server)])]
        row["overhead_us_rounds"] = rounds
        row["overhead_us"] = _median(rounds)
        row["overhead_us_totals"] = (None if bare_name not in per
                                     else round(row["cpu_us_per_request"] - per[bare_name]["cpu_us_per_request"], 1))
        if is_reference:
            row.update(_span_accounting(res, kind, config))
    contrib = per.get(CONTRIB, {}).get("overhead_us_rounds")
    for config, row in per.items():
        ratios: list[float | None] = []
        if contrib and config != BARE and row_kind_config(kind, config)[0] == kind:
            ratios = [_ratio(a, b) if b > 0 else None for a, b in zip(row["overhead_us_rounds"], contrib)]
        row["overhead_ratio_vs_contrib_rounds"] = ratios
        known = [x for x in ratios if x is not None]
        row["overhead_ratio_vs_contrib"] = _median(known, 3)
        row["overhead_ratio_vs_contrib_spread"] = [min(known), max(known)] if known else None
    rows = len(res.plan.kind_configs(kind)) + len(res.plan.reference_rows(kind))
    return {"threads": per_server, "client_threads": per_server * rows, "rounds": res.plan.rounds, "configs": per}


def _stored_server_spans(store: Path) -> dict[str, int]:
    """SERVER spans per service name in the collector's store."""
    from zoomer_serve.collector import open_readonly

    con = open_readonly(store)
    try:
        rows = con.execute("SELECT service_name, count(*) FROM spans WHERE kind = 'SERVER' "
                           "GROUP BY service_name").fetchall()
    finally:
        con.close()
    return {str(name): int(count) for name, count in rows}


# -- summary ---------------------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def _median(values: Sequence[float], digits: int = 1) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else round((ordered[mid - 1] + ordered[mid]) / 2, digits)


def summarise(res: Results) -> dict[str, Any]:
    """The JSON object that ``--json`` prints (see RESULTS.md for the field meanings)."""
    plan = res.plan
    out: dict[str, Any] = {}
    for kind in plan.kinds:
        paired = {str(n): _paired_summary(res, kind, n) for n in plan.threads}
        configs: dict[str, Any] = {}
        for config in plan.kind_configs(kind):
            threads: dict[str, Any] = {}
            for n in plan.threads:
                threads[str(n)] = _cell_summary(res, kind, config, n, paired[str(n)]["configs"])
            configs[config] = {"threads": threads, **_span_accounting(res, kind, config)}
        kind_out: dict[str, Any] = {"configs": configs, "paired": paired[str(max(plan.threads))],
                                    "paired_by_threads": paired, "phases": {
            str(n): {"collector_cpu_us_per_request": round(ph.collector_cpu_s / max(1, ph.requests) * 1e6, 1),
                     "client_cpu_us_per_request": round(ph.client_cpu_s / max(1, ph.requests) * 1e6, 1)}
            for (k, n), ph in res.phases.items() if k == kind}}
        if ZOOMER in configs:
            zt = configs[ZOOMER]["threads"]
            kind_out["overhead_ratio_vs_contrib"] = {n: zt[n]["overhead_ratio_vs_contrib"] for n in zt}
            kind_out["p99_ratio_vs_bare"] = {n: zt[n]["p99_ratio_vs_bare"] for n in zt}
            kind_out["targets"] = _targets(kind_out)
        out[kind] = kind_out
    for kind in plan.kinds:
        if server_kind(kind).transport == THRIFT and ZOOMER in out[kind]["configs"]:
            _thrift_targets(out[kind], out.get(GRPC_REFERENCE_KIND))
    if res.extra_rows is not None:
        out["extra_rows"] = res.extra_rows
    out["meta"] = _meta(res)
    return out


def _span_accounting(res: Results, kind: str, row: str) -> dict[str, Any]:
    """Calls the servers of one row answered, SERVER spans of theirs in the store, and the difference
    (``spans_lost``; null for rows that export nothing)."""
    services = res.services.get((kind, row), [])
    answered = sum(res.answered.get(s, 0) for s in services)
    stored = sum(res.stored_server_spans.get(s, 0) for s in services)
    exports = configuration(row_kind_config(kind, row)[1]).exports
    return {"requests_answered": answered, "server_spans_stored": stored,
            "spans_lost": answered - stored if exports else None}


def _thrift_targets(kind_out: dict[str, Any], grpc_out: dict[str, Any] | None) -> None:
    """Thrift: contrib has no Thrift interceptor, so ``overhead_ratio_vs_contrib`` is null; the target is the
    zoomer overhead (µs) within 10 % of the sync gRPC echo's zoomer overhead (a ratio ≤ 1.1).

    Judged (``overhead_met``, the same as ``overhead_met_paired``) in the round's paired phase, where a gRPC echo
    bare and zoomer server (the reference rows ``echo:bare`` and ``echo:zoomer``, see
    :meth:`Plan.reference_rows`) answer calls from the same client threads in the same seconds as the Thrift rows:
    ``paired.overhead_ratio_vs_grpc`` (null when the reference overhead is not positive, which only noise makes).
    The same ratio at every thread count's paired phase: ``paired_by_threads.<n>.overhead_ratio_vs_grpc``.
    Given, not judged: the ratio per client thread count against the echo kind's own round
    (``overhead_ratio_vs_grpc``, ``overhead_met_by_threads``; null when the echo kind was not run). Those two
    overheads are measured minutes apart, and each moves by 20 to 30 % between runs. The ``python_work`` control
    row (plain Python per call, no instrumentation) measures what that much Python per call costs in the same
    run: ``control_overhead_us``; the ``offload_work`` control row what that much CPU per call in a child process
    costs (zoomer-serve's export runs in one). Both rows' overhead and p99 ÷ bare per thread count:
    ``control_rows``.

    Latency: zoomer's p99 ÷ bare's at :data:`TARGET_P99_THREADS` client threads (the slices) within
    :data:`TARGET_THRIFT_P99_RATIO_VS_GRPC` times the gRPC interceptor's (the echo kind's zoomer row, same run):
    ``p99_ratio_vs_grpc`` per thread count, ``targets.p99_met_vs_grpc`` (null when the echo kind was not run).
    At 8 closed-loop client threads the slices load one thriftpy2 server at a time to its limit, where every
    µs of Python added to a call queues the other connections' threads on the interpreter lock."""
    zt = kind_out["configs"][ZOOMER]["threads"]
    ref = grpc_out["configs"].get(ZOOMER, {}).get("threads", {}) if grpc_out else {}
    ref_us = {n: ref.get(n, {}).get("overhead_us") for n in zt}
    ratios = {n: _ratio(zt[n]["overhead_us"], ref_us[n]) if (ref_us[n] or 0) > 0 else None for n in zt}
    kind_out["overhead_ratio_vs_grpc"] = ratios
    kind_out["overhead_us_grpc"] = ref_us
    control = kind_out["configs"].get(PYTHON_WORK, {}).get("threads", {})
    kind_out["control_overhead_us"] = {n: control[n]["overhead_us"] for n in control}
    kind_out["control_rows"] = {
        name: {"overhead_us": {n: t["overhead_us"] for n, t in rows.items()},
               "p99_ratio_vs_bare": {n: t["p99_ratio_vs_bare"] for n, t in rows.items()}}
        for name in CONTROL_ROWS if (rows := kind_out["configs"].get(name, {}).get("threads"))}
    paired = kind_out["paired"]["configs"]
    reference = paired.get(reference_row(ZOOMER), {})
    paired_ref = reference.get("overhead_us")
    paired_own = paired.get(ZOOMER, {}).get("overhead_us")
    paired_ratio = _ratio(paired_own, paired_ref) if (paired_ref or 0) > 0 else None
    kind_out["paired"]["overhead_ratio_vs_grpc"] = paired_ratio
    own_rounds = paired.get(ZOOMER, {}).get("overhead_us_rounds", [])
    ref_rounds = reference.get("overhead_us_rounds", [])
    kind_out["paired"]["overhead_ratio_vs_grpc_rounds"] = [_ratio(a, b) if b > 0 else None
                                                           for a, b in zip(own_rounds, ref_rounds)]
    for by_threads in kind_out.get("paired_by_threads", {}).values():
        if by_threads is not kind_out["paired"]:
            rows = by_threads["configs"]
            ref_us_n = rows.get(reference_row(ZOOMER), {}).get("overhead_us")
            by_threads["overhead_ratio_vs_grpc"] = (_ratio(rows.get(ZOOMER, {}).get("overhead_us"), ref_us_n)
                                                    if (ref_us_n or 0) > 0 else None)
    met = None if paired_ratio is None else paired_ratio <= TARGET_THRIFT_OVERHEAD_RATIO_VS_GRPC
    grpc_p99 = grpc_out.get("p99_ratio_vs_bare", {}) if grpc_out else {}
    p99_vs_grpc = {n: _ratio(v, grpc_p99.get(n)) for n, v in kind_out["p99_ratio_vs_bare"].items()}
    kind_out["p99_ratio_vs_grpc"] = p99_vs_grpc
    p99_judged = p99_vs_grpc.get(str(TARGET_P99_THREADS))
    kind_out["targets"] = {
        "overhead_ratio_vs_contrib_max": None, "overhead_ratio_vs_grpc_max": TARGET_THRIFT_OVERHEAD_RATIO_VS_GRPC,
        "p99_ratio_vs_bare_max": TARGET_P99_RATIO_VS_BARE, "p99_threads": TARGET_P99_THREADS,
        "overhead_judged_in": "paired",
        "overhead_met": met,
        "overhead_met_paired": met,
        "overhead_met_by_threads": {n: None if v is None else v <= TARGET_THRIFT_OVERHEAD_RATIO_VS_GRPC
                                    for n, v in ratios.items()},
        "p99_met": kind_out["targets"]["p99_met"],
        "p99_ratio_vs_grpc_max": TARGET_THRIFT_P99_RATIO_VS_GRPC,
        "p99_met_vs_grpc": None if p99_judged is None else p99_judged <= TARGET_THRIFT_P99_RATIO_VS_GRPC,
        "note": "no contrib Thrift interceptor: overhead_ratio_vs_contrib is null; the overhead target compares "
                f"with the '{GRPC_REFERENCE_KIND}' kind's zoomer overhead, judged in the paired phase, where "
                f"{GRPC_REFERENCE_KIND} bare and zoomer servers are measured side by side with the Thrift rows; "
                "overhead_met_by_threads compares the slices with the echo kind's own round, minutes apart. With "
                "more closed-loop client threads any row that adds Python to a call saturates the Thrift server's "
                f"interpreter lock in the slices and the bare one does not (see the '{PYTHON_WORK}' control row)",
    }


def _cell_summary(res: Results, kind: str, config: str, n: int, paired: dict[str, Any]) -> dict[str, Any]:
    """One row at ``n`` client threads: throughput and latency from the slices (all rounds pooled), CPU per
    request and overheads from the paired phase at ``n`` calls in flight per server (``paired``: its rows, see
    :func:`_paired_summary`; the overhead is the median over rounds, the ratio to contrib's the median of the
    rounds' ratios)."""
    cell = res.cells[(kind, config, n)]
    bare = res.cells.get((kind, BARE, n))
    rps = cell.requests_per_s
    p99 = percentile(cell.latency_us, 99)
    cpu = paired.get(config, {})
    summary: dict[str, Any] = {
        "requests": cell.requests,
        "requests_per_s": round(rps, 1),
        "p50_us": percentile(cell.latency_us, 50),
        "p90_us": percentile(cell.latency_us, 90),
        "p99_us": p99,
        "cpu_us_per_request": cpu.get("cpu_us_per_request"),
        "server_cpu_us_per_request": cpu.get("server_cpu_us_per_request"),
        "helpers_cpu_us_per_request": cpu.get("helpers_cpu_us_per_request"),
        "errors": cell.errors,
        "overhead_us": cpu.get("overhead_us"),
        "overhead_us_rounds": cpu.get("overhead_us_rounds", []),
        "overhead_us_median": cpu.get("overhead_us"),
        "overhead_ratio_vs_contrib": cpu.get("overhead_ratio_vs_contrib"),
        "overhead_ratio_vs_contrib_rounds": cpu.get("overhead_ratio_vs_contrib_rounds", []),
        "overhead_ratio_vs_contrib_spread": cpu.get("overhead_ratio_vs_contrib_spread"),
        "throughput_ratio_vs_bare": None, "p99_ratio_vs_bare": None, "p99_ratio_vs_bare_rounds": [],
    }
    if bare is not None:
        summary["throughput_ratio_vs_bare"] = _ratio(rps, bare.requests_per_s)
        summary["p99_ratio_vs_bare"] = _ratio(p99, percentile(bare.latency_us, 99))
        summary["p99_ratio_vs_bare_rounds"] = [_ratio(a["p99_us"], b["p99_us"])
                                               for a, b in zip(cell.rounds, bare.rounds)]
    return summary


def _targets(kind_out: dict[str, Any]) -> dict[str, Any]:
    """Verdicts: ``overhead_met`` from the paired phases at every thread count, ``overhead_met_paired`` from the
    one at the most calls in flight (both from medians over rounds; null without a contrib row), ``p99_met`` at
    :data:`TARGET_P99_THREADS` threads (the slices)."""
    ratios = list(kind_out["overhead_ratio_vs_contrib"].values())
    p99 = kind_out["p99_ratio_vs_bare"].get(str(TARGET_P99_THREADS))
    overhead_ok = None if any(v is None for v in ratios) or not ratios else \
        max(ratios) <= TARGET_OVERHEAD_RATIO_VS_CONTRIB
    p99_ok = p99 is not None and p99 <= TARGET_P99_RATIO_VS_BARE
    paired = kind_out.get("paired", {}).get("configs", {}).get(ZOOMER, {}).get("overhead_ratio_vs_contrib")
    return {"overhead_ratio_vs_contrib_max": TARGET_OVERHEAD_RATIO_VS_CONTRIB,
            "p99_ratio_vs_bare_max": TARGET_P99_RATIO_VS_BARE, "p99_threads": TARGET_P99_THREADS,
            "overhead_met": overhead_ok, "p99_met": p99_ok,
            "overhead_met_paired": None if paired is None else paired <= TARGET_OVERHEAD_RATIO_VS_CONTRIB}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("grpcio", "torch", "opentelemetry-sdk", "opentelemetry-instrumentation-grpc", "zoomer-serve"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meta(res: Results) -> dict[str, Any]:
    plan = res.plan
    return {
        "schema": SCHEMA,
        "date": res.started,
        "mode": plan.mode,
        "rounds": plan.rounds,
        "warmup_s": plan.warmup_s,
        "slice_s": plan.slice_s,
        "cycles": plan.cycles,
        "lead_s": plan.lead_s,
        "paired_s": plan.paired_s,
        "paired_per_server_s": plan.paired_per_server_s,
        "paired_scale": {kind: plan.paired_scale(kind) for kind in plan.kinds  # kinds whose paired phases last longer
                         if plan.paired_scale(kind) != 1.0},
        "threads": list(plan.threads),
        "collector_nice": plan.collector_nice,
        "extras": list(plan.extras),
        "configs": {c.name: c.label for c in CONFIGURATIONS if c.name in plan.configs},
        "kinds": {k.name: k.label for k in SERVER_KINDS if k.name in plan.kinds},
        "machine": {"cpus": os.cpu_count(), "cpu_model": _cpu_model(), "kernel": platform.release(),
                    "loadavg_before": [round(x, 2) for x in res.load_before],
                    "loadavg_after": [round(x, 2) for x in res.load_after]},
        "versions": _versions(),
        "elapsed_s": round(res.elapsed_s, 1),
        "collector": {k: res.collector_stats.get(k) for k in ("grpc_requests", "http_requests",
                                                               "spans_received", "metric_points_received",
                                                               "store_dropped")},
        "instrumentation_counters": res.instrumentation,
        "helper_processes": {service: len(pids) for service, pids in res.helper_pids.items()},
        "command": " ".join([Path(sys.executable).name, "benchmarks/overhead.py", *sys.argv[1:]]),
    }


def _verdict(met: bool | None) -> str:
    return "not evaluated (no positive reference)" if met is None else "met" if met else "MISSED"


def _fmt(value: Any, spec: str = ".0f") -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and value != value:
        return "nan"
    return format(value, spec)


def _ratio_cell(t: dict[str, Any]) -> str:
    """A row's ratio to contrib's: the median over rounds and, with several rounds, the lowest and highest."""
    ratio, spread = t.get("overhead_ratio_vs_contrib"), t.get("overhead_ratio_vs_contrib_spread")
    if ratio is None:
        return "–"
    known = [x for x in t.get("overhead_ratio_vs_contrib_rounds", []) if x is not None]
    if spread is None or len(known) < 2:
        return _fmt(ratio, ".2f")
    return f"{_fmt(ratio, '.2f')} ({_fmt(spread[0], '.2f')} to {_fmt(spread[1], '.2f')})"


def _threads_line(values: dict[str, Any], spec: str = ".2f") -> str:
    return ", ".join(f"{n} thr: {_fmt(v, spec)}" for n, v in values.items())


def markdown(summary: dict[str, Any]) -> str:
    """The tables RESULTS.md shows, one per server kind."""
    lines: list[str] = []
    meta = summary["meta"]
    for kind, label in meta["kinds"].items():
        k = summary[kind]
        lines += [f"### {kind}: {label}", "",
                  "| configuration | client threads | req/s | × bare | p50 µs | p99 µs | p99 × bare "
                  "| CPU µs/req (server + helpers) | overhead µs: median (per round) "
                  "| overhead × contrib: median (lowest to highest) | spans lost |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for config, c in k["configs"].items():
            for n, t in c["threads"].items():
                cpu = f"{_fmt(t['cpu_us_per_request'])} ({_fmt(t['server_cpu_us_per_request'])} + " \
                      f"{_fmt(t['helpers_cpu_us_per_request'])})"
                rounds = ", ".join(_fmt(x, "+.0f") for x in t.get("overhead_us_rounds", []))
                overhead = "–" if config == BARE else f"{_fmt(t.get('overhead_us'), '+.0f')} ({rounds})"
                lines.append(
                    f"| {config} | {n} | {_fmt(t['requests_per_s'])} | {_fmt(t.get('throughput_ratio_vs_bare'), '.2f')}"
                    f" | {_fmt(t['p50_us'])} | {_fmt(t['p99_us'])} | {_fmt(t.get('p99_ratio_vs_bare'), '.2f')}"
                    f" | {cpu} | {overhead} | {_ratio_cell(t)} | {_fmt(c['spans_lost'], 'd')} |")
        lines += ["", f"- req/s and latency: the slices ({meta['rounds']} rounds pooled); CPU and overheads: the paired "
                      "phase at the row's client threads per server (median over rounds; the ratio to contrib's is "
                      "the median of the rounds' ratios)"]
        if "overhead_ratio_vs_grpc" in k:
            lines += _thrift_lines(k)
        elif "targets" in k:
            tg = k["targets"]
            ratios = ", ".join(f"{n} thr: {_ratio_cell(k['configs'][ZOOMER]['threads'][n])}"
                               for n in k["overhead_ratio_vs_contrib"])
            lines += [f"- zoomer overhead ÷ contrib overhead: {ratios} (target ≤ "
                      f"{tg['overhead_ratio_vs_contrib_max']}: {_verdict(tg['overhead_met'])})",
                      f"- zoomer p99 ÷ bare p99: {_threads_line(k['p99_ratio_vs_bare'])} (target ≤ "
                      f"{tg['p99_ratio_vs_bare_max']} at {tg['p99_threads']} threads: {_verdict(tg['p99_met'])})"]
        for paired in k.get("paired_by_threads", {}).values():
            lines += _paired_lines(paired, k.get("targets") if paired is k.get("paired") else None)
        lines.append("")
    for section, rows in summary.get("extra_rows", {}).items():
        lines += [f"### extra rows: {section}", "", "| what | value | unit |", "| --- | ---: | --- |"]
        lines += [f"| {r['what']} | {r['value']} | {r['unit']} |" for r in rows]
        lines.append("")
    m = meta["machine"]
    paired = f"{meta['paired_s']} s" if meta.get("paired_s") else f"{meta.get('paired_per_server_s')} s per server"
    if not meta.get("paired_s") and meta.get("paired_scale"):
        paired += "".join(f" ({kind}'s × {scale:g})" for kind, scale in meta["paired_scale"].items())
    lines.append(f"{meta['date']}, mode {meta['mode']} ({meta['rounds']} rounds; per round and thread count a "
                 f"paired phase of {paired} and {meta['warmup_s']} s warm-up, then {meta['cycles']} cycles of "
                 f"{meta['slice_s']} s slices per configuration, each after a {meta.get('lead_s', 0)} s lead-in), {m['cpus']} CPUs ({m['cpu_model']}), load "
                 f"{m['loadavg_before'][0]} before / {m['loadavg_after'][0]} after, {meta['elapsed_s']} s, "
                 f"`{meta['command']}`")
    return "\n".join(lines)


def _thrift_lines(k: dict[str, Any]) -> list[str]:
    """The Thrift kind's verdict lines: overhead against the gRPC echo's, the control row, p99."""
    tg = k["targets"]
    limit = tg["overhead_ratio_vs_grpc_max"]
    over = {n: f" > {limit}" if met is False else "" for n, met in tg["overhead_met_by_threads"].items()}
    ratios = ", ".join(f"{n} thr: {_fmt(v, '.2f')}{over[n]} ({_fmt(k['configs'][ZOOMER]['threads'][n]['overhead_us'], '+.0f')}"
                       f" vs {_fmt(k['overhead_us_grpc'][n], '+.0f')} µs)"
                       for n, v in k["overhead_ratio_vs_grpc"].items())
    controls = [f"- control row {name} ({CONTROL_ROWS[name]}, no instrumentation): overhead over bare "
                + ", ".join(f"{n} thr: {_fmt(v, '+.0f')} µs" for n, v in row["overhead_us"].items())
                + "; p99 ÷ bare " + _threads_line(row["p99_ratio_vs_bare"])
                for name, row in k.get("control_rows", {}).items()]
    side = ", ".join(f"{n} thr: {_fmt(p.get('overhead_ratio_vs_grpc'), '.2f')}"
                     for n, p in k.get("paired_by_threads", {}).items())
    p99_limit = tg.get("p99_ratio_vs_grpc_max")
    return [f"- zoomer overhead ÷ the {GRPC_REFERENCE_KIND} kind's zoomer overhead in its own round: "
            f"{ratios} (target ≤ {limit}; shown, not judged: measured minutes apart; judged side by side in the "
            f"paired phase below, {reference_row(ZOOMER)}: {side})",
            *(controls or ["- control rows: not run"]),
            "- no contrib row: OpenTelemetry contrib has no Thrift interceptor (ratio vs contrib: null)",
            f"- zoomer p99 ÷ bare p99: {_threads_line(k['p99_ratio_vs_bare'])}; ÷ the {GRPC_REFERENCE_KIND} kind's "
            f"zoomer p99 ÷ bare p99: {_threads_line(k.get('p99_ratio_vs_grpc', {}))} (target ≤ {p99_limit} at "
            f"{tg['p99_threads']} threads: {_verdict(tg.get('p99_met_vs_grpc'))})"]


def _paired_lines(paired: dict[str, Any] | None, targets: dict[str, Any] | None = None) -> list[str]:
    """One line: CPU per request and overhead of every row in one thread count's paired phases (reference rows
    included), and, for the judged one (``targets`` given), the verdict."""
    if not paired or not paired["configs"]:
        return []
    cells = []
    for config, row in paired["configs"].items():
        cell = f"{config} {_fmt(row['cpu_us_per_request'])} ({_fmt(row['server_cpu_us_per_request'])} + " \
               f"{_fmt(row['helpers_cpu_us_per_request'])})"
        if not config.endswith(BARE) and row["overhead_us"] is not None:
            rounds = ", ".join(_fmt(v, "+.0f") for v in row["overhead_us_rounds"])
            cell += f", {_fmt(row['overhead_us'], '+.0f')} ({rounds})"
            if row["overhead_ratio_vs_contrib"] is not None:
                cell += f" = {_ratio_cell(row)} × contrib's"
        cells.append(cell)
    verdict = ""
    if "overhead_ratio_vs_grpc" in paired and targets:
        reference = reference_row(ZOOMER)
        rounds = ", ".join(_fmt(v, ".2f") for v in paired.get("overhead_ratio_vs_grpc_rounds", []))
        verdict = (f" (zoomer overhead ÷ {reference}'s in the same phase: "
                   f"{_fmt(paired['overhead_ratio_vs_grpc'], '.2f')}, per round {rounds}; "
                   f"target ≤ {targets['overhead_ratio_vs_grpc_max']}: "
                   f"{_verdict(targets['overhead_met_paired'])})")
    elif targets and targets.get("overhead_met_paired") is not None:
        verdict = (f" (zoomer vs contrib's; target ≤ {targets['overhead_ratio_vs_contrib_max']}: "
                   f"{_verdict(targets['overhead_met_paired'])})")
    return [f"- paired phases ({paired['client_threads']} client threads, {paired['threads']} calls in flight per "
            f"server, every thread calling all servers in turn), CPU µs per request (server + helpers), median "
            f"overhead (per round): " + "; ".join(cells) + verdict]


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


RANGES = (
    Range("--rounds", 1, 20), Range("--warmup", 0, 60), Range("--slice", 0, 30, low_open=True),
    Range("--cycles", 1, 100), Range("--collector-nice", 0, 19), Range("--paired-s", 0, 300, low_open=True),
    Range("--lead", 0, 10),
)
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="2 rounds of short slices (under 2 minutes)")
    mode.add_argument("--smoke", action="store_true", help="1 round of tiny slices: checks that it runs")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (progress on stderr)")
    p.add_argument("--rounds", type=int, help="rounds (each runs every configuration once)")
    p.add_argument("--warmup", type=float, help="seconds of unmeasured load per server before each phase")
    p.add_argument("--slice", type=float, help="seconds of one measured slice")
    p.add_argument("--cycles", type=int, help="measured slices per configuration per phase")
    p.add_argument("--lead", type=float, help="seconds of unmeasured load on a slice's server before each slice "
                                              "(default per mode: 0.5 s, --smoke 0.1 s)")
    p.add_argument("--paired-s", type=float, help="seconds of each paired phase (default per mode: 3 s per server "
                                                  "in it, --quick 0.3 s; the full run's model 3 times as long)")
    p.add_argument("--threads", default="1,8", help="client thread counts (default 1,8)")
    p.add_argument("--extras", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure the extra rows (GPU telemetry, profiler, host telemetry; "
                        "default: on in the full run, off with --quick and --smoke)")
    p.add_argument("--extra-sections", default=",".join(EXTRA_SECTIONS),
                   help="which extra rows --extras measures (default: %(default)s)")
    p.add_argument("--gpu", action="store_true",
                   help=f"add the '{GPU_FAKE}' configuration (GPU telemetry over fake sources) to the sync gRPC kinds")
    p.add_argument("--collector-nice", type=int, default=0,
                   help="niceness of the collector process (default 0, as the reported results)")
    p.add_argument("--kinds", default=",".join(k.name for k in SERVER_KINDS),
                   help="server kinds (default: all)")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGURATIONS if c.default),
                   help="configurations (default: %(default)s; also: "
                   + ", ".join(c.name for c in CONFIGURATIONS if not c.default)
                   + "; overheads need 'bare', ratios 'contrib')")
    return p


def parse_args(argv: Sequence[str] | None = None) -> Plan:
    p = build_parser()
    args = parse(p, argv, RANGES)
    name = "quick" if args.quick else "smoke" if args.smoke else "full"
    rounds, warmup, slice_s, cycles, paired_per_server_s, lead_s = MODES[name]
    known_kinds, known_configs = {k.name for k in SERVER_KINDS}, {c.name for c in CONFIGURATIONS}
    kinds, configs = _csv(args.kinds), _csv(args.configs)
    sections = _csv(args.extra_sections)
    if not sections or any(x not in EXTRA_SECTIONS for x in sections):
        p.error(f"unknown --extra-sections {args.extra_sections!r}; known: {', '.join(EXTRA_SECTIONS)}")
    if args.gpu and GPU_FAKE not in configs:
        configs += (GPU_FAKE,)
    for given, known, what in ((kinds, known_kinds, "server kind"), (configs, known_configs, "configuration")):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            p.error(f"unknown {what} {unknown or given}; known: {', '.join(sorted(known))}")
    try:
        threads = tuple(int(t) for t in _csv(args.threads))
    except ValueError:
        p.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    if not threads or min(threads) < 1 or max(threads) > 64:
        p.error(f"--threads must be between 1 and 64, got {args.threads!r}")

    def given_or(value: Any, default: Any) -> Any:
        return default if value is None else value  # an explicit 0 is a value, not "the mode's default"

    plan = Plan(name, given_or(args.rounds, rounds), given_or(args.warmup, warmup), given_or(args.slice, slice_s),
                given_or(args.cycles, cycles), threads, kinds, configs, args.collector_nice,
                sections if (name == "full" if args.extras is None else args.extras) else (), args.paired_s,
                paired_per_server_s, given_or(args.lead, lead_s), name == "full")
    empty = [k for k in kinds if not plan.kind_configs(k)]
    if empty:
        p.error(f"no configuration in --configs applies to server kind(s) {', '.join(empty)}")
    for kind in (k for k in kinds if server_kind(k).transport == THRIFT):
        pause_s = plan.longest_pause_s(kind)
        if 2 * pause_s >= THRIFT_CLIENT_TIMEOUT_MS / 1000:
            p.error(f"{kind}: a client connection would wait up to {pause_s:g} s between its slices, too close to "
                    f"the Thrift servers' idle timeout ({THRIFT_CLIENT_TIMEOUT_MS / 1000:g} s); use fewer "
                    "--configs or shorter --slice / --warmup")
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    plan = parse_args(argv)
    summary = summarise(measure(plan))
    if as_json:
        print(json.dumps(summary))
    else:
        print(markdown(summary))
    _log(markdown(summary) if as_json else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
