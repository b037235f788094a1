"""The locust plugin (imports locust: from a locustfile only). Import it at the top of a locustfile::

    from zoomer_serve.loadtest.plugin import GrpcUser, ThriftUser

On import it initialises grpcio's gevent integration (case C11, :mod:`zoomer_serve.loadtest.gevent_grpc`) and
adds the ``--zoomer-*`` options to locust's command line (:mod:`zoomer_serve.loadtest.config`). When locust
starts (its ``init`` event) every process configures zoomer-serve telemetry from the environment (the users'
CLIENT spans) and the deciding process (a single process or the master) attaches the steady-state profiling
trigger (:mod:`zoomer_serve.loadtest.trigger`) and the run's checks (:mod:`zoomer_serve.loadtest.distributed`:
a master collects every worker's last report when the test stops, and the deciding process exits 1 when a
worker failed or no request was sent). At the end (locust's ``quit`` event, after its own tables) that
process prints one summary (:mod:`zoomer_serve.loadtest.summary`) and writes it to ``--zoomer-summary-json``;
every process flushes its telemetry.

Distributed mode: load the same locustfile in the master and every worker. locust sends the master's parsed
options (the ``--zoomer-*`` ones included) to the workers with each spawn message, and names the user
classes each worker runs, so options and user classes are chosen on the master only.

Library mode (an Environment built in code): call :func:`install` after creating the runner, run the test,
stop the runner, then :meth:`LoadTestPlugin.finish`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import gevent
from locust import events

from zoomer_serve.config import ConfigError
from zoomer_serve.loadtest.config import LoadTestOptions, add_arguments
from zoomer_serve.loadtest.distributed import RunCheck
from zoomer_serve.loadtest.summary import (
    LoadTestSummary,
    client_stats,
    profile_summary,
    render_summary,
    with_store,
)
from zoomer_serve.loadtest.trigger import SteadyStateProfiler, decides
from zoomer_serve.loadtest.users import (
    TRACE_ID,
    GrpcStatusError,
    GrpcUser,
    MeasuredChannel,
    ThriftCallError,
    ThriftUser,
)

logger = logging.getLogger("zoomer_serve.loadtest")
DEFAULT_SERVICE_NAME = "zoomer-loadtest"
"""``service.name`` of the load generator's spans unless the environment names one."""
_telemetry_configured = False

__all__ = ["DEFAULT_SERVICE_NAME", "TRACE_ID", "GrpcStatusError", "GrpcUser", "LoadTestPlugin", "MeasuredChannel", "ThriftCallError",
           "ThriftUser", "configure_client_telemetry", "install"]


class LoadTestPlugin:
    """The plugin in one locust process: the trigger (deciding process only) and the end-of-run summary."""

    def __init__(self, environment: Any, options: LoadTestOptions, client_factory: Any = None) -> None:
        self.environment = environment
        self.options = options
        self.deciding = decides(environment.runner)
        self.trigger = SteadyStateProfiler(environment, options, client_factory)
        self.trigger.attach()
        self.check = RunCheck(environment).attach()
        self.summary: LoadTestSummary | None = None

    def finish(self) -> LoadTestSummary | None:
        """Once the test stopped (deciding process): wait for the profile (up to ``stop_wait_s``), build the
        summary (with the store when ``options.store`` is given), write ``options.summary_json``. Returns it;
        None in a worker. Idempotent."""
        if not self.deciding:
            return None
        if self.summary is not None:
            return self.summary
        record = self.trigger.finish()
        profile = profile_summary(record.to_dict(), self.options.profiles_dir, self.options.top_kernels) \
            if self.options.profile else None
        summary = LoadTestSummary(client=client_stats(self.environment.stats), profile=profile)
        if self.options.store is not None:
            summary = with_store(summary, self.options.store)
        if self.options.summary_json is not None:
            summary.write_json(self.options.summary_json)
        self.summary = summary
        return summary


def install(environment: Any, options: LoadTestOptions | None = None, *, client_factory: Any = None
            ) -> LoadTestPlugin:
    """Attach the plugin to ``environment`` (its runner must exist); in a process that runs users (not a
    master), first :func:`configure_client_telemetry`. ``client_factory(target)`` replaces the
    ProfilerControl client (tests)."""
    from locust.runners import MasterRunner

    if not isinstance(environment.runner, MasterRunner):
        configure_client_telemetry()
    plugin = LoadTestPlugin(environment, options or LoadTestOptions(), client_factory)
    # gevent's libev loop caches "now" from when it last ran, which may be when locust imported gevent:
    # seconds of locustfile imports (torch, for the demo's requests) and of this set-up would make the next
    # timers (locust's --run-time, armed right after its init event; a gevent.sleep) fire that much too early.
    gevent.get_hub().loop.update_now()
    return plugin


def configure_client_telemetry() -> None:
    """Configure this process's zoomer-serve telemetry once (replacing any configured before): from the
    ``OTEL_*`` / ``ZOOMER_*`` variables (where the users' CLIENT spans go), with GPU telemetry off (a load
    generator runs no GPU work), no per-request CPU time under gevent (said once, at debug level: greenlets
    share OS threads, so a thread's CPU clock cannot be split per request) and service name :data:`DEFAULT_SERVICE_NAME` unless ``OTEL_SERVICE_NAME``
    or ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` names one."""
    global _telemetry_configured
    if _telemetry_configured:
        return
    import dataclasses
    import os

    from zoomer_serve.config import ZoomerConfig
    from zoomer_serve.host.telemetry import gevent_patched_threads
    from zoomer_serve.runtime import configure

    cfg = ZoomerConfig.from_env()
    named = bool(os.environ.get("OTEL_SERVICE_NAME")) or "service.name" in cfg.resource_attributes
    host = cfg.host
    if host.request_cpu_time and gevent_patched_threads():
        logger.debug("zoomer-serve: locust's users are greenlets on shared OS threads (gevent), so their CLIENT "
                     "spans carry no per-request CPU time; the server's spans do")
        host = dataclasses.replace(host, request_cpu_time=False)
    configure(config=dataclasses.replace(cfg, gpu=dataclasses.replace(cfg.gpu, mode="off"), host=host,
                                         service_name=cfg.service_name if named else DEFAULT_SERVICE_NAME))
    _telemetry_configured = True


def wide_console() -> Any:
    """Where the summary is printed: rich tables on stdout, as wide as their widest row when the output is
    not a terminal (logs, pipes, CI), so that no name is cut (:class:`~zoomer_serve.cli_output.TableOutput`)."""
    from zoomer_serve.cli_output import TableOutput

    return TableOutput("table")


@events.init_command_line_parser.add_listener
def _add_options(parser: Any, **_: Any) -> None:
    add_arguments(parser)
    parser.add_argument("--zoomer-quiet", action="store_true", default=False, include_in_web_ui=False,
                        help="do not print the zoomer summary at the end (still written to --zoomer-summary-json)")


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    parsed = environment.parsed_options
    if parsed is None or not hasattr(parsed, "zoomer_warmup_s"):
        return  # library mode: the caller installs the plugin
    try:
        options = LoadTestOptions.from_namespace(parsed)
    except ConfigError as exc:
        logger.error("zoomer-serve loadtest: %s", exc)
        sys.exit(2)
    plugin = install(environment, options)
    quiet = bool(getattr(parsed, "zoomer_quiet", False))

    def on_quit(**_: Any) -> None:
        try:
            summary = plugin.finish()
            if summary is not None and not quiet:
                render_summary(summary, wide_console())
        finally:
            from zoomer_serve.runtime import shutdown

            shutdown()

    environment.events.quit.add_listener(on_quit)
