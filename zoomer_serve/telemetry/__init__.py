"""GPU telemetry: per-request CUDA memory, allocation events, OOMs, and NVML hardware metrics.

Switched on by :func:`zoomer_serve.configure` (``ZOOMER_GPU``, see :mod:`.config`); everything is off,
with one warning, where there is neither CUDA nor NVML. Names, units and sources: :mod:`.names` and
:mod:`.nvml`. Importing this package imports neither torch nor pynvml.
"""

from zoomer_serve.telemetry.config import GpuConfigError, GpuTelemetryConfig
from zoomer_serve.telemetry.gpu import GpuTelemetry, attach_gpu_telemetry, install_gpu_telemetry
from zoomer_serve.telemetry.history import AllocationHistory, SnapshotError, SnapshotResult, SnapshotTimeout
from zoomer_serve.telemetry.memory import GpuMemoryObserver
from zoomer_serve.telemetry.memory_source import CudaMemorySource, MemoryCounters, TorchCudaMemorySource
from zoomer_serve.telemetry.nvml import NvmlSampler, NvmlUnavailable

__all__ = [
    "AllocationHistory",
    "CudaMemorySource",
    "GpuConfigError",
    "GpuMemoryObserver",
    "GpuTelemetry",
    "GpuTelemetryConfig",
    "MemoryCounters",
    "NvmlSampler",
    "NvmlUnavailable",
    "SnapshotError",
    "SnapshotResult",
    "SnapshotTimeout",
    "TorchCudaMemorySource",
    "attach_gpu_telemetry",
    "install_gpu_telemetry",
]
