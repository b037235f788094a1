"""The names the analysis reads: request labels in profiler traces and span attributes in the store.

One place for each: the code that writes them (the request recorder, the GPU memory sampler) should import
these constants rather than repeat the strings.

Request labels
--------------
While a request runs under ``torch.profiler``, zoomer-serve opens a ``record_function`` range named
``zoomer.request/<trace_id>/<span_id>`` around it: ``<trace_id>`` is the request span's W3C trace id (32
lowercase hex digits) and ``<span_id>`` its span id (16 lowercase hex digits), the ids under which the span
is stored. A request whose work runs on other threads (an executor) has ranges of the same name there too,
opened by its phases: a request is all its ranges. The format is defined once, in
:mod:`zoomer_serve.profiling.labels` (which writes the ranges);
this module adapts it to the store's hex ids. The analysis finds these ranges in a Kineto trace
(``user_annotation`` events) to give GPU time per request and to put requests and kernels on one timeline.

GPU memory span attributes and GPU metrics
------------------------------------------
The analysis reads these from the store; they are written by the GPU telemetry and defined (once) in
:mod:`zoomer_serve.telemetry.names`, from which the constants below are taken. Per request span (sums over
the watched devices):

==========================================  ===============================================================
attribute                                   meaning
==========================================  ===============================================================
``zoomer.gpu.memory.allocated.end``         ``allocated_bytes.all.current`` at request end: bytes held by
                                            tensors
``zoomer.gpu.memory.reserved.end``          ``reserved_bytes.all.current`` at request end: bytes the caching
                                            allocator holds from CUDA (allocated + cached free blocks)
``zoomer.gpu.memory.peak``                  ``allocated_bytes.all.peak`` over the request's window, bytes
``zoomer.gpu.memory.alloc_retries``         ``num_alloc_retries`` during the request (cudaMalloc failed, the
                                            cache was flushed and the allocation retried)
``zoomer.gpu.memory.ooms``                  ``num_ooms`` during the request
==========================================  ===============================================================

Host telemetry (names defined once in :mod:`zoomer_serve.host.names`): per request span,
``zoomer.request.cpu_time_ns`` (thread CPU time of the request, ns; compared with its wall time), and on each
``zoomer.profile`` span the Python CPU profile's top functions (``zoomer.profile.cpu.top.function`` /
``.location`` / ``.self_share`` / ``.total_share``, parallel arrays, most own samples first), which name the
function behind a CPU-bound phase.

A request that failed with CUDA out-of-memory is also recognised from its ``error.type`` attribute (or an
``exception`` / ``zoomer.gpu.oom`` span event) containing ``OutOfMemoryError``. Metrics (``metric_points``):
``hw.gpu.utilization`` (ratio) and ``hw.gpu.memory.usage`` (bytes), per ``hw.id``, for the timelines.
"""

from __future__ import annotations

import re
from importlib import import_module
from typing import Any

from zoomer_serve.profiling import labels as _profiling

REQUEST_LABEL_PREFIX = _profiling.REQUEST_LABEL_PREFIX
"""Start of the ``record_function`` name of a request range: ``zoomer.request/<trace_id>/<span_id>``."""

OOM_ERROR_MARKER = "OutOfMemoryError"  # in error.type (torch.OutOfMemoryError) or an exception event
PROFILE_SESSION_ID = "zoomer.profile.session_id"
PROFILE_KERNEL_COUNT = "zoomer.profile.kernel.count"

