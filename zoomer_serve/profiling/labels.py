"""The profiler range label that ties a request to its part of a kernel profile.

While a profiling session runs, each covered request runs inside a ``torch.profiler.record_function`` range
named ``zoomer.request/<trace_id>/<span_id>``: the request span's W3C trace id (32 lowercase hex digits) and
span id (16 lowercase hex digits). In the Chrome trace the range is a ``user_annotation`` event; the analysis
side finds a request's kernels through it. The range opens on the thread that starts the request; a request
whose work runs on other threads has ranges of the same name there too, opened by its phases
(:class:`zoomer_serve.recording.recorder.phase`), and all of them are its. :data:`REQUEST_LABEL_PREFIX` is
the one definition of the format.
"""

from __future__ import annotations

import re

REQUEST_LABEL_PREFIX = "zoomer.request/"
_LABEL = re.compile(r"zoomer\.request/([0-9a-f]{32})/([0-9a-f]{16})")


def request_label(trace_id: int, span_id: int) -> str:
    """The range name for a request span: ``zoomer.request/<trace_id hex32>/<span_id hex16>``."""
    return f"{REQUEST_LABEL_PREFIX}{trace_id:032x}/{span_id:016x}"


def parse_request_label(name: str) -> tuple[int, int] | None:
    """``(trace_id, span_id)`` from a range name made by :func:`request_label`; None for any other name."""
    if not name.startswith(REQUEST_LABEL_PREFIX):
        return None
    match = _LABEL.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1), 16), int(match.group(2), 16)
