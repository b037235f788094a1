"""The one seam between GPU memory telemetry and torch's CUDA caching allocator.

:class:`CudaMemorySource` is what the rest of :mod:`zoomer_serve.telemetry` calls;
:class:`TorchCudaMemorySource` implements it over ``torch.cuda`` (and a few private ``torch._C`` entry
points, each guarded), and the tests implement it with a fake allocator. Nothing here initialises CUDA:
until the application does, every counter reads zero (nothing can have been allocated yet) and the
``armed`` features (history, OOM observer) wait (see :meth:`CudaMemorySource.is_initialized`).

Where the figures come from: the caching allocator's per-device statistics, the same ones that
``torch.cuda.memory_stats(device)`` flattens into keys such as ``"allocated_bytes.all.current"``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, Protocol

from zoomer_serve.recording.errors import internal_error

OomCallback = Callable[[int, int, int, int], None]
"""``(device, requested_bytes, device_limit_bytes, device_free_bytes)``: torch calls it on the thread whose
allocation failed, before raising ``torch.OutOfMemoryError``. ``device_limit_bytes`` is the device's total
memory, or the per-process limit when ``torch.cuda.set_per_process_memory_fraction`` is in force."""


class MemoryCounters(NamedTuple):
    """The allocator figures one request boundary needs, from one read of the device's statistics.

    All in bytes except the last three (counts since the process started); keys as in
    ``torch.cuda.memory_stats``.
    """

    allocated: int  # "allocated_bytes.all.current"
    peak: int  # "allocated_bytes.all.peak" (since the last reset_peak_memory_stats)
    reserved: int  # "reserved_bytes.all.current"
    alloc_retries: int  # "num_alloc_retries"
    ooms: int  # "num_ooms"
    device_allocs: int  # "num_device_alloc" (cudaMalloc / cuMemMap calls)


ZERO_COUNTERS = MemoryCounters(0, 0, 0, 0, 0, 0)

counters_of: Callable[[tuple[int, int, int, int, int, int]], MemoryCounters] = partial(tuple.__new__, MemoryCounters)
"""``counters_of((allocated, peak, reserved, alloc_retries, ooms, device_allocs))``: the same MemoryCounters as
the class call, without its Python-level ``__new__`` (about 0.15 µs less per read, twice per request)."""


class CudaMemorySource(Protocol):
    """CUDA caching-allocator access for one process. Devices are CUDA indices (``torch.cuda`` order)."""

    @property
    def supports_metadata(self) -> bool:
        """Whether :meth:`set_memory_metadata` tags trace entries (``torch.cuda.memory._set_memory_metadata``,
        torch >= 2.10)."""

    def is_initialized(self) -> bool:
        """True once the application has initialised CUDA (this seam never does it)."""

    def device_count(self) -> int:
        """Number of CUDA devices visible to this process (no CUDA initialisation)."""

    def device_uuid(self, device: int) -> str | None:
        """The device's UUID as NVML writes it (``GPU-...`` / ``MIG-...``), or None when unknown or when
        CUDA is not initialised yet."""

    def counters(self, device: int) -> MemoryCounters:
        """One read of the device's allocator statistics (see :class:`MemoryCounters`)."""

    def memory_allocated(self, device: int) -> int:
        """Bytes held by tensors (``torch.cuda.memory_allocated``)."""

    def memory_reserved(self, device: int) -> int:
        """Bytes held by the caching allocator (``torch.cuda.memory_reserved``)."""

    def memory_stats(self, device: int) -> dict[str, Any]:
        """The flat statistics dict of ``torch.cuda.memory_stats`` (about 100 keys; not for the request path)."""

    def reset_peak_memory_stats(self, device: int) -> None:
        """Set every ``*.peak`` statistic of the device to its current value."""

    def snapshot(self) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``: ``{"segments": [...], "device_traces": [[TraceEntry, ...],
        ...], ...}``; each TraceEntry a dict with ``action``, ``addr`` (``device_free`` for ``oom``),
        ``size``, ``stream``, ``time_us`` and ``user_metadata`` (and ``frames`` when stacks are recorded)."""

    def record_memory_history(self, enabled: bool, stacks: str = "python", max_entries: int = 10_000) -> None:
        """Start (``enabled``) or stop recording allocator trace entries. ``stacks``: ``python`` (Python
        frames of each allocation) or ``none``; ``max_entries``: ring-buffer size per device."""

    def set_memory_metadata(self, metadata: str) -> None:
        """Tag every trace entry this thread causes from now on with ``metadata`` (``""`` clears it)."""

    def attach_oom_observer(self, callback: OomCallback) -> None:
        """Have ``callback`` called on every CUDA out-of-memory error of this process."""

    def detach_oom_observer(self, callback: OomCallback) -> None:
        """Stop calling ``callback`` (torch itself cannot detach; the real source dispatches)."""


class TorchCudaMemorySource:
    """:class:`CudaMemorySource` over ``torch.cuda``.

    :meth:`counters` reads the nested statistics with one ``torch._C._cuda_memoryStats(device)`` call;
    ``torch.cuda.memory_allocated`` and friends would each build, flatten and sort the full dict.

    Raises:
        RuntimeError: this torch build has no CUDA support (``torch.cuda.is_available()`` is False).
    """

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False: no CUDA device or a CPU-only torch build")
        self._torch = torch
        self._is_init = torch.cuda.is_initialized
        self._stats = torch._C._cuda_memoryStats
        self._reset = torch._C._cuda_resetPeakMemoryStats
        self._set_metadata: Callable[[str], None] | None = getattr(torch._C, "_cuda_setMemoryMetadata", None)

    @property
    def supports_metadata(self) -> bool:
        """Whether this torch has ``torch.cuda.memory._set_memory_metadata`` (torch >= 2.10)."""
        return self._set_metadata is not None

    def is_initialized(self) -> bool:
        return bool(self._is_init())

    def device_count(self) -> int:
        return int(self._torch.cuda.device_count())

    def device_uuid(self, device: int) -> str | None:
        if not self._is_init():
            return None
        try:
            raw = str(self._torch.cuda.get_device_properties(device).uuid)
        except Exception:
            return None
        return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"

    def counters(self, device: int) -> MemoryCounters:
        if not self._is_init():
            return ZERO_COUNTERS
        s = self._stats(device)
        a = s["allocated_bytes"]["all"]
        return counters_of((a["current"], a["peak"], s["reserved_bytes"]["all"]["current"],
                            s.get("num_alloc_retries", 0), s.get("num_ooms", 0), s.get("num_device_alloc", 0)))

    def memory_allocated(self, device: int) -> int:
        return int(self._torch.cuda.memory_allocated(device))

    def memory_reserved(self, device: int) -> int:
        return int(self._torch.cuda.memory_reserved(device))

    def memory_stats(self, device: int) -> dict[str, Any]:
        return dict(self._torch.cuda.memory_stats(device))

    def reset_peak_memory_stats(self, device: int) -> None:
        if self._is_init():
            self._reset(device)

    def snapshot(self) -> dict[str, Any]:
        return self._torch.cuda.memory._snapshot()

    def record_memory_history(self, enabled: bool, stacks: str = "python", max_entries: int = 10_000) -> None:
        record = self._torch.cuda.memory._record_memory_history
        if not enabled:
            record(enabled=None)
        elif stacks == "none":
            record(enabled="all", context=None, stacks="python", max_entries=max_entries)
        else:
            record(enabled="all", context="alloc", stacks="python", max_entries=max_entries)

    def set_memory_metadata(self, metadata: str) -> None:
        if self._set_metadata is not None:
            self._set_metadata(metadata)

    def attach_oom_observer(self, callback: OomCallback) -> None:
        """Attaches one dispatcher to torch per process (torch keeps every observer forever) and adds
        ``callback`` to it. Raises RuntimeError when this torch has no OOM observer hook (it is private)."""
        with _oom_lock:
            if not _oom_state["attached"]:
                attach = getattr(self._torch._C, "_cuda_attach_out_of_memory_observer", None)
                if attach is None:
                    raise RuntimeError("this torch has no torch._C._cuda_attach_out_of_memory_observer")
                attach(_dispatch_oom)
                _oom_state["attached"] = True
            _oom_callbacks.append(callback)

    def detach_oom_observer(self, callback: OomCallback) -> None:
        with _oom_lock:
            if callback in _oom_callbacks:
                _oom_callbacks.remove(callback)


_oom_lock = threading.Lock()
_oom_state = {"attached": False}
_oom_callbacks: list[OomCallback] = []


def _dispatch_oom(device: int, requested: int, limit: int, free: int) -> None:
    """The one OOM observer given to torch: calls the attached callbacks; never raises into the allocator
    (an exception there would replace the OutOfMemoryError the application expects)."""
    for callback in tuple(_oom_callbacks):
        try:
            callback(device, requested, limit, free)
        except Exception as exc:
            internal_error("gpu.oom_callback", exc)
