"""Render a :class:`Report` as ``rich`` tables."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from zoomer_serve.report.model import MethodStats, Report

NO_REQUESTS = "no requests recorded"


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f}%"


def _statuses(m: MethodStats) -> str:
    return ", ".join(f"{status} {count}" for status, count in m.status_counts.items())


def methods_table(report: Report) -> Table:
    """Per service and method: count, rate, errors, latency percentiles (ms)."""
    table = Table(title="Requests (SERVER spans), latency in ms", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("service", overflow="fold", min_width=7)
    table.add_column("method", overflow="fold", min_width=7)
    for name in ("reqs", "req/s", "errors", "err%", "p50", "p90", "p99", "max"):
        table.add_column(name, justify="right", no_wrap=True)
    for m in report.methods:
        rate = "-" if m.rate_per_s is None else f"{m.rate_per_s:.1f}"
        table.add_row(m.service_name, m.method, str(m.count), rate, str(m.error_count), _pct(m.error_rate),
                      _ms(m.p50_ms), _ms(m.p90_ms), _ms(m.p99_ms), _ms(m.max_ms))
    return table


def statuses_table(report: Report) -> Table:
    """Requests per status code (``rpc.response.status_code``, else the span status), per method."""
    table = Table(title="Status codes", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("service", overflow="fold")
    table.add_column("method", overflow="fold")
    table.add_column("requests by status")
    for m in report.methods:
        table.add_row(m.service_name, m.method, _statuses(m))
    return table


def phases_table(report: Report) -> Table | None:
    """Phase share of request time and mean phase duration; None when no request has phases."""
    if not any(m.phases for m in report.methods):
        return None
    table = Table(title="Phases (share of request time)", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("service", "left"), ("method", "left"), ("phase", "left"), ("spans", "right"),
                          ("mean ms", "right"), ("share", "right")):
        table.add_column(name, justify=justify)
    for m in report.methods:
        for p in m.phases:
            table.add_row(m.service_name, m.method, p.phase, str(p.count), _ms(p.mean_ms), _pct(p.share))
        if m.unattributed_share is not None:
            table.add_row(m.service_name, m.method, "[dim](outside phases)[/dim]", "", "",
                          _pct(m.unattributed_share))
    return table


def slowest_table(report: Report) -> Table | None:
    """The slowest traces; None when none are listed."""
    if not report.slowest:
        return None
    table = Table(title=f"Slowest {len(report.slowest)} traces", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("trace id", "left"), ("service", "left"), ("method", "left"), ("ms", "right"),
                          ("status", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for t in report.slowest:
        table.add_row(t.trace_id, t.service_name, t.method, _ms(t.duration_ms), t.status)
    return table


def render_report(report: Report, console: Console) -> None:
    """Print ``report`` to ``console``: "no requests recorded" when empty, else the tables."""
    if report.empty:
        console.print(NO_REQUESTS)
        return
    window_s = ((report.window_end_ns or 0) - (report.window_start_ns or 0)) / 1e9
    console.print(f"[bold]{report.total_requests}[/bold] requests, [bold]{report.total_errors}[/bold] errors "
                  f"over {window_s:.1f} s  ({report.store_path})")
    for table in (methods_table(report), statuses_table(report), phases_table(report),
                  slowest_table(report)):
        if table is not None:
            console.print(table)
