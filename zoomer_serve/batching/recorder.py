"""Batch recording: what a server's own batching loop calls so that each request keeps its figures.

A request that joins a batch calls :meth:`BatchRecorder.enqueue` on its own thread or task (its span is the
current request, or given); the batching loop, once it cuts a batch, calls :meth:`BatchRecorder.begin` with the
members' :class:`QueuedRequest` tickets on the thread that runs the batch, runs the batch's work under
``zoomer_serve.phase(...)`` as a request would, and ends the batch (:meth:`Batch.end`, or the ``with`` block)
**before** it hands the results to the requests::

    batching = BatchRecorder("ranker", max_size=32, max_delay_ms=2)

    # request thread / task
    ticket = batching.enqueue(items=len(request.candidates))
    queue.put((ticket, inputs, future))

    # batching loop
    with batching.begin([t for t, _, _ in batch], reason=CUT_FULL if len(batch) == 32 else CUT_DELAY):
        with phase("forward"):
            outputs = model(concat(inputs))
    for (_, _, future), out in zip(batch, split(outputs)):
        future.set_result(out)

What it records (names, units and the share rule: :mod:`zoomer_serve.batching.names` and
:mod:`zoomer_serve.batching.shares`): a batch span in a trace of its own, linked to every member request; on
each member its queue wait, batch id, size, index and its share of the batch's phase time and GPU memory, a
``queue`` child span and a copy of the batch's phases; while a profiling session runs, a profiler range around
the batch with one marker per member, from which the trace summary gives each member its share of the batch's
kernels and operators. The queue-wait and batch-size histograms come from the member spans in the exporter.

Cost: one ticket per request at enqueue (a few hundred ns); at the batch's end, per member, one attribute
update, one link, and one child span per batch phase plus the ``queue`` one (the ``benchmarks/batching.py``
figures), all on the batch thread. Nothing here raises into the batcher: internal errors are counted
(:func:`~zoomer_serve.recording.internal_error`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from zoomer_serve.batching import names as n
from zoomer_serve.batching.shares import RULE_ITEMS, check_rule, split_int
from zoomer_serve.config import ConfigError
from zoomer_serve.recording import RequestRecorder, RequestSpan, current_request, internal_error
from zoomer_serve.recording import records as r
from zoomer_serve.recording.recorder import _profiler_enabled, profile_scope

_mono_ns = time.monotonic_ns
_PHASE_KEY = "zoomer.phase"
_ATTRS, _START, _END, _STATUS = r.R_ATTRS, r.R_START_NS, r.R_END_NS, r.R_STATUS
_BATCH_ID, _SIZE, _INDEX, _ITEMS, _SHARE = n.BATCH_ID, n.SIZE, n.INDEX, n.ITEMS, n.SHARE
_QUEUE_WAIT, _PHASE_NAMES, _PHASE_SHARE_NS, _QUEUE_PHASE = n.QUEUE_WAIT, n.PHASE_NAMES, n.PHASE_SHARE_NS, n.QUEUE_PHASE
_MAX_REASON_CHARS = 32
_GPU_PEAK = "zoomer.gpu.memory.peak"
_GPU_ALLOCATED_START = "zoomer.gpu.memory.allocated.start"
_GPU_DEVICE_ALLOCS = "zoomer.gpu.memory.device_allocs"
_EVENTS_SPAN = "zoomer.gpu.memory.events"


BeforeBatch = Callable[[list[RequestSpan | None]], None]
_before_batch: list[BeforeBatch] = []  # run on the batching thread before each batch starts


def add_before_batch(hook: BeforeBatch) -> None:
    """Have ``hook(member spans)`` called on the batching thread before every batch starts (the request-scoped
    profiler waits there for the profiler to run when a member asked to be profiled). Idempotent."""
    if hook not in _before_batch:
        _before_batch.append(hook)


def remove_before_batch(hook: BeforeBatch) -> None:
    if hook in _before_batch:
        _before_batch.remove(hook)


# Batches whose allocations the allocator history will send later (batch span id -> members, weights, batch id),
# until the drain hands them to _share_allocations; bounded, oldest dropped first (counted).
_MAX_ALLOCATIONS_WAITING = 4096
_allocations_waiting: OrderedDict[int, tuple[list[RequestSpan | None], list[int], str]] = OrderedDict()
_allocations_lock = threading.Lock()
allocation_shares_dropped = 0
"""Batches whose allocation shares were dropped because too many waited for the allocator history's drain."""


