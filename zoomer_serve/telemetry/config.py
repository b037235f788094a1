"""GPU telemetry settings: one dataclass, filled from ``ZOOMER_GPU*`` variables or code.

| setting | variable | default |
| --- | --- | --- |
| GPU telemetry | ``ZOOMER_GPU``: ``auto`` (on where CUDA or NVML is there), ``on``, ``off`` | ``auto`` |
| watched CUDA devices | ``ZOOMER_GPU_DEVICES`` (comma-separated indices) | all visible devices |
| per-request peak | ``ZOOMER_GPU_PEAK`` (``true``/``false``): resets the allocator's peak stats at request boundaries | ``true`` |
| allocation history | ``ZOOMER_GPU_MEMORY_HISTORY`` (``true``/``false``) | ``false`` |
| history stacks | ``ZOOMER_GPU_MEMORY_HISTORY_STACKS``: ``python`` or ``none`` | ``python`` |
| history ring size | ``ZOOMER_GPU_MEMORY_HISTORY_MAX_ENTRIES`` (trace entries per device) | 10000 |
| history drain period | ``ZOOMER_GPU_MEMORY_HISTORY_DRAIN_MS`` (ms) | 1000 |
| largest events per request | ``ZOOMER_GPU_MEMORY_HISTORY_TOP_EVENTS`` | 5 |
| NVML sampling period | ``ZOOMER_GPU_NVML_PERIOD_MS`` (ms) | 1000 |
| OOM observer | ``ZOOMER_GPU_OOM`` (``true``/``false``) | ``true`` |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from zoomer_serve import envvars

GPU_MODES = ("auto", "on", "off")
STACKS = ("python", "none")


class GpuConfigError(ValueError):
    """A GPU telemetry setting is invalid; the message names the variable (or field) and the value.

    A subclass of ``ValueError`` like :class:`zoomer_serve.config.ConfigError`, which re-raises it."""


@dataclass(frozen=True)
class GpuTelemetryConfig:
    """What GPU telemetry does (see the module docstring for the variables). Times in ms.

    ``devices`` None means every CUDA device this process can see. Raises :class:`GpuConfigError`
    on an invalid value."""

    mode: str = "auto"
    devices: tuple[int, ...] | None = None
    peak: bool = True
    history: bool = False
    history_stacks: str = "python"
    history_max_entries: int = 10_000
    history_drain_ms: int = 1000
    history_top_events: int = 5
    nvml_period_ms: int = 1000
    oom: bool = True

    def __post_init__(self) -> None:
        if self.mode not in GPU_MODES:
            raise GpuConfigError(f"ZOOMER_GPU must be one of {GPU_MODES}, got {self.mode!r}")
        if self.history_stacks not in STACKS:
            raise GpuConfigError(f"ZOOMER_GPU_MEMORY_HISTORY_STACKS must be one of {STACKS}, "
                                 f"got {self.history_stacks!r}")
        for name in ("history_max_entries", "history_drain_ms", "nvml_period_ms"):
            if getattr(self, name) <= 0:
                raise GpuConfigError(f"GPU telemetry {name} must be > 0, got {getattr(self, name)}")
        if self.history_top_events < 0:
            raise GpuConfigError(f"ZOOMER_GPU_MEMORY_HISTORY_TOP_EVENTS must be >= 0, got {self.history_top_events}")
        if self.devices is not None and any(d < 0 for d in self.devices):
            raise GpuConfigError(f"ZOOMER_GPU_DEVICES must be CUDA device indices >= 0, got {self.devices}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GpuTelemetryConfig:
        """Read the ``ZOOMER_GPU*`` variables from ``env`` (default ``os.environ``)."""
        env = os.environ if env is None else env
        return cls(
            mode=(env.get("ZOOMER_GPU") or "auto").strip().lower(),
            devices=_devices(env.get("ZOOMER_GPU_DEVICES")),
            peak=_bool(env, "ZOOMER_GPU_PEAK", True),
            history=_bool(env, "ZOOMER_GPU_MEMORY_HISTORY", False),
            history_stacks=(env.get("ZOOMER_GPU_MEMORY_HISTORY_STACKS") or "python").strip().lower(),
            history_max_entries=_int(env, "ZOOMER_GPU_MEMORY_HISTORY_MAX_ENTRIES", 10_000),
            history_drain_ms=_int(env, "ZOOMER_GPU_MEMORY_HISTORY_DRAIN_MS", 1000),
            history_top_events=_int(env, "ZOOMER_GPU_MEMORY_HISTORY_TOP_EVENTS", 5, minimum=0),
            nvml_period_ms=_int(env, "ZOOMER_GPU_NVML_PERIOD_MS", 1000),
            oom=_bool(env, "ZOOMER_GPU_OOM", True),
        )


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    return envvars.switch(env, name, default, GpuConfigError, "true or false")


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 1) -> int:
    return envvars.integer(env, name, default, GpuConfigError, minimum)


def _devices(raw: str | None) -> tuple[int, ...] | None:
    if raw is None or not raw.strip():
        return None
    out = []
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit():
            raise GpuConfigError(f"ZOOMER_GPU_DEVICES must be comma-separated CUDA device indices, got {raw!r}")
        out.append(int(part))
    return tuple(out)
