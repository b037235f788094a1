"""Settings of a profiled load test: when the steady-state trigger starts the profiler, the session's bounds,
and where the end-of-run summary reads and writes. Locust-free (the ``zoomer-serve loadtest`` command line
and locust's own parser share :func:`add_arguments`).

| option | variable | default |
| --- | --- | --- |
| ``--zoomer-target`` (ProfilerControl ``host:port``) | ``ZOOMER_LOADTEST_TARGET`` | locust's ``--host`` |
| ``--zoomer-no-profile`` | | profiling on |
| ``--zoomer-warmup-s`` | ``ZOOMER_LOADTEST_WARMUP_S`` | 10 s after spawning completed |
| ``--zoomer-warmup-requests`` | ``ZOOMER_LOADTEST_WARMUP_REQUESTS`` | 0 requests after spawning completed |
| ``--zoomer-stable-cv`` | ``ZOOMER_LOADTEST_STABLE_CV`` | off |
| ``--zoomer-stable-samples`` | ``ZOOMER_LOADTEST_STABLE_SAMPLES`` | 5 |
| ``--zoomer-profile-requests`` | ``ZOOMER_LOADTEST_PROFILE_REQUESTS`` | 100 |
| ``--zoomer-profile-duration-s`` | ``ZOOMER_LOADTEST_PROFILE_DURATION_S`` | none (the server caps it at 60 s) |
| ``--zoomer-cuda`` (``auto``, ``on``, ``off``) | ``ZOOMER_LOADTEST_CUDA`` | ``auto`` |
| ``--zoomer-stop-wait-s`` | ``ZOOMER_LOADTEST_STOP_WAIT_S`` | 60 s |
| ``--zoomer-profiles-dir`` (the server's traces, as mounted here) | ``ZOOMER_PROFILES_DIR`` | none |
| ``--zoomer-store`` (the collector's DuckDB store, read at the end) | | none |
| ``--zoomer-summary-json`` | ``ZOOMER_LOADTEST_SUMMARY_JSON`` | none |

The admin token is read from ``ZOOMER_ADMIN_TOKEN`` only (a token on a command line shows in ``ps``).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoomer_serve.config import ConfigError
from zoomer_serve.profiling.config import SessionOptions

CUDA_CHOICES = ("auto", "on", "off")
TRANSPORTS = ("grpc", "thrift")
"""The demo Ranker's transports, as ``zoomer-serve loadtest --transport`` and the packaged users take them."""
TRANSPORT_ENV = "ZOOMER_LOADTEST_TRANSPORT"


