"""Terminal output with rich: findings and the analysis tables. Every value from a trace or store is printed
as plain text (kernel and annotation names contain brackets that rich would read as markup)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table as RichTable
from rich.text import Text

from zoomer_serve.analysis.findings import Finding
from zoomer_serve.analysis.table import Table

NO_GPU_WORK = ("This trace holds no GPU work (no kernels, copies or memsets): it was recorded without CUDA "
               "activities or on a machine without a GPU, so it has no GPU tables; its CPU side is in the "
               "findings, the annotation and request tables and the merged timeline.")


def has_gpu_work(trace: Any) -> bool:
    """Whether a :class:`~zoomer_serve.analysis.kineto.KinetoTrace` ran anything on a GPU (kernels, copies or
    memsets)."""
    return len(trace.kernels) + len(trace.memops) > 0


def range_time_views(trace: Any, tables: dict[str, Table]) -> list[tuple[Table, list[str] | None, str]]:
    """The per-annotation and per-request tables as shown, (table, columns or None for all, title), those with
    rows only: with their GPU columns when ``trace`` ran GPU work; without it, by CPU time alone (its GPU
    columns could only be zero)."""
    gpu = has_gpu_work(trace)
    out: list[tuple[Table, list[str] | None, str]] = []
    for key, what, cpu_columns in (("annotation_gpu_time", "annotation", ["name", "count", "cpu_time_us"]),
                                   ("request_gpu_time", "request",
                                    ["trace_id", "span_id", "start_us", "cpu_time_us", "pid", "tid"])):
        table = tables[key]
        if len(table):
            out.append((table, None, f"GPU time per {what}") if gpu else (table, cpu_columns, f"CPU time per {what}"))
    return out


SEVERITY_STYLE = {"high": "bold red", "medium": "bold yellow", "low": "cyan", "info": "dim"}
_NAME_WIDTH = 80


_CONTROL_PICTURES = {c: 0x2400 + c for c in range(0x20)} | {0x7F: 0x2421}


def printable(text: str) -> str:
    """``text`` with control characters (which a trace may carry in names) shown as their Unicode control
    pictures (U+2400 block), so that they cannot move the cursor or restyle a terminal."""
    return text.translate(_CONTROL_PICTURES)


def _short(text: str, width: int = _NAME_WIDTH) -> str:
    text = printable(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _split_top(text: str) -> tuple[str, str, str]:
    """(name before the first top-level '<', its template arguments, the rest after the matching '>')."""
    i = text.find("<")
    if i < 0:
        return text, "", ""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "<":
            depth += 1
        elif text[j] == ">":
            depth -= 1
            if depth == 0:
                return text[:i], text[i + 1:j], text[j + 1:]
    return text[:i], text[i + 1:], ""


def _first_type_argument(args: str) -> str:
    depth = 0
    start = 0
    for j, ch in enumerate(args + ","):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            arg = args[start:j].strip()
            start = j + 1
            base = _split_top(arg)[0].split("(")[0].strip()
            if base and not base.replace(".", "").isdigit() and base not in ("true", "false"):
                return base.split("::")[-1]
    return ""


def short_kernel_name(name: str, width: int = 60) -> str:
    """A readable kernel name: no ``void``, namespaces or parameters; the first type argument of a template
    is kept (``vectorized_elementwise_kernel<CUDAFunctor_add>``). Used for labels; tables keep full names."""
    name = printable(name)
    if name.startswith(("Memcpy", "Memset")):
        return name
    s = name[5:] if name.startswith("void ") else name
    s = s.replace("(anonymous namespace)::", "")
    base, args, rest = _split_top(s)
    base = base.split("(")[0].strip().split("::")[-1] or s
    if not args and not rest:
        text = s.split("(")[0].strip() or name
    else:
        arg = _first_type_argument(args) if args else ""
        text = f"{base}<{arg}>" if arg else base
    return text if len(text) <= width else text[: width - 1] + "…"


def fmt_value(value: Any, unit: str = "") -> str:
    """A number for humans: us / ms / bytes / ratio get their unit; NaN and None print as '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if unit == "ratio":
            return f"{value:.1%}"
        if unit == "x":
            return f"{value:,.1f}x"
        if unit == "us":
            if abs(value) >= 1e6:
                return f"{value / 1e6:,.2f} s"
            if abs(value) >= 1e3:
                return f"{value / 1e3:,.2f} ms"
            return f"{value:,.1f} us"
        if unit == "ms":
            return f"{value:,.2f} ms"
        if unit == "GB/s":
            return f"{value:,.2f} GB/s"
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and unit == "bytes":
        return _bytes(value)
    return _short(str(value))


_TIME_SCALES = (("s", 1e6), ("ms", 1e3), ("us", 1.0))
_BYTE_SCALES = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_SUFFIXES = {"us": "_us", "ms": "_ms", "bytes": "_bytes", "GB/s": "_gbps", "ratio": "_share", "%": "_pct"}


