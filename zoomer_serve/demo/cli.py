"""``zoomer-serve serve-demo`` (the demo model server alone) and ``zoomer-serve demo`` (the whole flow:
embedded collector + instrumented model server + load + report, on one machine, nothing else to start)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zoomer_serve.cli_output import TableOutput, add_format_option
from zoomer_serve.cli_paths import same_file
from zoomer_serve.cli_types import (
    MAX_CLIENT_THREADS,
    client_threads,
    duration_s,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_int,
    torch_threads,
)
from zoomer_serve.config import ConfigError
from zoomer_serve.processes import SignalStop, StopRequested, start_zoomer_command, stop_process
from zoomer_serve.profiling.serving import ServerProfiling, add_profiling_options

SLOW_PREPROCESS_HELP = ("add N iterations of a deliberately slow pure-Python step (hash_ids_slowly) to every "
                        "request's preprocess phase (about 15 ms per 100000 on one core) to demonstrate a "
                        "CPU-bound request (default 0: off)")
DEMO_SERVICE = "zoomer-demo-ranker"
BATCHED_SERVICE_SUFFIX = "-batched"


def _add_batching_options(parser: argparse.ArgumentParser, default_size: int, size_help: str) -> None:
    parser.add_argument("--batch-max-size", type=non_negative_int, default=default_size, metavar="N", help=size_help)
    parser.add_argument("--batch-max-delay-ms", type=non_negative_float, default=2.0, metavar="D",
                        help="longest wait, from the oldest queued request, for a batch to fill (default 2 ms)")


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve-demo", help="serve the demo DLRM ranking model over gRPC with the zoomer interceptor",
        description="Serve the demo Ranker until SIGINT/SIGTERM, exporting wherever the OTEL_* variables "
        "say; then drain in-flight calls and flush telemetry.")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=50051, help="listen port, 0 = any free port (default 50051)")
    serve.add_argument("--server", choices=("sync", "aio"), default="sync",
                       help="grpc.server with a thread pool (sync) or grpc.aio (default sync)")
    serve.add_argument("--transport", choices=("grpc", "thrift"), default="grpc",
                       help="serve the Ranker over gRPC (ranker.proto) or Thrift (ranker.thrift) (default grpc)")
    serve.add_argument("--grace-s", type=non_negative_float, default=5.0,
                       help="seconds to drain in-flight calls on stop (default 5)")
    serve.add_argument("--torch-threads", type=torch_threads, default=1,
                       help="torch intra-op threads (default 1: the gRPC worker threads already run in parallel)")
    serve.add_argument("--slow-preprocess", type=non_negative_int, default=0, metavar="N",
                       help=SLOW_PREPROCESS_HELP)
    _add_batching_options(serve, 0, "run forward passes through a dynamic batcher of at most N requests, recorded "
                          "with zoomer_serve.batching (default 0: one forward pass per request)")
    add_profiling_options(serve)
    serve.set_defaults(func=run_serve_demo)

    demo = subparsers.add_parser(
        "demo", help="run the whole flow on the demo model: collector, server, load, report",
        description="Start the embedded collector and the instrumented demo model server, drive real load "
        "(unary and streaming, a few invalid requests) for a bounded time, shut down cleanly, print the report.")
    demo.add_argument("--store", type=Path, default=None,
                      help="DuckDB store to write, a new file (default: zoomer-data/demo-<time>-<pid>.duckdb)")
    demo.add_argument("--duration-s", type=duration_s, default=20.0, help="how long to send load (default 20 s)")
    demo.add_argument("--clients", type=client_threads, default=4,
                      help=f"concurrent client threads, at most {MAX_CLIENT_THREADS} (default 4)")
    demo.add_argument("--max-requests", type=positive_int, default=None, help="stop after this many calls")
    demo.add_argument("--server", choices=("sync", "aio"), default="sync", help="gRPC server flavour (default sync)")
    demo.add_argument("--transport", choices=("grpc", "thrift"), default="grpc",
                      help="gRPC or Thrift between the load and the server (default grpc)")
    demo.add_argument("--slow-preprocess", type=non_negative_int, default=0, metavar="N", help=SLOW_PREPROCESS_HELP)
    demo.add_argument("--html", type=Path, default=None, metavar="FILE",
                      help="where to write the HTML report (default: next to the store, STORE with .html)")
    add_format_option(demo)
    _add_batching_options(demo, 8, "the load runs in two phases of half the time each, against two servers: one "
                          "forward pass per request, then a dynamic batcher of at most N requests (service "
                          f"{DEMO_SERVICE}{BATCHED_SERVICE_SUFFIX}); 0: one phase, no batching (default 8)")
    demo.set_defaults(func=run_demo)


# -- serve-demo -------------------------------------------------------------------------------------------
def run_serve_demo(args: argparse.Namespace) -> int:

    import torch

    from zoomer_serve.demo.service import ServiceConfig

    torch.set_num_threads(max(1, args.torch_threads))
    try:
        config = ServiceConfig(slow_preprocess_iterations=args.slow_preprocess, batch_max_size=args.batch_max_size,
                               batch_max_delay_ms=args.batch_max_delay_ms)
    except ValueError as exc:
        print(f"zoomer-serve serve-demo: {exc}", file=sys.stderr)
        return 2
    with SignalStop("zoomer-serve serve-demo", announce=False) as stopping:  # SIGINT / SIGTERM: drain and stop
        return _serve_demo(args, config, stopping.event)


def _serve_demo(args: argparse.Namespace, config: Any, stop: threading.Event) -> int:
    """serve-demo once its options are read: configure telemetry, build the model, serve until ``stop``, flush;
    the exit code (2 for a bad setting, 1 when the port cannot be bound)."""
    import json

    import zoomer_serve
    from zoomer_serve.demo.model import build_model, pick_device
    from zoomer_serve.demo.service import ServerBindError, check_port_free

    try:
        check_port_free(args.host, args.port)
    except ServerBindError as exc:
        print(f"zoomer-serve serve-demo: {exc}", file=sys.stderr)
        return 1
    try:
        ServerProfiling.configs(args)  # checked before telemetry starts, whose shutdown would flush first
        # configure from OTEL_* / ZOOMER_* before the first request; spans and profiling sessions are named
        # for the service (the demo's name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES gives one)
        zoomer_serve.configure(config=demo_config(args.batch_max_size))
        profiling = ServerProfiling.from_args(args)
    except ConfigError as exc:
        print(f"zoomer-serve serve-demo: {exc}", file=sys.stderr)
        return 2
    device = pick_device()
    model = build_model(device=device)
    # the aio and Thrift demo servers take no extra gRPC services: there the admin service gets its own port
    own_port = args.server == "aio" or args.transport == "thrift"
    admin_port = profiling.serve_own_port() if own_port else None

    def ready(port: int) -> None:
        print(json.dumps({"event": "ready", "host": args.host, "port": port, "device": str(device),
                          "admin_port": admin_port or port, "batch_max_size": args.batch_max_size}), flush=True)

    try:
        if args.transport == "thrift":
            from zoomer_serve.demo.thrift_server import serve_thrift_forever

            serve_thrift_forever(args.host, args.port, stop, model=model, aio=args.server == "aio",
                                 grace_s=args.grace_s, on_ready=ready, config=config)
        elif args.server == "aio":
            from zoomer_serve.demo.aio_server import serve_aio_forever

            serve_aio_forever(args.host, args.port, stop, model=model, grace_s=args.grace_s, on_ready=ready,
                              config=config)
        else:
            _serve_sync(args, model, stop, ready, profiling, config)
    except ServerBindError as exc:
        print(f"zoomer-serve serve-demo: {exc}", file=sys.stderr)
        profiling.close()
        return 1
    profiling.close()  # a session still running writes its trace and spans before telemetry flushes
    stats = zoomer_serve.shutdown()
    print(json.dumps({"event": "stopped", "spans_exported": stats.exported if stats else 0,
                      "spans_dropped": stats.dropped if stats else 0,
                      "spans_unknown": stats.unknown if stats else 0}), flush=True)
    return 0


def demo_service_name(batch_max_size: int) -> str:
    """The demo's service name: :data:`DEMO_SERVICE`, with :data:`BATCHED_SERVICE_SUFFIX` when it batches
    (the names ``zoomer-serve demo`` gives its two servers)."""
    return DEMO_SERVICE + (BATCHED_SERVICE_SUFFIX if batch_max_size else "")


def demo_config(batch_max_size: int) -> Any:
    """The demo server's :class:`~zoomer_serve.config.ZoomerConfig`: from the environment, with the service
    named :func:`demo_service_name` unless ``OTEL_SERVICE_NAME`` or ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES`` names it. Raises ConfigError on a bad variable."""
    import dataclasses

    from zoomer_serve.config import ZoomerConfig

    config = ZoomerConfig.from_env()
    if os.environ.get("OTEL_SERVICE_NAME") or "service.name" in config.resource_attributes:
        return config
    return dataclasses.replace(config, service_name=demo_service_name(batch_max_size))


def _serve_sync(args: argparse.Namespace, model: Any, stop: threading.Event, ready: Any,
                profiling: ServerProfiling, config: Any = None) -> None:
    from interceptors import ZoomerServerInterceptor
    from zoomer_serve.demo.service import build_server

    interceptor = ZoomerServerInterceptor(server_address=args.host, server_port=args.port or None)
    server, port = build_server(model, args.host, args.port, interceptors=[interceptor],
                                extra_servicers=[profiling.mount], config=config)
    interceptor.server_port = port
    ready(port)
    stop.wait()
    server.stop(grace=args.grace_s).wait(args.grace_s + 1)


# -- demo -------------------------------------------------------------------------------------------------
def _default_store() -> Path:
    """A new store's path: the time and this process's id, so that two demos started in one second (two
    terminals, a CI matrix) do not share a store."""
    return Path("zoomer-data") / f"{time.strftime('demo-%Y%m%d-%H%M%S')}-{os.getpid()}.duckdb"


def _phases(args: argparse.Namespace) -> list[tuple[str, int, float, int | None]]:
    """The demo's load phases: ``(service name, batch max size, seconds, most calls)``: one forward pass per
    request, then (unless ``--batch-max-size 0``) the dynamic batcher, each with half the time and of the
    calls (``--max-requests`` in all: the first phase takes an odd one; a phase left with none is dropped)."""
    phases = [(demo_service_name(0), 0)]
    if args.batch_max_size:
        phases.append((demo_service_name(args.batch_max_size), args.batch_max_size))
    share = len(phases)
    if args.max_requests is None:
        return [(name, size, args.duration_s / share, None) for name, size in phases]
    base, extra = divmod(args.max_requests, share)
    calls = [base + (i < extra) for i in range(share)]
    return [(name, size, args.duration_s / share, n) for (name, size), n in zip(phases, calls) if n]


def _say(console: Any, text: str) -> None:
    """One step of the demo as one line: not folded at 80 columns when the output is not a terminal."""
    console.print(text, soft_wrap=not console.is_terminal)


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    fmt = getattr(args, "format", "table")
    # progress and the steps go to stdout with the tables, or to stderr when stdout holds markdown, csv or json
    console = Console(stderr=fmt != "table")
    store = (args.store or _default_store()).resolve()
    html = (args.html or store.with_suffix(".html")).resolve()
    problem = _output_problem(store, html)
    if problem is not None:  # said before the load runs, not after
        print(f"zoomer-serve demo: {problem}", file=sys.stderr)
        return 2
    env, ignored = demo_child_env(os.environ)
    procs: list[subprocess.Popen[bytes]] = []  # running: the collector, then the server of the phase
    results: list[Any] = []
    server_rc = collector_rc = 0
    failed: str | None = None
    # Ctrl+C (SIGINT to the process group: the children run in groups of their own and do not get it) or
    # SIGTERM: stop the load, then the server (it flushes into the collector still running), then the collector
    with SignalStop("zoomer-serve demo") as stopping:
        try:
            _say(console, f"[bold]zoomer-serve demo[/]: store [cyan]{store}[/]")
            if ignored:
                _say(console, f"  ignoring {', '.join(ignored)} from the environment: the demo sends every span to "
                              "its own collector")
            collector, col = start_zoomer_command(
                ["collector", "--store", str(store), "--grpc-port", "0", "--http-port", "0"], env,
                "embedded collector", stop=stopping.event)
            procs.append(collector)
            _say(console, f"  embedded OTLP collector on 127.0.0.1:{col['grpc_port']} (gRPC), "
                          f":{col['http_port']} (HTTP)")
            for service, batch_size, seconds, calls in _phases(args):
                if stopping.stopped:
                    break
                server_env = dict(env, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{col['grpc_port']}",
                                  OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_SERVICE_NAME=service,
                                  OTEL_BSP_SCHEDULE_DELAY="500", OTEL_METRIC_EXPORT_INTERVAL="5000")
                server, srv = start_zoomer_command(
                    ["serve-demo", "--port", "0", "--server", args.server, "--transport", args.transport,
                     "--slow-preprocess", str(args.slow_preprocess), "--batch-max-size", str(batch_size),
                     "--batch-max-delay-ms", str(args.batch_max_delay_ms)], server_env, "demo model server",
                    stop=stopping.event)
                procs.append(server)
                target = f"127.0.0.1:{srv['port']}"
                how = (f"a dynamic batcher of at most {batch_size} requests, {args.batch_max_delay_ms:g} ms"
                       if batch_size else "one forward pass per request")
                _say(console, f"  demo Ranker {service} (DLRM on {srv['device']}, {how}) with the zoomer "
                              f"interceptor on {target}")
                results.append(_drive(console, target, args, seconds, calls, stopping.event))
                server_rc = max(server_rc, _stop_server(console, server))
                procs.remove(server)
        except StopRequested:
            pass
        except RuntimeError as exc:  # a child did not start; it said why on stderr
            failed = str(exc)
        finally:
            # what still runs stops in order, the server before the collector (never killed first: what the
            # server had not flushed would be lost); each is killed only after its stop timeout
            for proc in reversed(procs[1:]):
                server_rc = max(server_rc, _stop_server(console, proc))
            if procs:
                _say(console, "  stopping the collector (flush store)")
                collector_rc = stop_process(procs[0], 30)
            procs.clear()
    if failed is not None:
        _say(console, f"[red]zoomer-serve demo[/]: {failed}")
        return 1
    if stopping.stopped and not results:
        _say(console, f"  stopped ({stopping.signal_name}) before any load was sent")
        return stopping.exit_code
    out = TableOutput(fmt, console=console if fmt == "table" else None)
    return _finish(out, store, html, _merged(results), server_rc, collector_rc, stopping.signum)


_NOT_INHERITED_PREFIXES = ("OTEL_EXPORTER_OTLP_", "ZOOMER_COLLECTOR_")
_NOT_INHERITED = frozenset({
    "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "ZOOMER_EXPORT_MODE",
    "ZOOMER_EXPORT_MAX_REQUEST_BYTES", "ZOOMER_EXCLUDED_METHODS"})


def demo_child_env(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment of the demo's collector and servers: ``environ`` without the variables that would send
    spans elsewhere, sample, drop or exclude them, or make the embedded collector expect a token, TLS or a
    Parquet rotation (every ``OTEL_EXPORTER_OTLP_*`` and ``ZOOMER_COLLECTOR_*`` one, the exporters, the
    sampler, the SDK switch, the queue and batch sizes, ``ZOOMER_EXPORT_MODE``, the excluded methods): the demo
    checks that its store holds one span per call. Also the names left out, sorted, for the demo to say."""
    ignored = sorted(name for name in environ
                     if name in _NOT_INHERITED or name.startswith(_NOT_INHERITED_PREFIXES))
    return {k: v for k, v in environ.items() if k not in ignored}, ignored


