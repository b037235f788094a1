"""Findings about dynamic batching, from the batch spans and member requests in the store
(:mod:`zoomer_serve.batching`) and from batch ranges in kernel traces.

Store detectors (per queue: the batch spans of one service and ``messaging.destination.name``; per method for
the queue wait). Queue waits count every batched message, from each request's ``queue`` child spans (a stream
queues one message per batch it joins; its ``zoomer.batch.*`` attributes are its last message's only), as the
report's Batching table does (:data:`zoomer_serve.report.build.BATCH_MESSAGES_CTE`):

- ``batch.queue-wait``: requests of a method spend at least half their time waiting for a batch to fill: the
  delay is too long for the load (evidence: queue wait percentiles, its share of latency, how the batches were
  cut and filled).
- ``batch.under-filled``: a queue's batches are mostly cut by the delay well below their maximum size: the delay
  is too short for the arrival rate, or too few clients feed the replica (evidence: fill, cut reasons, the arrival
  rate and the batch size it gives in one delay).
- ``batch.share-outlier``: one request type (method) takes most of the batches' time although it is a minority of
  their requests, or a few large requests take most of their batches (evidence: time and request fractions per
  method, the largest shares).

Trace detector:

- ``batch.small-for-gpu``: the kernels launched inside batch ranges run at low estimated occupancy or with grids
  smaller than the GPU's SM count: the batches are too small to keep the GPU busy.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zoomer_serve.analysis.findings import AT_STAKE, Finding, severity_for_share
from zoomer_serve.batching import names as bn
from zoomer_serve.report.build import BATCH_MESSAGES_CTE

if TYPE_CHECKING:
    from zoomer_serve.analysis.kineto import KinetoTrace
    from zoomer_serve.analysis.store import StoreData

# batch.queue-wait: summed queue wait / summed request duration of a method's batched requests
QUEUE_WAIT_SHARE = 0.5
MIN_BATCHED_REQUESTS = 20
# batch.under-filled: mean fill below this, with at least this share of batches cut by the delay
UNDER_FILL = 0.5
UNDER_FILL_DELAY_SHARE = 0.8
MIN_BATCHES = 10
# batch.share-outlier
DOMINANT_TIME_SHARE = 0.5
DOMINANT_LIFT = 2.0
OUTLIER_RATIO = 3.0
OUTLIER_MIN_SHARE_OF_MEMBERS = 0.05
# batch.small-for-gpu: kernel-time-weighted estimated occupancy (%) below this, or this share of batch kernel
# time in grids with fewer blocks than SMs
SMALL_OCCUPANCY_PCT = 25.0
SMALL_GRID_SHARE = 0.5
MIN_TRACE_BATCHES = 3
MAX_ITEMS = 10
NS_PER_MS = 1e6

_BATCHES_SQL = f"""
WITH uspans AS (
    SELECT * FROM spans QUALIFY row_number() OVER (PARTITION BY trace_id, span_id ORDER BY received_ns) = 1
)
SELECT span_id, coalesce(service_name, 'unknown_service'), attributes->>'$."{bn.MESSAGING_DESTINATION}"',
       start_ns, duration_ns, CAST(attributes AS VARCHAR)
FROM uspans WHERE kind = 'INTERNAL' AND attributes->>'$."{bn.CUT_REASON}"' IS NOT NULL
ORDER BY start_ns
"""


def _query(data: StoreData, sql: str) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` over the store ``data`` was read from (a DuckDB file or a Parquet dataset); none when it
    cannot be read again or is not a store with spans (the other detectors say so)."""
    from zoomer_serve.artifacts.storage import StorageError
    from zoomer_serve.collector.parquet import open_source
    from zoomer_serve.collector.store import StoreError

    try:
        con = open_source(data.path)
    except (StoreError, StorageError, OSError):
        return []
    try:
        return con.execute(sql).fetchall()
    except Exception:
        return []
    finally:
        con.close()


