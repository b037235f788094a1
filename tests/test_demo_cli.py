"""The main job end to end, as a user runs it: ``zoomer-serve demo`` and ``zoomer-serve serve-demo``."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import psutil
import pytest
from _never_lost import note

from zoomer_serve.analysis.store import detect_store, load_store
from zoomer_serve.processes import wait_for_event

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _example_processes import free_port
from _finding_claims import checked_ids


@pytest.mark.slow
def test_demo_runs_the_whole_flow_and_every_call_becomes_a_span(tmp_path):
    store = tmp_path / "demo.duckdb"
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "demo", "--store", str(store),
                           "--duration-s", "3", "--clients", "2"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert str(store) in proc.stdout.replace("\n", "")
    # piped, each step is one line however long (rich's 80 columns used to fold it)
    lines = proc.stdout.splitlines()
    assert f"zoomer-serve demo: store {store}" in lines, proc.stdout[:2000]
    steps = [line for line in lines if "with the zoomer interceptor on 127.0.0.1:" in line]
    assert len(steps) == 2 and all(line.lstrip().startswith("demo Ranker zoomer-demo-ranker") for line in steps)
    assert "a dynamic batcher of at most 8 requests, 2 ms" in steps[1], steps
    con = duckdb.connect(str(store), read_only=True)
    try:
        server_spans = con.execute("SELECT count(*) FROM spans WHERE kind = 'SERVER'").fetchone()[0]
        phases = con.execute("SELECT DISTINCT json_extract_string(attributes, '$.\"zoomer.phase\"') "
                             "FROM spans WHERE kind = 'INTERNAL'").fetchall()
        codes = con.execute("SELECT DISTINCT json_extract_string(attributes, '$.\"rpc.response.status_code\"') "
                            "FROM spans WHERE kind = 'SERVER'").fetchall()
        duration_points = con.execute("SELECT count(*) FROM metric_points "
                                      "WHERE metric_name = 'rpc.server.call.duration'").fetchone()[0]
        by_service = dict(con.execute(
            "SELECT service_name, count(*) FILTER (WHERE json_extract_string(attributes, '$.\"zoomer.batch.id\"') "
            "IS NOT NULL) FROM spans WHERE kind = 'SERVER' GROUP BY ALL").fetchall())
        batch_spans = con.execute("SELECT count(*) FROM spans WHERE name = 'process ranker'").fetchone()[0]
    finally:
        con.close()
    assert server_spans > 20
    assert f"the store holds {server_spans} server spans" in " ".join(proc.stdout.split())
    assert {p[0] for p in phases} >= {"preprocess", "forward", "postprocess"}
    assert "OK" in {c[0] for c in codes}
    assert duration_points > 0
    # two phases: one forward pass per request, then the dynamic batcher (its valid requests ran in batches)
    assert by_service["zoomer-demo-ranker"] == 0 and by_service["zoomer-demo-ranker-batched"] > 0
    assert batch_spans > 0 and "Batching (requests that ran in batches)" in proc.stdout
    # the demo runs on the CPU: its findings give no GPU advice and say what their evidence shows
    data = load_store(store)
    assert data.gpu is False
    checked_ids(detect_store(data), gpu=False)


@pytest.mark.parametrize("server", ["sync", "aio"])
@pytest.mark.slow
def test_serve_demo_drains_and_flushes_on_sigterm(collector, tmp_path, server):
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=collector.grpc_endpoint, OTEL_SERVICE_NAME="ranker-t",
               OTEL_BSP_SCHEDULE_DELAY="60000")  # nothing is sent before shutdown: the flush must do it
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", "serve-demo", "--port", "0", "--server", server],
                            stdout=subprocess.PIPE, env=env)
    try:
        ready = wait_for_event(proc, "ready", 120)
        assert ready is not None
        from zoomer_serve.demo.load import drive_load

        result = drive_load(f"127.0.0.1:{ready['port']}", 1.5, clients=2, invalid_share=0.0)
        proc.send_signal(signal.SIGTERM)
        stopped = wait_for_event(proc, "stopped", 60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stopped is not None and (stopped["spans_dropped"], stopped["spans_unknown"]) == (0, 0)
    spans = collector.spans("SERVER")
    assert len(spans) == result.total_calls > 0
    assert {s["service_name"] for s in spans} == {"ranker-t"}


@pytest.mark.parametrize("argv", [
    ["demo", "--duration-s", "-1"], ["demo", "--clients", "0"], ["demo", "--max-requests", "-1"],
    ["demo", "--batch-max-size", "-1"], ["serve-demo", "--batch-max-delay-ms", "-2"],
    ["serve-demo", "--port", "99999"], ["serve-demo", "--port", "-5"], ["serve-demo", "--grace-s", "-3"],
    ["profile", "start", "--target", "127.0.0.1:1", "--requests", "-3"],
])
@pytest.mark.slow
def test_bad_command_line_values_are_refused_before_anything_starts(argv):
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "is not" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"ZOOMER_PROFILES_DIR": "FILE"}, {"ZOOMER_ADMIN_TOKEN": "secret\n"}])
def test_serve_demo_refuses_bad_profiling_settings_before_its_telemetry_starts(tmp_path, env):
    """A profiles folder that is a file, a token gRPC metadata cannot carry: exit 2 naming it, and nothing
    tries to export on the way out (the refusal came after the telemetry had started: 13 s of flush retries
    against a closed port, their errors after the message)."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    env = {k: str(afile) if v == "FILE" else v for k, v in env.items()}
    closed = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "serve-demo", "--port", "0"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": closed, **env})
    assert proc.returncode == 2
    assert next(iter(env)) in proc.stderr and "Traceback" not in proc.stderr
    assert "export" not in proc.stderr.lower() and "4317" not in proc.stderr