def _stop_server(console: Any, server: subprocess.Popen[bytes]) -> int:
    """Stop a phase's demo server (it drains its calls and flushes its telemetry); its exit code."""
    _say(console, "  stopping the server (drain, flush telemetry)")
    return stop_process(server, 30)


def _output_problem(store: Path, html: Path) -> str | None:
    """Why the store or the HTML report cannot be written where asked (their folder cannot be made, the path
    is a folder, the store exists already, they are one file), or None; makes the store's folder."""
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make the store's folder {store.parent}: {exc.strerror or exc}"
    for what, path in (("store", store), ("HTML report", html)):
        if path.is_dir():
            return f"the {what} {path} is a folder; give a file name"
    if store.exists():  # its spans would count against this run's calls
        return (f"the store {store} already exists: the demo checks that its store holds one span per call it "
                "makes, so give --store a path that does not exist yet (or leave --store out for a new one)")
    if not html.parent.is_dir():
        return f"the HTML report's folder {html.parent} does not exist"
    if same_file(store, html):
        return f"--store and --html name the same file ({store}): the HTML report would overwrite the store"
    return None


def _merged(results: list[Any]) -> Any:
    """One LoadResult of the phases' (counts and unexpected calls added; latencies of the last phase)."""
    from collections import Counter

    from zoomer_serve.demo.load import LoadResult

    counts: Counter[tuple[str, str]] = Counter()
    for res in results:
        counts.update(res.counts)
    return LoadResult(duration_s=sum(res.duration_s for res in results), counts=dict(counts),
                      latency_ms=results[-1].latency_ms, unexpected=sum(res.unexpected for res in results),
                      stream_messages=sum(res.stream_messages for res in results))


