"""Terminal output with rich: findings and the analysis tables. Every value from a trace or store is printed
as plain text (kernel and annotation names contain brackets that rich would read as markup)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table as RichTable
from rich.text import Text

from zoomer_serve.analysis.findings import Finding
from zoomer_serve.analysis.table import Table

SEVERITY_STYLE = {"high": "bold red", "medium": "bold yellow", "low": "cyan", "info": "dim"}
_NAME_WIDTH = 80


def _short(text: str, width: int = _NAME_WIDTH) -> str:
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


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _evidence_text(evidence: dict[str, Any], limit: int = 8) -> str:
    parts = []
    for key, value in evidence.items():
        if isinstance(value, (dict, list)):
            continue
        unit = "us" if key.endswith("_us") else "ms" if key.endswith("_ms") else "ratio" if key.endswith("_share") \
            else "bytes" if key.endswith("_bytes") or key == "bytes" else ""
        parts.append(f"{key}={fmt_value(value, unit)}")
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
        body.append(Text("  • " + ", ".join(f"{k}={fmt_value(v)}" for k, v in item.items()), style="dim"))
    if len(finding.items) > items:
        body.append(Text(f"  … {len(finding.items) - items} more (see --json)", style="dim"))
    body.append(Text("→ " + finding.recommendation, style="green"))
    title = Text.assemble((finding.severity.upper(), SEVERITY_STYLE.get(finding.severity, "")), "  ",
                          (finding.id, "bold"), (f"  {finding.scope}" if finding.scope else "", ""))
    return Panel(Group(*body), title=title, title_align="left", subtitle=Text(_short(finding.source, 60)),
                 subtitle_align="right")


def render_findings(findings: Sequence[Finding], console: Console | None = None, items: int = 3) -> None:
    """Print findings (in the given order) to ``console`` (a new stdout console when None); a line saying
    so when there are none."""
    console = console or Console()
    if not findings:
        console.print(Text("No findings: none of the detectors fired.", style="green"))
        return
    counts = {s: sum(1 for f in findings if f.severity == s) for s in SEVERITY_STYLE}
    console.print(Text.assemble(("Findings: ", "bold"), ", ".join(f"{n} {s}" for s, n in counts.items() if n)))
    for f in findings:
        console.print(finding_panel(f, items))


def rich_table(table: Table, columns: Sequence[str] | None = None, limit: int = 15, title: str | None = None) -> RichTable:
    """A :class:`~zoomer_serve.analysis.table.Table` as a rich table (first ``limit`` rows)."""
    cols = list(columns or table.column_names)
    out = RichTable(title=Text(title or table.name, style="bold"), title_justify="left")
    for c in cols:
        unit = table.units.get(c, "")
        numeric = table[c].dtype.kind in "iuf"
        out.add_column(Text(c), justify="right" if numeric else "left", overflow="fold")
        del unit
    for row in table.rows(limit):
        out.add_row(*[Text(fmt_value(row[c], table.units.get(c, ""))) for c in cols])
    if len(table) > limit:
        out.caption = f"{len(table) - limit} more rows"
    return out
