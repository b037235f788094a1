"""The collector's tables as rotating Parquet files (hive-partitioned by service and hour) under a folder or
an S3 URL, written by several collectors side by side; ``report`` and ``analyze --store`` read such a dataset
as they read a DuckDB store. Every acknowledged span is counted in the dataset exactly once, through failed
rotations and a rotation that dies between upload and commit."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pytest
from _collector_fixtures import raw_trace_request, tracer_provider
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from zoomer_serve.analysis.api import analyze_store
from zoomer_serve.collector import EmbeddedCollector, Store
from zoomer_serve.collector.cli import build_collector, parquet_config, register
from zoomer_serve.collector.ingest import Ingestor, Signal
from zoomer_serve.collector.parquet import open_source
from zoomer_serve.collector.rotation import ParquetConfig, ParquetRotator
from zoomer_serve.collector.store import NO_EXTENSION_DOWNLOADS, SCHEMA
from zoomer_serve.config import ConfigError
from zoomer_serve.report.build import build_report

ROOT = Path(__file__).resolve().parents[1]

if TYPE_CHECKING:
    from _object_storage import S3

pytest_plugins = ("_object_storage",)  # the s3 fixture


def _send(collector: EmbeddedCollector, transport: str, service: str, n: int) -> None:
    provider = tracer_provider(collector, transport, service=service)
    tracer = provider.get_tracer("t")
    from opentelemetry.trace import SpanKind, StatusCode

    for i in range(n):
        with tracer.start_as_current_span("Predict", kind=SpanKind.SERVER,
                                          attributes={"rpc.method": f"{service}.v1.Svc/Predict",
                                                      "rpc.response.status_code": "OK" if i % 10 else "INTERNAL"}
                                          ) as span:
            if i % 10 == 0:  # a server error: ERROR, as the RPC conventions have an instrumentation mark it
                span.set_status(StatusCode.ERROR, "INTERNAL")
    assert provider.force_flush(30_000)
    provider.shutdown()


def _count(con: duckdb.DuckDBPyConnection, sql: str) -> Any:
    return con.execute(sql).fetchall()


def _as_store(dataset: str, path: Path) -> Path:
    """The dataset's rows in a DuckDB store file (the other kind of input, same rows)."""
    src = open_source(dataset)
    try:
        src.execute(f"ATTACH '{path}' AS copy")
        src.execute(SCHEMA.replace("CREATE TABLE IF NOT EXISTS ", "CREATE TABLE IF NOT EXISTS copy."))
        for table in ("spans", "metric_points"):
            src.execute(f"INSERT INTO copy.{table} BY NAME SELECT * FROM {table}")
        src.execute("DETACH copy")
    finally:
        src.close()
    return path


