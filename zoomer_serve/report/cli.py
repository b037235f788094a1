"""``zoomer-serve report``: summarize the collector's store (tables in ``--format`` table, markdown, csv or
json: see :mod:`zoomer_serve.cli_output`; or the whole report model as JSON with ``--json``), then name the
store and the ``zoomer-serve analyze`` command to run on it.

Exit codes: 0 (also for an empty store, which prints "no requests recorded"), 2 when the store is missing
or unreadable (message on stderr naming the path, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.text import Text

from zoomer_serve.cli_output import TableOutput, add_format_option
from zoomer_serve.cli_types import INT32_MAX, int_between
from zoomer_serve.collector.store import default_store_path
from zoomer_serve.report.build import ReportError, build_report
from zoomer_serve.report.render import next_steps, render_report


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "report",
        help="summarize recorded requests: rates, errors, latency percentiles, phases, slowest traces",
        description="Read the collector's DuckDB store (stop the collector first: DuckDB allows one writer "
        "or many readers) and summarize the requests per service and method: counts, rates and errors from the "
        "rpc.server.call.duration metric (every call, sampled or not; the SERVER spans when the store has no such "
        "metric), latency, phases and slowest traces from the SERVER spans (a sample under a head sampler).",
    )
    p.add_argument("--store", default=None,
                   help="DuckDB file, or a Parquet dataset the collector wrote (--parquet-url: a folder or URL such "
                   "as s3://bucket/prefix) (default: $ZOOMER_STORE or ./zoomer-data/zoomer.duckdb)")
    p.add_argument("--json", action="store_true",
                   help="print the whole report model as one JSON object (every field; --format json prints the "
                   "tables as shown); overrides --format")
    add_format_option(p)
    p.add_argument("--slowest", type=int_between(0, INT32_MAX), default=10, help="how many slowest traces to list (default 10)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Build and print the report for the parsed ``args``; returns the exit code (0, or 2 on a bad store)."""
    store = args.store if args.store is not None else default_store_path()
    try:
        report = build_report(store, slowest=args.slowest)
    except FileNotFoundError as exc:
        print(f"zoomer-serve report: {exc} "
              "(run `zoomer-serve collector --store PATH` first, or pass --store / set ZOOMER_STORE)",
              file=sys.stderr)
        return 2
    except ReportError as exc:
        print(f"zoomer-serve report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
        sys.stdout.flush()
        return 0
    out = TableOutput(getattr(args, "format", "table"), console=console)
    render_report(report, out)
    for line in next_steps(report.store_path):
        out.print(Text(line))
    out.close()
    return 0
