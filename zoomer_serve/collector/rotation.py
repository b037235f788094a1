"""Rotating the collector's tables out to Parquet files under a storage URL (the layout of
:mod:`~zoomer_serve.collector.parquet`).

With Parquet output on, the collector's DuckDB file is its staging area: exports are still answered only once
their rows are committed there (group commit, :mod:`~zoomer_serve.collector.store`), and a
:class:`ParquetRotator` thread moves them out every ``rotate_s`` seconds, or sooner once ``rotate_rows`` rows
were written since the last rotation, and once more when the collector stops.

One rotation, in one DuckDB transaction on its own connection (the store's writer keeps inserting meanwhile;
its rows committed after the transaction began are not in its snapshot and stay for the next rotation):

1. ``COPY`` each table's rows, with the partition columns, to a local temporary folder as Parquet
   (``PARTITION_BY (service, hour)``, zstd), files named ``<writer>-<rotation>-<n>.parquet``;
2. upload the files through fsspec, each retried up to ``retries`` times with backoff;
3. ``DELETE`` the rows it copied, count the rotation in ``zoomer_meta``, ``COMMIT``.

Any failure rolls the transaction back: the rows stay in the staging file and the next rotation takes them
again. A crash between upload and commit leaves the same writer id and rotation number in the staging file,
so the next run writes files of the same names (the same rows and any newer ones) over those: no row is lost
and none is stored twice. The writer id is made once per staging file and kept in it.
"""

from __future__ import annotations

import logging
import math
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoomer_serve.artifacts.storage import StorageError, check_protocol, filesystem, join, put_file
from zoomer_serve.collector.parquet import partition_select
from zoomer_serve.collector.store import TABLES, Store

log = logging.getLogger(__name__)

WRITER_KEY = "parquet_writer_id"
ROTATION_KEY = "parquet_rotation"


@dataclass(frozen=True)
class ParquetConfig:
    """Parquet output of the collector.

    Attributes:
        url: the storage root (URL or folder).
        rotate_s: longest time between rotations, seconds.
        rotate_rows: rows written since the last rotation that trigger one sooner.
        retries / backoff_s: further attempts per file upload, and the first wait between them (doubling).
    """

    url: str
    rotate_s: float = 60.0
    rotate_rows: int = 200_000
    retries: int = 5
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.rotate_s < math.inf:  # an endless period: the rotation thread's wait would raise
            raise ValueError(f"rotate_s must be a finite number > 0, got {self.rotate_s}")
        if self.rotate_rows < 1 or not 0 <= self.retries or not 0 <= self.backoff_s < math.inf:
            raise ValueError(f"rotate_rows >= 1, retries >= 0, finite backoff_s >= 0 needed, got "
                             f"{self.rotate_rows}, {self.retries}, {self.backoff_s}")
        try:
            object.__setattr__(self, "url", check_protocol(self.url))
        except StorageError as exc:
            raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class RotationStats:
    """Counters of a :class:`ParquetRotator`: ``rotations`` (committed), ``failed`` (rolled back),
    ``rows`` (moved out, all tables), ``files`` and ``bytes`` (uploaded), ``retries`` (upload attempts
    repeated), ``last_error`` ("" when none)."""

    rotations: int
    failed: int
    rows: int
    files: int
    bytes: int
    retries: int
    last_error: str


