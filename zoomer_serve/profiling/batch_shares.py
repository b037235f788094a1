"""A batch's part of a kernel profile, divided among its member requests.

While a profiling session runs, a batch (:mod:`zoomer_serve.batching`) runs inside a range named with its
span's ids (:func:`~zoomer_serve.profiling.labels.batch_label`), and one empty marker range per member
(:func:`~zoomer_serve.profiling.labels.member_label`) names the member and its weight under the batch's share
rule. :func:`~zoomer_serve.profiling.summary.summarize_events` attributes the operators and GPU activities inside
a batch range to the batch as it does for a request range (innermost range on the thread, then correlation ids);
:func:`share_batches` then gives each member its share of every figure: counts and bytes split exactly with the
largest-remainder method (the members' parts add up to the batch's), times in proportion to the weights. A member
whose own request range is not in the trace (it started before the session) still gets its share, as a request of
its own, so that the batch's kernel time is attributed to requests in full.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from zoomer_serve.batching.shares import split_float, split_int

_INT_FIELDS = ("kernel_count", "cuda_runtime_count", "memcpy_count", "memcpy_bytes", "memset_count", "memset_bytes",
               "cpu_op_count")
_FLOAT_FIELDS = ("kernel_time_us", "cuda_runtime_time_us", "memcpy_time_us", "memset_time_us")


@dataclass
class BatchMarks:
    """The members of one batch range as its markers name them: ``(trace_id, span_id, weight)`` in order."""

    members: list[tuple[int, int, int]] = field(default_factory=list)


def share_batches(batches: dict[int, Any], marks: dict[int, BatchMarks], requests: dict[Hashable, Any],
                  new_profile: Any) -> int:
    """Add each batch profile's figures (``batches``: batch span id -> a ``RequestProfile`` of the batch range) to
    its members' profiles in ``requests`` (keyed ``(trace_id, span_id)``; ``new_profile(key, start_us)`` makes a
    missing one), by the weights in ``marks``. Returns the number of batches shared (a batch range without
    markers keeps its figures unattributed to any request)."""
    shared = 0
    for batch_span_id, profile in batches.items():
        mark = marks.get(batch_span_id)
        if mark is None or not mark.members:
            continue
        shared += 1
        w = [weight for _, _, weight in mark.members]
        parts: dict[str, list[Any]] = {}
        for name in _INT_FIELDS:
            parts[name] = split_int(int(getattr(profile, name)), w)
        for name in _FLOAT_FIELDS:
            parts[name] = split_float(float(getattr(profile, name)), w)
        kernels = {k: (split_int(stat.count, w), split_float(stat.time_us, w)) for k, stat in profile.kernels.items()}
        for i, (trace_id, span_id, _) in enumerate(mark.members):
            key = (trace_id, span_id)
            member = requests.get(key)
            if member is None:
                member = requests[key] = new_profile(key, profile.start_us)
            for name, values in parts.items():
                setattr(member, name, getattr(member, name) + values[i])
            for kname, (counts, times) in kernels.items():
                member.add_kernel_share(kname, counts[i], times[i])
    return shared
