"""W3C Trace Context parsing and formatting (``traceparent`` / ``tracestate``), and span id generation.

The request path parses ``traceparent`` itself (a few string operations) instead of going through the
OpenTelemetry propagator API, which costs several µs per request. Garbage never raises: it yields ``None``,
and the caller starts a new trace.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

_rng = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _rng.seed(os.urandom(16)))
_HEX = frozenset("0123456789abcdef")
_MAX_TRACESTATE_LEN = 512


random_bits = _rng.getrandbits
"""``random_bits(k)``: k random bits from this module's generator (reseeded in a forked child), for callers on the
request path that make ids without a call to :func:`new_trace_id` / :func:`new_span_id` (0 must become 1)."""


def new_trace_id() -> int:
    """A random, non-zero 128-bit trace id."""
    return _rng.getrandbits(128) or 1


def new_span_id() -> int:
    """A random, non-zero 64-bit span id."""
    return _rng.getrandbits(64) or 1


@dataclass(frozen=True)
class ParentContext:
    """A parent span taken from a caller: its trace id (128-bit int), span id (64-bit int), W3C trace
    flags (bit 0 = sampled), and tracestate (str or None), and whether it came from another process."""

    trace_id: int
    span_id: int
    trace_flags: int
    trace_state: str | None = None
    remote: bool = True

    @property
    def sampled(self) -> bool:
        return bool(self.trace_flags & 1)


def parse_traceparent(value: str | bytes | None, tracestate: str | bytes | None = None) -> ParentContext | None:
    """Parse a W3C ``traceparent`` header (``00-<32 hex>-<16 hex>-<2 hex>``).

    Returns None for a missing or malformed value, an all-zero id, or version ``ff`` (all per the W3C
    Trace Context spec); a future version with extra fields is accepted. ``tracestate`` is kept verbatim
    when at most 512 characters, else dropped.
    """
    value = _ascii(value)
    if not value:
        return None
    parts = value.split("-")
    if len(parts) < 4:
        return None
    version, trace_hex, span_hex, flags_hex = parts[0], parts[1], parts[2], parts[3]
    if len(version) != 2 or len(trace_hex) != 32 or len(span_hex) != 16 or len(flags_hex) != 2:
        return None
    if not _HEX.issuperset(version + trace_hex + span_hex + flags_hex) or version == "ff":
        return None
    if version == "00" and len(parts) != 4:
        return None
    trace_id = int(trace_hex, 16)
    span_id = int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    state = _clean_tracestate(tracestate)
    return ParentContext(trace_id, span_id, int(flags_hex, 16), state, True)


def _ascii(value: str | bytes | None) -> str | None:
    """A header value as stripped text, or None when absent or not ASCII."""
    if not value:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value.strip()


def _clean_tracestate(value: str | bytes | None) -> str | None:
    value = _ascii(value)
    if not value or len(value) > _MAX_TRACESTATE_LEN or not value.isprintable():
        return None
    return value


def format_traceparent(trace_id: int, span_id: int, trace_flags: int) -> str:
    """Format a W3C ``traceparent`` header value (version 00)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{trace_flags & 0xFF:02x}"
