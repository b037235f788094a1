"""argparse value types shared by the subcommands: each rejects a bad value with a message naming the rule."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from zoomer_serve.envvars import INT_MAX as INT32_MAX


def _number(text: str, kind: type, rule: str, ok: object) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule}") from None
    if not ok(value):  # type: ignore[operator]
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
    return value  # type: ignore[no-any-return]


def positive_int(text: str) -> int:
    """An int >= 1."""
    return int(_number(text, int, "an integer >= 1", lambda v: v >= 1))


UINT32_MAX = 2**32 - 1


def positive_int32(text: str) -> int:
    """An int in 1..2147483647: what a C ``int`` takes (gRPC message size limits)."""
    return int(_number(text, int, f"an integer in 1..{INT32_MAX}", lambda v: 1 <= v <= INT32_MAX))


MAX_CLIENT_THREADS = 1024


def client_threads(text: str) -> int:
    """A count of load-generating client threads, 1..:data:`MAX_CLIENT_THREADS` (one OS thread each: more is a
    mistake that would exhaust threads or memory before any load ran; ``loadtest`` drives larger loads)."""
    return int(_number(text, int, f"an integer in 1..{MAX_CLIENT_THREADS}", lambda v: 1 <= v <= MAX_CLIENT_THREADS))


MAX_TORCH_THREADS = 1024


def torch_threads(text: str) -> int:
    """torch's intra-op thread count, 1..:data:`MAX_TORCH_THREADS` (``torch.set_num_threads`` starts that many
    OpenMP threads: 100000 of them crashed the process with SIGSEGV)."""
    return int(_number(text, int, f"an integer in 1..{MAX_TORCH_THREADS}", lambda v: 1 <= v <= MAX_TORCH_THREADS))


def positive_uint32(text: str) -> int:
    """An int in 1..4294967295: a count or a length the wire carries as a protobuf ``uint32``."""
    return int(_number(text, int, f"an integer in 1..{UINT32_MAX}", lambda v: 1 <= v <= UINT32_MAX))


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in ``low..high`` (a bound the value meets later, named where it is given)."""
    def parse(text: str) -> int:
        return int(_number(text, int, f"an integer in {low}..{high}", lambda v: low <= v <= high))

    parse.__name__ = f"integer in {low}..{high}"  # argparse names the type in some messages
    return parse


def store_path(text: str) -> Path:
    """A path that is not empty (``Path("")`` would be the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the store location is empty")
    return Path(text)


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    return int(_number(text, int, "an integer >= 0", lambda v: v >= 0))


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    return _number(text, float, "a number >= 0", lambda v: 0 <= v < float("inf"))


MAX_DURATION_S = 7 * 86400


def duration_s(text: str) -> float:
    """A length of time in seconds, 0..:data:`MAX_DURATION_S` (a week: clocks and progress bars take it;
    1e308 s overflowed them)."""
    return _number(text, float, f"a number of seconds in 0..{MAX_DURATION_S}", lambda v: 0 <= v <= MAX_DURATION_S)


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0 = any free port)."""
    return int(_number(text, int, "a port number in 0..65535", lambda v: 0 <= v <= 65535))


def host_port(text: str) -> str:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) with a port in 1..65535: an address to connect to."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port in 1..65535")
    return text.strip()


def positive_float(text: str) -> float:
    """A finite float > 0."""
    return _number(text, float, "a number > 0", lambda v: 0 < v < float("inf"))
