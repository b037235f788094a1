"""The DuckDB store that the embedded collector writes and the report reads.

One DuckDB file holds everything (default: :func:`default_store_path`). DuckDB allows either one process
that opens the file for writing (the collector) or any number of read-only processes (the report), not
both at once: run the report after the collector has stopped.

Schema (version 1; all times are Unix epoch nanoseconds, ids are lowercase hex)
-----------------------------------------------------------------------------

Table ``spans`` — one row per received span:

================== ========= ===========================================================================
column             type      meaning
================== ========= ===========================================================================
trace_id           VARCHAR   32 lowercase hex characters (16 bytes)
span_id            VARCHAR   16 lowercase hex characters (8 bytes)
parent_span_id     VARCHAR   16 hex characters, NULL for a root span
name               VARCHAR   span name
kind               VARCHAR   'SERVER', 'CLIENT', 'INTERNAL', 'PRODUCER', 'CONSUMER' or 'UNSPECIFIED'
start_ns           BIGINT    start time, Unix epoch ns
end_ns             BIGINT    end time, Unix epoch ns
duration_ns        BIGINT    end_ns - start_ns, ns (negative only if the sender's clock data is)
status_code        VARCHAR   'UNSET', 'OK' or 'ERROR'
status_message     VARCHAR   status description ('' when none)
service_name       VARCHAR   resource attribute ``service.name`` (NULL when absent)
service_instance_id VARCHAR  resource attribute ``service.instance.id`` (NULL when absent)
scope_name         VARCHAR   instrumentation scope name
attributes         JSON      object: attribute key -> JSON value (see "Attribute values")
resource_attributes JSON     object, same encoding
events             JSON      list of {"name": str, "time_ns": int, "attributes": object}
links              JSON      list of {"trace_id": hex, "span_id": hex, "attributes": object}
received_ns        BIGINT    when the collector received the export request, Unix epoch ns
================== ========= ===========================================================================

Table ``metric_points`` — one row per metric data point:

======================= ======= ======================================================================
column                  type    meaning
======================= ======= ======================================================================
metric_name             VARCHAR instrument name
description             VARCHAR instrument description
unit                    VARCHAR UCUM unit as sent (e.g. 'ms', 's', 'By')
metric_type             VARCHAR 'gauge', 'sum', 'histogram', 'exponential_histogram' or 'summary'
service_name            VARCHAR resource attribute ``service.name``
service_instance_id     VARCHAR resource attribute ``service.instance.id``
scope_name              VARCHAR instrumentation scope name
start_ns                BIGINT  start of the aggregation interval, Unix epoch ns (NULL/0 for gauges)
time_ns                 BIGINT  time of the data point, Unix epoch ns
attributes              JSON    data point attributes (object)
resource_attributes     JSON    resource attributes (object)
value                   DOUBLE  gauge / sum value (ints are stored as DOUBLE); NULL for other types
count                   BIGINT  histogram / exponential histogram / summary: number of observations
sum                     DOUBLE  sum of observations (NULL when the sender omitted it)
min                     DOUBLE  histogram minimum (NULL when omitted)
max                     DOUBLE  histogram maximum (NULL when omitted)
bucket_counts           JSON    histogram: list of ints, len(explicit_bounds) + 1 entries
explicit_bounds         JSON    histogram: list of upper bounds (floats, in the metric's unit)
is_monotonic            BOOLEAN sum only
aggregation_temporality VARCHAR 'DELTA' or 'CUMULATIVE' (sum / histograms); NULL otherwise
quantile_values         JSON    summary only: list of {"quantile": float, "value": float}
exponential_buckets     JSON    exponential histogram only: {"scale", "zero_count", "zero_threshold",
                                "positive": {"offset", "bucket_counts"}, "negative": {...}}
received_ns             BIGINT  when the collector received the export request, Unix epoch ns
======================= ======= ======================================================================

Table ``zoomer_meta`` (key VARCHAR, value VARCHAR) holds ``schema_version``.

Attribute values: OTLP ``AnyValue`` maps to JSON as string -> string, bool -> bool, int -> int,
double -> number (NaN / +-Infinity -> the strings "NaN", "Infinity", "-Infinity"), bytes -> base64 string,
array -> list, key-value list -> object, empty -> null. NaN in a DOUBLE column is stored as NULL.

Writing
-------
:class:`Store` accepts rows into a bounded in-memory queue (counted in rows). One writer thread takes
batches off the queue (waiting up to ``StoreConfig.linger_s`` for a batch to fill) and inserts each batch
with a single statement (the rows are handed to DuckDB as columns of NumPy arrays, measured at about 100k
span rows/s on 2 cores, against ~400 rows/s for ``executemany``). :meth:`Store.flush` and
:meth:`Store.close` write everything accepted before they return.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

# Never let DuckDB fetch or load extensions on its own (a SQLite file would make it download sqlite_scanner):
# a store is plain DuckDB, and this process must not reach the network because of a file it was given.
NO_EXTENSION_DOWNLOADS: dict[str, str | bool | int | float | list[str]] = {
    "autoinstall_known_extensions": False, "autoload_known_extensions": False}

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_STORE_RELPATH = Path("zoomer-data") / "zoomer.duckdb"
STORE_ENV_VAR = "ZOOMER_STORE"

# (column, SQL type, NumPy dtype used to hand a batch to DuckDB). "object" keeps None as NULL.
SPAN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("trace_id", "VARCHAR", "object"),
    ("span_id", "VARCHAR", "object"),
    ("parent_span_id", "VARCHAR", "object"),
    ("name", "VARCHAR", "object"),
    ("kind", "VARCHAR", "object"),
    ("start_ns", "BIGINT", "int64"),
    ("end_ns", "BIGINT", "int64"),
    ("duration_ns", "BIGINT", "int64"),
    ("status_code", "VARCHAR", "object"),
    ("status_message", "VARCHAR", "object"),
    ("service_name", "VARCHAR", "object"),
    ("service_instance_id", "VARCHAR", "object"),
    ("scope_name", "VARCHAR", "object"),
    ("attributes", "JSON", "object"),
    ("resource_attributes", "JSON", "object"),
    ("events", "JSON", "object"),
    ("links", "JSON", "object"),
    ("received_ns", "BIGINT", "int64"),
)

METRIC_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("metric_name", "VARCHAR", "object"),
    ("description", "VARCHAR", "object"),
    ("unit", "VARCHAR", "object"),
    ("metric_type", "VARCHAR", "object"),
    ("service_name", "VARCHAR", "object"),
    ("service_instance_id", "VARCHAR", "object"),
    ("scope_name", "VARCHAR", "object"),
    ("start_ns", "BIGINT", "object"),
    ("time_ns", "BIGINT", "int64"),
    ("attributes", "JSON", "object"),
    ("resource_attributes", "JSON", "object"),
    ("value", "DOUBLE", "object"),
    ("count", "BIGINT", "object"),
    ("sum", "DOUBLE", "object"),
    ("min", "DOUBLE", "object"),
    ("max", "DOUBLE", "object"),
    ("bucket_counts", "JSON", "object"),
    ("explicit_bounds", "JSON", "object"),
    ("is_monotonic", "BOOLEAN", "object"),
    ("aggregation_temporality", "VARCHAR", "object"),
    ("quantile_values", "JSON", "object"),
    ("exponential_buckets", "JSON", "object"),
    ("received_ns", "BIGINT", "int64"),
)

TABLES: dict[str, tuple[tuple[str, str, str], ...]] = {"spans": SPAN_COLUMNS, "metric_points": METRIC_COLUMNS}


def _create_table_sql(table: str, columns: Sequence[tuple[str, str, str]]) -> str:
    body = ",\n    ".join(f"{name} {sql_type}" for name, sql_type, _ in columns)
    return f"CREATE TABLE IF NOT EXISTS {table} (\n    {body}\n);"


SCHEMA: str = "\n".join(
    [_create_table_sql(t, cols) for t, cols in TABLES.items()]
    + ["CREATE TABLE IF NOT EXISTS zoomer_meta (key VARCHAR PRIMARY KEY, value VARCHAR);"]
)
"""The DDL of the store (idempotent: every statement is ``CREATE TABLE IF NOT EXISTS``)."""


class StoreError(RuntimeError):
    """The store file cannot be opened or created (locked by another process, not a DuckDB file, ...)."""


def default_store_path() -> Path:
    """The store path used when none is given: ``$ZOOMER_STORE``, else ``./zoomer-data/zoomer.duckdb``.

    The relative default is resolved against the current working directory at call time.
    """
    env = os.environ.get(STORE_ENV_VAR, "").strip()
    return Path(env) if env else Path.cwd() / DEFAULT_STORE_RELPATH


def open_readonly(path: str | os.PathLike[str]) -> duckdb.DuckDBPyConnection:
    """Open the store read-only and return the DuckDB connection (the caller closes it).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        StoreError: DuckDB cannot open it (another process holds it for writing, or not a DuckDB file).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"store not found: {p}")
    try:
        return duckdb.connect(str(p), read_only=True, config=NO_EXTENSION_DOWNLOADS)
    except duckdb.Error as exc:
        raise StoreError(f"cannot open store {p} read-only: {exc}") from exc


