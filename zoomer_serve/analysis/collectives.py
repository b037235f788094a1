"""Collectives across the ranks of a distributed job: one Kineto trace per rank (several files, or a folder).

- :func:`collectives_per_rank`: NCCL kernels per collective (AllReduce, AllGather, ReduceScatter, SendRecv,
  ...) and rank: count, GPU time, mean and longest.
- :func:`overlap_per_rank`: communication against computation per rank: how much communication ran while
  computation did (hidden) and how much did not (exposed), as HTA's ``get_comm_comp_overlap``.
- :func:`stragglers`: the n-th instance of each collective is matched across ranks (by order of start on
  each rank); a rank that starts it last makes the others wait. Per rank: collectives matched, how often it
  was last, its mean lateness (start minus the earliest rank's start) and the time the others spent waiting
  for it (summed over the instances it was last: the mean of its start minus each other rank's start).
- :func:`detect_collectives`: findings ``collective.straggler`` and ``collective.exposed-communication``.

A rank is ``distributedInfo.rank`` of the trace's metadata (Kineto writes it for NCCL jobs), else the
trace's position on the command line. Traces of one rank should come from one clock: Kineto's timestamps
are each host's Unix time, so hosts must be NTP-synchronised for the lateness figures to mean anything.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

from zoomer_serve.analysis.breakdown import time_breakdown
from zoomer_serve.analysis.findings import AT_STAKE, Finding, severity_for_share
from zoomer_serve.analysis.kernels import kernel_kinds
from zoomer_serve.analysis.kineto import KinetoTrace
from zoomer_serve.analysis.table import Table

US = "us"
_COLLECTIVE = re.compile(r"(?i)(all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|send_?recv|"
                         r"reduce|gather|scatter|send|recv)")
_CANONICAL = {"allreduce": "AllReduce", "allgather": "AllGather", "reducescatter": "ReduceScatter",
              "alltoall": "AllToAll", "broadcast": "Broadcast", "sendrecv": "SendRecv", "reduce": "Reduce",
              "gather": "Gather", "scatter": "Scatter", "send": "Send", "recv": "Recv"}
# collective.straggler: last in at least this share of at least this many matched collectives, this late.
STRAGGLER_LAST_SHARE = 0.5
STRAGGLER_MIN_MATCHED = 10
STRAGGLER_MIN_LATENESS_US = 100.0
# collective.exposed-communication: communication not hidden behind computation, share of communication
# time, for communication taking at least this share of the window.
EXPOSED_SHARE = 0.5
EXPOSED_MIN_COMM_SHARE = 0.05


def rank_of(trace: KinetoTrace, default: int) -> int:
    """``distributedInfo.rank`` of the trace, else ``default``."""
    info = trace.metadata.get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else default


def ranks(traces: list[KinetoTrace]) -> list[int]:
    """The rank of each trace; when two traces claim one rank, positions are used for all."""
    found = [rank_of(t, i) for i, t in enumerate(traces)]
    return found if len(set(found)) == len(found) else list(range(len(traces)))


def collective_of(name: str) -> str:
    """The collective a communication kernel runs, from its name (``ncclKernel_AllReduce_RING_LL_Sum_float``
    -> "AllReduce"); "other" when the name says none."""
    m = _COLLECTIVE.search(name)
    return _CANONICAL.get(m.group(1).replace("_", "").lower(), "other") if m else "other"


def _comm(trace: KinetoTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Communication kernels: (start us, duration us, collective, device), by start."""
    k = trace.kernels
    sel = kernel_kinds(k["name"]) == "communication" if len(k) else np.zeros(0, dtype=bool)
    names = k["name"][sel]
    coll = np.array([collective_of(str(n)) for n in names], dtype=object)
    return k["ts"][sel] + trace.origin_us, k["dur"][sel], coll, k["device"][sel]


