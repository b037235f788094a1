"""Timeline analyzers over a :class:`~zoomer_serve.analysis.kineto.KinetoTrace`: GPU busy / idle time,
idle gaps, kernel launches, copy bandwidth, and GPU time per annotation and per request.

Definitions (all times in microseconds):

- *GPU operations* are kernels, memcpys and memsets (CUPTI ``cuda_sync`` records are the host waiting,
  not the GPU working, and are not counted as busy).
- *Window* of a device or stream: from the start of its first GPU operation to the end of its last.
- *Busy*: the length of the union of its GPU operations' intervals; *idle* = window - busy.
- *Idle categories*, as Holistic Trace Analysis (HTA) defines them: a gap before GPU operation *k* is
  **host wait** when *k*'s launch call (the runtime call with the same correlation id) started after the
  previous operation ended (the CPU did not enqueue work in time), else **kernel wait** when the gap is
  shorter than ``kernel_wait_threshold_us`` (30 us, HTA's ``consecutive_kernel_delay``: back-to-back
  launch overhead), else **other** (e.g. waiting on another stream or an event). Per stream, a gap is the
  time from the previous operation's end to the next one's start, exactly as HTA computes it; per device,
  the gaps are those between the merged busy intervals of all its streams. A stream runs one operation at a
  time, so its operations never overlap in a real trace; where they do (duplicated events, which the reader
  warns about) a stream's gaps are also taken between merged intervals: no negative gap, and the three
  categories still add up to the idle time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from zoomer_serve.analysis.kineto import KinetoTrace
from zoomer_serve.analysis.labels import parse_request_label
from zoomer_serve.analysis.table import Table
from zoomer_serve.batching.shares import split_float, split_int
from zoomer_serve.intervals import merge_intervals, union_length
from zoomer_serve.profiling.labels import parse_batch_label, parse_member_label

KERNEL_WAIT_THRESHOLD_US = 30.0
SHORT_KERNEL_US = 10.0

US = "us"


def _lookup(keys_sorted: np.ndarray, values: np.ndarray, query: np.ndarray, missing: float) -> np.ndarray:
    """values[i] where keys_sorted[i] == query, else ``missing`` (keys_sorted ascending)."""
    if len(keys_sorted) == 0:
        return np.full(len(query), missing, dtype=np.float64)
    pos = np.searchsorted(keys_sorted, query)
    pos_c = np.minimum(pos, len(keys_sorted) - 1)
    hit = (pos < len(keys_sorted)) & (keys_sorted[pos_c] == query) & (query >= 0)
    return np.where(hit, values[pos_c], missing)


def launch_index(trace: KinetoTrace, correlation: np.ndarray) -> np.ndarray:
    """For each correlation id, the row in ``trace.runtime`` of the call that launched it (-1: none)."""
    rt = trace.runtime
    corr = rt["correlation"]
    order = np.argsort(corr, kind="stable")
    idx = _lookup(corr[order], order.astype(np.float64), np.asarray(correlation), -1.0)
    return idx.astype(np.int64)


def _launch_ts(trace: KinetoTrace, correlation: np.ndarray) -> np.ndarray:
    idx = launch_index(trace, correlation)
    ts = trace.runtime["ts"]
    return np.where(idx >= 0, ts[np.maximum(idx, 0)] if len(ts) else np.nan, np.nan)


def _categorise(gap: np.ndarray, gap_start: np.ndarray, next_launch: np.ndarray,
                threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Masks (host_wait, kernel_wait) for gaps; the rest are "other"."""
    with np.errstate(invalid="ignore"):
        host = next_launch > gap_start
    kernel = ~host & (gap < threshold)
    return host, kernel


