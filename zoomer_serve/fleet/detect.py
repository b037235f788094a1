"""Fleet findings: replicas that stand out from their peers, kernels whose time per request differs most
between replicas, and replicas with a different kernel mix.

Peers are the replicas of one service on one GPU model (``zoomer.gpu.model``; "" for CPU-only replicas);
latency is compared per method. Every comparison uses median and MAD (:mod:`~zoomer_serve.fleet.stats`), and
a replica stands out on a metric when both hold:

- its modified z-score is at least :data:`~zoomer_serve.fleet.stats.Z_THRESHOLD` (3.5) in the metric's bad
  direction (both directions for the GPU figures), and
- it differs from the peers' median by at least the metric's ``min_relative`` share of the median and its
  ``min_absolute`` amount: a tight fleet does not turn noise into findings.

At least :data:`MIN_PEERS` replicas with the figure are needed for a comparison. A p99 taken from a few hundred
requests rests on a handful of them, so a high p99 counts only when more of the replica's requests lie above
the peers' median p99 than chance would put there (a binomial test at :data:`TAIL_ALPHA`, Bonferroni over the
replicas compared): one unlucky request does not make an outlier.

Findings (ids as :data:`FLEET_DETECTOR_IDS`): ``fleet.outlier-replica`` (one per replica, every metric it
stands out on, with the resource attributes where it differs from its peers), ``fleet.kernel-spread`` (one
per peer group: the kernels whose time per request varies most across replicas), ``fleet.kernel-mix`` (one
per replica whose kernel mix, the share of kernel time per kernel, is far from its peers': kernels only it
runs, kernels it lacks, and the resource attributes that differ, since a different torch, driver or model
version is the usual cause). Each carries ``at_stake_share`` (:data:`FLEET_AT_STAKE_MEANING`) and takes its
severity from it by the analysis's one rule (:func:`~zoomer_serve.analysis.findings.severity_for_share`).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from zoomer_serve.analysis.findings import AT_STAKE, Finding, severity_for_share
from zoomer_serve.fleet.aggregate import ReplicaFigures
from zoomer_serve.fleet.spans import LATENCY_BUCKETS_PER_DOUBLING
from zoomer_serve.fleet.stats import Z_THRESHOLD, binomial_tail, robust

MIN_PEERS = 5
TAIL_ALPHA = 0.01
"""Significance of a high p99 against its sampling noise, for all the replicas of a comparison together."""
MIX_MIN_DISTANCE = 0.1
"""A kernel mix this far (total variation distance, 0..1) from the peers' median mix, at least, to count."""
MIX_KERNEL_SHARE = 0.01
KERNEL_MIN_RATIO = 1.2
MAX_ITEMS = 10
IDENTITY_ATTRIBUTES = frozenset({"service.instance.id", "host.name", "host.id", "host.ip", "process.pid",
                                 "process.parent_pid", "container.id", "k8s.pod.name", "k8s.pod.uid",
                                 "k8s.pod.ip", "service.name"})
"""Resource attributes that name the replica itself: never a "difference" between replicas."""

FLEET_DETECTOR_IDS = {
    "fleet.outlier-replica": "a replica far from its peers (same service and GPU model) on latency, GPU busy share, "
                             "kernel time per request, allocator retries or host CPU (median and MAD)",
    "fleet.kernel-spread": "kernels whose time per request differs most between the replicas of a peer group",
    "fleet.kernel-mix": "a replica whose kernel mix differs from its peers', with the resource attributes that differ",
}

FLEET_AT_STAKE_MEANING = {
    "fleet.outlier-replica": "the replica's distance from the peers' median / the larger of the two, on the figure "
                             "where it stands out most (the share of its time, work or busy share beyond its peers')",
    "fleet.kernel-spread": "time per request the most spread kernel takes above the median on its slowest replica / "
                           "that replica's kernel time per request",
    "fleet.kernel-mix": "the share of the replica's kernel time distributed unlike its peers' median mix (total "
                        "variation distance)",
}
"""What ``at_stake_share`` measures for each fleet detector; the severity follows from it by the analysis's one rule
(:func:`~zoomer_serve.analysis.findings.severity_for_share`)."""


@dataclass(frozen=True)
class Metric:
    """A per-replica figure compared across peers: ``name``, ``label``, ``unit``, ``direction`` ("high": high is
    bad; "both"), ``min_relative`` (share of the median) and ``min_absolute`` (in ``unit``) a difference needs."""

    name: str
    label: str
    unit: str
    direction: str
    min_relative: float
    min_absolute: float