def collectives_per_rank(traces: list[KinetoTrace]) -> Table:
    """NCCL (communication) kernels per rank and collective.

    Columns: ``rank``, ``collective``, ``count``, ``total_us``, ``mean_us``, ``max_us``, ``share`` (of the
    rank's summed communication time, 0..1).
    """
    rows = []
    for rank, t in zip(ranks(traces), traces):
        _, dur, coll, _ = _comm(t)
        total = float(dur.sum())
        for c in sorted(set(coll.tolist())):
            d = dur[coll == c]
            rows.append((rank, c, int(len(d)), float(d.sum()), float(d.mean()), float(d.max()),
                         float(d.sum()) / total if total > 0 else 0.0))
    rows.sort(key=lambda r: (r[0], -r[3]))
    return Table.from_rows(
        "collectives", ("rank", "collective", "count", "total_us", "mean_us", "max_us", "share"), rows,
        units={"total_us": US, "mean_us": US, "max_us": US, "share": "ratio"},
        description="communication kernels per rank and collective",
        dtypes={"rank": np.int64, "collective": object, "count": np.int64, "total_us": np.float64,
                "mean_us": np.float64, "max_us": np.float64, "share": np.float64})


def overlap_per_rank(traces: list[KinetoTrace]) -> Table:
    """Communication against computation per rank and device.

    Columns: ``rank``, ``device``, ``communication_us``, ``computation_us``, ``hidden_us`` (communication
    while computation ran), ``exposed_us`` (communication alone), ``hidden_share`` (hidden / communication,
    0..1; NaN without communication), ``communication_share`` (of the device's window).
    """
    rows = []
    for rank, t in zip(ranks(traces), traces):
        for r in time_breakdown(t).rows():
            comm, hidden = r["communication_us"], r["computation_communication_overlap_us"]
            rows.append((rank, r["device"], comm, r["computation_us"], hidden, comm - hidden,
                         hidden / comm if comm > 0 else float("nan"),
                         comm / r["window_us"] if r["window_us"] > 0 else 0.0))
    return Table.from_rows(
        "communication_overlap", ("rank", "device", "communication_us", "computation_us", "hidden_us",
                                  "exposed_us", "hidden_share", "communication_share"), rows,
        units={"communication_us": US, "computation_us": US, "hidden_us": US, "exposed_us": US,
               "hidden_share": "ratio", "communication_share": "ratio"},
        description="communication hidden behind computation, and exposed, per rank (as HTA's comm/comp overlap)",
        dtypes={"rank": np.int64, "device": np.int64})


def matched_instances(traces: list[KinetoTrace]) -> dict[str, np.ndarray]:
    """Per collective, the start times (Unix us) of its n-th instance on each rank: an array of shape
    (instances, ranks), as many instances as the rank with the fewest has."""
    per_rank = [_comm(t) for t in traces]
    out: dict[str, np.ndarray] = {}
    kinds = set().union(*(set(c.tolist()) for _, _, c, _ in per_rank)) if per_rank else set()
    for kind in sorted(kinds):
        starts = [np.sort(ts[coll == kind]) for ts, _, coll, _ in per_rank]
        n = min(len(s) for s in starts)
        if n:
            out[kind] = np.stack([s[:n] for s in starts], axis=1)
    return out


def stragglers(traces: list[KinetoTrace]) -> Table:
    """Per rank, how late it starts the collectives all ranks run (see the module docstring).

    Columns: ``rank``, ``matched`` (collective instances seen on every rank), ``last`` (instances it
    started last), ``last_share``, ``mean_lateness_us``, ``max_lateness_us``, ``others_waited_us``.
    Most waited-for first.
    """
    rk = ranks(traces)
    n = len(traces)
    matched = 0
    last = np.zeros(n, dtype=np.int64)
    lateness: list[list[float]] = [[] for _ in range(n)]
    waited = np.zeros(n)
    if n >= 2:
        for starts in matched_instances(traces).values():
            matched += len(starts)
            first = starts.min(axis=1, keepdims=True)
            late = starts - first
            for r in range(n):
                lateness[r].extend(late[:, r].tolist())
            who = np.argmax(starts, axis=1)
            for i, r in enumerate(who.tolist()):
                last[r] += 1
                others = np.delete(starts[i], r)
                waited[r] += float((starts[i, r] - others).mean())
    rows = [(rk[r], matched, int(last[r]), last[r] / matched if matched else 0.0,
             float(np.mean(lateness[r])) if lateness[r] else 0.0, float(np.max(lateness[r])) if lateness[r] else 0.0,
             float(waited[r])) for r in range(n)]
    rows.sort(key=lambda r: -r[6])
    return Table.from_rows(
        "stragglers", ("rank", "matched", "last", "last_share", "mean_lateness_us", "max_lateness_us",
                       "others_waited_us"), rows,
        units={"last_share": "ratio", "mean_lateness_us": US, "max_lateness_us": US, "others_waited_us": US},
        description="how late each rank starts the collectives every rank runs (matched by order)",
        dtypes={"rank": np.int64, "matched": np.int64, "last": np.int64, "last_share": np.float64,
                "mean_lateness_us": np.float64, "max_lateness_us": np.float64, "others_waited_us": np.float64})