def _drive(console: Any, target: str, args: argparse.Namespace, seconds: float, calls: int | None,
           cancel: threading.Event | None = None) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    drive_load: Callable[..., Any]
    if args.transport == "thrift":
        from zoomer_serve.demo.thrift_load import drive_thrift_load

        drive_load = drive_thrift_load
    else:
        from zoomer_serve.demo.load import drive_load

    with Progress(TextColumn("  load"), BarColumn(), TextColumn("{task.fields[calls]} calls, "
                  "{task.fields[ok]} ok"), TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("load", total=seconds, calls=0, ok=0)

        def progress(p: Any) -> None:
            bar.update(task, completed=min(p.elapsed_s, seconds), calls=p.calls, ok=p.ok)

        result = drive_load(target, seconds, clients=args.clients, max_requests=calls, progress=progress,
                            cancel=cancel)
        bar.update(task, completed=seconds if cancel is None or not cancel.is_set() else min(result.duration_s,
                   seconds), calls=result.total_calls)
    return result


def _finish(console: TableOutput, store: Path, html: Path, result: Any, server_rc: int, collector_rc: int,
            signum: int | None = None) -> int:
    """Print the report and the findings, write the HTML report to ``html``, name what to run next; the exit
    code (1 when a process failed, the store does not hold one span per call, or the HTML report could not be
    written; 128 + ``signum`` when a signal stopped the demo early, after the report of what it did)."""
    import shlex

    from rich.text import Text

    from zoomer_serve.analysis import analyze, render_findings
    from zoomer_serve.analysis.html import write_html
    from zoomer_serve.report import build_report, render_report

    report = build_report(store)
    render_report(report, console)
    analysis = analyze(None, store)
    render_findings(analysis.findings, console)
    spans = sum(m.count for m in report.methods)
    console.print(Text(f"\n  sent {result.total_calls} calls "
                       f"({', '.join(f'{m} {c}: {n}' for (m, c), n in sorted(result.counts.items()))}); "
                       f"the store holds {spans} server spans"))
    html_written = True
    try:
        write_html(analysis, html, title=f"zoomer-serve demo: {store.name}")
        console.print(Text(f"  HTML report: {html}  (open it in a browser)"))
    except OSError as exc:
        html_written = False
        console.print(Text(f"  HTML report not written: {html}: {exc}"))
    quoted = shlex.quote(str(store))
    console.print(Text(f"  store: {store}  (again: zoomer-serve report --store {quoted}; "
                       f"zoomer-serve analyze --store {quoted})"))
    ok = (server_rc == 0 and collector_rc == 0 and result.unexpected == 0 and spans == result.total_calls
          and html_written)
    if not ok:
        console.print(Text(f"demo problem: server exit {server_rc}, collector exit {collector_rc}, "
                           f"{result.unexpected} unexpected statuses, {spans} spans for {result.total_calls} calls"
                           + ("" if html_written else ", the HTML report not written")))
    if signum is not None:
        console.print(Text(f"  stopped early by {signal.Signals(signum).name} after {result.duration_s:.1f} s of "
                           "load: the report covers the calls sent until then"))
    console.close()
    if signum is not None:
        return 128 + signum
    return 0 if ok else 1
