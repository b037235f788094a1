"""``zoomer-serve analyze``: findings and tables from Kineto trace files and/or the collector's store.

Output: a terminal summary (rich), or ``--json`` (findings and tables on stdout); ``--html FILE`` writes a
self-contained HTML report with plots, ``--perfetto FILE`` the merged timeline (requests, CPU ops and kernels
on one time axis; TrackEvent protobuf, or Chrome JSON for ``.json`` names; see
:mod:`zoomer_serve.analysis.perfetto`). Exit codes: 0 (with or without findings), 2 when an input is missing,
unreadable or holds no trace events (message on stderr naming it, no traceback), 3 with ``--fail-on SEVERITY``
when a finding at least that severe was found.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.text import Text

from zoomer_serve.analysis.api import AnalysisResult, analyze
from zoomer_serve.analysis.conventions import CONVENTIONS, STEPS, Conventions
from zoomer_serve.analysis.findings import SEVERITIES
from zoomer_serve.analysis.kineto import TraceFormatError
from zoomer_serve.analysis.render import (
    NO_GPU_WORK,
    has_gpu_work,
    range_time_views,
    render_findings,
    rich_table,
)
from zoomer_serve.analysis.store import StoreAnalysisError, requests_note, store_loss_notes
from zoomer_serve.cli_output import TableOutput, add_format_option
from zoomer_serve.cli_paths import output_problem
from zoomer_serve.cli_types import INT32_MAX, int_between
from zoomer_serve.collector.store import default_store_path


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``analyze`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "analyze",
        help="find performance problems in Kineto traces and/or the request store, with recommendations",
        description="Analyse PyTorch profiler (Kineto) trace files (.json or .json.gz) and/or the collector's "
        "DuckDB store: GPU utilisation and idle time, kernel breakdown, launch overhead, copies, "
        "synchronisations, tail latency, slow replicas, CPU-bound phases, GPU memory. With neither traces nor "
        "--store, the default store is read.",
    )
    p.add_argument("traces", nargs="*", type=Path, metavar="TRACE",
                   help="Kineto / Chrome trace JSON files, or folders of them (the ranks of a job: collectives, "
                   "communication overlap and stragglers across them)")
    p.add_argument("--store", default=None,
                   help="DuckDB store, or a Parquet dataset the collector wrote (folder or URL such as "
                   "s3://bucket/prefix) (default when no trace is given: $ZOOMER_STORE or ./zoomer-data/zoomer.duckdb)")
    p.add_argument("--json", action="store_true",
                   help="print findings and every row of every table as JSON instead of the summary (the whole "
                   "result with raw values; --format json prints the summary's tables as shown); overrides --format")
    add_format_option(p)
    p.add_argument("--html", type=Path, default=None, metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--perfetto", type=Path, default=None, metavar="FILE",
                   help="write the merged timeline (request spans and phases, CPU ops, kernels) for "
                   "ui.perfetto.dev: TrackEvent protobuf (FILE.pftrace; .gz to compress), or Chrome JSON when "
                   "FILE ends in .json / .json.gz")
    p.add_argument("--conventions", choices=CONVENTIONS, default="zoomer",
                   help="what the figures count: zoomer (default: every GPU operation in the trace, sync records "
                   "are the host waiting, times as written) or hta (Holistic Trace Analysis' definitions, to "
                   "compare with it; see docs/reports.md, 'How our figures differ from HTA's')")
    p.add_argument("--steps", choices=STEPS, default=None,
                   help="profiler steps to count: all (default with --conventions zoomer) or complete (all but the "
                   "last, whose GPU work may run past the recording; default with --conventions hta)")
    p.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="compare two traces, stores or store windows (STORE@FROM..TO, ISO 8601 or Unix seconds): "
                   "figures with deltas, kernels and ops that appeared, vanished or changed, phases, findings")
    p.add_argument("--rows", type=int_between(0, INT32_MAX), default=10,
                   help="rows per table in the terminal summary (default 10; --json and --html hold every row)")
    p.add_argument("--fail-on", choices=SEVERITIES, default=None,
                   help="exit 3 when a finding of this severity or worse is found (for CI gates)")
    p.set_defaults(func=run)
    return p


def _error(message: str) -> int:
    print(f"zoomer-serve analyze: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run the analysis for parsed ``args``; returns the exit code. Never raises for bad input: exit 2 with
    one line on stderr (an unexpected error included, named as such)."""
    try:
        return _run(args, console)
    except Exception as exc:  # the promise is one line, never a traceback
        return _error(f"internal error ({type(exc).__name__}: {exc}); please report it with the input")


