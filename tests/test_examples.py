"""The programs in examples/ run as a user runs them: each server is started as a subprocess (port 0, the
address it prints), called by its client script (or locust), stopped by a signal, and its spans are read
from the embedded collector it exported to (OTEL_EXPORTER_OTLP_ENDPOINT, as a user sets it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _example_processes import ROOT, free_port, server, telemetry_env

EXAMPLES = ROOT / "examples"
RANK = "examples.ranker.v1.Ranker/Rank"
THRIFT_RANK = "Ranker/Rank"
PHASES = ("preprocess", "forward", "postprocess")


def run_client(script: Path, env: dict[str, str], *args: str) -> list[str]:
    done = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def request_spans(rows: list[dict[str, Any]], service: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["kind"] == "SERVER" and r["service_name"] == service]


def phases_of(rows: list[dict[str, Any]], span: dict[str, Any]) -> list[str]:
    return sorted(r["name"] for r in rows if r["parent_span_id"] == span["span_id"] and r["trace_id"] ==
                  span["trace_id"] and "zoomer.phase" in r["attributes"])


def check_requests(rows: list[dict[str, Any]], service: str, method: str, ok: int, refused: dict[str, int]
                   ) -> list[dict[str, Any]]:
    """``ok`` + refused calls of ``method``, one SERVER span each, with the phases each one ran."""
    spans = request_spans(rows, service)
    assert len(spans) == ok + sum(refused.values())
    assert {s["attributes"]["rpc.method"] for s in spans} == {method}
    codes = [s["attributes"]["rpc.response.status_code"] for s in spans]
    assert {code: codes.count(code) for code in set(codes)} == {"OK": ok, **refused}
    for span in spans:
        answered = span["attributes"]["rpc.response.status_code"] == "OK"
        assert phases_of(rows, span) == (sorted(PHASES) if answered else ["preprocess"]), span
    return spans


@pytest.mark.slow
def test_grpc_server_example_serves_phases_and_stops_on_ctrl_c_with_every_span_stored(collector: Any) -> None:
    with server(["examples/grpc_server/server.py", "--port", "0"], telemetry_env(collector, "example-ranker")) \
            as (program, target):
        printed = run_client(EXAMPLES / "grpc_server" / "client.py", telemetry_env(collector, "example-client"),
                             "--target", target, "--calls", "12", "--invalid", "2")
        assert program.stop(signal.SIGINT) == 0, program.output[-3000:]
    assert len([line for line in printed if " items, best item-" in line]) == 12
    assert [line for line in printed if line.startswith("invalid-")] == [
        "invalid-0: INVALID_ARGUMENT: 1 to 256 candidates, got 0", "invalid-1: INVALID_ARGUMENT: 1 to 256 candidates, got 0"]
    rows = collector.spans()
    spans = check_requests(rows, "example-ranker", RANK, ok=12, refused={"INVALID_ARGUMENT": 2})
    clients = {(r["trace_id"], r["span_id"]): r for r in rows if r["kind"] == "CLIENT"}
    assert len(clients) == 14 and {r["service_name"] for r in clients.values()} == {"example-client"}
    for span in spans:  # each call: the client's span is the parent of the server's
        parent = clients[(span["trace_id"], span["parent_span_id"])]
        assert parent["attributes"]["rpc.method"] == RANK
        assert parent["attributes"]["rpc.response.status_code"] == span["attributes"]["rpc.response.status_code"]


@pytest.mark.slow
def test_grpc_aio_server_example_serves_concurrent_calls_and_stops_on_sigterm_with_every_span_stored(
        collector: Any) -> None:
    with server(["examples/grpc_aio_server/server.py", "--port", "0"],
                telemetry_env(collector, "example-ranker-aio")) as (program, target):
        printed = run_client(EXAMPLES / "grpc_aio_server" / "client.py", telemetry_env(collector, "example-client"),
                             "--target", target, "--calls", "16", "--concurrency", "4")
        assert program.stop(signal.SIGTERM) == 0, program.output[-3000:]
    assert sorted(line.split(":")[0] for line in printed) == sorted(f"call-{i}" for i in range(16))
    rows = collector.spans()
    spans = check_requests(rows, "example-ranker-aio", RANK, ok=16, refused={})
    clients = {(r["trace_id"], r["span_id"]) for r in rows if r["kind"] == "CLIENT"}
    assert {(s["trace_id"], s["parent_span_id"]) for s in spans} == clients and len(clients) == 16


@pytest.mark.slow
def test_thrift_server_example_answers_declared_errors_and_flushes_on_sigterm(collector: Any) -> None:
    with server(["examples/thrift_server/server.py", "--port", "0"],
                telemetry_env(collector, "example-ranker-thrift")) as (program, target):
        printed = run_client(EXAMPLES / "thrift_server" / "client.py", telemetry_env(collector, "example-client"),
                             "--target", target, "--calls", "12", "--invalid", "3")
        # zoomer-serve's SIGTERM handler hands the spans over, then lets the signal end the process
        assert program.stop(signal.SIGTERM) == -signal.SIGTERM, program.output[-3000:]
    assert len([line for line in printed if " items, best item-" in line]) == 12
    assert len([line for line in printed if "InvalidRequest: 1 to 256 candidates, got 0" in line]) == 3
    rows = collector.spans()
    spans = check_requests(rows, "example-ranker-thrift", THRIFT_RANK, ok=12, refused={"InvalidRequest": 3})
    assert {s["attributes"]["rpc.system.name"] for s in spans} == {"thrift"}
    refused = [s for s in spans if s["attributes"]["rpc.response.status_code"] == "InvalidRequest"]
    assert all(s["attributes"]["zoomer.rpc.business_error"] == "InvalidRequest" for s in refused)


@pytest.mark.slow
def test_locust_example_loads_the_grpc_example_and_every_request_has_its_server_span(collector: Any,
                                                                                     tmp_path: Path) -> None:
    summary_json = tmp_path / "summary.json"
    with server(["examples/grpc_server/server.py", "--port", "0"], telemetry_env(collector, "example-ranker")) \
            as (program, target):
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "examples/locust_own_service/locustfile.py", "--headless",
             "--host", target, "--users", "4", "--spawn-rate", "4", "--run-time", "4s", "--stop-timeout", "10",
             "--only-summary", "--zoomer-no-profile", "--zoomer-quiet", "--zoomer-summary-json", str(summary_json)],
            cwd=ROOT, env=telemetry_env(collector), capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-4000:]
        assert program.stop(signal.SIGINT) == 0, program.output[-3000:]
    client = {c["name"]: c for c in json.loads(summary_json.read_text())["client"]}
    assert set(client) == {RANK, "Aggregated"} and client[RANK]["failures"] == 0 and client[RANK]["count"] > 0
    rows = collector.spans()
    spans = check_requests(rows, "example-ranker", RANK, ok=client[RANK]["count"], refused={})
    clients = {(r["trace_id"], r["span_id"]): r for r in rows if r["kind"] == "CLIENT"}
    assert len(clients) == client[RANK]["count"]
    assert {clients[(s["trace_id"], s["parent_span_id"])]["service_name"] for s in spans} == {"zoomer-loadtest"}


def test_the_committed_generated_code_of_the_grpc_example_is_what_its_proto_gives() -> None:
    """The command in examples/grpc_server/ranker.proto regenerates exactly the committed files."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) regenerates the code")
    folder = EXAMPLES / "grpc_server"
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{folder}", f"--python_out={out}",
                               f"--pyi_out={out}", f"--grpc_python_out={out}", str(folder / "ranker.proto")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        for name in ("ranker_pb2.py", "ranker_pb2.pyi", "ranker_pb2_grpc.py"):
            assert (Path(out) / name).read_text() == (folder / name).read_text(), name


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpc_server/client.py", "grpc_aio_server/client.py", "thrift_server/client.py"])
def test_a_client_pointed_at_a_port_nobody_listens_on_says_so_in_one_line(script: str, collector: Any) -> None:
    """A wrong --target (a port with no server) ends the example client with exit 1 and one line naming the
    target and the reason, not a traceback."""
    target = f"127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--target", target, "--calls", "2"], cwd=ROOT,
                          env=telemetry_env(collector, "example-client"), capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("client.py: ")]
    assert len(ours) == 1 and target in ours[0], done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpc_server/server.py", "grpc_aio_server/server.py"])
def test_a_server_example_on_a_port_in_use_says_so_instead_of_sharing_it(script: str, collector: Any) -> None:
    """A second example server on a busy port printed "listening" and shared the port with the first (grpc's
    SO_REUSEPORT default), splitting the calls between two servers: now exit 1, one line naming the address."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, str(EXAMPLES / script), "--host", "127.0.0.1", "--port", str(port)],
                              cwd=ROOT, env=telemetry_env(collector, "example-server"), capture_output=True, text=True,
                              timeout=180)
    assert done.returncode == 1 and "listening" not in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "Traceback" not in done.stderr and f"cannot listen on 127.0.0.1:{port}: " in done.stderr
