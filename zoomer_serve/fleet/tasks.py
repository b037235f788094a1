"""One task of the fleet job: read one Kineto trace artifact and reduce it to the figures the fleet compares.

:func:`analyze_artifact` runs in a worker (a process of the local pool, or a Ray worker): it reads the file
through fsspec, checks its size and SHA-256 against the manifest (a mismatch is :class:`CorruptArtifact`),
loads it with the single-trace reader (:func:`~zoomer_serve.analysis.kineto.load_trace_bytes`) and returns a
small dict (:class:`TraceFigures` as a dict): a few numbers and the trace's top kernels, whatever the trace's
size. Errors: :class:`CorruptArtifact` and :class:`~zoomer_serve.analysis.kineto.TraceFormatError` (both
ValueError: never retried), OSError (the storage: retried by the engines).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

TOP_KERNELS = 64
"""Kernels kept per trace (by GPU time): the kernel mix and kernel comparisons use these."""


class ArtifactError(ValueError):
    """The artifact cannot be analysed and trying again will not help: it is missing, or damaged."""


class CorruptArtifact(ArtifactError):
    """The artifact's bytes are not what its manifest says (size or SHA-256)."""


@dataclass
class TraceFigures:
    """What one trace contributes (times in µs).

    Attributes:
        url / instance / service / gpu_model / session_id / start_ns / end_ns: from the manifest.
        requests: requests the trace covers (the manifest's count; else the trace's request ranges; else its
            profiler steps; else 1).
        kernel_count / kernel_time_us: all GPU kernels of the trace.
        busy_us / window_us: GPU busy time (kernels and copies merged over streams) and the window from the first
            GPU operation's start to the last one's end, summed over devices.
        kernels: ``[name, count, time_us]`` of the top :data:`TOP_KERNELS` kernels, most time first.
        events: events read; warnings: the reader's warnings about odd content.
    """

    url: str
    instance: str
    service: str
    gpu_model: str
    session_id: str
    start_ns: int
    end_ns: int
    requests: int
    kernel_count: int
    kernel_time_us: float
    busy_us: float
    window_us: float
    kernels: list[list[Any]] = field(default_factory=list)
    events: int = 0
    warnings: list[str] = field(default_factory=list)


def read_verified(url: str, size: int | None, sha256: str | None) -> bytes:
    """The artifact's bytes, checked against its manifest. Raises OSError (storage), CorruptArtifact."""
    from zoomer_serve.artifacts.storage import filesystem

    fs, path = filesystem(url)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise ArtifactError(f"{url}: the artifact is missing (its manifest is there)") from None
    if size is not None and len(data) != size:
        raise CorruptArtifact(f"{url}: {len(data)} bytes, the manifest says {size}")
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise CorruptArtifact(f"{url}: SHA-256 differs from the manifest's")
    return bytes(data)


def run_task(task: tuple[str, int | None]) -> dict[str, Any] | None:
    """The fleet job's task: ``(manifest URL, since_ns)``. Reads the manifest and analyses its trace
    (:func:`analyze_artifact`); the dict also holds the manifest's ``resource`` attributes. None when the
    artifact ended before ``since_ns``.

    Raises:
        OSError: the storage could not be read (worth a retry).
        ArtifactError / TraceFormatError (ValueError): manifest or trace missing or damaged (not retried).
    """
    from zoomer_serve.artifacts.layout import Manifest
    from zoomer_serve.artifacts.storage import filesystem

    url, since_ns = task
    fs, path = filesystem(url)
    try:
        manifest = Manifest.from_json(fs.cat_file(path))
    except FileNotFoundError:
        raise ArtifactError(f"{url}: the manifest vanished") from None
    except ValueError as exc:
        raise ArtifactError(f"{url}: {exc}") from None
    if since_ns is not None and manifest.end_ns < since_ns:
        return None
    out = analyze_artifact({"url": manifest.url, "bytes": manifest.bytes, "sha256": manifest.sha256,
                            "instance": manifest.instance, "service": manifest.service,
                            "gpu_model": manifest.gpu_model, "session_id": manifest.session_id,
                            "start_ns": manifest.start_ns, "end_ns": manifest.end_ns, "requests": manifest.requests})
    out["resource"] = manifest.resource
    out["host"] = manifest.host
    return out


def analyze_artifact(task: dict[str, Any]) -> dict[str, Any]:
    """Analyse the trace artifact a task names (keys: ``url``, ``bytes``, ``sha256``, ``instance``,
    ``service``, ``gpu_model``, ``session_id``, ``start_ns``, ``end_ns``, ``requests``). Returns
    :class:`TraceFigures` as a dict.

    Raises:
        OSError: the storage could not be read (worth a retry).
        CorruptArtifact / TraceFormatError (ValueError): the file is damaged (not retried).
    """
    from zoomer_serve.analysis.kineto import load_trace_bytes
    from zoomer_serve.analysis.timeline import gpu_utilization

    data = read_verified(task["url"], task.get("bytes"), task.get("sha256"))
    trace = load_trace_bytes(data, name=task["url"])
    del data
    k = trace.kernels
    util = gpu_utilization(trace)
    devices = util["stream"] == -1
    names, inverse = np.unique(k["name"].astype(str), return_inverse=True) if len(k) else (np.array([]), None)
    kernels: list[list[Any]] = []
    if inverse is not None:
        time_us = np.bincount(inverse, weights=k["dur"], minlength=len(names))
        count = np.bincount(inverse, minlength=len(names))
        for i in np.argsort(-time_us, kind="stable")[:TOP_KERNELS]:
            kernels.append([str(names[i]), int(count[i]), float(time_us[i])])
    figures = TraceFigures(
        url=task["url"], instance=task["instance"], service=task["service"], gpu_model=task.get("gpu_model") or "",
        session_id=task.get("session_id") or "", start_ns=int(task.get("start_ns") or 0),
        end_ns=int(task.get("end_ns") or 0), requests=_requests(task, trace), kernel_count=len(k),
        kernel_time_us=float(k["dur"].sum()) if len(k) else 0.0,
        busy_us=float(util["busy_us"][devices].sum()), window_us=float(util["window_us"][devices].sum()),
        kernels=kernels, events=trace.event_count, warnings=list(trace.warnings))
    return asdict(figures)


def _requests(task: dict[str, Any], trace: Any) -> int:
    if int(task.get("requests") or 0) > 0:
        return int(task["requests"])
    from zoomer_serve.analysis.labels import REQUEST_LABEL_PREFIX

    a = trace.annotations
    if len(a):
        names = a["name"].astype(str)
        cpu = ~a["on_gpu"]
        labelled = {n for n in names[cpu] if n.startswith(REQUEST_LABEL_PREFIX)}
        if labelled:
            return len(labelled)
        steps = int(np.sum(np.char.startswith(names[cpu].astype("U"), "ProfilerStep#")))
        if steps:
            return steps
    return 1
