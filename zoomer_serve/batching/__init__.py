"""Batch recording for servers that batch requests (dynamic batching): per-request queue wait, batch spans
linked to their members, and each member's share of the batch's phase time, GPU memory and kernels.

- :class:`BatchRecorder`: ``enqueue`` on the request's side, ``begin`` / :class:`Batch` ``end`` in the
  batching loop (:mod:`zoomer_serve.batching.recorder` shows the few lines).
- :mod:`zoomer_serve.batching.names`: every attribute and metric it writes; :mod:`zoomer_serve.batching.shares`:
  the share rule.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zoomer_serve.batching.names import CUT_DELAY, CUT_DRAIN, CUT_FULL
    from zoomer_serve.batching.recorder import Batch, BatchRecorder, BatchStats, QueuedRequest
    from zoomer_serve.batching.shares import RULE_EQUAL, RULE_ITEMS

# Loaded on first use (PEP 562): the trace summary needs only the share rule, not the recorder.
_LAZY = {
    **dict.fromkeys(("CUT_DELAY", "CUT_DRAIN", "CUT_FULL"), "names"),
    **dict.fromkeys(("Batch", "BatchRecorder", "BatchStats", "QueuedRequest"), "recorder"),
    **dict.fromkeys(("RULE_EQUAL", "RULE_ITEMS"), "shares"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zoomer_serve.batching' has no attribute {name!r}")
    value = getattr(import_module(f"zoomer_serve.batching.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CUT_DELAY",
    "CUT_DRAIN",
    "CUT_FULL",
    "RULE_EQUAL",
    "RULE_ITEMS",
    "Batch",
    "BatchRecorder",
    "BatchStats",
    "QueuedRequest",
]
