"""``zoomer-serve collector``: run the embedded OTLP collector until SIGINT / SIGTERM.

Prints one JSON line when listening, ``{"event": "ready", "grpc_port": P, "http_port": P, "store": PATH,
"auth": [...], "open": BOOL}`` (``auth``: any of ``"bearer_token"``, ``"tls"``; ``open``: true when it listens
on a non-loopback address with neither, which it does only with ``--insecure-open``), and one when stopped,
``{"event": "stopped", ...counters}``. SIGINT (Ctrl+C, to the process or its group) and SIGTERM stop it the
same way: the receivers stop accepting, requests being ingested finish, and everything acknowledged is
already in the store (it was committed before the answer). Exit codes: 0 after a clean stop, 2 when a
setting is wrong (the same non-zero ``--grpc-port`` and ``--http-port`` included), 1 when the store cannot be
opened or a port cannot be bound (message on stderr, naming the receiver, its address and its flag). A start
that fails leaves no store file it created itself.

Settings besides the flags (each flag's default comes from its variable):

============================ ======================================================================
variable                     meaning
============================ ======================================================================
``ZOOMER_STORE``             the store file (``--store``)
``ZOOMER_COLLECTOR_TOKEN``   bearer token every export must carry (no flag: a command line shows
                             in ``ps``); see :mod:`zoomer_serve.collector.security`
``ZOOMER_COLLECTOR_TLS_CERT`` / ``..._TLS_KEY``  ``--tls-cert`` / ``--tls-key``
``ZOOMER_COLLECTOR_INSECURE_OPEN``  ``--insecure-open``
``ZOOMER_COLLECTOR_PARQUET_URL``  ``--parquet-url``: rotate the tables out to Parquet files there
``ZOOMER_COLLECTOR_PARQUET_ROTATE_S``  ``--parquet-rotate-s``
``ZOOMER_COLLECTOR_MAX_CONNECTIONS``, ``..._HEADER_TIMEOUT_S``, ``..._BODY_TIMEOUT_S``,
``..._IDLE_TIMEOUT_S``       the OTLP/HTTP receiver's bounds (:class:`~zoomer_serve.collector.http_receiver.HttpLimits`)
============================ ======================================================================
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from zoomer_serve.artifacts.storage import StorageError, check_protocol
from zoomer_serve.cli_types import port_number, positive_float, positive_int, positive_int32, store_path
from zoomer_serve.collector.collector import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_MESSAGE_BYTES,
    EmbeddedCollector,
)
from zoomer_serve.collector.http_receiver import HttpLimits
from zoomer_serve.collector.rotation import ParquetConfig
from zoomer_serve.collector.security import ReceiverSecurity
from zoomer_serve.collector.store import StoreError, default_store_path
from zoomer_serve.config import ConfigError
from zoomer_serve.netaddr import BindError
from zoomer_serve.processes import SignalStop

_PORT_OPTIONS = {"grpc_port": "--grpc-port", "http_port": "--http-port"}
"""The flag of each :class:`~zoomer_serve.netaddr.BindError` setting, for its message."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``collector`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "collector",
        help="run the embedded OTLP collector (gRPC + HTTP) writing to a DuckDB store",
        description="Receive OTLP traces and metrics over gRPC and HTTP and store them in DuckDB. "
        "Runs until SIGINT or SIGTERM, then writes everything acknowledged and exits 0.",
    )
    p.add_argument("--store", type=store_path, default=None,
                   help="DuckDB file (default: $ZOOMER_STORE or ./zoomer-data/zoomer.duckdb)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1). A non-loopback address needs a token "
                        "(ZOOMER_COLLECTOR_TOKEN), TLS, or --insecure-open")
    p.add_argument("--grpc-port", type=port_number, default=DEFAULT_GRPC_PORT,
                   help=f"OTLP/gRPC port, 0 = any free port (default {DEFAULT_GRPC_PORT})")
    p.add_argument("--http-port", type=port_number, default=DEFAULT_HTTP_PORT,
                   help=f"OTLP/HTTP port, 0 = any free port (default {DEFAULT_HTTP_PORT})")
    p.add_argument("--max-message-bytes", type=positive_int32, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help=f"largest export request in bytes, after decompression (default {DEFAULT_MAX_MESSAGE_BYTES})")
    sec = p.add_argument_group("authentication and TLS (token: ZOOMER_COLLECTOR_TOKEN)")
    sec.add_argument("--tls-cert", type=Path, default=None,
                     help="PEM certificate chain: both receivers speak TLS (with --tls-key; "
                          "ZOOMER_COLLECTOR_TLS_CERT)")
    sec.add_argument("--tls-key", type=Path, default=None, help="PEM private key (ZOOMER_COLLECTOR_TLS_KEY)")
    sec.add_argument("--insecure-open", action="store_true", default=None,
                     help="listen on a non-loopback address with neither token nor TLS: anyone who can connect "
                          "can write (ZOOMER_COLLECTOR_INSECURE_OPEN=true)")
    pq = p.add_argument_group("Parquet output (many collectors side by side, object storage)")
    pq.add_argument("--parquet-url", default=None, metavar="URL",
                    help="also write the tables as rotating Parquet files under URL or folder (s3://bucket/prefix, "
                         "...), hive-partitioned by service and hour; the --store file then only stages rows until "
                         "they are out (ZOOMER_COLLECTOR_PARQUET_URL)")
    pq.add_argument("--parquet-rotate-s", type=positive_float, default=None, metavar="S",
                    help=f"seconds between rotations (default {ParquetConfig.rotate_s:g}; "
                         "ZOOMER_COLLECTOR_PARQUET_ROTATE_S)")
    lim = p.add_argument_group("OTLP/HTTP receiver bounds")
    lim.add_argument("--max-connections", type=positive_int, default=None,
                     help="open connections at most; past it new ones are closed at once "
                          f"(default {HttpLimits.max_connections}; ZOOMER_COLLECTOR_MAX_CONNECTIONS)")
    lim.add_argument("--header-timeout-s", type=positive_float, default=None,
                     help="a request's headers must arrive within this many seconds of its first byte "
                          f"(default {HttpLimits.header_timeout_s:g}; ZOOMER_COLLECTOR_HEADER_TIMEOUT_S)")
    lim.add_argument("--body-timeout-s", type=positive_float, default=None,
                     help="a request's whole body must arrive within this many seconds of its headers "
                          f"(default {HttpLimits.body_timeout_s:g}; ZOOMER_COLLECTOR_BODY_TIMEOUT_S)")
    lim.add_argument("--idle-timeout-s", type=positive_float, default=None,
                     help="a connection waiting this long for a request is closed "
                          f"(default {HttpLimits.idle_timeout_s:g}; ZOOMER_COLLECTOR_IDLE_TIMEOUT_S)")
    p.set_defaults(func=run)
    return p


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _raise_file_limit(needed: int) -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` towards ``needed`` (never above the hard limit): each
    OTLP/HTTP connection is a file descriptor."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX, or not allowed
        pass


def build_collector(args: argparse.Namespace) -> EmbeddedCollector:
    """The collector the parsed ``args`` (and the ``ZOOMER_*`` variables) describe.

    Raises:
        ConfigError: a bad setting or variable (named), the same non-zero ``--grpc-port`` and ``--http-port``,
            or an open non-loopback bind without ``--insecure-open``.
        ValueError: a bad port or size.
    """
    if args.grpc_port == args.http_port and args.grpc_port != 0:
        raise ConfigError(f"--grpc-port and --http-port are both {args.grpc_port}: the OTLP/gRPC and OTLP/HTTP "
                          "receivers need a port each (0 picks a free one)")
    security = ReceiverSecurity.from_env(tls_cert=args.tls_cert, tls_key=args.tls_key,
                                         insecure_open=args.insecure_open)
    limits = HttpLimits.from_env(max_connections=args.max_connections, header_timeout_s=args.header_timeout_s,
                                 body_timeout_s=args.body_timeout_s, idle_timeout_s=args.idle_timeout_s)
    store = args.store if args.store is not None else default_store_path()
    return EmbeddedCollector(store, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                             max_message_bytes=args.max_message_bytes, http_limits=limits, security=security,
                             parquet=parquet_config(args))


def parquet_config(args: argparse.Namespace, env: Any = None) -> ParquetConfig | None:
    """The Parquet output ``--parquet-url`` / ``ZOOMER_COLLECTOR_PARQUET_URL`` asks for (None: off).

    Raises:
        ConfigError: a URL whose protocol cannot be used (unknown to fsspec, or its package missing), a bad
            ``ZOOMER_COLLECTOR_PARQUET_ROTATE_S`` or rotation period (named).
    """
    env = os.environ if env is None else env
    url = getattr(args, "parquet_url", None)
    url_name = "--parquet-url"
    if not url:
        url, url_name = (env.get("ZOOMER_COLLECTOR_PARQUET_URL") or "").strip(), "ZOOMER_COLLECTOR_PARQUET_URL"
    if not url:
        return None
    try:
        check_protocol(url)
    except (StorageError, ValueError) as exc:
        raise ConfigError(f"{url_name}: {exc}") from None
    rotate = getattr(args, "parquet_rotate_s", None)
    name = "--parquet-rotate-s"
    if rotate is None and (env.get("ZOOMER_COLLECTOR_PARQUET_ROTATE_S") or "").strip():
        name = "ZOOMER_COLLECTOR_PARQUET_ROTATE_S"
        try:
            rotate = float(env["ZOOMER_COLLECTOR_PARQUET_ROTATE_S"])
        except ValueError:
            raise ConfigError(f"{name} must be a number of seconds, got "
                              f"{env['ZOOMER_COLLECTOR_PARQUET_ROTATE_S']!r}") from None
    try:
        return ParquetConfig(url) if rotate is None else ParquetConfig(url, rotate_s=rotate)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Run the collector with the parsed ``args`` until SIGINT / SIGTERM (or until ``stop`` is set).

    Returns the exit code: 0 after a clean stop, 2 for a bad setting (as every zoomer-serve command), 1 if it
    could not start otherwise (the store is in use, a port is taken).
    """
    stop = stop or threading.Event()
    try:
        collector = build_collector(args)
    except ValueError as exc:  # ConfigError included
        print(f"zoomer-serve collector: {exc}", file=sys.stderr)
        return 2
    _raise_file_limit(collector.config.http_limits.max_connections + 256)
    with SignalStop("zoomer-serve collector", event=stop, announce=False):  # SIGINT / SIGTERM set stop
        return _serve(collector, stop)


def _serve(collector: EmbeddedCollector, stop: threading.Event) -> int:
    """Start ``collector``, say it is ready, run until ``stop`` is set, say what it stored; the exit code as
    :func:`run` gives it. The collector is stopped however this ends."""
    try:
        try:
            collector.start()
        except ConfigError as exc:  # TLS files that hold no certificate or key
            print(f"zoomer-serve collector: {exc}", file=sys.stderr)
            return 2
        except BindError as exc:
            option = _PORT_OPTIONS.get(exc.setting, exc.setting)
            print(f"zoomer-serve collector: {exc.receiver} receiver cannot listen on {exc.address} (set by --host "
                  f"and {option}): {exc.reason}", file=sys.stderr)
            return 1
        except (StoreError, OSError) as exc:
            print(f"zoomer-serve collector: {exc}", file=sys.stderr)
            return 1
        security = collector.config.security
        _emit({"event": "ready", "grpc_port": collector.grpc_port, "http_port": collector.http_port,
               "store": str(collector.store_path.resolve()), "auth": security.methods,
               "open": security.is_open(collector.config.host),
               "parquet": collector.config.parquet.url if collector.config.parquet is not None else None})
        while not stop.wait(0.5):
            pass
        stats = collector.stop()
        _emit({"event": "stopped", **stats})
        return 0
    finally:
        collector.stop()
