"""The commands that print tables, run as a user runs them (a subprocess, stdout a pipe), on a store filled
through real OTLP: whole names when piped, ``--format table|markdown|csv|json`` that parse, rates only over a
time span, and the next command to run."""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _collector_fixtures import running_collector, tracer_provider
from opentelemetry.trace import SpanKind

LONG_SERVICE = "zoomer-demo-ranker-of-the-recommendations-team-eu-west"
LONG_METHOD = "RankCandidatesForTheHomeFeedWithTheLongestName"
T0 = 1_800_000_000_000_000_000  # ns
BURST = 50  # requests within 23 ms: a count, not a rate


def _spans(tracer: Any, method: str, n: int, start_ns: int, step_ns: int, duration_ns: int) -> None:
    for i in range(n):
        start = start_ns + i * step_ns
        span = tracer.start_span(f"zoomer.demo.v1.Ranker/{method}", kind=SpanKind.SERVER, start_time=start,
                                 attributes={"rpc.system": "grpc", "rpc.method": method,
                                             "rpc.response.status_code": "OK"})
        span.end(end_time=start + duration_ns)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("cli_output")
    with running_collector(tmp) as collector:
        provider = tracer_provider(collector, "grpc", service=LONG_SERVICE)
        tracer = provider.get_tracer("test")
        _spans(tracer, LONG_METHOD, 30, T0, 100_000_000, 4_000_000)  # 30 requests over 2.9 s
        _spans(tracer, "Burst", BURST, T0, 450_000, 500_000)  # 50 requests over 22.6 ms
        provider.shutdown()
        stats = collector.stop()
    assert stats["spans_received"] == 30 + BURST
    return collector.store_path


def zoomer(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m zoomer_serve ARGV`` with stdout and stderr pipes (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "zoomer_serve", *argv], capture_output=True, text=True,
                          timeout=timeout)


