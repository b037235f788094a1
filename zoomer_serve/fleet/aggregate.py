"""Folding task results into per-replica figures as they arrive, and writing them as Parquet.

:class:`FleetAggregator` keeps one :class:`ReplicaFigures` per replica (``service``, ``service.instance.id``)
with sums and a capped kernel table (:data:`MAX_KERNELS` per replica): its memory grows with the number of
replicas, not of traces. Every trace's own figures go to :class:`ResultsWriter`, which writes them in Parquet
parts of :data:`PART_ROWS` rows next to the data (``<out>/traces/part-NNNNN.parquet``, and the kernels of each
trace in ``<out>/trace_kernels/``) and forgets them.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from zoomer_serve.artifacts.storage import StorageError, filesystem, is_local, join, url_of
from zoomer_serve.collector.store import NO_EXTENSION_DOWNLOADS

MAX_KERNELS = 256
"""Kernels kept per replica (most GPU time first); beyond, the time goes to :data:`OTHER_KERNELS`."""
OTHER_KERNELS = "(other kernels)"
PART_ROWS = 1000


@dataclass
class ReplicaFigures:
    """One replica's figures across its traces and span data (times: kernels µs, latency ms).

    Trace side: ``traces``, ``requests`` (covered by the traces), ``kernel_time_us``, ``busy_us``,
    ``window_us``, ``kernels`` (name -> ``[count, time_us]``), ``sessions`` (``[session_id, trace url]``,
    at most 20), ``resource`` (the first manifest's resource attributes).
    Span side: ``methods`` (method -> ``{"count", "p50_ms", "p99_ms", "errors", "latency_buckets"}``, the
    buckets as :data:`~zoomer_serve.fleet.spans.LATENCY_BUCKETS_PER_DOUBLING` says), ``span_requests``,
    ``alloc_retries`` (sum of ``zoomer.gpu.memory.alloc_retries``), ``host_cpu`` (mean
    ``process.cpu.utilization``), ``gpu_utilization`` (mean ``hw.gpu.utilization``).
    """

    service: str
    instance: str
    gpu_model: str = ""
    host: str = ""
    traces: int = 0
    requests: int = 0
    kernel_time_us: float = 0.0
    busy_us: float = 0.0
    window_us: float = 0.0
    kernels: dict[str, list[float]] = field(default_factory=dict)
    sessions: list[list[str]] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)
    span_requests: int = 0
    span_errors: int = 0
    alloc_retries: float = 0.0
    host_cpu: float | None = None
    gpu_utilization: float | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.service, self.instance

    @property
    def kernel_us_per_request(self) -> float | None:
        return self.kernel_time_us / self.requests if self.requests > 0 else None

    @property
    def gpu_busy_share(self) -> float | None:
        return self.busy_us / self.window_us if self.window_us > 0 else None

    @property
    def alloc_retries_per_request(self) -> float | None:
        return self.alloc_retries / self.span_requests if self.span_requests > 0 else None

    def kernel_per_request(self) -> dict[str, float]:
        """Kernel name -> µs per covered request."""
        if self.requests <= 0:
            return {}
        return {name: t / self.requests for name, (_, t) in self.kernels.items() if name != OTHER_KERNELS}

    def add_trace(self, figures: dict[str, Any]) -> None:
        self.traces += 1
        self.requests += int(figures["requests"])
        self.kernel_time_us += float(figures["kernel_time_us"])
        self.busy_us += float(figures["busy_us"])
        self.window_us += float(figures["window_us"])
        self.gpu_model = self.gpu_model or str(figures.get("gpu_model") or "")
        self.host = self.host or str(figures.get("host") or "")
        if not self.resource and figures.get("resource"):
            self.resource = dict(figures["resource"])
        if len(self.sessions) < 20:
            self.sessions.append([str(figures.get("session_id") or ""), str(figures["url"])])
        for name, count, time_us in figures["kernels"]:
            acc = self.kernels.setdefault(name, [0.0, 0.0])
            acc[0] += count
            acc[1] += time_us
        if len(self.kernels) > MAX_KERNELS:
            ranked = sorted(self.kernels.items(), key=lambda kv: -kv[1][1])
            other = [0.0, 0.0]
            for _, (c, t) in ranked[MAX_KERNELS - 1:]:
                other[0] += c
                other[1] += t
            self.kernels = dict(ranked[:MAX_KERNELS - 1])
            self.kernels[OTHER_KERNELS] = [a + b for a, b in zip(self.kernels.get(OTHER_KERNELS, [0.0, 0.0]), other)]

    def row(self) -> dict[str, Any]:
        """A flat row for the replica table (``--json``, Parquet)."""
        main = max(self.methods.items(), key=lambda kv: kv[1]["count"], default=(None, None))
        return {"service": self.service, "instance": self.instance, "gpu_model": self.gpu_model, "host": self.host,
                "traces": self.traces, "requests_profiled": self.requests,
                "kernel_us_per_request": _num(self.kernel_us_per_request), "gpu_busy_share": _num(self.gpu_busy_share),
                "requests": self.span_requests, "errors": self.span_errors,
                "main_method": main[0], "p99_ms": _num(main[1]["p99_ms"]) if main[1] else None,
                "p50_ms": _num(main[1]["p50_ms"]) if main[1] else None,
                "alloc_retries_per_request": _num(self.alloc_retries_per_request),
                "host_cpu": _num(self.host_cpu), "gpu_utilization": _num(self.gpu_utilization)}


def _num(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


class FleetAggregator:
    """The replicas seen so far (see the module docstring)."""

    def __init__(self) -> None:
        self.replicas: dict[tuple[str, str], ReplicaFigures] = {}

    def replica(self, service: str, instance: str) -> ReplicaFigures:
        key = (service, instance)
        r = self.replicas.get(key)
        if r is None:
            r = self.replicas[key] = ReplicaFigures(service, instance)
        return r

    def add_trace(self, figures: dict[str, Any]) -> None:
        self.replica(str(figures["service"]), str(figures["instance"])).add_trace(figures)


TRACE_COLUMNS = ("url", "service", "instance", "gpu_model", "session_id", "start_ns", "end_ns", "requests",
                 "kernel_count", "kernel_time_us", "busy_us", "window_us", "events", "status", "error", "attempts")
KERNEL_COLUMNS = ("url", "instance", "kernel", "count", "time_us")


class OutputError(OSError):
    """The fleet job's results cannot be written where ``FleetOptions.out`` (or its default) says."""


@contextlib.contextmanager
def writing_to(out: str) -> Iterator[None]:
    """Storage errors inside the block are those of the results' place: raised as :class:`OutputError`
    naming ``out``."""
    try:
        yield
    except OutputError:
        raise
    except (OSError, StorageError) as exc:
        raise OutputError(f"cannot write the results to {out}: {type(exc).__name__}: {exc}") from exc


class ResultsWriter:
    """Writes per-trace rows (:data:`TRACE_COLUMNS`) and their kernels (:data:`KERNEL_COLUMNS`) as Parquet
    parts under ``<out>/results`` (``out`` a URL or folder) every :data:`PART_ROWS` traces and at
    :meth:`close`. Raises :class:`OutputError` for any storage error, naming ``out``."""

    def __init__(self, out: str) -> None:
        self.out = out
        with writing_to(out):
            self.fs, root = filesystem(out)
        self.root = join(root, "results")
        self._traces: list[tuple[Any, ...]] = []
        self._kernels: list[tuple[Any, ...]] = []
        self._parts = 0
        self.files: list[str] = []

    def add(self, figures: dict[str, Any] | None, url: str, error: str, attempts: int) -> None:
        if figures is None:
            self._traces.append((url, "", "", "", "", 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, "failed", error, attempts))
        else:
            f = figures
            self._traces.append((f["url"], f["service"], f["instance"], f["gpu_model"], f["session_id"],
                                 int(f["start_ns"]), int(f["end_ns"]), int(f["requests"]), int(f["kernel_count"]),
                                 float(f["kernel_time_us"]), float(f["busy_us"]), float(f["window_us"]),
                                 int(f["events"]), "ok", "", attempts))
            self._kernels.extend((f["url"], f["instance"], name, int(c), float(t)) for name, c, t in f["kernels"])
        if len(self._traces) >= PART_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self._traces:
            return
        self._write("traces", TRACE_COLUMNS, self._traces)
        if self._kernels:
            self._write("trace_kernels", KERNEL_COLUMNS, self._kernels)
        self._traces, self._kernels = [], []
        self._parts += 1

    def close(self) -> list[str]:
        self.flush()
        return self.files

    def _write(self, name: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
        cols = {c: np.array(v, dtype=object if isinstance(v[0], str) else None) for c, v in zip(columns, zip(*rows))}
        target = join(self.root, name, f"part-{self._parts:05d}.parquet")
        with writing_to(self.out), tempfile.TemporaryDirectory(prefix="zoomer-fleet-") as tmp:
            local = Path(tmp) / "part.parquet"
            con = duckdb.connect(config=NO_EXTENSION_DOWNLOADS)
            try:
                con.register("batch", cols)
                con.execute(f"COPY batch TO '{str(local).replace(chr(39), chr(39) * 2)}' (FORMAT parquet, "
                            "COMPRESSION zstd)")
            finally:
                con.close()
            if is_local(self.fs):
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(local), target)
        self.files.append(url_of(self.fs, target))
