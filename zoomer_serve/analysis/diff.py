"""Trace diff: ``zoomer-serve analyze --diff BEFORE AFTER``. Each side is a Kineto trace file, a store, or a
time window of a store (``STORE@FROM..TO``, times as ISO 8601 (UTC unless an offset is given) or Unix
seconds). The result holds, side by side with deltas:

- ``figures``: GPU window, busy and idle time (host wait, kernel wait, other), computation, communication,
  memory time, kernels and their time, copies, launch calls and their CPU time, synchronising calls and the
  time they blocked, CPU ops, profiler steps (traces); requests, error share and latency percentiles per
  service and method (stores: ``<service> <method> p50``);
- ``kernels`` and ``cpu_ops``: per name, count, time and (kernels) launches before and after, with a status:
  appeared, vanished or changed (largest change of time first);
- ``phases``: per request phase (store: ``zoomer.phase`` spans) or annotation (trace: ``record_function``
  ranges), instances and mean time before and after;
- ``findings``: every finding id and scope, with its severity before and after and whether it appeared,
  went away or stayed.

Relative changes are (after - before) / before; NaN when there was nothing before.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from zoomer_serve.analysis.api import AnalysisResult, analyze
from zoomer_serve.analysis.conventions import Conventions
from zoomer_serve.analysis.table import Table

_WINDOW = re.compile(r"^(?P<path>.+?)@(?P<start>.*?)\.\.(?P<end>.*)$")
US = "us"


@dataclass(frozen=True)
class Side:
    """One side of a diff: a trace file or a store (``store``), with an optional window of Unix ns
    ``[start_ns, end_ns)``; ``label`` as given on the command line."""

    label: str
    path: Path
    store: bool
    start_ns: int | None = None
    end_ns: int | None = None


_LATEST_NS = 2**63 - 1  # the last time an int64 of Unix ns holds (2262)


def _time_ns(text: str, what: str) -> int | None:
    """Unix ns of ``text`` (ISO 8601, UTC unless it says; or Unix seconds); None when empty.

    Raises:
        ValueError: neither form, or a time outside 1970..2262 (the message names ``what``).
    """
    text = text.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            t = dt.datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{what}: {text!r} is neither ISO 8601 time nor Unix seconds") from None
        if t.tzinfo is None:
            t = t.replace(tzinfo=dt.timezone.utc)
        seconds = t.timestamp()
    return checked_time_ns(seconds * 1e9, what, text)


def checked_time_ns(ns: float, what: str, text: str) -> int:
    """``ns`` as an int when it is a time from 1970 to 2262 (what Unix ns in an int64 hold).

    Raises:
        ValueError: it is not (NaN, infinite, before 1970 or after 2262), naming ``what`` and ``text``.
    """
    if not 0 <= ns <= _LATEST_NS:  # NaN fails too
        raise ValueError(f"{what}: {text!r} is not a time between 1970 and 2262")
    return int(ns)


def parse_side(spec: str) -> Side:
    """``PATH`` (a trace file, or a store: a ``.duckdb`` file) or ``STORE@FROM..TO`` (either end may be
    empty).

    Raises:
        ValueError: a window on a trace file, a window not written ``FROM..TO``, or a time that cannot be read.
    """
    m = _WINDOW.match(spec)
    path = Path(m.group("path") if m else spec)
    store = path.suffix == ".duckdb"
    if m is None:
        head, at, _ = spec.rpartition("@")
        if at and not path.exists() and Path(head).is_file():
            raise ValueError(f"{spec}: a store's time window is written STORE@FROM..TO (either end may be empty; "
                             "times as ISO 8601 or Unix seconds)")
        return Side(spec, path, store)
    if not store:
        raise ValueError(f"{spec}: a time window needs a store (a .duckdb file), not a trace file")
    start, end = _time_ns(m.group("start"), spec), _time_ns(m.group("end"), spec)
    if start is not None and end is not None and end <= start:
        raise ValueError(f"{spec}: the window ends before it starts")
    return Side(spec, path, store, start, end)


def load_side(side: Side, conventions: Conventions | None = None) -> AnalysisResult:
    """Analyse one side (its store window only, when given).

    Raises:
        FileNotFoundError / TraceFormatError / StoreAnalysisError: as :func:`analyze`.
    """
    if not side.path.is_file():
        raise FileNotFoundError(f"not found: {side.path}")
    if not side.store:
        return analyze([side.path], None, conventions)
    from zoomer_serve.analysis.findings import sort_findings
    from zoomer_serve.analysis.store import detect_store, load_store, request_percentiles

    data = _window(load_store(side.path), side.start_ns, side.end_ns)
    return AnalysisResult(store=data, store_tables={"request_percentiles": request_percentiles(data)},
                          findings=sort_findings(detect_store(data)))


def _window(data: Any, start_ns: int | None, end_ns: int | None) -> Any:
    """The store's data restricted to requests that started in ``[start_ns, end_ns)`` (and their phases,
    and memory / metric samples in the window); its requests are counted by their spans (``calls`` left empty: the
    cumulative ``rpc.server.call.duration`` points cannot tell the calls of a window)."""
    if start_ns is None and end_ns is None:
        return data
    lo = -(2**62) if start_ns is None else start_ns
    hi = 2**62 if end_ns is None else end_ns
    req = data.requests
    keep = (req["start_ns"] >= lo) & (req["start_ns"] < hi)
    new_index = np.full(len(req), -1, dtype=np.int64)
    new_index[keep] = np.arange(int(keep.sum()))
    ph = data.phases
    ph_keep = keep[ph["request"]] if len(ph) else np.zeros(0, dtype=bool)
    phases = ph.take(ph_keep)
    phases.columns["request"] = new_index[phases["request"]]
    mem, met = data.memory, data.gpu_metrics
    # the calls the rpc.server.call.duration metric counted cover the whole store, not the window
    return replace(data, requests=req.take(keep), phases=phases, calls={},
                   memory=mem.take((mem["time_ns"] >= lo) & (mem["time_ns"] < hi)) if len(mem) else mem,
                   gpu_metrics=met.take((met["time_ns"] >= lo) & (met["time_ns"] < hi)) if len(met) else met)


@dataclass
class DiffReport:
    """The diff of two sides: ``before`` / ``after`` labels, their analyses, and the tables (see the module
    docstring)."""

    before: str
    after: str
    before_result: AnalysisResult
    after_result: AnalysisResult
    tables: dict[str, Table] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: both labels and every row of every table."""
        return {"before": self.before, "after": self.after,
                "tables": {k: t.to_dict() for k, t in self.tables.items()}}