@dataclass
class BatchRow:
    """One batch span: ``span_id`` (hex), ``service``, ``queue``, ``start_ns``, ``duration_ns``, ``size``,
    ``max_size`` (0 when unknown), ``fill`` (NaN when unknown), ``cut_reason``, ``max_delay_ms`` (NaN when
    unknown)."""

    span_id: str
    service: str
    queue: str
    start_ns: int
    duration_ns: int
    size: int
    max_size: int
    fill: float
    cut_reason: str
    max_delay_ms: float


def load_batches(data: StoreData) -> list[BatchRow]:
    """The batch spans of the store ``data`` was read from (an empty list when it cannot be read again)."""
    out = []
    rows = _query(data, _BATCHES_SQL)
    for span_id, service, queue, start_ns, duration_ns, raw in rows:
        try:
            a = json.loads(raw or "{}")
        except ValueError:
            continue
        size = int(a.get(bn.SIZE) or 0)
        max_size = int(a.get(bn.MAX_SIZE) or 0)
        out.append(BatchRow(str(span_id), str(service), str(queue or ""), int(start_ns), int(duration_ns), size,
                            max_size, size / max_size if max_size else math.nan, str(a.get(bn.CUT_REASON)),
                            float(a.get(bn.MAX_DELAY_MS, math.nan))))
    return out


_MESSAGES_SQL = BATCH_MESSAGES_CTE + """
SELECT trace_id, span_id, batch_id, wait_ns FROM messages
"""


@dataclass
class _Message:
    """One batched message of request ``row`` (a unary request has one, a stream one per message it queued): its
    ``batch_id`` and queue wait ``wait_ns`` (its ``queue`` child span's duration, ns)."""

    row: int
    service: str
    method: str
    batch_id: str
    wait_ns: int
    duration_ms: float


def load_messages(data: StoreData) -> list[_Message]:
    """Every batched message of the requests in ``data`` (:data:`zoomer_serve.report.build.BATCH_MESSAGES_CTE`,
    the source of the report's Batching table); an empty list when the store cannot be read again."""
    rows = _query(data, _MESSAGES_SQL)
    req = data.requests
    index = {(t, s): i for i, (t, s) in enumerate(zip(req["trace_id"].tolist(), req["span_id"].tolist()))}
    out = []
    for trace_id, span_id, batch_id, wait_ns in rows:
        i = index.get((trace_id, span_id))
        if i is not None:
            out.append(_Message(i, str(req["service"][i]), str(req["method"][i]), str(batch_id), int(wait_ns),
                                float(req["duration_ms"][i])))
    return out


def _request_ms(messages: list[_Message]) -> float:
    """Summed duration (ms) of the distinct requests of ``messages``."""
    return float(sum({m.row: m.duration_ms for m in messages}.values()))


@dataclass
class _Member:
    """A batched request as its span's ``zoomer.batch.*`` attributes give it (for a stream: its last message's
    batch, share and items; the share-outlier detector works on these)."""

    row: int
    service: str
    method: str
    batch_id: str
    share: float
    items: int
    wait_ns: int
    duration_ms: float


def _members(data: StoreData) -> list[_Member]:
    req = data.requests
    out = []
    for i in range(len(req)):
        raw = req["attributes"][i]
        if bn.BATCH_ID not in raw:  # most stores hold no batches: skip the JSON
            continue
        a = data.attributes(i)
        try:
            out.append(_Member(i, str(req["service"][i]), str(req["method"][i]), str(a[bn.BATCH_ID]),
                               float(a.get(bn.SHARE, 0.0)), int(a.get(bn.ITEMS, 0)), int(a.get(bn.QUEUE_WAIT, 0)),
                               float(req["duration_ms"][i])))
        except (TypeError, ValueError):
            continue
    return out


def detect_batching(data: StoreData) -> list[Finding]:
    """The store detectors of this module (see its docstring)."""
    members = _members(data)
    if not members:
        return []
    batches = load_batches(data)
    messages = load_messages(data)
    out = detect_queue_wait(data, messages, batches)
    out.extend(detect_under_filled(data, batches, messages))
    out.extend(detect_share_outliers(data, members, batches))
    return out


