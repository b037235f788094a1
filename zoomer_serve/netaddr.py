"""Network addresses: the one test of whether a listening address is reachable from this machine only, and
the error of a receiver that cannot listen on its address."""

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


def format_hostport(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class BindError(OSError):
    """A receiver could not listen on its address (port in use, bad host, ...).

    Attributes:
        receiver: which one, e.g. ``"OTLP/gRPC"``.
        address: ``host:port`` it asked for.
        reason: why, without the address (e.g. ``"Address already in use"``).
        setting: the name of the setting that chose the port (e.g. ``"grpc_port"``), "" when none.
    """

    def __init__(self, receiver: str, address: str, reason: str, setting: str = "") -> None:
        self.receiver, self.address, self.reason, self.setting = receiver, address, reason, setting
        where = f" ({setting})" if setting else ""
        super().__init__(f"{receiver} receiver cannot listen on {address}{where}: {reason}")


def bind_failure_reason(exc: OSError) -> str:
    """The reason of a failed ``bind`` without the address that ``socket.create_server`` appends
    ("Address already in use", "Name or service not known", ...)."""
    text = exc.strerror or str(exc)
    return text.split(" (while attempting to bind on address", 1)[0]


def bind_probe(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound, found by binding it once (and closing at once); None when it can be.
    For a server (grpc) whose own bind error does not say why."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host.strip("[]"), port), family=family).close()
    except OSError as exc:
        return bind_failure_reason(exc)
    return None