def diff_results(before: AnalysisResult, after: AnalysisResult, before_label: str = "before",
                 after_label: str = "after") -> DiffReport:
    """Compare two analyses (each of at most one trace and/or a store)."""
    rep = DiffReport(before_label, after_label, before, after)
    rep.tables["figures"] = _figures(before, after)
    rep.tables["kernels"] = _named(_kernel_stats(before), _kernel_stats(after), "kernels",
                                   "GPU kernels and copies per name: count, time and launches before and after")
    rep.tables["cpu_ops"] = _named(_op_stats(before), _op_stats(after), "cpu_ops",
                                   "CPU ops per name: count and time before and after")
    rep.tables["phases"] = _phases(before, after)
    rep.tables["findings"] = _findings(before, after)
    return rep


def diff(before: str | os.PathLike[str], after: str | os.PathLike[str],
         conventions: Conventions | None = None) -> DiffReport:
    """Load both sides (see :func:`parse_side`) and compare them.

    Raises:
        ValueError: a side cannot be parsed; FileNotFoundError / TraceFormatError / StoreAnalysisError: as
            :func:`analyze`.
    """
    a, b = parse_side(str(before)), parse_side(str(after))
    return diff_results(load_side(a, conventions), load_side(b, conventions), a.label, b.label)


# ---- figures ---------------------------------------------------------------------------------------------------