METRICS = (
    Metric("p99_ms", "p99 latency", "ms", "high", 0.2, 1.0),
    Metric("kernel_us_per_request", "GPU kernel time per request", "us", "high", 0.2, 1.0),
    Metric("gpu_busy_share", "GPU busy share of the profiled window", "ratio", "both", 0.15, 0.1),
    Metric("gpu_utilization", "GPU utilization (NVML)", "ratio", "both", 0.15, 0.1),
    Metric("alloc_retries_per_request", "allocator retries per request", "1/request", "high", 0.0, 0.001),
    Metric("host_cpu", "process CPU utilization", "ratio", "high", 0.2, 0.05),
)
METRIC_BY_NAME = {m.name: m for m in METRICS}


def peer_groups(replicas: list[ReplicaFigures]) -> dict[tuple[str, str], list[ReplicaFigures]]:
    """Replicas by (service, GPU model), each group sorted by instance."""
    out: dict[tuple[str, str], list[ReplicaFigures]] = defaultdict(list)
    for r in replicas:
        out[(r.service, r.gpu_model)].append(r)
    return {k: sorted(v, key=lambda r: r.instance) for k, v in sorted(out.items())}


def _values(group: list[ReplicaFigures], metric: str) -> list[tuple[ReplicaFigures, str, float]]:
    """(replica, method or "", value) for every replica of ``group`` that has the figure."""
    out = []
    for r in group:
        if metric == "p99_ms":
            for method, m in r.methods.items():
                if m.get("p99_ms") is not None:
                    out.append((r, method, float(m["p99_ms"])))
            continue
        v = getattr(r, metric)
        if v is not None and not math.isnan(v):
            out.append((r, "", float(v)))
    return out


def outliers(replicas: list[ReplicaFigures]) -> list[dict[str, Any]]:
    """Every (replica, metric[, method]) that stands out from its peers (see the module docstring), ranked:
    largest |z| first (ties: larger ratio to the median)."""
    found: list[dict[str, Any]] = []
    for (service, gpu), group in peer_groups(replicas).items():
        for metric in METRICS:
            by_method: dict[str, list[tuple[ReplicaFigures, float]]] = defaultdict(list)
            for r, method, v in _values(group, metric.name):
                by_method[method].append((r, v))
            for method, rows in by_method.items():
                if len(rows) < MIN_PEERS:
                    continue
                stats = robust([v for _, v in rows])
                for r, v in rows:
                    z = stats.z(v)
                    diff = v - stats.median
                    bad = z >= Z_THRESHOLD if metric.direction == "high" else abs(z) >= Z_THRESHOLD
                    if not bad or abs(diff) < max(metric.min_absolute, metric.min_relative * abs(stats.median)):
                        continue
                    entry = {
                        "service": service, "gpu_model": gpu, "instance": r.instance, "metric": metric.name,
                        "label": metric.label, "unit": metric.unit, "method": method, "value": v,
                        "peer_median": stats.median, "peer_mad": stats.mad, "z": z,
                        "ratio": v / stats.median if stats.median else math.inf, "peers": stats.n,
                        "direction": "high" if diff > 0 else "low"}
                    if metric.name == "p99_ms" and not _tail_is_real(r.methods[method], stats.median, len(rows),
                                                                      entry):
                        continue
                    found.append(entry)
    found.sort(key=lambda o: (-min(abs(o["z"]), 1e12), -abs(math.log(o["ratio"])) if o["ratio"] not in (0, math.inf)
                              else -1e12, o["instance"], o["metric"]))
    for rank, o in enumerate(found, 1):
        o["rank"] = rank
    return found


