"""Health probes for the zoomer-serve containers of docker-compose.yml (standard library + grpcio, both in the
zoomer-serve image, so no curl or grpc_health_probe binary is needed).

Usage::

    python deploy/healthcheck.py [--timeout-s S] [--wait-s S] TARGET [TARGET ...]

TARGET is one of

- ``grpc://HOST:PORT``: a gRPC server there accepts an HTTP/2 connection (the channel becomes READY);
- ``tcp://HOST:PORT``: something accepts a TCP connection;
- ``http://HOST:PORT/PATH``: a GET is answered with a 2xx status.

Exit status 0 when every target answers within ``--timeout-s`` seconds (default 3), else 1 with one line per
target that did not on stderr; 2 for a malformed target. With ``--wait-s N`` the probes are repeated every
second until all answer or N seconds have passed (for one-shot "wait until that service is ready" services).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("grpc", "tcp", "http")


@dataclass(frozen=True)
class Target:
    """One probe: ``kind`` in :data:`KINDS`, ``host``, ``port`` and (for http) ``path``."""

    kind: str
    host: str
    port: int
    path: str = "/"

    def __str__(self) -> str:
        suffix = self.path if self.kind == "http" else ""
        return f"{self.kind}://{self.host}:{self.port}{suffix}"


def parse_target(text: str) -> Target:
    """Parse ``grpc://h:p``, ``tcp://h:p`` or ``http://h:p/path``. Raises ValueError naming the target."""
    url = urllib.parse.urlsplit(text)
    if url.scheme not in KINDS:
        raise ValueError(f"target {text!r}: the scheme must be one of {', '.join(KINDS)}")
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None:
        raise ValueError(f"target {text!r}: expected {url.scheme}://HOST:PORT with a numeric port")
    return Target(url.scheme, url.hostname, port, url.path or "/")


def probe(target: Target, timeout_s: float) -> str | None:
    """Probe ``target`` once; None when it answered, else why not (one line)."""
    if target.kind == "grpc":
        return _probe_grpc(target, timeout_s)
    if target.kind == "tcp":
        try:
            with socket.create_connection((target.host, target.port), timeout=timeout_s):
                return None
        except OSError as exc:
            return f"{target}: no TCP connection ({exc})"
    return _probe_http(target, timeout_s)


def _probe_grpc(target: Target, timeout_s: float) -> str | None:
    import grpc

    channel = grpc.insecure_channel(f"{target.host}:{target.port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return None
    except grpc.FutureTimeoutError:
        return f"{target}: the gRPC channel did not become ready within {timeout_s:g} s"
    finally:
        channel.close()


def _probe_http(target: Target, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{target.host}:{target.port}{target.path}", timeout=timeout_s) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError) as exc:
        return f"{target}: no HTTP answer ({getattr(exc, 'reason', exc)})"
    return None if 200 <= status < 300 else f"{target}: HTTP status {status}"


def check(targets: Sequence[Target], timeout_s: float, wait_s: float = 0.0) -> list[str]:
    """Probe every target, repeating every second until all answer or ``wait_s`` seconds passed.
    Returns the failures of the last round (empty when all answered)."""
    deadline = time.monotonic() + wait_s
    while True:
        failures = [msg for msg in (probe(t, timeout_s) for t in targets) if msg is not None]
        if not failures or time.monotonic() + 1.0 > deadline:
            return failures
        time.sleep(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="+", metavar="TARGET", help="grpc://H:P, tcp://H:P or http://H:P/PATH")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="time for one probe (default 3 s)")
    parser.add_argument("--wait-s", type=float, default=0.0, help="keep probing for this long (default 0)")
    args = parser.parse_args(argv)
    try:
        targets = [parse_target(t) for t in args.targets]
    except ValueError as exc:
        parser.error(str(exc))
    failures = check(targets, args.timeout_s, args.wait_s)
    for msg in failures:
        print(f"unhealthy: {msg}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
