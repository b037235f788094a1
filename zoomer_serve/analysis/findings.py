"""Findings: what a detector concluded, with the numbers behind it and what to do about it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("high", "medium", "low", "info")
"""Severity levels, most severe first."""


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
