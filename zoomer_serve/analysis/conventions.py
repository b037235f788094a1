"""Which events the figures count: our definitions, or Holistic Trace Analysis' (HTA), and which profiler
steps (``zoomer-serve analyze --conventions zoomer|hta --steps all|complete``).

Our figures and HTA's (``traceinsight`` 0.6, the successor of ``HolisticTraceAnalysis`` 0.5) differ by
definition, not by arithmetic. On real traces the differences reach 12 to 59 %:

==========================  ====================================  ============================================
question                    ours (default, ``zoomer``)            HTA (``hta``)
==========================  ====================================  ============================================
which profiler steps        all of the trace (``--steps all``)    all but the last (its
                                                                  ``include_last_profiler_step=False``), when
                                                                  the trace has at least two ``ProfilerStep``
                                                                  names (``--steps complete``)
GPU work whose launch call  counted: the GPU did it (work         dropped (when the trace has at least two
is not in the trace         launched before recording started,    steps), as is every CPU event after the last
                            or from a thread Kineto missed)       step
CUPTI sync records on a     the host waiting: not GPU work        GPU work: in the window, busy time and
stream ("Stream Sync",                                            temporal breakdown (not in the idle
"Stream Wait Event", ...)                                         breakdown per stream)
sub-microsecond times       kept as written                       rounded to whole microseconds when the file
                                                                  has any (start up, end down: kernels shorter
                                                                  by up to 1 us, sub-us kernels negative)
==========================  ====================================  ============================================

``--steps complete`` with our conventions drops the last profiler step the same way (CPU events from its
start on and the GPU work they launched) but keeps GPU work without a launch call that started before it.
:func:`profiler_steps` gives figures per profiler step in either case.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from zoomer_serve.analysis.kineto import KinetoTrace
from zoomer_serve.analysis.table import Table

STEPS = ("all", "complete")
CONVENTIONS = ("zoomer", "hta")
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)")
GPU_SYNC_NAMES = ("Event Sync", "Context Sync")
"""Sync records HTA treats as GPU kernels even without a stream."""


@dataclass(frozen=True)
class Conventions:
    """``name``: "zoomer" (ours) or "hta"; ``steps``: "all" or "complete" (see the module docstring).

    Raises:
        ValueError: an unknown name or steps value.
    """

    name: str = "zoomer"
    steps: str = "all"

    def __post_init__(self) -> None:
        if self.name not in CONVENTIONS:
            raise ValueError(f"conventions must be one of {CONVENTIONS}, got {self.name!r}")
        if self.steps not in STEPS:
            raise ValueError(f"steps must be one of {STEPS}, got {self.steps!r}")

    @property
    def hta(self) -> bool:
        return self.name == "hta"


def _step_rows(trace: KinetoTrace, cpu_only: bool) -> np.ndarray:
    a = trace.annotations
    names = a["name"]
    hit = np.array(["ProfilerStep" in str(n) for n in names], dtype=bool) if len(a) else np.zeros(0, dtype=bool)
    if cpu_only:
        hit &= ~a["on_gpu"]
    return np.flatnonzero(hit)


def apply_conventions(trace: KinetoTrace, conventions: Conventions) -> KinetoTrace:
    """A copy of ``trace`` whose tables hold what ``conventions`` count (the trace itself when nothing
    changes). Warnings say what was left out."""
    if conventions == Conventions():
        return trace
    t = trace
    notes: list[str] = []
    if conventions.hta:
        t = _round_like_hta(t, notes)
    rows = _step_rows(t, cpu_only=not conventions.hta)
    step_names = set(t.annotations["name"][rows].tolist())
    if conventions.hta and len(step_names) >= 2:
        a = t.annotations
        cutoff = float(a["ts"][rows].max()) if conventions.steps == "complete" else \
            float((a["ts"][rows] + a["dur"][rows]).max())
        t = _keep_before(t, cutoff, inclusive=conventions.steps == "all", keep_unlaunched=False, hta=True)
        notes.append(f"HTA conventions: {'the last profiler step, ' if conventions.steps == 'complete' else ''}"
                     f"CPU events after {'its start' if conventions.steps == 'complete' else 'the last step'} and "
                     f"GPU work not launched by the CPU events kept are left out")
    elif conventions.steps == "complete" and len(step_names) >= 2:
        cutoff = float(t.annotations["ts"][rows].max())
        t = _keep_before(t, cutoff, inclusive=False, keep_unlaunched=True, hta=False)
        notes.append("the last profiler step is left out (CPU events from its start on and the GPU work they "
                     "launched)")
    elif conventions.steps == "complete":
        notes.append(f"--steps complete: the trace has {len(step_names)} profiler step(s), fewer than two, so "
                     f"nothing is left out (as HTA does)")
    return dataclasses.replace(t, conventions=conventions.name, steps=conventions.steps,
                               syncs_are_gpu_work=conventions.hta, warnings=[*trace.warnings, *notes])


def _round_like_hta(trace: KinetoTrace, notes: list[str]) -> KinetoTrace:
    """HTA's rounding of traces with fractional times: start rounded up, end down, in the file's clock."""
    tables = ("kernels", "memops", "runtime", "syncs", "cpu_ops", "annotations")
    o = trace.origin_us
    # HTA rounds when its ts column is not integral (its dtype is float), whatever the durations are
    fractional = any(np.any((o + getattr(trace, n)["ts"]) % 1 != 0) for n in (*tables, "flows")
                     if len(getattr(trace, n)))
    if not fractional:
        return trace
    changes: dict[str, Any] = {}
    for n in tables:
        tb = getattr(trace, n)
        start = np.ceil(o + tb["ts"])
        end = np.floor(o + tb["ts"] + tb["dur"])
        changes[n] = Table(tb.name, {**tb.columns, "ts": start - o, "dur": end - start}, dict(tb.units),
                           tb.description)
    notes.append("HTA conventions: times rounded to whole microseconds (start up, end down) as HTA does for "
                 "traces with sub-microsecond times")
    return dataclasses.replace(trace, **changes)


def _keep_before(t: KinetoTrace, cutoff: float, inclusive: bool, keep_unlaunched: bool, hta: bool) -> KinetoTrace:
    """CPU-side events starting before ``cutoff`` (at or before when ``inclusive``), and GPU work launched
    by a kept runtime call (or, ``keep_unlaunched``, without a launch call in the trace and starting before
    the cutoff)."""

    def before(ts: np.ndarray) -> np.ndarray:
        return ts <= cutoff if inclusive else ts < cutoff

    s = t.syncs
    sync_gpu = ((s["stream"] >= 0) & (s["correlation"] >= 0)) | np.isin(s["kind"], GPU_SYNC_NAMES) if hta \
        else np.ones(len(s), dtype=bool)
    rt_keep = before(t.runtime["ts"])
    kept_corr = t.runtime["correlation"][rt_keep]
    if hta:  # HTA joins GPU work to every kept CPU event with its correlation id, sync records included
        kept_corr = np.concatenate([kept_corr, s["correlation"][~sync_gpu & before(s["ts"])]])
    all_corr = t.runtime["correlation"]

    def gpu_keep(tb: Table) -> np.ndarray:
        keep = np.isin(tb["correlation"], kept_corr) & (tb["correlation"] >= 0)
        if keep_unlaunched:
            keep |= ~np.isin(tb["correlation"], all_corr) & before(tb["ts"])
        return keep

    sync_keep = np.where(sync_gpu, gpu_keep(s), before(s["ts"])) if hta else gpu_keep(s)
    a = t.annotations
    ann_keep = before(a["ts"])
    return dataclasses.replace(
        t, kernels=t.kernels.take(gpu_keep(t.kernels)), memops=t.memops.take(gpu_keep(t.memops)),
        runtime=t.runtime.take(rt_keep), syncs=s.take(sync_keep), cpu_ops=t.cpu_ops.take(before(t.cpu_ops["ts"])),
        annotations=a.take(ann_keep))


def profiler_steps(trace: KinetoTrace) -> Table:
    """Figures per profiler step (the CPU-side ``ProfilerStep#N`` ranges).

    Columns: ``step`` (N), ``start_us`` (relative to the trace origin), ``cpu_us`` (the range's duration),
    ``gpu_ops`` (GPU operations whose launch call started inside the range on any thread), ``gpu_time_us``
    (their summed durations), ``gpu_busy_us`` (the union of their intervals), ``gpu_end_us`` (when the last
    of them ended, relative to the step's start), ``last`` (the trace's last step: HTA leaves it out by
    default because its GPU work may run past the end of the recording).
    """
    from zoomer_serve.analysis.timeline import launch_index
    from zoomer_serve.intervals import union_length

    a = trace.annotations
    rows = _step_rows(trace, cpu_only=True)
    ops = trace.gpu_ops()
    li = launch_index(trace, ops["correlation"])
    launch_ts = np.where(li >= 0, trace.runtime["ts"][np.maximum(li, 0)] if len(trace.runtime) else np.nan, np.nan)
    out = []
    for i in rows.tolist():
        m = PROFILER_STEP.match(str(a["name"][i]))
        start, dur = float(a["ts"][i]), float(a["dur"][i])
        with np.errstate(invalid="ignore"):
            sel = (launch_ts >= start) & (launch_ts <= start + dur)
        ts, d = ops["ts"][sel], ops["dur"][sel]
        out.append((int(m.group(1)) if m else -1, start, dur, int(sel.sum()), float(d.sum()),
                    union_length(ts, ts + d), float((ts + d).max() - start) if len(ts) else math.nan))
    out.sort(key=lambda r: r[1])
    last = max((r[1] for r in out), default=None)
    table_rows = [(*r, r[1] == last) for r in out]
    return Table.from_rows(
        "profiler_steps", ("step", "start_us", "cpu_us", "gpu_ops", "gpu_time_us", "gpu_busy_us", "gpu_end_us",
                           "last"), table_rows,
        units={"start_us": "us", "cpu_us": "us", "gpu_time_us": "us", "gpu_busy_us": "us", "gpu_end_us": "us"},
        description="figures per profiler step (GPU work by the step its launch call ran in)",
        dtypes={"step": np.int64, "start_us": np.float64, "cpu_us": np.float64, "gpu_ops": np.int64,
                "gpu_time_us": np.float64, "gpu_busy_us": np.float64, "gpu_end_us": np.float64, "last": bool})
