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

Writing: acknowledged means committed (group commit)
----------------------------------------------------
The collector answers an export only after the rows it holds are committed to the DuckDB file, so that
what it acknowledged survives ``kill -9`` of the collector (a commit has written DuckDB's write-ahead log,
which DuckDB replays when the file is opened again).

:class:`Store` keeps a bounded in-memory queue (counted in rows). A receiver's handler calls
:meth:`Store.write`, which queues its rows and waits until the batch holding them is committed. One writer
thread takes everything queued (up to ``StoreConfig.batch_rows``) and inserts it with a single statement
(the rows are handed to DuckDB as columns of NumPy arrays that it reads by their variable's name, about 100k span
rows/s on 2 cores against ~400 rows/s for ``executemany``), then wakes the handlers whose rows it held. Requests
that arrive while an insert runs share the next one, so concurrent exporters still share statements (each costs
about 2 ms of CPU on top of its rows) without any request waiting for a timer.

Why not a write-ahead file of our own in front of a lingering writer (answer once the request is appended
to a log, insert later)? DuckDB's commit already is that log: a second one would write every request twice,
need its own replay, trimming and corruption handling, and would only save the export's latency the time of
one insert (a few ms), which no exporter waits on (they send from a background thread). The cost of group
commit is more, smaller statements when a single exporter sends one request at a time, and a wait for the
commit's ``fdatasync`` of DuckDB's log (milliseconds on a VM disk; it also makes the data survive a power
loss): measured in ``benchmarks/COLLECTOR.md`` against the 1 s linger it replaced.

Checkpoints: one per row group
------------------------------
DuckDB moves its write-ahead log into the file (a checkpoint) when the log passes ``checkpoint_threshold``
(16 MiB by default), whatever rows that is. A checkpoint that falls inside one of DuckDB's row groups
(:data:`DUCKDB_ROW_GROUP_ROWS` rows) rewrites that partly filled group at the next one, and now and then many
more: inserting 512-row requests of 1.2 kB spans, checkpoints every ~26 000 rows cost 80 ms to 1.6 s of CPU
each, larger as the table grew, 40 % of the store's CPU (``benchmarks/store_checkpoints.py``,
``benchmarks/COLLECTOR.md``). So the writer checkpoints itself once ``StoreConfig.checkpoint_rows`` rows (a
row group) went into a table since the last one, after it has answered the writes of that batch, and the
size threshold is raised to :data:`CHECKPOINT_CAP` (a bound on the log for rows of several kB).

:meth:`Store.submit` (queue without waiting) remains for callers that do their own flushing;
:meth:`Store.flush` and :meth:`Store.close` write everything accepted before they return. A row that DuckDB
refuses is logged and reported to its writer as failed (the receivers answer it as a rejected item in
``partial_success``), never silently dropped.
"""

from __future__ import annotations

import enum
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
DUCKDB_ROW_GROUP_ROWS = 122_880
"""Rows in one of DuckDB's row groups (its default ``row_group_size``, which stores created here keep)."""
CHECKPOINT_CAP = "256MiB"
"""DuckDB's ``checkpoint_threshold`` while the writer checkpoints per row group: the write-ahead log's
largest size before DuckDB checkpoints on its own (rows of over ~2 kB reach it before a row group is full)."""
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
        StoreError: DuckDB cannot open it: not a DuckDB file (said so), or another process holds it for
            writing (the message asks whether a collector still runs on it), or another DuckDB error.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"store not found: {p}")
    try:
        con = duckdb.connect(str(p), read_only=True, config=NO_EXTENSION_DOWNLOADS)
    except duckdb.Error as exc:
        text = str(exc)
        if "in-memory database" in text:  # DuckDB took it for a data file it would read into memory
            raise StoreError(f"cannot open store {p}: not a DuckDB file (DuckDB takes it for a data file: JSON, "
                             "CSV or Parquet)") from exc
        if "not a valid DuckDB database file" in text:
            raise StoreError(f"cannot open store {p}: not a DuckDB file ({text})") from exc
        hint = " (is a collector still running on it?)" if "Could not set lock" in text else ""
        raise StoreError(f"cannot open store {p} read-only: {text}{hint}") from exc
    return _file_backed(con, p)


BATCH_NAME = "zoomer_batch"
"""The name under which the writer's insert reads its batch (a Python local that DuckDB finds by that name)."""


def _batch_name_free(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """Refuse a store whose file has a table or view named :data:`BATCH_NAME`: DuckDB resolves a name in its
    catalog before a Python variable, so the writer would insert that table's rows instead of its batch.

    Raises:
        StoreError: there is one (``con`` is closed).
    """
    found = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ? UNION ALL "
                        "SELECT count(*) FROM duckdb_views() WHERE view_name = ?", [BATCH_NAME, BATCH_NAME]).fetchall()
    if any(n for (n,) in found):
        con.close()
        raise StoreError(f"cannot open store {path} for writing: it has a table or view named {BATCH_NAME!r}, "
                         "the name the collector's writer reads its batches by; rename it")


