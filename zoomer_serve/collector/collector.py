"""The embedded OTLP collector: gRPC + HTTP receivers in front of one DuckDB :class:`Store`."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from zoomer_serve.collector.grpc_receiver import GrpcReceiver
from zoomer_serve.collector.http_receiver import HttpLimits, HttpReceiver
from zoomer_serve.collector.ingest import Ingestor
from zoomer_serve.collector.rotation import ParquetConfig, ParquetRotator
from zoomer_serve.collector.security import ReceiverSecurity
from zoomer_serve.collector.store import Store, StoreConfig, default_store_path

log = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 16 * MiB
DEFAULT_GRPC_PORT = 4317
DEFAULT_HTTP_PORT = 4318


@dataclass(frozen=True)
class CollectorConfig:
    """Settings of an :class:`EmbeddedCollector`.

    Attributes:
        store_path: DuckDB file (created with its folder if missing).
        host: address both receivers bind; loopback by default, since whoever can reach the collector can
            write into the store.
        grpc_port / http_port: 0 picks a free port; None disables that receiver.
        max_message_bytes: largest accepted export request in bytes, after decompression.
        store: queue and batch sizes of the store writer.
        grpc_workers: threads serving gRPC calls (each waits for its export's commit).
        http_limits: deadlines, connection and memory bounds of the OTLP/HTTP receiver.
        security: bearer token and TLS of both receivers; a non-loopback ``host`` needs one of them or
            ``security.insecure_open`` (:mod:`zoomer_serve.collector.security`).
        parquet: when set, the store file is a staging area whose rows rotate out to Parquet files under
            ``parquet.url`` (:mod:`zoomer_serve.collector.rotation`).
    """

    store_path: Path
    host: str = "127.0.0.1"
    grpc_port: int | None = DEFAULT_GRPC_PORT
    http_port: int | None = DEFAULT_HTTP_PORT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    store: StoreConfig = StoreConfig()
    grpc_workers: int = 8
    http_limits: HttpLimits = HttpLimits()
    security: ReceiverSecurity = ReceiverSecurity()
    parquet: ParquetConfig | None = None


class EmbeddedCollector:
    """An OTLP collector (traces and metrics stored, logs counted) writing to a DuckDB file.

    Usage::

        with EmbeddedCollector("run.duckdb", grpc_port=0, http_port=0) as c:
            ...  # export to c.grpc_port / c.http_port
        # on exit every acknowledged span and point is in run.duckdb

    Raises (from :meth:`start`):
        zoomer_serve.collector.store.StoreError: the store cannot be opened for writing.
        zoomer_serve.netaddr.BindError: a port cannot be bound (an OSError naming the receiver, the address,
            the setting and why).
        zoomer_serve.config.ConfigError: the TLS certificate or key cannot be loaded.

    Raises (from the constructor):
        ValueError: a bad setting (a port out of range, the same non-zero port for both receivers);
            ``ConfigError`` (a ValueError) for a non-loopback ``host`` with neither
            token nor TLS unless ``security.insecure_open``.
    """

    def __init__(
        self,
        store_path: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        grpc_port: int | None = DEFAULT_GRPC_PORT,
        http_port: int | None = DEFAULT_HTTP_PORT,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        *,
        store_config: StoreConfig | None = None,
        grpc_workers: int = 8,
        http_limits: HttpLimits | None = None,
        security: ReceiverSecurity | None = None,
        parquet: ParquetConfig | None = None,
    ) -> None:
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
        for name, port in (("grpc_port", grpc_port), ("http_port", http_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if grpc_port is not None and grpc_port == http_port and grpc_port != 0:
            raise ValueError(f"grpc_port and http_port are both {grpc_port}: the OTLP/gRPC and OTLP/HTTP receivers "
                             "need a port each (0 picks a free one)")
        self.config = CollectorConfig(
            store_path=Path(store_path) if store_path is not None else default_store_path(),
            host=host,
            grpc_port=grpc_port,
            http_port=http_port,
            max_message_bytes=max_message_bytes,
            store=store_config or StoreConfig(),
            grpc_workers=grpc_workers,
            http_limits=http_limits or HttpLimits(),
            security=security or ReceiverSecurity(),
            parquet=parquet,
        )
        self.config.security.check_bind(host)
        self._lock = threading.Lock()
        self._store: Store | None = None
        self._ingestor: Ingestor | None = None
        self._grpc: GrpcReceiver | None = None
        self._http: HttpReceiver | None = None
        self._rotator: ParquetRotator | None = None
        self._final_stats: dict[str, Any] | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None

    @property
    def store_path(self) -> Path:
        return self.config.store_path

    @property
    def running(self) -> bool:
        return self._store is not None

    def start(self) -> EmbeddedCollector:
        """Open the store, start the receivers; fills :attr:`grpc_port` / :attr:`http_port`. Returns self.

        On failure everything already started is stopped again before the error propagates, and the store
        file, its write-ahead log and the folders above it are removed if this start created them (a store
        that existed before is closed again, untouched).

        Raises:
            RuntimeError: already started.
        """
        with self._lock:
            if self._store is not None:
                raise RuntimeError("collector already started")
            cfg = self.config
            created = _absent_store_paths(cfg.store_path)
            store = Store(cfg.store_path, cfg.store)
            ingestor = Ingestor(store)
            self._store, self._ingestor, self._final_stats = store, ingestor, None
            try:
                if cfg.parquet is not None:
                    self._rotator = ParquetRotator(store, cfg.parquet).start()
                if cfg.grpc_port is not None:
                    self._grpc = GrpcReceiver(ingestor, cfg.host, cfg.grpc_port, cfg.max_message_bytes,
                                              cfg.grpc_workers, cfg.security)
                    self.grpc_port = self._grpc.start()
                if cfg.http_port is not None:
                    self._http = HttpReceiver(ingestor, cfg.host, cfg.http_port, cfg.max_message_bytes,
                                              cfg.http_limits, cfg.security)
                    self.http_port = self._http.start()
            except BaseException:
                self._stop_locked(timeout_s=1.0)
                _remove_created(created)
                raise
        return self

    def stop(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Stop both receivers (requests in flight get up to ``timeout_s`` seconds), then write everything
        accepted to the store and close it. Idempotent. Returns the final :meth:`stats`."""
        with self._lock:
            return self._stop_locked(timeout_s)

    def _stop_locked(self, timeout_s: float) -> dict[str, Any]:
        if self._store is None:
            return self._final_stats if self._final_stats is not None else self.stats()
        receivers: list[GrpcReceiver | HttpReceiver] = [r for r in (self._grpc, self._http) if r is not None]
        stoppers = [threading.Thread(target=r.stop, args=(timeout_s,), daemon=True) for r in receivers]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(timeout_s + 2.0)
        rotator, self._rotator = self._rotator, None
        if rotator is not None:
            rotator.stop()  # everything acknowledged goes out to Parquet (or stays staged on failure)
        self._store.close()
        self._final_stats = self._stats_of(self._store, self._ingestor, self._http, rotator)
        self._store = None
        self._grpc = self._http = None
        log.info("collector stopped: %s", self._final_stats)
        return self._final_stats

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every item acknowledged so far is written to the store; False on timeout."""
        store = self._store
        return True if store is None else store.flush(timeout_s)

    def stats(self) -> dict[str, Any]:
        """Counters: ``grpc_requests``, ``http_requests``, ``spans_received``, ``metric_points_received``,
        ``log_records_received``, ``rejected_*`` (``rejected_unauthenticated`` too), ``http_<status>``; the
        HTTP receiver's ``http_connections`` (accepted), ``http_connections_refused`` (over the limit),
        ``http_idle_closed``, ``http_headers_timeouts``, ``http_body_timeouts`` and its gauges
        ``http_connections_open`` / ``http_connections_peak``; the store's ``store_accepted``,
        ``store_written``, ``store_failed``, ``store_dropped``, ``store_queued`` (rows), ``store_batches``
        (insert statements), ``store_commit_timeouts`` and ``store_checkpoints`` (the writer's, one per row group
        written); with Parquet output the rotation's ``parquet_rotations``,
        ``parquet_failed``, ``parquet_rows``, ``parquet_files``, ``parquet_bytes``, ``parquet_retries``,
        ``parquet_last_error``."""
        if self._store is None:
            return dict(self._final_stats or {})
        return self._stats_of(self._store, self._ingestor, self._http, self._rotator)

    @staticmethod
    def _stats_of(store: Store, ingestor: Ingestor | None, http: HttpReceiver | None,
                  rotator: ParquetRotator | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "grpc_requests": 0, "http_requests": 0, "spans_received": 0, "metric_points_received": 0,
            "log_records_received": 0, "rejected_invalid": 0, "rejected_too_large": 0,
            "rejected_unavailable": 0, "rejected_unauthenticated": 0,
        }
        if http is not None:
            out.update({"http_connections": 0, "http_connections_refused": 0, "http_idle_closed": 0,
                        "http_headers_timeouts": 0, "http_body_timeouts": 0})
        if ingestor is not None:
            out.update(ingestor.counters())
        if http is not None:
            out.update(http.stats())
        out.update({f"store_{k}": v for k, v in asdict(store.stats()).items()})
        if rotator is not None:
            out.update({f"parquet_{k}": v for k, v in asdict(rotator.stats()).items()})
        return out

    def __enter__(self) -> EmbeddedCollector:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _absent_store_paths(store_path: Path) -> list[Path]:
    """What opening a store at ``store_path`` would create, as it is now: the file and its write-ahead log
    (only when the file is missing: a log next to an existing store holds its data) and the missing folders
    above it, deepest first. Empty when the store file exists."""
    if store_path.exists():
        return []
    wal = store_path.with_name(store_path.name + ".wal")
    paths = [store_path] if wal.exists() else [store_path, wal]
    for folder in store_path.absolute().parents:
        if folder.exists():
            break
        paths.append(folder)
    return paths


def _remove_created(paths: list[Path]) -> None:
    """Remove the files and (empty) folders of :func:`_absent_store_paths` that a failed start left; what
    cannot be removed is logged and left."""
    for path in paths:
        try:
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove %s, created by the collector's failed start: %s", path, exc)
