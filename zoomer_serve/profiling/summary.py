"""Per-request kernel summary of a Kineto (torch.profiler) Chrome trace.

Input: the ``traceEvents`` list of a Chrome trace-event JSON file as torch.profiler writes it. Complete
events (``"ph": "X"``) carry ``ts`` and ``dur`` in µs; the categories used here are Kineto's:

- ``user_annotation``: ``record_function`` ranges on CPU threads; the request ranges
  (:mod:`zoomer_serve.profiling.labels`) are among them. A range still open when the profiler stopped
  (``args.finished`` false) is ignored.
- ``cpu_op``: ATen operators on CPU threads.
- ``cuda_runtime`` / ``cuda_driver``: CUDA API calls on CPU threads (kernel launches, memcpy calls ...),
  with ``args.correlation``.
- ``kernel`` / ``gpu_memcpy`` / ``gpu_memset``: GPU activities (``pid`` = device, ``tid`` = stream), with
  ``args.correlation`` (the CUDA API call that issued them) and, for copies and sets, ``args.bytes``.

Attribution: a CPU-thread event belongs to the innermost request range on the same ``(pid, tid)`` that
contains its start. A request may have ranges on several threads (its work in an executor thread has one
there, opened by its phases); all of them are its. A GPU activity belongs to the request of the CUDA API
call with the same correlation id; when that call was not found (Kineto could not name its thread), to the
request of the ``cpu_op`` whose ``External id`` the activity carries (Kineto links GPU activities to their
launching operator that way).
Kernels launched outside any request range (warm-up, other threads) stay unattributed; the share of kernel
time attributed is reported.

Batches (:mod:`zoomer_serve.batching`): a batch range (:func:`~zoomer_serve.profiling.labels.batch_label`) takes
what runs inside it like a request range does, and its figures then go to its members, divided by the weights
its marker ranges name (:mod:`zoomer_serve.profiling.batch_shares`); ``TraceSummary.batches`` counts them.
"""

from __future__ import annotations

import bisect
import gzip
import json
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import numpy as np

from zoomer_serve.intervals import union_length
from zoomer_serve.profiling.batch_shares import BatchMarks, share_batches
from zoomer_serve.profiling.labels import parse_batch_label, parse_member_label, parse_request_label

RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_MAX_NESTING_WALK = 16


@dataclass
class KernelStat:
    """One kernel name's launches: ``count`` and total GPU ``time_us`` (µs)."""

    name: str
    count: int = 0
    time_us: float = 0.0


@dataclass
class GpuTotals:
    """GPU work of one request or one whole trace. Times in µs, sizes in bytes.

    ``kernel_time_us``: sum of kernel durations (overlapping kernels on several streams add up);
    ``cuda_runtime_time_us`` / ``cuda_runtime_count``: CUDA runtime and driver API calls on the CPU
    (launch cost); ``memcpy_*`` / ``memset_*``: GPU copy and set activities and the bytes they moved.
    """

    kernel_count: int = 0
    kernel_time_us: float = 0.0
    cuda_runtime_count: int = 0
    cuda_runtime_time_us: float = 0.0
    memcpy_count: int = 0
    memcpy_time_us: float = 0.0
    memcpy_bytes: int = 0
    memset_count: int = 0
    memset_time_us: float = 0.0
    memset_bytes: int = 0
    kernels: dict[str, KernelStat] = field(default_factory=dict, repr=False)

    def add_gpu(self, event: Mapping[str, Any]) -> None:
        cat, dur = event["cat"], float(event.get("dur", 0.0))
        args = event.get("args") or {}
        if cat == "kernel":
            self.kernel_count += 1
            self.kernel_time_us += dur
            stat = self.kernels.get(event["name"])
            if stat is None:
                stat = self.kernels[event["name"]] = KernelStat(event["name"])
            stat.count += 1
            stat.time_us += dur
        elif cat == "gpu_memcpy":
            self.memcpy_count += 1
            self.memcpy_time_us += dur
            self.memcpy_bytes += int(args.get("bytes", 0))
        elif cat == "gpu_memset":
            self.memset_count += 1
            self.memset_time_us += dur
            self.memset_bytes += int(args.get("bytes", 0))

    def add_kernel_share(self, name: str, count: int, time_us: float) -> None:
        """Add ``count`` launches and ``time_us`` of kernel ``name`` to the per-name table (a batch's share;
        the totals are added by the caller)."""
        stat = self.kernels.get(name)
        if stat is None:
            stat = self.kernels[name] = KernelStat(name)
        stat.count += count
        stat.time_us += time_us

    def top_kernels(self, n: int) -> list[KernelStat]:
        """The ``n`` kernel names with the most total GPU time, most first."""
        return sorted(self.kernels.values(), key=lambda k: (-k.time_us, k.name))[:n]


