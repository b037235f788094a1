"""Allocation events per request: torch's allocator history, tagged per request, drained off the request path.

While recording is on (:meth:`AllocationHistory.enable`), torch keeps the last ``max_entries`` allocator
trace entries per device in a ring buffer (``torch.cuda.memory._record_memory_history``; Python stacks or
none). Each sampled request tags its thread with ``torch.cuda.memory._set_memory_metadata`` (the tag holds
its trace and span id; the metadata is per thread), so every entry the request's thread causes carries the
tag in ``user_metadata``. A background drain (:meth:`AllocationHistory.drain`, every ``drain_ms``) reads
the ring buffer with ``torch.cuda.memory._snapshot()``, takes the entries it has not seen yet, and adds them
up per request. Once a request has ended before a drain's snapshot, its totals leave as one child span
``zoomer.gpu.memory.events`` of the request span: count and bytes per action (``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``oom``) and the largest
entries as span events. Entries with no (or an unknown) tag are counted as unattributed.

On the request path: one formatted tag and one ``_set_memory_metadata`` call at the start, a clear at the
end (when the request ends on the thread that started it). The request's phases that run on other threads
(an executor thread of a grpc.aio server) tag those threads for their duration too. An asyncio server runs many
requests on its loop thread: allocations made there, outside phases on other threads, carry the latest
started request's tag, so attribution is only as good as the thread model.

:meth:`AllocationHistory.dump_snapshot` writes the snapshot pickle that https://pytorch.org/memory_viz opens,
in a worker thread, within a time budget; a failure, an empty snapshot or a timeout raises
:class:`SnapshotError`.
"""

from __future__ import annotations

import heapq
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoomer_serve.recording import RequestSpan, internal_error
from zoomer_serve.telemetry import names as n
from zoomer_serve.telemetry.memory_source import CudaMemorySource

logger = logging.getLogger("zoomer_serve.telemetry")
TAG_PREFIX = "zoomer/"
_MAX_TAGGED = 100_000
_ACTIONS = frozenset(n.ACTIONS)


SentHook = Callable[[RequestSpan, dict[str, Any], int, int], None]
SENT_HOOKS: list[SentHook] = []
"""Called on the drain thread after a span's ``zoomer.gpu.memory.events`` child was sent, with the span, the
child's attributes (counts and bytes per action) and its start and end (Unix ns): how a batch
(:mod:`zoomer_serve.batching`) shares its allocations among its members. Exceptions are counted like the send's."""


def is_tagged(span: RequestSpan) -> bool:
    """Whether allocation history tags ``span`` (its allocations will come back as a child span when drained)."""
    return any(isinstance(join, _Tag) for join in span.thread_joins)


class SnapshotError(RuntimeError):
    """A memory snapshot could not be written: the snapshot failed, was empty, or took longer than the
    budget (:class:`SnapshotTimeout`)."""


class SnapshotTimeout(SnapshotError):
    """The snapshot did not finish within its time budget (the partial file is removed when it does)."""


@dataclass(frozen=True)
class SnapshotResult:
    """A written snapshot: ``path``, ``bytes`` (file size), ``trace_entries`` (all devices),
    ``segments``, ``seconds`` (wall time to take and write it)."""

    path: Path
    bytes: int
    trace_entries: int
    segments: int
    seconds: float


@dataclass
class DrainStats:
    """Counters of the drain since it started: ``drains``, ``entries`` (new trace entries seen),
    ``attributed`` / ``unattributed`` entries, ``overruns`` (drains that found the ring buffer had wrapped
    past entries not yet read: they are lost), ``child_spans`` sent, ``tags_dropped`` (requests not tagged
    because too many were pending), ``errors``."""

    drains: int = 0
    entries: int = 0
    attributed: int = 0
    unattributed: int = 0
    overruns: int = 0
    child_spans: int = 0
    tags_dropped: int = 0
    errors: int = 0


