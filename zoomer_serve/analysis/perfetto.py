"""A merged Chrome trace (JSON, opens in Perfetto UI / chrome://tracing): request spans from the store and
the kernels, copies, runtime calls, CPU ops and annotations of Kineto traces on one timeline.

Layout: each Kineto process keeps its pid and threads; GPU work goes to pid = device id (as Kineto draws
it), one track per stream, with flow arrows from each launch call to its kernel. Requests become a process
"zoomer-serve requests" with one track per replica (``service.instance.id``); phases nest under their
request. When a trace holds request ranges (``zoomer.request/<trace_id>/<span_id>``) whose span is in the
store, a flow arrow joins the span to the range.

Times: Kineto timestamps are Unix epoch microseconds (PyTorch >= 2.0); span times (Unix epoch ns) are
divided by 1000. The file is written event by event, so memory stays at one event.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from zoomer_serve.analysis.kineto import KinetoTrace
from zoomer_serve.analysis.labels import parse_request_label
from zoomer_serve.analysis.store import StoreData

REQUESTS_PID = 2_000_000_000
"""Process id of the request track group (chosen to stay clear of real pids and GPU device ids)."""
MARGIN_US = 1_000_000.0


def _meta(pid: int, name: str, tid: int | None = None) -> dict[str, Any]:
    if tid is None:
        return {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _trace_events(trace: KinetoTrace) -> Iterator[dict[str, Any]]:
    o = trace.origin_us
    for pid, name in trace.process_names.items():
        yield _meta(pid, name)
    for (pid, tid), name in trace.thread_names.items():
        yield _meta(pid, name, tid)
    for dev in trace.devices:
        props = trace.device_properties.get(dev, {})
        yield _meta(dev, f"GPU {dev}" + (f" ({props['name']})" if props.get("name") else ""))
    k = trace.kernels
    for i in range(len(k)):
        yield {"ph": "X", "cat": "kernel", "name": k["name"][i], "pid": int(k["device"][i]),
               "tid": int(k["stream"][i]), "ts": o + float(k["ts"][i]), "dur": float(k["dur"][i]),
               "args": {"correlation": int(k["correlation"][i]), "grid_blocks": int(k["grid_blocks"][i]),
                        "block_threads": int(k["block_threads"][i]),
                        "occupancy": None if np.isnan(k["occupancy"][i]) else float(k["occupancy"][i])}}
    m = trace.memops
    for i in range(len(m)):
        yield {"ph": "X", "cat": f"gpu_{m['op'][i]}", "name": m["name"][i], "pid": int(m["device"][i]),
               "tid": int(m["stream"][i]), "ts": o + float(m["ts"][i]), "dur": float(m["dur"][i]),
               "args": {"correlation": int(m["correlation"][i]), "bytes": int(m["bytes"][i])}}
    for table, cat in ((trace.runtime, "cuda_runtime"), (trace.cpu_ops, "cpu_op")):
        for i in range(len(table)):
            ev = {"ph": "X", "cat": cat, "name": table["name"][i], "pid": int(table["pid"][i]),
                  "tid": int(table["tid"][i]), "ts": o + float(table["ts"][i]), "dur": float(table["dur"][i])}
            if cat == "cuda_runtime":
                ev["args"] = {"correlation": int(table["correlation"][i])}
            yield ev
    a = trace.annotations
    for i in range(len(a)):
        on_gpu = bool(a["on_gpu"][i])
        yield {"ph": "X", "cat": "gpu_user_annotation" if on_gpu else "user_annotation", "name": a["name"][i],
               "pid": int(a["device"][i] if on_gpu else a["pid"][i]),
               "tid": int(a["stream"][i] if on_gpu else a["tid"][i]), "ts": o + float(a["ts"][i]),
               "dur": float(a["dur"][i])}
    s = trace.syncs
    for i in range(len(s)):
        yield {"ph": "X", "cat": "cuda_sync", "name": s["kind"][i], "pid": int(s["device"][i]),
               "tid": int(s["stream"][i]), "ts": o + float(s["ts"][i]), "dur": float(s["dur"][i])}
    # launch arrows: runtime call -> GPU op with the same correlation id
    rt = trace.runtime
    if len(rt):
        order = np.argsort(rt["correlation"], kind="stable")
        corr_sorted = rt["correlation"][order]
        for table in (k, m):
            pos = np.searchsorted(corr_sorted, table["correlation"])
            for i in range(len(table)):
                p = int(pos[i])
                c = int(table["correlation"][i])
                if c < 0 or p >= len(corr_sorted) or corr_sorted[p] != c:
                    continue
                j = int(order[p])
                yield {"ph": "s", "cat": "ac2g", "name": "launch", "id": c, "pid": int(rt["pid"][j]),
                       "tid": int(rt["tid"][j]), "ts": o + float(rt["ts"][j])}
                yield {"ph": "f", "bp": "e", "cat": "ac2g", "name": "launch", "id": c, "pid": int(table["device"][i]),
                       "tid": int(table["stream"][i]), "ts": o + float(table["ts"][i])}


def _request_rows(store: StoreData, traces: list[KinetoTrace]) -> np.ndarray:
    """Rows of the store's requests to draw: those overlapping the traces' time range (with a 1 s margin)
    when any do, else all."""
    req = store.requests
    if not traces or not len(req):
        return np.arange(len(req))
    lo = min(t.origin_us for t in traces) - MARGIN_US
    hi = max(t.origin_us + max((float((tb["ts"] + tb["dur"]).max()) for tb in (t.kernels, t.runtime, t.cpu_ops)
                                if len(tb)), default=0.0) for t in traces) + MARGIN_US
    start = req["start_ns"] / 1000.0
    end = start + req["duration_ms"] * 1000.0
    sel = np.flatnonzero((end >= lo) & (start <= hi))
    return sel if len(sel) else np.arange(len(req))


def _request_events(store: StoreData, rows: np.ndarray, linked: dict[tuple[str, str], tuple[int, int, float]]
                    ) -> Iterator[dict[str, Any]]:
    req = store.requests
    instances = sorted(set(req["instance"][rows].tolist()))
    tids = {inst: k + 1 for k, inst in enumerate(instances)}
    yield _meta(REQUESTS_PID, "zoomer-serve requests")
    for inst, tid in tids.items():
        yield _meta(REQUESTS_PID, f"replica {inst or '(no service.instance.id)'}", tid)
    phases_by_request: dict[int, list[int]] = {}
    ph = store.phases
    wanted = set(rows.tolist())
    for j, r in enumerate(ph["request"].tolist()):
        if r in wanted:
            phases_by_request.setdefault(r, []).append(j)
    for i in rows.tolist():
        tid = tids[req["instance"][i]]
        ts = float(req["start_ns"][i]) / 1000.0
        yield {"ph": "X", "cat": "request", "name": req["method"][i], "pid": REQUESTS_PID, "tid": tid, "ts": ts,
               "dur": float(req["duration_ms"][i]) * 1000.0,
               "args": {"trace_id": req["trace_id"][i], "span_id": req["span_id"][i], "status": req["status"][i],
                        "service": req["service"][i]}}
        for j in phases_by_request.get(i, []):
            yield {"ph": "X", "cat": "phase", "name": ph["phase"][j], "pid": REQUESTS_PID, "tid": tid,
                   "ts": float(ph["start_ns"][j]) / 1000.0, "dur": float(ph["duration_ms"][j]) * 1000.0}
        target = linked.get((req["trace_id"][i], req["span_id"][i]))
        if target is not None:
            fid = 1_000_000_000 + i
            yield {"ph": "s", "cat": "zoomer.request", "name": "request", "id": fid, "pid": REQUESTS_PID,
                   "tid": tid, "ts": ts}
            yield {"ph": "f", "bp": "e", "cat": "zoomer.request", "name": "request", "id": fid,
                   "pid": target[0], "tid": target[1], "ts": target[2]}


def write_perfetto(out_path: str | os.PathLike[str], traces: list[KinetoTrace] | None = None,
                   store: StoreData | None = None) -> dict[str, int]:
    """Write the merged Chrome trace JSON to ``out_path`` (gzip when it ends in ``.gz``).

    Returns counts: ``events`` written, ``requests`` drawn, ``linked_requests`` (joined to a trace range).

    Raises:
        OSError: the file cannot be written.
    """
    traces = traces or []
    out = Path(out_path)
    linked: dict[tuple[str, str], tuple[int, int, float]] = {}
    for t in traces:
        a = t.annotations
        for i in np.flatnonzero(~a["on_gpu"]):
            ids = parse_request_label(str(a["name"][i]))
            if ids is not None:  # of a request with ranges on several threads, its first one
                at = (int(a["pid"][i]), int(a["tid"][i]), t.origin_us + float(a["ts"][i]))
                if ids not in linked or at[2] < linked[ids][2]:
                    linked[ids] = at
    rows = _request_rows(store, traces) if store is not None else np.empty(0, dtype=np.int64)
    counts = {"events": 0, "requests": int(len(rows)), "linked_requests": 0}
    if store is not None:
        keys = set(zip(store.requests["trace_id"][rows].tolist(), store.requests["span_id"][rows].tolist()))
        counts["linked_requests"] = len(keys & set(linked))
    opener: Any = gzip.open if out.suffix == ".gz" else open
    with opener(out, "wb") as fh:
        counts["events"] = _write(fh, traces, store, rows, linked)
    return counts


def _write(fh: IO[bytes], traces: list[KinetoTrace], store: StoreData | None, rows: np.ndarray,
           linked: dict[tuple[str, str], tuple[int, int, float]]) -> int:
    fh.write(b'{"displayTimeUnit": "ms", "otherData": {"producer": "zoomer-serve analyze"}, "traceEvents": [\n')
    n = 0
    sources: list[Iterator[dict[str, Any]]] = [_trace_events(t) for t in traces]
    if store is not None:
        sources.append(_request_events(store, rows, linked))
    for source in sources:
        for ev in source:
            fh.write((b",\n" if n else b"") + orjson.dumps(ev, option=orjson.OPT_SERIALIZE_NUMPY))
            n += 1
    fh.write(b"\n]}\n")
    return n
