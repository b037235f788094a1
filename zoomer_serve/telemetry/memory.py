"""Per-request GPU memory: a request observer that puts the caching allocator's figures on each span.

:class:`GpuMemoryObserver` is registered with :meth:`RequestRecorder.add_observer`. On the request path it
makes, per watched device, one statistics read at the start and one at the end of each sampled request
(and, with the per-request peak on, one ``reset_peak_memory_stats`` at each), then sets the attributes
listed in :mod:`zoomer_serve.telemetry.names`. Unsampled requests are only counted (so that sampled ones
know they shared the device); nothing is read for them.

The peak discipline (correct when requests overlap). Every request boundary on a device (a start or an end)
reads ``allocated_bytes.all.peak`` (the peak since the previous boundary), gives it to every request in
flight, and resets the peak. The boundaries of a request's own start and end are among them, so a request's
``zoomer.gpu.memory.peak`` is exactly the device's peak over the request's window. When it was the only
request in flight for its whole window, that is its own peak; otherwise ``zoomer.gpu.memory.peak.shared``
is true and the figure is the device's (what overlapping requests allocated counts too). A transient
allocate-and-free that falls between a boundary's read and its reset (a few microseconds) is missed.
While the peak is on, ``torch.cuda.max_memory_allocated()`` therefore reports per-boundary peaks, not the
process's lifetime peak; set ``ZOOMER_GPU_PEAK=false`` where the application needs the latter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from zoomer_serve.recording import RequestSpan, current_request, internal_error
from zoomer_serve.recording import records as r
from zoomer_serve.telemetry import names as n
from zoomer_serve.telemetry.memory_source import CudaMemorySource, MemoryCounters

logger = logging.getLogger("zoomer_serve.telemetry")
_MAX_IN_FLIGHT = 65_536  # spans that never end must not grow memory without bound


class _Flight:
    """One sampled request in flight: counters at its start, per-device peak so far, shared flag, and its
    allocation-history tag (or None)."""

    __slots__ = ("start", "peak", "shared", "tag")

    def __init__(self, start: list[MemoryCounters]) -> None:
        self.start = start
        self.peak = [0] * len(start)  # interval peaks seen since the start (see peak_bytes)
        self.shared = False
        self.tag: Any = None

    def peak_bytes(self, i: int) -> int:
        """The peak on the i-th device over the window: the interval peaks, or the allocation at the start
        (right after the start's reset the device peak is the current allocation)."""
        return max(self.peak[i], self.start[i][0])


class GpuMemoryObserver:
    """Sets per-request GPU memory attributes on request spans (see the module docstring).

    Args:
        source: the CUDA memory seam.
        devices: CUDA device indices to watch (sums over them go on the span; see ``names``).
        peak: keep the per-request peak (resets the allocator's peak statistics at request boundaries).
        history: an :class:`~zoomer_serve.telemetry.history.AllocationHistory` to tag requests for, or None.
        oom_counter: an OpenTelemetry counter for ``zoomer.gpu.memory.oom``, or None.
        device_attributes: metric attributes (``hw.id``, ``hw.type``) per CUDA device index.

    ``utilization`` (a dict CUDA index -> ratio) is replaced by the NVML sampler after each tick; the
    request path only reads it.
    """

    def __init__(self, source: CudaMemorySource, devices: Sequence[int], peak: bool = True,
                 history: Any = None, oom_counter: Any = None,
                 device_attributes: dict[int, dict[str, Any]] | None = None) -> None:
        if not devices:
            raise ValueError("GpuMemoryObserver needs at least one CUDA device index")
        self.devices = tuple(devices)
        self.peak = peak
        self.history = history
        self.utilization: dict[int, float] = {}
        self.oom_count = 0
        self.oom_unattributed = 0
        self._oom_counter = oom_counter
        self.device_attributes = device_attributes or {}
        self._lock = threading.Lock()
        self._flights: dict[int, _Flight | None] = {}  # span_id -> flight (None: unsampled, only counted)
        self._counters = source.counters
        self._reset = source.reset_peak_memory_stats
        self._devices_attr = list(self.devices)

    # -- request path ----------------------------------------------------------------------------------
    def on_start(self, span: RequestSpan) -> None:
        """Count the request in flight; for a sampled one read the start counters (one read per device)."""
        flights = self._flights
        if not span.trace_flags & 1:
            with self._lock:
                if flights:
                    self._mark_shared()
                if len(flights) < _MAX_IN_FLIGHT:
                    flights[span.span_id] = None
            return
        with self._lock:
            start = self._boundary()
            flight = _Flight(start)
            if flights:
                flight.shared = True
                self._mark_shared()
            if len(flights) < _MAX_IN_FLIGHT:
                flights[span.span_id] = flight
        history = self.history
        if history is not None and history.recording:
            flight.tag = history.begin(span)

    def on_end(self, span: RequestSpan) -> None:
        """Read the end counters and set the span's ``zoomer.gpu.*`` attributes."""
        with self._lock:
            flight = self._flights.pop(span.span_id, None)
            if flight is None:
                return
            end = self._boundary(flight)
        if flight.tag is not None:
            self.history.end(flight.tag)
        self._set_attributes(span.attributes, flight, end)

    def _boundary(self, ending: _Flight | None = None) -> list[MemoryCounters]:
        """Read every device once; with the peak on, hand the peak since the last boundary to every
        request in flight (and to ``ending``, already removed) and reset it. Caller holds the lock."""
        out = []
        counters, reset, peak = self._counters, self._reset, self.peak
        for i, dev in enumerate(self.devices):
            c = counters(dev)
            out.append(c)
            if peak:
                p = c[1]
                for f in self._flights.values():
                    if f is not None and p > f.peak[i]:
                        f.peak[i] = p
                if ending is not None and p > ending.peak[i]:
                    ending.peak[i] = p
                reset(dev)
        return out

    def _mark_shared(self) -> None:
        for f in self._flights.values():
            if f is not None:
                f.shared = True

    def _set_attributes(self, attrs: dict[str, Any], flight: _Flight, end: list[MemoryCounters]) -> None:
        start = flight.start
        if len(end) == 1:
            s, e = start[0], end[0]
            attrs[n.GPU_DEVICES] = self._devices_attr
            attrs[n.MEM_ALLOCATED_START] = s[0]
            attrs[n.MEM_ALLOCATED_END] = e[0]
            attrs[n.MEM_RESERVED_START] = s[2]
            attrs[n.MEM_RESERVED_END] = e[2]
            attrs[n.MEM_ALLOC_RETRIES] = e[3] - s[3]
            attrs[n.MEM_OOMS] = e[4] - s[4]
            attrs[n.MEM_DEVICE_ALLOCS] = e[5] - s[5]
            if self.peak:
                attrs[n.MEM_PEAK] = flight.peak_bytes(0)
                attrs[n.MEM_PEAK_SHARED] = flight.shared
            util = self.utilization.get(self.devices[0])
            if util is not None:
                attrs[n.GPU_UTILIZATION] = util
            return
        self._set_multi_device(attrs, flight, end)

    def _set_multi_device(self, attrs: dict[str, Any], flight: _Flight, end: list[MemoryCounters]) -> None:
        start = flight.start
        per_device: dict[str, list[int]] = {
            n.MEM_ALLOCATED_START: [c.allocated for c in start],
            n.MEM_ALLOCATED_END: [c.allocated for c in end],
            n.MEM_RESERVED_START: [c.reserved for c in start],
            n.MEM_RESERVED_END: [c.reserved for c in end],
            n.MEM_ALLOC_RETRIES: [e.alloc_retries - s.alloc_retries for s, e in zip(start, end)],
            n.MEM_OOMS: [e.ooms - s.ooms for s, e in zip(start, end)],
            n.MEM_DEVICE_ALLOCS: [e.device_allocs - s.device_allocs for s, e in zip(start, end)],
        }
        if self.peak:
            per_device[n.MEM_PEAK] = [flight.peak_bytes(i) for i in range(len(start))]
            attrs[n.MEM_PEAK_SHARED] = flight.shared
        attrs[n.GPU_DEVICES] = self._devices_attr
        for key, values in per_device.items():
            attrs[key] = sum(values)
            attrs[key + n.BY_DEVICE_SUFFIX] = values
        utils = [u for u in (self.utilization.get(d) for d in self.devices) if u is not None]
        if utils:
            attrs[n.GPU_UTILIZATION] = max(utils)

    # -- out of memory (called by torch on the thread whose allocation failed) --------------------------
    def on_oom(self, device: int, requested: int, limit: int, free: int) -> None:
        """Mark the request running on this thread (span event ``zoomer.gpu.oom``, status ERROR,
        ``error.type``) and count the OOM. Never raises (torch is about to raise OutOfMemoryError)."""
        try:
            self.oom_count += 1
            if self._oom_counter is not None:
                self._oom_counter.add(1, self.device_attributes.get(device, {n.HW_TYPE: "gpu"}))
            span = current_request()
            if span is None or not span.is_open:
                self.oom_unattributed += 1
                if self.oom_unattributed == 1:
                    logger.warning("zoomer-serve: CUDA out of memory on device %s (%d bytes requested) outside "
                                   "any request; counted in %s (logged once)", device, requested, n.GPU_OOM_COUNT)
                return
            mark_oom(span, device, requested, limit, free)
        except Exception as exc:
            internal_error("gpu.on_oom", exc)


def mark_oom(span: RequestSpan, device: int, requested: int, limit: int, free: int) -> None:
    """Add the ``zoomer.gpu.oom`` event to ``span``, set status ERROR and ``error.type`` (unless the
    adapter already set a more specific one)."""
    span.add_event(n.OOM_EVENT, {
        n.OOM_DEVICE: device,
        n.OOM_REQUESTED_BYTES: requested,
        n.OOM_DEVICE_FREE_BYTES: free,
        n.OOM_DEVICE_LIMIT_BYTES: limit,
    })
    span.set_status(r.STATUS_ERROR, f"CUDA out of memory on device {device}: tried to allocate {requested} bytes "
                                    f"with {free} bytes free")
    span.attributes.setdefault("error.type", n.OOM_ERROR_TYPE)