def markdown_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """The pipe tables of a markdown text by their ``**title**`` line: rows as column -> cell."""
    tables: dict[str, list[dict[str, str]]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("**") and i + 3 < len(lines) and lines[i + 2].startswith("| "):
            header = _md_cells(lines[i + 2])
            assert set(_md_cells(lines[i + 3])) == {"---"}
            rows = []
            for row in lines[i + 4:]:
                if not row.startswith("| "):
                    break
                cells = _md_cells(row)
                assert len(cells) == len(header), row
                rows.append(dict(zip(header, cells)))
            tables[line.strip("*")] = rows
    return tables


def _md_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def csv_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """The blocks of the csv format: a title row, a header row, data rows; blocks split by an empty row."""
    tables: dict[str, list[dict[str, str]]] = {}
    block: list[list[str]] = []
    for row in [*csv.reader(io.StringIO(text)), []]:
        if row:
            block.append(row)
            continue
        if block:
            assert len(block[0]) == 1, block[0]
            tables[block[0][0]] = [dict(zip(block[1], r)) for r in block[2:]]
            assert all(len(r) == len(block[1]) for r in block[2:])
        block = []
    return tables


def json_tables(text: str) -> dict[str, list[dict[str, Any]]]:
    data = json.loads(text)
    assert set(data) == {"tables", "notes"}
    return {f"{t['section']}: {t['title']}" if t["section"] else t["title"]: t["rows"] for t in data["tables"]}


PARSERS = {"markdown": markdown_tables, "csv": csv_tables, "json": json_tables}


@pytest.mark.parametrize("fmt", ["markdown", "csv", "json"])
def test_report_formats_parse_and_hold_whole_names(store: Path, fmt: str) -> None:
    proc = zoomer("report", "--store", str(store), "--format", fmt)
    assert proc.returncode == 0, proc.stderr
    tables = PARSERS[fmt](proc.stdout)
    requests = tables["Requests, latency in ms"]
    assert {(r["service"], r["method"]) for r in requests} == {(LONG_SERVICE, LONG_METHOD), (LONG_SERVICE, "Burst")}
    by_method = {r["method"]: r for r in requests}
    assert str(by_method[LONG_METHOD]["reqs"]) == "30" and str(by_method["Burst"]["reqs"]) == str(BURST)
    # a rate needs a time span: 50 requests within 23 ms get none
    assert by_method["Burst"]["req/s"] in ("-", None)
    assert float(by_method[LONG_METHOD]["req/s"]) == pytest.approx(30 / 2.904, rel=1e-2)
    assert "Status codes" in tables and "Slowest 10 traces" in tables


def test_report_piped_table_never_cuts_a_name(store: Path) -> None:
    """Piped (not a terminal), rich's default 80 columns used to fold names into pieces."""
    proc = zoomer("report", "--store", str(store))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(LONG_SERVICE in line and LONG_METHOD in line for line in lines) >= 2  # requests, status codes
    assert max(len(line) for line in lines) > 80
    assert "2159" not in proc.stdout and "over 0.0 s" not in proc.stdout


@pytest.mark.slow
def test_report_names_the_store_and_the_analyze_command(store: Path) -> None:
    proc = zoomer("report", "--store", str(store))
    assert f"store: {store}" in proc.stdout
    assert f"zoomer-serve analyze --store {store}" in proc.stdout
    # the command it names runs on that store
    follow = zoomer("analyze", "--store", str(store), "--format", "json")
    assert follow.returncode == 0, follow.stderr
    # with csv the stdout holds only tables; the lines around them go to stderr
    as_csv = zoomer("report", "--store", str(store), "--format", "csv")
    assert f"zoomer-serve analyze --store {store}" in as_csv.stderr
    assert "zoomer-serve analyze" not in as_csv.stdout
    assert f"zoomer-serve analyze --store {store}" in " ".join(json.loads(
        zoomer("report", "--store", str(store), "--format", "json").stdout)["notes"])


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv", "json"])
def test_analyze_formats_hold_whole_names(store: Path, fmt: str) -> None:
    proc = zoomer("analyze", "--store", str(store), "--format", fmt)
    assert proc.returncode == 0, proc.stderr
    if fmt == "table":
        assert any(LONG_SERVICE in line and LONG_METHOD in line for line in proc.stdout.splitlines())
        return
    tables = PARSERS[fmt](proc.stdout)
    requests = next(rows for title, rows in tables.items() if title.endswith("Requests"))
    assert {r["method"] for r in requests} == {LONG_METHOD, "Burst"}
    assert {r["service"] for r in requests} == {LONG_SERVICE}
    assert any(title.endswith("Findings") for title in tables) or (proc.stdout + proc.stderr).count("No findings") == 1


@pytest.mark.parametrize("command", [["report"], ["analyze"], ["fleet", "analyze", "x"], ["loadtest"], ["demo"]])
def test_a_bad_format_names_the_choices(command: list[str]) -> None:
    proc = zoomer(*command, "--format", "xml")
    assert proc.returncode == 2
    assert "--format" in proc.stderr and "'table', 'markdown', 'csv', 'json'" in proc.stderr


# -- help texts --------------------------------------------------------------------------------------------
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


def _parsers(parser: argparse.ArgumentParser, name: str = "zoomer-serve"
             ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the command line, by its command path, depth first."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _unknown_flags(text: str, own: set[str], commands: dict[str, set[str]]) -> set[str]:
    """Flags ``text`` names that are neither in ``own`` nor options of a command it names."""
    named = {c for c in commands if re.search(rf"\b{re.escape(c)}\b", text)}
    others = set().union(*(commands[c] for c in named)) if named else set()
    return {f for f in FLAG.findall(text) if f not in own and f not in others}


def test_every_help_text_names_only_flags_that_exist() -> None:
    """``loadtest --help`` named --zoomer-stable-samples and --zoomer-profile-duration-s, which the command
    calls --stable-samples and --profile-duration-s."""
    from zoomer_serve.cli import build_parser

    parsers = dict(_parsers(build_parser()))
    commands = {path.split(" ", 1)[1]: _options(p) for path, p in parsers.items() if " " in path}
    assert {"report", "analyze", "loadtest", "profile start", "fleet analyze", "demo", "serve-demo"} <= set(commands)
    wrong = {}
    for path, parser in parsers.items():
        bad = _unknown_flags(parser.format_help(), _options(parser), commands)
        if bad:
            wrong[path] = sorted(bad)
    assert wrong == {}


def test_the_locust_plugin_help_names_only_its_own_flags() -> None:
    """The same options in locust's parser carry the --zoomer- prefix; their help texts must say so."""
    from zoomer_serve.loadtest.config import add_arguments

    parser = argparse.ArgumentParser(prog="locust")
    add_arguments(parser)
    text = parser.format_help()
    assert "--zoomer-stable-samples" in text and "--zoomer-profile-duration-s" in text
    assert _unknown_flags(text, _options(parser), {}) == set()


# -- profiling sessions: names, Kineto's stderr lines, what to run next ------------------------------------
NOISE = ("USDT:", "External init callback")


@pytest.mark.slow
@pytest.mark.parametrize("log_level", ["WARNING", "DEBUG"])
def test_serve_demo_session_is_named_for_the_service_quiet_on_stderr_and_names_its_files(
        collector: Any, tmp_path: Path, log_level: str) -> None:
    """serve-demo without OTEL_SERVICE_NAME names its spans and sessions zoomer-demo-ranker (they were
    "zoomer-serve_..."); Kineto's USDT / External init callback lines on fd 2 go to the log at debug level;
    ``profile stop`` names the files and the analyze command, which runs on them."""
    import os
    import signal

    from _profiling_support import TOKEN

    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.processes import wait_for_event

    profiles = tmp_path / "profiles"
    env = {k: v for k, v in os.environ.items() if k not in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES")}
    env |= {"ZOOMER_ADMIN_TOKEN": TOKEN, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.grpc_endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200"}
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", "--log-level", log_level, "serve-demo",
                                 "--port", "0", "--profiles-dir", str(profiles)],
                                stdout=subprocess.PIPE, stderr=stderr, env=env)
        try:
            ready = wait_for_event(proc, "ready", 120)
            assert ready is not None
            target = f"127.0.0.1:{ready['port']}"

            def profile(*argv: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run([sys.executable, "-m", "zoomer_serve", "profile", *argv, "--target", target],
                                      env=env, capture_output=True, text=True, timeout=120)

            started = profile("start", "--requests", "1000", "--duration-ms", "60000")
            assert started.returncode == 0, started.stderr
            assert drive_load(target, 30.0, clients=2, max_requests=20, invalid_share=0.0).unexpected == 0
            stopped = profile("stop")
            assert stopped.returncode == 0, stopped.stderr
            proc.send_signal(signal.SIGTERM)
            assert wait_for_event(proc, "stopped", 90) is not None
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    trace = next(profiles.glob("*.pt.trace.json.gz"))
    assert trace.name.startswith("zoomer-demo-ranker_")
    assert {s["service_name"] for s in collector.spans("SERVER")} == {"zoomer-demo-ranker"}
    summary = trace.with_name(trace.name.replace(".pt.trace.json.gz", ".summary.json"))
    lines = stopped.stdout.splitlines()
    assert "  files (on the server):" in lines
    assert f"    {trace.resolve()}" in lines and f"    {summary.resolve()}" in lines and summary.is_file()
    command = f"zoomer-serve analyze {trace.resolve()}"
    assert f"  next: {command}" in " ".join(lines) or any(line.startswith(f"  next: {command} ") for line in lines)
    analysed = zoomer(*command.split()[1:], "--format", "json")
    assert analysed.returncode == 0, analysed.stderr
    assert json.loads(analysed.stdout)["tables"]
    err = stderr_path.read_text(errors="replace")
    raw = [line for line in err.splitlines() if line.startswith(NOISE)]
    assert raw == [], raw  # never on stderr as Kineto wrote them
    logged = [line for line in err.splitlines() if "zoomer_serve.profiling: kineto: " in line]
    if log_level == "DEBUG":
        assert any("USDT:" in line and "profiler_start" in line for line in logged)
        assert any("USDT:" in line and "profiler_stop" in line for line in logged)
    else:
        assert logged == []


@pytest.mark.slow
def test_gevent_locust_process_says_nothing_about_per_request_cpu_time(collector: Any) -> None:
    """The locust process (gevent) printed a warning that requests get no per-request CPU time; its CLIENT
    spans never could: it is said once at debug level."""
    import os

    code = ("from gevent import monkey; monkey.patch_all()\n"
            "import logging, sys; logging.basicConfig(level=sys.argv[1])\n"
            "from zoomer_serve.loadtest.plugin import configure_client_telemetry\n"
            "configure_client_telemetry()\n"
            "import zoomer_serve; zoomer_serve.shutdown()\n")
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=collector.grpc_endpoint)
    runs = {level: subprocess.run([sys.executable, "-c", code, level], env=env, capture_output=True, text=True,
                                  timeout=120) for level in ("WARNING", "DEBUG")}
    assert all(r.returncode == 0 for r in runs.values()), runs["WARNING"].stderr
    assert "per-request CPU time" not in runs["WARNING"].stderr
    assert runs["DEBUG"].stderr.count("per-request CPU time") == 1


@pytest.mark.slow
def test_demo_prints_json_tables_and_names_its_html_report(tmp_path: Path) -> None:
    """``demo --format json``: stdout is one JSON object (the steps and the progress go to stderr); the
    report's tables hold the service name whole; the HTML report is written and named."""
    store = tmp_path / "demo.duckdb"
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "demo", "--store", str(store), "--duration-s", "2",
                           "--clients", "2", "--batch-max-size", "0", "--format", "json"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    requests = next(t for t in data["tables"] if t["title"].startswith("Requests, latency in ms"))
    assert {r["service"] for r in requests["rows"]} == {"zoomer-demo-ranker"}
    assert sum(r["reqs"] for r in requests["rows"]) > 10
    html = store.with_suffix(".html")
    assert f"  HTML report: {html}  (open it in a browser)" in data["notes"]
    assert html.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")
    assert "embedded OTLP collector" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_loadtest_csv_tables_on_stdout_and_a_quiet_stderr(tmp_path: Path) -> None:
    """``loadtest --format csv``: stdout holds only the csv blocks (locust's output and our lines go to
    stderr); stderr holds none of Kineto's lines (server) nor the gevent CPU-time warning (locust)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("ZOOMER_ADMIN_TOKEN", "OTEL_SERVICE_NAME")}
    store = tmp_path / "run.duckdb"
    done = subprocess.run([sys.executable, "-m", "zoomer_serve", "loadtest", "--users", "2", "--run-time", "3",
                           "--warmup-s", "1", "--profile-requests", "15", "--store", str(store), "--profiles-dir",
                           str(tmp_path / "profiles"), "--format", "csv"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    tables = csv_tables(done.stdout)
    client_server = tables["Load test: client (locust) vs server (spans), latency in ms"]
    assert {r["side"] for r in client_server} >= {"client grpc", "server"}
    requests = tables["Requests, latency in ms"]
    assert {r["service"] for r in requests} == {"zoomer-demo-ranker"}
    assert f"zoomer-serve analyze --store {store.resolve()}" in done.stderr
    assert "Response time percentiles" in done.stderr  # locust's summary
    noise = [line for line in done.stderr.splitlines()
             if line.startswith(NOISE) or "per-request CPU time" in line]
    assert noise == []


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["markdown", "csv", "json"])
def test_fleet_analyze_formats_parse(tmp_path: Path, fmt: str) -> None:
    """``fleet analyze --format``: the outliers and findings tables of a small synthetic fleet (12 replicas,
    one slow: replica 3) parse and name the slow replica."""
    from zoomer_serve.fleet.synthetic import FleetSpec, build_fleet

    base = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "kineto" / "a100_alexnet_inference.json.gz"
    if not base.is_file():
        pytest.skip(f"the shared Kineto traces are not here ({base})")
    truth = build_fleet(str(tmp_path), base, FleetSpec(replicas=12, slow=(3,), second_gpu_share=0.0, requests=100))
    proc = zoomer("fleet", "analyze", str(tmp_path), "--drill-down", "0", "--workers", "1", "--format", fmt,
                  timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = PARSERS[fmt](proc.stdout)
    outliers = next(rows for title, rows in tables.items() if title.endswith("Outliers (robust z against peers)"))
    assert {r["replica"] for r in outliers} == truth.slow
    findings = next(rows for title, rows in tables.items() if title.endswith("Findings"))
    assert "fleet.outlier-replica" in {r["id"] for r in findings}


def test_loadtest_errors_name_its_own_flags() -> None:
    """The options' checks name locust's flags (--zoomer-stable-samples); loadtest calls it --stable-samples."""
    proc = zoomer("loadtest", "--stable-samples", "1", "--no-profile")
    assert proc.returncode == 2
    assert "zoomer-serve loadtest: --stable-samples (ZOOMER_LOADTEST_STABLE_SAMPLES) must be >= 2, got 1" in proc.stderr
    assert "--zoomer-" not in proc.stderr


def test_analyze_diff_and_a_trace_in_json(store: Path) -> None:
    """``analyze --diff`` and ``analyze TRACE`` with ``--format json``: one object per table, with its title."""
    diff = zoomer("analyze", "--diff", str(store), str(store), "--format", "json")
    assert diff.returncode == 0, diff.stderr
    figures = next(t for t in json.loads(diff.stdout)["tables"] if t["title"] == "Figures")
    requests = next(r for r in figures["rows"] if r["figure"] == "requests")
    assert requests["before"] == requests["after"] == 30 + BURST and requests["delta"] == 0
    trace = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "kineto" / "a100_alexnet_inference.json.gz"
    if not trace.is_file():
        pytest.skip(f"the shared Kineto traces are not here ({trace})")
    proc = zoomer("analyze", str(trace), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    tables = json.loads(proc.stdout)["tables"]
    kernels = next(t for t in tables if t["title"] == "Top kernels")
    assert kernels["section"] == f"trace {trace}" and len(kernels["rows"]) == 10
    assert all(isinstance(r["count"], int) and r["count"] > 0 for r in kernels["rows"])


def test_piped_findings_keep_their_whole_title() -> None:
    """Piped (not a terminal), a finding's panel was 80 columns wide and cut its title, the method it is about
    included ("zoomer.demo.v1.Ranker/Pred─"); the title (severity, id, scope) stays whole, on one line."""
    from zoomer_serve.analysis.findings import Finding
    from zoomer_serve.analysis.render import render_findings
    from zoomer_serve.cli_output import TableOutput

    scope = f"{LONG_SERVICE} {LONG_METHOD}"
    finding = Finding(id="request.tail-latency", title="t", severity="medium", summary="p99 is 7x the median.",
                      evidence={"p99_ms": 6.2}, recommendation="Open the listed traces.", source="s.duckdb",
                      scope=scope)
    buf = io.StringIO()
    out = TableOutput("table", file=buf)
    render_findings([finding], out)
    out.close()
    text = buf.getvalue()
    assert any(f"request.tail-latency  {scope}" in line for line in text.splitlines()), text


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv", "json"])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(store: Path, fmt: str) -> None:
    """``zoomer-serve report ... | head -1``: the command wrote on after head had gone and ended with a
    BrokenPipeError traceback (markdown, csv), or exit 1 with nothing said. Now it stops writing and exits 1
    quietly (Python's recipe for a closed stdout: nothing more is flushed into it)."""
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", "report", "--store", str(store), "--format", fmt],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


def test_ctrl_c_before_a_command_handles_it_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl+C while a command is still starting (importing its modules, before it handles Ctrl+C itself) printed a
    KeyboardInterrupt traceback. Now it is one line, and the exit status of a SIGINT death (130), as shells
    expect."""
    from zoomer_serve import cli

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    report = parser._subparsers._group_actions[0].choices["report"]  # type: ignore[union-attr]
    report.set_defaults(func=interrupted)
    assert cli.main(["report", "--store", "x.duckdb"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "zoomer-serve: interrupted", err