def _trace_figures(result: AnalysisResult) -> dict[str, tuple[float, str]]:
    from zoomer_serve.analysis.trace_detectors import SYNC_CALLS, api_name

    out: dict[str, tuple[float, str]] = {}
    if not result.traces:
        return out
    rep = result.traces[0]
    t, tables = rep.trace, rep.tables
    tb = tables["time_breakdown"]
    util = tables["gpu_utilization"]
    dev = util.take(util["stream"] == -1) if len(util) else util
    for name, col in (("GPU window", "window_us"), ("GPU busy", "busy_us"), ("GPU idle", "idle_us"),
                      ("computation", "computation_us"), ("communication", "communication_us"),
                      ("memory operations", "memory_us"),
                      ("communication overlapped by computation", "computation_communication_overlap_us")):
        out[name] = (float(tb[col].sum()) if len(tb) else 0.0, US)
    for name, col in (("idle: host wait", "host_wait_us"), ("idle: kernel wait", "kernel_wait_us"),
                      ("idle: other", "other_idle_us")):
        out[name] = (float(dev[col].sum()) if len(dev) else 0.0, US)
    window = out["GPU window"][0]
    out["idle share"] = (out["GPU idle"][0] / window if window > 0 else math.nan, "ratio")
    out["kernels"] = (float(len(t.kernels)), "")
    out["kernel time"] = (float(t.kernels["dur"].sum()), US)
    out["copies and memsets"] = (float(len(t.memops)), "")
    out["copy and memset time"] = (float(t.memops["dur"].sum()), US)
    out["copied bytes"] = (float(t.memops["bytes"].sum()), "bytes")
    out["CUDA runtime / driver calls"] = (float(len(t.runtime)), "")
    out["CPU time in CUDA calls"] = (float(t.runtime["dur"].sum()), US)
    base = np.array([api_name(str(n)) for n in t.runtime["name"]], dtype=object)
    sync = np.isin(base, np.array(sorted(SYNC_CALLS), dtype=object)) if len(base) else np.zeros(0, dtype=bool)
    out["synchronising calls"] = (float(sync.sum()), "")
    out["CPU blocked in synchronising calls"] = (float(t.runtime["dur"][sync].sum()), US)
    out["CPU ops"] = (float(len(t.cpu_ops)), "")
    steps = tables["profiler_steps"]
    out["profiler steps"] = (float(len(steps)), "")
    if len(steps):
        out["mean profiler step (CPU)"] = (float(steps["cpu_us"].mean()), US)
    return out


def _store_figures(result: AnalysisResult) -> dict[str, tuple[float, str]]:
    from zoomer_serve.analysis.store import (
        _scope,  # the findings' "service method" label
        request_totals,
    )

    out: dict[str, tuple[float, str]] = {}
    if result.store is None:
        return out
    pct = result.store_tables.get("request_percentiles")
    req = result.store.requests
    requests, errors = (request_totals(pct)[:2] if pct is not None  # the report's counts: metric, else spans
                        else (len(req), int(req["is_error"].sum())))
    out["requests"] = (float(requests), "")
    out["error share"] = (errors / requests if requests else math.nan, "ratio")
    if pct is not None:
        for row in pct.rows():
            for q in ("p50_ms", "p90_ms", "p99_ms"):
                if q in row:
                    out[f"{_scope(row['service'], row['method'])} {q[:3]}"] = (row[q], "ms")
    return out


def _figures(before: AnalysisResult, after: AnalysisResult) -> Table:
    b = {**_trace_figures(before), **_store_figures(before)}
    a = {**_trace_figures(after), **_store_figures(after)}
    rows = []
    for name in list(b) + [n for n in a if n not in b]:
        vb, unit = b.get(name, (math.nan, a.get(name, (0, ""))[1]))
        va = a.get(name, (math.nan, unit))[0]
        rows.append((name, unit, vb, va, va - vb, _rel(vb, va)))
    return Table.from_rows("figures", ("figure", "unit", "before", "after", "delta", "change"), rows,
                           units={"change": "ratio"},
                           description="figures of both sides with the change (units in the unit column)",
                           dtypes={"figure": object, "unit": object, "before": np.float64, "after": np.float64,
                                   "delta": np.float64, "change": np.float64})


def _rel(before: float, after: float) -> float:
    if before is None or after is None or not math.isfinite(before) or before == 0:
        return math.nan
    return (after - before) / abs(before)


# ---- per name ----------------------------------------------------------------------------------------------------


def _kernel_stats(result: AnalysisResult) -> dict[str, tuple[str, int, float, int]]:
    """name -> (kind, count, time us, launches found)."""
    if not result.traces:
        return {}
    from zoomer_serve.analysis.timeline import launch_index

    t = result.traces[0].trace
    kb = result.traces[0].tables["kernel_breakdown"]
    out: dict[str, list[Any]] = {}
    for name, kind, count, total in zip(kb["name"].tolist(), kb["kind"].tolist(), kb["count"].tolist(),
                                        kb["total_us"].tolist()):
        row = out.setdefault(name, [kind, 0, 0.0, 0])
        row[1] += count
        row[2] += total
    ops = t.gpu_ops()
    launched = launch_index(t, ops["correlation"]) >= 0
    for name, ok in zip(ops["name"].tolist(), launched.tolist()):
        if ok and name in out:
            out[name][3] += 1
    return {k: (v[0], v[1], v[2], v[3]) for k, v in out.items()}


def _op_stats(result: AnalysisResult) -> dict[str, tuple[str, int, float, int]]:
    if not result.traces:
        return {}
    ops = result.traces[0].trace.cpu_ops
    out: dict[str, list[Any]] = {}
    for name, dur in zip(ops["name"].tolist(), ops["dur"].tolist()):
        row = out.setdefault(name, ["cpu_op", 0, 0.0, 0])
        row[1] += 1
        row[2] += dur
    return {k: (v[0], v[1], v[2], v[3]) for k, v in out.items()}


