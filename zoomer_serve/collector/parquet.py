"""Span data as a Parquet dataset: the layout the collector writes (:mod:`~zoomer_serve.collector.rotation`)
and the readers use.

Layout under a storage root (a URL or folder, :mod:`zoomer_serve.artifacts.storage`), hive-partitioned by
service and hour::

    <root>/spans/service=<service.name>/hour=<YYYY-MM-DDTHH>/<writer>-<rotation>-<n>.parquet
    <root>/metric_points/service=<service.name>/hour=<YYYY-MM-DDTHH>/<writer>-<rotation>-<n>.parquet

The files hold the store's columns (:data:`~zoomer_serve.collector.store.SPAN_COLUMNS`,
:data:`~zoomer_serve.collector.store.METRIC_COLUMNS`; the store module is the one definition of the tables).
``service`` is ``service.name`` (``unknown_service`` when absent), ``hour`` the UTC hour of ``start_ns``
(spans) or ``time_ns`` (metric points). ``<writer>`` names the collector that wrote the file (unique per
collector and kept in its staging store), so any number of collectors write side by side without
coordination; ``<rotation>`` counts its rotations.

:func:`open_source` opens either kind of input, a DuckDB store file or such a dataset, as a read-only DuckDB
connection with the tables ``spans`` and ``metric_points``: the report and ``analyze --store`` read both the
same way. DuckDB reads Parquet and hive partitions itself (no extension); a remote root is read through its
fsspec filesystem registered with DuckDB, so DuckDB never fetches an extension either.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import duckdb

from zoomer_serve.artifacts.storage import StorageError, filesystem, is_local, is_url, join, normalize
from zoomer_serve.collector.store import NO_EXTENSION_DOWNLOADS, TABLES, open_readonly

TIME_COLUMNS: dict[str, str] = {"spans": "start_ns", "metric_points": "time_ns"}
"""Table -> the column whose UTC hour partitions it."""
PARTITION_COLUMNS = ("service", "hour")
UNKNOWN_SERVICE = "unknown_service"


def partition_select(table: str) -> str:
    """``SELECT`` of ``table``'s rows with the two partition columns added (what a rotation writes)."""
    col = TIME_COLUMNS[table]
    return (f"SELECT *, coalesce(service_name, '{UNKNOWN_SERVICE}') AS service, "
            f"coalesce(strftime(make_timestamp({col} // 1000), '%Y-%m-%dT%H'), 'unknown') AS hour FROM {table}")


def table_glob(root: str, table: str) -> str:
    """The glob of ``table``'s files under ``root``."""
    return join(root, table, "*", "*", "*.parquet")


def open_source(location: str | os.PathLike[str]) -> duckdb.DuckDBPyConnection:
    """A read-only DuckDB connection with ``spans`` and ``metric_points`` for ``location``: a DuckDB store file
    (opened read-only), or a Parquet dataset (a folder or URL, see the module docstring).

    Raises:
        FileNotFoundError: nothing there (no file, no folder, no Parquet file of either table).
        StoreError: a store file DuckDB cannot open read-only (a collector still writes it, not DuckDB).
        StorageError: the location is empty, the URL's fsspec backend is missing, or the storage cannot be
            listed (host unknown, refused, no permission: the message names the location and the error).
    """
    text = os.fspath(location)
    if not text.strip():
        raise StorageError("the store location is empty")
    if not is_url(text):
        path = Path(text)
        if path.is_file():
            return open_readonly(path)
        if not path.is_dir():
            raise FileNotFoundError(f"store not found: {path}")
    return open_dataset(text)


def open_dataset(location: str, since_ns: int | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection whose ``spans`` and ``metric_points`` are views over the Parquet files
    under ``location`` (a table without files is an empty table of the store's schema). ``since_ns``: leave
    out the hour partitions before its hour (DuckDB then does not read their files).

    Raises:
        FileNotFoundError: no Parquet file of either table under ``location``.
        StorageError: the URL's fsspec backend is missing, the storage cannot be listed, or a file under it is not
            readable Parquet (the message names the file).
    """
    fs, root = filesystem(location)
    try:
        found = {t: bool(fs.glob(table_glob(root, t))) for t in TABLES}
    except FileNotFoundError:
        found = dict.fromkeys(TABLES, False)
    except OSError as exc:  # fsspec backends raise their transport's errors (socket.gaierror, ConnectionError)
        raise StorageError(f"cannot list {normalize(location)}: {type(exc).__name__}: {exc}") from exc
    if not any(found.values()):
        raise FileNotFoundError(f"store not found: no Parquet span data ({table_glob(normalize(location), 'spans')}) "
                                f"under {normalize(location)}")
    con = duckdb.connect(config=NO_EXTENSION_DOWNLOADS)
    try:
        prefix = root if is_local(fs) else _register(con, fs, location, root)
        for table in TABLES:
            if found[table]:
                con.execute(f"CREATE VIEW {table} AS SELECT * EXCLUDE ({', '.join(PARTITION_COLUMNS)}) FROM "
                            f"read_parquet('{_quote(table_glob(prefix, table))}', hive_partitioning = true, "
                            f"union_by_name = true){_since(since_ns)}")
            else:
                con.execute(_empty_table(table))
    except duckdb.Error as exc:  # a file that is not Parquet, or cut short (DuckDB's message names it)
        con.close()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__  # not its SQL
        raise StorageError(f"cannot read the Parquet data under {normalize(location)}: {first} (move that file "
                           "aside to read the rest)") from None
    except BaseException:
        con.close()
        raise
    return con


def _register(con: duckdb.DuckDBPyConnection, fs: Any, location: str, root: str) -> str:
    """Register ``fs`` with DuckDB; the root as a URL DuckDB routes to it."""
    con.register_filesystem(fs)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if not protocol:
        raise StorageError(f"cannot read {location}: its filesystem names no protocol")
    return f"{protocol}://{root}"


def _since(since_ns: int | None) -> str:
    if since_ns is None:
        return ""
    import time

    return f" WHERE hour >= '{time.strftime('%Y-%m-%dT%H', time.gmtime(since_ns / 1e9))}'"


def _empty_table(table: str) -> str:
    columns = ", ".join(f"{name} {sql_type}" for name, sql_type, _ in TABLES[table])
    return f"CREATE TABLE {table} ({columns})"


def _quote(text: str) -> str:
    return text.replace("'", "''")
