"""Settings of kernel profiling: one session's bounds and options, the controller's limits, the automatic
triggers and the admin service. Dataclasses that validate themselves; a bad value raises
:class:`~zoomer_serve.config.ConfigError` naming the field (or environment variable) and the value.

| setting | variable | default |
| --- | --- | --- |
| where traces are written | ``ZOOMER_PROFILES_DIR`` | ``./zoomer-data/profiles`` |
| admin shared token | ``ZOOMER_ADMIN_TOKEN`` | none: the admin service refuses every call |
| admin open to loopback callers without a token | ``ZOOMER_ADMIN_OPEN_LOOPBACK`` (``true``/``false``) | ``false`` |

The automatic triggers (steady state, latency SLO) are off unless configured in code or on the
``serve-demo`` command line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zoomer_serve import envvars
from zoomer_serve.config import ConfigError

MAX_REQUESTS_CAP = 1000
"""Hard cap on the requests one session covers (each is a link on the ``zoomer.profile`` span; a CPU trace of
the demo model takes about 200 KB of JSON per request)."""
MAX_DURATION_MS_CAP = 60_000
"""Hard cap on a session's duration in ms, whatever bounds it was given."""
DEFAULT_MAX_REQUESTS = 100
"""Requests covered by a session started with neither bound."""
DEFAULT_PROFILES_DIR = Path("zoomer-data") / "profiles"
DEFAULT_EXCLUDED_METHODS = ("zoomer.profiling.v1.ProfilerControl/*", "grpc.health.v1.Health/*",
                            "grpc.reflection.*")

TRIGGER_ON_DEMAND = "on_demand"
TRIGGER_STEADY_STATE = "steady_state"
TRIGGER_LATENCY_SLO = "latency_slo"
TRIGGER_LOAD_TEST = "load_test"
_TRIGGER_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,31}")


def check_trigger(trigger: str) -> str:
    """Return ``trigger`` if it is a valid trigger name (lowercase ``[a-z][a-z0-9_.-]``, at most 32
    characters: it becomes part of a file name); raise ConfigError otherwise."""
    if not isinstance(trigger, str) or not _TRIGGER_NAME.fullmatch(trigger):
        raise ConfigError(f"trigger must match [a-z][a-z0-9_.-]{{0,31}}, got {trigger!r}")
    return trigger