def _named(before: dict[str, tuple[str, int, float, int]], after: dict[str, tuple[str, int, float, int]],
           name: str, description: str) -> Table:
    rows = []
    for key in set(before) | set(after):
        kb, cb, tb, lb = before.get(key, ("", 0, 0.0, 0))
        ka, ca, ta, la = after.get(key, ("", 0, 0.0, 0))
        status = "appeared" if key not in before else "vanished" if key not in after else \
            "same" if (cb, round(tb, 3), lb) == (ca, round(ta, 3), la) else "changed"
        rows.append((key, kb or ka, status, cb, ca, tb, ta, ta - tb, _rel(tb, ta), lb, la))
    order = {"appeared": 0, "vanished": 1, "changed": 2, "same": 3}
    rows.sort(key=lambda r: (order[r[2]], -abs(r[7]), r[0]))
    return Table.from_rows(
        name, ("name", "kind", "status", "count_before", "count_after", "time_before_us", "time_after_us",
               "delta_us", "change", "launches_before", "launches_after"), rows,
        units={"time_before_us": US, "time_after_us": US, "delta_us": US, "change": "ratio"},
        description=description + " (appeared, vanished, then changed most first)",
        dtypes={"name": object, "kind": object, "status": object, "count_before": np.int64,
                "count_after": np.int64, "time_before_us": np.float64, "time_after_us": np.float64,
                "delta_us": np.float64, "change": np.float64, "launches_before": np.int64,
                "launches_after": np.int64})


def _phase_stats(result: AnalysisResult) -> dict[str, tuple[str, int, float]]:
    """phase -> (source, instances, mean time in ms) from the store's phases and the trace's annotations."""
    out: dict[str, tuple[str, int, float]] = {}
    if result.store is not None and len(result.store.phases):
        ph = result.store.phases
        for name in sorted(set(ph["phase"].tolist())):
            d = ph["duration_ms"][ph["phase"] == name]
            out[name] = ("request phase", int(len(d)), float(d.mean()))
    if result.traces:
        ann = result.traces[0].tables["annotation_gpu_time"]
        for row in ann.rows():
            if row["name"] not in out and row["count"]:
                out[row["name"]] = ("annotation", int(row["count"]), row["cpu_time_us"] / row["count"] / 1e3)
    return out


def _phases(before: AnalysisResult, after: AnalysisResult) -> Table:
    b, a = _phase_stats(before), _phase_stats(after)
    rows = []
    for key in list(b) + [k for k in a if k not in b]:
        sb, nb, mb = b.get(key, ("", 0, math.nan))
        sa, na, ma = a.get(key, ("", 0, math.nan))
        rows.append((key, sb or sa, nb, na, mb, ma, ma - mb, _rel(mb, ma)))
    rows.sort(key=lambda r: -abs(r[6]) if math.isfinite(r[6]) else 0.0)
    return Table.from_rows(
        "phases", ("phase", "source", "count_before", "count_after", "mean_before_ms", "mean_after_ms",
                   "delta_ms", "change"), rows,
        units={"mean_before_ms": "ms", "mean_after_ms": "ms", "delta_ms": "ms", "change": "ratio"},
        description="mean time per request phase (store) or per annotation instance (trace)",
        dtypes={"phase": object, "source": object, "count_before": np.int64, "count_after": np.int64,
                "mean_before_ms": np.float64, "mean_after_ms": np.float64, "delta_ms": np.float64,
                "change": np.float64})


def _findings(before: AnalysisResult, after: AnalysisResult) -> Table:
    b = {(f.id, f.scope): f for f in before.findings}
    a = {(f.id, f.scope): f for f in after.findings}
    rows = []
    for key in list(b) + [k for k in a if k not in b]:
        fb, fa = b.get(key), a.get(key)
        status = "appeared" if fb is None else "went away" if fa is None else "stayed"
        shown = fa if fa is not None else fb
        rows.append((key[0], key[1], status, fb.severity if fb else "", fa.severity if fa else "",
                     shown.title if shown is not None else ""))
    order = {"appeared": 0, "went away": 1, "stayed": 2}
    rows.sort(key=lambda r: (order[r[2]], r[0], r[1]))
    return Table.from_rows(
        "findings", ("id", "scope", "status", "severity_before", "severity_after", "title"), rows,
        description="findings that appeared, went away or stayed",
        dtypes={c: object for c in ("id", "scope", "status", "severity_before", "severity_after", "title")})
