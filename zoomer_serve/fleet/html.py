"""The fleet report as one self-contained HTML page: heat maps (replica x time: p99 latency and GPU
utilization; kernel x replica: time per request), the ranked outlier list with links down to each replica's
own trace report and merged timeline, the findings, the replica table and the artifacts that failed.

Plots are matplotlib images embedded as base64 PNG (as in the single-trace report,
:mod:`zoomer_serve.analysis.html`), each an ``<img>`` with a ``data-plot`` naming it; a heat map without data
is a note saying what it needs. Links are relative to the report (the drill-down files sit beside it) or the
artifacts' own URLs.
"""

from __future__ import annotations

import html
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from zoomer_serve.analysis.html import _CSS, _finding_html, _img, _nodata, _plt
from zoomer_serve.fleet.model import FleetReport
from zoomer_serve.fleet.spans import HeatMap

HEATMAPS = ("latency_p99", "gpu_utilization", "kernel_time")
"""The ``data-plot`` names of the heat maps."""
MAX_HEATMAP_ROWS = 400
"""Replicas drawn per heat map: the outliers first, then the others in order (all of them are in --json)."""
_EXTRA_CSS = ".links a{margin-right:8px} td.bad{color:#c62828;font-weight:bold}"


def _order(hm: HeatMap, first: list[str], axis_rows: bool) -> list[int]:
    labels = hm.rows if axis_rows else hm.columns
    rank = {name: i for i, name in enumerate(first)}
    idx = sorted(range(len(labels)), key=lambda i: (rank.get(labels[i], len(rank)), i))
    return idx[:MAX_HEATMAP_ROWS]


def plot_replica_time(hm: HeatMap | None, first: list[str], why: str) -> str:
    """A replica x time heat map (outlier replicas on top, labelled)."""
    name = hm.name if hm is not None else "heatmap"
    if hm is None or not hm.rows:
        return _nodata(name, why)
    plt = _plt()
    order = _order(hm, first, True)
    data = np.array([[np.nan if v is None else v for v in hm.values[i]] for i in order], dtype=float)
    scale = 100.0 if hm.unit == "ratio" else 1.0
    fig, ax = plt.subplots(figsize=(11, min(2.5 + 0.12 * len(order), 14)))
    image = ax.imshow(data * scale, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="%" if hm.unit == "ratio" else hm.unit)
    flagged = set(first)
    labelled = [(pos, hm.rows[i]) for pos, i in enumerate(order) if hm.rows[i] in flagged or len(order) <= 40]
    ax.set_yticks([p for p, _ in labelled], [f"{'! ' if n in flagged else ''}{n}" for _, n in labelled], fontsize=7)
    step = max(1, len(hm.columns) // 8)
    ax.set_xticks(range(0, len(hm.columns), step), [hm.columns[i][11:16] for i in range(0, len(hm.columns), step)],
                  fontsize=8)
    ax.set_xlabel(f"time (UTC), from {hm.columns[0] if hm.columns else ''}")
    ax.set_ylabel(f"replicas ({len(order)} of {len(hm.rows)}; outliers first, marked !)")
    ax.set_title(hm.title, fontsize=11)
    return _img(hm.name, fig, hm.title)


def plot_kernel_replica(hm: HeatMap | None, first: list[str]) -> str:
    """Kernel x replica heat map: each kernel's time per request relative to its median over the replica's peer
    group (log2 colour scale: white = the median, red = slower, blue = faster; grey = the replica does not run
    it); replicas by peer group, outliers first within each."""
    if hm is None or not hm.rows or not hm.columns:
        return _nodata("kernel_time", "The kernel heat map needs Kineto trace artifacts with kernels.")
    plt = _plt()
    rank = {name: i for i, name in enumerate(first)}
    cols = sorted(range(len(hm.columns)), key=lambda j: (hm.groups[j], rank.get(hm.columns[j], len(rank)), j))
    cols = cols[:MAX_HEATMAP_ROWS]
    data = np.array([[np.nan if row[j] is None else row[j] for j in cols] for row in hm.values], dtype=float)
    groups = np.array([hm.groups[j] for j in cols], dtype=object)
    rel = np.full(data.shape, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a kernel no replica of a group runs: all-NaN median
        for g in dict.fromkeys(groups.tolist()):
            sel = groups == g
            part = np.where(data[:, sel] > 0, data[:, sel], np.nan)
            rel[:, sel] = np.log2(part / np.nanmedian(part, axis=1, keepdims=True))
    fig, ax = plt.subplots(figsize=(min(4 + 0.08 * len(cols), 16), 2.5 + 0.25 * len(hm.rows)))
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#dddddd")
    image = ax.imshow(np.ma.masked_invalid(rel), aspect="auto", interpolation="nearest", cmap=cmap, vmin=-1.5, vmax=1.5)
    fig.colorbar(image, ax=ax, label="log2(time per request / kernel's median)")
    from zoomer_serve.analysis.render import short_kernel_name

    ax.set_yticks(range(len(hm.rows)), [short_kernel_name(n, 60) for n in hm.rows], fontsize=7)
    flagged = set(first)
    labelled = [(p, hm.columns[j]) for p, j in enumerate(cols) if hm.columns[j] in flagged or len(cols) <= 40]
    ax.set_xticks([p for p, _ in labelled], [f"{'! ' if n in flagged else ''}{n}" for _, n in labelled], fontsize=7,
                  rotation=90)
    bounds = [p for p in range(1, len(cols)) if groups[p] != groups[p - 1]]
    for p in bounds:
        ax.axvline(p - 0.5, color="black", linewidth=1)
    ax.set_xlabel(f"replicas ({len(cols)} of {len(hm.columns)}) by peer group ("
                  + " | ".join(dict.fromkeys(groups.tolist())) + "); outliers first, marked !")
    ax.set_title(hm.title + " (relative to the peer group's median)", fontsize=11)
    return _img("kernel_time", fig, hm.title)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        if unit == "ratio":
            return f"{value:.1%}"
        return f"{value:.4g}"
    return str(value)


def _link(href: str | None, text: str) -> str:
    return f'<a href="{html.escape(href)}">{html.escape(text)}</a>' if href else ""


def _links(report: FleetReport, instance: str) -> str:
    parts = []
    for entry in report.drilldown.get(instance, []):
        parts += [_link(entry.get("html"), "trace report"), _link(entry.get("timeline"), "timeline"),
                  _link(entry.get("trace_url"), "trace")]
        if entry.get("error"):
            parts.append(f'<span class="meta">{html.escape(entry["error"])}</span>')
    if not parts:
        rows = [r for r in report.replicas if r["instance"] == instance]
        sessions = next((f.evidence.get("sessions") for f in report.findings
                         if f.evidence.get("instance") == instance and f.evidence.get("sessions")), None) or []
        parts = [_link(url, f"trace {sid}") for sid, url in sessions[:3]] if rows else []
    return '<span class="links">' + "".join(parts) + "</span>"


def outliers_table(report: FleetReport) -> str:
    """The ranked outlier list."""
    if not report.outliers:
        return '<p class="meta" data-table="outliers">No replica stands out from its peers.</p>'
    head = ("<tr><th>rank</th><th>replica</th><th>service</th><th>GPU</th><th>metric</th><th>method</th>"
            "<th>value</th><th>peer median</th><th>ratio</th><th>robust z</th><th>peers</th><th>drill down</th></tr>")
    rows = []
    for o in report.outliers:
        rows.append(f"<tr><td class=\"num\">{o['rank']}</td><td>{html.escape(o['instance'])}</td>"
                    f"<td>{html.escape(o['service'])}</td><td>{html.escape(o['gpu_model'] or 'CPU')}</td>"
                    f"<td>{html.escape(o['label'])}</td><td>{html.escape(o['method'])}</td>"
                    f"<td class=\"num bad\">{_fmt(o['value'], o['unit'])}</td>"
                    f"<td class=\"num\">{_fmt(o['peer_median'], o['unit'])}</td><td class=\"num\">{o['ratio']:.2f}x</td>"
                    f"<td class=\"num\">{_fmt(o['z'])}</td><td class=\"num\">{o['peers']}</td>"
                    f"<td>{_links(report, o['instance'])}</td></tr>")
    return f'<div class="scroll"><table data-table="outliers">{head}{"".join(rows)}</table></div>'


def _rows_table(rows: list[dict[str, Any]], name: str, limit: int = 200) -> str:
    if not rows:
        return f'<p class="meta" data-table="{name}">none</p>'
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c), 'ratio' if c in ('gpu_busy_share', 'host_cpu', 'gpu_utilization') else ''))}</td>"
                                    for c in cols) + "</tr>" for r in rows[:limit])
    more = f'<div class="meta">{len(rows) - limit} more rows in report.json</div>' if len(rows) > limit else ""
    return f'<div class="scroll"><table data-table="{name}"><tr>{head}</tr>{body}</table></div>{more}'