def _cuts(batches: list[BatchRow]) -> dict[str, Any]:
    fills = [b.fill for b in batches if not math.isnan(b.fill)]
    reasons = Counter(b.cut_reason for b in batches)
    delays = [b.max_delay_ms for b in batches if not math.isnan(b.max_delay_ms)]
    return {"batches_count": len(batches), "mean_fill": float(np.mean(fills)) if fills else None,
            "cut_by_delay_share": reasons.get(bn.CUT_DELAY, 0) / len(batches) if batches else None,
            "cut_reasons": dict(reasons), "max_delay_ms": max(delays) if delays else None,
            "mean_batch_size": float(np.mean([b.size for b in batches])) if batches else None}


def detect_queue_wait(data: StoreData, messages: list[_Message], batches: list[BatchRow]) -> list[Finding]:
    """``batch.queue-wait`` per service and method (see the module docstring). The share counts every batched
    message (a stream's too) over the batched requests' time: the report's Batching table's wait share."""
    out = []
    by_id = {b.span_id: b for b in batches}
    groups: dict[tuple[str, str], list[_Message]] = defaultdict(list)
    for m in messages:
        groups[(m.service, m.method)].append(m)
    for (service, method), group in sorted(groups.items()):
        durations = {m.row: m.duration_ms for m in group}
        if len(durations) < MIN_BATCHED_REQUESTS:
            continue
        waits_ms = np.array([m.wait_ns / NS_PER_MS for m in group])
        total_ms = float(sum(durations.values()))
        share = float(waits_ms.sum()) / total_ms if total_ms > 0 else 0.0
        if share < QUEUE_WAIT_SHARE:
            continue
        theirs = [by_id[bid] for bid in {m.batch_id for m in group} if bid in by_id]
        cuts = _cuts(theirs)
        latency = np.array(list(durations.values()))
        delay = cuts["max_delay_ms"]
        delay_cut = cuts["cut_by_delay_share"]
        why = (f"{delay_cut:.0%} of their batches were cut by the {delay:g} ms delay, filled {cuts['mean_fill']:.0%} "
               f"on average" if delay is not None and delay_cut is not None and cuts["mean_fill"] is not None
               else "their batches waited to fill")
        out.append(Finding(
            id="batch.queue-wait", title=f"Queue wait dominates the latency of {method}",
            severity=severity_for_share(share),
            summary=(f"{len(durations)} batched requests spent {share:.0%} of their time waiting for a batch "
                     f"(queue wait p50 {np.quantile(waits_ms, 0.5):.2f} ms, p99 {np.quantile(waits_ms, 0.99):.2f} ms; "
                     f"latency p50 {np.quantile(latency, 0.5):.2f} ms); {why}."),
            evidence={"requests_count": len(durations), "messages_count": len(group), "queue_wait_share": share,
                      "queue_wait_p50_ms": float(np.quantile(waits_ms, 0.5)),
                      "queue_wait_p99_ms": float(np.quantile(waits_ms, 0.99)),
                      "latency_p50_ms": float(np.quantile(latency, 0.5)), **cuts, AT_STAKE: share},
            items=[{"trace_id": data.requests["trace_id"][m.row], "queue_wait_ms": m.wait_ns / NS_PER_MS,
                    "duration_ms": m.duration_ms, "batch_id": m.batch_id}
                   for m in sorted(group, key=lambda m: -m.wait_ns)[:MAX_ITEMS]],
            recommendation=("The batching delay is too long for this load: requests wait for batches that do not "
                            "fill. Lower the maximum delay toward the time the load takes to fill a batch (max "
                            "size / arrival rate), or cut batches as soon as the model is idle instead of waiting "
                            "out the delay; keep the delay only where the larger batches pay for it in throughput."),
            source=str(data.path), scope=f"{service} {method}"))
    return out