def _tail_is_real(method: dict[str, Any], peer_p99_ms: float, peers: int, entry: dict[str, Any]) -> bool:
    """Whether a replica's high p99 is more than the sampling noise of a p99 taken from few requests: of its
    requests, more lie above the peers' median p99 than 1 % (what the peers' own p99 means) would put there
    by chance, at :data:`TAIL_ALPHA` over the ``peers`` compared (Bonferroni). Counts come from the latency
    buckets (a request in the threshold's own bucket is not counted); without buckets the check passes. Puts
    ``requests_above_peer_p99`` and ``tail_p_value`` in ``entry``."""
    buckets = method.get("latency_buckets")
    if not buckets:
        return True
    per = LATENCY_BUCKETS_PER_DOUBLING
    edge = math.floor(math.log2(max(peer_p99_ms * 1e6, 1.0)) * per)
    above = sum(n for b, n in buckets.items() if b > edge)
    total = sum(buckets.values())
    p = binomial_tail(above, total, 0.01)
    entry["requests_above_peer_p99"] = above
    entry["tail_p_value"] = p
    return p < TAIL_ALPHA / max(peers, 1)


def resource_differences(replica: ReplicaFigures, peers: list[ReplicaFigures]) -> list[dict[str, Any]]:
    """Resource attributes where ``replica`` differs from what most of its ``peers`` have: ``key``, ``value``
    (the replica's), ``peer_value`` (the peers' most common), ``peer_share`` (of the peers with the key)."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for p in peers:
        if p is replica:
            continue
        for k, v in p.resource.items():
            if k not in IDENTITY_ATTRIBUTES:
                counts[k][str(v)] += 1
    out = []
    for key in sorted(set(counts) | {k for k in replica.resource if k not in IDENTITY_ATTRIBUTES}):
        mine = replica.resource.get(key)
        top = counts[key].most_common(1)
        if not top:
            if mine is not None and len(peers) > 1:
                out.append({"key": key, "value": str(mine), "peer_value": None, "peer_share": 0.0})
            continue
        value, n = top[0]
        share = n / sum(counts[key].values())
        if share >= 0.5 and str(mine) != value:
            out.append({"key": key, "value": None if mine is None else str(mine), "peer_value": value,
                        "peer_share": share})
    return out


def detect_outlier_replicas(replicas: list[ReplicaFigures], ranked: list[dict[str, Any]], source: str
                            ) -> list[Finding]:
    """``fleet.outlier-replica``: one finding per replica in ``ranked`` (the :func:`outliers` list)."""
    groups = peer_groups(replicas)
    by_replica: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for o in ranked:
        by_replica[(o["service"], o["gpu_model"], o["instance"])].append(o)
    out = []
    for (service, gpu, instance), rows in by_replica.items():
        peers = groups[(service, gpu)]
        replica = next(r for r in peers if r.instance == instance)
        diffs = resource_differences(replica, peers)
        worst = rows[0]
        at_stake = max(_beyond_peers(o["value"], o["peer_median"]) for o in rows)
        parts = [f"{o['label']}{' of ' + o['method'] if o['method'] else ''} {_fmt(o['value'], o['unit'])} vs "
                 f"peer median {_fmt(o['peer_median'], o['unit'])} ({o['ratio']:.2f}x, z {_z(o['z'])})" for o in rows]
        differs = ("; it differs from its peers in " + ", ".join(f"{d['key']} = {d['value']} (peers: {d['peer_value']})"
                                                                 for d in diffs[:5])) if diffs else ""
        out.append(Finding(
            id="fleet.outlier-replica", title=f"Replica {instance} stands out from its {worst['peers']} peers",
            severity=severity_for_share(at_stake),
            summary=f"{service} on {gpu or 'CPU'}: " + "; ".join(parts) + differs + ".",
            evidence={"service": service, "gpu_model": gpu, "instance": instance, "host": replica.host,
                      "rank": worst["rank"], "metrics": rows, "resource_differences": diffs,
                      "sessions": replica.sessions, AT_STAKE: at_stake},
            items=[{k: o[k] for k in ("metric", "method", "value", "peer_median", "z", "ratio", "unit")} for o in rows],
            recommendation=_outlier_advice(rows, diffs), source=source, scope=f"{service} @ {instance}"))
    return out


def _beyond_peers(value: float, peer_median: float) -> float:
    """How far ``value`` lies from the peers' median, as a share (0..1) of the larger of the two."""
    larger = max(abs(value), abs(peer_median))
    return min(1.0, abs(value - peer_median) / larger) if larger > 0 else 0.0


