"""One summary of a profiled load test (locust-free): what locust measured, what the server's spans say, the gap
between the two, and the profiling session.

Where each figure comes from:

- client (per locust entry, ms): locust's ``StatsEntry``: requests, failures, percentiles
  (``get_response_time_percentile``; locust keeps response times rounded to 2 significant digits above
  100 ms), mean, max, requests per second over the run.
- server (per service and method, ms): the collector's DuckDB store, through
  :func:`zoomer_serve.report.build_report` (the store is read once the collector has stopped): requests and
  errors as the ``rpc.server.call.duration`` metric counted them (every call, sampled or not; the SERVER spans
  when the store has no such metric), latency from the SERVER spans.
- gap (per method, ms): client minus server latency: network, queueing, (de)serialization, client overhead.
  ``paired`` when the store also holds the load generator's CLIENT spans: the distribution over calls of
  (CLIENT span duration - duration of its SERVER child span). Otherwise ``difference``: locust's figure minus
  the server's for the mean (exact for the mean when both count the same calls) and each percentile (a
  difference of percentiles, not a percentile of differences).
- profile: the session's final ``SessionInfo`` from ``ProfilerControl`` (trace path, requests, kernel totals),
  and, when the trace file is readable here, :func:`zoomer_serve.profiling.summarize_events` over it: the top
  kernels by GPU time and per-request kernel time (µs) and CPU operator counts.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoomer_serve.semconv import method_sql

if TYPE_CHECKING:
    from zoomer_serve.report.model import MethodStats

NS_PER_MS = 1_000_000.0


@dataclass(frozen=True)
class ClientStats:
    """One locust stats entry (``name`` is the RPC method; ``request_type`` ``grpc``/``thrift``; the total row
    has ``name`` "Aggregated"). Times in ms, ``rps`` per second over the run."""

    request_type: str
    name: str
    count: int
    failures: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    rps: float


@dataclass(frozen=True)
class ServerStats:
    """One service and method in the store: ``count`` / ``errors`` are its requests (the calls the
    ``rpc.server.call.duration`` metric counted where the store has it, else its SERVER spans), the latency
    figures (ms) are its SERVER spans'."""

    service_name: str
    method: str
    count: int
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float


@dataclass(frozen=True)
class Gap:
    """Client minus server latency of one method (ms); ``basis`` ``paired`` or ``difference`` (module
    docstring); ``count``: calls paired (``paired``) or the client's count (``difference``)."""

    name: str
    basis: str
    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float


@dataclass(frozen=True)
class KernelRow:
    name: str
    count: int
    time_us: float


@dataclass(frozen=True)
class ProfileSummary:
    """The run's profiling session, as the trigger saw it and as the trace says.

    ``state`` / ``reason``: from the trigger (``finished``, ``failed``, ``warming``, ``off`` ...);
    ``started_after_s``: seconds from spawning complete to the Start call; ``requests_before_start``: locust's
    count in that time; ``rolling_cv``: the stability check's last CV (None when it is off); ``session``: the final
    ``SessionInfo`` (dict); ``trace_file``: the trace as read here (None when not readable);
    ``top_kernels``: by total GPU time; ``per_request``: over the covered requests found in the trace:
    ``requests``, ``kernel_time_us_mean`` / ``_p50`` / ``_p99``, ``cpu_ops_mean``, ``range_ms_p50`` (the
    request's profiler range).
    """

    state: str
    reason: str | None = None
    target: str | None = None
    started_after_s: float | None = None
    requests_before_start: int | None = None
    rolling_cv: float | None = None
    session: dict[str, Any] | None = None
    trace_file: str | None = None
    top_kernels: list[KernelRow] = field(default_factory=list)
    per_request: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """A session ran to its end and wrote a trace."""
        return self.state == "finished" and self.session is not None and self.session.get("outcome") == "done"


