"""Network addresses: the one test of whether a listening address is reachable from this machine only."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback literals (127.0.0.0/8, ``::1``, brackets allowed); False for wildcards
    (``0.0.0.0``, ``::``, ``""``), other addresses and other host names (which could resolve anywhere). Servers
    that can write telemetry or start profiling listen on a non-loopback address only with a token."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False