def _outlier_advice(rows: list[dict[str, Any]], diffs: list[dict[str, Any]]) -> str:
    metrics = {o["metric"] for o in rows}
    advice = []
    if diffs:
        advice.append("Its resource attributes differ from its peers' (" + ", ".join(d["key"] for d in diffs[:3])
                      + "): align its image, driver or model version with the others first.")
    if "kernel_us_per_request" in metrics:
        advice.append("Its GPU kernels take longer per request: check GPU clocks and thermal throttling "
                      "(zoomer.gpu.clock.sm, zoomer.gpu.clock_event.active), another process on the GPU, and the "
                      "kernels of fleet.kernel-spread; open its traces' reports (the drill-down links).")
    if "host_cpu" in metrics:
        advice.append("Its process uses more CPU for the same work: look at its CPU profiles (request.cpu-bound-"
                      "phase), thread counts and noisy neighbours on its host.")
    if "alloc_retries_per_request" in metrics:
        advice.append("The caching allocator retries cudaMalloc there: it runs close to the memory limit or "
                      "fragments it (gpu.alloc-retries); set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or "
                      "give it headroom.")
    if metrics & {"gpu_busy_share", "gpu_utilization"}:
        advice.append("Its GPU is busy for a different share of the time than its peers': a different load "
                      "balancer weight, batch size or input mix, or a GPU waiting on the host.")
    if "p99_ms" in metrics and not metrics - {"p99_ms"}:
        advice.append("Only its latency differs: compare its host (CPU throttling, network, noisy neighbours) and "
                      "its load balancer weight with the others'; see request.slow-replica for the phase.")
    advice.append("Drain and restart it if it stays an outlier.")
    return " ".join(advice)


def detect_kernel_spread(replicas: list[ReplicaFigures], source: str) -> list[Finding]:
    """``fleet.kernel-spread``: per peer group, the kernels (run by at least half of the replicas with traces,
    :data:`MIN_PEERS` at least) whose time per request varies most: ranked by the largest ratio of one replica's
    time per request to the median; kept when that replica's z-score is at least 3.5 and the ratio at least
    :data:`KERNEL_MIN_RATIO`."""
    out = []
    for (service, gpu), group in peer_groups(replicas).items():
        per = {r.instance: r.kernel_per_request() for r in group if r.requests > 0}
        if len(per) < MIN_PEERS:
            continue
        names = Counter(name for k in per.values() for name in k)
        rows: list[dict[str, Any]] = []
        for name, n in names.items():
            if n < max(MIN_PEERS, len(per) / 2):
                continue
            values = [(inst, k[name]) for inst, k in per.items() if name in k]
            stats = robust([v for _, v in values])
            if stats.median <= 0:
                continue
            inst, high = max(values, key=lambda iv: iv[1])
            low_inst, low = min(values, key=lambda iv: iv[1])
            ratio, z = high / stats.median, stats.z(high)
            if z < Z_THRESHOLD or ratio < KERNEL_MIN_RATIO:
                continue
            rows.append({"kernel": name, "replicas": len(values), "median_us_per_request": stats.median,
                         "mad_us_per_request": stats.mad, "max_us_per_request": high, "max_instance": inst,
                         "max_over_median": ratio, "max_z": z, "min_us_per_request": low, "min_instance": low_inst,
                         "robust_cv": stats.scale / stats.median,
                         "outlier_instances": sorted(i for i, v in values if stats.z(v) >= Z_THRESHOLD
                                                     and v / stats.median >= KERNEL_MIN_RATIO)})
        if not rows:
            continue
        rows.sort(key=lambda r: (-r["max_over_median"], r["kernel"]))
        top = rows[0]
        slowest_total = sum(per[top["max_instance"]].values())
        at_stake = min(1.0, (top["max_us_per_request"] - top["median_us_per_request"]) / slowest_total) \
            if slowest_total > 0 else 0.0
        out.append(Finding(
            id="fleet.kernel-spread", title=f"Kernel times per request differ between {service} replicas on {gpu or 'CPU'}",
            severity=severity_for_share(at_stake),
            summary=(f"{len(rows)} kernels run much longer per request on some replicas; most: {top['kernel']} takes "
                     f"{top['max_us_per_request']:.1f} us per request on {top['max_instance']}, "
                     f"{top['max_over_median']:.2f}x the median {top['median_us_per_request']:.1f} us over "
                     f"{top['replicas']} replicas."),
            evidence={"service": service, "gpu_model": gpu, "kernels_count": len(rows), "replicas_count": len(per),
                      AT_STAKE: at_stake},
            items=rows[:MAX_ITEMS],
            recommendation=("The same kernel taking longer per request on a few replicas points at those GPUs (clocks, "
                            "thermal or power throttling, ECC errors, a neighbour process) or at larger inputs routed "
                            "to them; the same kernel longer everywhere on a set of replicas sharing an image points at "
                            "a library version. Compare the replicas named with fleet.outlier-replica."),
            source=source, scope=f"{service} on {gpu or 'CPU'}"))
    return out