@dataclass(frozen=True)
class LoadTestSummary:
    """A whole run: ``client`` entries (the last is "Aggregated"), ``server`` (None when no store was read;
    ``server_note`` says why), ``gaps``, ``profile`` (None when profiling was off), and the store read."""

    client: list[ClientStats]
    server: list[ServerStats] | None = None
    server_note: str | None = None
    gaps: list[Gap] = field(default_factory=list)
    profile: ProfileSummary | None = None
    store: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadTestSummary:
        profile = data.get("profile")
        if profile is not None:
            profile = ProfileSummary(**{**profile, "top_kernels": [KernelRow(**k) for k in profile["top_kernels"]]})
        server = data.get("server")
        return cls(client=[ClientStats(**c) for c in data["client"]],
                   server=None if server is None else [ServerStats(**s) for s in server],
                   server_note=data.get("server_note"), gaps=[Gap(**g) for g in data.get("gaps", [])],
                   profile=profile, store=data.get("store"))

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write the summary as JSON (the folder is created)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.partial")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, target)

    @classmethod
    def read_json(cls, path: str | os.PathLike[str]) -> LoadTestSummary:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


# -- client ------------------------------------------------------------------------------------------------
def client_stats(stats: Any) -> list[ClientStats]:
    """Per-entry figures of locust's ``RequestStats`` (``environment.stats``), sorted by name, then the total."""
    entries = sorted(stats.entries.values(), key=lambda e: (e.name, e.method or ""))
    return [_client_entry(e) for e in entries] + [_client_entry(stats.total)]


def _client_entry(entry: Any) -> ClientStats:
    pct = entry.get_response_time_percentile
    return ClientStats(request_type=entry.method or "", name=entry.name, count=int(entry.num_requests),
                       failures=int(entry.num_failures), p50_ms=float(pct(0.5) or 0), p90_ms=float(pct(0.9) or 0),
                       p99_ms=float(pct(0.99) or 0), mean_ms=float(entry.avg_response_time),
                       max_ms=float(entry.max_response_time), rps=float(entry.total_rps))


# -- server and gap ----------------------------------------------------------------------------------------
_PAIRED_SQL = f"""
WITH u AS (
    SELECT * FROM spans QUALIFY row_number() OVER (PARTITION BY trace_id, span_id ORDER BY received_ns) = 1
)
SELECT {method_sql("s.")} AS method, count(*),
       avg(c.duration_ns - s.duration_ns), quantile_cont(c.duration_ns - s.duration_ns, [0.5, 0.9, 0.99])
FROM u c JOIN u s ON s.trace_id = c.trace_id AND s.parent_span_id = c.span_id
WHERE c.kind = 'CLIENT' AND s.kind = 'SERVER'
GROUP BY ALL ORDER BY method
"""


def with_store(summary: LoadTestSummary, store: str | os.PathLike[str]) -> LoadTestSummary:
    """``summary`` with the server side and the gaps read from the store at ``store``; when the store cannot
    be read (missing, locked by a running collector, not a store), ``server`` stays None and
    ``server_note`` says why."""
    from zoomer_serve.report import ReportError, build_report

    try:
        report = build_report(store, slowest=0)
        paired = _paired_gaps(Path(store))
    except (FileNotFoundError, ReportError) as exc:
        note = f"store not found: {store}" if isinstance(exc, FileNotFoundError) else str(exc)
        return replace(summary, server=None, server_note=note, gaps=[], store=str(store))
    server = [s for s in map(_server_stats, report.methods) if s is not None]
    return replace(summary, server=server, server_note=None, gaps=gaps(summary.client, server, paired),
                   store=str(store))


def _server_stats(m: MethodStats) -> ServerStats | None:
    """The server side of one method: its requests and errors (counted by the ``rpc.server.call.duration`` metric
    where the store has it, else the spans: ``MethodStats.counts_from``) and its spans' latency; None when the
    method has no span (no latency to compare)."""
    if m.p50_ms is None or m.p90_ms is None or m.p99_ms is None or m.mean_ms is None or m.max_ms is None:
        return None
    return ServerStats(m.service_name, m.method, m.count, m.error_count, m.p50_ms, m.p90_ms, m.p99_ms, m.mean_ms,
                       m.max_ms)


