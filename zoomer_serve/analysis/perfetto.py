"""The merged timeline: request spans and their phases from the store, and the CPU ops, runtime calls,
annotations, kernels, copies and counters of Kineto traces, on one time axis, for ui.perfetto.dev.

Format
------
The default output is Perfetto's native TrackEvent protobuf (``.pftrace``; ``.pftrace.gz`` gzips it),
written with the protobuf classes the ``perfetto`` package ships (``perfetto_trace_pb2``), in batches of
packets serialised as one ``Trace`` message each (concatenated ``Trace`` messages are one trace, which is
what its streaming trace builder writes too, one packet at a time). Why not the Chrome JSON that Kineto
writes:

- **Time.** Unix time in microseconds (1.8e15 in 2026) leaves a double 0.25 us of resolution, so JSON would
  blur sub-microsecond kernels and launch gaps; TrackEvent timestamps are integer nanoseconds.
- **Nesting.** Perfetto requires slices on one track to nest; it reads JSON "best effort" and hides or
  mangles ``X`` events that overlap on one thread (concurrent requests of a replica, kernels whose rounded
  times overlap by a nanosecond). Here every track is declared (``TrackDescriptor``) and each group of slices
  (a replica's requests, a thread, a GPU stream) is laid out on as many lanes as needed so that every lane
  nests perfectly: nothing overflows, nothing is dropped.
- **Names and links.** Tracks carry real names (no pid/tid guessing), flows connect a launch call to its
  kernel and a request span to its profiler range by id, and counter tracks (GPU PM sampling) are native.

The ``perfetto`` package (pure Python, Apache-2.0, kept by the Perfetto team, depends only on protobuf which
this project already has) is imported only when a timeline is written. A ``.json`` / ``.json.gz`` path
still gets Chrome JSON of the same layout (one tid per lane, so nothing overlaps either), with times in
microseconds since a ``baseTimeNanoseconds`` written at the top, as Kineto does, so no precision is lost.

Layout
------
- "zoomer-serve requests": one child track per replica (``service.instance.id``), more lanes when requests
  overlap; each request slice holds its phases.
- Per trace (named by its file): "<file> · process <pid>" with one child per thread (CPU ops, runtime calls,
  annotations, including the request ranges ``zoomer.request/<trace_id>/<span_id>``), and "<file> · GPU <n>"
  with one child per stream (kernels, copies, memsets, GPU annotations), one for synchronisation records, and
  one counter track per counter series of the device (``ph`` "C": CUPTI PM sampling); counters of other pids
  in a group of their own. Kernels replayed from a CUDA graph carry their ``graph_node_id``.
- Flows: each runtime call to the GPU operations it launched (correlation id); each request span to its
  first profiler range.

Times: every trace time goes through :meth:`KinetoTrace.unix_ns` (``baseTimeNanoseconds`` aware), span times
are Unix ns already, so request spans and their ranges line up (case C19).
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from zoomer_serve.analysis.kineto import KinetoTrace
from zoomer_serve.analysis.labels import parse_request_label
from zoomer_serve.analysis.store import StoreData

MARGIN_NS = 1_000_000_000
"""Requests within this many ns of a trace's time range are drawn with it (all are drawn when none is)."""
SEQUENCE_ID = 1
BATCH_PACKETS = 4096

Key = tuple[str, int]
"""A slice's source: (table, row) -- ``("requests", i)``, ``("t0:kernels", i)``, ..."""


@dataclass
class Slice:
    """One slice: Unix ns start and end, name, category, and its source row (for arguments and flows)."""

    start_ns: int
    end_ns: int
    name: str
    category: str
    key: Key
    order: int = 0  # ties of start and end: lower first (the outer slice)


@dataclass
class Track:
    """A track: ``uuid``, ``name``, ``parent`` (0 = top level), sibling ``rank``, and for counter tracks
    the ``unit``."""

    uuid: int
    name: str
    parent: int = 0
    rank: int = 0
    counter: bool = False
    unit: str = ""