def collective_tables(traces: list[KinetoTrace]) -> dict[str, Table]:
    """Every table of this module, by name."""
    return {"collectives": collectives_per_rank(traces), "communication_overlap": overlap_per_rank(traces),
            "stragglers": stragglers(traces)}


def detect_collectives(traces: list[KinetoTrace], tables: dict[str, Table] | None = None) -> list[Finding]:
    """``collective.straggler`` and ``collective.exposed-communication`` (thresholds: module constants)."""
    tables = tables or collective_tables(traces)
    source = ", ".join(str(t.path) for t in traces)
    out: list[Finding] = []
    by_rank: dict[int, float] = defaultdict(float)
    for r in tables["collectives"].rows():
        by_rank[r["rank"]] += r["mean_us"] * r["count"]
    for r in tables["stragglers"].rows():
        if r["matched"] < STRAGGLER_MIN_MATCHED or r["last_share"] < STRAGGLER_LAST_SHARE \
                or r["mean_lateness_us"] < STRAGGLER_MIN_LATENESS_US:
            continue
        collective_us = sum(by_rank.values())
        at_stake = r["others_waited_us"] / collective_us if collective_us > 0 else 0.0
        out.append(Finding(
            id="collective.straggler", title=f"Rank {r['rank']} makes the other ranks wait",
            severity=severity_for_share(at_stake),
            summary=(f"Rank {r['rank']} started {r['last']} of {r['matched']} collectives last "
                     f"({r['last_share']:.0%}), on average {r['mean_lateness_us'] / 1e3:.2f} ms after the first "
                     f"rank; the other ranks waited {r['others_waited_us'] / 1e3:.1f} ms for it in all."),
            evidence={"rank": r["rank"], "matched_count": r["matched"], "last_count": r["last"],
                      "last_share": r["last_share"], "mean_lateness_us": r["mean_lateness_us"],
                      "max_lateness_us": r["max_lateness_us"], "others_waited_us": r["others_waited_us"],
                      "collective_us": collective_us, AT_STAKE: at_stake},
            recommendation=("Look at what this rank does before its collectives that the others do not: more data "
                            "or longer sequences in its batches (balance them), slower data loading or host work, "
                            "a slower or throttled GPU, or a busier host. Compare its profiler steps with another "
                            "rank's (--diff)."),
            source=source, scope=f"rank {r['rank']}"))
    for r in tables["communication_overlap"].rows():
        comm = r["communication_us"]
        if comm <= 0 or r["communication_share"] < EXPOSED_MIN_COMM_SHARE or \
                r["exposed_us"] / comm < EXPOSED_SHARE:
            continue
        at_stake = r["communication_share"] * r["exposed_us"] / comm
        out.append(Finding(
            id="collective.exposed-communication",
            title=f"Communication on rank {r['rank']} mostly not overlapped with computation",
            severity=severity_for_share(at_stake),
            summary=(f"{r['exposed_us'] / 1e3:.1f} ms of {comm / 1e3:.1f} ms of communication on rank {r['rank']} "
                     f"(device {r['device']}) ran while no computation did ({1 - r['hidden_share']:.0%})."),
            evidence={"rank": r["rank"], "communication_us": comm, "exposed_us": r["exposed_us"],
                      "hidden_share": r["hidden_share"], "communication_share": r["communication_share"],
                      AT_STAKE: at_stake},
            recommendation=("Overlap communication with computation: bucket gradients (DDP bucket_cap_mb), "
                            "launch collectives asynchronously on their own stream, or prefetch parameters "
                            "(FSDP forward/backward prefetch)."),
            source=source, scope=f"rank {r['rank']}"))
    return out