@pytest.mark.slow
def test_serve_demo_on_a_port_in_use_says_so_before_its_telemetry_starts():
    """A port another server listens on: exit 1 naming the address, and nothing tries to export on the way out
    (the bind came after the telemetry and the model had started: a trial waited 13 s of flush retries against a
    closed port, their errors after the message)."""
    closed = f"http://127.0.0.1:{free_port()}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "serve-demo", "--port", str(port)],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": closed})
    assert proc.returncode == 1, proc.stderr
    assert f"cannot bind 127.0.0.1:{port}: Address already in use" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "export" not in proc.stderr.lower(), proc.stderr


def test_demo_with_an_unusable_store_says_why_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "demo", "--store", str(tmp_path),
                           "--duration-s", "1"], capture_output=True, text=True, timeout=120)
    # a folder as the store is refused before anything starts (it used to fail when the collector did not start)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"the store {tmp_path} is a folder; give a file name" in proc.stderr and proc.stdout == ""


@pytest.mark.slow
def test_a_shell_set_up_for_another_backend_does_not_take_the_demos_spans(tmp_path):
    """A user's OTEL_* / ZOOMER_* settings for production reached the demo's server and collector: spans sent to a
    dead traces endpoint or sampled (0 and 40 spans stored for 654 and 498 calls, exit 1, no reason given), or a
    collector that wanted a token. The demo leaves them out, says so, and stores one span per call."""
    env = dict(os.environ, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:9/",
               OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_TRACES_SAMPLER="traceidratio",
               OTEL_TRACES_SAMPLER_ARG="0.1", ZOOMER_COLLECTOR_TOKEN="s3cret-token-of-32-characters-xx")
    store = tmp_path / "env.duckdb"
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "demo", "--store", str(store), "--duration-s",
                           "2", "--batch-max-size", "0", "--clients", "2"], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("ignoring OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_TRACES_SAMPLER, "
            "OTEL_TRACES_SAMPLER_ARG, ZOOMER_COLLECTOR_TOKEN from the environment") in proc.stdout
    text = " ".join(proc.stdout.split())
    sent = int(text.split("sent ")[1].split(" calls")[0])
    assert sent > 0 and f"the store holds {sent} server spans" in text