@dataclass(frozen=True)
class LoadTestOptions:
    """What the locust plugin does around a run (see the module docstring for the options).

    Attributes:
        target: ProfilerControl address ``host:port`` (``grpc://`` accepted); None: locust's ``--host``.
        profile: start one profiling session once the run is steady.
        warmup_s: seconds after spawning completed before the trigger may fire.
        warmup_requests: requests (locust's count) after spawning completed before it may fire (it always
            waits for at least one: a test that sends no request is never profiled).
        stable_cv: when set, also wait until the coefficient of variation of the last ``stable_samples``
            one-second samples of locust's rolling median response time (its ~10 s window) is at most this.
        profile_requests / profile_duration_s: the session's bounds (requests covered, seconds); the session
            ends at the first one reached (None: not given; with neither the server covers 100 requests).
        cuda: capture CUDA kernels: ``auto`` (when the server has CUDA), ``on``, ``off``.
        stop_wait_s: at the end of the run, how long to wait for the server to write the trace.
        profiles_dir: where the server's trace files can be read on this machine (a shared volume); a trace
            path the server reports that is not readable here is looked up by file name in this folder.
        store: the collector's DuckDB store, read at the end for the server-side latencies (the collector
            must have stopped: DuckDB allows one writer or many readers).
        summary_json: where to write the summary as JSON.
        top_kernels: kernels listed in the profile summary.

    Raises ConfigError (naming the option) on a bad value.
    """

    target: str | None = None
    profile: bool = True
    warmup_s: float = 10.0
    warmup_requests: int = 0
    stable_cv: float | None = None
    stable_samples: int = 5
    profile_requests: int | None = 100
    profile_duration_s: float | None = None
    cuda: str = "auto"
    stop_wait_s: float = 60.0
    profiles_dir: Path | None = None
    store: Path | None = None
    summary_json: Path | None = None
    top_kernels: int = 10

    def __post_init__(self) -> None:
        _check(0 <= self.warmup_s < math.inf, "--zoomer-warmup-s", self.warmup_s, "a finite number >= 0")
        _check(self.warmup_requests >= 0, "--zoomer-warmup-requests", self.warmup_requests, ">= 0")
        if self.stable_cv is not None:
            _check(0 < self.stable_cv < math.inf, "--zoomer-stable-cv", self.stable_cv, "a finite number > 0")
        _check(self.stable_samples >= 2, "--zoomer-stable-samples", self.stable_samples, ">= 2")
        if self.profile_duration_s is not None:
            _check(0 < self.profile_duration_s < math.inf, "--zoomer-profile-duration-s", self.profile_duration_s,
                   "a finite number > 0")
        _check(self.cuda in CUDA_CHOICES, "--zoomer-cuda", self.cuda, f"one of {', '.join(CUDA_CHOICES)}")
        _check(0 < self.stop_wait_s < math.inf, "--zoomer-stop-wait-s", self.stop_wait_s, "a finite number > 0")
        _check(self.top_kernels >= 1, "top_kernels", self.top_kernels, ">= 1")
        if self.profile_requests is not None:  # 0 on the command line stands for None: no request bound
            _check(self.profile_requests >= 1, "--zoomer-profile-requests", self.profile_requests,
                   ">= 0 (0: bounded by --zoomer-profile-duration-s only)")
        try:
            self.session_options().bounded()
        except ConfigError as exc:
            raise ConfigError(f"--zoomer-profile-requests / --zoomer-profile-duration-s: {exc}") from None
        if self.target is not None:
            grpc_target(self.target, "--zoomer-target")
        if self.summary_json is not None:  # checked now, not after the whole run
            _check(not self.summary_json.is_dir(), "--zoomer-summary-json", str(self.summary_json),
                   "a file name, not a folder")
            _check(self.summary_json.parent.is_dir(), "--zoomer-summary-json", str(self.summary_json),
                   "in an existing folder")

    @property
    def duration_ms(self) -> int | None:
        return None if self.profile_duration_s is None else max(1, round(self.profile_duration_s * 1000))

    def session_options(self) -> SessionOptions:
        """The profiling session's bounds and capture options as the server takes them."""
        cuda = {"auto": None, "on": True, "off": False}[self.cuda]
        return SessionOptions(max_requests=self.profile_requests, duration_ms=self.duration_ms, cuda=cuda)

    @classmethod
    def from_namespace(cls, ns: Any) -> LoadTestOptions:
        """From parsed :func:`add_arguments` options (locust's ``environment.parsed_options``)."""
        return cls(target=ns.zoomer_target, profile=not ns.zoomer_no_profile, warmup_s=ns.zoomer_warmup_s,
                   warmup_requests=ns.zoomer_warmup_requests, stable_cv=ns.zoomer_stable_cv,
                   stable_samples=ns.zoomer_stable_samples, profile_requests=ns.zoomer_profile_requests or None,
                   profile_duration_s=ns.zoomer_profile_duration_s, cuda=ns.zoomer_cuda,
                   stop_wait_s=ns.zoomer_stop_wait_s, profiles_dir=_path(ns.zoomer_profiles_dir),
                   store=_path(ns.zoomer_store), summary_json=_path(ns.zoomer_summary_json))


def _check(ok: bool, name: str, value: Any, rule: str) -> None:
    """Refuse ``value`` of option ``name`` (``--zoomer-<option>``) unless ``ok``, naming the option and its
    environment variable (the value may have come from either)."""
    if not ok:
        env = ENV_VARS.get(name.removeprefix("--zoomer-"))
        raise ConfigError(f"{name}{f' ({env})' if env else ''} must be {rule}, got {value!r}")


def _path(value: Any) -> Path | None:
    return Path(value) if value not in (None, "") else None


def _env_choice(choices: tuple[str, ...], env: str) -> Any:
    """An argparse ``type`` for an option with ``choices`` whose default is ``env``'s value: that value, when it is
    not one of ``choices``, is refused naming ``env`` (argparse checks only the values given on the command line,
    which it still does, with its own words)."""

    def checked(text: str) -> str:
        if text not in choices and text == _env(env):
            raise argparse.ArgumentTypeError(f"{env}={text!r} is not one of {', '.join(choices)}")
        return text

    return checked


def _naming_env(convert: Any, env: str) -> Any:
    """``convert`` (an argparse ``type``) whose error names ``env`` when the bad text is that variable's value
    (argparse alone names the option, which the user did not give)."""

    def from_text(text: str) -> Any:
        try:
            return convert(text)
        except ValueError:
            if text != _env(env):
                raise
            raise argparse.ArgumentTypeError(f"{env}={text!r} is not a valid {convert.__name__}") from None

    from_text.__name__ = convert.__name__
    return from_text


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def grpc_target(host: str | None, what: str = "--host") -> str:
    """A gRPC channel target ``host:port`` from ``host:port``, ``grpc://host:port`` or ``[::1]:port``.

    Raises ConfigError naming ``what`` when there is no host or no port, or the port is not in 1..65535."""
    text = (host or "").strip()
    if text.startswith("grpc://"):
        text = text[len("grpc://"):]
    text = text.rstrip("/")
    name, sep, port = text.rpartition(":")
    if not sep or not name or not port.isdigit() or "/" in text:
        raise ConfigError(f"{what} must be host:port (or grpc://host:port), got {host!r}")
    if not 1 <= int(port) <= 65535:  # grpc would take the port modulo 65536 and connect elsewhere
        raise ConfigError(f"{what} must have a port in 1..65535, got {host!r}")
    return text


