"""``zoomer-serve profile start|stop|status --target HOST:PORT``: drive the ProfilerControl admin service of a
running server. The token comes from ``ZOOMER_ADMIN_TOKEN``. Exit status 0 when the call was answered (also
for ``not running``), 1 when it was refused or failed, or a session it waited for failed; 3
(:data:`EXIT_ALREADY_RUNNING`) when ``start`` found a session already running (the reply is printed as usual;
nothing was started). When a session finished with a trace (``stop``, also of a session that ended on its own
before it, ``start --wait``), the files it wrote and the ``zoomer-serve analyze`` command to run on them are
printed after it (``files`` and ``next`` with ``--json``)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
from typing import Any

from zoomer_serve.cli_types import host_port, non_negative_float, positive_float, positive_uint32

DEFAULT_STOP_WAIT_S = 60.0
EXIT_ALREADY_RUNNING = 3
"""``profile start``'s exit code when a session was already running (so scripts can tell it from a start)."""


def register(subparsers: Any) -> None:
    profile = subparsers.add_parser(
        "profile", help="start, stop or inspect a kernel profiling session of a running server",
        description="Control torch.profiler sessions of a server that hosts the ProfilerControl admin service "
        "(zoomer-serve serve-demo does). The shared token is read from ZOOMER_ADMIN_TOKEN.")
    sub = profile.add_subparsers(dest="profile_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", required=True, type=host_port, help="the server's admin address, HOST:PORT")
    common.add_argument("--timeout-s", type=positive_float, default=30.0, help="deadline of each call (default 30 s)")
    common.add_argument("--json", action="store_true", help="print the reply as JSON")

    start = sub.add_parser(
        "start", parents=[common], help="start a session",
        description=f"Start a profiling session. Exit code 0 when it started, {EXIT_ALREADY_RUNNING} when a session "
        "was already running (nothing started; the running session is printed), 1 when the call was refused or "
        "failed (or, with --wait, the session failed).")
    start.add_argument("--requests", type=positive_uint32, default=None, help="requests to cover (default 100 when "
                       "--duration-ms is not given either; hard cap 1000)")
    start.add_argument("--duration-ms", type=positive_uint32, default=None, help="session length in ms (hard cap 60000)")
    start.add_argument("--cuda", choices=("auto", "on", "off"), default="auto",
                       help="capture CUDA kernels (auto: when the server has CUDA)")
    for flag in ("record-shapes", "profile-memory", "with-stack", "with-flops"):
        start.add_argument(f"--{flag}", action="store_true", help=f"torch.profiler {flag.replace('-', '_')}")
    start.add_argument("--trigger", default="on_demand", help="label of who asked (default on_demand)")
    start.add_argument("--wait", action="store_true", help="wait for the session to end and its trace")
    start.set_defaults(func=run_start)

    stop = sub.add_parser("stop", parents=[common], help="stop the active session and wait for its trace")
    stop.add_argument("--wait-s", type=non_negative_float, default=DEFAULT_STOP_WAIT_S,
                      help=f"how long to wait for the trace (default {DEFAULT_STOP_WAIT_S:g} s; 0: do not wait)")
    stop.set_defaults(func=run_stop)

    status = sub.add_parser("status", parents=[common], help="show the state, active and last session")
    status.set_defaults(func=run_status)


def _client(args: argparse.Namespace) -> Any:
    from zoomer_serve.config import ConfigError
    from zoomer_serve.profiling.client import ProfilerClient

    try:
        return ProfilerClient(args.target, timeout_s=args.timeout_s)
    except ConfigError as exc:
        _fail(str(exc))
        raise SystemExit(2) from None


def run_start(args: argparse.Namespace) -> int:
    from zoomer_serve.profiling.client import ProfilerControlError
    from zoomer_serve.profiling.session import Result

    cuda = {"auto": None, "on": True, "off": False}[args.cuda]
    with _client(args) as client:
        try:
            reply = client.start(args.requests, args.duration_ms, cuda=cuda, record_shapes=args.record_shapes,
                                 profile_memory=args.profile_memory, with_stack=args.with_stack,
                                 with_flops=args.with_flops, trigger=args.trigger)
            if args.wait and reply.result is Result.STARTED and reply.session is not None:
                budget = reply.session.duration_ms / 1000 + DEFAULT_STOP_WAIT_S
                finished = client.wait_finished(reply.session.number, budget)
                if finished is None:
                    return _fail(f"session {reply.session.session_id} did not finish within {budget:g} s")
                reply = dataclasses.replace(reply, session=finished, message=_finished_line(finished))
        except ProfilerControlError as exc:
            return _fail(str(exc))
    code = _print(reply, args.json)
    return EXIT_ALREADY_RUNNING if reply.result is Result.ALREADY_RUNNING else code