def test_the_demos_children_get_the_environment_less_what_would_take_their_spans() -> None:
    from zoomer_serve.demo.cli import demo_child_env

    env, ignored = demo_child_env({"PATH": "/bin", "OTEL_SERVICE_NAME": "mine", "OTEL_RESOURCE_ATTRIBUTES": "a=b",
                                   "OTEL_EXPORTER_OTLP_HEADERS": "k=v", "OTEL_SDK_DISABLED": "true",
                                   "ZOOMER_EXPORT_MODE": "none", "ZOOMER_COLLECTOR_PARQUET_URL": "s3://b/x",
                                   "ZOOMER_GPU": "off"})
    assert env == {"PATH": "/bin", "OTEL_SERVICE_NAME": "mine", "OTEL_RESOURCE_ATTRIBUTES": "a=b", "ZOOMER_GPU": "off"}
    assert ignored == ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_SDK_DISABLED", "ZOOMER_COLLECTOR_PARQUET_URL",
                       "ZOOMER_EXPORT_MODE"]


def test_demo_refuses_an_html_report_that_is_its_store(tmp_path):
    """``demo --store S --html S`` wrote its HTML report over the store it had just filled and exited 0, telling
    the user to run ``report --store S`` on what was now a web page: refused before anything starts."""
    store = tmp_path / "same.duckdb"
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "demo", "--store", str(store), "--html",
                           str(tmp_path / "." / "same.duckdb"), "--duration-s", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert f"--store and --html name the same file ({store})" in proc.stderr and "Traceback" not in proc.stderr
    assert not store.exists()


def test_two_demos_started_in_one_second_get_stores_of_their_own(tmp_path, monkeypatch):
    """The default store was named for the second only: two demos started together (two terminals, a CI matrix)
    shared it and one failed on the store's lock."""
    from zoomer_serve.demo import cli as demo_cli

    monkeypatch.setattr(demo_cli.time, "strftime", lambda fmt: "demo-20261203-153531")
    here, pid = demo_cli._default_store(), os.getpid()
    monkeypatch.setattr(demo_cli.os, "getpid", lambda: pid + 1)
    assert here != demo_cli._default_store()
    assert here.parent == Path("zoomer-data") and here.name == f"demo-20261203-153531-{pid}.duckdb"


def test_demo_refuses_a_store_that_already_exists(tmp_path):
    """A second ``demo --store S`` on the store of a first run added its spans to the first run's, then reported
    "808 spans for 367 calls" and exited 1: the demo checks that its store holds one span per call it made. A
    store that exists is refused before anything starts, and left as it was."""
    store = tmp_path / "earlier.duckdb"
    store.write_bytes(b"an earlier run's store")
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "demo", "--store", str(store),
                           "--duration-s", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert f"the store {store} already exists" in proc.stderr and "--store" in proc.stderr
    assert store.read_bytes() == b"an earlier run's store"


def _start_demo(store: Path, tmp_path: Path, env: dict[str, str] | None = None
                ) -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    """``zoomer-serve demo`` in a session of its own (as from a terminal), once its first phase's load runs:
    the process and its children (collector, server, the server's export helper). ``env``: variables added."""
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", "demo", "--store", str(store), "--duration-s",
                             "60", "--clients", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True, env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    for line in proc.stdout:
        if "with the zoomer interceptor on" in line:
            break
    else:
        proc.wait(timeout=60)
        raise AssertionError(f"the demo ended before its load (exit {proc.returncode}): {proc.stderr.read()}")
    time.sleep(2.0)  # some calls done (not a timing assertion)
    return proc, psutil.Process(proc.pid).children(recursive=True)


