"""``zoomer-serve loadtest``: run the Ranker locustfile headless against a target for a given time and number of
users, then print locust's summary, the profile summary and the server-side latency report.

Two modes:

- ``--host HOST:PORT``: load a server that runs already. Profiling goes to its ProfilerControl (``--target``,
  default the host; token from ``ZOOMER_ADMIN_TOKEN``); the server side is read from ``--store`` at the end
  if given (the collector writing it must have stopped by then). Before any load, a preflight checks that the
  host answers (a TCP connect; for gRPC also a channel that becomes ready) and so does ``--target`` when given
  (gRPC), each within :data:`PREFLIGHT_TIMEOUT_S`; if not, the command stops at once (exit 1) naming it.
- no ``--host``: the whole flow on this machine, like ``zoomer-serve demo``: an embedded collector, the demo
  model server (``serve-demo`` with a one-run admin token), the load, a clean stop of both, the report.
  ``--target`` is refused here (exit 2): the demo is profiled on its own admin port.

locust runs in a subprocess (``python -m locust``, by way of :data:`zoomer_serve.processes.LOCUST_BOOT`), so
this command never imports locust or gevent (whose monkeypatching would affect every other command). Exit code 0 when locust exited 0, the profile (unless
``--no-profile``) produced a trace and, in the self-contained mode, the server and collector stopped cleanly;
else 1; 2 for bad options.

Ctrl+C (SIGINT to the process group) or SIGTERM: locust, the collector and the server run in process groups of
their own and do not get the terminal's Ctrl+C; this command SIGTERMs locust (it stops its users and writes its
summary), then stops the server (it flushes its telemetry into the collector still running), then the collector,
prints the summary of what ran and exits 128 + the signal's number (130, 143). If it is killed (SIGKILL), its
children get SIGTERM on Linux (:func:`zoomer_serve.processes.child_popen_kwargs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zoomer_serve.cli_output import TableOutput, add_format_option
from zoomer_serve.cli_types import positive_float, positive_int
from zoomer_serve.config import ConfigError
from zoomer_serve.loadtest.config import (
    TRANSPORT_ENV,
    TRANSPORTS,
    LoadTestOptions,
    add_arguments,
    grpc_target,
    to_locust_args,
)
from zoomer_serve.processes import (
    LOCUST_BOOT,
    SignalStop,
    StopRequested,
    child_popen_kwargs,
    start_zoomer_command,
    stop_process,
)

DEFAULT_LOCUSTFILE = Path(__file__).with_name("ranker_users.py")
PREFLIGHT_TIMEOUT_S = 5.0
"""How long the preflight waits for each address to answer (the TCP connect, then the gRPC channel), s."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``loadtest`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "loadtest", help="locust load test of the demo Ranker with profiling at steady state, then one summary",
        description="Run locust headless (benchmarks/locustfile.py's users) against --host, or against a demo "
        "server started here when --host is not given; profile once the load is steady; print locust's "
        "summary, the profile and the server-side latency report.")
    p.add_argument("--host", default=None, help="HOST:PORT of a running server (default: start the demo here)")
    p.add_argument("--transport", choices=TRANSPORTS, default=os.environ.get(TRANSPORT_ENV, "").strip() or "grpc",
                   help=f"Ranker transport (default ${TRANSPORT_ENV}, else grpc)")
    p.add_argument("--server", choices=("sync", "aio"), default="sync",
                   help="the demo server's flavour when it is started here (default sync)")
    p.add_argument("--users", type=positive_int, default=8, help="locust users (default 8)")
    p.add_argument("--spawn-rate", type=positive_float, default=None, help="users started per second (default: all at once)")
    p.add_argument("--run-time", type=positive_int, default=30, help="seconds of load (default 30)")
    p.add_argument("--locustfile", type=Path, default=DEFAULT_LOCUSTFILE,
                   help="locustfile (default: the packaged Ranker users, as in benchmarks/locustfile.py)")
    p.add_argument("--json", action="store_true",
                   help="print the summary as JSON (locust's output goes to stderr; --format json prints the "
                   "tables as shown); overrides --format")
    add_format_option(p)
    add_arguments(p, prefix="--")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        if args.transport not in TRANSPORTS:  # argparse does not check a default against the choices
            raise ConfigError(f"{TRANSPORT_ENV}={args.transport!r} must be one of {', '.join(TRANSPORTS)}")
        options = LoadTestOptions.from_namespace(args)
        if args.host is not None:
            grpc_target(args.host)
        elif options.target is not None:
            raise ConfigError(f"--target {options.target} (or ZOOMER_LOADTEST_TARGET) names the ProfilerControl of a "
                              "server given with --host; without --host the demo server started here is profiled "
                              "on its own admin port. Give --host too, or drop --target")
    except ConfigError as exc:  # LoadTestOptions names locust's options (--zoomer-X): here they are --X
        print(f"zoomer-serve loadtest: {str(exc).replace('--zoomer-', '--')}", file=sys.stderr)
        return 2
    if not args.locustfile.is_file():
        what = (f"--locustfile {args.locustfile} is a folder, not a locustfile" if args.locustfile.is_dir()
                else f"locustfile not found: {args.locustfile}")
        print(f"zoomer-serve loadtest: {what}", file=sys.stderr)
        return 2
    if args.host is not None:
        problem = _preflight(args.host, args.transport, options)
        if problem is not None:
            end = "" if problem.endswith((".", "?")) else "."  # "running there?" takes no period after it
            print(f"zoomer-serve loadtest: {problem}{end} No load was run.", file=sys.stderr)
            return 1
    # Ctrl+C (SIGINT to the process group: locust, the server and the collector run in groups of their own and
    # do not get it) or SIGTERM: locust stops its users and writes its summary, then the server stops (it
    # flushes into the collector still running), then the collector; the summary of what ran is printed
    with SignalStop("zoomer-serve loadtest") as stopping, \
            tempfile.TemporaryDirectory(prefix="zoomer-loadtest-") as tmp:
        plugin_json = Path(tmp) / "summary.json"
        if args.host is not None:
            return _run_against(args, options, args.host, dict(os.environ), plugin_json, [], stopping)
        return _run_demo(args, options, plugin_json, stopping)