@dataclass(frozen=True)
class StoreConfig:
    """Tuning of :class:`Store`.

    Attributes:
        max_queued_rows: rows accepted but not yet written before :meth:`Store.submit` refuses more. One
            submission larger than this is still accepted when the queue is empty, so any single request
            can make progress.
        batch_rows: most rows inserted by one statement.
        linger_s: how long (seconds) the writer waits for more rows before writing a partial batch;
            :meth:`Store.flush` and :meth:`Store.close` cut it short. Each DuckDB insert statement costs
            about 4 ms of CPU on top of its rows, so batching a second of a typical exporter's 512-span
            requests (about 2000 rows) roughly halves the writer's CPU per row against one request per
            statement (``benchmarks/COLLECTOR.md``). Acknowledged rows wait at most this long in memory.
    """

    max_queued_rows: int = 200_000
    batch_rows: int = 20_000
    linger_s: float = 1.0


@dataclass(frozen=True)
class StoreStats:
    """Row counters of a :class:`Store` (all counts are rows, over the store's lifetime).

    ``accepted`` = rows acknowledged to callers; ``written`` = rows inserted; ``failed`` = accepted rows whose
    insert raised (logged); ``dropped`` = rows refused because the queue was full or the store closed
    (the caller was told, nothing acknowledged); ``queued`` = accepted, not yet written.
    """

    accepted: int
    written: int
    failed: int
    dropped: int
    queued: int
    batches: int