@pytest.mark.slow
@pytest.mark.parametrize(("how", "code"), [("sigint-group", 130), ("sigterm-pid", 143)])
def test_demo_stopped_by_ctrl_c_stops_in_order_and_keeps_every_call(tmp_path, how, code):
    """C12 on ``zoomer-serve demo``: Ctrl+C (SIGINT to its process group) or SIGTERM to its pid while the load
    runs: the load stops, the server stops first (its telemetry flushes into the collector still running),
    then the collector; the report is printed with one stored server span per call sent, the batched phase
    never starts, no child is left, and the exit status is 128 + the signal's number. (The children used to
    get the terminal's SIGINT themselves: the collector stopped before the server's flush reached it, and
    the demo drove load at the dead server for half a minute more.)"""
    store = tmp_path / "int.duckdb"
    proc, children = _start_demo(store, tmp_path)
    if how == "sigint-group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    _, alive = psutil.wait_procs(children, timeout=60)
    assert proc.returncode == code, out[-3000:] + err[-3000:]
    assert alive == []
    assert "Traceback" not in err and "could not be exported" not in err, err[-3000:]
    con = duckdb.connect(str(store), read_only=True)
    try:
        by_service = dict(con.execute("SELECT service_name, count(*) FROM spans WHERE kind = 'SERVER' "
                                      "GROUP BY ALL").fetchall())
    finally:
        con.close()
    text = " ".join(out.split())
    sent = int(text.split(" sent ")[1].split(" calls")[0])
    note("C12", f"zoomer-serve demo, {how} during the load", sent, sum(by_service.values()))
    assert by_service == {"zoomer-demo-ranker": sent} and sent > 0, text[-2000:]
    assert f"the store holds {sent} server spans" in text and "demo problem" not in text


@pytest.mark.slow
def test_a_demo_killed_with_sigkill_leaves_no_child_running(tmp_path):
    """The demo's children (collector, server) stop when the demo dies, even of SIGKILL (they used to serve
    on, orphaned, until killed by hand). The server, whose collector went with the demo, spends its export
    budget (2 s here) retrying before it exits; the children hold the demo's stderr until they are gone, so the
    demo's pipes are read only after them (reading them first, with a 60 s limit, failed once on a loaded
    machine)."""
    proc, children = _start_demo(tmp_path / "killed.duckdb", tmp_path, {"OTEL_EXPORTER_OTLP_TIMEOUT": "2000"})
    assert len(children) >= 2
    proc.kill()
    proc.wait(timeout=30)
    alive = _running(children, timeout_s=180)
    for child in alive:
        child.kill()
    proc.communicate(timeout=60)
    assert alive == []


def _running(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of ``procs`` (not this process's children) still running after up to ``timeout_s``. An exited one
    that its new parent has not reaped yet is a zombie: gone, not running (``psutil.wait_procs`` counted it alive,
    and the container's init reaped one too late for it once)."""
    deadline = time.monotonic() + timeout_s
    running = list(procs)
    while True:
        running = [p for p in running if _is_running(p)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def _is_running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize(("max_requests", "batch", "calls"), [
    (5, 8, [3, 2]), (1, 8, [1]), (6, 8, [3, 3]), (5, 0, [5]), (None, 8, [None, None])])
def test_max_requests_is_the_most_calls_in_all_phases(max_requests, batch, calls) -> None:
    """``demo --max-requests N`` sends at most N calls over its phases (5 used to send 3 + 3)."""
    from zoomer_serve.demo.cli import _phases

    args = argparse.Namespace(max_requests=max_requests, batch_max_size=batch, duration_s=20.0)
    assert [p[3] for p in _phases(args)] == calls


@pytest.mark.slow
def test_demo_whose_html_report_cannot_be_written_exits_1(tmp_path):
    """``demo --html /proc/x.html``: its folder exists, so nothing refused it at the start, the write failed at the
    end, the demo said "HTML report not written" and still exited 0. Now the run is a problem (exit 1) that names
    it; the store and the report are there."""
    store, html = tmp_path / "s.duckdb", Path("/proc/zoomer-serve-test-report.html")
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "demo", "--store", str(store), "--html", str(html),
                           "--duration-s", "2", "--max-requests", "6", "--batch-max-size", "0"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"HTML report not written: {html}" in proc.stdout and "the HTML report not written" in proc.stdout
    assert "6 spans for 6 calls" in proc.stdout and store.exists() and "Traceback" not in proc.stderr
