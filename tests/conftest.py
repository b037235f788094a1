"""Shared fixtures: a real embedded OTLP collector on 127.0.0.1 (port 0) with a DuckDB store in a tmp dir,
and zoomer-serve telemetry configured to export to it over real OTLP."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import zoomer_serve
from zoomer_serve.collector import EmbeddedCollector
from zoomer_serve.collector.store import open_readonly

os.environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", "60000")

# A suite started in the background by a shell without job control (`nohup pytest &`, some CI runners) inherits
# SIGINT ignored, and so would every server it starts: the tests that stop one as Ctrl+C does would wait in vain
# (such a process keeps an ignored signal ignored, as it should). Give this process, and so its children, the
# default that a terminal gives.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _process_recorder_as_found() -> Iterator[None]:
    """The process keeps one request recorder across configure() calls (zoomer_serve.runtime): what a test
    hangs on it and leaves there (a SpanWatch, an observer of its own) is taken off after the test, so that the
    next test's recorder is as the process would have it."""
    from zoomer_serve import runtime

    before = runtime._recorder
    observers = before.observers if before is not None else ()
    yield
    after = runtime._recorder
    if after is not None:
        after.observers = tuple(o for o in after.observers if o in observers)


@dataclass
class CollectorHandle:
    """A running embedded collector; :meth:`finish` stops telemetry and the collector and reads the store."""

    collector: EmbeddedCollector
    store_path: Path
    stopped: bool = False
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.collector.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.collector.http_port}"

    def stop(self) -> None:
        if not self.stopped:
            self.collector.stop()
            self.stopped = True

    def finish(self) -> None:
        """Flush zoomer-serve telemetry (everything it acknowledged reaches the store) and stop."""
        zoomer_serve.shutdown()
        self.stop()

    def spans(self, kind: str | None = None) -> list[dict[str, Any]]:
        """All span rows (``attributes``/``events``/``links`` parsed from JSON); stops everything first."""
        self.finish()
        con = open_readonly(self.store_path)
        try:
            cur = con.execute("SELECT * FROM spans ORDER BY start_ns")
            cols = [d[0] for d in cur.description]
            rows = [dict(zip(cols, row)) for row in cur.fetchall()]
        finally:
            con.close()
        for row in rows:
            for key in ("attributes", "resource_attributes", "events", "links"):
                if isinstance(row.get(key), str):
                    row[key] = json.loads(row[key])
        return [row for row in rows if kind is None or row["kind"] == kind]

    def metric_points(self, name: str) -> list[dict[str, Any]]:
        self.finish()
        con = open_readonly(self.store_path)
        try:
            cur = con.execute("SELECT * FROM metric_points WHERE metric_name = ? ORDER BY time_ns", [name])
            cols = [d[0] for d in cur.description]
            rows = [dict(zip(cols, row)) for row in cur.fetchall()]
        finally:
            con.close()
        for row in rows:
            for key in ("attributes", "bucket_counts", "explicit_bounds"):
                if isinstance(row.get(key), str):
                    row[key] = json.loads(row[key])
        return rows


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorHandle]:
    store = tmp_path / "store.duckdb"
    col = EmbeddedCollector(store, host="127.0.0.1", grpc_port=0, http_port=0)
    col.start()
    handle = CollectorHandle(col, store)
    yield handle
    zoomer_serve.shutdown(timeout_s=2)
    handle.stop()


@pytest.fixture
def telemetry(collector: CollectorHandle) -> Iterator[zoomer_serve.Telemetry]:
    """zoomer-serve exporting over OTLP/gRPC to the test collector, through the helper process."""
    tel = zoomer_serve.configure(service_name="test-svc", endpoint=collector.grpc_endpoint, protocol="grpc",
                                 export_mode="process", schedule_delay_ms=100, timeout_ms=5000,
                                 set_global_providers=False)
    yield tel
    zoomer_serve.shutdown(timeout_s=2)