def gpu_utilization(trace: KinetoTrace, kernel_wait_threshold_us: float = KERNEL_WAIT_THRESHOLD_US) -> Table:
    """GPU busy and idle time per device (``stream`` = -1) and per stream.

    Columns: ``device``, ``stream`` (-1 = all streams of the device), ``ops`` (GPU operations),
    ``window_us``, ``busy_us``, ``idle_us``, ``utilization`` (busy / window, 0..1), ``host_wait_us``,
    ``kernel_wait_us``, ``other_idle_us`` (idle split, see the module docstring), ``longest_gap_us``.
    Under HTA's conventions the device rows count CUPTI sync records on a stream as GPU work (as its temporal
    breakdown does); the stream rows never do (as its idle time breakdown).
    """
    ops = trace.gpu_ops()
    launch = _launch_ts(trace, ops["correlation"])
    rows = []
    for dev in np.unique(ops["device"]):
        dsel = ops["device"] == dev
        rows.append(_merged_row(int(dev), -1, ops["ts"][dsel], ops["dur"][dsel], launch[dsel],
                                kernel_wait_threshold_us))
        streams = ops["stream"][dsel]
        work = ops["kind"][dsel] != "sync"  # per stream, sync records are never work (HTA's idle breakdown too)
        for stream in np.unique(streams[work]):
            ssel = (streams == stream) & work
            rows.append(_stream_row(int(dev), int(stream), ops["ts"][dsel][ssel], ops["dur"][dsel][ssel],
                                    launch[dsel][ssel], kernel_wait_threshold_us))
    return Table.from_rows(
        "gpu_utilization",
        ("device", "stream", "ops", "window_us", "busy_us", "idle_us", "utilization", "host_wait_us",
         "kernel_wait_us", "other_idle_us", "longest_gap_us"),
        rows,
        units={"window_us": US, "busy_us": US, "idle_us": US, "utilization": "ratio", "host_wait_us": US,
               "kernel_wait_us": US, "other_idle_us": US, "longest_gap_us": US},
        description="GPU busy/idle time per device (stream -1) and stream; idle split as HTA defines it",
        dtypes={"device": np.int64, "stream": np.int64, "ops": np.int64})


def _stream_row(dev: int, stream: int, ts: np.ndarray, dur: np.ndarray, launch: np.ndarray,
                threshold: float) -> tuple:
    end = ts + dur
    if len(ts) > 1 and np.any(ts[1:] < np.maximum.accumulate(end)[:-1]):  # overlapping operations
        return _merged_row(dev, stream, ts, dur, launch, threshold)
    window = float(end.max() - ts.min())
    busy = union_length(ts, end)
    gap = ts[1:] - end[:-1]
    host, kernel = _categorise(gap, end[:-1], launch[1:], threshold)
    other = ~host & ~kernel
    return (dev, stream, len(ts), window, busy, window - busy, busy / window if window > 0 else 1.0,
            float(gap[host].sum()), float(gap[kernel].sum()), float(gap[other].sum()),
            float(gap.max()) if len(gap) else 0.0)