def _tables_fit(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """Refuse a store whose file already has a ``spans`` or ``metric_points`` table without the store's columns
    (another tool's file): the collector said it was ready, then refused every row it was sent, logging each.

    Raises:
        StoreError: such a table (``con`` is closed).
    """
    for table, columns in TABLES.items():
        present = {name for (name,) in con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND schema_name = current_schema()",
            [table]).fetchall()}
        missing = [name for name, _, _ in columns if name not in present]
        if present and missing:
            con.close()
            raise StoreError(f"cannot open store {path} for writing: it is not a zoomer-serve store (its table "
                             f"{table!r} has no column {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")


def _file_backed(con: duckdb.DuckDBPyConnection, path: Path) -> duckdb.DuckDBPyConnection:
    """``con`` if its database is the file at ``path``. DuckDB opens an existing JSON, CSV or Parquet file as
    an in-memory database that reads it: rows written there would be acknowledged and lost.

    Raises:
        StoreError: it is such a file (``con`` is closed).
    """
    row = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
    if row is None or row[0] is None:
        con.close()
        raise StoreError(f"cannot open store {path}: not a DuckDB file (DuckDB would only read it into memory: "
                         "give a new path or an existing .duckdb store)")
    return con


@dataclass(frozen=True)
class StoreConfig:
    """Tuning of :class:`Store`.

    Attributes:
        max_queued_rows: rows accepted but not yet written before :meth:`Store.write` / :meth:`Store.submit`
            refuse more. One submission larger than this is still accepted when the queue is empty, so any
            single request can make progress.
        batch_rows: most rows inserted by one statement (one submission is never split).
        linger_s: how long (seconds) the writer waits for more rows before inserting fewer than
            ``batch_rows``; :meth:`Store.flush` and :meth:`Store.close` cut it short. Default 0: insert at
            once, batching only what queued up during the previous insert (group commit). Every
            :meth:`Store.write` waits for its commit, so a linger adds to each acknowledged export's
            latency what it saves in statements.
        commit_timeout_s: longest a :meth:`Store.write` waits for its commit before it reports a timeout
            (the rows stay queued and are still written).
        checkpoint_rows: rows written into one table after which the writer checkpoints the file (see
            "Checkpoints" above); default one DuckDB row group. 0 leaves checkpoints to DuckDB's own
            16 MiB log threshold.
    """

    max_queued_rows: int = 200_000
    batch_rows: int = 20_000
    linger_s: float = 0.0
    commit_timeout_s: float = 30.0
    checkpoint_rows: int = DUCKDB_ROW_GROUP_ROWS

    def __post_init__(self) -> None:
        if self.max_queued_rows <= 0 or self.batch_rows <= 0:
            raise ValueError(f"max_queued_rows and batch_rows must be > 0, got {self.max_queued_rows}, "
                             f"{self.batch_rows}")
        if self.checkpoint_rows < 0:
            raise ValueError(f"checkpoint_rows must be >= 0, got {self.checkpoint_rows}")
        if self.linger_s < 0 or self.commit_timeout_s <= 0:
            raise ValueError(f"linger_s must be >= 0 and commit_timeout_s > 0, got {self.linger_s}, "
                             f"{self.commit_timeout_s}")


@dataclass(frozen=True)
class StoreStats:
    """Row counters of a :class:`Store` (all counts are rows, over the store's lifetime).

    ``accepted`` = rows queued for writing; ``written`` = rows inserted; ``failed`` = accepted rows whose
    insert raised (logged, and reported to :meth:`Store.write`'s caller); ``dropped`` = rows refused because
    the queue was full or the store closed (the caller was told, nothing acknowledged); ``queued`` = accepted,
    not yet written; ``batches`` = insert statements that committed rows; ``commit_timeouts`` = writes
    whose caller stopped waiting before the commit (the rows are still written); ``checkpoints`` = the
    writer's own checkpoints (``StoreConfig.checkpoint_rows``; DuckDB's and the one at close not counted).
    """

    accepted: int
    written: int
    failed: int
    dropped: int
    queued: int
    batches: int
    commit_timeouts: int = 0
    checkpoints: int = 0


class WriteStatus(enum.Enum):
    """How a :meth:`Store.write` ended."""

    COMMITTED = "committed"  # every row is in the file, except ``failed`` ones DuckDB refused (logged)
    REFUSED = "refused"  # queue full or store closing: nothing queued, the caller may retry
    TIMED_OUT = "timed_out"  # queued but not committed within the wait; the rows are still written later


