"""The profiler range label that ties a request to its part of a kernel profile.

While a profiling session runs, each covered request runs inside a ``torch.profiler.record_function`` range
named ``zoomer.request/<trace_id>/<span_id>``: the request span's W3C trace id (32 lowercase hex digits) and
span id (16 lowercase hex digits). In the Chrome trace the range is a ``user_annotation`` event; the analysis
side finds a request's kernels through it. The range opens on the thread that starts the request; a request
whose work runs on other threads has ranges of the same name there too, opened by its phases
(:class:`zoomer_serve.recording.recorder.phase`), and all of them are its. :data:`REQUEST_LABEL_PREFIX` is
the one definition of the format.

A batch of requests (:mod:`zoomer_serve.batching`) runs inside a range of its own, ``zoomer.batch/<trace_id>/
<span_id>`` (the batch span's ids, :func:`batch_label`), on the thread that runs it; right after it opens, one
empty marker range per member names the member and its weight under the share rule (:func:`member_label`).
The batch's work belongs to its members, divided by those weights
(:mod:`zoomer_serve.profiling.batch_shares`).
"""

from __future__ import annotations

import re
import threading

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


BATCH_LABEL_PREFIX = "zoomer.batch/"
MEMBER_LABEL_PREFIX = "zoomer.batch.member/"
_BATCH = re.compile(r"zoomer\.batch/([0-9a-f]{32})/([0-9a-f]{16})")
_MEMBER = re.compile(r"zoomer\.batch\.member/([0-9a-f]{16})/([0-9a-f]{32})/([0-9a-f]{16})/([0-9]{1,18})")


def batch_label(trace_id: int, span_id: int) -> str:
    """The range name of a batch (:mod:`zoomer_serve.batching`) while a profiling session runs:
    ``zoomer.batch/<batch span's trace_id hex32>/<span_id hex16>``. The batch's operators and kernels fall inside
    it on the batch thread; they belong to its members, divided by the share rule."""
    return f"{BATCH_LABEL_PREFIX}{trace_id:032x}/{span_id:016x}"


def member_label(batch_span_id: int, trace_id: int, span_id: int, weight: int) -> str:
    """The marker of one member of a batch: an empty range opened and closed right after the batch's range opens,
    on the same thread, named ``zoomer.batch.member/<batch span_id hex16>/<member trace_id hex32>/<member span_id
    hex16>/<weight>`` (``weight``: the member's weight under the batch's share rule, a non-negative integer)."""
    return f"{MEMBER_LABEL_PREFIX}{batch_span_id:016x}/{trace_id:032x}/{span_id:016x}/{max(0, int(weight))}"


def parse_batch_label(name: str) -> tuple[int, int] | None:
    """``(trace_id, span_id)`` of the batch span from a :func:`batch_label`; None for any other name."""
    if not name.startswith(BATCH_LABEL_PREFIX):
        return None
    match = _BATCH.fullmatch(name)
    return (int(match.group(1), 16), int(match.group(2), 16)) if match is not None else None


def parse_member_label(name: str) -> tuple[int, int, int, int] | None:
    """``(batch span_id, member trace_id, member span_id, weight)`` from a :func:`member_label`; None for any
    other name."""
    if not name.startswith(MEMBER_LABEL_PREFIX):
        return None
    match = _MEMBER.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1), 16), int(match.group(2), 16), int(match.group(3), 16), int(match.group(4))


THREAD_REQUESTS: dict[int, tuple[str, str, str]] = {}
"""While a profiling session runs: thread ident (``threading.get_ident()``) -> ``(trace_id, span_id, rpc.method)``
(ids as lowercase hex) of the covered request whose range was opened last, of those still open on that thread. Set
and cleared with the request's range (:func:`enter_thread_request`), read by the in-process CPU sampler to label its
samples. Plain dict operations under the interpreter lock: no lock of its own."""

_OPEN: dict[int, list[tuple[str, str, str]]] = {}
"""Thread ident -> the requests whose ranges are open on it, in the order they were opened. Ranges need not close
in the reverse order: an asyncio server's requests open and close theirs on the event loop's thread as their
coroutines interleave (restoring "the one it replaced" there left a request that had ended marked on a thread
that was gone, and a later thread with the same ident had its samples labelled with it)."""


def enter_thread_request(trace_id: int, span_id: int, method: str) -> tuple[int, tuple[str, str, str]]:
    """Mark this thread as running the request; returns the token for :func:`exit_thread_request`."""
    ident = threading.get_ident()
    entry = (f"{trace_id:032x}", f"{span_id:016x}", method)
    _OPEN.setdefault(ident, []).append(entry)
    THREAD_REQUESTS[ident] = entry
    return ident, entry


def exit_thread_request(token: tuple[int, tuple[str, str, str]]) -> None:
    """Undo :func:`enter_thread_request`, in any order: the thread is then marked with the request opened last of
    those still open on it, or not at all."""
    ident, entry = token
    open_here = _OPEN.get(ident)
    if open_here is None:
        return
    for i in range(len(open_here) - 1, -1, -1):
        if open_here[i] is entry:
            del open_here[i]
            break
    if open_here:
        THREAD_REQUESTS[ident] = open_here[-1]
    else:
        _OPEN.pop(ident, None)
        THREAD_REQUESTS.pop(ident, None)