class Store:
    """Writes span and metric rows into the DuckDB file at ``path`` from one background thread.

    Rows are tuples in the column order of :data:`SPAN_COLUMNS` / :data:`METRIC_COLUMNS`. Thread-safe:
    any thread may call :meth:`submit`.

    Raises:
        StoreError: the file cannot be opened for writing (e.g. another process holds it).
    """

    def __init__(self, path: str | os.PathLike[str], config: StoreConfig | None = None) -> None:
        self.path = Path(path)
        self.config = config or StoreConfig()
        self._con = self._open(self.path)
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, list[tuple[Any, ...]]]] = deque()
        self._queued = 0
        self._accepted = 0
        self._written = 0
        self._failed = 0
        self._dropped = 0
        self._batches = 0
        self._closing = False
        self._closed = False
        self._flushing = 0  # flush() calls waiting: the writer stops lingering for them
        self._thread = threading.Thread(target=self._run, name="zoomer-store-writer", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(path: Path) -> duckdb.DuckDBPyConnection:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            con = duckdb.connect(str(path), config=NO_EXTENSION_DOWNLOADS)
            con.execute(SCHEMA)
            con.execute(
                "INSERT OR IGNORE INTO zoomer_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)]
            )
        except (duckdb.Error, OSError) as exc:
            raise StoreError(f"cannot open store {path} for writing: {exc}") from exc
        return con

    # ---- producer side -------------------------------------------------------------------------------

    def submit(self, table: str, rows: list[tuple[Any, ...]]) -> bool:
        """Queue ``rows`` for ``table`` ('spans' or 'metric_points'); all or nothing.

        Returns True when accepted (they will be written, at the latest by :meth:`close`), False when the
        queue is full or the store is closing (counted in ``dropped``; the caller must report a retryable
        error to its client).

        Raises:
            KeyError: unknown table.
        """
        if table not in TABLES:
            raise KeyError(table)
        n = len(rows)
        if n == 0:
            return True
        with self._cond:
            full = self._queued > 0 and self._queued + n > self.config.max_queued_rows
            if self._closing or full:
                self._dropped += n
                return False
            self._queue.append((table, rows))
            self._queued += n
            self._accepted += n
            self._cond.notify_all()  # the writer, and flush() callers share this condition
        return True

    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters."""
        with self._cond:
            return StoreStats(self._accepted, self._written, self._failed, self._dropped, self._queued,
                              self._batches)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every row accepted so far is written (or failed), without waiting out the writer's
        linger. Returns False on timeout."""
        with self._cond:
            target = self._accepted
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._written + self._failed >= target, timeout_s)
            finally:
                self._flushing -= 1

    def close(self) -> StoreStats:
        """Refuse new rows, write everything accepted, checkpoint and close the file. Idempotent.

        Returns the final counters.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            if not self._closed:
                self._closed = True
                try:
                    self._con.close()
                except duckdb.Error:  # pragma: no cover - closing a healthy file does not fail
                    log.exception("closing store %s failed", self.path)
        return self.stats()

    # ---- writer thread -------------------------------------------------------------------------------

    def _take_batch(self) -> tuple[str, list[tuple[Any, ...]]] | None:
        """Wait for rows, then pop up to ``batch_rows`` of one table. None once closing and drained."""
        cfg = self.config
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            if not self._batch_due():
                # Let more requests arrive so one statement carries many rows.
                self._cond.wait_for(self._batch_due, cfg.linger_s)
            table = self._queue[0][0]
            rows: list[tuple[Any, ...]] = []
            while self._queue and self._queue[0][0] == table and len(rows) < cfg.batch_rows:
                rows.extend(self._queue.popleft()[1])
            return table, rows

    def _batch_due(self) -> bool:
        """A full batch is queued, or someone waits for the rows (close, flush): write without lingering."""
        return self._queued >= self.config.batch_rows or self._closing or self._flushing > 0

    def _run(self) -> None:
        while True:
            item = self._take_batch()
            if item is None:
                return
            table, rows = item
            written = self._insert_salvaging(table, rows)
            with self._cond:
                self._queued -= len(rows)
                self._written += written
                self._failed += len(rows) - written
                self._batches += 1
                self._cond.notify_all()

    def _insert_salvaging(self, table: str, rows: list[tuple[Any, ...]]) -> int:
        """Insert ``rows``; if the statement fails, split the batch to write every row that can be.

        Returns the number of rows written. A row that cannot be inserted on its own is logged and skipped.
        """
        error = self._insert(table, rows)
        if error is None:
            return len(rows)
        if len(rows) == 1:
            log.error("dropping 1 row that %s in %s refused: %s", table, self.path, error)
            return 0
        mid = len(rows) // 2
        return self._insert_salvaging(table, rows[:mid]) + self._insert_salvaging(table, rows[mid:])

    def _insert(self, table: str, rows: list[tuple[Any, ...]]) -> Exception | None:
        """Insert ``rows`` with one statement. Returns the error instead of raising it."""
        columns = TABLES[table]
        try:
            values = list(zip(*rows))
            batch = {name: np.array(col, dtype=dtype) for (name, _, dtype), col in zip(columns, values)}
            self._con.register("zoomer_batch", batch)
            try:
                self._con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM zoomer_batch")
            finally:
                self._con.unregister("zoomer_batch")
        except Exception as exc:  # a bad batch must not kill the writer thread
            return exc
        return None
