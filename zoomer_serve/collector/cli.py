"""``zoomer-serve collector``: run the embedded OTLP collector until SIGINT / SIGTERM.

Prints one JSON line when listening, ``{"event": "ready", "grpc_port": P, "http_port": P, "store": PATH}``,
and one when stopped, ``{"event": "stopped", ...counters}``. Exit codes: 0 after a clean stop, 1 when the
store cannot be opened or a port cannot be bound (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from zoomer_serve.collector.collector import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_MESSAGE_BYTES,
    EmbeddedCollector,
)
from zoomer_serve.collector.store import StoreError, default_store_path


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``collector`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "collector",
        help="run the embedded OTLP collector (gRPC + HTTP) writing to a DuckDB store",
        description="Receive OTLP traces and metrics over gRPC and HTTP and store them in DuckDB. "
        "Runs until SIGINT or SIGTERM, then writes everything acknowledged and exits 0.",
    )
    p.add_argument("--store", type=Path, default=None,
                   help="DuckDB file (default: $ZOOMER_STORE or ./zoomer-data/zoomer.duckdb)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; anyone who can connect can write)")
    p.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT,
                   help=f"OTLP/gRPC port, 0 = any free port (default {DEFAULT_GRPC_PORT})")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help=f"OTLP/HTTP port, 0 = any free port (default {DEFAULT_HTTP_PORT})")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help=f"largest export request in bytes, after decompression (default {DEFAULT_MAX_MESSAGE_BYTES})")
    p.set_defaults(func=run)
    return p


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _install_stop_handlers(stop: threading.Event) -> dict[int, Any]:
    """Route SIGINT / SIGTERM to ``stop``; returns the previous handlers (empty off the main thread)."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda _signum, _frame: stop.set())
    return previous


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Run the collector with the parsed ``args`` until SIGINT / SIGTERM (or until ``stop`` is set).

    Returns the exit code: 0 after a clean stop, 1 if it could not start.
    """
    store = args.store if args.store is not None else default_store_path()
    stop = stop or threading.Event()
    try:
        collector = EmbeddedCollector(store, host=args.host, grpc_port=args.grpc_port,
                                      http_port=args.http_port, max_message_bytes=args.max_message_bytes)
    except ValueError as exc:
        print(f"zoomer-serve collector: {exc}", file=sys.stderr)
        return 1
    previous = _install_stop_handlers(stop)
    try:
        try:
            collector.start()
        except (StoreError, OSError) as exc:
            print(f"zoomer-serve collector: {exc}", file=sys.stderr)
            return 1
        _emit({"event": "ready", "grpc_port": collector.grpc_port, "http_port": collector.http_port,
               "store": str(collector.store_path.resolve())})
        while not stop.wait(0.5):
            pass
        stats = collector.stop()
        _emit({"event": "stopped", **stats})
        return 0
    finally:
        collector.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