@dataclass
class RequestProfile(GpuTotals):
    """One request's part of a trace: ``key`` (from the range name; ``(trace_id, span_id)`` for zoomer
    request ranges), ``start_us`` (its first range's start, trace time) and ``duration_us`` (the time its ranges
    cover, overlaps counted once: a request with ranges on two threads at once counts that time once), and
    ``cpu_op_count`` (ATen operators run inside its ranges on their threads)."""

    key: Hashable = None
    start_us: float = 0.0
    duration_us: float = 0.0
    cpu_op_count: int = 0


@dataclass
class TraceSummary:
    """What :func:`summarize_events` found. ``requests`` by key; ``totals``: all GPU activity of the trace;
    ``attributed``: the part of it that belongs to some request; ``event_count``: complete events
    (``ph`` X) in the trace; ``unfinished_requests``: request ranges still open at the end; ``batches``: batch
    ranges whose figures went to their members."""

    requests: dict[Hashable, RequestProfile]
    totals: GpuTotals
    attributed: GpuTotals
    event_count: int
    unfinished_requests: int = 0
    batches: int = 0

    @property
    def attributed_share(self) -> float | None:
        """Attributed kernel time / all kernel time (None when the trace has no kernel)."""
        if self.totals.kernel_time_us <= 0:
            return None
        return self.attributed.kernel_time_us / self.totals.kernel_time_us


KeyOf = Callable[[str], Hashable | None]


class _Ranges:
    """Request ranges of one CPU thread, sorted by start, for containment lookups."""

    def __init__(self) -> None:
        self.items: list[tuple[float, float, RequestProfile]] = []
        self.starts: list[float] = []

    def freeze(self) -> None:
        self.items.sort(key=lambda item: item[0])
        self.starts = [item[0] for item in self.items]

    def find(self, ts: float) -> RequestProfile | None:
        i = bisect.bisect_right(self.starts, ts) - 1
        for j in range(i, max(i - _MAX_NESTING_WALK, -1), -1):
            start, end, profile = self.items[j]
            if start <= ts <= end:
                return profile
        return None


def summarize_events(events: Iterable[Mapping[str, Any]], key_of: KeyOf = parse_request_label) -> TraceSummary:
    """Attribute the GPU work of a trace's events to request ranges (see the module docstring).

    ``key_of(name)`` returns a request key for a ``user_annotation`` name, None for other ranges (default:
    the zoomer request label). Two passes over the events; memory is linear in their number.
    """
    events = [e for e in events if e.get("ph") == "X"]
    ranges: dict[tuple[Any, Any], _Ranges] = {}
    requests: dict[Hashable, RequestProfile] = {}
    spans: dict[Hashable, list[tuple[float, float]]] = {}  # each request's ranges (start, end), µs
    batches: dict[int, RequestProfile] = {}  # batch span id -> what ran inside its ranges
    marks: dict[int, BatchMarks] = {}
    unfinished = 0
    for ev in events:
        if ev.get("cat") != "user_annotation":
            continue
        key = key_of(ev.get("name", ""))
        if key is None:
            _batch_range(ev, batches, marks, ranges)
            continue
        if (ev.get("args") or {}).get("finished") is False:
            unfinished += 1
            continue
        start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        profile = requests.get(key)
        if profile is None:  # a key seen twice (ranges on several threads): all count for it
            profile = requests[key] = RequestProfile(key=key, start_us=start)
        profile.duration_us += dur
        spans.setdefault(key, []).append((start, start + dur))
        ranges.setdefault((ev.get("pid"), ev.get("tid")), _Ranges()).items.append((start, start + dur, profile))
    for r in ranges.values():
        r.freeze()
    for key, intervals in spans.items():  # several ranges: the time they cover (overlaps once)
        if len(intervals) > 1:
            starts, ends = np.array([i[0] for i in intervals]), np.array([i[1] for i in intervals])
            requests[key].start_us, requests[key].duration_us = float(starts.min()), union_length(starts, ends)

    def enclosing(ev: Mapping[str, Any]) -> RequestProfile | None:
        thread = ranges.get((ev.get("pid"), ev.get("tid")))
        return thread.find(float(ev["ts"])) if thread is not None else None

    by_external_id: dict[Any, RequestProfile] = {}
    by_correlation: dict[Any, RequestProfile] = {}
    gpu_events: list[Mapping[str, Any]] = []
    for ev in events:
        cat = ev.get("cat")
        if cat == "cpu_op":
            owner = enclosing(ev)
            if owner is not None:
                owner.cpu_op_count += 1
                ext = (ev.get("args") or {}).get("External id")
                if ext is not None:
                    by_external_id[ext] = owner
        elif cat in RUNTIME_CATEGORIES:
            args = ev.get("args") or {}
            owner = enclosing(ev) or by_external_id.get(args.get("External id"))
            if owner is not None:
                owner.cuda_runtime_count += 1
                owner.cuda_runtime_time_us += float(ev.get("dur", 0.0))
                if args.get("correlation") is not None:
                    by_correlation[args["correlation"]] = owner
        elif cat in GPU_CATEGORIES:
            gpu_events.append(ev)

    totals, attributed = GpuTotals(), GpuTotals()
    for ev in gpu_events:
        totals.add_gpu(ev)
        args = ev.get("args") or {}
        owner = by_correlation.get(args.get("correlation"))
        if owner is None:
            owner = by_external_id.get(args.get("External id"))
        if owner is not None:
            owner.add_gpu(ev)
            attributed.add_gpu(ev)
    shared = share_batches(batches, marks, requests, lambda key, start: RequestProfile(key=key, start_us=start))
    return TraceSummary(requests, totals, attributed, len(events), unfinished, shared)


