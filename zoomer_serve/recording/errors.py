"""Fail-open bookkeeping: internal errors of the middleware are counted and logged once per place.

Nothing in zoomer-serve may raise into the server it watches. Code on the request path catches its own
exceptions and calls :func:`internal_error`, which counts them per place and logs the first one of each
place with its traceback; :func:`internal_error_counts` reads the counters (tests and the exporter's
self-metrics use it).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("zoomer_serve")
_counts: Counter[str] = Counter()
_lock = threading.Lock()


def internal_error(where: str, exc: BaseException | None = None) -> None:
    """Count an internal error at ``where``; log it (with traceback) the first time only."""
    with _lock:
        _counts[where] += 1
        first = _counts[where] == 1
    if first:
        logger.warning("zoomer-serve internal error in %s (logged once; counted): %r", where, exc,
                       exc_info=exc is not None)


def internal_error_counts() -> dict[str, int]:
    """A copy of the internal error counters, by place."""
    with _lock:
        return dict(_counts)
