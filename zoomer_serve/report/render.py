"""Render a :class:`Report` as ``rich`` tables.

Names that come from the spans (services, methods, phases, statuses) are shown as plain text, never parsed
as rich markup.
"""

from __future__ import annotations

import shlex
from typing import Any

from rich import box
from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

from zoomer_serve.report.model import (
    COUNTS_FROM_METRIC,
    COUNTS_FROM_SPANS,
    BatchingStats,
    MethodStats,
    Report,
)

NO_REQUESTS = "no requests recorded"
LEFT: JustifyMethod = "left"
RIGHT: JustifyMethod = "right"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f}%"


def _statuses(m: MethodStats) -> Text:
    return Text(", ".join(f"{status} {count}" for status, count in m.status_counts.items()))


def _table(title: str, columns: list[tuple[str, JustifyMethod]], fold: tuple[str, ...] = ()) -> Table:
    """A table with left-aligned title; columns named in ``fold`` wrap, the others never do."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in columns:
        if name in fold:
            table.add_column(name, justify=justify, overflow="fold", min_width=7)
        else:
            table.add_column(name, justify=justify, no_wrap=True)
    return table


ERRORS_CAPTION = ("errors: span status ERROR (server failures such as INTERNAL or UNAVAILABLE; in the metric's counts, "
                  "calls with those codes); client errors such as INVALID_ARGUMENT and declared Thrift exceptions "
                  "are not, see the Status codes table")


def counts_source(report: Report) -> str:
    """Where the report's request counts, rates and errors come from, for a title or a header."""
    if report.counts_from == COUNTS_FROM_METRIC:
        return f"counted by the {COUNTS_FROM_METRIC} metric"
    if report.counts_from == COUNTS_FROM_SPANS:
        return "counted from SERVER spans"
    return f"counted by the {COUNTS_FROM_METRIC} metric where the store has it, else from SERVER spans"


def sample_note(report: Report) -> str:
    """What the span-based figures rest on: "1459 sampled spans, 25.1% of the calls" when the spans are a sample
    of the calls the metric counted, else "N spans"."""
    if report.sampled:
        return f"{report.total_spans} sampled spans, {_pct(report.span_sample_ratio or 0.0)} of the calls"
    return f"{report.total_spans} spans"


def methods_table(report: Report) -> Table:
    """Per service and method: count, rate, errors (:attr:`MethodStats.error_count`), the spans the latency
    percentiles (ms) rest on, the percentiles."""
    numeric = ("reqs", "req/s", "errors", "err%", "spans", "p50", "p90", "p99", "max")
    title = "Requests, latency in ms"  # one title whatever the counts come from: --format keys tables by it
    table = _table(title, [("service", LEFT), ("method", LEFT)] + [(n, RIGHT) for n in numeric],
                   fold=("service", "method"))
    caption = f"reqs: {counts_source(report)}; latency: the SERVER spans; {ERRORS_CAPTION}"
    if report.sampled:
        caption += "; spans: the SERVER spans the latency percentiles rest on, a sample of the requests"
    table.caption, table.caption_justify = caption, "left"
    for m in report.methods:
        rate = "-" if m.rate_per_s is None else f"{m.rate_per_s:.1f}"
        table.add_row(Text(m.service_name), Text(m.method), str(m.count), rate, str(m.error_count),
                      _pct(m.error_rate), str(m.spans), _ms(m.p50_ms), _ms(m.p90_ms), _ms(m.p99_ms),
                      _ms(m.max_ms))
    return table


def statuses_table(report: Report) -> Table:
    """Requests per status code (``rpc.response.status_code``, else the span status), per method: every code,
    errors or not."""
    table = _table("Status codes", [("service", LEFT), ("method", LEFT), ("requests by status", LEFT)],
                   fold=("service", "method", "requests by status"))
    table.caption, table.caption_justify = counts_source(report), "left"
    for m in report.methods:
        table.add_row(Text(m.service_name), Text(m.method), _statuses(m))
    return table


def phases_table(report: Report) -> Table | None:
    """Phase share of request time and mean phase duration; None when no request has phases."""
    if not any(m.phases for m in report.methods):
        return None
    table = _table("Phases (share of request time)",
                   [("service", LEFT), ("method", LEFT), ("phase", LEFT), ("spans", RIGHT), ("mean ms", RIGHT),
                    ("share", RIGHT)], fold=("service", "method", "phase"))
    table.caption, table.caption_justify = f"over {sample_note(report)}", "left"
    for m in report.methods:
        for p in m.phases:
            table.add_row(Text(m.service_name), Text(m.method), Text(p.phase), str(p.count), _ms(p.mean_ms),
                          _pct(p.share))
        if m.unattributed_share is not None:
            table.add_row(Text(m.service_name), Text(m.method), Text("(outside phases)", style="dim"), "", "",
                          _pct(m.unattributed_share))
    return table