def run_stop(args: argparse.Namespace) -> int:
    from zoomer_serve.profiling.client import ProfilerControlError
    from zoomer_serve.profiling.session import Result

    with _client(args) as client:
        try:
            reply = client.stop(wait_s=min(args.wait_s, 120.0))
            unfinished = reply.session is not None and reply.session.outcome is None
            if reply.result in (Result.STOPPING, Result.ALREADY_STOPPING) and unfinished and args.wait_s > 120.0:
                finished = client.wait_finished(reply.session.number, args.wait_s - 120.0)
                if finished is not None:
                    reply = dataclasses.replace(reply, session=finished, message=_finished_line(finished))
                    if reply.result is Result.STOPPING:
                        reply = dataclasses.replace(reply, result=Result.STOPPED)
        except ProfilerControlError as exc:
            return _fail(str(exc))
    if reply.result is Result.STOPPED and reply.session is not None:
        reply = dataclasses.replace(reply, message=_finished_line(reply.session))
    return _print(reply, args.json, last_too=True)


def run_status(args: argparse.Namespace) -> int:
    from zoomer_serve.profiling.client import ProfilerControlError

    with _client(args) as client:
        try:
            reply = client.status()
        except ProfilerControlError as exc:
            return _fail(str(exc))
    return _print(reply, args.json)


def _finished_line(info: Any) -> str:
    if info.outcome == "done":
        return f"session {info.session_id} done: {info.requests} requests, trace {info.trace_path}"
    return f"session {info.session_id} failed: {info.error}"


def _fail(message: str) -> int:
    print(f"zoomer-serve profile: {message}", file=sys.stderr)
    return 1


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def session_files(info: Any) -> list[str]:
    """The files a finished session wrote, as the server names them: the gzip Chrome trace, the per-request
    summary beside it (``<session_id>.summary.json``), and, when that folder is readable here, any other
    ``<session_id>.*`` file in it. Empty when the session wrote no trace."""
    from pathlib import Path

    from zoomer_serve.artifacts.session import SUMMARY_SUFFIX

    if not info.trace_path:
        return []
    trace = Path(info.trace_path)
    files = [trace, trace.with_name(info.session_id + SUMMARY_SUFFIX)]
    try:
        files += sorted(p for p in trace.parent.glob(f"{info.session_id}.*") if p not in files)
    except OSError:
        pass
    return [str(f) for f in files]


def analyze_command(info: Any) -> str | None:
    """The ``zoomer-serve analyze`` command line for a finished session's trace (None without one)."""
    import shlex

    if not info.trace_path:
        return None
    return f"zoomer-serve analyze {shlex.quote(info.trace_path)}"


def _next_steps(reply: Any, last_too: bool = False) -> tuple[list[str], str | None]:
    """The files and the analyze command of the reply's session; with ``last_too``, of the last session when no
    session is running (a ``stop`` after the session ended on its own)."""
    info = reply.session if reply.session is not None or not last_too else reply.last
    if info is None or info.outcome != "done":
        return [], None
    return session_files(info), analyze_command(info)


def _print(reply: Any, as_json: bool, last_too: bool = False) -> int:
    files, command = _next_steps(reply, last_too)
    if as_json:
        out = _plain(reply)
        if files:
            out |= {"files": files, "next": command}
        print(json.dumps(out, indent=2))
    else:
        print(reply.message)
        for label, info in (("session", reply.session), ("last", reply.last)):
            if info is not None and (label == "session" or reply.session is None
                                     or info.number != reply.session.number):
                print(f"  {label}: #{info.number} {info.trigger} {info.state.value}"
                      f"{' ' + info.outcome if info.outcome else ''}, {info.requests}/{info.max_requests} requests"
                      f"{', trace ' + info.trace_path if info.trace_path else ''}"
                      f"{', error: ' + info.error if info.error else ''}")
        if files:
            print("  files (on the server):")
            for path in files:
                print(f"    {path}")
            print(f"  next: {command}   (add --store STORE for the requests, --html report.html for the HTML "
                  "report)")
    failed = reply.session is not None and reply.session.outcome == "failed"
    return 1 if failed else 0
