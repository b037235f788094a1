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


# A sampled request in flight is a list ``[start, peak, shared, tag]`` (a list, not an object: the request
# path pays one allocation and no constructor call):
#   start  -- the counters read at its start boundary (one device: a MemoryCounters; several: a list of them,
#             in the order of ``devices``);
#   peak   -- the largest interval peak handed to it since its start (one device: an int; several: a list);
#   shared -- whether another request (sampled or not) was in flight at any time during its window;
#   tag    -- its allocation-history tag, or None.
# Its peak over the window is max(peak, start allocation): right after the start's reset the device peak is
# the current allocation. An unsampled request is None in the in-flight map (only counted). The one-device
# path indexes flights and MemoryCounters with literals (allocated 0, peak 1, reserved 2, alloc_retries 3,
# ooms 4, device_allocs 5); the several-device path uses the names.
_START, _PEAK, _SHARED, _TAG = range(4)


class GpuMemoryObserver:
    """Sets per-request GPU memory attributes on request spans (see the module docstring).

    Args:
        source: the CUDA memory seam.
        devices: CUDA device indices to watch (sums over them go on the span; see ``names``).
        peak: keep the per-request peak (resets the allocator's peak statistics at request boundaries).
        history: an :class:`~zoomer_serve.telemetry.history.AllocationHistory` to tag requests for, or None.
        oom_counter: an OpenTelemetry counter for ``zoomer.gpu.memory.oom``, or None.
        device_attributes: metric attributes (``hw.id``, ``hw.type``) per CUDA device index.

    Raises:
        ValueError: ``devices`` is empty.

    ``utilization`` (a dict CUDA index -> ratio) is replaced by the NVML sampler after each tick; the
    request path only reads it. One device (the common case) takes a path without per-device lists or
    loops; it sets the same attributes as the general path would.
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
        self._flights: dict[int, list[Any] | None] = {}  # span_id -> flight (None: unsampled, only counted)
        self._counters = source.counters
        self._reset = source.reset_peak_memory_stats
        self._devices_attr = list(self.devices)
        self._one = self.devices[0] if len(self.devices) == 1 else None  # the single device, else None

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
        dev = self._one
        with self._lock:
            if dev is None:
                flight = self._start_multi_device()
            else:
                start = self._counters(dev)
                if self.peak:  # the boundary: hand the peak since the last one to those in flight, reset it
                    if flights:
                        p = start[1]
                        for f in flights.values():
                            if f is not None:
                                f[2] = True  # _SHARED
                                if p > f[1]:  # _PEAK
                                    f[1] = p
                    self._reset(dev)
                elif flights:
                    self._mark_shared()
                flight = [start, 0, bool(flights), None]
            if len(flights) < _MAX_IN_FLIGHT:
                flights[span.span_id] = flight
        history = self.history
        if history is not None and history.recording:
            flight[_TAG] = history.begin(span)

    def on_end(self, span: RequestSpan) -> None:
        """Read the end counters and set the span's ``zoomer.gpu.*`` attributes."""
        dev = self._one
        with self._lock:
            flights = self._flights
            flight = flights.pop(span.span_id, None)
            if flight is None:
                return
            if dev is None:
                ends = self._boundary(flight)
            else:
                end = self._counters(dev)
                if self.peak:  # the boundary, for those still in flight and for this one (already removed)
                    p = end[1]
                    if flights:
                        for f in flights.values():
                            if f is not None and p > f[1]:  # _PEAK
                                f[1] = p
                    if p > flight[1]:
                        flight[1] = p
                    self._reset(dev)
        tag = flight[3]  # _TAG
        if tag is not None:
            self.history.end(tag)
        if dev is None:
            self._set_multi_device(span.attributes, flight, ends)
        else:
            self._set_one_device(span.attributes, flight, end, dev)

    def _set_one_device(self, attrs: dict[str, Any], flight: list[Any], end: MemoryCounters, dev: int) -> None:
        """The attributes for one device: what :meth:`_set_multi_device` gives, without the ``.by_device``
        lists (the sums are the device's own figures)."""
        start = flight[0]  # _START
        s_alloc = start[0]
        attrs[n.GPU_DEVICES] = self._devices_attr
        attrs[n.MEM_ALLOCATED_START] = s_alloc
        attrs[n.MEM_ALLOCATED_END] = end[0]
        attrs[n.MEM_RESERVED_START] = start[2]
        attrs[n.MEM_RESERVED_END] = end[2]
        attrs[n.MEM_ALLOC_RETRIES] = end[3] - start[3]
        attrs[n.MEM_OOMS] = end[4] - start[4]
        attrs[n.MEM_DEVICE_ALLOCS] = end[5] - start[5]
        if self.peak:
            peak = flight[1]
            attrs[n.MEM_PEAK] = peak if peak > s_alloc else s_alloc
            attrs[n.MEM_PEAK_SHARED] = flight[2]
        util = self.utilization.get(dev)
        if util is not None:
            attrs[n.GPU_UTILIZATION] = util

    def _start_multi_device(self) -> list[Any]:
        """The start boundary and new flight for several devices. Caller holds the lock."""
        flights = self._flights
        start = self._boundary()
        flight = [start, [0] * len(start), bool(flights), None]
        if flights:
            self._mark_shared()
        return flight

    def _boundary(self, ending: list[Any] | None = None) -> list[MemoryCounters]:
        """Read every device once; with the peak on, hand the peak since the last boundary to every
        request in flight (and to ``ending``, already removed) and reset it. Caller holds the lock."""
        out = []
        counters, reset = self._counters, self._reset
        if not self.peak:
            return [counters(dev) for dev in self.devices]
        peaks = [f[_PEAK] for f in self._flights.values() if f is not None]
        if ending is not None:
            peaks.append(ending[_PEAK])
        for i, dev in enumerate(self.devices):
            c = counters(dev)
            out.append(c)
            p = c[1]
            for fp in peaks:
                if p > fp[i]:
                    fp[i] = p
            reset(dev)
        return out

    def _mark_shared(self) -> None:
        for f in self._flights.values():
            if f is not None:
                f[_SHARED] = True

    def _set_multi_device(self, attrs: dict[str, Any], flight: list[Any], end: list[MemoryCounters]) -> None:
        start = flight[_START]
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
            per_device[n.MEM_PEAK] = [max(p, s.allocated) for p, s in zip(flight[_PEAK], start)]
            attrs[n.MEM_PEAK_SHARED] = flight[_SHARED]
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