@dataclass
class Timeline:
    """The merged timeline before it is written: tracks, slices per track (lanes assigned, nesting), counter
    points per track, flows by slice source, and argument getters."""

    tracks: list[Track] = field(default_factory=list)
    slices: dict[int, list[Slice]] = field(default_factory=dict)
    counters: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    flows_out: dict[Key, list[int]] = field(default_factory=dict)
    flows_in: dict[Key, list[int]] = field(default_factory=dict)
    args: dict[str, Callable[[int], dict[str, Any]]] = field(default_factory=dict)
    _next_uuid: int = 1
    _next_flow: int = 1
    _children: dict[int, int] = field(default_factory=dict)

    def track(self, name: str, parent: int = 0, counter: bool = False, unit: str = "") -> int:
        """Declare a track; returns its uuid."""
        uuid = self._next_uuid
        self._next_uuid += 1
        rank = self._children.get(parent, 0)
        self._children[parent] = rank + 1
        self.tracks.append(Track(uuid, name, parent, rank, counter, unit))
        return uuid

    def flow(self, source: Key, target: Key) -> None:
        """An arrow from the slice of ``source`` to the slice of ``target``."""
        fid = self._next_flow
        self._next_flow += 1
        self.flows_out.setdefault(source, []).append(fid)
        self.flows_in.setdefault(target, []).append(fid)

    def add_lanes(self, name: str, parent: int, slices: list[Slice]) -> list[int]:
        """Put ``slices`` on as few tracks named ``name`` (under ``parent``) as keep each one perfectly
        nested; returns the lane tracks' uuids (none for no slices)."""
        if not slices:
            return []
        slices.sort(key=lambda s: (s.start_ns, -s.end_ns, s.order))
        lanes = assign_lanes([(s.start_ns, s.end_ns) for s in slices])
        uuids: list[int] = []
        for lane in range(max(lanes) + 1):
            uuids.append(self.track(name if lane == 0 else f"{name} · lane {lane + 1}", parent))
        for s, lane in zip(slices, lanes):
            self.slices.setdefault(uuids[lane], []).append(s)
        return uuids


def assign_lanes(intervals: list[tuple[int, int]]) -> list[int]:
    """For intervals sorted by (start, -end): a lane per interval such that the intervals of each lane nest
    perfectly (any two are disjoint or one contains the other), first fit. Touching intervals (one ends
    where the next starts) are siblings."""
    stacks: list[list[int]] = []
    out: list[int] = []
    for start, end in intervals:
        for i, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                out.append(i)
                break
        else:
            stacks.append([end])
            out.append(len(stacks) - 1)
    return out


# ---- building the timeline ----------------------------------------------------------------------------------


def _request_rows(store: StoreData, traces: list[KinetoTrace]) -> np.ndarray:
    """Rows of the store's requests to draw: those overlapping the traces' time range (with a margin) when
    any do, else all."""
    req = store.requests
    if not traces or not len(req):
        return np.arange(len(req))
    lo = min(t.origin_unix_ns for t in traces) - MARGIN_NS
    hi = max(int(t.unix_ns(_trace_end_us(t))) for t in traces) + MARGIN_NS
    start = req["start_ns"].astype(np.int64)
    end = start + np.rint(req["duration_ms"] * 1e6).astype(np.int64)
    sel = np.flatnonzero((end >= lo) & (start <= hi))
    return sel if len(sel) else np.arange(len(req))


def _trace_end_us(t: KinetoTrace) -> float:
    ends = [float((tb["ts"] + tb["dur"]).max()) for tb in (t.kernels, t.memops, t.runtime, t.cpu_ops, t.annotations)
            if len(tb)]
    return max(ends, default=0.0)


