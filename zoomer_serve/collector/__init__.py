"""Embedded OTLP collector: gRPC (4317) and HTTP (4318) receivers writing spans and metric points into a
DuckDB file (schema in :mod:`zoomer_serve.collector.store`)."""

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