ENV_VARS = {
    "target": "ZOOMER_LOADTEST_TARGET",
    "warmup-s": "ZOOMER_LOADTEST_WARMUP_S",
    "warmup-requests": "ZOOMER_LOADTEST_WARMUP_REQUESTS",
    "stable-cv": "ZOOMER_LOADTEST_STABLE_CV",
    "stable-samples": "ZOOMER_LOADTEST_STABLE_SAMPLES",
    "profile-requests": "ZOOMER_LOADTEST_PROFILE_REQUESTS",
    "profile-duration-s": "ZOOMER_LOADTEST_PROFILE_DURATION_S",
    "cuda": "ZOOMER_LOADTEST_CUDA",
    "stop-wait-s": "ZOOMER_LOADTEST_STOP_WAIT_S",
    "profiles-dir": "ZOOMER_PROFILES_DIR",
    "summary-json": "ZOOMER_LOADTEST_SUMMARY_JSON",
}
"""The environment variable of each option (by its name without the prefix): read at parse time (locust) or as
the default (plain argparse), and named with the option when its value is refused."""


def add_arguments(parser: Any, prefix: str = "--zoomer-") -> None:
    """Add the options of :class:`LoadTestOptions` to ``parser`` as ``<prefix><name>`` (destinations
    ``zoomer_<name>`` whatever the prefix). With locust's parser (configargparse) each option reads its
    environment variable at parse time; with a plain argparse parser the variable's value is the default."""
    reads_env = any(c.__module__ == "configargparse" for c in type(parser).__mro__)
    group = parser.add_argument_group("zoomer-serve profiling",
                                      "Profile the target once the load is steady (ProfilerControl; the admin "
                                      "token comes from ZOOMER_ADMIN_TOKEN) and summarize the run.")

    def add(name: str, **kwargs: Any) -> None:
        env = ENV_VARS.get(name)
        if env is not None:
            if reads_env:
                kwargs["env_var"] = env
            elif _env(env) is not None:
                kwargs["default"] = _env(env)  # a string default: argparse converts (and checks) it at parse time
                if "type" in kwargs:
                    kwargs["type"] = _naming_env(kwargs["type"], env)
                elif "choices" in kwargs:  # argparse checks a default against no choices
                    kwargs["type"] = _env_choice(kwargs["choices"], env)
        if kwargs.get("action") is None and "choices" not in kwargs:
            kwargs["metavar"] = name.split("-")[-1].upper() if name != "target" else "HOST:PORT"
        group.add_argument(prefix + name, dest="zoomer_" + name.replace("-", "_"), **kwargs)

    add("target", default=None,
        help="ProfilerControl address host:port (default: the target host)")
    add("no-profile", action="store_true", default=False, help="run the load without profiling")
    add("warmup-s", type=float, default=10.0,
        help="seconds after spawning completed before profiling may start (default 10)")
    add("warmup-requests", type=int, default=0,
        help="requests after spawning completed before profiling may start (default 0; profiling always "
             "waits for at least one request)")
    add("stable-cv", type=float, default=None,
        help="also wait until locust's rolling median response time is stable: coefficient of variation of "
             f"the last {prefix}stable-samples one-second samples at most this (default: off)")
    add("stable-samples", type=int, default=5,
        help="one-second samples the stability check looks at (default 5)")
    add("profile-requests", type=int, default=100,
        help=f"requests the profiling session covers (default 100; 0: bounded by {prefix}profile-duration-s only)")
    add("profile-duration-s", type=float, default=None,
        help="profiling session length in seconds (default: bounded by requests; the server caps it)")
    add("cuda", choices=CUDA_CHOICES, default="auto",
        help="capture CUDA kernels: auto (when the server has CUDA), on, off (default auto)")
    add("stop-wait-s", type=float, default=60.0,
        help="at the end, how long to wait for the server to write the trace (default 60)")
    add("profiles-dir", default=None,
        help="where the server's trace files are readable here (e.g. a shared volume), for the kernel summary")
    add("store", default=None, help="the collector's DuckDB store, read at the end for server-side latency "
        "(the collector must have stopped)")
    add("summary-json", default=None, help="write the run summary as JSON here")


def to_locust_args(options: LoadTestOptions) -> list[str]:
    """The locust command-line arguments that give a locust process ``options``."""
    args: list[str] = []
    for name, value in (("target", options.target), ("warmup-s", options.warmup_s),
                        ("warmup-requests", options.warmup_requests), ("stable-cv", options.stable_cv),
                        ("stable-samples", options.stable_samples),
                        ("profile-requests", options.profile_requests or 0),  # 0: not given
                        ("profile-duration-s", options.profile_duration_s), ("cuda", options.cuda),
                        ("stop-wait-s", options.stop_wait_s), ("profiles-dir", options.profiles_dir),
                        ("store", options.store), ("summary-json", options.summary_json)):
        if value is not None:
            args += [f"--zoomer-{name}", str(value)]
    if not options.profile:
        args.append("--zoomer-no-profile")
    return args