@dataclass(frozen=True)
class SessionOptions:
    """What one profiling session captures and when it ends.

    The session ends at the first of: ``max_requests`` covered requests have ended, ``duration_ms`` ms
    have passed, or a stop call. With neither bound it covers ``DEFAULT_MAX_REQUESTS`` requests; the
    duration never exceeds ``MAX_DURATION_MS_CAP`` (the controller's ``max_duration_ms_cap``) even when
    only a request bound is given, and the requests never exceed ``max_requests_cap``.

    Attributes:
        max_requests: requests to cover (None: bounded by time only, then by the cap).
        duration_ms: session length in ms (None: bounded by requests only, then by the cap).
        cuda: capture CUDA kernels, memcpy and memset (``ProfilerActivity.CUDA``); None: when CUDA is
            available. True on a machine without CUDA makes the start fail.
        record_shapes / profile_memory / with_stack / with_flops: the ``torch.profiler.profile`` options of
            the same names (each adds cost to every profiled op).
    """

    max_requests: int | None = None
    duration_ms: int | None = None
    cuda: bool | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False

    def bounded(self, max_requests_cap: int = MAX_REQUESTS_CAP,
                max_duration_ms_cap: int = MAX_DURATION_MS_CAP) -> tuple[int, int]:
        """The effective ``(max_requests, duration_ms)`` under the caps.

        Raises ConfigError: a bound below 1 or above its cap (the message names the cap)."""
        for name, value, cap in (("max_requests", self.max_requests, max_requests_cap),
                                 ("duration_ms", self.duration_ms, max_duration_ms_cap)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
            if value > cap:
                raise ConfigError(f"{name}={value} exceeds the hard cap of {cap}")
        requests = self.max_requests
        if requests is None:
            requests = max_requests_cap if self.duration_ms is not None else min(DEFAULT_MAX_REQUESTS,
                                                                                max_requests_cap)
        return requests, self.duration_ms if self.duration_ms is not None else max_duration_ms_cap


@dataclass(frozen=True)
class SteadyStateConfig:
    """Start one session once the server has warmed up and its latency is stable (off unless given).

    Criterion: after ``warmup_requests`` matching requests have ended, request durations are grouped into
    consecutive windows of ``window_ms``; a window counts when it holds at least ``min_requests``. Latency is
    stable when the last ``windows`` counted windows are consecutive and the coefficient of variation
    (population standard deviation / mean) of their p50s is at most ``max_cv``. Then one session with
    ``session`` options starts, trigger ``steady_state``; the trigger never fires again in this process
    (unless that start failed, when it tries again at the next stable window).

    ``methods``: globs over ``pkg.Service/Method`` whose requests count (None: all traced requests).
    """

    warmup_requests: int = 200
    window_ms: int = 1000
    windows: int = 5
    min_requests: int = 20
    max_cv: float = 0.1
    methods: tuple[str, ...] | None = None
    session: SessionOptions = field(default_factory=SessionOptions)

    def __post_init__(self) -> None:
        _positive(self, ("window_ms", "windows", "min_requests"))
        if self.warmup_requests < 0:
            raise ConfigError(f"steady_state.warmup_requests must be >= 0, got {self.warmup_requests}")
        if self.windows < 2:
            raise ConfigError(f"steady_state.windows must be >= 2 to measure variation, got {self.windows}")
        if not self.max_cv > 0:
            raise ConfigError(f"steady_state.max_cv must be > 0, got {self.max_cv}")


@dataclass(frozen=True)
class LatencySloConfig:
    """Start a session when a method's p99 latency stays above ``p99_ms`` (off unless given).

    Criterion: per method, request durations are grouped into consecutive windows of ``window_ms``; a
    window with at least ``min_requests`` requests whose p99 exceeds ``p99_ms`` is a violation. After
    ``sustain_windows`` consecutive violating windows of one method, one session with ``session`` options
    starts (trigger ``latency_slo``, attribute ``zoomer.profile.trigger.method``); then the trigger stays
    quiet for ``cooldown_ms`` counted from the end of that session's writing. A window with fewer requests,
    or a gap, resets the run. While another session runs the trigger waits (no cooldown starts).

    ``methods``: globs over ``pkg.Service/Method`` to watch (None: every traced method).
    """

    p99_ms: float
    window_ms: int = 1000
    sustain_windows: int = 3
    min_requests: int = 10
    cooldown_ms: int = 300_000
    methods: tuple[str, ...] | None = None
    session: SessionOptions = field(default_factory=SessionOptions)

    def __post_init__(self) -> None:
        _positive(self, ("window_ms", "sustain_windows", "min_requests"))
        if not self.p99_ms > 0:
            raise ConfigError(f"latency_slo.p99_ms must be > 0, got {self.p99_ms}")
        if self.cooldown_ms < 0:
            raise ConfigError(f"latency_slo.cooldown_ms must be >= 0, got {self.cooldown_ms}")


@dataclass(frozen=True)
class ProfilerConfig:
    """The profiling controller's settings.

    Attributes:
        profiles_dir: where traces are written (created on first use).
        max_requests_cap / max_duration_ms_cap: hard caps on every session's bounds.
        drain_timeout_ms: once a session stops taking requests, how long it waits for the requests it
            covers to end before it stops the profiler (requests still running are left out).
        start_timeout_ms: how long a blocking start waits for the profiler to come up.
        postprocess_timeout_ms: how long summarizing and compressing one trace may take.
        top_kernels: kernels listed per request and per session, by total GPU time.
        excluded_methods: globs over ``pkg.Service/Method`` never covered (admin, health, reflection).
        steady_state / latency_slo: automatic triggers; None (the default) is off.
    """

    profiles_dir: Path = DEFAULT_PROFILES_DIR
    max_requests_cap: int = MAX_REQUESTS_CAP
    max_duration_ms_cap: int = MAX_DURATION_MS_CAP
    drain_timeout_ms: int = 2000
    start_timeout_ms: int = 30_000
    postprocess_timeout_ms: int = 300_000
    top_kernels: int = 10
    excluded_methods: tuple[str, ...] = DEFAULT_EXCLUDED_METHODS
    steady_state: SteadyStateConfig | None = None
    latency_slo: LatencySloConfig | None = None

    def __post_init__(self) -> None:
        _positive(self, ("max_requests_cap", "max_duration_ms_cap", "drain_timeout_ms", "start_timeout_ms",
                         "postprocess_timeout_ms", "top_kernels"))
        object.__setattr__(self, "profiles_dir", Path(self.profiles_dir))
        if self.profiles_dir.exists() and not self.profiles_dir.is_dir():
            raise ConfigError(f"ProfilerConfig.profiles_dir {str(self.profiles_dir)!r} (ZOOMER_PROFILES_DIR, "
                              f"--profiles-dir) is a file, not a folder")
        for trigger in (self.steady_state, self.latency_slo):
            if trigger is not None:
                trigger.session.bounded(self.max_requests_cap, self.max_duration_ms_cap)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ProfilerConfig:
        """``ZOOMER_PROFILES_DIR`` from ``env`` (default ``os.environ``), then ``overrides``."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        if env.get("ZOOMER_PROFILES_DIR", "").strip():
            values["profiles_dir"] = Path(env["ZOOMER_PROFILES_DIR"].strip())
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def check_admin_token(token: str) -> str:
    """``token`` if it can travel as gRPC metadata (``authorization: Bearer <token>``) and as a Thrift header:
    printable ASCII (0x20 to 0x7E), not blank. Raises ConfigError naming the first character that cannot
    (a newline from a file read whole, for example) and its position."""
    return envvars.bearer_token(token, "ZOOMER_ADMIN_TOKEN", ConfigError)


@dataclass(frozen=True)
class AdminConfig:
    """Access to the ``ProfilerControl`` admin service (closed by default).

    Policy, checked on every call:

    - ``token`` set: the caller must send gRPC metadata ``authorization: Bearer <token>``. No such header:
      ``UNAUTHENTICATED``; a different token: ``PERMISSION_DENIED`` (compared with ``hmac.compare_digest``).
    - ``token`` not set and ``open_loopback`` false (the default): every call is refused with
      ``PERMISSION_DENIED`` (the message says how to open it).
    - ``token`` not set and ``open_loopback`` true: callers on a loopback address (127.0.0.0/8, ::1) or a
      Unix socket are served without a token; any other caller gets ``PERMISSION_DENIED``.

    A standalone admin server listens on ``host`` (default 127.0.0.1); a non-loopback ``host`` without a
    token is refused with ConfigError.
    """

    token: str | None = None
    open_loopback: bool = False
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.token is not None:
            check_admin_token(self.token)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> AdminConfig:
        """``ZOOMER_ADMIN_TOKEN`` and ``ZOOMER_ADMIN_OPEN_LOOPBACK`` from ``env``, then ``overrides``."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        if "ZOOMER_ADMIN_TOKEN" in env:
            values["token"] = env["ZOOMER_ADMIN_TOKEN"]
        if (env.get("ZOOMER_ADMIN_OPEN_LOOPBACK") or "").strip():
            values["open_loopback"] = envvars.switch(env, "ZOOMER_ADMIN_OPEN_LOOPBACK", False, ConfigError,
                                                     "true or false")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def _positive(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}")