class _Totals:
    """Per-request totals, built by the drain thread only."""

    __slots__ = ("count", "bytes", "top", "first_us", "last_us", "seq")

    def __init__(self) -> None:
        self.count = dict.fromkeys(n.ACTIONS, 0)
        self.bytes = dict.fromkeys(n.ACTIONS, 0)
        self.top: list[tuple[int, int, dict[str, Any]]] = []  # min-heap of (size, seq, event attrs)
        self.first_us = 0
        self.last_us = 0
        self.seq = 0

    def add(self, action: str, entry: dict[str, Any], device: int, keep: int) -> None:
        size = int(entry.get("size") or 0)
        self.count[action] += 1
        self.bytes[action] += size
        t_us = int(entry.get("time_us") or 0)
        if t_us:
            self.first_us = t_us if not self.first_us else min(self.first_us, t_us)
            self.last_us = max(self.last_us, t_us)
        if keep <= 0:
            return
        self.seq += 1
        item = (size, self.seq, {"t_us": t_us, n.EVENT_ACTION: action, n.EVENT_SIZE: size,
                                 n.EVENT_DEVICE: device, n.EVENT_STREAM: int(entry.get("stream") or 0),
                                 n.EVENT_ADDR: int(entry.get("addr") or entry.get("device_free") or 0)})
        if len(self.top) < keep:
            heapq.heappush(self.top, item)
        elif size > self.top[0][0]:
            heapq.heapreplace(self.top, item)


class _Tag:
    """A tagged request: its span (to send the child), the thread that tagged it, when it ended
    (monotonic ns, 0 while running) and its totals (drain thread only). Also a thread join of the span
    (``RequestSpan.add_thread_join``): the request's phases on other threads tag those threads too."""

    __slots__ = ("span", "key", "thread", "ended_ns", "totals", "_set_metadata")

    def __init__(self, span: RequestSpan, key: str, thread: int, set_metadata: Callable[[str], None]) -> None:
        self.span = span
        self.key = key
        self.thread = thread
        self.ended_ns = 0
        self.totals: _Totals | None = None
        self._set_metadata = set_metadata

    def enter(self) -> None:
        self._set_metadata(self.key)

    def exit(self, _token: None) -> None:
        self._set_metadata("")