def _run(args: argparse.Namespace, console: Console | None) -> int:
    if args.diff is not None:
        return _run_diff(args, console)
    store = args.store
    if not args.traces and store is None:
        store = default_store_path()
        if not store.is_file():
            return _error(f"no trace files given and no store at {store} (pass TRACE files and/or --store)")
    traces: list[Path] = []
    for t in args.traces:
        if t.is_dir():
            found = trace_files(t)
            if not found:
                return _error(f"no trace files (*.json, *.json.gz) in the folder {t}")
            traces.extend(found)
        elif not t.is_file():
            return _error(f"trace not found: {t}")
        else:
            traces.append(t)
    problem = output_problem(_outputs(args), [*traces, *_local(store)])
    if problem is not None:  # said before the analysis runs, not after; an input is never overwritten
        return _error(problem)
    steps = args.steps or ("complete" if args.conventions == "hta" else "all")
    try:
        result = analyze(traces, store, Conventions(args.conventions, steps))
    except FileNotFoundError as exc:
        return _error(str(exc))
    except (TraceFormatError, StoreAnalysisError) as exc:
        return _error(str(exc))
    for rep in result.traces:
        for warning in rep.trace.warnings:
            print(f"zoomer-serve analyze: warning: {rep.trace.path}: {warning}", file=sys.stderr)
    try:
        notes = _write_outputs(args, result)
    except OSError as exc:
        return _error(f"cannot write the output: {exc}")
    if args.json:
        out = result.to_dict()  # every row: --rows is for the terminal summary
        out["outputs"] = notes
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
                                      | orjson.OPT_NON_STR_KEYS).decode() + "\n")
        sys.stdout.flush()
    else:
        shown = TableOutput(getattr(args, "format", "table"), console=console)
        render_summary(result, shown, rows=args.rows)
        for note in notes:
            shown.print(Text(note))
        shown.close()
    if args.fail_on is not None:
        worst = SEVERITIES.index(args.fail_on)
        if any(SEVERITIES.index(f.severity) <= worst for f in result.findings):
            return 3
    return 0


def trace_files(folder: Path) -> list[Path]:
    """The trace files of a folder (``*.json`` and ``*.json.gz``, as the ranks of a job write them), sorted;
    zoomer-serve's other artifacts in a profiles folder (session summaries, CPU profiles, manifests) are no
    traces and are left out."""
    from zoomer_serve.artifacts.layout import MANIFEST_SUFFIX, TRACE_SUFFIX, kind_of

    return sorted(p for p in folder.iterdir()
                  if p.is_file() and p.name.endswith((".json", ".json.gz")) and not p.name.endswith(MANIFEST_SUFFIX)
                  and kind_of(p.name) in (kind_of(TRACE_SUFFIX), "other"))


def _run_diff(args: argparse.Namespace, console: Console | None) -> int:
    from zoomer_serve.analysis.diff import diff, parse_side

    if args.traces or args.store is not None:
        return _error("--diff takes its two sides as BEFORE AFTER; give no other trace or --store")
    try:
        inputs = [parse_side(side).path for side in args.diff]
    except ValueError as exc:  # a window on a trace file, a time that cannot be read
        return _error(str(exc))
    problem = output_problem(_outputs(args), inputs)
    if problem is not None:
        return _error(problem)
    steps = args.steps or ("complete" if args.conventions == "hta" else "all")
    try:
        report = diff(args.diff[0], args.diff[1], Conventions(args.conventions, steps))
    except (FileNotFoundError, ValueError, StoreAnalysisError) as exc:  # TraceFormatError is a ValueError
        return _error(str(exc))
    for result in (report.before_result, report.after_result):
        for rep in result.traces:
            for warning in rep.trace.warnings:
                print(f"zoomer-serve analyze: warning: {rep.trace.path}: {warning}", file=sys.stderr)
    notes = []
    if args.html is not None:
        from zoomer_serve.analysis.html import write_diff_html

        try:
            write_diff_html(report, args.html)
        except OSError as exc:
            return _error(f"cannot write the output: {exc}")
        notes.append(f"HTML diff: {args.html}")
    if args.json:
        out = report.to_dict()
        out["outputs"] = notes
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
        sys.stdout.flush()
        return 0
    shown = TableOutput(getattr(args, "format", "table"), console=console)
    render_diff(report, shown, rows=args.rows)
    for note in notes:
        shown.print(Text(note))
    shown.close()
    return 0


def render_diff(report: Any, console: Console | TableOutput, rows: int = 10) -> None:
    """The terminal view of a :class:`~zoomer_serve.analysis.diff.DiffReport`."""
    console.rule(Text(f"before {report.before}  →  after {report.after}"))
    t = report.tables
    console.print(rich_table(t["figures"], limit=len(t["figures"]), title="Figures"))
    k = t["kernels"]
    if len(k):
        console.print(rich_table(k.take(k["status"] != "same"), ["name", "kind", "status", "count_before",
                                                                "count_after", "time_before_us", "time_after_us",
                                                                "delta_us", "launches_before", "launches_after"],
                                 rows, "Kernels and copies that appeared, vanished or changed most"))
    o = t["cpu_ops"]
    if len(o):
        console.print(rich_table(o.take(o["status"] != "same"), ["name", "status", "count_before", "count_after",
                                                                "time_before_us", "time_after_us", "delta_us"],
                                 rows, "CPU ops that appeared, vanished or changed most"))
    if len(t["phases"]):
        console.print(rich_table(t["phases"], limit=rows, title="Phases"))
    console.print(rich_table(t["findings"], limit=len(t["findings"]), title="Findings"))