@dataclass(frozen=True)
class WriteResult:
    """Outcome of one :meth:`Store.write`: ``failed`` rows (of a COMMITTED write) DuckDB refused, with the
    first ``error``."""

    status: WriteStatus
    failed: int = 0
    error: str = ""


class _Pending:
    """One submission in the queue: its rows, and what became of them once the writer is done."""

    __slots__ = ("done", "error", "failed", "rows", "table")

    def __init__(self, table: str, rows: list[tuple[Any, ...]]) -> None:
        self.table = table
        self.rows = rows
        self.done = False
        self.failed = 0
        self.error = ""


class Store:
    """Writes span and metric rows into the DuckDB file at ``path`` from one background thread.

    Rows are tuples in the column order of :data:`SPAN_COLUMNS` / :data:`METRIC_COLUMNS`. Thread-safe:
    any thread may call :meth:`write` or :meth:`submit`.

    Raises:
        StoreError: the file cannot be opened for writing (e.g. another process holds it).
    """

    def __init__(self, path: str | os.PathLike[str], config: StoreConfig | None = None) -> None:
        self.path = Path(path)
        self.config = config or StoreConfig()
        self._con = self._open(self.path)
        if self.config.checkpoint_rows:
            self._con.execute(f"SET checkpoint_threshold = '{CHECKPOINT_CAP}'")
        self._since_checkpoint = dict.fromkeys(TABLES, 0)  # rows written per table since the last one
        self._checkpoints = 0
        self._cond = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._queued = 0
        self._accepted = 0
        self._written = 0
        self._failed = 0
        self._dropped = 0
        self._batches = 0
        self._commit_timeouts = 0
        self._closing = False
        self._closed = False
        self._flushing = 0  # flush() calls waiting: the writer stops lingering for them
        self._thread = threading.Thread(target=self._run, name="zoomer-store-writer", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(path: Path) -> duckdb.DuckDBPyConnection:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            con = _file_backed(duckdb.connect(str(path), config=NO_EXTENSION_DOWNLOADS), path)
            _batch_name_free(con, path)
            _tables_fit(con, path)
            con.execute(SCHEMA)
            con.execute("SET python_enable_replacements = true")  # how _insert hands DuckDB its batch
            con.execute(
                "INSERT OR IGNORE INTO zoomer_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)]
            )
        except (duckdb.Error, OSError) as exc:
            raise StoreError(f"cannot open store {path} for writing: {exc}") from exc
        return con

    # ---- producer side -------------------------------------------------------------------------------

    def write(self, table: str, rows: list[tuple[Any, ...]], timeout_s: float | None = None) -> WriteResult:
        """Queue ``rows`` for ``table`` ('spans' or 'metric_points') and wait until they are committed.

        ``timeout_s``: longest wait for the commit (default ``StoreConfig.commit_timeout_s``). Returns
        COMMITTED (with the rows DuckDB refused, if any, in ``failed``), REFUSED (queue full or closing;
        nothing queued; counted in ``dropped``) or TIMED_OUT (queued, still to be written; counted in
        ``commit_timeouts``).

        Raises:
            KeyError: unknown table.
        """
        pending = self._enqueue(table, rows)
        if pending is None:
            return WriteResult(WriteStatus.REFUSED)
        wait = self.config.commit_timeout_s if timeout_s is None else timeout_s
        with self._cond:
            if not self._cond.wait_for(lambda: pending.done, wait):
                self._commit_timeouts += 1
                return WriteResult(WriteStatus.TIMED_OUT)
        return WriteResult(WriteStatus.COMMITTED, pending.failed, pending.error)

    def submit(self, table: str, rows: list[tuple[Any, ...]]) -> bool:
        """Queue ``rows`` for ``table`` ('spans' or 'metric_points') without waiting for the commit; all or
        nothing.

        Returns True when accepted (they will be written, at the latest by :meth:`close`; until then a
        crash loses them: use :meth:`write` to acknowledge only what is committed), False when the queue is
        full or the store is closing (counted in ``dropped``).

        Raises:
            KeyError: unknown table.
        """
        return self._enqueue(table, rows) is not None

    def _enqueue(self, table: str, rows: list[tuple[Any, ...]]) -> _Pending | None:
        if table not in TABLES:
            raise KeyError(table)
        pending = _Pending(table, rows)
        n = len(rows)
        with self._cond:
            full = self._queued > 0 and self._queued + n > self.config.max_queued_rows
            if self._closing or full:
                self._dropped += n
                return None
            if n == 0:
                pending.done = True
                return pending
            self._queue.append(pending)
            self._queued += n
            self._accepted += n
            self._cond.notify_all()  # the writer, and flush() callers share this condition
        return pending

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to the same database for another thread (the caller closes it): its own
        transactions, isolated from the writer's (the Parquet rotation, :mod:`~zoomer_serve.collector.rotation`)."""
        return self._con.cursor()

    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters."""
        with self._cond:
            return StoreStats(self._accepted, self._written, self._failed, self._dropped, self._queued,
                              self._batches, self._commit_timeouts, self._checkpoints)

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

    def _take_batch(self) -> list[_Pending] | None:
        """Wait for rows, then pop submissions of one table holding up to ``batch_rows`` rows (at least
        one submission). None once closing and drained."""
        cfg = self.config
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            if cfg.linger_s > 0 and not self._batch_due():
                # Let more requests arrive so one statement carries many rows.
                self._cond.wait_for(self._batch_due, cfg.linger_s)
            table = self._queue[0].table
            batch = [self._queue.popleft()]
            n = len(batch[0].rows)
            while self._queue and self._queue[0].table == table:
                n += len(self._queue[0].rows)
                if n > cfg.batch_rows:
                    break
                batch.append(self._queue.popleft())
            return batch

    def _batch_due(self) -> bool:
        """A full batch is queued, or someone waits for the rows (close, flush): write without lingering."""
        return self._queued >= self.config.batch_rows or self._closing or self._flushing > 0

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            self._insert_batch(batch)
            rows = sum(len(p.rows) for p in batch)
            failed = sum(p.failed for p in batch)
            with self._cond:
                self._queued -= rows
                self._written += rows - failed
                self._failed += failed
                self._batches += 1
                for p in batch:
                    p.done = True
                    p.rows = []  # the caller may wait a while longer; the rows are no longer needed
                self._cond.notify_all()
            self._count_for_checkpoint(batch[0].table, rows - failed)

    def _count_for_checkpoint(self, table: str, written: int) -> None:
        """Checkpoint once ``checkpoint_rows`` rows went into ``table`` since the last checkpoint (after the
        batch's writers were answered: they do not wait for it). A failed checkpoint is logged; DuckDB's
        size threshold still bounds the log."""
        every = self.config.checkpoint_rows
        self._since_checkpoint[table] += written
        if not every or self._since_checkpoint[table] < every:
            return
        self._since_checkpoint = dict.fromkeys(TABLES, 0)  # a checkpoint covers every table
        try:
            self._con.execute("CHECKPOINT")
        except duckdb.Error as exc:
            log.warning("checkpoint of store %s failed: %s", self.path, exc)
            return
        with self._cond:
            self._checkpoints += 1

    def _insert_batch(self, batch: list[_Pending]) -> None:
        """Insert the rows of ``batch`` (one table) with one statement; if it fails, each submission on its
        own, splitting further to write every row that can be (``failed`` / ``error`` set on each)."""
        table = batch[0].table
        if len(batch) > 1 and self._insert(table, [r for p in batch for r in p.rows]) is None:
            return
        for p in batch:
            errors: list[Exception] = []
            written = self._insert_salvaging(table, p.rows, errors)
            p.failed = len(p.rows) - written
            if errors:
                p.error = f"{type(errors[0]).__name__}: {errors[0]}"

    def _insert_salvaging(self, table: str, rows: list[tuple[Any, ...]], errors: list[Exception]) -> int:
        """Insert ``rows``; if the statement fails, split the batch to write every row that can be.

        Returns the number of rows written. A row that cannot be inserted on its own is logged, its error
        appended to ``errors``, and skipped.
        """
        error = self._insert(table, rows)
        if error is None:
            return len(rows)
        if len(rows) == 1:
            log.error("dropping 1 row that %s in %s refused: %s", table, self.path, error)
            errors.append(error)
            return 0
        mid = len(rows) // 2
        return (self._insert_salvaging(table, rows[:mid], errors)
                + self._insert_salvaging(table, rows[mid:], errors))

    def _insert(self, table: str, rows: list[tuple[Any, ...]]) -> Exception | None:
        """Insert ``rows`` with one statement (DuckDB auto-commits it). Returns the error instead of raising."""
        columns = TABLES[table]
        try:
            values = list(zip(*rows))
            zoomer_batch = {name: np.array(col, dtype=dtype) for (name, _, dtype), col in zip(columns, values)}
            # DuckDB finds this local by its name (a replacement scan, BATCH_NAME): registering it as a view and
            # dropping that after are two catalog changes, which cost more CPU than inserting 512 span rows
            self._con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {BATCH_NAME}")
            del zoomer_batch
        except Exception as exc:  # a bad batch must not kill the writer thread
            return exc
        return None
