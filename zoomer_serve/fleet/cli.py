"""``zoomer-serve fleet analyze URL``: the fleet job (:mod:`zoomer_serve.fleet.job`) from the command line.

Prints a summary (the ranked outliers and the findings) or, with ``--json``, the whole report; a progress bar
on stderr (when it is a terminal) while the traces are analysed. Exit codes: 0 (with or without findings), 2 when the URL does not
exist, holds nothing to analyse (in the ``--since`` window: the message says how many trace artifacts there
are and how many ended before it; nothing is written then), cannot be read, or a setting is wrong (one line on
stderr), 3 with ``--fail-on`` when a finding at least that severe was found.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from zoomer_serve.analysis.findings import SEVERITIES
from zoomer_serve.analysis.render import render_findings
from zoomer_serve.cli_output import TableOutput, add_format_option

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")


def parse_since(text: str, now_ns: int | None = None) -> int:
    """``--since``: a duration back from now (``90m``, ``6h``, ``7d``), ISO 8601 (UTC unless it says), or Unix
    seconds; returns Unix ns. Raises ValueError naming the value."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    from zoomer_serve.analysis.diff import _time_ns, checked_time_ns

    m = _RELATIVE.match(text.strip())
    if m:
        back_ns = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)] * 1e9
        return checked_time_ns(now_ns - back_ns, "--since", text)

    value = _time_ns(text.strip(), "--since")
    if value is None:
        raise ValueError("--since is empty")
    return value


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``fleet`` subcommand (``fleet analyze``) to an ``argparse`` subparsers object."""
    p = subparsers.add_parser("fleet", help="analyse a fleet's profiling artifacts and span data in object storage",
                              description="Fleet-wide analysis of what many replicas uploaded (ZOOMER_ARTIFACTS_URL) "
                              "and their collectors wrote (zoomer-serve collector --parquet-url).")
    sub = p.add_subparsers(dest="fleet_command", metavar="ACTION")
    a = sub.add_parser("analyze", help="analyse every trace under URL as a task, compare replicas with their peers",
                       description="List the Kineto trace artifacts and span data under URL, analyse each trace as a "
                       "task (a local process pool, or Ray), and find replicas that stand out from their peers (same "
                       "service and GPU model; median and MAD), kernels whose time per request differs most, and "
                       "replicas with a different kernel mix. Results go next to the data as Parquet, with "
                       "report.json and report.html.")
    a.add_argument("url", help="storage root: a folder, or a URL such as s3://bucket/prefix (ZOOMER_ARTIFACTS_URL)")
    a.add_argument("--since", default=None, help="only artifacts and spans since then: 6h, 7d, ISO 8601, Unix seconds")
    a.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: a process pool on this machine (default); ray: Ray tasks (pip install "
                   "'zoomer-serve[fleet]')")
    a.add_argument("--address", default=None,
                   help="Ray cluster to join (ray://head:10001, or auto); default: start a local Ray instance")
    a.add_argument("--workers", type=int, default=2, help="processes of the local pool / CPUs of a local Ray (default 2)")
    a.add_argument("--retries", type=int, default=2, help="further attempts of a task after a storage error (default 2)")
    a.add_argument("--out", default=None, help="where results go (default URL/fleet/<run id>)")
    a.add_argument("--drill-down", type=int, default=5, metavar="N",
                   help="outlier replicas whose first trace gets its own HTML report and timeline (default 5)")
    a.add_argument("--json", action="store_true",
                   help="print the whole report as JSON (--format json prints the summary's tables); overrides --format")
    add_format_option(a)
    a.add_argument("--html", default=None, metavar="FILE", help="also write the HTML report to this local file")
    a.add_argument("--rows", type=int, default=15, help="outliers shown in the summary (default 15)")
    a.add_argument("--fail-on", choices=SEVERITIES, default=None,
                   help="exit 3 when a finding of this severity or worse is found")
    a.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p


def _error(message: str) -> int:
    print(f"zoomer-serve fleet: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run ``fleet analyze`` for the parsed ``args``; returns the exit code."""
    from zoomer_serve.artifacts.storage import StorageError
    from zoomer_serve.fleet.aggregate import OutputError
    from zoomer_serve.fleet.engines import EngineError
    from zoomer_serve.fleet.job import FleetOptions, run_fleet_job

    try:
        since = parse_since(args.since) if args.since else None
        options = FleetOptions(url=args.url, since_ns=since, engine=args.engine, address=args.address,
                               workers=args.workers, retries=args.retries, out=args.out, drill_down=args.drill_down)
    except ValueError as exc:
        return _error(str(exc))
    err = Console(stderr=True)
    try:
        with Progress(TextColumn("analysing traces"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=err, transient=True, disable=not err.is_terminal) as bar:  # else a blank line
            task = bar.add_task("traces", total=None)
            report = run_fleet_job(options, progress=lambda done, total: bar.update(task, completed=done, total=total))
    except (StorageError, EngineError, OutputError) as exc:
        return _error(str(exc))
    except OSError as exc:  # the storage's own errors (an unknown host, a refused connection)
        return _error(f"cannot read {args.url}: {type(exc).__name__}: {exc}")
    if report.empty:
        return _error(nothing_to_analyze(report, args.since))
    if args.html:
        from zoomer_serve.fleet.html import write_fleet_html

        try:
            write_fleet_html(report, args.html)
        except OSError as exc:
            return _error(f"cannot write {args.html}: {exc}")
    if args.json:
        sys.stdout.write(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
                         .decode() + "\n")
        sys.stdout.flush()
    else:
        out = TableOutput(getattr(args, "format", "table"), console=console)
        render_fleet_summary(report, out, args.rows)
        out.close()
    if args.fail_on is not None:
        worst = SEVERITIES.index(args.fail_on)
        if any(SEVERITIES.index(f.severity) <= worst for f in report.findings):
            return 3
    return 0


def nothing_to_analyze(report: Any, since: str | None) -> str:
    """The message for a report with nothing in it (:attr:`~zoomer_serve.fleet.model.FleetReport.empty`): under
    a ``--since`` window, how many trace artifacts the root holds in all and how many of them lie outside the
    window (listing them all again, which only this case needs)."""
    what = ("no trace artifacts (artifacts/.../*.pt.trace.json.gz.manifest.json) and no span data "
            "(spans/...parquet)")
    if report.since_ns is None:
        return f"{what} under {report.source}"
    from zoomer_serve.artifacts.inventory import trace_manifest_urls
    from zoomer_serve.artifacts.storage import StorageError

    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(report.since_ns / 1e9))
    head = f"{what} from --since {since} ({start}) on under {report.source}"
    try:
        found = len(trace_manifest_urls(report.source))
    except (StorageError, OSError) as exc:
        return f"{head} (counting all trace artifacts failed: {type(exc).__name__}: {exc})"
    if not found:
        return f"{head}: no trace artifacts found at all"
    inside = report.counts.get("traces_analyzed", 0) + report.counts.get("traces_failed", 0)
    return (f"{head}: {found} trace artifact{'' if found == 1 else 's'} found, {found - inside} of them ended "
            f"before {start}")