def _slices(trace: KinetoTrace, table_name: str, prefix: str, category: str | np.ndarray,
            rows: np.ndarray, order: int = 0) -> list[Slice]:
    """Slices of ``rows`` of a trace table; ``category`` is one for all or one per row (aligned with rows)."""
    tb = getattr(trace, table_name)
    start = trace.unix_ns(tb["ts"][rows])
    end = start + np.rint(tb["dur"][rows] * 1000.0).astype(np.int64)
    names = tb["kind" if table_name == "syncs" else "name"][rows].tolist()
    cats = [category] * len(rows) if isinstance(category, str) else [str(c) for c in category.tolist()]
    source = f"{prefix}:{table_name}"
    return [Slice(int(a), int(b), str(n), c, (source, i), order)
            for a, b, n, c, i in zip(start.tolist(), end.tolist(), names, cats, rows.tolist())]


def _group_rows(keys: np.ndarray) -> dict[int, np.ndarray]:
    """Row indices per distinct key (ascending keys, rows in table order)."""
    if not len(keys):
        return {}
    order = np.argsort(keys, kind="stable")
    uniq, first = np.unique(keys[order], return_index=True)
    bounds = list(first[1:]) + [len(order)]
    return {int(k): order[a:b] for k, a, b in zip(uniq, first, bounds)}


