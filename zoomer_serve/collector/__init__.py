"""Embedded OTLP collector: gRPC (4317) and HTTP (4318) receivers writing spans and metric points into a
DuckDB file (schema in :mod:`zoomer_serve.collector.store`).

An export is answered only once its rows are committed (:mod:`~zoomer_serve.collector.store`, group commit),
so acknowledged data survives ``kill -9``. The HTTP receiver bounds slow, idle and hostile clients
(:mod:`~zoomer_serve.collector.http_receiver`); both receivers can require a bearer token and speak TLS, and
a non-loopback bind needs one of them or an explicit ``--insecure-open``
(:mod:`~zoomer_serve.collector.security`). With Parquet output the store file stages rows that rotate out to
Parquet files under a URL (:mod:`~zoomer_serve.collector.rotation`), a dataset the report reads as it reads a
store (:mod:`~zoomer_serve.collector.parquet`). CLI flags and ``ZOOMER_COLLECTOR_*`` variables:
:mod:`~zoomer_serve.collector.cli`."""

from zoomer_serve.collector.collector import CollectorConfig, EmbeddedCollector
from zoomer_serve.collector.store import (
    SCHEMA,
    Store,
    StoreConfig,
    StoreError,
    StoreStats,
    WriteResult,
    WriteStatus,
    default_store_path,
    open_readonly,
)

__all__ = [
    "SCHEMA",
    "CollectorConfig",
    "EmbeddedCollector",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreStats",
    "WriteResult",
    "WriteStatus",
    "default_store_path",
    "open_readonly",
]