def _batch_range(ev: Mapping[str, Any], batches: dict[int, RequestProfile], marks: dict[int, BatchMarks],
                 ranges: dict[tuple[Any, Any], _Ranges]) -> None:
    """Register a finished batch range (as a range that takes what runs inside it) or a member marker."""
    name = ev.get("name", "")
    member = parse_member_label(name)
    if member is not None:
        marks.setdefault(member[0], BatchMarks()).members.append(member[1:])
        return
    ids = parse_batch_label(name)
    if ids is None or (ev.get("args") or {}).get("finished") is False:
        return
    start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
    profile = batches.get(ids[1])
    if profile is None:
        profile = batches[ids[1]] = RequestProfile(key=ids, start_us=start)
    profile.duration_us += dur
    ranges.setdefault((ev.get("pid"), ev.get("tid")), _Ranges()).items.append((start, start + dur, profile))


def summary_to_json(summary: TraceSummary, top_n: int) -> dict[str, Any]:
    """A JSON-ready form of ``summary`` for zoomer request keys (``(trace_id, span_id)``), keeping the ``top_n``
    kernels of each request and of the totals. :func:`summary_from_json` reads it back."""
    def totals(t: GpuTotals) -> dict[str, Any]:
        out = {f.name: getattr(t, f.name) for f in fields(GpuTotals) if f.name != "kernels"}
        out["kernels"] = [[k.name, k.count, k.time_us] for k in t.top_kernels(top_n)]
        return out

    requests = []
    for key, profile in summary.requests.items():
        trace_id, span_id = cast(tuple[int, int], key)
        entry = totals(profile)
        entry.update(key=[f"{trace_id:032x}", f"{span_id:016x}"], start_us=profile.start_us,
                     duration_us=profile.duration_us, cpu_op_count=profile.cpu_op_count)
        requests.append(entry)
    return {"requests": requests, "totals": totals(summary.totals), "attributed": totals(summary.attributed),
            "event_count": summary.event_count, "unfinished_requests": summary.unfinished_requests,
            "batches": summary.batches}


def summary_from_json(data: Mapping[str, Any]) -> TraceSummary:
    """The :class:`TraceSummary` written by :func:`summary_to_json` (kernel lists hold only the top ones)."""
    def fill(target: GpuTotals, entry: Mapping[str, Any]) -> GpuTotals:
        for f in fields(GpuTotals):
            if f.name != "kernels":
                setattr(target, f.name, entry[f.name])
        target.kernels = {name: KernelStat(name, count, time_us) for name, count, time_us in entry["kernels"]}
        return target

    requests: dict[Hashable, RequestProfile] = {}
    for entry in data["requests"]:
        key = (int(entry["key"][0], 16), int(entry["key"][1], 16))
        profile = RequestProfile(key=key, start_us=entry["start_us"], duration_us=entry["duration_us"],
                                 cpu_op_count=entry["cpu_op_count"])
        requests[key] = fill(profile, entry)  # type: ignore[assignment]
    return TraceSummary(requests, fill(GpuTotals(), data["totals"]), fill(GpuTotals(), data["attributed"]),
                        data["event_count"], data["unfinished_requests"], int(data.get("batches", 0)))


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a Chrome trace JSON file (gzip-compressed when the name ends in ``.gz``).

    Raises OSError (unreadable), ValueError (not JSON, or no ``traceEvents`` list)."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace: no traceEvents list")
    return data
