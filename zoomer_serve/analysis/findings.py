"""Findings: what a detector concluded, with the numbers behind it and what to do about it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("high", "medium", "low", "info")
"""Severity levels, most severe first."""

AT_STAKE = "at_stake_share"
"""The evidence key every finding carries: the share (0..1) of time at stake, as :data:`AT_STAKE_MEANING`
defines it per detector. The severity follows from it alone (:func:`severity_for_share`)."""

SEVERITY_THRESHOLDS = (("high", 0.25), ("medium", 0.05), ("low", 0.005))
"""The one rule for severity: a finding is ``high`` when at least 25% of the time in question is at stake,
``medium`` from 5%, ``low`` from 0.5%, ``info`` below (documented in docs/analysis.md, "Severity")."""


def severity_for_share(share: float) -> str:
    """The severity of a finding whose share of time at stake is ``share`` (0..1; NaN counts as 0), by
    :data:`SEVERITY_THRESHOLDS`."""
    if not share or math.isnan(share):
        return "info"
    for severity, threshold in SEVERITY_THRESHOLDS:
        if share >= threshold:
            return severity
    return "info"


@dataclass(frozen=True)
class Finding:
    """One conclusion of a detector.

    Attributes:
        id: the detector's stable id, e.g. ``"cuda.host-sync"`` (see :data:`DETECTOR_IDS`).
        title: a short headline.
        severity: one of :data:`SEVERITIES`.
        summary: one or two sentences with the key numbers.
        evidence: the figures the conclusion rests on, named with their unit as suffix (``_us``, ``_ms``,
            ``_bytes``, ``_share`` for 0..1 fractions, ``_count``).
        items: the events, kernels, requests or replicas involved (most important first, at most a few
            dozen), each a dict of plain values.
        recommendation: what to change, concretely.
        source: the trace file or store the finding comes from.
        scope: what the finding is about within the source (``"device 0"``, a method, a replica), or "".
    """

    id: str
    title: str
    severity: str
    summary: str
    evidence: dict[str, Any]
    recommendation: str
    items: list[dict[str, Any]] = field(default_factory=list)
    source: str = ""
    scope: str = ""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN / infinity become None)."""
        return _clean(asdict(self))


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first, then by id and scope (stable, deterministic order)."""
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), f.id, f.source, f.scope))


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # NumPy scalars
        return _clean(value.item())
    return value


DETECTOR_IDS = {
    "gpu.low-utilization": "GPU idle for much of the trace; idle split into host wait, kernel wait, other",
    "gpu.launch-bound": "many short kernels whose launch costs more CPU time than they run",
    "cuda.host-sync": "the CPU blocks on the GPU (stream/device/event synchronize, blocking copies)",
    "cuda.pageable-copy": "copies between the GPU and pageable (unpinned) host memory",
    "gpu.fp32-no-tensor-cores": "float32 matrix multiplies / convolutions that do not use tensor cores",
    "gpu.low-occupancy": "kernels with low achieved occupancy taking a large share of GPU time",
    "gpu.memory-fragmentation": "the caching allocator reserves much more memory than tensors use",
    "gpu.alloc-retries": "cudaMalloc failed and was retried after flushing the allocator cache",
    "gpu.oom": "requests failed with CUDA out-of-memory",
    "request.cpu-bound-phase": "a CPU phase (preprocess / postprocess) takes longer than the forward pass",
    "request.tail-latency": "p99 latency far above the median; the slowest requests and what they share",
    "request.slow-replica": "a replica (service.instance.id) much slower than the fleet median",
    "batch.queue-wait": "batched requests spend most of their time waiting for a batch: the delay is too long",
    "batch.under-filled": "batches mostly cut by the delay far below their maximum size",
    "batch.share-outlier": "one request type, or a few large requests, take most of the batches' time",
    "batch.small-for-gpu": "kernels of batches run at low occupancy / in small grids: batches too small for the GPU",
    "collective.straggler": "a rank that starts the collectives last and makes the other ranks wait",
    "collective.exposed-communication": "communication that computation does not hide on a rank",
}
"""Every detector id with what it looks for."""


AT_STAKE_MEANING = {
    "gpu.low-utilization": "idle time / the device's window (first to last GPU operation)",
    "gpu.launch-bound": "time the GPU waited on the host and on launches / the device's window",
    "cuda.host-sync": "time the CPU blocked in synchronising calls / the CPU-side window, or / the request "
                      "ranges' time when the calls fell inside requests (the larger)",
    "cuda.pageable-copy": "pageable copy time / GPU busy time (kernels, copies, memsets)",
    "gpu.fp32-no-tensor-cores": "time of the float32 kernels without tensor cores / the device's kernel time",
    "gpu.low-occupancy": "time of the low-occupancy kernels / the device's kernel time",
    "gpu.memory-fragmentation": "reserved but unused bytes / reserved bytes (memory, not time)",
    "gpu.alloc-retries": "requests that stalled on a retry / sampled requests",
    "gpu.oom": "requests that failed with out-of-memory / the replica's requests",
    "request.cpu-bound-phase": "the phase's time / the requests' time",
    "request.tail-latency": "time the slowest 1% spent above the median / the method's request time",
    "request.slow-replica": "time the replica's requests spent above the other replicas' median / the method's "
                            "request time",
    "batch.queue-wait": "queue wait / the batched requests' time",
    "batch.under-filled": "queue wait in batches cut by the delay / the time of their requests",
    "batch.share-outlier": "batch time the outliers take beyond their share of requests / the batches' time",
    "batch.small-for-gpu": "kernel time of batches in small grids or at low occupancy / the batches' kernel time",
    "collective.straggler": "time the other ranks waited for this rank / the ranks' collective time",
    "collective.exposed-communication": "communication not hidden by computation / the rank's window",
}
"""What ``at_stake_share`` measures for each detector (see :func:`severity_for_share`)."""