class ParquetRotator:
    """Moves ``store``'s rows to Parquet under ``config.url`` (see the module docstring).

    :meth:`start` runs the thread; :meth:`rotate` runs one rotation now (serialized with the thread's);
    :meth:`stop` stops the thread after a last rotation. Call :meth:`stop` before closing the store.
    """

    def __init__(self, store: Store, config: ParquetConfig, sleep: Any = None) -> None:
        self.store = store
        self.config = config
        self._sleep = sleep or time.sleep
        self._lock = threading.Lock()  # one rotation at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written_at_last = 0
        self._counts: dict[str, Any] = {"rotations": 0, "failed": 0, "rows": 0, "files": 0, "bytes": 0,
                                        "retries": 0, "last_error": ""}
        self.writer_id = self._writer_id()

    def start(self) -> ParquetRotator:
        self._thread = threading.Thread(target=self._run, name="zoomer-parquet-rotation", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> RotationStats:
        """Stop the thread, then rotate once more (every row committed so far). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.store.flush(timeout_s)
        self.rotate()
        return self.stats()

    def stats(self) -> RotationStats:
        with self._lock:
            return RotationStats(**self._counts)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(min(1.0, self.config.rotate_s)):
            written = self.store.stats().written
            due = time.monotonic() - last >= self.config.rotate_s
            if due or written - self._written_at_last >= self.config.rotate_rows:
                self.rotate()
                last = time.monotonic()

    # -- one rotation --------------------------------------------------------------------------------------
    def rotate(self) -> int:
        """Move every committed row out now; returns the rows moved (0 when none, or when it failed: the rows
        stay staged and the error is in :meth:`stats`)."""
        with self._lock:
            self._written_at_last = self.store.stats().written
            cur = self.store.cursor()
            tmp = Path(tempfile.mkdtemp(prefix="zoomer-parquet-"))
            try:
                cur.execute("BEGIN TRANSACTION")
                try:
                    rows = self._rotate_in(cur, tmp)
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                if rows:
                    cur.execute("COMMIT")
                    self._counts["rotations"] += 1
                    self._counts["rows"] += rows
                else:
                    cur.execute("ROLLBACK")
                return rows
            except Exception as exc:
                self._counts["failed"] += 1
                self._counts["last_error"] = f"{type(exc).__name__}: {exc}"
                log.warning("Parquet rotation to %s failed, the rows stay staged: %s", self.config.url, exc)
                return 0
            finally:
                cur.close()
                shutil.rmtree(tmp, ignore_errors=True)

    def _rotate_in(self, cur: Any, tmp: Path) -> int:
        counts = {t: int(cur.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in TABLES}
        if not any(counts.values()):
            return 0
        row = cur.execute("SELECT value FROM zoomer_meta WHERE key = ?", [ROTATION_KEY]).fetchone()
        rotation = int(row[0]) if row else 0
        pattern = f"{self.writer_id}-{rotation:08d}-{{i}}"
        for table, n in counts.items():
            if n:
                target = str(tmp / table).replace("'", "''")
                cur.execute(f"COPY ({partition_select(table)}) TO '{target}' (FORMAT parquet, COMPRESSION zstd, "
                            f"PARTITION_BY (service, hour), FILENAME_PATTERN '{pattern}')")
        self._upload(tmp)
        for table, n in counts.items():
            if n:
                cur.execute(f"DELETE FROM {table}")
        cur.execute("INSERT OR REPLACE INTO zoomer_meta VALUES (?, ?)", [ROTATION_KEY, str(rotation + 1)])
        return sum(counts.values())

    def _upload(self, tmp: Path) -> None:
        fs, root = filesystem(self.config.url)
        for path in sorted(p for p in tmp.rglob("*.parquet") if p.is_file()):
            target = join(root, path.relative_to(tmp).as_posix())
            wait = self.config.backoff_s
            for attempt in range(self.config.retries + 1):
                try:
                    put_file(fs, path, target)  # never seen half written: a reader would fail on it
                    break
                except Exception:
                    if attempt == self.config.retries:
                        raise
                    self._counts["retries"] += 1
                    self._sleep(wait)
                    wait *= 2
            self._counts["files"] += 1
            self._counts["bytes"] += path.stat().st_size

    def _writer_id(self) -> str:
        """This staging file's writer id (made and kept on first use): ``<host>-<8 hex>``."""
        cur = self.store.cursor()
        try:
            row = cur.execute("SELECT value FROM zoomer_meta WHERE key = ?", [WRITER_KEY]).fetchone()
            if row:
                return str(row[0])
            host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40] or "host"
            writer = f"{host}-{uuid.uuid4().hex[:8]}"
            cur.execute("INSERT INTO zoomer_meta VALUES (?, ?)", [WRITER_KEY, writer])
            return writer
        finally:
            cur.close()