BATCHING_CAPTION = ("every batched message counts (a stream queues one per message); wait share = the messages' "
                    "queue wait / the batched requests' time (the Phases table's queue share is over all requests)")


def batching_table(report: Report) -> Table | None:
    """Queue wait and batch size of the requests that ran in batches, per method and, for a service with more than
    one batched method, over all of them (each batch once); None when none did. Figures count every batched message
    (:class:`~zoomer_serve.report.model.BatchingStats`)."""
    if not any(m.batching for m in report.methods):
        return None
    table = _table("Batching (requests that ran in batches), queue wait in ms",
                   [("service", LEFT), ("method", LEFT), ("batched", RIGHT), ("messages", RIGHT), ("batches", RIGHT),
                    ("mean size", RIGHT), ("wait p50", RIGHT), ("wait p99", RIGHT), ("wait share", RIGHT)],
                   fold=("service", "method"))
    table.caption, table.caption_justify = f"{BATCHING_CAPTION}; over {sample_note(report)}", "left"
    totals = {t.service_name: t.batching for t in report.batching_totals}
    rows: dict[str, list[tuple[Text, BatchingStats]]] = {}
    for m in report.methods:
        if m.batching is not None:
            rows.setdefault(m.service_name, []).append((Text(m.method), m.batching))
    for service, methods in rows.items():
        if len(methods) > 1 and service in totals:
            methods.append((Text("(all methods)", style="dim"), totals[service]))
        for method, b in methods:
            table.add_row(Text(service), method, str(b.requests), str(b.messages), str(b.batches),
                          f"{b.mean_batch_size:.1f}", _ms(b.queue_wait_p50_ms), _ms(b.queue_wait_p99_ms),
                          _pct(b.queue_wait_share))
    return table


def slowest_table(report: Report) -> Table | None:
    """The slowest traces; None when none are listed."""
    if not report.slowest:
        return None
    table = _table(f"Slowest {len(report.slowest)} traces",
                   [("trace id", LEFT), ("service", LEFT), ("method", LEFT), ("ms", RIGHT), ("status", LEFT)],
                   fold=("service", "method"))
    table.caption, table.caption_justify = f"of {sample_note(report)}", "left"
    for t in report.slowest:
        table.add_row(t.trace_id, Text(t.service_name), Text(t.method), _ms(t.duration_ms), Text(t.status))
    return table


def window_text(seconds: float) -> str:
    """A time span for a sentence: "2.5 s" from 1 s up, "23 ms" below (never "0.0 s")."""
    if seconds >= 1.0:
        return f"{seconds:.1f} s"
    if seconds >= 0.001:
        return f"{seconds * 1e3:.0f} ms"
    return f"{seconds * 1e6:.0f} us"


def next_steps(store_path: str) -> list[str]:
    """The lines that say which store was read and the command that analyses it."""
    store = shlex.quote(store_path)
    return [f"store: {store_path}",
            f"next: zoomer-serve analyze --store {store}   (findings; add --html report.html for the HTML report)"]


def render_report(report: Report, console: Any) -> None:
    """Print ``report`` to ``console`` (a rich Console, or a :class:`~zoomer_serve.cli_output.TableOutput`):
    "no requests recorded" when empty (with its notes: calls and spans lost on the way), else a header line, the
    notes and the tables. The header gives the request
    count, the window, where the counts come from (the ``rpc.server.call.duration`` metric or the spans) and how
    many spans the latency figures rest on (a sample, with the ratio seen, when fewer than the calls); per-method
    rates are only given for windows of at least 1 s (see :data:`~zoomer_serve.report.build.MIN_RATE_WINDOW_S`)."""
    if report.empty:
        console.print(NO_REQUESTS)
        for note in report.notes:  # what was lost on the way, when that is why the store holds no request
            console.print(Text(f"note: {note}"))
        return
    window_s = ((report.window_end_ns or 0) - (report.window_start_ns or 0)) / 1e9
    header = Text.assemble((str(report.total_requests), "bold"), " requests, ",
                           (str(report.total_errors), "bold"), f" errors over {window_text(window_s)}  ",
                           f"({report.store_path})")
    console.print(header)
    console.print(Text(f"{counts_source(report)}; latency, phases and slowest traces from {sample_note(report)}"))
    for note in report.notes:
        console.print(Text(f"note: {note}"))
    for table in (methods_table(report), statuses_table(report), phases_table(report), batching_table(report),
                  slowest_table(report)):
        if table is not None:
            console.print(table)