def render_summary(result: AnalysisResult, console: Console | TableOutput, rows: int = 10) -> None:
    """The terminal summary: per trace its tables, the store's per-method percentiles, then the findings."""
    for rep in result.traces:
        s = rep.trace.summary()
        console.rule(Text(f"trace {s['path']}"))
        console.print(Text(f"{s['events']} events: {s['kernels']} kernels, {s['memops']} copies/memsets, "
                           f"{s['runtime_calls']} runtime calls, {s['cpu_ops']} CPU ops, {s['annotations']} "
                           f"annotations; devices {s['devices']}; conventions {s['conventions']}, "
                           f"{s['steps']} profiler steps"))
        t = rep.tables
        if not has_gpu_work(rep.trace):
            console.print(Text(NO_GPU_WORK, style="italic"))
        else:
            console.print(rich_table(t["gpu_utilization"], ["device", "stream", "ops", "window_us", "busy_us",
                                                             "utilization", "host_wait_us", "kernel_wait_us",
                                                             "other_idle_us"], rows, "GPU busy / idle"))
            console.print(rich_table(t["time_breakdown"], ["device", "window_us", "idle_us", "computation_us",
                                                            "communication_us", "memory_us",
                                                            "computation_communication_overlap_us"], rows,
                                     "Where GPU time goes"))
            console.print(rich_table(t["kind_breakdown"], limit=rows, title="GPU time by kind"))
            console.print(rich_table(t["kernel_breakdown"], ["name", "kind", "count", "total_us", "mean_us", "share"],
                                     rows, "Top kernels"))
            console.print(rich_table(t["launch_stats"], ["device", "kernels", "kernel_median_us", "launch_median_us",
                                                          "short_share", "launch_exceeds_kernel_share",
                                                          "launch_delay_median_us"], rows, "Kernel launches"))
            if len(t["memcpy_bandwidth"]):
                console.print(rich_table(t["memcpy_bandwidth"], ["op", "direction", "src", "dst", "count", "bytes",
                                                                  "time_us", "bandwidth_gbps"], rows, "Copies"))
        if len(t["counters"]):
            console.print(rich_table(t["counters"], limit=rows, title="Counter tracks"))
        if len(t["profiler_steps"]):
            console.print(rich_table(t["profiler_steps"], limit=rows, title="Profiler steps"))
        for table, columns, title in range_time_views(rep.trace, t):
            console.print(rich_table(table, columns, rows, title))
    if result.collective_tables and len(result.collective_tables["collectives"]):
        c = result.collective_tables
        console.rule(Text(f"Collectives across {len(result.traces)} ranks"))
        console.print(rich_table(c["collectives"], limit=rows * len(result.traces), title="Collectives per rank"))
        console.print(rich_table(c["communication_overlap"], limit=len(c["communication_overlap"]),
                                 title="Communication hidden behind computation"))
        console.print(rich_table(c["stragglers"], limit=len(c["stragglers"]), title="Stragglers"))
    if result.store is not None:
        console.rule(Text(f"store {result.store.path}"))
        requests = result.store_tables["request_percentiles"]
        mixed = len(set(requests["counts_from"].tolist())) > 1  # else the title says where the counts come from
        columns = [c for c in requests.column_names if mixed or c != "counts_from"]
        shown = rich_table(requests, columns, limit=rows, title="Requests")
        more = f"; {shown.caption}" if shown.caption else ""  # "N more rows"
        shown.caption = requests_note(requests) + more
        shown.caption_justify = "left"
        console.print(shown)
        for note in store_loss_notes(result.store.losses, requests):
            console.print(Text(f"note: {note}"))
    console.rule(Text("findings"))
    render_findings(result.findings, console)


def _outputs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """The files this run will write, as ``(option, path)``."""
    return [(option, path) for option, path in (("--html", args.html), ("--perfetto", args.perfetto))
            if path is not None]


def _local(store: str | Path | None) -> list[Path]:
    """The store as a local path to check outputs against (none for an object-store URL)."""
    return [] if store is None or "://" in str(store) else [Path(store)]


def _write_outputs(args: argparse.Namespace, result: Any) -> list[str]:
    """Write the --html / --perfetto files; the notes that say where they are. Raises OSError."""
    notes: list[str] = []
    if args.html is not None:
        from zoomer_serve.analysis.html import write_html

        write_html(result, args.html)
        notes.append(f"HTML report: {args.html}")
    if args.perfetto is not None:
        from zoomer_serve.analysis.perfetto import write_perfetto

        counts = write_perfetto(args.perfetto, [r.trace for r in result.traces], result.store)
        notes.append(f"Perfetto timeline: {args.perfetto} ({counts['events']} slices and counter points on "
                     f"{counts['tracks']} tracks, {counts['requests']} requests, {counts['linked_requests']} linked "
                     f"to trace ranges; open in https://ui.perfetto.dev)")
    return notes