def _paired_gaps(store: Path) -> dict[str, Gap]:
    from zoomer_serve.collector.store import open_readonly

    con = open_readonly(store)
    try:
        rows = con.execute(_PAIRED_SQL).fetchall()
    finally:
        con.close()
    return {method: Gap(method, "paired", int(n), mean / NS_PER_MS, q[0] / NS_PER_MS, q[1] / NS_PER_MS,
                        q[2] / NS_PER_MS) for method, n, mean, q in rows}


def gaps(client: list[ClientStats], server: list[ServerStats], paired: dict[str, Gap]) -> list[Gap]:
    """Per method the client called: the paired gap when the store has one, else the difference of the
    client's and the server's figures (server spans of all services with that method, counts merged)."""
    out = []
    for c in client:
        if c.name == "Aggregated":
            continue
        if c.name in paired:
            out.append(paired[c.name])
            continue
        same = [s for s in server if s.method == c.name]
        if len(same) != 1:  # none, or the method served by several services: no single figure to subtract
            continue
        s = same[0]
        out.append(Gap(c.name, "difference", c.count, c.mean_ms - s.mean_ms, c.p50_ms - s.p50_ms,
                       c.p90_ms - s.p90_ms, c.p99_ms - s.p99_ms))
    return out


# -- profile -----------------------------------------------------------------------------------------------
def readable_trace(trace_path: str | None, profiles_dir: Path | None) -> Path | None:
    """The trace file as readable on this machine: the server's path, else the same file name in
    ``profiles_dir`` (a shared volume mounted elsewhere); None when neither is a file."""
    if not trace_path:
        return None
    direct = Path(trace_path)
    if direct.is_file():
        return direct
    if profiles_dir is not None and (Path(profiles_dir) / direct.name).is_file():
        return Path(profiles_dir) / direct.name
    return None


def profile_summary(record: dict[str, Any], profiles_dir: Path | None = None, top_kernels: int = 10
                    ) -> ProfileSummary:
    """The :class:`ProfileSummary` of a trigger record (``TriggerRecord.to_dict()``), reading the trace when
    it is readable here (a trace that cannot be parsed is reported in ``reason``, not raised)."""
    session = record.get("session")
    base = ProfileSummary(state=record["state"], reason=record.get("reason"), target=record.get("target"),
                          started_after_s=record.get("warmup_elapsed_s"), rolling_cv=record.get("rolling_cv"),
                          requests_before_start=record.get("requests_before_start"),
                          session=session)
    trace = readable_trace(session.get("trace_path") if session else None, profiles_dir)
    if trace is None:
        if session and session.get("trace_path"):
            note = f"trace {session['trace_path']} is not readable here (see --zoomer-profiles-dir)"
            return replace(base, reason=f"{base.reason}; {note}" if base.reason else note)
        return base
    try:
        top, per_request = _trace_figures(trace, top_kernels)
    except (OSError, ValueError, KeyError) as exc:
        return replace(base, trace_file=str(trace), reason=f"trace {trace} could not be summarized: {exc}")
    return replace(base, trace_file=str(trace), top_kernels=top, per_request=per_request)


def _trace_figures(trace: Path, top_n: int) -> tuple[list[KernelRow], dict[str, float]]:
    from zoomer_serve.profiling import load_trace, summarize_events
    from zoomer_serve.profiling.stats import percentile

    summary = summarize_events(load_trace(trace)["traceEvents"])
    top = [KernelRow(k.name, k.count, round(k.time_us, 3)) for k in summary.totals.top_kernels(top_n)]
    profiles = list(summary.requests.values())
    if not profiles:
        return top, {"requests": 0}
    kernel = sorted(p.kernel_time_us for p in profiles)
    ranges_ms = sorted(p.duration_us / 1000.0 for p in profiles)
    return top, {"requests": len(profiles), "kernel_time_us_mean": round(sum(kernel) / len(kernel), 3),
                 "kernel_time_us_p50": round(percentile(kernel, 50), 3),
                 "kernel_time_us_p99": round(percentile(kernel, 99), 3),
                 "cpu_ops_mean": round(sum(p.cpu_op_count for p in profiles) / len(profiles), 1),
                 "range_ms_p50": round(percentile(ranges_ms, 50), 3)}