def _group_pairs(pid: np.ndarray, tid: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """Row indices per distinct (pid, tid)."""
    if not len(pid):
        return {}
    pairs, inverse = np.unique(np.stack([pid, tid], axis=1), axis=0, return_inverse=True)
    groups = _group_rows(inverse.reshape(-1))
    return {(int(pairs[g][0]), int(pairs[g][1])): rows for g, rows in groups.items()}


def _add_trace(tl: Timeline, trace: KinetoTrace, index: int, label: str) -> dict[tuple[str, str], Key]:
    """Tracks, slices and flows of one trace; returns the first request range per (trace_id, span_id)."""
    prefix = f"t{index}"
    _add_cpu(tl, trace, prefix, label)
    _add_gpu(tl, trace, prefix, label)
    _add_launch_flows(tl, trace, prefix)
    _add_args(tl, trace, prefix)
    ranges: dict[tuple[str, str], tuple[float, Key]] = {}
    a = trace.annotations
    for i in np.flatnonzero(~a["on_gpu"]):
        ids = parse_request_label(str(a["name"][i]))
        if ids is not None and (ids not in ranges or a["ts"][i] < ranges[ids][0]):
            ranges[ids] = (float(a["ts"][i]), (f"{prefix}:annotations", int(i)))
    return {ids: key for ids, (_, key) in ranges.items()}


def _add_cpu(tl: Timeline, trace: KinetoTrace, prefix: str, label: str) -> None:
    a = trace.annotations
    cpu_annot = np.flatnonzero(~a["on_gpu"])
    groups: dict[tuple[int, int], list[Slice]] = {}
    for table, cat, rows, order in (
            ("annotations", "user_annotation", cpu_annot, 0), ("cpu_ops", "cpu_op", None, 1),
            ("runtime", "cuda_runtime", None, 2)):
        tb = getattr(trace, table)
        rows = np.arange(len(tb)) if rows is None else rows
        for key, sel in _group_pairs(tb["pid"][rows], tb["tid"][rows]).items():
            groups.setdefault(key, []).extend(_slices(trace, table, prefix, cat, rows[sel], order))
    processes: dict[int, int] = {}
    for pid, tid in sorted(groups):
        if pid not in processes:
            pname = trace.process_names.get(pid, "")
            processes[pid] = tl.track(f"{label} · process {pid}" + (f" ({pname})" if pname else ""))
        tname = trace.thread_names.get((pid, tid), "")
        name = tname if tname.startswith("thread ") else f"thread {tid}" + (f" ({tname})" if tname else "")
        tl.add_lanes(name, processes[pid], groups[(pid, tid)])


def _add_gpu(tl: Timeline, trace: KinetoTrace, prefix: str, label: str) -> None:
    props = trace.device_properties
    k, m, a, s = trace.kernels, trace.memops, trace.annotations, trace.syncs
    gpu_annot = np.flatnonzero(a["on_gpu"])
    devices = sorted(set(trace.devices) | set(a["device"][gpu_annot].tolist()) | set(s["device"].tolist()))
    _add_other_counters(tl, trace, set(devices), label)
    for dev in devices:
        name = props.get(dev, {}).get("name")
        parent = tl.track(f"{label} · GPU {dev}" + (f" ({name})" if isinstance(name, str) and name else ""))
        streams: dict[int, list[Slice]] = {}
        memop_cats = np.array([f"gpu_{op}" for op in m["op"].tolist()], dtype=object)
        for table, cat, rows, order in (
                ("annotations", "gpu_user_annotation", gpu_annot[a["device"][gpu_annot] == dev], 0),
                ("kernels", "kernel", np.flatnonzero(k["device"] == dev), 1),
                ("memops", memop_cats, np.flatnonzero(m["device"] == dev), 1)):
            tb = getattr(trace, table)
            for stream, sel in _group_rows(tb["stream"][rows]).items():
                these = rows[sel]
                streams.setdefault(stream, []).extend(
                    _slices(trace, table, prefix, cat if isinstance(cat, str) else cat[these], these, order))
        for stream in sorted(streams):
            tl.add_lanes(f"stream {stream}", parent, streams[stream])
        sync_rows = np.flatnonzero(s["device"] == dev)
        tl.add_lanes("synchronisation (CUPTI records)", parent, _slices(trace, "syncs", prefix, "cuda_sync", sync_rows))
        _add_device_counters(tl, trace, dev, parent)


def _add_device_counters(tl: Timeline, trace: KinetoTrace, dev: int, parent: int) -> None:
    """Counter tracks (``ph`` "C") of one device (or process), one per counter and series."""
    c = trace.counters
    sel = c["device"] == dev
    for counter, name in sorted(set(zip(c["counter"][sel].tolist(), c["name"][sel].tolist()))):
        rows = np.flatnonzero(sel & (c["counter"] == counter) & (c["name"] == name))
        uuid = tl.track(name if name == counter else f"{counter}: {name}", parent, counter=True)
        ts = trace.unix_ns(c["ts"][rows])
        tl.counters[uuid] = list(zip(ts.tolist(), c["value"][rows].astype(float).tolist()))


def _add_other_counters(tl: Timeline, trace: KinetoTrace, devices: set[int], label: str) -> None:
    """Counters whose pid is no GPU of the trace: a group per pid."""
    for pid in sorted(set(trace.counters["device"].tolist()) - devices):
        name = trace.process_names.get(pid, "")
        parent = tl.track(f"{label} · counters of {pid}" + (f" ({name})" if name else ""))
        _add_device_counters(tl, trace, pid, parent)


def _add_launch_flows(tl: Timeline, trace: KinetoTrace, prefix: str) -> None:
    rt = trace.runtime
    if not len(rt):
        return
    order = np.argsort(rt["correlation"], kind="stable")
    corr_sorted = rt["correlation"][order]
    for table in ("kernels", "memops"):
        tb = getattr(trace, table)
        if not len(tb):
            continue
        corr = tb["correlation"]
        pos = np.minimum(np.searchsorted(corr_sorted, corr), len(corr_sorted) - 1)
        hit = (corr >= 0) & (corr_sorted[pos] == corr)
        for i in np.flatnonzero(hit).tolist():
            tl.flow((f"{prefix}:runtime", int(order[pos[i]])), (f"{prefix}:{table}", i))


def _add_args(tl: Timeline, trace: KinetoTrace, prefix: str) -> None:
    k, m, rt = trace.kernels, trace.memops, trace.runtime

    def kernel(i: int) -> dict[str, Any]:
        occ = float(k["occupancy"][i])
        out: dict[str, Any] = {"correlation": int(k["correlation"][i]), "grid_blocks": int(k["grid_blocks"][i]),
                               "block_threads": int(k["block_threads"][i])}
        if occ == occ:
            out["occupancy_pct"] = occ
        if int(k["graph_node_id"][i]) >= 0:
            out["graph_node_id"] = int(k["graph_node_id"][i])
        return out

    tl.args[f"{prefix}:kernels"] = kernel
    tl.args[f"{prefix}:memops"] = lambda i: {"correlation": int(m["correlation"][i]), "bytes": int(m["bytes"][i])}
    tl.args[f"{prefix}:runtime"] = lambda i: {"correlation": int(rt["correlation"][i])}


def _add_requests(tl: Timeline, store: StoreData, rows: np.ndarray) -> None:
    req, ph = store.requests, store.phases
    if not len(rows):
        return
    parent = tl.track("zoomer-serve requests")
    wanted = np.zeros(len(req), dtype=bool)
    wanted[rows] = True
    start = req["start_ns"].astype(np.int64)
    end = start + np.rint(req["duration_ms"] * 1e6).astype(np.int64)
    groups: dict[str, list[Slice]] = {}
    for i in rows.tolist():
        groups.setdefault(str(req["instance"][i]), []).append(
            Slice(int(start[i]), int(end[i]), str(req["method"][i]), "request", ("requests", i), 0))
    if len(ph):
        p_start = ph["start_ns"].astype(np.int64)
        p_end = p_start + np.rint(ph["duration_ms"] * 1e6).astype(np.int64)
        for j, r in enumerate(ph["request"].tolist()):
            if 0 <= r < len(req) and wanted[r]:
                groups[str(req["instance"][r])].append(
                    Slice(int(p_start[j]), int(p_end[j]), str(ph["phase"][j]), "phase", ("phases", j), 1))
    for inst in sorted(groups):
        tl.add_lanes(f"replica {inst or '(no service.instance.id)'}", parent, groups[inst])
    tl.args["requests"] = lambda i: {"trace_id": str(req["trace_id"][i]), "span_id": str(req["span_id"][i]),
                                     "status": str(req["status"][i]), "service": str(req["service"][i])}


def build_timeline(traces: list[KinetoTrace], store: StoreData | None = None) -> tuple[Timeline, dict[str, int]]:
    """The merged timeline of ``traces`` and the store's requests (those near the traces' time range).

    Returns the timeline and counts: ``requests`` drawn, ``linked_requests`` (joined to a profiler range).
    """
    tl = Timeline()
    rows = _request_rows(store, traces) if store is not None else np.empty(0, dtype=np.int64)
    if store is not None:
        _add_requests(tl, store, rows)
    ranges: dict[tuple[str, str], Key] = {}
    names = [Path(str(t.path)).name for t in traces]
    for i, t in enumerate(traces):
        label = names[i] if names.count(names[i]) == 1 else f"{names[i]} #{i + 1}"
        for ids, key in _add_trace(tl, t, i, label).items():
            ranges.setdefault(ids, key)
    linked = 0
    if store is not None:
        req = store.requests
        for i in rows.tolist():
            target = ranges.get((str(req["trace_id"][i]), str(req["span_id"][i])))
            if target is not None:
                tl.flow(("requests", i), target)
                linked += 1
    return tl, {"requests": int(len(rows)), "linked_requests": linked}


# ---- writing --------------------------------------------------------------------------------------------------


def _events(tl: Timeline, uuid: int) -> Iterator[tuple[int, Slice | None]]:
    """The track's slices as (timestamp, slice) begins and (timestamp, None) ends, in nesting order."""
    stack: list[int] = []
    for s in tl.slices.get(uuid, []):
        while stack and stack[-1] <= s.start_ns:
            yield stack.pop(), None
        yield s.start_ns, s
        stack.append(s.end_ns)
    while stack:
        yield stack.pop(), None


def write_perfetto(out_path: str | os.PathLike[str], traces: list[KinetoTrace] | None = None,
                   store: StoreData | None = None) -> dict[str, int]:
    """Write the merged timeline to ``out_path``: TrackEvent protobuf, or Chrome JSON when the name ends in
    ``.json`` / ``.json.gz``; gzip when it ends in ``.gz``.

    Returns counts: ``events`` (slices and counter points written), ``requests`` drawn, ``linked_requests``
    (requests joined to a profiler range by a flow), ``tracks``, ``shifted_ns`` (0, or how far every time
    was moved because a trace held times before 1970, which protobuf timestamps cannot hold).

    Raises:
        OSError: the file cannot be written.
    """
    out = Path(out_path)
    tl, counts = build_timeline(traces or [], store)
    json_format = out.name.endswith((".json", ".json.gz"))
    opener: Any = gzip.open if out.suffix == ".gz" else open
    first = min([v[0].start_ns for v in tl.slices.values() if v] + [c[0][0] for c in tl.counters.values() if c],
                default=0)
    shift = 0 if json_format or first >= 0 else -first  # protobuf timestamps are unsigned
    with opener(out, "wb") as fh:
        counts["events"] = _write_json(fh, tl) if json_format else _write_proto(fh, tl, shift)
    counts["tracks"] = len(tl.tracks)
    counts["shifted_ns"] = shift
    return counts


def _write_proto(fh: IO[bytes], tl: Timeline, shift: int = 0) -> int:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    te = pb.TrackEvent
    begin, end_type, counter_type = te.TYPE_SLICE_BEGIN, te.TYPE_SLICE_END, te.TYPE_COUNTER
    trace = pb.Trace()
    interned: dict[str, int] = {}
    count = 0

    def packet() -> Any:
        p = trace.packet.add()
        p.trusted_packet_sequence_id = SEQUENCE_ID
        return p

    def flush() -> None:
        fh.write(trace.SerializeToString())
        trace.Clear()

    first = packet()
    first.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    first.first_packet_on_sequence = True
    for t in tl.tracks:
        d = packet().track_descriptor
        d.uuid = t.uuid
        d.name = t.name
        if t.parent:
            d.parent_uuid = t.parent
        d.sibling_order_rank = t.rank
        d.child_ordering = pb.TrackDescriptor.EXPLICIT
        if t.counter:
            d.counter.SetInParent()
    for t in tl.tracks:
        if t.counter:
            for ts, value in tl.counters.get(t.uuid, []):
                p = packet()
                p.timestamp = ts + shift
                p.track_event.type = counter_type
                p.track_event.track_uuid = t.uuid
                p.track_event.double_counter_value = value
                count += 1
            continue
        for ts, s in _events(tl, t.uuid):
            p = packet()
            p.timestamp = ts + shift
            ev = p.track_event
            ev.track_uuid = t.uuid
            if s is None:
                ev.type = end_type
            else:
                ev.type = begin
                iid = interned.get(s.name)
                if iid is None:
                    iid = interned[s.name] = len(interned) + 1
                    n = p.interned_data.event_names.add()
                    n.iid = iid
                    n.name = s.name
                ev.name_iid = iid
                p.sequence_flags = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
                ev.categories.append(s.category)
                _proto_args(ev, tl, s.key)
                ev.flow_ids.extend(tl.flows_out.get(s.key, ()))
                ev.terminating_flow_ids.extend(tl.flows_in.get(s.key, ()))
                count += 1
            if len(trace.packet) >= BATCH_PACKETS:
                flush()
    flush()
    return count


def _proto_args(ev: Any, tl: Timeline, key: Key) -> None:
    getter = tl.args.get(key[0])
    if getter is None:
        return
    for name, value in getter(key[1]).items():
        a = ev.debug_annotations.add()
        a.name = name
        if isinstance(value, bool):
            a.bool_value = value
        elif isinstance(value, int):
            a.int_value = value
        elif isinstance(value, float):
            a.double_value = value
        else:
            a.string_value = str(value)


def _write_json(fh: IO[bytes], tl: Timeline) -> int:
    starts = [s.start_ns for v in tl.slices.values() for s in v[:1]] + \
             [c[0][0] for c in tl.counters.values() if c]
    base = (min(starts) // 1_000_000_000) * 1_000_000_000 if starts else 0
    fh.write(b'{"displayTimeUnit": "ms", "baseTimeNanoseconds": ' + str(base).encode()
             + b', "otherData": {"producer": "zoomer-serve analyze"}, "traceEvents": [\n')
    pids: dict[int, int] = {}
    n = 0

    def emit(ev: dict[str, Any]) -> None:
        nonlocal n
        fh.write((b",\n" if n else b"") + orjson.dumps(ev))
        n += 1

    by_uuid = {t.uuid: t for t in tl.tracks}
    for t in tl.tracks:
        root = t
        while root.parent:
            root = by_uuid[root.parent]
        pid = pids.setdefault(root.uuid, len(pids) + 1)
        if root is t:
            emit({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": t.name}})
            emit({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            continue
        label = t.name if t.parent == root.uuid else f"{by_uuid[t.parent].name} · {t.name}"
        emit({"ph": "M", "name": "thread_name", "pid": pid, "tid": t.uuid, "args": {"name": label}})
        emit({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t.uuid, "args": {"sort_index": t.uuid}})
        for ts, value in tl.counters.get(t.uuid, []):
            emit({"ph": "C", "name": t.name, "pid": pid, "tid": t.uuid, "ts": (ts - base) / 1000.0,
                  "args": {"value": value}})
        for s in tl.slices.get(t.uuid, []):
            ev: dict[str, Any] = {"ph": "X", "cat": s.category, "name": s.name, "pid": pid, "tid": t.uuid,
                                  "ts": (s.start_ns - base) / 1000.0, "dur": (s.end_ns - s.start_ns) / 1000.0}
            getter = tl.args.get(s.key[0])
            if getter is not None:
                ev["args"] = getter(s.key[1])
            emit(ev)
            for fid in tl.flows_out.get(s.key, ()):
                emit({"ph": "s", "cat": "flow", "name": "flow", "id": fid, "pid": pid, "tid": t.uuid,
                      "ts": (s.start_ns - base) / 1000.0})
            for fid in tl.flows_in.get(s.key, ()):
                emit({"ph": "f", "bp": "e", "cat": "flow", "name": "flow", "id": fid, "pid": pid, "tid": t.uuid,
                      "ts": (s.start_ns - base) / 1000.0})
    fh.write(b"\n]}\n")
    return n


# ---- reading back (for checks and tests) ----------------------------------------------------------------------


@dataclass
class ReadSlice:
    """A slice read back from a merged timeline file: its track (uuid; for JSON the tid), times (Unix ns),
    name, category, arguments, depth on its track and the flow ids leaving / entering it."""

    track: int
    start_ns: int
    end_ns: int
    name: str
    category: str
    args: dict[str, Any]
    depth: int
    flows_out: list[int]
    flows_in: list[int]


@dataclass
class ReadTimeline:
    """A merged timeline file read back: track names and parents by uuid, slices, counter points by track."""

    track_names: dict[int, str]
    track_parents: dict[int, int]
    slices: list[ReadSlice]
    counters: dict[int, list[tuple[int, float]]]

    def path_of(self, track: int) -> str:
        """The track's name with its parents', outermost first, joined by " / "."""
        names = []
        while track:
            names.append(self.track_names.get(track, "?"))
            track = self.track_parents.get(track, 0)
        return " / ".join(reversed(names))


def read_timeline(path: str | os.PathLike[str]) -> ReadTimeline:
    """Read a file written by :func:`write_perfetto` back, pairing slice begins and ends per track the way
    Perfetto's trace processor does (packets sorted by timestamp, ties in file order).

    Raises:
        ValueError: an end without a begin, or a slice left open, on some track (the file does not nest).
        OSError: the file cannot be read.
    """
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if p.name.endswith((".json", ".json.gz")):
        return _read_json(orjson.loads(raw))
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    trace = pb.Trace.FromString(raw)
    names: dict[int, str] = {}
    parents: dict[int, int] = {}
    interned: dict[int, str] = {}
    events: list[tuple[int, int, Any, str]] = []
    counters: dict[int, list[tuple[int, float]]] = {}
    for n, packet in enumerate(trace.packet):
        for e in packet.interned_data.event_names:
            interned[e.iid] = e.name
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            names[d.uuid] = d.name
            parents[d.uuid] = d.parent_uuid
        if packet.HasField("track_event"):
            ev = packet.track_event
            if ev.type == pb.TrackEvent.TYPE_COUNTER:
                counters.setdefault(ev.track_uuid, []).append((packet.timestamp, ev.double_counter_value))
            else:
                name = interned.get(ev.name_iid, "") if ev.name_iid else ev.name
                events.append((packet.timestamp, n, ev, name))
    events.sort(key=lambda x: (x[0], x[1]))
    slices: list[ReadSlice] = []
    open_: dict[int, list[ReadSlice]] = {}
    for ts, _, ev, name in events:
        stack = open_.setdefault(ev.track_uuid, [])
        if ev.type == pb.TrackEvent.TYPE_SLICE_END:
            if not stack:
                raise ValueError(f"{p}: slice end at {ts} without a begin on track {ev.track_uuid}")
            stack.pop().end_ns = ts
            continue
        args = {}
        for a in ev.debug_annotations:
            kind = a.WhichOneof("value")
            args[a.name] = getattr(a, kind) if kind else None
        s = ReadSlice(ev.track_uuid, ts, ts, name, ev.categories[0] if ev.categories else "", args, len(stack),
                      list(ev.flow_ids), list(ev.terminating_flow_ids))
        slices.append(s)
        if ev.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            stack.append(s)
    left = {uuid: len(st) for uuid, st in open_.items() if st}
    if left:
        raise ValueError(f"{p}: slices left open on tracks {left}")
    return ReadTimeline(names, parents, slices, counters)


def _read_json(doc: dict[str, Any]) -> ReadTimeline:
    base = int(doc.get("baseTimeNanoseconds", 0))
    names: dict[int, str] = {}
    slices: list[ReadSlice] = []
    counters: dict[int, list[tuple[int, float]]] = {}
    by_start: dict[tuple[int, int], ReadSlice] = {}
    flows: list[dict[str, Any]] = []
    for ev in doc["traceEvents"]:
        ph = ev.get("ph")
        if ph == "M" and ev.get("name") == "thread_name":
            names[ev["tid"]] = ev["args"]["name"]
        elif ph == "X":
            start = base + round(ev["ts"] * 1000)
            s = ReadSlice(ev["tid"], start, start + round(ev["dur"] * 1000), ev["name"], ev.get("cat", ""),
                          ev.get("args", {}), 0, [], [])
            slices.append(s)
            by_start.setdefault((ev["tid"], start), s)
        elif ph == "C":
            counters.setdefault(ev["tid"], []).append((base + round(ev["ts"] * 1000), ev["args"]["value"]))
        elif ph in ("s", "f"):
            flows.append(ev)
    for ev in flows:
        s = by_start[(ev["tid"], base + round(ev["ts"] * 1000))]
        (s.flows_out if ev["ph"] == "s" else s.flows_in).append(ev["id"])
    return ReadTimeline(names, {}, slices, counters)


def linked_requests(tl: ReadTimeline) -> list[tuple[ReadSlice, ReadSlice]]:
    """(request span slice, its profiler range slice) for each request joined to a range by a flow."""
    by_flow_in = {fid: s for s in tl.slices for fid in s.flows_in}
    return [(req, by_flow_in[fid]) for req in tl.slices if req.category == "request" for fid in req.flows_out
            if fid in by_flow_in]


def ranges_outside_spans(tl: ReadTimeline, tolerance_ns: int = 1_000_000) -> tuple[int, list[str]]:
    """The time-base check (case C19): every request's profiler range lies inside its span's time, within
    ``tolerance_ns``. Returns (pairs checked, one line per range that does not)."""
    pairs = linked_requests(tl)
    bad = [f"{rng.name}: range {rng.start_ns}..{rng.end_ns} ns, span {req.start_ns}..{req.end_ns} ns"
           for req, rng in pairs
           if rng.start_ns < req.start_ns - tolerance_ns or rng.end_ns > req.end_ns + tolerance_ns]
    return len(pairs), bad