def _share_allocations(span: RequestSpan, attrs: dict[str, Any], start_ns: int, end_ns: int) -> None:
    """The allocator history sent a span's ``zoomer.gpu.memory.events`` child: when the span is a batch, give each
    member a child of the same name with its share of every count and byte figure (``zoomer.batch.id``,
    ``zoomer.batch.share`` say it is a share)."""
    with _allocations_lock:
        entry = _allocations_waiting.pop(span.span_id, None)
    if entry is None:
        return
    spans, w, batch_id = entry
    parts = {key: split_int(int(value), w) for key, value in attrs.items() if isinstance(value, int)}
    total = sum(w)
    for i, member in enumerate(spans):
        if member is None:
            continue
        figures: dict[str, Any] = {key: values[i] for key, values in parts.items()}
        figures[n.BATCH_ID] = batch_id
        figures[n.SHARE] = w[i] / total if total else 0.0
        member.add_child(_EVENTS_SPAN, start_ns, end_ns, figures)


def _await_allocations(span: RequestSpan, members: list[QueuedRequest], w: list[int]) -> None:
    """Keep the batch's members until the allocator history sends the batch's allocations (when it tags it)."""
    global allocation_shares_dropped
    history = sys.modules.get("zoomer_serve.telemetry.history")
    if history is None or not span.thread_joins or not history.is_tagged(span):
        return
    if _share_allocations not in history.SENT_HOOKS:
        history.SENT_HOOKS.append(_share_allocations)
    with _allocations_lock:
        _allocations_waiting[span.span_id] = ([m.span for m in members], w, f"{span.span_id:016x}")
        while len(_allocations_waiting) > _MAX_ALLOCATIONS_WAITING:
            _allocations_waiting.popitem(last=False)
            allocation_shares_dropped += 1


class QueuedRequest:
    """A request waiting for a batch: its span (None when it has none: counted, not linked), its ``items``
    and when it entered the queue (``time.monotonic_ns()``)."""

    __slots__ = ("span", "items", "enqueued_mono_ns")

    def __init__(self, span: RequestSpan | None, items: int, enqueued_mono_ns: int) -> None:
        self.span = span
        self.items = items
        self.enqueued_mono_ns = enqueued_mono_ns


@dataclass
class BatchStats:
    """Counters since the recorder was made: ``batches`` begun, ``members`` (with a span), ``untraced``
    members (without), ``late`` members whose span had already ended when their batch ended (their figures are
    lost: end the batch before handing out results), ``errors`` (batches that ended with an exception)."""

    batches: int = 0
    members: int = 0
    untraced: int = 0
    late: int = 0
    errors: int = 0


class BatchRecorder:
    """Records the batches of one queue (see the module docstring).

    Args:
        queue: the queue's name (``messaging.destination.name``; the batch span is ``process <queue>``).
        max_size: the batcher's largest batch, in requests (for ``zoomer.batch.fill``); None when it has none.
        max_delay_ms: the batcher's longest wait for a batch to fill (recorded as given); None when unknown.
        share_rule: ``items`` (default) or ``equal`` (:mod:`zoomer_serve.batching.shares`).
        recorder: where spans go; default the process's (configured from the environment on first use).

    Raises:
        ConfigError: an empty queue name, a max_size below 1, a negative max_delay_ms, an unknown share rule.
    """

    def __init__(self, queue: str = "batch", *, max_size: int | None = None, max_delay_ms: float | None = None,
                 share_rule: str = RULE_ITEMS, recorder: RequestRecorder | None = None) -> None:
        if not isinstance(queue, str) or not queue.strip():
            raise ConfigError(f"queue must be a non-empty name, got {queue!r}")
        if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1):
            raise ConfigError(f"max_size must be a positive integer or None, got {max_size!r}")
        if max_delay_ms is not None and not max_delay_ms >= 0:
            raise ConfigError(f"max_delay_ms must be >= 0 or None, got {max_delay_ms!r}")
        self.queue = queue
        self.max_size = max_size
        self.max_delay_ms = max_delay_ms
        self.share_rule = check_rule(share_rule)
        if recorder is None:
            from zoomer_serve.runtime import get_recorder

            recorder = get_recorder()
        self.recorder = recorder
        self.stats = BatchStats()
        self._span_name = n.SPAN_NAME_PREFIX + queue
        self._static: dict[str, Any] = {n.MESSAGING_OPERATION_TYPE: n.OPERATION_PROCESS,
                                        n.MESSAGING_DESTINATION: queue, n.SHARE_RULE: self.share_rule}
        if max_size is not None:
            self._static[n.MAX_SIZE] = max_size
        if max_delay_ms is not None:
            self._static[n.MAX_DELAY_MS] = float(max_delay_ms)
        self._lock = threading.Lock()

    # -- request side ------------------------------------------------------------------------------------
    def enqueue(self, items: int = 1, span: RequestSpan | None = None) -> QueuedRequest:
        """The request ``span`` (default: the current request, :func:`~zoomer_serve.current_request`) enters the
        queue now with ``items`` items. Call it on the request's thread or task when it is queued."""
        return QueuedRequest(span if span is not None else current_request(), items, _mono_ns())

    # -- batch side --------------------------------------------------------------------------------------
    def begin(self, members: Sequence[QueuedRequest], reason: str = n.CUT_FULL) -> Batch:
        """A batch of ``members`` (in the batcher's order) starts now on this thread: its span starts and is made
        current here (``phase(...)`` spans become its children), and, while a profiling session runs, its
        profiler range opens. End it with :meth:`Batch.end` (or a ``with`` block) on the same thread, before the
        results go to the requests. ``reason``: why it was cut (``full``, ``delay``, or the batcher's own short
        word). Never raises; an internal failure gives a batch that records nothing (counted)."""
        for hook in _before_batch:
            try:
                hook([m.span for m in members])
            except Exception as exc:
                internal_error("batching.before_batch", exc)
        start = _mono_ns()
        try:
            return Batch(self, list(members), str(reason)[:_MAX_REASON_CHARS] or n.CUT_FULL, start)
        except Exception as exc:
            internal_error("batching.begin", exc)
            return Batch.inert(self)