# -- terminal ----------------------------------------------------------------------------------------------
def render_summary(summary: LoadTestSummary, console: Any) -> None:
    """Print ``summary`` with rich: client vs server latency per method, the gap, the profile."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Load test: client (locust) vs server (spans), latency in ms", title_justify="left",
                  box=box.SIMPLE_HEAD)
    for name in ("side", "method", "reqs", "fail", "p50", "p90", "p99", "mean", "max"):
        table.add_column(name, justify="left" if name in ("side", "method") else "right",
                         overflow="fold" if name == "method" else "ellipsis")
    for c in summary.client:
        table.add_row(f"client {c.request_type}".strip(), Text(c.name), str(c.count), str(c.failures), _ms(c.p50_ms),
                      _ms(c.p90_ms), _ms(c.p99_ms), _ms(c.mean_ms), _ms(c.max_ms))
    for s in summary.server or []:
        table.add_row("server", Text(f"{s.method} ({s.service_name})"), str(s.count), str(s.errors), _ms(s.p50_ms),
                      _ms(s.p90_ms), _ms(s.p99_ms), _ms(s.mean_ms), _ms(s.max_ms))
    for g in summary.gaps:
        table.add_row(f"gap ({g.basis})", Text(g.name), str(g.count), "", _ms(g.p50_ms), _ms(g.p90_ms),
                      _ms(g.p99_ms), _ms(g.mean_ms), "")
    console.print(table)
    if summary.server is None:
        console.print(Text(f"server side: {summary.server_note or 'not read (no store given)'}"))
    total = summary.client[-1] if summary.client else None
    if total is not None:
        console.print(Text(f"locust: {total.count} requests, {total.failures} failures, {total.rps:.1f} req/s"))
    _render_profile(summary.profile, console)


def _ms(value: float) -> str:
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def _render_profile(profile: ProfileSummary | None, console: Any) -> None:
    from rich.text import Text

    if profile is None:
        console.print(Text("profile: off"))
        return
    session = profile.session or {}
    head = f"profile: {profile.state}"
    if profile.started_after_s is not None:
        head += f", started {profile.started_after_s:.1f} s after spawning completed"
        if profile.rolling_cv is not None:
            head += f" (rolling-median CV {profile.rolling_cv:.3f})"
    if session:
        head += (f"; session {session.get('session_id')} {session.get('outcome') or 'active'}: "
                 f"{session.get('requests')} requests, stop reason {session.get('stop_reason')}")
    console.print(Text(head))
    if profile.reason:
        console.print(Text(f"  {profile.reason}"))
    if session.get("trace_path"):
        console.print(Text(f"  trace: {session['trace_path']} ({session.get('trace_bytes', 0)} bytes)"))
    if session:
        share = session.get("attributed_share")
        console.print(Text(f"  kernels: {session.get('kernel_count', 0)}, {session.get('kernel_time_us', 0.0):.1f} µs"
                           + (f", {100 * share:.1f}% attributed to requests" if share is not None else "")))
    if profile.per_request:
        p = profile.per_request
        if p.get("requests"):
            console.print(Text(f"  per request ({p['requests']} in the trace): kernel time mean "
                               f"{p['kernel_time_us_mean']:.1f} µs, p50 {p['kernel_time_us_p50']:.1f} µs, p99 "
                               f"{p['kernel_time_us_p99']:.1f} µs; {p['cpu_ops_mean']:.0f} CPU ops; range p50 "
                               f"{p['range_ms_p50']:.2f} ms"))
    if profile.top_kernels:
        for k in profile.top_kernels:
            console.print(Text(f"    {k.time_us:12.1f} µs  {k.count:6d}x  {k.name}"))
    elif profile.trace_file:
        console.print(Text("  no GPU kernels in the trace (a CPU-only session)"))

