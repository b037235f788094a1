"""A real ``zoomer-serve collector`` process for tests (``python -m zoomer_serve collector``), and exporters
that count what the collector acknowledged: raw OTLP requests over gRPC and HTTP whose spans and metric points
carry unique names, so that the store can be checked against exactly what was answered success."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from _collector_fixtures import METRICS_EXPORT, TRACE_EXPORT, http_post, kv, raw_trace_request
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

REPO_ROOT = Path(__file__).resolve().parents[1]
T0 = 1_800_000_000_000_000_000


@dataclass
class CollectorProcess:
    """A running collector process (its own process group) and its ready line."""

    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    store: Path

    @property
    def grpc_port(self) -> int:
        return int(self.ready["grpc_port"])

    @property
    def http_port(self) -> int:
        return int(self.ready["http_port"])

    def signal_pid(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float = 60.0) -> tuple[int, str, str]:
        """Wait for the exit; returns (exit code, rest of stdout, stderr)."""
        out, err = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_collector(store: Path, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                    host: str = "127.0.0.1") -> CollectorProcess:
    """``python -m zoomer_serve collector --store STORE --grpc-port 0 --http-port 0`` in a new session (so
    that signals to its process group reach it alone); returns once the ready line was read.

    Raises:
        RuntimeError: the process exited before its ready line (with its stderr).
    """
    cmd = [sys.executable, "-m", "zoomer_serve", "collector", "--store", str(store), "--host", host,
           "--grpc-port", "0", "--http-port", "0", *extra_args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=30)
        raise RuntimeError(f"collector exited with {proc.returncode} before its ready line: {err}")
    ready = json.loads(line)
    assert ready["event"] == "ready", ready
    return CollectorProcess(proc, ready, store)


def metrics_request(names: Sequence[str]) -> ExportMetricsServiceRequest:
    """One gauge data point per name (value = its index)."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.append(kv("service.name", AnyValue(string_value="raw")))
    sm = rm.scope_metrics.add()
    for i, name in enumerate(names):
        sm.metrics.add(name=name).gauge.data_points.add(time_unix_nano=T0 + i, as_int=i)
    return req


@dataclass
class AckedExporter:
    """Sends raw OTLP exports (spans and gauge points with unique names) over gRPC or HTTP and records the
    names of everything the collector answered success for."""

    grpc_port: int
    http_port: int
    spans_per_request: int = 50
    points_per_request: int = 5
    acked_spans: set[str] = field(default_factory=set)
    acked_points: set[str] = field(default_factory=set)
    sent_spans: set[str] = field(default_factory=set)
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def export_once(self, transport: str, channel: grpc.Channel | None = None) -> bool:
        """One trace export and one metrics export; True when both were acknowledged."""
        tag = uuid.uuid4().hex[:12]
        spans = raw_trace_request(self.spans_per_request, service="acked")
        span_names = []
        for i, span in enumerate(spans.resource_spans[0].scope_spans[0].spans):
            span.name = f"s-{tag}-{i}"
            span_names.append(span.name)
        point_names = [f"m-{tag}-{i}" for i in range(self.points_per_request)]
        with self._lock:
            self.sent_spans.update(span_names)
        ok_spans = self._send(transport, TRACE_EXPORT, "/v1/traces", spans.SerializeToString(), channel)
        ok_points = self._send(transport, METRICS_EXPORT, "/v1/metrics",
                               metrics_request(point_names).SerializeToString(), channel)
        with self._lock:
            if ok_spans:
                self.acked_spans.update(span_names)
            if ok_points:
                self.acked_points.update(point_names)
            self.failures += (not ok_spans) + (not ok_points)
        return ok_spans and ok_points

    def _send(self, transport: str, method: str, path: str, payload: bytes, channel: grpc.Channel | None) -> bool:
        try:
            if transport == "grpc":
                if channel is not None:
                    channel.unary_unary(method)(payload, timeout=30)
                else:
                    with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as own:
                        own.unary_unary(method)(payload, timeout=30)
                return True
            return http_post(self.http_port, path, payload)[0] == 200
        except (grpc.RpcError, OSError):
            return False


def stored_names(con: Any) -> tuple[set[str], set[str]]:
    """(span names, metric names) in the store behind the DuckDB connection ``con``."""
    spans = {r[0] for r in con.execute("SELECT name FROM spans").fetchall()}
    points = {r[0] for r in con.execute("SELECT metric_name FROM metric_points").fetchall()}
    return spans, points


SIGNALS = {"sigint-group": (signal.SIGINT, True), "sigterm-pid": (signal.SIGTERM, False),
           "sigterm-group": (signal.SIGTERM, True)}
