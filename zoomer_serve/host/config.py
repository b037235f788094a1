"""Host telemetry settings: one dataclass, filled from ``ZOOMER_HOST*`` / ``ZOOMER_CPU_PROFILE*`` variables or
code. A bad value raises :class:`HostConfigError` naming the variable (or field) and the value.

| setting | variable | default |
| --- | --- | --- |
| host telemetry (all of the below) | ``ZOOMER_HOST``: ``on`` / ``off`` | ``on`` |
| system and process metrics | ``ZOOMER_HOST_METRICS``: comma-separated groups (``cpu``, ``memory``, ``disk``, ``network``, ``process``, ``gc``) and/or metric names, or ``none`` | all groups |
| per-request thread CPU time | ``ZOOMER_HOST_REQUEST_CPU_TIME`` (``true``/``false``; ``false``: never, sessions included) | ``true`` |
| ... outside profiling sessions, on 1 in N traces | ``ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN`` (N >= 0; 0: only in sessions, 1: every request) | 16 (:data:`DEFAULT_REQUEST_CPU_TIME_ONE_IN`) |
| Python CPU profile in profiling sessions | ``ZOOMER_CPU_PROFILE``: ``auto`` (py-spy, else the in-process sampler), ``py-spy``, ``in-process``, ``off`` | ``auto`` |
| sampling rate | ``ZOOMER_CPU_PROFILE_RATE_HZ`` (samples per second per thread, 1..1000) | 19 (:data:`DEFAULT_RATE_HZ`) |
| top functions on the ``zoomer.profile`` span | ``ZOOMER_CPU_PROFILE_TOP`` | 10 |
| py-spy binary | ``ZOOMER_CPU_PROFILE_PYSPY`` | ``py-spy`` beside the Python interpreter, else on ``PATH`` |
| py-spy attach timeout | ``ZOOMER_CPU_PROFILE_ATTACH_TIMEOUT_MS`` (ms) | 5000 |

The metrics are observed when the SDK's metric reader collects, every ``OTEL_METRIC_EXPORT_INTERVAL`` ms
(60 s by default): the period of every zoomer-serve metric.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from zoomer_serve import envvars
from zoomer_serve.host.names import METRIC_GROUPS

CPU_PROFILE_MODES = ("auto", "py-spy", "in-process", "off")
MAX_RATE_HZ = 1000
DEFAULT_RATE_HZ = 19
DEFAULT_REQUEST_CPU_TIME_ONE_IN = 16
"""Outside profiling sessions, per-request CPU time is measured on 1 in this many sampled traces (every request
inside a session; :mod:`zoomer_serve.host.request_cpu`). One measured request costs the demo model 40 to 176 µs
of CPU on the 2-core benchmark machine (the thread clock's end read, benchmarks/RESULTS.md); 1 in 16 brings
the mean to 2.5 to 11 µs, and a service answering 100 requests/s still gets about 6 measured ones a second."""
"""Default CPU sampling rate. py-spy costs about 1.2 ms of CPU per sample of an 18-thread server (17 % of a core
at 100 Hz, 3 % at 19 Hz, measured on the 2-core benchmark machine); at 100 Hz it added 8 % to the demo's
latency inside sessions, at 19 Hz nothing measurable (benchmarks/RESULTS.md). 19, not 20, so that samples do
not fall in step with work that repeats every 10, 50 or 100 ms (the rate continuous profilers such as Parca use).
Raise it (``ZOOMER_CPU_PROFILE_RATE_HZ``) for finer profiles of short sessions: a session of 100 requests of
3 ms gets about 6 samples per busy thread at 19 Hz."""


class HostConfigError(ValueError):
    """A host telemetry setting is invalid; the message names the variable (or field) and the value.

    A subclass of ``ValueError`` like :class:`zoomer_serve.config.ConfigError`, which re-raises it."""


def known_metrics() -> tuple[str, ...]:
    """Every metric name ``ZOOMER_HOST_METRICS`` accepts, in group order."""
    return tuple(m for group in METRIC_GROUPS.values() for m in group)


@dataclass(frozen=True)
class HostConfig:
    """What host telemetry does (see the module docstring for the variables).

    ``metrics``: the metric names to report (every name one of :func:`known_metrics`); empty for none.
    ``cpu_profile_pyspy``: the py-spy binary, None to look beside the interpreter, then on ``PATH``.
    """

    enabled: bool = True
    metrics: tuple[str, ...] = known_metrics()
    request_cpu_time: bool = True
    request_cpu_time_one_in: int = DEFAULT_REQUEST_CPU_TIME_ONE_IN
    cpu_profile: str = "auto"
    cpu_profile_rate_hz: int = DEFAULT_RATE_HZ
    cpu_profile_top: int = 10
    cpu_profile_pyspy: str | None = None
    cpu_profile_attach_timeout_ms: int = 5000

    def __post_init__(self) -> None:
        if self.cpu_profile not in CPU_PROFILE_MODES:
            raise HostConfigError(f"ZOOMER_CPU_PROFILE must be one of {CPU_PROFILE_MODES}, got {self.cpu_profile!r}")
        if not 1 <= self.cpu_profile_rate_hz <= MAX_RATE_HZ:
            raise HostConfigError(f"ZOOMER_CPU_PROFILE_RATE_HZ must be within 1..{MAX_RATE_HZ}, "
                                  f"got {self.cpu_profile_rate_hz}")
        if self.request_cpu_time_one_in < 0:
            raise HostConfigError("ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN (request_cpu_time_one_in) must be >= 0 "
                                  f"(0: only inside profiling sessions), got {self.request_cpu_time_one_in}")
        for name, variable in (("cpu_profile_top", "ZOOMER_CPU_PROFILE_TOP"),
                               ("cpu_profile_attach_timeout_ms", "ZOOMER_CPU_PROFILE_ATTACH_TIMEOUT_MS")):
            if getattr(self, name) < 1:
                raise HostConfigError(f"{variable} ({name}) must be >= 1, got {getattr(self, name)}")
        unknown = [m for m in self.metrics if m not in known_metrics()]
        if unknown:
            raise HostConfigError(f"ZOOMER_HOST_METRICS: unknown metric {unknown[0]!r}; use groups "
                                  f"{', '.join(METRIC_GROUPS)} or names from {', '.join(known_metrics())}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HostConfig:
        """Read the variables from ``env`` (default ``os.environ``). Raises HostConfigError."""
        env = os.environ if env is None else env
        pyspy = (env.get("ZOOMER_CPU_PROFILE_PYSPY") or "").strip() or None
        return cls(
            enabled=_switch(env, "ZOOMER_HOST", True),
            metrics=parse_metrics(env.get("ZOOMER_HOST_METRICS")),
            request_cpu_time=_switch(env, "ZOOMER_HOST_REQUEST_CPU_TIME", True),
            request_cpu_time_one_in=_int(env, "ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN", DEFAULT_REQUEST_CPU_TIME_ONE_IN),
            cpu_profile=(env.get("ZOOMER_CPU_PROFILE") or "auto").strip().lower(),
            cpu_profile_rate_hz=_int(env, "ZOOMER_CPU_PROFILE_RATE_HZ", DEFAULT_RATE_HZ),
            cpu_profile_top=_int(env, "ZOOMER_CPU_PROFILE_TOP", 10),
            cpu_profile_pyspy=pyspy,
            cpu_profile_attach_timeout_ms=_int(env, "ZOOMER_CPU_PROFILE_ATTACH_TIMEOUT_MS", 5000),
        )


def parse_metrics(raw: str | None) -> tuple[str, ...]:
    """``ZOOMER_HOST_METRICS``: groups and/or metric names, comma-separated; ``none`` for none; unset or
    empty for all. Returns the metric names, in group order, without duplicates. Raises HostConfigError."""
    if raw is None or not raw.strip():
        return known_metrics()
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if parts == ["none"]:
        return ()
    wanted: set[str] = set()
    for part in parts:
        if part in METRIC_GROUPS:
            wanted.update(METRIC_GROUPS[part])
        elif part in known_metrics():
            wanted.add(part)
        else:
            raise HostConfigError(f"ZOOMER_HOST_METRICS: {part!r} is neither a group ({', '.join(METRIC_GROUPS)}) "
                                  "nor a known metric name")
    return tuple(m for m in known_metrics() if m in wanted)


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    return envvars.switch(env, name, default, HostConfigError, "on/off (true/false)")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    return envvars.integer(env, name, default, HostConfigError)