def detect_under_filled(data: StoreData, batches: list[BatchRow],
                        messages: list[_Message] | None = None) -> list[Finding]:
    """``batch.under-filled`` per service and queue (see the module docstring); ``batches_count`` counts the queue's
    batch spans (the report's Batching table counts the same batches over a service's messages). The time at stake
    is the queue wait of the messages in batches cut by the delay, as a share of their requests' time."""
    out = []
    by_batch: dict[str, list[_Message]] = defaultdict(list)
    for m in messages or []:
        by_batch[m.batch_id].append(m)
    groups: dict[tuple[str, str], list[BatchRow]] = defaultdict(list)
    for b in batches:
        groups[(b.service, b.queue)].append(b)
    for (service, queue), group in sorted(groups.items()):
        cuts = _cuts(group)
        if len(group) < MIN_BATCHES or cuts["mean_fill"] is None or cuts["cut_by_delay_share"] is None:
            continue
        if cuts["mean_fill"] >= UNDER_FILL or cuts["cut_by_delay_share"] < UNDER_FILL_DELAY_SHARE:
            continue
        window_s = (group[-1].start_ns + group[-1].duration_ns - group[0].start_ns) / 1e9
        arrivals = sum(b.size for b in group)
        rate = arrivals / window_s if window_s > 0 else math.nan
        delay = cuts["max_delay_ms"]
        max_size = max(b.max_size for b in group)
        per_delay = rate * delay / 1000 if delay is not None and not math.isnan(rate) else math.nan
        needed_ms = max_size / rate * 1000 if rate and not math.isnan(rate) else math.nan
        arithmetic = (f" Requests arrived at {rate:.0f}/s: filling {max_size} takes about {needed_ms:.1f} ms of "
                      f"arrivals, against a {delay:g} ms delay." if not math.isnan(per_delay) else "")
        cut = [m for b in group if b.cut_reason == bn.CUT_DELAY for m in by_batch.get(b.span_id, ())]
        cut_time_ms = _request_ms(cut)
        at_stake = sum(m.wait_ns for m in cut) / NS_PER_MS / cut_time_ms if cut_time_ms > 0 else 0.0
        toward = (f"raise the delay toward the {needed_ms:.1f} ms it takes the load to fill a batch"
                  if not math.isnan(per_delay) else "raise the delay")
        out.append(Finding(
            id="batch.under-filled", title=f"Batches of {queue} are mostly under-filled",
            severity=severity_for_share(at_stake),
            summary=(f"{len(group)} batches filled {cuts['mean_fill']:.0%} of their maximum {max_size} on average; "
                     f"{cuts['cut_by_delay_share']:.0%} were cut by the delay.{arithmetic}"),
            evidence={**cuts, "max_size": max_size, "arrival_rate_per_s": rate,
                      "requests_per_delay": per_delay, "fill_time_ms": needed_ms, AT_STAKE: at_stake},
            items=[{"batch_id": b.span_id, "size": b.size, "fill": b.fill, "cut_reason": b.cut_reason}
                   for b in group[:MAX_ITEMS]],
            recommendation=("The batches run nearly empty, so each forward pass does its fixed work for few "
                            f"requests. If the latency budget allows, {toward}; otherwise the replica gets too "
                            "little load for its batch size: send it more clients (fewer replicas), or lower the "
                            "maximum size to what the load fills."),
            source=str(data.path), scope=f"{service} {queue}"))
    return out


def detect_share_outliers(data: StoreData, members: list[_Member], batches: list[BatchRow]) -> list[Finding]:
    """``batch.share-outlier`` per service and queue (see the module docstring)."""
    out = []
    queue_of = {b.span_id: (b.service, b.queue) for b in batches}
    groups: dict[tuple[str, str], list[_Member]] = defaultdict(list)
    for m in members:
        groups[queue_of.get(m.batch_id, (m.service, ""))].append(m)
    for (service, queue), group in sorted(groups.items()):
        by_batch: dict[str, list[_Member]] = defaultdict(list)
        for m in group:
            by_batch[m.batch_id].append(m)
        mixed = [ms for ms in by_batch.values() if len(ms) > 1]
        if len(mixed) < MIN_BATCHES:
            continue
        finding = _dominant_method(data, mixed, service, queue) or _large_requests(data, mixed, service, queue)
        if finding is not None:
            out.append(finding)
    return out


