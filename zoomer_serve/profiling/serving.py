"""Profiling in a model server process: command-line options, the controller, the admin service (for
``zoomer-serve serve-demo``, and for anyone wiring the same into their own server)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoomer_serve.cli_types import (
    int_between,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from zoomer_serve.profiling.config import (
    MAX_REQUESTS_CAP,
    AdminConfig,
    LatencySloConfig,
    ProfilerConfig,
    SessionOptions,
    SteadyStateConfig,
)


def add_profiling_options(parser: argparse.ArgumentParser) -> None:
    """Add the profiling options of a serving command to ``parser``."""
    group = parser.add_argument_group(
        "kernel profiling", "The ProfilerControl admin service is closed by default: it needs ZOOMER_ADMIN_TOKEN "
        "from callers, or --admin-open-loopback for local callers. So is profiling one request (metadata or Thrift "
        "header zoomer-profile: <token>, or baggage zoomer.profile from loopback callers when opened). Automatic "
        "triggers are off unless enabled.")
    group.add_argument("--profiles-dir", type=Path, default=None,
                       help="where traces go (default $ZOOMER_PROFILES_DIR or ./zoomer-data/profiles)")
    group.add_argument("--admin-open-loopback", action="store_true",
                       help="let loopback callers use the admin service without a token")
    group.add_argument("--steady-state", action="store_true",
                       help="profile once after warm-up when latency is stable (CV of windowed p50)")
    group.add_argument("--steady-warmup-requests", type=non_negative_int, default=200, help="requests before measuring (200)")
    group.add_argument("--steady-max-cv", type=positive_float, default=0.1, help="stability threshold (0.1)")
    group.add_argument("--slo-p99-ms", type=positive_float, default=None,
                       help="profile when a method's windowed p99 stays above this many ms (off by default)")
    group.add_argument("--slo-window-ms", type=positive_int, default=1000, help="SLO window (1000 ms)")
    group.add_argument("--slo-sustain-windows", type=positive_int, default=3, help="violating windows in a row (3)")
    group.add_argument("--slo-cooldown-s", type=non_negative_float, default=300.0, help="quiet time after an SLO session (300 s)")
    group.add_argument("--trigger-requests", type=int_between(1, MAX_REQUESTS_CAP), default=100,
                       help=f"requests covered by an automatic session (100; at most {MAX_REQUESTS_CAP})")
    group.add_argument("--profile-over-ms", type=positive_float, default=None,
                       help="capture the next request slower than this many ms: a session stays armed until one is "
                       "(off by default)")
    group.add_argument("--profile-over-window-ms", type=positive_int, default=10_000,
                       help="length of one armed session of --profile-over-ms (10000 ms)")
    group.add_argument("--profile-over-attempts", type=positive_int, default=6,
                       help="armed sessions before --profile-over-ms gives up (6)")


@dataclass
class ServerProfiling:
    """The controller and admin settings of one server process."""

    controller: Any
    admin: AdminConfig
    admin_server: Any = None
    request_profiler: Any = None

    @staticmethod
    def configs(args: argparse.Namespace) -> tuple[ProfilerConfig, AdminConfig, Any]:
        """The controller's, the admin service's and on-request profiling's settings from parsed
        :func:`add_profiling_options` options and the environment, checked; nothing starts.

        Raises ConfigError on a bad value (the message names it)."""
        from zoomer_serve.profiling.on_request import RequestProfilingConfig

        session = SessionOptions(max_requests=args.trigger_requests)
        overrides: dict[str, Any] = {}
        if args.profiles_dir is not None:
            overrides["profiles_dir"] = args.profiles_dir
        if args.steady_state:
            overrides["steady_state"] = SteadyStateConfig(warmup_requests=args.steady_warmup_requests,
                                                          max_cv=args.steady_max_cv, session=session)
        if args.slo_p99_ms is not None:
            overrides["latency_slo"] = LatencySloConfig(
                p99_ms=args.slo_p99_ms, window_ms=args.slo_window_ms, sustain_windows=args.slo_sustain_windows,
                cooldown_ms=int(args.slo_cooldown_s * 1000), session=session)
        admin = AdminConfig.from_env(open_loopback=True if args.admin_open_loopback else None)
        on_request = RequestProfilingConfig(threshold_ms=args.profile_over_ms,
                                            threshold_window_ms=args.profile_over_window_ms,
                                            threshold_attempts=args.profile_over_attempts)
        profiler = ProfilerConfig.from_env(**overrides)
        from zoomer_serve.artifacts import ArtifactsConfig

        ArtifactsConfig.from_env(profiler.profiles_dir)  # read again by the controller; a bad one stops us now
        return profiler, admin, on_request

    @classmethod
    def from_args(cls, args: argparse.Namespace, telemetry: Any = None) -> ServerProfiling:
        """Build and attach the controller from parsed :func:`add_profiling_options` options.

        Raises ConfigError on a bad value (the message names it)."""
        from zoomer_serve.profiling.controller import ProfilerController
        from zoomer_serve.profiling.on_request import RequestProfiler

        profiler, admin, on_request = cls.configs(args)
        controller = ProfilerController(profiler, telemetry).attach()
        return cls(controller, admin, request_profiler=RequestProfiler(controller, admin, on_request).attach())

    def mount(self, server: Any) -> None:
        """Register the admin service on a sync ``grpc.Server`` (an ``extra_servicers`` entry)."""
        from zoomer_serve.profiling.admin import add_profiler_control

        add_profiler_control(server, self.controller, self.admin)

    def serve_own_port(self, port: int = 0) -> int:
        """Run the admin service on its own loopback port; returns it."""
        from zoomer_serve.profiling.admin import serve_profiler_control

        self.admin_server, bound = serve_profiler_control(self.controller, port, self.admin)
        return bound

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the triggers, finish an active session (its trace is written), stop the admin server."""
        if self.request_profiler is not None:
            self.request_profiler.close()
        self.controller.close(timeout_s)
        if self.admin_server is not None:
            self.admin_server.stop(None)