def detect_kernel_mix(replicas: list[ReplicaFigures], source: str) -> list[Finding]:
    """``fleet.kernel-mix``: replicas whose kernel-time shares are far from their peers' median shares (total
    variation distance; outlier by z-score and at least :data:`MIX_MIN_DISTANCE`)."""
    out = []
    for (service, gpu), group in peer_groups(replicas).items():
        mixed = [r for r in group if r.kernel_time_us > 0 and r.kernels]
        if len(mixed) < MIN_PEERS:
            continue
        names = sorted({n for r in mixed for n in r.kernels})
        index = {n: i for i, n in enumerate(names)}
        shares = np.zeros((len(mixed), len(names)))
        for i, r in enumerate(mixed):
            total = sum(t for _, t in r.kernels.values())
            for n, (_, t) in r.kernels.items():
                shares[i, index[n]] = t / total if total > 0 else 0.0
        median = np.median(shares, axis=0)
        median = median / median.sum() if median.sum() > 0 else median
        distance = 0.5 * np.abs(shares - median).sum(axis=1)
        stats = robust(distance)
        present = (shares >= MIX_KERNEL_SHARE).mean(axis=0)
        for i, r in enumerate(mixed):
            d = float(distance[i])
            if stats.z(d) < Z_THRESHOLD or d < MIX_MIN_DISTANCE:
                continue
            only = [{"kernel": names[j], "share": float(shares[i, j]), "peers_with_it": float(present[j])}
                    for j in np.argsort(-shares[i]) if shares[i, j] >= MIX_KERNEL_SHARE and present[j] <= 0.2]
            missing = [{"kernel": names[j], "peer_median_share": float(median[j])}
                       for j in np.argsort(-median) if median[j] >= MIX_KERNEL_SHARE and shares[i, j] < MIX_KERNEL_SHARE]
            diffs = resource_differences(r, group)
            cause = ("; it differs from its peers in " + ", ".join(f"{x['key']} = {x['value']} (peers: {x['peer_value']})"
                                                                   for x in diffs[:5])) if diffs else \
                "; its resource attributes match its peers'"
            at_stake = min(1.0, d)  # a total variation distance: at most 1, but for rounding
            out.append(Finding(
                id="fleet.kernel-mix", title=f"Replica {r.instance} runs a different kernel mix",
                severity=severity_for_share(at_stake),
                summary=(f"{service} on {gpu or 'CPU'}: {d:.0%} of {r.instance}'s kernel time is distributed unlike its "
                         f"{len(mixed)} peers' median mix (peers: median distance {stats.median:.0%}); "
                         f"{len(only)} kernels only it runs, {len(missing)} it lacks{cause}."),
                evidence={"service": service, "gpu_model": gpu, "instance": r.instance, "mix_distance": d,
                          "peer_median_distance": stats.median, "z": stats.z(d), "only_here": only[:MAX_ITEMS],
                          "missing_here": missing[:MAX_ITEMS], "resource_differences": diffs,
                          "sessions": r.sessions, AT_STAKE: at_stake},
                items=only[:MAX_ITEMS] + [{"kernel": m["kernel"], "missing": True} for m in missing[:MAX_ITEMS]],
                recommendation=("Different kernels for the same model usually mean a different torch, CUDA, cuDNN or "
                                "driver version (other kernel selection and fusion), a different model version or "
                                "dtype, or torch.compile / TF32 settings that differ. "
                                + ("Start with the attributes named above; " if diffs else
                                   "Record the versions as resource attributes (OTEL_RESOURCE_ATTRIBUTES) to see them here; ")
                                + "roll the replica onto the fleet's image if it is not an intended canary."),
                source=source, scope=f"{service} @ {r.instance}"))
    return out


def _fmt(value: float, unit: str) -> str:
    if unit == "ratio":
        return f"{value:.0%}"
    if unit == "1/request":
        return f"{value:.3f}/request"
    return f"{value:.3g} {unit}"


def _z(z: float) -> str:
    return "inf" if math.isinf(z) else f"{z:.1f}"