# -- preflight -----------------------------------------------------------------------------------------------
def _preflight(host: str, transport: str, options: LoadTestOptions) -> str | None:
    """Why the run cannot work (``--host`` or the profiling ``--target`` does not answer), or None."""
    problem = check_answers(grpc_target(host), transport)
    if problem is not None:
        return f"--host {problem}; is the {transport} server running there?"
    if options.profile and options.target is not None and options.target != host:
        problem = check_answers(grpc_target(options.target, "--target"), "grpc")
        if problem is not None:
            return f"--target {problem}; is the server's ProfilerControl there? (--no-profile runs without it)"
    return None


def check_answers(address: str, protocol: str, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> str | None:
    """Whether a server answers at ``address`` (``host:port``, ``[v6]:port``): a TCP connect and, for
    ``protocol`` ``"grpc"``, a gRPC channel that becomes ready (``grpc.channel_ready_future``), each within
    ``timeout_s`` seconds. Returns None when it answers, else the reason, starting with the address and
    saying what was tried."""
    name, _, port = address.rpartition(":")
    try:
        socket.create_connection((name.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return f"{address}: TCP connect failed ({exc.strerror or exc})"
    if protocol != "grpc":
        return None
    import grpc

    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return (f"{address}: TCP connect succeeded, but no gRPC channel became ready within {timeout_s:g} s "
                    "(not a gRPC server, or one that needs TLS)")
    return None


# -- processes -----------------------------------------------------------------------------------------------
def _run_demo(args: argparse.Namespace, options: LoadTestOptions, plugin_json: Path, stopping: SignalStop) -> int:
    data = Path("zoomer-data")
    store = (options.store or data / time.strftime("loadtest-%Y%m%d-%H%M%S.duckdb")).resolve()
    profiles = (options.profiles_dir or data / "profiles").resolve()
    store.parent.mkdir(parents=True, exist_ok=True)
    note = None
    if options.profile and args.transport == "thrift" and args.server == "sync":
        note = ("serve-demo --transport thrift --server sync serves no ProfilerControl; use --server aio to "
                "profile over Thrift. Running without profiling.")
        options = dataclasses.replace(options, profile=False)
    options = dataclasses.replace(options, store=store, profiles_dir=profiles)
    env = dict(os.environ, ZOOMER_ADMIN_TOKEN=os.environ.get("ZOOMER_ADMIN_TOKEN") or secrets.token_urlsafe(24))
    procs: list[subprocess.Popen[bytes]] = []
    say = _say(_machine_readable(args))
    try:
        collector, col = start_zoomer_command(
            ["collector", "--store", str(store), "--grpc-port", "0", "--http-port", "0"], env, "embedded collector",
            stop=stopping.event)
        procs.append(collector)
        endpoint = f"http://127.0.0.1:{col['grpc_port']}"
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                   OTEL_BSP_SCHEDULE_DELAY="500")
        server, srv = start_zoomer_command(
            ["serve-demo", "--port", "0", "--transport", args.transport, "--server", args.server,
             "--profiles-dir", str(profiles)], dict(env, OTEL_SERVICE_NAME="zoomer-demo-ranker"), "demo model server",
            stop=stopping.event)
        procs.append(server)
        host = f"127.0.0.1:{srv['port']}"
        options = dataclasses.replace(options, target=f"127.0.0.1:{srv['admin_port']}")
        say(f"zoomer-serve loadtest: collector on 127.0.0.1:{col['grpc_port']} (store {store}), demo Ranker "
            f"({args.transport}, {args.server}) on {host}")
        if note:
            say(f"zoomer-serve loadtest: {note}")
        if stopping.stopped:
            raise StopRequested("stopped before the load started")
        return _run_against(args, options, host, env, plugin_json, procs, stopping)
    except StopRequested:
        print(f"zoomer-serve loadtest: stopped ({stopping.signal_name}) "
              "before any load was run", file=sys.stderr)
        return stopping.exit_code
    except RuntimeError as exc:
        print(f"zoomer-serve loadtest: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in reversed(procs):  # what still runs: the server, then the collector (killed after a timeout)
            stop_process(proc, 60)


def _machine_readable(args: argparse.Namespace) -> bool:
    """Whether stdout holds only the results (--json, --format markdown / csv / json): then locust's output
    and our progress lines go to stderr."""
    return bool(args.json) or getattr(args, "format", "table") != "table"


def _say(json_mode: bool) -> Any:
    def say(text: str) -> None:
        print(text, file=sys.stderr if json_mode else sys.stdout, flush=True)

    return say


def locust_command(args: argparse.Namespace, options: LoadTestOptions, host: str, plugin_json: Path) -> list[str]:
    """The ``python -m locust`` command line of a run (:data:`~zoomer_serve.processes.LOCUST_BOOT`)."""
    spawn_rate = args.spawn_rate if args.spawn_rate is not None else float(args.users)
    plugin_options = dataclasses.replace(options, store=None, summary_json=plugin_json)
    argv = [sys.executable, "-c", LOCUST_BOOT, "-f", str(args.locustfile), "--headless", "--host", host,
            "--users", str(args.users), "--spawn-rate", f"{spawn_rate:g}", "--run-time", f"{args.run_time}s",
            "--only-summary", "--stop-timeout", "10", "--zoomer-quiet",
            # locust would exit 1 for one call cut off by its own stop: the run fails only for more failed
            # requests than users (_failed_past_the_stop)
            "--exit-code-on-error", "0", *to_locust_args(plugin_options)]
    if args.locustfile.resolve() == DEFAULT_LOCUSTFILE.resolve():
        argv += ["--zoomer-transport", args.transport]
    return argv


def _run_against(args: argparse.Namespace, options: LoadTestOptions, host: str, env: dict[str, str],
                 plugin_json: Path, procs: list[subprocess.Popen[bytes]], stopping: SignalStop) -> int:
    """Run locust, stop the processes this command started (``procs``: server, then collector), read the
    store, print everything; the exit code (128 + the signal's number when ``stopping`` got one: locust
    was stopped early with SIGTERM, which stops its users and writes its summary)."""
    locust_rc = _run_locust(locust_command(args, options, host, plugin_json), env, _machine_readable(args),
                            args.run_time + options.stop_wait_s + 120, stopping)
    stopped_ok = True
    for proc in reversed(procs):  # the server first (a session still running is finished), then the collector
        stopped_ok = stop_process(proc, 60) == 0 and stopped_ok
    procs.clear()
    if not plugin_json.is_file():
        print(f"zoomer-serve loadtest: locust wrote no summary (exit code {locust_rc})", file=sys.stderr)
        return stopping.exit_code or 1
    from zoomer_serve.loadtest.summary import LoadTestSummary, with_store

    summary = LoadTestSummary.read_json(plugin_json)
    if options.store is not None:
        summary = with_store(summary, options.store)
    if options.summary_json is not None:
        summary.write_json(options.summary_json)
    _print(summary, options, args.json, getattr(args, "format", "table"))
    profile_ok = not options.profile or (summary.profile is not None and summary.profile.ok)
    if stopping.stopped:
        print(f"zoomer-serve loadtest: stopped early by {stopping.signal_name}: "
              "the summary covers the load sent until then", file=sys.stderr)
        return stopping.exit_code
    failed = _failed_past_the_stop(summary, args.users)
    if failed is not None:
        print(f"zoomer-serve loadtest: {failed}", file=sys.stderr)
    return 0 if locust_rc == 0 and profile_ok and stopped_ok and failed is None else 1


def _failed_past_the_stop(summary: Any, users: int) -> str | None:
    """Why the run failed by its requests, or None: more failed requests than ``users``, the most that locust's
    own stop can cut off (one call in flight per user, which locust counts as failed and ``--exit-code-on-error 0``
    lets pass)."""
    total = summary.client[-1] if summary.client else None
    if total is None or total.failures <= users:
        return None
    return (f"{total.failures} of {total.count} requests failed, more than the {users} that the stop can cut off "
            "(one per user): see the failures in the table")


def _run_locust(argv: list[str], env: dict[str, str], to_stderr: bool, limit_s: float, stopping: SignalStop) -> int:
    """Run locust in a process group of its own until it exits: SIGTERM it once ``stopping`` is set (locust
    then stops its users, within its ``--stop-timeout``, and writes its summary), kill it after ``limit_s``
    seconds. Its exit code (-1 when killed for the time limit)."""
    proc = subprocess.Popen(argv, stdout=sys.stderr if to_stderr else None, **child_popen_kwargs(env))
    deadline = time.monotonic() + limit_s
    signalled = False
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if stopping.stopped and not signalled:
            proc.send_signal(signal.SIGTERM)
            signalled = True
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            print(f"zoomer-serve loadtest: locust did not end within {limit_s:g} s; killed", file=sys.stderr)
            return -1


def _print(summary: Any, options: LoadTestOptions, as_json: bool, format: str = "table") -> None:
    if as_json:
        sys.stdout.write(json.dumps(summary.to_dict(), indent=2) + "\n")
        sys.stdout.flush()
        return
    from rich.text import Text

    from zoomer_serve.loadtest.summary import render_summary

    out = TableOutput(format)
    render_summary(summary, out)
    if options.store is not None and summary.server is not None:
        from zoomer_serve.report import build_report, render_report
        from zoomer_serve.report.render import next_steps

        out.print()
        render_report(build_report(options.store), out)
        for line in next_steps(str(options.store)):
            out.print(Text(line))
    out.close()