class AllocationHistory:
    """Allocator trace recording, request tagging, the background drain and snapshots.

    Args:
        source: the CUDA memory seam.
        stacks: ``python`` or ``none`` (frames kept with each allocation).
        max_entries: ring-buffer size per device.
        top_events: how many of a request's largest entries become span events.
    Thread safety: :meth:`begin` / :meth:`end` run on request threads; :meth:`drain` on one background
    thread at a time (serialised); :meth:`enable` / :meth:`disable` from any thread.
    """

    def __init__(self, source: CudaMemorySource, stacks: str = "python", max_entries: int = 10_000,
                 top_events: int = 5) -> None:
        self.source = source
        self.stacks = stacks
        self.max_entries = max_entries
        self.top_events = top_events
        self.recording = False
        self.stats = DrainStats()
        self._tags: dict[str, _Tag] = {}
        self._watermarks: dict[int, tuple[int, int]] = {}  # device -> (last time_us, entries at that time)
        self._drain_lock = threading.Lock()
        self._switch_lock = threading.Lock()
        self._set_metadata = source.set_memory_metadata
        self._tagging = bool(getattr(source, "supports_metadata", True))

    # -- windows -------------------------------------------------------------------------------------
    def enable(self) -> None:
        """Start recording (no-op when on). Not for the request path: it calls into the allocator."""
        with self._switch_lock:
            if self.recording:
                return
            self.source.record_memory_history(True, stacks=self.stacks, max_entries=self.max_entries)
            self.recording = True

    def disable(self) -> None:
        """Drain what was recorded, then stop recording (no-op when off)."""
        with self._switch_lock:
            if not self.recording:
                return
            self.recording = False  # new requests stop tagging first
            self.drain(force=True)  # entries recorded between this drain and the switch-off are lost
            self.source.record_memory_history(False, stacks=self.stacks, max_entries=self.max_entries)
            # the watermarks stay: whether torch empties its ring when recording stops or not, the next
            # window's drains then take only entries newer than what was read

    @contextmanager
    def window(self) -> Iterator[AllocationHistory]:
        """Record for the duration of a ``with`` block."""
        self.enable()
        try:
            yield self
        finally:
            self.disable()

    # -- request path --------------------------------------------------------------------------------
    def begin(self, span: RequestSpan) -> _Tag | None:
        """Tag this thread's allocations with the request (trace and span id). Returns the tag or None."""
        if not self._tagging:
            return None
        tags = self._tags
        if len(tags) >= _MAX_TAGGED:
            self.stats.tags_dropped += 1
            return None
        key = f"{TAG_PREFIX}{span.trace_id:032x}/{span.span_id:016x}"
        tag = _Tag(span, key, threading.get_ident(), self._set_metadata)
        tags[key] = tag
        self._set_metadata(key)
        span.add_thread_join(tag)  # its phases in executor threads tag their allocations there
        return tag

    def end(self, tag: _Tag) -> None:
        """The request ended: clear the thread's tag when it is the thread that set it."""
        tag.ended_ns = time.monotonic_ns()
        tag.span.remove_thread_join(tag)
        if tag.thread == threading.get_ident():
            self._set_metadata("")

    # -- background ------------------------------------------------------------------------------------
    def drain(self, force: bool = False) -> int:
        """Read new trace entries, add them to their requests, send the totals of requests that ended
        before this snapshot. Takes a snapshot only while recording (or when ``force``). Returns the number
        of new entries. Never raises (errors are counted)."""
        with self._drain_lock:
            try:
                return self._drain(force or self.recording)
            except Exception as exc:
                self.stats.errors += 1
                internal_error("gpu.history.drain", exc)
                return 0

    def _drain(self, take_snapshot: bool) -> int:
        taken_ns = time.monotonic_ns()
        new = 0
        if take_snapshot:
            snapshot = self.source.snapshot()
            for device, entries in enumerate(snapshot.get("device_traces") or ()):
                new += self._attribute(device, self._fresh(device, entries))
            self.stats.drains += 1
            self.stats.entries += new
        self._send_finished(taken_ns)
        return new

    def _fresh(self, device: int, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The entries of ``device`` not seen by an earlier drain (the ring buffer is in time order)."""
        count = len(entries)
        if not count:
            return []
        mark = self._watermarks.get(device)
        last_us = int(entries[-1].get("time_us") or 0)
        same = 0
        for e in reversed(entries):
            if int(e.get("time_us") or 0) != last_us:
                break
            same += 1
        self._watermarks[device] = (last_us, same)
        if mark is None:
            return entries
        mark_us, seen_at_mark = mark
        i = count
        while i > 0 and int(entries[i - 1].get("time_us") or 0) > mark_us:
            i -= 1
        at_mark = 0
        while i - at_mark > 0 and int(entries[i - at_mark - 1].get("time_us") or 0) == mark_us:
            at_mark += 1
        start = i - max(0, at_mark - seen_at_mark)
        if start == 0 and at_mark == 0 and count >= self.max_entries:
            self.stats.overruns += 1
            if self.stats.overruns == 1:
                logger.warning("zoomer-serve: the allocator history ring buffer (%d entries) wrapped between two "
                               "drains; entries were lost. Raise ZOOMER_GPU_MEMORY_HISTORY_MAX_ENTRIES or lower "
                               "ZOOMER_GPU_MEMORY_HISTORY_DRAIN_MS (counted in %s; logged once)",
                               self.max_entries, n.HISTORY_OVERRUNS)
        return entries[start:]

    def _attribute(self, device: int, entries: list[dict[str, Any]]) -> int:
        tags, keep, stats = self._tags, self.top_events, self.stats
        used = 0
        for e in entries:
            action = e.get("action")
            if action not in _ACTIONS:
                continue
            used += 1
            tag = tags.get(e.get("user_metadata") or "")
            if tag is None:
                stats.unattributed += 1
                continue
            if tag.totals is None:
                tag.totals = _Totals()
            tag.totals.add(action, e, device, keep)
            stats.attributed += 1
        return used

    def _send_finished(self, taken_ns: int) -> None:
        """Send (and forget) every request that ended before the snapshot taken at ``taken_ns``."""
        done = [t for t in list(self._tags.values()) if t.ended_ns and t.ended_ns <= taken_ns]
        for tag in done:
            self._tags.pop(tag.key, None)
            if tag.totals is not None:
                self._send(tag)

    def _send(self, tag: _Tag) -> None:
        totals = tag.totals
        assert totals is not None
        attrs: dict[str, Any] = {}
        for action in n.ACTIONS:
            attrs[n.action_count(action)] = totals.count[action]
            attrs[n.action_bytes(action)] = totals.bytes[action]
        events: list[tuple[int, str, dict[str, Any] | None]] = []
        for _size, _seq, ev in sorted(totals.top, key=lambda item: (-item[0], item[1])):
            ev = dict(ev)
            t_us = ev.pop("t_us")
            events.append((t_us * 1000 if t_us else tag.span.start_ns, n.EVENT_NAME, ev))
        start_ns = totals.first_us * 1000 or tag.span.start_ns
        end_ns = max(totals.last_us * 1000, start_ns)
        try:
            tag.span.add_child(n.EVENTS_SPAN, start_ns, end_ns, attrs, events=events)
            self.stats.child_spans += 1
            for hook in SENT_HOOKS:
                hook(tag.span, attrs, start_ns, end_ns)
        except Exception as exc:
            internal_error("gpu.history.send", exc)

    # -- snapshot ------------------------------------------------------------------------------------
    def dump_snapshot(self, path: str | os.PathLike[str], timeout_s: float = 30.0) -> SnapshotResult:
        """Write ``torch.cuda.memory._snapshot()`` as a pickle at ``path`` (the file pytorch.org/memory_viz
        opens), taken and written in a worker thread; the caller waits at most ``timeout_s``.

        Raises:
            SnapshotTimeout: not done within ``timeout_s`` (the worker removes its partial file).
            SnapshotError: the snapshot failed, or it is empty (no segments and no trace entries).
        """
        target = Path(path)
        job = _SnapshotJob(self.source, target)
        worker = threading.Thread(target=job.run, name="zoomer-gpu-snapshot", daemon=True)
        worker.start()
        if not job.done.wait(timeout_s):
            job.abandon()
            raise SnapshotTimeout(f"memory snapshot to {target} did not finish within {timeout_s} s")
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result


class _SnapshotJob:
    """One snapshot written by a worker thread; abandoned jobs clean up after themselves."""

    def __init__(self, source: CudaMemorySource, target: Path) -> None:
        self.source = source
        self.target = target
        self.tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        self.done = threading.Event()
        self.result: SnapshotResult | None = None
        self.error: SnapshotError | None = None
        self._lock = threading.Lock()
        self._abandoned = False

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            snapshot = self.source.snapshot()
            traces = snapshot.get("device_traces") or []
            entries = sum(len(t) for t in traces)
            segments = len(snapshot.get("segments") or [])
            if not entries and not segments:
                raise SnapshotError("empty memory snapshot: no segments and no trace entries (nothing allocated "
                                    "on CUDA yet, and allocation history not recording)")
            self.target.parent.mkdir(parents=True, exist_ok=True)
            with open(self.tmp, "wb") as f:
                pickle.dump(snapshot, f)
            with self._lock:
                if self._abandoned:
                    self.tmp.unlink(missing_ok=True)
                    return
                os.replace(self.tmp, self.target)
            self.result = SnapshotResult(self.target, self.target.stat().st_size, entries, segments,
                                         time.monotonic() - t0)
        except SnapshotError as exc:
            self.error = exc
        except Exception as exc:
            self.error = SnapshotError(f"memory snapshot to {self.target} failed: {type(exc).__name__}: {exc}")
            self.tmp.unlink(missing_ok=True)
        finally:
            self.done.set()