def render_fleet_html(report: FleetReport, title: str = "zoomer-serve fleet report") -> str:
    """The report as one HTML string (see the module docstring)."""
    first = report.outlier_instances
    c = report.counts
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
             f"<style>{_CSS}{_EXTRA_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f'<div class="meta">{html.escape(report.source)}, run {html.escape(report.run_id)} on the '
             f'{html.escape(report.engine)} engine, generated {time.strftime("%Y-%m-%d %H:%M:%S")}: '
             f'{c.get("replicas", 0)} replicas in {c.get("peer_groups", 0)} peer groups, '
             f'{c.get("traces_analyzed", 0)} traces analysed, {c.get("traces_failed", 0)} failed, '
             f'{c.get("span_requests", 0)} requests in the span data.</div>',
             "<h2>Outliers</h2>", '<div class="meta">Replicas compared with their peers (same service and GPU '
             "model) by median and MAD; robust z = 0.6745 (x - median) / MAD.</div>", outliers_table(report),
             "<h2>Heat maps</h2>",
             plot_replica_time(report.heatmaps.get("latency_p99"), first,
                               "The latency heat map needs span data (collectors writing Parquet under this URL)."),
             plot_replica_time(report.heatmaps.get("gpu_utilization"), first,
                               "The GPU utilization heat map needs NVML metrics (hw.gpu.utilization) in the span data."),
             plot_kernel_replica(report.heatmaps.get("kernel_time"), first + [
                 f.evidence["instance"] for f in report.findings if f.id == "fleet.kernel-mix"]),
             "<h2>Findings</h2>"]
    parts.extend(_finding_html(f) for f in report.findings)
    if not report.findings:
        parts.append('<p class="meta">No fleet finding.</p>')
    parts += ["<h2>Replicas</h2>", _rows_table(report.replicas, "replicas"),
              "<h2>Artifacts that could not be analysed</h2>", _rows_table(report.failed, "failed"),
              "</body></html>"]
    return "".join(parts)


def write_fleet_html(report: FleetReport, out_path: str | os.PathLike[str]) -> Path:
    """Write :func:`render_fleet_html` to ``out_path``. Raises OSError."""
    out = Path(out_path)
    out.write_text(render_fleet_html(report), encoding="utf-8")
    return out
