"""The frames that the server process writes to its export helper process (one definition for both sides).

A frame is a 4-byte big-endian payload length followed by a pickled ``(kind, body)``:

- ``(RECORDS, (parent_counters, [record, ...]))``: span records (:mod:`zoomer_serve.recording.records`) and the
  server side's loss counters so far (``{"queue_full": spans, "helper_lost": spans, "too_large": spans}``, and
  ``exported`` / ``rejected`` / ``export_failed``: those of the helpers that died before this one), cumulative,
  reported by the helper in ``otel.sdk.exporter.span.exported``; and ``calls_queue_full``,
  ``calls_too_large``, ``calls_helper_lost``: calls (request records; a span made with the OpenTelemetry API is
  none) missing from the RPC metrics, reported in ``zoomer.exporter.call.dropped``);
- ``(FLUSH, (seq, metrics))``: export everything received so far now (the RPC metrics too when ``metrics``);
  the helper answers ``{"event": "flushed", "seq": seq, "ok": bool}`` on stdout once it has been sent (or
  failed; ``ok``: whether the flush succeeded, :meth:`~zoomer_serve.export.worker.ExportWorker.flush`);
- ``(SHUTDOWN, budget_s)``: flush within ``budget_s`` seconds, report ``{"event": "stats", ...}`` and exit.

Frames are at most :data:`MAX_FRAME_BYTES` long: the server splits a batch whose pickle is larger; of a single
record that is larger on its own it drops (and counts) the spans and sends only what the RPC metrics read; the
helper skips (and counts) a longer frame instead of stopping.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

from zoomer_serve.export.otlp_wire import numpy_scalar_item

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 8 * 1024 * 1024
"""Largest frame payload, bytes. Bounds the memory one frame takes on either side and how long one
``pickle.dumps`` holds the server's interpreter lock."""

RECORDS = "records"
FLUSH = "flush"
SHUTDOWN = "shutdown"


def encode(kind: str, body: Any) -> bytes:
    """One frame: header and pickled ``(kind, body)`` (no size check: see :func:`pickled`)."""
    payload = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


_OWN_TYPES = (str, bool, int, float, bytes)


class _PlainPickler(pickle.Pickler):
    """Pickles records as they are, except a value of any other type than Python's own (an attribute value: an
    enum or a class of the server's ``__main__``, a tensor ...): a NumPy scalar as its Python value, anything else
    as its ``str()``, what the exporter would encode it as anyway. The helper process could not load such a class
    (``Can't get attribute 'Color' on <module ...>``) and skipped the whole frame, up to 128 calls, counted
    nowhere."""

    def reducer_override(self, obj: Any) -> Any:
        # never called for None, bool, int, float, str, bytes, list, tuple, dict, set (what records are made of)
        if type(obj) in (bytearray, frozenset, complex) or any(obj is t for t in _OWN_TYPES):  # the latter: our reducers' callables
            return NotImplemented
        plain = numpy_scalar_item(obj)
        if plain is not obj and type(plain) in _OWN_TYPES:
            return type(plain), (plain,)
        try:
            text = str(obj)
        except Exception:  # a user's value must not stop the export
            text = f"<{type(obj).__qualname__} whose str() failed>"
        return str, (text,)


def pickled(kind: str, body: Any) -> bytes:
    """The payload of a frame, without its header (to check its size before framing it). Values of other types
    than Python's own go as their ``str()`` (see :class:`_PlainPickler`)."""
    out = io.BytesIO()
    _PlainPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump((kind, body))
    return out.getvalue()


def framed(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> tuple[str, Any]:
    """``(kind, body)`` of a frame's payload.

    Raises:
        ValueError: the payload is not a frame of this protocol.
    """
    try:
        kind, body = pickle.loads(payload)
    except Exception as exc:
        raise ValueError(f"not an export frame: {exc!r}") from None
    if kind not in (RECORDS, FLUSH, SHUTDOWN):
        raise ValueError(f"unknown export frame kind {kind!r}")
    return kind, body