class Batch:
    """One batch between :meth:`BatchRecorder.begin` and :meth:`end`; a context manager (an exception leaving the
    block marks the batch span ERROR and propagates). ``span`` is its span (None for an inert batch)."""

    def __init__(self, owner: BatchRecorder, members: list[QueuedRequest], reason: str, start_mono: int) -> None:
        self.owner = owner
        self.members = members
        self.start_mono = start_mono
        self.span: RequestSpan | None = None
        self._ended = False
        self._range: Any = None
        size = len(members)
        w: list[int] = []
        items = traced = 0
        sampled = False
        first = start_mono
        for m in members:  # one pass: weights, items, untraced, sampling, the oldest enqueue
            items += m.items
            w.append(m.items if m.items > 0 else 0)
            if m.enqueued_mono_ns < first:
                first = m.enqueued_mono_ns
            if m.span is not None:
                traced += 1
                sampled = sampled or bool(m.span.trace_flags & 1)
        if owner.share_rule != RULE_ITEMS or not any(w):
            w = [1] * size
        total = sum(w)
        self.weights = w
        self.fractions = [x / total for x in w] if total else []
        attrs = owner._static.copy()
        attrs[n.MESSAGING_BATCH_COUNT] = attrs[n.SIZE] = size
        attrs[n.ITEMS] = items
        attrs[n.CUT_REASON] = reason
        if owner.max_size:
            attrs[n.FILL] = size / owner.max_size
        attrs[n.QUEUE_WAIT_MAX] = start_mono - first
        if traced < size:
            attrs[n.UNTRACED] = size - traced
        span = owner.recorder.start(owner._span_name, r.KIND_INTERNAL, attrs, None, is_request=False,
                                    start_mono_ns=start_mono, sampled=sampled if traced else None)
        self.span = span
        links: list[tuple[int, int, dict[str, Any] | None]] = [
            (m.span.trace_id, m.span.span_id, {n.INDEX: i, n.SHARE: f})
            for i, (m, f) in enumerate(zip(members, self.fractions)) if m.span is not None]
        limit = owner.recorder.limits.link_count
        if len(links) > limit:  # as add_link does past OTEL_SPAN_LINK_COUNT_LIMIT: dropped, counted
            span.dropped_links = len(links) - limit
            del links[limit:]
        span.links = links or None
        with owner._lock:
            owner.stats.batches += 1
            owner.stats.members += traced
            owner.stats.untraced += size - traced
        span.activate()
        if _profiler_enabled():
            self._open_range()

    @classmethod
    def inert(cls, owner: BatchRecorder) -> Batch:
        """A batch that records nothing (what :meth:`BatchRecorder.begin` returns when it failed)."""
        batch = cls.__new__(cls)
        batch.owner, batch.members, batch.start_mono, batch.span = owner, [], 0, None
        batch.weights, batch.fractions, batch._ended, batch._range = [], [], True, None
        return batch

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and self.span is not None and not self._ended:
            try:
                self.span.record_exception(exc)
                self.span.set_status(r.STATUS_ERROR, f"{type(exc).__name__}: {exc}")
                self.span.attributes["error.type"] = type(exc).__qualname__
                with self.owner._lock:
                    self.owner.stats.errors += 1
            except Exception as err:
                internal_error("batching.error", err)
        self.end()

    # -- end ---------------------------------------------------------------------------------------------
    def end(self) -> None:
        """End the batch (once; later calls do nothing): close its profiler range and its span, then give every
        member still open its figures (a member already ended is counted in ``stats.late``)."""
        if self._ended or self.span is None:
            self._ended = True
            return
        self._ended = True
        span = self.span
        try:
            if self._range is not None:
                self._close_range()
            span.deactivate()
            phases = [c for c in span.child_records() if c[r.R_PARENT_ID] == span.span_id
                      and c[r.R_ATTRS].get(_PHASE_KEY) is not None]
            if span.thread_joins and self.members:
                _await_allocations(span, self.members, self.weights)
            span.end()
            self._share_out(span, phases)
        except Exception as exc:
            internal_error("batching.end", exc)

    def _share_out(self, span: RequestSpan, phases: list[tuple[Any, ...]]) -> None:
        members = self.members
        if not members:
            return
        batch_id = f"{span.span_id:016x}"
        w, fractions = self.weights, self.fractions
        names = [str(p[_ATTRS][_PHASE_KEY]) for p in phases]
        phase_parts = [split_int(p[_END] - p[_START], w) for p in phases]
        copies = [(name, p[_START], p[_END], {_PHASE_KEY: name, _BATCH_ID: batch_id}, p[_STATUS])
                  for name, p in zip(names, phases)]
        queue_attrs = {_PHASE_KEY: _QUEUE_PHASE, _BATCH_ID: batch_id}
        common = {_BATCH_ID: batch_id, _SIZE: len(members), _PHASE_NAMES: names}
        gpu = self._gpu_parts(span.attributes)
        batch_clock = span.start_ns - span.mono_ns
        start = self.start_mono
        link_to = (span.trace_id, span.span_id)
        late = 0
        for i, m in enumerate(members):
            ms = m.span
            if ms is None:
                continue
            if not ms._open:
                late += 1
                continue
            enqueued = m.enqueued_mono_ns if m.enqueued_mono_ns < start else start
            a = ms.attributes
            a.update(common)
            a[_INDEX] = i
            a[_ITEMS] = m.items
            a[_SHARE] = fractions[i]
            a[_QUEUE_WAIT] = start - enqueued
            a[_PHASE_SHARE_NS] = [parts[i] for parts in phase_parts]
            for key, parts in gpu:
                a[key] = parts[i]
            clock = ms.start_ns - ms.mono_ns
            ms.add_child(_QUEUE_PHASE, clock + enqueued, clock + start, queue_attrs)
            offset = clock - batch_clock
            for name, p_start, p_end, attrs, status in copies:
                ms.add_child(name, p_start + offset, p_end + offset, attrs, status)
            ms.add_link(*link_to)
        if late:
            with self.owner._lock:
                self.owner.stats.late += late

    def _gpu_parts(self, attrs: dict[str, Any]) -> list[tuple[str, list[int]]]:
        """The members' parts of the batch's GPU memory figures (set on the batch span by GPU telemetry)."""
        out = []
        peak, start = attrs.get(_GPU_PEAK), attrs.get(_GPU_ALLOCATED_START)
        if isinstance(peak, int) and isinstance(start, int):
            out.append((n.GPU_PEAK_SHARE, split_int(max(0, peak - start), self.weights)))
        allocs = attrs.get(_GPU_DEVICE_ALLOCS)
        if isinstance(allocs, int):
            out.append((n.GPU_DEVICE_ALLOCS_SHARE, split_int(allocs, self.weights)))
        return out

    # -- profiler range ----------------------------------------------------------------------------------
    def _open_range(self) -> None:
        """Open the batch's profiler range on this thread and mark its members (see
        :mod:`zoomer_serve.profiling.labels`); a thread join of the batch span, so the batch's phases on other
        threads open it there too. Under a zoomer-serve session only when the batch serves one of its requests
        (:meth:`~zoomer_serve.recording.recorder.ProfileScope.hold_batch`)."""
        from zoomer_serve.profiling.labels import batch_label, member_label
        from zoomer_serve.profiling.session import RequestRange

        span = self.span
        assert span is not None
        try:
            scope = profile_scope()
            if scope is not None and not scope.hold_batch(span, [m.span for m in self.members]):
                return  # it serves no request of the session: neither its range nor its phases go into the trace
            join = RequestRange(batch_label(span.trace_id, span.span_id))
            rf = join.enter()
            for m, w in zip(self.members, self.weights):
                if m.span is not None:
                    marker = RequestRange(member_label(span.span_id, m.span.trace_id, m.span.span_id, w))
                    marker.exit(marker.enter())
            span.add_thread_join(join)
            self._range = (join, rf, scope)
        except Exception as exc:
            internal_error("batching.profiler_range", exc)

    def _close_range(self) -> None:
        join, rf, scope = self._range
        self._range = None
        assert self.span is not None
        self.span.remove_thread_join(join)
        join.exit(rf)
        if scope is not None:
            scope.release_batch(self.span)