def column_format(table: Table, column: str) -> tuple[str, Callable[[Any], str]]:
    """The header and the cell formatter of a table column, with one unit for the whole column: times in
    the largest of s / ms / us that fits every cell (``window_us`` of 2.5e6 us: "window (s)", cells
    "2.50"), byte counts likewise in GiB / MiB / KiB / B, ratios as percentages, GB/s as they are."""
    unit = table.units.get(column, "")
    values = table[column]
    base = column[: -len(_SUFFIXES[unit])] if unit in _SUFFIXES and column.endswith(_SUFFIXES[unit]) else column
    numeric = values.dtype.kind in "iuf" and len(values) > 0
    finite = np.abs(values[np.isfinite(values)]) if numeric else np.empty(0)
    top = float(finite.max()) if len(finite) else 0.0
    if unit in ("us", "bytes") and numeric:
        scales = _TIME_SCALES if unit == "us" else _BYTE_SCALES
        name, div = next(((n, d) for n, d in scales if top >= d), scales[-1])
        digits = 0 if name == "B" else 2 if top / div < 1e4 else 0
        return f"{base} ({name})", lambda v: _number(v, div, digits)
    if unit == "ms" and numeric:
        return f"{base} (ms)", lambda v: _number(v, 1.0, 2)
    if unit == "ratio":
        return f"{base} (%)", lambda v: _number(v, 0.01, 1)
    if unit in ("GB/s", "%") and numeric:
        return f"{base} ({unit})", lambda v: _number(v, 1.0, 2)
    return column, lambda v: fmt_value(v, unit)


def _number(value: Any, div: float, digits: int) -> str:
    if value is None or isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        return "-" if not isinstance(value, bool) else ("yes" if value else "no")
    return f"{value / div:,.{digits}f}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def unit_of(key: str) -> str:
    """The unit a finding's evidence / item key implies by its suffix (see :class:`Finding`)."""
    if key.endswith("_us"):
        return "us"
    if key.endswith("_ms"):
        return "ms"
    if key.endswith("_share"):
        return "ratio"
    if key.endswith("_bytes") or key == "bytes":
        return "bytes"
    return ""


def fmt_item(key: str, value: Any) -> str:
    """One evidence or item value for display (kernel names shortened)."""
    if key in ("kernel", "next_op", "name") and isinstance(value, str):
        return short_kernel_name(value)
    return fmt_value(value, unit_of(key))


def _evidence_text(evidence: dict[str, Any], limit: int = 8) -> str:
    parts = []
    for key, value in evidence.items():
        if isinstance(value, (dict, list)):
            continue
        parts.append(f"{key}={fmt_item(key, value)}")
        if len(parts) >= limit:
            break
    return ", ".join(parts)


def finding_panel(finding: Finding, items: int = 3) -> Panel:
    """One finding as a rich panel: severity, id, scope, summary, evidence, top items, recommendation."""
    body: list[Any] = [Text(finding.summary)]
    ev = _evidence_text(finding.evidence)
    if ev:
        body.append(Text("evidence: " + ev, style="dim"))
    for item in finding.items[:items]:
        body.append(Text("  • " + ", ".join(f"{k}={fmt_item(k, v)}" for k, v in item.items()), style="dim"))
    if len(finding.items) > items:
        body.append(Text(f"  … {len(finding.items) - items} more (see --json)", style="dim"))
    body.append(Text("→ " + finding.recommendation, style="green"))
    title = Text.assemble((finding.severity.upper(), SEVERITY_STYLE.get(finding.severity, "")), "  ",
                          (finding.id, "bold"), (f"  {finding.scope}" if finding.scope else "", ""))
    return Panel(Group(*body), title=title, title_align="left", subtitle=Text(_short(finding.source, 60)),
                 subtitle_align="right")


def findings_table(findings: Sequence[Finding]) -> RichTable:
    """The findings as one table (severity, id, scope, summary, evidence, recommendation, source): what
    :func:`render_findings` prints for the markdown, csv and json formats."""
    out = RichTable(title="Findings", title_justify="left")
    for name in ("severity", "id", "scope", "summary", "evidence", "recommendation", "source"):
        out.add_column(name)
    for f in findings:
        out.add_row(f.severity, f.id, Text(f.scope or ""), Text(f.summary), Text(_evidence_text(f.evidence)),
                    Text(f.recommendation), Text(f.source))
    return out


def render_findings(findings: Sequence[Finding], console: Any = None, items: int = 3) -> None:
    """Print findings (in the given order) to ``console`` (a new stdout console when None; a
    :class:`~zoomer_serve.cli_output.TableOutput` in the markdown, csv or json format gets them as one table,
    :func:`findings_table`); a line saying so when there are none."""
    console = console or Console()
    if not findings:
        console.print(Text("No findings: none of the detectors fired.", style="green"))
        return
    if getattr(console, "format", "table") != "table":
        console.print(findings_table(findings))
        return
    counts = {s: sum(1 for f in findings if f.severity == s) for s in SEVERITY_STYLE}
    console.print(Text.assemble(("Findings: ", "bold"), ", ".join(f"{n} {s}" for s, n in counts.items() if n)))
    for f in findings:
        console.print(finding_panel(f, items))


def rich_table(table: Table, columns: Sequence[str] | None = None, limit: int = 15, title: str | None = None) -> RichTable:
    """A :class:`~zoomer_serve.analysis.table.Table` as a rich table (first ``limit`` rows), one unit per
    column (:func:`column_format`)."""
    cols = list(columns or table.column_names)
    out = RichTable(title=Text(title or table.name, style="bold"), title_justify="left")
    formats = {c: column_format(table, c) for c in cols}
    for c in cols:
        numeric = table[c].dtype.kind in "iuf"
        out.add_column(Text(formats[c][0]), justify="right" if numeric else "left", overflow="fold")
    for row in table.rows(limit):
        out.add_row(*[Text(short_kernel_name(row[c]) if c in ("name", "next_op") and isinstance(row[c], str)
                           else formats[c][1](row[c])) for c in cols])
    if len(table) > limit:
        out.caption = f"{len(table) - limit} more rows"
    return out