# The names the store analysis reads, taken from the modules that write them (the one place for each
# string), on first use: reading a trace needs none of them, nor the GPU and host telemetry they live in.
_FROM = {
    "GPU_DEVICES": ("zoomer_serve.telemetry.names", "GPU_DEVICES"),
    "GPU_MEMORY_ALLOCATED": ("zoomer_serve.telemetry.names", "MEM_ALLOCATED_END"),
    "GPU_MEMORY_RESERVED": ("zoomer_serve.telemetry.names", "MEM_RESERVED_END"),
    "GPU_MEMORY_PEAK": ("zoomer_serve.telemetry.names", "MEM_PEAK"),
    "GPU_MEMORY_ALLOC_RETRIES": ("zoomer_serve.telemetry.names", "MEM_ALLOC_RETRIES"),
    "GPU_MEMORY_OOMS": ("zoomer_serve.telemetry.names", "MEM_OOMS"),
    "GPU_OOM_EVENT": ("zoomer_serve.telemetry.names", "OOM_EVENT"),
    "METRIC_GPU_UTILIZATION": ("zoomer_serve.telemetry.names", "HW_GPU_UTILIZATION"),
    "METRIC_GPU_MEMORY_USAGE": ("zoomer_serve.telemetry.names", "HW_GPU_MEMORY_USAGE"),
    "METRIC_HW_ID": ("zoomer_serve.telemetry.names", "HW_ID"),
    "REQUEST_CPU_TIME": ("zoomer_serve.host.names", "REQUEST_CPU_TIME"),
    "PROFILE_SPAN": ("zoomer_serve.profiling.export", "PROFILE_SPAN_NAME"),
    "CPU_PROFILE_PATH": ("zoomer_serve.host.names", "CPU_PATH"),
    "CPU_PROFILE_SAMPLES": ("zoomer_serve.host.names", "CPU_SAMPLES"),
    "CPU_TOP_FUNCTION": ("zoomer_serve.host.names", "CPU_TOP_FUNCTION"),
    "CPU_TOP_LOCATION": ("zoomer_serve.host.names", "CPU_TOP_LOCATION"),
    "CPU_TOP_SELF_SHARE": ("zoomer_serve.host.names", "CPU_TOP_SELF_SHARE"),
    "CPU_TOP_TOTAL_SHARE": ("zoomer_serve.host.names", "CPU_TOP_TOTAL_SHARE"),
}


def __getattr__(name: str) -> Any:
    if name == "GPU_MEMORY_ATTRIBUTES":
        value: Any = tuple(__getattr__(n) for n in ("GPU_MEMORY_ALLOCATED", "GPU_MEMORY_RESERVED", "GPU_MEMORY_PEAK",
                                                     "GPU_MEMORY_ALLOC_RETRIES", "GPU_MEMORY_OOMS"))
    elif name in _FROM:
        module, attr = _FROM[name]
        value = getattr(import_module(module), attr)
    else:
        raise AttributeError(f"module 'zoomer_serve.analysis.labels' has no attribute {name!r}")
    globals()[name] = value
    return value


PHASE_ATTRIBUTE = "zoomer.phase"
"""Span attribute naming a request phase (set by :func:`zoomer_serve.phase`)."""
PHASE_PREPROCESS = "preprocess"
PHASE_FORWARD = "forward"
PHASE_POSTPROCESS = "postprocess"

SERVICE_INSTANCE_ID = "service.instance.id"
RPC_METHOD = "rpc.method"
RPC_STATUS = "rpc.response.status_code"
ERROR_TYPE = "error.type"


def _int_id(value: int | str, digits: int, what: str) -> int:
    if isinstance(value, int):
        number = value
    elif re.fullmatch(f"[0-9a-fA-F]{{{digits}}}", value):
        number = int(value, 16)
    else:
        raise ValueError(f"{what} must be {digits} hex digits, got {value!r}")
    if not 0 <= number < 1 << (4 * digits):
        raise ValueError(f"{what} out of range: {value}")
    return number


def request_label(trace_id: int | str, span_id: int | str) -> str:
    """The ``record_function`` name for a request: ``zoomer.request/<32 hex>/<16 hex>`` (ids as ints or as
    the store's hex strings).

    Raises:
        ValueError: an id out of range or not hex of the right length.
    """
    return _profiling.request_label(_int_id(trace_id, 32, "trace_id"), _int_id(span_id, 16, "span_id"))


def parse_request_label(name: str) -> tuple[str, str] | None:
    """``(trace_id, span_id)`` as lowercase hex (as the store holds them) from a request label, or None for
    any other name."""
    ids = _profiling.parse_request_label(name)
    if ids is None:
        return None
    return f"{ids[0]:032x}", f"{ids[1]:016x}"