def render_fleet_summary(report: Any, console: Console | TableOutput, rows: int = 15) -> None:
    """The terminal view: counts, the ranked outliers, the findings, where the results are."""
    c = report.counts
    console.rule(Text(f"fleet {report.source}"))
    console.print(Text(f"{c.get('replicas', 0)} replicas in {c.get('peer_groups', 0)} peer groups; "
                       f"{c.get('traces_analyzed', 0)} traces analysed, {c.get('traces_failed', 0)} failed; "
                       f"{c.get('span_requests', 0)} requests in the span data"))
    table = Table(title="Outliers (robust z against peers)", title_justify="left")
    for col in ("rank", "replica", "service", "GPU", "metric", "method", "value", "peer median", "ratio", "z"):
        table.add_column(col, overflow="fold")
    for o in report.outliers[:rows]:
        z = "inf" if abs(o["z"]) == float("inf") else f"{o['z']:.1f}"
        table.add_row(str(o["rank"]), Text(o["instance"]), Text(o["service"]), Text(o["gpu_model"] or "CPU"),
                      o["metric"], Text(o["method"]), f"{o['value']:.4g}", f"{o['peer_median']:.4g}",
                      f"{o['ratio']:.2f}x", z)
    console.print(table if report.outliers else Text("No replica stands out from its peers."))
    for f in report.failed[:rows]:
        console.print(Text(f"failed: {f['url']}: {f['error']}"))
    console.rule(Text("findings"))
    render_findings(report.findings, console)
    console.print(Text(f"results: {report.outputs.get('report_html')} (and report.json, replicas.parquet, results/)"))
