"""A self-contained HTML report: the findings and plots (latency over time, per-method percentiles, GPU
utilisation and memory timelines, kernel breakdown), drawn with matplotlib and embedded as base64 PNG.

The file has no external references (no scripts, fonts or images fetched), so it can be mailed or attached
to a ticket. Each plot is an ``<img>`` with a ``data-plot`` attribute naming it; a plot without data is
replaced by a note saying what data it needs.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zoomer_serve.analysis.api import AnalysisResult, TraceReport
from zoomer_serve.analysis.findings import SEVERITIES, Finding
from zoomer_serve.analysis.labels import METRIC_GPU_MEMORY_USAGE, METRIC_GPU_UTILIZATION
from zoomer_serve.analysis.render import (
    NO_GPU_WORK,
    column_format,
    fmt_item,
    fmt_value,
    has_gpu_work,
    range_time_views,
    short_kernel_name,
)
from zoomer_serve.analysis.table import Table
from zoomer_serve.analysis.timeline import utilization_timeline

PLOTS = ("latency_over_time", "method_percentiles", "gpu_utilization", "gpu_memory", "kernel_breakdown")
"""The ``data-plot`` names of the report's plots."""

MAX_SCATTER_POINTS = 20_000
_SEVERITY_COLOR = {"high": "#c62828", "medium": "#ef6c00", "low": "#1565c0", "info": "#616161"}
_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;color:#222}
h1{font-size:24px;margin-bottom:4px} h2{font-size:19px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
h3{font-size:15px;margin:18px 0 6px} .meta{color:#666;font-size:13px}
.finding{border:1px solid #ddd;border-left:6px solid #999;border-radius:4px;padding:10px 14px;margin:12px 0}
.sev{font-weight:bold;text-transform:uppercase;font-size:12px;color:#fff;padding:2px 6px;border-radius:3px}
.fid{font-family:monospace;font-size:13px;margin-left:8px} .scope{color:#555;font-size:13px;margin-left:8px}
.rec{background:#f1f8e9;padding:6px 10px;border-radius:3px;margin-top:6px}
table{border-collapse:collapse;font-size:12px;margin:6px 0} td,th{border:1px solid #e0e0e0;padding:3px 6px;text-align:left}
th{background:#fafafa} td.num{text-align:right;font-variant-numeric:tabular-nums}
img.plot{max-width:100%;border:1px solid #eee;margin:6px 0} .nodata{color:#777;font-style:italic;padding:8px;border:1px dashed #ccc}
details summary{cursor:pointer;color:#1565c0;font-size:13px} code{font-size:12px}
.scroll{overflow-x:auto;max-width:100%} caption{text-align:left;font-weight:bold;font-size:13px;padding:4px 0}
.nogpu{color:#555;font-style:italic;margin:6px 0}
"""


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _img(name: str, fig: Any, alt: str) -> str:
    return (f'<img class="plot" data-plot="{name}" alt="{html.escape(alt)}" '
            f'src="data:image/png;base64,{_png(fig)}">')


def _nodata(name: str, why: str) -> str:
    return f'<div class="nodata" data-plot-missing="{name}">{html.escape(why)}</div>'


# ---- plots -------------------------------------------------------------------------------------------------


def plot_latency_over_time(result: AnalysisResult) -> str:
    store = result.store
    if store is None or not len(store.requests):
        return _nodata("latency_over_time", "Latency over time needs request spans: pass --store.")
    plt = _plt()
    req = store.requests
    t0 = float(req["start_ns"].min())
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for method in sorted(set(req["method"].tolist())):
        idx = np.flatnonzero(req["method"] == method)
        step = max(1, len(idx) // MAX_SCATTER_POINTS)
        idx = idx[::step]
        x = (req["start_ns"][idx] - t0) / 1e9
        ax.scatter(x, req["duration_ms"][idx], s=6, alpha=0.6, label=method)
        err = idx[req["is_error"][idx]]
        if len(err):
            ax.scatter((req["start_ns"][err] - t0) / 1e9, req["duration_ms"][err], s=18, marker="x", color="#c62828")
    d = req["duration_ms"]
    if d.min() > 0 and d.max() / d.min() > 50:
        ax.set_yscale("log")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Request latency over time (x = error)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", markerscale=2)
    return _img("latency_over_time", fig, "request latency over time")


def plot_method_percentiles(result: AnalysisResult) -> str:
    table = result.store_tables.get("request_percentiles")
    if table is None or not len(table):
        return _nodata("method_percentiles", "Per-method percentiles need request spans: pass --store.")
    plt = _plt()
    labels = [f"{m}" for m in table["method"].tolist()]
    y = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.55 * len(labels)))
    h = 0.26
    for k, (col, color) in enumerate((("p50_ms", "#90caf9"), ("p90_ms", "#42a5f5"), ("p99_ms", "#1565c0"))):
        vals = table[col]
        ax.barh(y + (k - 1) * h, vals, height=h, color=color, label=col.replace("_ms", ""))
        for yi, v in zip(y + (k - 1) * h, vals):
            ax.text(v, yi, f" {v:.1f}", va="center", fontsize=7)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("latency (ms)")
    ax.set_title("Latency percentiles per method")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return _img("method_percentiles", fig, "latency percentiles per method")


def _metric_series(result: AnalysisResult, metric: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    store = result.store
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if store is None or not len(store.gpu_metrics):
        return out
    m = store.gpu_metrics
    sel = m["metric"] == metric
    for key in sorted(set(zip(m["instance"][sel].tolist(), m["hw_id"][sel].tolist()))):
        s = sel & (m["instance"] == key[0]) & (m["hw_id"] == key[1])
        out[f"{key[0] or 'replica'} {key[1]}".strip()] = (m["time_ns"][s], m["value"][s])
    return out


def plot_gpu_utilization(result: AnalysisResult) -> str:
    series = []
    for rep in result.traces:
        for dev, (x, frac) in utilization_timeline(rep.trace).items():
            series.append((f"{Path(str(rep.trace.path)).name} GPU {dev}", x / 1e3, frac * 100, "trace"))
    for label, (t, v) in _metric_series(result, METRIC_GPU_UTILIZATION).items():
        series.append((f"NVML {label}", (t - t.min()) / 1e6, v * 100, "metric"))
    if not series:
        if result.traces:
            return _nodata("gpu_utilization", "No GPU utilisation to plot: the traces hold no GPU work (no kernels, "
                                              "copies or memsets) and the store no hw.gpu.utilization metrics.")
        return _nodata("gpu_utilization", "GPU utilisation needs a Kineto trace (trace files) or hw.gpu.utilization "
                                          "metrics in the store.")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for label, x, y, kind in series:
        ax.plot(x, y, lw=1.2, label=label, drawstyle="steps-post" if kind == "trace" else "default")
    ax.set_ylim(-2, 102)
    ax.set_xlabel("ms since the start of the trace (or of the metric series)")
    ax.set_ylabel("GPU busy (%)")
    ax.set_title("GPU utilisation over time (kernels + copies, per time bin)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _img("gpu_utilization", fig, "GPU utilisation over time")


def plot_gpu_memory(result: AnalysisResult) -> str:
    lines: list[tuple[str, np.ndarray, np.ndarray]] = []
    store = result.store
    if store is not None and len(store.memory):
        mem = store.memory
        t0 = float(mem["time_ns"].min())
        for inst in sorted(set(mem["instance"].tolist())):
            s = mem["instance"] == inst
            for col, label in (("allocated_bytes", "allocated"), ("reserved_bytes", "reserved")):
                ok = s & (mem[col] >= 0)
                if ok.any():
                    lines.append((f"{inst or 'replica'} {label}", (mem["time_ns"][ok] - t0) / 1e9,
                                  mem[col][ok] / 2**30))
    for label, (t, v) in _metric_series(result, METRIC_GPU_MEMORY_USAGE).items():
        lines.append((f"NVML used {label}", (t - t.min()) / 1e9, v / 2**30))
    for rep in result.traces:
        m = rep.trace.memory
        for dev in sorted(set(m["device"].tolist())) if len(m) else []:
            if dev < 0:
                continue
            s = m["device"] == dev
            name = Path(str(rep.trace.path)).name
            lines.append((f"{name} GPU {dev} allocated", m["ts"][s] / 1e6, m["total_allocated"][s] / 2**30))
            lines.append((f"{name} GPU {dev} reserved", m["ts"][s] / 1e6, m["total_reserved"][s] / 2**30))
    if not lines:
        return _nodata("gpu_memory", "GPU memory over time needs zoomer.gpu.memory.* span attributes or "
                                     "hw.gpu.memory.usage metrics in the store, or a trace recorded with "
                                     "profile_memory=True.")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for label, x, y in lines:
        ax.plot(x, y, lw=1.2, label=label, drawstyle="steps-post")
    ax.set_xlabel("seconds since the first sample")
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _img("gpu_memory", fig, "GPU memory over time")


def plot_kernel_breakdown(rep: TraceReport, index: int) -> str:
    kinds: Table = rep.tables["kind_breakdown"]
    names: Table = rep.tables["kernel_breakdown"]
    if not len(kinds):
        return _nodata("kernel_breakdown", "No GPU kernels in this trace.")
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [1, 1.7]},
                                 layout="constrained")
    kind_total: dict[str, float] = {}
    for k, v in zip(kinds["kind"].tolist(), kinds["total_us"].tolist()):
        kind_total[k] = kind_total.get(k, 0.0) + v
    ks = sorted(kind_total, key=lambda k: -kind_total[k])
    a1.barh(ks, [kind_total[k] / 1e3 for k in ks], color="#5c6bc0")
    a1.invert_yaxis()
    a1.set_xlabel("GPU time (ms)")
    a1.set_title("by kind")
    top = names.head(12)
    labels = [short_kernel_name(n, 44) for n in top["name"].tolist()]
    a2.barh(range(len(labels)), top["total_us"] / 1e3, color="#26a69a")
    a2.set_yticks(range(len(labels)), labels, fontsize=7)
    a2.invert_yaxis()
    a2.set_xlabel("GPU time (ms)")
    a2.set_title("top kernels / copies")
    for ax in (a1, a2):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Kernel breakdown: {Path(str(rep.trace.path)).name}", fontsize=11)
    return _img("kernel_breakdown", fig, f"kernel breakdown of trace {index + 1}")


# ---- html --------------------------------------------------------------------------------------------------


def _table_html(table: Table, columns: list[str] | None = None, limit: int = 15, title: str = "",
                description: str | None = None) -> str:
    """A table with a caption (``title`` and ``description``, default the table's), one unit per column (in
    its header), at most ``limit`` rows; it scrolls sideways inside the page when wide."""
    cols = columns or table.column_names
    formats = {c: column_format(table, c) for c in cols}
    head = "".join(f"<th>{html.escape(formats[c][0])}</th>" for c in cols)
    body = []
    for row in table.rows(limit):
        cells = []
        for c in cols:
            v = row[c]
            cls = ' class="num"' if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
            text = short_kernel_name(v, 90) if c in ("name", "next_op") and isinstance(v, str) else formats[c][1](v)
            cells.append(f"<td{cls} title=\"{html.escape(str(v))}\">{html.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = (f'<div class="meta">{len(table) - limit} more rows: every row is in the --json output</div>'
            if len(table) > limit else "")
    description = table.description if description is None else description
    caption = html.escape(title or table.name) + (f' <span class="meta">{html.escape(description)}</span>'
                                                  if description else "")
    return (f'<div class="scroll"><table data-table="{html.escape(table.name)}"><caption>{caption}</caption>'
            f"<tr>{head}</tr>{''.join(body)}</table></div>{more}")


def _kv_table(values: dict[str, Any]) -> str:
    rows = []
    for k, v in values.items():
        if isinstance(v, (dict, list)):
            text = ", ".join(f"{a}: {fmt_value(b) if not isinstance(b, dict) else _compact(b)}"
                             for a, b in v.items()) if isinstance(v, dict) else _compact_list(v)
        else:
            text = fmt_item(k, v)
        rows.append(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(text))}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def _compact(d: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={fmt_value(v)}" for k, v in d.items()) + "}"


def _compact_list(values: list[Any]) -> str:
    return "; ".join(_compact(v) if isinstance(v, dict) else fmt_value(v) for v in values[:5])


def _items_table(items: list[dict[str, Any]]) -> str:
    if not items:
        return ""
    cols: list[str] = []
    for it in items:
        for k in it:
            if k not in cols:
                cols.append(k)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    rows = []
    for it in items:
        cells = []
        for c in cols:
            v = it.get(c)
            text = fmt_item(c, v)
            cells.append(f"<td title=\"{html.escape(str(v))}\">{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _finding_html(f: Finding) -> str:
    color = _SEVERITY_COLOR.get(f.severity, "#999")
    return (f'<div class="finding" data-finding="{html.escape(f.id)}" style="border-left-color:{color}">'
            f'<span class="sev" style="background:{color}">{html.escape(f.severity)}</span>'
            f'<span class="fid">{html.escape(f.id)}</span><span class="scope">{html.escape(f.scope)}</span>'
            f'<h3>{html.escape(f.title)}</h3><div>{html.escape(f.summary)}</div>'
            f'<div class="rec"><b>What to do:</b> {html.escape(f.recommendation)}</div>'
            f'<details><summary>evidence and items</summary>{_kv_table(f.evidence)}{_items_table(f.items)}'
            f'<div class="meta">source: {html.escape(f.source)}</div></details></div>')


def render_html(result: AnalysisResult, title: str = "zoomer-serve analysis") -> str:
    """The report as one HTML string (see the module docstring)."""
    from zoomer_serve.analysis.store import request_totals

    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    sources = [str(r.trace.path) for r in result.traces] + ([str(result.store.path)] if result.store else [])
    n_spans = len(result.store.requests) if result.store else 0
    table = result.store_tables.get("request_percentiles")
    n_req = request_totals(table)[0] if table is not None else n_spans
    parts.append(f'<div class="meta">Generated {time.strftime("%Y-%m-%d %H:%M:%S")} from '
                 f'{html.escape(", ".join(sources) or "nothing")}; {len(result.traces)} trace(s), {n_req} requests '
                 f'({n_spans} spans), {len(result.findings)} findings.</div>')
    counts = ", ".join(f"{sum(1 for f in result.findings if f.severity == s)} {s}" for s in SEVERITIES
                       if any(f.severity == s for f in result.findings))
    parts.append(f"<h2>Findings</h2><div class=\"meta\">{html.escape(counts or 'no detector fired')}</div>")
    parts.extend(_finding_html(f) for f in result.findings)
    parts.append("<h2>Requests</h2>")
    parts.append(_safe(plot_latency_over_time, result, "latency_over_time"))
    parts.append(_safe(plot_method_percentiles, result, "method_percentiles"))
    if "request_percentiles" in result.store_tables:
        parts.append(_table_html(result.store_tables["request_percentiles"], title="Request latency per method"))
    parts.append("<h2>GPU</h2>")
    parts.append(_safe(plot_gpu_utilization, result, "gpu_utilization"))
    parts.append(_safe(plot_gpu_memory, result, "gpu_memory"))
    for i, rep in enumerate(result.traces):
        parts.append(f"<h3>Trace {html.escape(str(rep.trace.path))}</h3>")
        if not has_gpu_work(rep.trace):
            parts.append(f'<p class="nogpu" data-no-gpu="{i}">{html.escape(NO_GPU_WORK)}</p>')
        else:
            parts.append(_safe(functools.partial(_kernel_plot, rep=rep, index=i), result, "kernel_breakdown"))
            parts.append(_table_html(rep.tables["gpu_utilization"], title="GPU busy / idle per device and stream"))
            parts.append(_table_html(rep.tables["time_breakdown"], title="Where GPU time goes"))
            parts.append(_table_html(rep.tables["kernel_breakdown"], ["device", "name", "kind", "count", "total_us",
                                                                        "mean_us", "share"], limit=12,
                                     title="Top kernels and copies"))
            parts.append(_table_html(rep.tables["launch_stats"], title="Kernel launches"))
            if len(rep.tables["memcpy_bandwidth"]):
                parts.append(_table_html(rep.tables["memcpy_bandwidth"], title="Copies and memsets"))
        if len(rep.tables["counters"]):
            parts.append(_table_html(rep.tables["counters"], limit=30, title="Counter tracks"))
        if len(rep.tables["profiler_steps"]):
            parts.append(_table_html(rep.tables["profiler_steps"], title="Profiler steps"))
        for table, columns, title in range_time_views(rep.trace, rep.tables):
            # the description speaks of GPU time; a CPU-only view has its title alone
            parts.append(_table_html(table, columns, limit=10, title=title, description=None if columns is None else ""))
    if not result.traces:
        parts.append(_nodata("kernel_breakdown", "The kernel breakdown needs a Kineto trace: pass trace files."))
    c = result.collective_tables
    if c and len(c["collectives"]):
        parts.append(f"<h2>Collectives across {len(result.traces)} ranks</h2>")
        parts.append(_table_html(c["collectives"], limit=60, title="Collectives per rank"))
        parts.append(_table_html(c["communication_overlap"], limit=len(c["communication_overlap"]),
                                 title="Communication hidden behind computation"))
        parts.append(_table_html(c["stragglers"], limit=len(c["stragglers"]), title="Stragglers"))
    parts.append("</body></html>")
    return "".join(parts)


def _kernel_plot(result: AnalysisResult, rep: TraceReport, index: int) -> str:
    return plot_kernel_breakdown(rep, index)


def _safe(fn: Callable[[AnalysisResult], str], result: AnalysisResult, name: str) -> str:
    """A plot, or a note with the error when drawing it failed (one bad plot must not lose the report)."""
    try:
        return fn(result)
    except Exception as exc:  # reported in the page: one bad plot must not lose the report
        return _nodata(name, f"This plot could not be drawn: {type(exc).__name__}: {exc}")


def write_html(result: AnalysisResult, out_path: str | os.PathLike[str], title: str = "zoomer-serve analysis") -> Path:
    """Write the HTML report to ``out_path``; returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    out = Path(out_path)
    out.write_text(render_html(result, title), encoding="utf-8")
    return out


def render_diff_html(report: Any, title: str = "zoomer-serve diff") -> str:
    """A :class:`~zoomer_serve.analysis.diff.DiffReport` as one self-contained HTML page (no plots): the
    figures, the kernels, CPU ops and phases that changed, and the findings."""
    t = report.tables
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f'<div class="meta">before: {html.escape(report.before)}; after: {html.escape(report.after)}; '
             f'generated {time.strftime("%Y-%m-%d %H:%M:%S")}</div>']
    parts.append("<h2>Figures</h2>" + _table_html(t["figures"], limit=len(t["figures"]), title="Figures"))
    changed = t["kernels"].take(t["kernels"]["status"] != "same")
    parts.append("<h2>Kernels and copies</h2>" + _table_html(
        changed, ["name", "kind", "status", "count_before", "count_after", "time_before_us", "time_after_us",
                  "delta_us", "change", "launches_before", "launches_after"], limit=40,
        title="Kernels and copies that appeared, vanished or changed most"))
    ops = t["cpu_ops"].take(t["cpu_ops"]["status"] != "same")
    parts.append("<h2>CPU ops</h2>" + _table_html(ops, ["name", "status", "count_before", "count_after",
                                                        "time_before_us", "time_after_us", "delta_us", "change"],
                                                  limit=40, title="CPU ops that appeared, vanished or changed most"))
    parts.append("<h2>Phases</h2>" + _table_html(t["phases"], limit=40, title="Phases"))
    parts.append("<h2>Findings</h2>" + _table_html(t["findings"], limit=len(t["findings"]), title="Findings"))
    parts.append("</body></html>")
    return "".join(parts)


def write_diff_html(report: Any, out_path: str | os.PathLike[str]) -> Path:
    """Write :func:`render_diff_html` to ``out_path``; returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    out = Path(out_path)
    out.write_text(render_diff_html(report), encoding="utf-8")
    return out