@pytest.mark.slow
def test_two_collectors_write_side_by_side_and_report_reads_the_dataset(tmp_path: Path) -> None:
    """Two collectors (their own staging files) rotate into one folder every 0.2 s while four SDK exporters send
    over gRPC and HTTP; on stop everything acknowledged is in the dataset once, hive-partitioned, in files named
    per collector. The report and the store analysis of the dataset equal those of a DuckDB store holding the
    same rows."""
    out = tmp_path / "dataset"
    collectors = [EmbeddedCollector(tmp_path / f"stage{i}.duckdb", grpc_port=0, http_port=0,
                                    parquet=ParquetConfig(str(out), rotate_s=0.2)).start() for i in range(2)]
    sent = {"ranker": 0, "scorer": 0}
    try:
        threads = []
        for c, transport, service, n in ((collectors[0], "grpc", "ranker", 300), (collectors[1], "http", "ranker", 200),
                                         (collectors[0], "http", "scorer", 150), (collectors[1], "grpc", "scorer", 250)):
            sent[service] += n
            threads.append(threading.Thread(target=_send, args=(c, transport, service, n)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        stats = [c.stop() for c in collectors]
    assert sum(s["spans_received"] for s in stats) == sum(sent.values())
    assert all(s["parquet_failed"] == 0 and s["parquet_rows"] == s["spans_received"] for s in stats), stats
    files = sorted(p.relative_to(out).parts for p in out.rglob("*.parquet"))
    assert {f[:2] for f in files} == {("spans", "service=ranker"), ("spans", "service=scorer")}
    assert all(f[2].startswith("hour=") and len(f) == 4 for f in files)
    assert len({f[3].rsplit("-", 2)[0] for f in files}) == 2  # one writer id per collector
    for i in range(2):  # the staging files hold nothing any more
        con = duckdb.connect(str(tmp_path / f"stage{i}.duckdb"), read_only=True, config=NO_EXTENSION_DOWNLOADS)
        assert _count(con, "SELECT count(*) FROM spans") == [(0,)]
        con.close()
    con = open_source(str(out))
    assert _count(con, "SELECT service_name, count(*), count(DISTINCT (trace_id, span_id)) FROM spans GROUP BY 1 "
                       "ORDER BY 1") == [("ranker", 500, 500), ("scorer", 400, 400)]
    con.close()
    store = _as_store(str(out), tmp_path / "same.duckdb")
    from_dataset, from_store = build_report(out).to_dict(), build_report(store).to_dict()
    assert from_dataset.pop("store_path") == str(out) and from_store.pop("store_path") == str(store)
    assert from_dataset == from_store
    assert from_dataset["total_requests"] == 900 and from_dataset["total_errors"] == 90
    assert [f.to_dict() | {"source": ""} for f in analyze_store(out)] == \
        [f.to_dict() | {"source": ""} for f in analyze_store(store)]


@pytest.mark.slow
def test_report_and_analyze_read_a_dataset_in_s3(tmp_path: Path, s3: S3) -> None:
    """A collector rotating into ``s3://`` (moto's S3 server, s3fs); ``zoomer-serve report --store s3://...`` and
    ``analyze --store s3://...`` in fresh processes read it through fsspec (DuckDB fetches no extension)."""
    url = s3.url("collector-a")
    collector = EmbeddedCollector(tmp_path / "stage.duckdb", grpc_port=0, http_port=0,
                                  parquet=ParquetConfig(url, rotate_s=60)).start()
    try:
        _send(collector, "grpc", "ranker", 120)
    finally:
        stats = collector.stop()
    assert stats["parquet_rotations"] == 1 and stats["parquet_rows"] == 120 and stats["parquet_files"] >= 1
    keys = s3.fs.find(f"{s3.bucket}/collector-a")
    assert keys and all("/spans/service=ranker/hour=" in k and k.endswith(".parquet") for k in keys)
    done = subprocess.run([sys.executable, "-m", "zoomer_serve", "report", "--store", url, "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["store_path"] == url and report["total_requests"] == 120 and report["total_errors"] == 12
    done = subprocess.run([sys.executable, "-m", "zoomer_serve", "analyze", "--store", url, "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["store"]["tables"]["request_percentiles"]["rows"]
    assert [(r["service"], r["count"], r["errors"]) for r in rows] == [("ranker", 120, 12)]
    missing = subprocess.run([sys.executable, "-m", "zoomer_serve", "report", "--store", s3.url("nothing-here")],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert missing.returncode == 2 and "no Parquet span data" in missing.stderr


class _HeldRotator(ParquetRotator):
    """A rotation that waits after its upload (``held``/``release``), or dies there (``die``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held, self.release = threading.Event(), threading.Event()
        self.release.set()
        self.die = False

    def _upload(self, tmp: Path) -> None:
        super()._upload(tmp)
        self.held.set()
        self.release.wait(30)
        if self.die:
            raise RuntimeError("died between upload and commit")


def _ingest(store: Store, n: int, service: str = "svc") -> None:
    result = Ingestor(store).ingest_message(Signal.TRACES, raw_trace_request(
        n, service=service, attrs={"rpc.method": AnyValue(string_value="s.v1.S/M")}))
    assert result.outcome.value == "ok"


def _staged(store: Store) -> int:
    cur = store.cursor()
    try:
        return int(cur.execute("SELECT count(*) FROM spans").fetchone()[0])
    finally:
        cur.close()


def test_rows_committed_during_a_rotation_wait_for_the_next_and_none_is_lost_or_doubled(tmp_path: Path) -> None:
    out = tmp_path / "dataset"
    store = Store(tmp_path / "stage.duckdb")
    rotator = _HeldRotator(store, ParquetConfig(str(out), rotate_s=3600))
    _ingest(store, 50)
    rotator.release.clear()
    moved: list[int] = []
    t = threading.Thread(target=lambda: moved.append(rotator.rotate()))
    t.start()
    assert rotator.held.wait(30)
    _ingest(store, 30)  # committed while the rotation's transaction is open
    rotator.release.set()
    t.join(30)
    assert moved == [50] and _staged(store) == 30
    assert rotator.rotate() == 30 and _staged(store) == 0
    con = open_source(str(out))
    assert _count(con, "SELECT count(*), count(DISTINCT span_id) FROM spans") == [(80, 80)]
    con.close()
    store.close()


def test_a_rotation_that_dies_after_uploading_is_redone_under_the_same_names(tmp_path: Path) -> None:
    """Upload done, commit not: the rows stay staged; the next rotation (even by a new process on the same
    staging file) writes files of the same names over the first ones, so every row is there once."""
    out = tmp_path / "dataset"
    stage = tmp_path / "stage.duckdb"
    store = Store(stage)
    rotator = _HeldRotator(store, ParquetConfig(str(out), rotate_s=3600))
    _ingest(store, 40)
    rotator.die = True
    assert rotator.rotate() == 0
    assert rotator.stats().failed == 1 and "died between upload and commit" in rotator.stats().last_error
    first = sorted(p.relative_to(out) for p in out.rglob("*.parquet"))
    assert first and _staged(store) == 40
    writer = rotator.writer_id
    _ingest(store, 10)
    store.close()
    store = Store(stage)  # "restarted"
    again = ParquetRotator(store, ParquetConfig(str(out), rotate_s=3600))
    assert again.writer_id == writer
    assert again.rotate() == 50
    assert sorted(p.relative_to(out) for p in out.rglob("*.parquet")) == first
    con = open_source(str(out))
    assert _count(con, "SELECT count(*), count(DISTINCT span_id) FROM spans") == [(50, 50)]
    con.close()
    store.close()


@pytest.mark.slow
def test_a_failed_upload_keeps_the_rows_staged_until_it_works(tmp_path: Path) -> None:
    blocked = tmp_path / "dataset"
    blocked.write_text("a file where the dataset's folder should be")
    store = Store(tmp_path / "stage.duckdb")
    sleeps: list[float] = []
    rotator = ParquetRotator(store, ParquetConfig(str(blocked), rotate_s=3600, retries=2, backoff_s=0.01),
                             sleep=sleeps.append)
    _ingest(store, 25)
    assert rotator.rotate() == 0 and _staged(store) == 25
    assert rotator.stats().failed == 1 and sleeps == [0.01, 0.02] and rotator.stats().retries == 2
    blocked.unlink()
    assert rotator.rotate() == 25 and _staged(store) == 0
    assert rotator.stats().rotations == 1 and rotator.stats().rows == 25
    store.close()


def test_the_cli_flags_and_variables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["collector", "--store", str(tmp_path / "s.duckdb"), "--grpc-port", "0",
                              "--http-port", "0", "--parquet-url", str(tmp_path / "out"), "--parquet-rotate-s", "5"])
    collector = build_collector(args)
    assert collector.config.parquet == ParquetConfig(str(tmp_path / "out"), rotate_s=5.0)
    plain = parser.parse_args(["collector"])
    assert parquet_config(plain, {}) is None
    assert parquet_config(plain, {"ZOOMER_COLLECTOR_PARQUET_URL": "memory://b/p",
                                  "ZOOMER_COLLECTOR_PARQUET_ROTATE_S": "30"}) == ParquetConfig("memory://b/p",
                                                                                              rotate_s=30)
    # a URL whose protocol fsspec does not know (or whose package is missing) is refused at start, naming where
    # it came from; it used to start and then fail on every rotation, the rows piling up staged
    with pytest.raises(ConfigError, match=r"ZOOMER_COLLECTOR_PARQUET_URL: cannot use bogus://x: .*bogus"):
        parquet_config(plain, {"ZOOMER_COLLECTOR_PARQUET_URL": "bogus://x"})
    flagged = parser.parse_args(["collector", "--parquet-url", "bogus://x"])
    with pytest.raises(ConfigError, match=r"--parquet-url: cannot use bogus://x"):
        parquet_config(flagged, {})
    with pytest.raises(ValueError, match="bogus"):
        ParquetConfig("bogus://x")
    with pytest.raises(ConfigError, match="ZOOMER_COLLECTOR_PARQUET_ROTATE_S"):
        parquet_config(plain, {"ZOOMER_COLLECTOR_PARQUET_URL": "x", "ZOOMER_COLLECTOR_PARQUET_ROTATE_S": "soon"})
    for endless in ("inf", "1e400", "nan"):  # an endless period made the rotation thread's wait raise
        with pytest.raises(ConfigError, match="ZOOMER_COLLECTOR_PARQUET_ROTATE_S: rotate_s must be a finite "
                                              "number > 0"):
            parquet_config(plain, {"ZOOMER_COLLECTOR_PARQUET_URL": "x", "ZOOMER_COLLECTOR_PARQUET_ROTATE_S": endless})
    with pytest.raises(SystemExit) as refused:  # checked as the arguments are read, naming the flag
        parser.parse_args(["collector", "--parquet-url", "x", "--parquet-rotate-s", "0"])
    assert refused.value.code == 2
    assert "argument --parquet-rotate-s: '0' is not a number > 0" in capsys.readouterr().err


def test_a_parquet_file_cut_short_is_named_in_one_line_by_report_analyze_and_fleet(tmp_path: Path) -> None:
    """A cut-short file in the dataset (a partial copy) made ``report`` and ``fleet analyze`` print DuckDB's
    traceback: now one line naming the file, exit 2 (a bad store, as for every zoomer-serve command)."""
    out = tmp_path / "dataset"
    store = Store(tmp_path / "stage.duckdb")
    _ingest(store, 20)
    assert ParquetRotator(store, ParquetConfig(str(out), rotate_s=3600)).rotate() == 20
    store.close()
    bad = next(out.rglob("*.parquet"))
    bad.write_bytes(bad.read_bytes()[:500])
    for argv in (["report", "--store", str(out)], ["analyze", "--store", str(out)], ["fleet", "analyze", str(out)]):
        done = subprocess.run([sys.executable, "-m", "zoomer_serve", *argv], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr and "internal error" not in done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot read the Parquet data under" in lines[0] and bad.name in lines[0], lines


def test_an_upload_cut_short_never_appears_under_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files reach a local dataset under a ``.partial`` name and are renamed once complete: a copy that fails
    half way leaves no file that readers would take for Parquet, and the rows stay staged."""
    import os

    import fsspec.implementations.local as local

    def half_copy(self: Any, lpath: str, rpath: str, **kwargs: Any) -> None:
        Path(rpath).write_bytes(Path(lpath).read_bytes()[:100])
        raise OSError("disk full")

    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError("cross-device link")))
    monkeypatch.setattr(local.LocalFileSystem, "put_file", half_copy)
    out = tmp_path / "dataset"
    store = Store(tmp_path / "stage.duckdb")
    _ingest(store, 15)
    rotator = ParquetRotator(store, ParquetConfig(str(out), rotate_s=3600, retries=0))
    assert rotator.rotate() == 0 and _staged(store) == 15 and "disk full" in rotator.stats().last_error
    assert not list(out.rglob("*.parquet")) and list(out.rglob("*.parquet.partial"))
    monkeypatch.undo()
    assert rotator.rotate() == 15 and not list(out.rglob("*.partial"))
    con = open_source(str(out))
    assert _count(con, "SELECT count(*) FROM spans") == [(15,)]
    con.close()
    store.close()
