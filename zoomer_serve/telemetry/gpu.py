"""GPU telemetry as one unit: what :func:`zoomer_serve.configure` installs when it is enabled.

:func:`install_gpu_telemetry` decides from the config and what the machine has:

- CUDA (``torch.cuda.is_available()``): the per-request memory observer (:mod:`.memory`), the OOM
  observer, and (when configured) allocation history (:mod:`.history`);
- NVML (``import pynvml`` and ``nvmlInit`` work): the hardware metrics sampler (:mod:`.nvml`);
- neither: nothing is installed, no observer runs on the request path, and one warning says why.

One background thread (``zoomer-gpu``) does everything periodic: it samples NVML, drains allocation
history, and arms the CUDA features (OOM observer, history recording) once the application has initialised
CUDA (zoomer-serve never initialises CUDA itself, so a server that forks workers is not affected).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zoomer_serve.recording import RequestRecorder, internal_error
from zoomer_serve.telemetry import names as n
from zoomer_serve.telemetry.config import GpuTelemetryConfig
from zoomer_serve.telemetry.history import AllocationHistory, SnapshotResult
from zoomer_serve.telemetry.memory import GpuMemoryObserver
from zoomer_serve.telemetry.memory_source import CudaMemorySource
from zoomer_serve.telemetry.nvml import NvmlSampler, NvmlUnavailable

logger = logging.getLogger("zoomer_serve.telemetry")
METER_NAME = "zoomer_serve.telemetry.gpu"


@dataclass
class GpuTelemetry:
    """The installed GPU telemetry of one :class:`~zoomer_serve.Telemetry` (``telemetry.gpu``).

    ``observer`` / ``history`` are None without CUDA; ``sampler`` is None without NVML. Use
    :meth:`enable_history` / :meth:`disable_history` for recording windows and :meth:`dump_snapshot`
    for a memory_viz snapshot; :meth:`shutdown` stops everything (also called by ``Telemetry.shutdown``).
    """

    config: GpuTelemetryConfig
    recorder: RequestRecorder
    source: CudaMemorySource | None = None
    observer: GpuMemoryObserver | None = None
    history: AllocationHistory | None = None
    sampler: NvmlSampler | None = None
    armed: bool = False
    _want_history: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _cuda_to_uuid: dict[int, str] = field(default_factory=dict)

    # -- control ---------------------------------------------------------------------------------------
    def enable_history(self) -> None:
        """Start allocation-history recording now (or as soon as CUDA is initialised).
        Raises RuntimeError without CUDA."""
        if self.history is None:
            raise RuntimeError("allocation history needs CUDA; GPU memory telemetry is off in this process")
        self._want_history = True
        if self.armed:
            self.history.enable()

    def disable_history(self) -> None:
        """Drain what was recorded and stop recording."""
        self._want_history = False
        if self.history is not None:
            self.history.disable()

    def dump_snapshot(self, path: str, timeout_s: float = 30.0) -> SnapshotResult:
        """Write the memory_viz snapshot pickle (see :meth:`AllocationHistory.dump_snapshot`).
        Raises RuntimeError without CUDA, SnapshotError on failure or timeout."""
        if self.history is None:
            raise RuntimeError("memory snapshots need CUDA; GPU memory telemetry is off in this process")
        return self.history.dump_snapshot(path, timeout_s)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, remove the observer, send pending allocation totals, stop recording (when this
        telemetry started it), close NVML. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self.observer is not None:
            self.recorder.remove_observer(self.observer)
            if self.source is not None and self.armed and self.config.oom:
                self.source.detach_oom_observer(self.observer.on_oom)
        if self.history is not None:
            self.history.disable()
            self.history.drain()
        if self.sampler is not None:
            self.sampler.close()

    # -- background ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Arm what can be armed now, take a first NVML sample, start the background thread."""
        self.tick_arm()
        if self.sampler is not None:
            self.sample_now()
        self._thread = threading.Thread(target=self._run, name="zoomer-gpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cfg = self.config
        periods: list[tuple[str, float, Callable[[], object]]] = []
        if self.sampler is not None:
            periods.append(("nvml", cfg.nvml_period_ms / 1000.0, self.sample_now))
        if self.history is not None:
            periods.append(("history", cfg.history_drain_ms / 1000.0, self.history.drain))
        if self.source is not None:
            periods.append(("arm", 1.0, self.tick_arm))
        if not periods:
            return
        due = {name: time.monotonic() + period for name, period, _ in periods}
        while not self._stop.is_set():
            now = time.monotonic()
            for name, period, fn in periods:
                if now >= due[name]:
                    due[name] = now + period
                    try:
                        fn()
                    except Exception as exc:
                        internal_error(f"gpu.thread.{name}", exc)
            self._stop.wait(max(0.0, min(due.values()) - time.monotonic()))

    def tick_arm(self) -> None:
        """Once CUDA is initialised: attach the OOM observer, start history if wanted, map devices to NVML."""
        source = self.source
        if source is None or self.armed or not source.is_initialized():
            return
        self.armed = True
        if self.config.oom and self.observer is not None:
            try:
                source.attach_oom_observer(self.observer.on_oom)
            except Exception as exc:
                logger.warning("zoomer-serve: CUDA out-of-memory observer unavailable (%s); OOMs are still counted "
                               "per request by %s", exc, n.MEM_OOMS)
        if self._want_history and self.history is not None:
            self.history.enable()
        if self.observer is not None:
            self._map_devices(source, self.observer)

    def _map_devices(self, source: CudaMemorySource, observer: GpuMemoryObserver) -> None:
        """CUDA index -> ``hw.id``: NVML's UUID of the same device where NVML lists it (the bytes match; the
        ``GPU-`` / ``MIG-`` prefixes may not), else the UUID torch reports."""
        nvml_ids = {_uuid_key(d.uuid): d.uuid for d in self.sampler.devices} if self.sampler is not None else {}
        for dev in observer.devices:
            uuid = source.device_uuid(dev)
            if uuid:
                hw_id = nvml_ids.get(_uuid_key(uuid), uuid)
                self._cuda_to_uuid[dev] = hw_id
                observer.device_attributes[dev] = {n.HW_TYPE: "gpu", n.HW_ID: hw_id}

    def sample_now(self) -> None:
        """One NVML sample; refreshes the per-request utilization the observer reads."""
        if self.sampler is None:
            return
        self.sampler.sample()
        if self.observer is not None:
            by_uuid = self.sampler.utilization_by_uuid()
            self.observer.utilization = {dev: by_uuid[uuid] for dev, uuid in self._cuda_to_uuid.items()
                                         if uuid in by_uuid}


def _uuid_key(uuid: str) -> str:
    """A device UUID without its ``GPU-`` / ``MIG-`` prefix, lower case."""
    head, sep, rest = uuid.partition("-")
    return (rest if sep and head in ("GPU", "MIG") else uuid).lower()


_warned: set[str] = set()


def _warn(message: str) -> None:
    logger.warning("zoomer-serve: %s", message)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _warn(message)


def install_gpu_telemetry(config: GpuTelemetryConfig, recorder: RequestRecorder, meter_provider: Any = None, *,
                          memory_source: CudaMemorySource | None = None, nvml: Any = None,
                          warn_once: bool = False) -> GpuTelemetry | None:
    """Install GPU telemetry on ``recorder`` (request observer) and ``meter_provider`` (metrics).

    ``memory_source`` / ``nvml``: the two seams (default: torch.cuda and ``import pynvml``). Returns None
    (after one warning, or silently for ``mode="off"``) when neither CUDA nor NVML is usable. ``warn_once``:
    a warning this process already logged is not logged again (``configure()`` sets it, since a server may
    configure more than once: from the environment when its interceptor is made, then in code).
    """
    warn = _warn_once if warn_once else _warn
    if config.mode == "off":
        return None
    source, cuda_reason = (memory_source, "") if memory_source is not None else _default_memory_source()
    sampler, nvml_reason = _open_sampler(nvml)
    if source is None and sampler is None:
        warn(f"GPU telemetry off: {cuda_reason}; {nvml_reason}")
        return None
    if source is None:
        warn(f"per-request GPU memory off ({cuda_reason}); NVML hardware metrics on")
    elif sampler is None:
        warn(f"GPU hardware metrics off ({nvml_reason}); per-request GPU memory on")
    meter = meter_provider.get_meter(METER_NAME) if meter_provider is not None else None
    gpu = GpuTelemetry(config, recorder, source=source, sampler=sampler, _want_history=config.history)
    if sampler is not None and meter is not None:
        sampler.register_metrics(meter)
    if source is not None:
        _install_memory(gpu, source, meter)
    gpu.start()
    return gpu


def _install_memory(gpu: GpuTelemetry, source: CudaMemorySource, meter: Any) -> None:
    cfg = gpu.config
    devices = cfg.devices if cfg.devices is not None else tuple(range(source.device_count()))
    if cfg.history:
        gpu.history = AllocationHistory(source, cfg.history_stacks, cfg.history_max_entries, cfg.history_top_events)
        if not getattr(source, "supports_metadata", True):
            logger.warning("zoomer-serve: this torch has no torch.cuda.memory._set_memory_metadata (torch >= 2.10): "
                           "allocation history is recorded but not attributed to requests")
    oom_counter = None
    if meter is not None:
        oom_counter = meter.create_counter(n.GPU_OOM_COUNT, unit="{oom}",
                                           description="CUDA out-of-memory errors seen by the allocator's observer.")
        if gpu.history is not None:
            _register_history_metrics(gpu.history, meter)
    device_attrs = {d: {n.HW_TYPE: "gpu", n.HW_ID: f"cuda:{d}"} for d in devices}
    gpu.observer = GpuMemoryObserver(source, devices, cfg.peak, gpu.history, oom_counter, device_attrs)
    gpu.recorder.add_observer(gpu.observer)


def _register_history_metrics(history: AllocationHistory, meter: Any) -> None:
    from opentelemetry.metrics import Observation

    def unattributed(options: Any) -> list[Observation]:
        return [Observation(history.stats.unattributed)]

    def overruns(options: Any) -> list[Observation]:
        return [Observation(history.stats.overruns)]

    meter.create_observable_counter(n.EVENTS_UNATTRIBUTED, callbacks=[unattributed], unit="{entry}",
                                    description="Allocator trace entries that no request tag claimed.")
    meter.create_observable_counter(n.HISTORY_OVERRUNS, callbacks=[overruns], unit="{drain}",
                                    description="Drains that found the history ring buffer had lost entries.")


def _default_memory_source() -> tuple[CudaMemorySource | None, str]:
    torch = sys.modules.get("torch")  # never import torch (1-2 s, 150k objects) into a server that does not use it
    if torch is None:
        return None, "torch is not imported by this process"
    if not torch.cuda.is_available():
        return None, f"no CUDA device (torch.cuda.is_available() is False, torch {torch.__version__})"
    from zoomer_serve.telemetry.memory_source import TorchCudaMemorySource

    try:
        source = TorchCudaMemorySource()
    except Exception as exc:
        return None, f"CUDA memory statistics unavailable: {exc}"
    if source.device_count() < 1:
        return None, "no CUDA device visible"
    return source, ""


def _open_sampler(nvml: Any) -> tuple[NvmlSampler | None, str]:
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return None, "NVML bindings not installed (pip install nvidia-ml-py)"
        nvml = pynvml
    sampler = NvmlSampler(nvml)
    try:
        sampler.open()
    except NvmlUnavailable as exc:
        return None, str(exc)
    if not sampler.devices:
        sampler.close()
        return None, "NVML lists no GPU"
    return sampler, ""


def attach_gpu_telemetry(telemetry: Any, config: GpuTelemetryConfig | None = None, *,
                         memory_source: CudaMemorySource | None = None, nvml: Any = None) -> GpuTelemetry | None:
    """(Re)install GPU telemetry on a configured :class:`~zoomer_serve.Telemetry` (its ``gpu``), e.g. with
    other sources than torch.cuda and pynvml; the previous one is shut down. Returns the new one or None."""
    if telemetry.gpu is not None:
        telemetry.gpu.shutdown()
    telemetry.gpu = install_gpu_telemetry(config or telemetry.config.gpu, telemetry.recorder,
                                          telemetry.meter_provider, memory_source=memory_source, nvml=nvml)
    return telemetry.gpu