def _dominant_method(data: StoreData, batches: list[list[_Member]], service: str, queue: str) -> Finding | None:
    count: Counter[str] = Counter()
    time_share: dict[str, float] = defaultdict(float)
    for ms in batches:
        for m in ms:
            count[m.method] += 1
            time_share[m.method] += m.share
    if len(count) < 2:
        return None
    n, total = sum(count.values()), sum(time_share.values())
    method, t = max(time_share.items(), key=lambda kv: kv[1])
    time_frac, req_frac = t / total, count[method] / n
    if time_frac < DOMINANT_TIME_SHARE or time_frac < DOMINANT_LIFT * req_frac:
        return None
    items = [{"method": k, "requests_share": count[k] / n, "time_share": time_share[k] / total}
             for k, _ in sorted(time_share.items(), key=lambda kv: -kv[1])[:MAX_ITEMS]]
    at_stake = time_frac - req_frac
    return Finding(
        id="batch.share-outlier", title=f"{method} dominates the batches of {queue}",
        severity=severity_for_share(at_stake),
        summary=(f"In {len(batches)} mixed batches, {method} is {req_frac:.0%} of the requests but takes "
                 f"{time_frac:.0%} of the batch time (by the share rule)."),
        evidence={"method": method, "requests_share": req_frac, "time_share": time_frac,
                  "batches_count": len(batches), AT_STAKE: at_stake},
        items=items,
        recommendation=(f"{method} requests are much larger than the others they share batches with: every request "
                        "in those batches waits for them. Give them a queue (and batch size) of their own, or cap "
                        "their size, so that the small requests are not held behind them."),
        source=str(data.path), scope=f"{service} {queue}")


def _large_requests(data: StoreData, batches: list[list[_Member]], service: str, queue: str) -> Finding | None:
    outliers: list[tuple[_Member, float]] = []
    for ms in batches:
        median = float(np.median([m.share for m in ms]))
        outliers.extend((m, m.share / median) for m in ms if median > 0 and m.share >= OUTLIER_RATIO * median)
    n = sum(len(ms) for ms in batches)
    if not outliers or len(outliers) < OUTLIER_MIN_SHARE_OF_MEMBERS * n:
        return None
    outliers.sort(key=lambda mr: -mr[1])
    total = sum(m.share for ms in batches for m in ms)
    median_of = {id(m): float(np.median([o.share for o in ms])) for ms in batches for m in ms}
    at_stake = sum(m.share - median_of[id(m)] for m, _ in outliers) / total if total > 0 else 0.0
    items = [{"trace_id": data.requests["trace_id"][m.row], "method": m.method, "items": m.items, "share": m.share,
              "times_batch_median": ratio, "batch_id": m.batch_id} for m, ratio in outliers[:MAX_ITEMS]]
    return Finding(
        id="batch.share-outlier", title=f"Large requests dominate their batches in {queue}",
        severity=severity_for_share(at_stake),
        summary=(f"{len(outliers)} of {n} batched requests ({len(outliers) / n:.0%}) took at least "
                 f"{OUTLIER_RATIO:g}x the median share of their batch; the largest {items[0]['times_batch_median']:.1f}x "
                 f"({items[0]['items']} items)."),
        evidence={"outliers_count": len(outliers), "batched_requests_count": n,
                  "outlier_ratio_threshold": OUTLIER_RATIO, AT_STAKE: at_stake},
        items=items,
        recommendation=("A few large requests set the time of the batches they join. Bucket requests by size (one "
                        "queue per size class), cap the items per request, or count the batch's maximum in items so "
                        "that one large request fills a batch on its own."),
        source=str(data.path), scope=f"{service} {queue}")


