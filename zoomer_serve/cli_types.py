"""argparse value types shared by the subcommands: each rejects a bad value with a message naming the rule."""

from __future__ import annotations

import argparse

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
    """An int in 1..2147483647: what a C ``int`` takes (``torch.set_num_threads``, gRPC message size limits)."""
    return int(_number(text, int, f"an integer in 1..{INT32_MAX}", lambda v: 1 <= v <= INT32_MAX))


MAX_CLIENT_THREADS = 1024


def client_threads(text: str) -> int:
    """A count of load-generating client threads, 1..:data:`MAX_CLIENT_THREADS` (one OS thread each: more is a
    mistake that would exhaust threads or memory before any load ran; ``loadtest`` drives larger loads)."""
    return int(_number(text, int, f"an integer in 1..{MAX_CLIENT_THREADS}", lambda v: 1 <= v <= MAX_CLIENT_THREADS))


def positive_uint32(text: str) -> int:
    """An int in 1..4294967295: a count or a length the wire carries as a protobuf ``uint32``."""
    return int(_number(text, int, f"an integer in 1..{UINT32_MAX}", lambda v: 1 <= v <= UINT32_MAX))


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    return int(_number(text, int, "an integer >= 0", lambda v: v >= 0))


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    return _number(text, float, "a number >= 0", lambda v: 0 <= v < float("inf"))


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0 = any free port)."""
    return int(_number(text, int, "a port number in 0..65535", lambda v: 0 <= v <= 65535))


def positive_float(text: str) -> float:
    """A finite float > 0."""
    return _number(text, float, "a number > 0", lambda v: 0 < v < float("inf"))
