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

from zoomer_serve.host import names as _host
from zoomer_serve.profiling import export as _export
from zoomer_serve.profiling import labels as _profiling
from zoomer_serve.telemetry import names as _gpu

REQUEST_LABEL_PREFIX = _profiling.REQUEST_LABEL_PREFIX
"""Start of the ``record_function`` name of a request range: ``zoomer.request/<trace_id>/<span_id>``."""

# Written by the GPU telemetry: its names module is the one place for these strings.
GPU_MEMORY_ALLOCATED = _gpu.MEM_ALLOCATED_END
GPU_MEMORY_RESERVED = _gpu.MEM_RESERVED_END
GPU_MEMORY_PEAK = _gpu.MEM_PEAK
GPU_MEMORY_ALLOC_RETRIES = _gpu.MEM_ALLOC_RETRIES
GPU_MEMORY_OOMS = _gpu.MEM_OOMS
GPU_MEMORY_ATTRIBUTES = (GPU_MEMORY_ALLOCATED, GPU_MEMORY_RESERVED, GPU_MEMORY_PEAK, GPU_MEMORY_ALLOC_RETRIES,
                         GPU_MEMORY_OOMS)
GPU_OOM_EVENT = _gpu.OOM_EVENT
OOM_ERROR_MARKER = "OutOfMemoryError"  # in error.type (torch.OutOfMemoryError) or an exception event
METRIC_GPU_UTILIZATION = _gpu.HW_GPU_UTILIZATION
METRIC_GPU_MEMORY_USAGE = _gpu.HW_GPU_MEMORY_USAGE
METRIC_HW_ID = _gpu.HW_ID

REQUEST_CPU_TIME = _host.REQUEST_CPU_TIME
PROFILE_SPAN = _export.PROFILE_SPAN_NAME
PROFILE_SESSION_ID = "zoomer.profile.session_id"
CPU_PROFILE_PATH = _host.CPU_PATH
CPU_PROFILE_SAMPLES = _host.CPU_SAMPLES
CPU_TOP_FUNCTION = _host.CPU_TOP_FUNCTION
CPU_TOP_LOCATION = _host.CPU_TOP_LOCATION
CPU_TOP_SELF_SHARE = _host.CPU_TOP_SELF_SHARE
CPU_TOP_TOTAL_SHARE = _host.CPU_TOP_TOTAL_SHARE

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