def _device_gaps(ts: np.ndarray, dur: np.ndarray, launch: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gaps between merged busy intervals: (gap_start, gap_end, index of the op after the gap, busy_len)."""
    order = np.argsort(ts, kind="stable")
    s, e = ts[order], (ts + dur)[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    group_end = np.maximum.reduceat(e, idx)
    busy = float((group_end - s[idx]).sum())
    gap_start = group_end[:-1]
    gap_end = s[idx[1:]]
    return gap_start, gap_end, order[idx[1:]], np.array([busy])


def _merged_row(dev: int, stream: int, ts: np.ndarray, dur: np.ndarray, launch: np.ndarray,
                threshold: float) -> tuple:
    """A row whose gaps lie between the merged busy intervals of the operations (a device's, ``stream`` -1)."""
    gap_start, gap_end, after, busy_arr = _device_gaps(ts, dur, launch)
    busy = float(busy_arr[0])
    window = float((ts + dur).max() - ts.min())
    gap = gap_end - gap_start
    host, kernel = _categorise(gap, gap_start, launch[after], threshold)
    other = ~host & ~kernel
    return (dev, stream, len(ts), window, busy, window - busy, busy / window if window > 0 else 1.0,
            float(gap[host].sum()), float(gap[kernel].sum()), float(gap[other].sum()),
            float(gap.max()) if len(gap) else 0.0)


def idle_gaps(trace: KinetoTrace, min_gap_us: float = 0.0,
              kernel_wait_threshold_us: float = KERNEL_WAIT_THRESHOLD_US) -> Table:
    """Each idle gap of each device (between merged busy intervals of all its streams), longest first.

    Columns: ``device``, ``start_us``, ``end_us`` (relative to the trace origin), ``gap_us``, ``category``
    ("host_wait" / "kernel_wait" / "other"), ``next_op`` (name of the GPU operation after the gap),
    ``next_launch`` (its launching runtime call, "" if not in the trace), ``launch_delay_us`` (from the
    launch call's start to the operation's start; NaN when unknown). Only gaps >= ``min_gap_us``.
    """
    ops = trace.gpu_ops()
    launch_idx = launch_index(trace, ops["correlation"])
    rt_ts, rt_name = trace.runtime["ts"], trace.runtime["name"]
    launch = np.where(launch_idx >= 0, rt_ts[np.maximum(launch_idx, 0)] if len(rt_ts) else np.nan, np.nan)
    rows = []
    for dev in np.unique(ops["device"]):
        sel = np.flatnonzero(ops["device"] == dev)
        gs, ge, after, _ = _device_gaps(ops["ts"][sel], ops["dur"][sel], launch[sel])
        gap = ge - gs
        host, kernel = _categorise(gap, gs, launch[sel][after], kernel_wait_threshold_us)
        keep = np.flatnonzero(gap >= min_gap_us)
        for i in keep:
            op = sel[after[i]]
            li = launch_idx[op]
            rows.append((int(dev), float(gs[i]), float(ge[i]), float(gap[i]),
                         "host_wait" if host[i] else "kernel_wait" if kernel[i] else "other",
                         str(ops["name"][op]), str(rt_name[li]) if li >= 0 else "",
                         float(ops["ts"][op] - launch[op]) if li >= 0 else float("nan")))
    rows.sort(key=lambda r: -r[3])
    return Table.from_rows(
        "idle_gaps", ("device", "start_us", "end_us", "gap_us", "category", "next_op", "next_launch",
                      "launch_delay_us"), rows,
        units={"start_us": US, "end_us": US, "gap_us": US, "launch_delay_us": US},
        description="GPU idle gaps per device, longest first",
        dtypes={"device": np.int64, "start_us": np.float64, "end_us": np.float64, "gap_us": np.float64,
                "category": object, "next_op": object, "next_launch": object, "launch_delay_us": np.float64})


def kernel_launches(trace: KinetoTrace) -> Table:
    """Each kernel joined with the runtime call that launched it (by correlation id).

    Columns: ``device``, ``stream``, ``name``, ``ts``, ``dur`` (kernel, us), ``launch_name`` (e.g.
    ``cudaLaunchKernel``, "" when the call is not in the trace), ``launch_dur_us`` (time the CPU spent in
    the launch call), ``launch_delay_us`` (launch call start -> kernel start: queueing plus launch latency),
    ``pid``, ``tid`` (the launching thread, -1 when unknown), ``launch_row`` (the call's row in
    ``trace.runtime``, -1), ``launch_kernels`` (kernels that call launched: more than one for a CUDA graph
    replay), ``launch_kernel_us`` (their summed time), ``graph`` (the kernel came from a CUDA graph: a
    ``graph node id``, or a launch shared with other kernels).
    """
    k = trace.kernels
    idx = launch_index(trace, k["correlation"])
    rt = trace.runtime
    ok = idx >= 0
    safe = np.maximum(idx, 0)
    has = len(rt) > 0

    def pick(col: str, missing: Any, dtype: Any) -> np.ndarray:
        if not has:
            return np.full(len(k), missing, dtype=dtype)
        return np.where(ok, rt[col][safe], missing).astype(dtype)

    # kernels sharing one launch call (a CUDA graph replay: cudaGraphLaunch) and their summed time
    shared = np.bincount(safe[ok], minlength=max(len(rt), 1)) if ok.any() else np.zeros(max(len(rt), 1), np.int64)
    launch_gpu = np.bincount(safe[ok], weights=k["dur"][ok], minlength=max(len(rt), 1)) if ok.any() \
        else np.zeros(max(len(rt), 1))
    cols = {
        "device": k["device"], "stream": k["stream"], "name": k["name"], "ts": k["ts"], "dur": k["dur"],
        "launch_name": pick("name", "", object),
        "launch_dur_us": pick("dur", np.nan, np.float64),
        "launch_delay_us": np.where(ok, k["ts"] - (rt["ts"][safe] if has else 0.0), np.nan),
        "pid": pick("pid", -1, np.int64), "tid": pick("tid", -1, np.int64),
        "launch_row": idx,
        "launch_kernels": np.where(ok, shared[safe], 0).astype(np.int64),
        "launch_kernel_us": np.where(ok, launch_gpu[safe], np.nan),
        "graph": (k["graph_node_id"] >= 0) | (np.where(ok, shared[safe], 0) > 1),
    }
    return Table("kernel_launches", cols, {"ts": US, "dur": US, "launch_dur_us": US, "launch_delay_us": US,
                                           "launch_kernel_us": US},
                 "kernels with their launching runtime call")


def counter_summary(trace: KinetoTrace) -> Table:
    """Counter tracks (``ph`` "C" samples, e.g. CUPTI PM sampling on a "GPU N Counters" track): one row per
    device, counter and series.

    Columns: ``device``, ``counter``, ``name``, ``samples``, ``min``, ``mean``, ``max`` (in the counter's own
    unit), ``first_us``, ``last_us`` (relative to the trace origin).
    """
    c = trace.counters
    rows = []
    if len(c):
        keys = list(zip(c["device"].tolist(), c["counter"].tolist(), c["name"].tolist()))
        groups: dict[tuple[int, str, str], list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        for (dev, counter, name), idx in sorted(groups.items()):
            v, ts = c["value"][idx], c["ts"][idx]
            rows.append((dev, counter, name, len(idx), float(v.min()), float(v.mean()), float(v.max()),
                         float(ts.min()), float(ts.max())))
    return Table.from_rows(
        "counters", ("device", "counter", "name", "samples", "min", "mean", "max", "first_us", "last_us"), rows,
        units={"first_us": US, "last_us": US}, description="counter tracks (ph C samples) per device and series",
        dtypes={"device": np.int64, "counter": object, "name": object, "samples": np.int64, "min": np.float64,
                "mean": np.float64, "max": np.float64, "first_us": np.float64, "last_us": np.float64})


def launch_stats(trace: KinetoTrace, short_kernel_us: float = SHORT_KERNEL_US) -> Table:
    """Launch statistics per device: how long the CPU spends launching kernels against how long they run.

    Columns: ``device``, ``kernels``, ``launched`` (kernels whose launch call is in the trace),
    ``kernel_total_us``, ``launch_total_us`` (summed launch call durations, each call once),
    ``kernel_median_us``, ``launch_median_us`` (per call), ``short_kernels`` (kernels shorter than
    ``short_kernel_us``), ``short_share``, ``launch_exceeds_kernel_share`` (launch calls that took longer than
    the kernels they launched ran: for a CUDA graph replay, all of its kernels together),
    ``launch_delay_median_us``, ``launch_delay_p90_us`` (launch call start -> kernel start), ``launch_calls``,
    ``graph_kernels`` (kernels replayed from CUDA graphs).
    """
    kl = kernel_launches(trace)
    rows = []
    for dev in np.unique(kl["device"]):
        sel = kl["device"] == dev
        dur = kl["dur"][sel]
        delay = kl["launch_delay_us"][sel]
        launched = kl["launch_row"][sel] >= 0
        n = int(sel.sum())
        short = int((dur < short_kernel_us).sum())
        # per launch call, once: a CUDA graph replay launches many kernels with one call
        calls, first = np.unique(kl["launch_row"][sel][launched], return_index=True)
        call_dur = kl["launch_dur_us"][sel][launched][first]
        call_gpu = kl["launch_kernel_us"][sel][launched][first]
        exceeds = int((call_dur > call_gpu).sum())
        rows.append((int(dev), n, int(launched.sum()), float(dur.sum()), float(call_dur.sum()),
                     float(np.median(dur)), _nanq(call_dur, 0.5), short, short / n if n else 0.0,
                     exceeds / len(calls) if len(calls) else 0.0, _nanq(delay, 0.5), _nanq(delay, 0.9),
                     len(calls), int(kl["graph"][sel].sum())))
    return Table.from_rows(
        "launch_stats",
        ("device", "kernels", "launched", "kernel_total_us", "launch_total_us", "kernel_median_us",
         "launch_median_us", "short_kernels", "short_share", "launch_exceeds_kernel_share",
         "launch_delay_median_us", "launch_delay_p90_us", "launch_calls", "graph_kernels"),
        rows,
        units={"kernel_total_us": US, "launch_total_us": US, "kernel_median_us": US, "launch_median_us": US,
               "short_share": "ratio", "launch_exceeds_kernel_share": "ratio", "launch_delay_median_us": US,
               "launch_delay_p90_us": US},
        description=f"CPU launch time vs kernel time per device (short = under {short_kernel_us:g} us)",
        dtypes={"device": np.int64, "kernels": np.int64, "launched": np.int64, "short_kernels": np.int64,
                "launch_calls": np.int64, "graph_kernels": np.int64})


def _nanq(values: np.ndarray, q: float) -> float:
    v = values[~np.isnan(values)]
    return float(np.quantile(v, q)) if len(v) else float("nan")


def memcpy_bandwidth(trace: KinetoTrace) -> Table:
    """Achieved bandwidth of memory operations per device, operation, direction and memory kinds.

    Columns: ``device``, ``op`` (memcpy / memset), ``direction``, ``src``, ``dst``, ``count``, ``bytes``,
    ``time_us``, ``bandwidth_gbps`` (bytes / time, GB/s = 1e9 bytes/s), ``median_bandwidth_gbps`` (per
    operation), ``max_bandwidth_gbps``. Largest ``time_us`` first.
    """
    m = trace.memops
    rows = []
    if len(m):
        keys = list(zip(m["device"].tolist(), m["op"].tolist(), m["direction"].tolist(), m["src"].tolist(),
                        m["dst"].tolist()))
        groups: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        for key, idx_list in groups.items():
            idx = np.array(idx_list)
            b = m["bytes"][idx]
            t = m["dur"][idx]
            bw = m["bandwidth"][idx]
            total_t = float(t.sum())
            rows.append((*key, len(idx), int(b.sum()), total_t,
                         float(b.sum()) / (total_t * 1e3) if total_t > 0 else float("nan"),
                         _nanq(bw, 0.5), float(np.nanmax(bw)) if np.any(~np.isnan(bw)) else float("nan")))
    rows.sort(key=lambda r: -r[7])
    return Table.from_rows(
        "memcpy_bandwidth",
        ("device", "op", "direction", "src", "dst", "count", "bytes", "time_us", "bandwidth_gbps",
         "median_bandwidth_gbps", "max_bandwidth_gbps"),
        rows,
        units={"bytes": "bytes", "time_us": US, "bandwidth_gbps": "GB/s", "median_bandwidth_gbps": "GB/s",
               "max_bandwidth_gbps": "GB/s"},
        description="achieved bandwidth of copies and memsets",
        dtypes={"device": np.int64, "op": object, "direction": object, "src": object, "dst": object,
                "count": np.int64, "bytes": np.int64, "time_us": np.float64, "bandwidth_gbps": np.float64,
                "median_bandwidth_gbps": np.float64, "max_bandwidth_gbps": np.float64})


def _gpu_time_by_runtime(trace: KinetoTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per runtime row: (GPU time of the ops it launched, their count, first op start, last op end)."""
    ops = trace.gpu_ops()
    n = len(trace.runtime)
    gpu = np.zeros(n)
    count = np.zeros(n, dtype=np.int64)
    first = np.full(n, np.inf)
    last = np.full(n, -np.inf)
    if n and len(ops):
        idx = launch_index(trace, ops["correlation"])
        ok = idx >= 0
        np.add.at(gpu, idx[ok], ops["dur"][ok])
        np.add.at(count, idx[ok], 1)
        np.minimum.at(first, idx[ok], ops["ts"][ok])
        np.maximum.at(last, idx[ok], ops["ts"][ok] + ops["dur"][ok])
    return gpu, count, first, last


class _LaunchIndex:
    """Runtime calls per (pid, tid), sorted by time, with prefix sums of the GPU time they launched."""

    def __init__(self, trace: KinetoTrace) -> None:
        rt = trace.runtime
        gpu, count, first, last = _gpu_time_by_runtime(trace)
        self.threads: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        if not len(rt):
            return
        keys = rt["pid"] * (1 << 32) + (rt["tid"] & 0xFFFFFFFF)
        for key in np.unique(keys):
            sel = np.flatnonzero(keys == key)  # rt is sorted by ts, so sel is too
            pid, tid = int(rt["pid"][sel[0]]), int(rt["tid"][sel[0]])
            self.threads[(pid, tid)] = (rt["ts"][sel], np.concatenate([[0.0], np.cumsum(gpu[sel])]),
                                        np.concatenate([[0], np.cumsum(count[sel])]), first[sel], last[sel])

    def within(self, pid: int, tid: int, start: float, end: float) -> tuple[float, int, float, float]:
        """(GPU time, GPU ops, first op start, last op end) of ops launched in [start, end] on the thread."""
        t = self.threads.get((pid, tid))
        if t is None:
            return 0.0, 0, float("nan"), float("nan")
        ts, cgpu, ccount, first, last = t
        lo = int(np.searchsorted(ts, start, "left"))
        hi = int(np.searchsorted(ts, end, "right"))
        if hi <= lo:
            return 0.0, 0, float("nan"), float("nan")
        n = int(ccount[hi] - ccount[lo])
        if n == 0:
            return 0.0, 0, float("nan"), float("nan")
        return float(cgpu[hi] - cgpu[lo]), n, float(first[lo:hi].min()), float(last[lo:hi].max())


def annotation_gpu_time(trace: KinetoTrace, names: Sequence[str] | None = None,
                        pattern: str | None = None) -> Table:
    """GPU time per CPU-side annotation name (``record_function`` ranges, profiler steps, phases).

    GPU work belongs to an annotation when its launch call ran on the annotation's thread inside the
    annotation's time range (so nested ranges both count it). Columns: ``name``, ``count`` (instances),
    ``cpu_time_us`` (summed range durations), ``gpu_time_us`` (summed durations of the GPU operations
    launched inside), ``gpu_ops``, ``gpu_span_us`` (summed per-instance first-op-start -> last-op-end),
    ``gpu_per_cpu`` (gpu_time / cpu_time). Largest GPU time first. ``names`` / ``pattern`` (regex) filter.
    """
    a = trace.annotations
    sel = ~a["on_gpu"]
    if names is not None:
        sel &= np.isin(a["name"], np.array(list(names), dtype=object))
    if pattern is not None:
        rx = re.compile(pattern)
        sel &= np.array([bool(rx.search(n)) for n in a["name"]], dtype=bool)
    index = _LaunchIndex(trace)
    acc: dict[str, list[float]] = {}
    for i in np.flatnonzero(sel):
        name = str(a["name"][i])
        gpu, n, first, last = index.within(int(a["pid"][i]), int(a["tid"][i]), float(a["ts"][i]),
                                           float(a["ts"][i] + a["dur"][i]))
        row = acc.setdefault(name, [0, 0.0, 0.0, 0, 0.0])
        row[0] += 1
        row[1] += float(a["dur"][i])
        row[2] += gpu
        row[3] += n
        row[4] += (last - first) if n else 0.0
    rows = [(name, int(r[0]), r[1], r[2], int(r[3]), r[4], r[2] / r[1] if r[1] > 0 else float("nan"))
            for name, r in acc.items()]
    rows.sort(key=lambda r: (-r[3], r[0]))
    return Table.from_rows(
        "annotation_gpu_time",
        ("name", "count", "cpu_time_us", "gpu_time_us", "gpu_ops", "gpu_span_us", "gpu_per_cpu"), rows,
        units={"cpu_time_us": US, "gpu_time_us": US, "gpu_span_us": US, "gpu_per_cpu": "ratio"},
        description="GPU time of the work launched inside each CPU annotation (record_function range)",
        dtypes={"name": object, "count": np.int64, "cpu_time_us": np.float64, "gpu_time_us": np.float64,
                "gpu_ops": np.int64, "gpu_span_us": np.float64, "gpu_per_cpu": np.float64})


def request_gpu_time(trace: KinetoTrace) -> Table:
    """GPU time per request, from the request annotations zoomer-serve writes (see
    :mod:`zoomer_serve.analysis.labels`), with each request's share of the batches it ran in.

    Columns: ``trace_id``, ``span_id`` (hex), ``start_us`` (its first range's start, relative to the trace
    origin), ``cpu_time_us`` (the time its ranges cover, overlaps once), ``gpu_time_us``, ``gpu_ops``
    (launched inside its ranges, plus its share of its batches'), ``gpu_span_us`` (first GPU op start -> last GPU
    op end), ``pid``, ``tid`` (of its first range), ``batch_gpu_time_us`` (the part of ``gpu_time_us`` that is its
    share of batches). One row per request, in trace order: a request whose work ran in executor threads has a
    range on each thread, all summed here. A batch range (``zoomer.batch/...``) gives what was launched inside it
    to its members by the weights of its marker ranges (:mod:`zoomer_serve.profiling.batch_shares`: GPU time in
    proportion, op counts split exactly); a member without a range of its own (it started before the profiler)
    gets a row at its batch's range, with no CPU time.
    """
    a = trace.annotations
    index = _LaunchIndex(trace)
    parts: dict[tuple[str, str], list[tuple[float, float, float, int, float, float, int, int, float]]] = {}
    batches: dict[str, list[tuple[float, float, float, int, float, float, int, int]]] = {}
    marks: dict[str, list[tuple[tuple[str, str], int]]] = {}
    for i in np.flatnonzero(~a["on_gpu"]):
        name = str(a["name"][i])
        ids = parse_request_label(name)
        start, dur = float(a["ts"][i]), float(a["dur"][i])
        pid, tid = int(a["pid"][i]), int(a["tid"][i])
        if ids is None:
            _batch_annotation(name, index, pid, tid, start, dur, batches, marks)
            continue
        gpu, n, first, last = index.within(pid, tid, start, start + dur)
        parts.setdefault(ids, []).append((start, start + dur, gpu, n, first, last, pid, tid, dur))
    _unnest_batches(parts, batches)
    shares = _batch_shares(batches, marks)
    rows = []
    for ids in list(parts) + [k for k in shares if k not in parts]:
        ranges = parts.get(ids, [])
        share = shares.get(ids)
        pieces = [(p[2], p[3], p[4], p[5]) for p in ranges] + ([share[:4]] if share else [])
        n = sum(p[1] for p in pieces)
        first = min((p[2] for p in pieces if p[1]), default=0.0)
        last = max((p[3] for p in pieces if p[1]), default=0.0)
        if ranges:
            head = min(ranges)
            covered = head[8] if len(ranges) == 1 else union_length(
                np.array([p[0] for p in ranges]), np.array([p[1] for p in ranges]))
            where = (head[0], head[6], head[7])
        else:
            covered, where = 0.0, share[4:7]  # type: ignore[index]
        rows.append((ids[0], ids[1], where[0], covered, sum(p[0] for p in pieces), n, (last - first) if n else 0.0,
                     where[1], where[2], share[0] if share else 0.0))
    rows.sort(key=lambda row: row[2])
    return Table.from_rows(
        "request_gpu_time",
        ("trace_id", "span_id", "start_us", "cpu_time_us", "gpu_time_us", "gpu_ops", "gpu_span_us", "pid",
         "tid", "batch_gpu_time_us"), rows,
        units={"start_us": US, "cpu_time_us": US, "gpu_time_us": US, "gpu_span_us": US, "batch_gpu_time_us": US},
        description="GPU time per request (zoomer.request annotations, with shares of zoomer.batch annotations)",
        dtypes={"trace_id": object, "span_id": object, "start_us": np.float64, "cpu_time_us": np.float64,
                "gpu_time_us": np.float64, "gpu_ops": np.int64, "gpu_span_us": np.float64, "pid": np.int64,
                "tid": np.int64, "batch_gpu_time_us": np.float64})


def _batch_annotation(name: str, index: _LaunchIndex, pid: int, tid: int, start: float, dur: float,
                      batches: dict[str, list[tuple[float, float, float, int, float, float, int, int]]],
                      marks: dict[str, list[tuple[tuple[str, str], int]]]) -> None:
    """Collect a batch range (what was launched inside it) or a member marker (member ids and weight)."""
    member = parse_member_label(name)
    if member is not None:
        marks.setdefault(f"{member[0]:016x}", []).append(((f"{member[1]:032x}", f"{member[2]:016x}"), member[3]))
        return
    ids = parse_batch_label(name)
    if ids is not None:
        gpu, n, first, last = index.within(pid, tid, start, start + dur)
        batches.setdefault(f"{ids[1]:016x}", []).append((start, start + dur, gpu, n, first, last, pid, tid))


def _unnest_batches(parts: dict[tuple[str, str], list[Any]], batches: dict[str, list[Any]]) -> None:
    """A batch range inside a request range on the same thread (the batch ran on that request's thread): take
    the batch's launches out of the request's own part, they are shared among the members."""
    for ranges in batches.values():
        for b in ranges:
            for own in parts.values():
                for j, p in enumerate(own):
                    if (p[6], p[7]) == (b[6], b[7]) and p[0] <= b[0] and b[1] <= p[1]:
                        own[j] = (p[0], p[1], p[2] - b[2], p[3] - b[3], p[4], p[5], p[6], p[7], p[8])


def _batch_shares(batches: dict[str, list[Any]], marks: dict[str, list[tuple[tuple[str, str], int]]]
                  ) -> dict[tuple[str, str], tuple[float, int, float, float, float, int, int]]:
    """Per member: (GPU time, GPU ops, first op start, last op end, batch start, pid, tid) of its batch shares."""
    out: dict[tuple[str, str], tuple[float, int, float, float, float, int, int]] = {}
    for batch_id, ranges in batches.items():
        members = marks.get(batch_id)
        if not members:
            continue
        w = [weight for _, weight in members]
        gpu = sum(b[2] for b in ranges)
        ops = sum(b[3] for b in ranges)
        with_ops = [b for b in ranges if b[3]]
        first = min((b[4] for b in with_ops), default=0.0)
        last = max((b[5] for b in with_ops), default=0.0)
        head = min(ranges)
        for (ids, _), g, k in zip(members, split_float(gpu, w), split_int(ops, w)):
            prev = out.get(ids)
            if prev is None:
                out[ids] = (g, k, first, last, head[0], head[6], head[7])
            else:
                out[ids] = (prev[0] + g, prev[1] + k, min(prev[2], first) if k else prev[2],
                            max(prev[3], last) if k else prev[3], prev[4], prev[5], prev[6])
    return out


def utilization_timeline(trace: KinetoTrace, bins: int = 200) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per device: (bin start times in us, busy fraction 0..1 of each bin) over the device's window;
    for plotting GPU utilisation over time."""
    ops = trace.gpu_ops()
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for dev in np.unique(ops["device"]):
        sel = ops["device"] == dev
        s, e = merge_intervals(ops["ts"][sel], ops["ts"][sel] + ops["dur"][sel])
        lo, hi = float(s.min()), float(e.max())
        edges = np.linspace(lo, hi, bins + 1)
        # busy time in [edge_i, edge_i+1) = B(edge_i+1) - B(edge_i), B(x) = busy time before x
        cum = np.concatenate([[0.0], np.cumsum(e - s)])

        def busy_before(x: np.ndarray, s: np.ndarray = s, e: np.ndarray = e, cum: np.ndarray = cum) -> np.ndarray:
            j = np.searchsorted(s, x, "right")  # intervals starting at or before x
            inside = np.clip(x - s[np.maximum(j - 1, 0)], 0, None)
            last_len = np.where(j > 0, np.minimum(inside, (e - s)[np.maximum(j - 1, 0)]), 0.0)
            return cum[np.maximum(j - 1, 0)] * (j > 0) + last_len

        b = busy_before(edges)
        width = np.diff(edges)
        frac = np.divide(np.diff(b), width, out=np.zeros(bins), where=width > 0)
        out[int(dev)] = (edges[:-1], np.clip(frac, 0.0, 1.0))
    return out