# -- trace ---------------------------------------------------------------------------------------------------
def detect_small_batches(trace: KinetoTrace) -> list[Finding]:
    """``batch.small-for-gpu``: kernels launched inside batch ranges (see the module docstring)."""
    from zoomer_serve.analysis.trace_detectors import kernel_groups
    from zoomer_serve.profiling.labels import parse_batch_label

    a = trace.annotations
    if not len(a):
        return []
    names = a["name"]
    ranges = [i for i in np.flatnonzero(~a["on_gpu"]) if str(names[i]).startswith("zoomer.batch/")
              and parse_batch_label(str(names[i])) is not None]
    k, rt = trace.kernels, trace.runtime
    if len(ranges) < MIN_TRACE_BATCHES or not len(k) or not len(rt):
        return []
    inside: set[int] = set()
    for i in ranges:
        lo, hi = float(a["ts"][i]), float(a["ts"][i] + a["dur"][i])
        sel = (rt["pid"] == a["pid"][i]) & (rt["tid"] == a["tid"][i]) & (rt["ts"] >= lo) & (rt["ts"] <= hi)
        inside.update(int(c) for c in rt["correlation"][sel])
    ksel = np.isin(k["correlation"], np.array(sorted(inside), dtype=np.int64))
    if not ksel.any():
        return []
    dur = k["dur"][ksel]
    total = float(dur.sum())
    occ = k["occupancy"][ksel]
    known = ~np.isnan(occ) & (occ > 0)
    occupancy = float((occ[known] * dur[known]).sum() / dur[known].sum()) if known.any() else math.nan
    dev = int(np.bincount(k["device"][ksel].astype(np.int64)).argmax())
    sms = int(trace.device_properties.get(dev, {}).get("numSms", 0) or 0)
    small = (k["grid_blocks"][ksel] > 0) & (k["grid_blocks"][ksel] < sms) if sms else np.zeros(len(dur), bool)
    small_share = float(dur[small].sum()) / total if total > 0 else 0.0
    if not (occupancy < SMALL_OCCUPANCY_PCT or small_share >= SMALL_GRID_SHARE):
        return []
    weak = small | (known & (np.nan_to_num(occ, nan=100.0) < SMALL_OCCUPANCY_PCT))
    at_stake = float(dur[weak].sum()) / total if total > 0 else 0.0
    grids = k["grid_blocks"][ksel]
    items = [{"kernel": g.kernel, "variants": g.variants, "count": g.count, "total_us": g.total_us,
              "grid_blocks": int(grids[g.indices].max())}
             for g in kernel_groups([str(n) for n in k["name"][ksel]], dur.tolist())[:MAX_ITEMS]]
    occ_text = f"{occupancy:.0f}%" if not math.isnan(occupancy) else "unknown"
    return [Finding(
        id="batch.small-for-gpu", title="Batches too small to keep the GPU busy",
        severity=severity_for_share(at_stake),
        summary=(f"The {int(ksel.sum())} kernels of {len(ranges)} batches ran at {occ_text} estimated achieved "
                 f"occupancy (kernel-time weighted); {small_share:.0%} of their time in grids smaller than the "
                 f"GPU's {sms} SMs."),
        evidence={"batches_count": len(ranges), "kernels_count": int(ksel.sum()), "kernel_time_us": total,
                  "occupancy_pct": None if math.isnan(occupancy) else occupancy,
                  "small_grid_time_share": small_share, "sm_count": sms, AT_STAKE: at_stake},
        items=items,
        recommendation=("Each batch gives the GPU too little work per kernel: raise the batcher's maximum size "
                        "(and the delay it may wait, within the latency budget) so batches carry more rows, or "
                        "merge the queues of replicas that share a GPU; check batch.under-filled in the store for "
                        "whether the load can fill larger batches."),
        source=str(trace.path), scope=f"device {dev}")]
