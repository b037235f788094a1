"""locust's distributed mode with the zoomer plugin: a real master and two workers, each its own
``locust`` process on 127.0.0.1 as a user starts them, against the demo Ranker (``zoomer-serve serve-demo``)
exporting to the test's embedded collector; the workers' CLIENT spans go there too, each worker with its own
``service.instance.id``. Options and user classes are given on the master only."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from _example_processes import Program, free_port, start, telemetry_env

from interceptors import ZoomerServerInterceptor
from zoomer_serve.processes import start_zoomer_command, stop_process

LOCUSTFILE = "benchmarks/locustfile.py"
SLOW_LOCUSTFILE = "tests/_slow_locustfile.py"
SLOW_START_LOCUSTFILE = "tests/_slow_start_locustfile.py"
QUIET_LOCUSTFILE = "tests/_quiet_locustfile.py"
PREDICT = "zoomer.demo.v1.Ranker/Predict"
PREDICT_STREAM = "zoomer.demo.v1.Ranker/PredictStream"
SERVER_SERVICE = "zoomer-demo-ranker"
TOKEN = "distributed-test-token-3c1e"


@dataclass
class Cluster:
    """A finished run: the exit codes and output of the master and of each worker, the master's summary."""

    master_rc: int
    master_output: str
    worker_rcs: list[int]
    worker_outputs: list[str]
    summary: dict[str, Any] | None

    def everything(self) -> str:
        """The master's last output and each worker's whole output, for an assertion's message."""
        return "\n=====\n".join([self.master_output[-6000:], *self.worker_outputs])


def run_cluster(master_args: list[str], env: dict[str, str], tmp_path: Path, host: str,
                worker_locustfile: str = LOCUSTFILE, run_s: int = 4, locustfile: str = LOCUSTFILE,
                once_spawned: Callable[[Program, list[Program]], None] | None = None) -> Cluster:
    """``locust --master --headless --expect-workers 2`` and two ``locust --worker`` processes; waits for
    all three (generous limits: on a loaded 2-core machine each imports torch and the model's requests). A master
    that could not bind its port (taken between :func:`free_port` and locust's bind) is started again, on
    another port, up to twice. ``once_spawned(master, workers)`` is called once the master says that spawning
    is complete (every worker reported its users, or on a loaded machine its wait for those reports ran out)."""
    for attempt in range(3):
        cluster = _run_cluster_once(master_args, env, tmp_path, host, worker_locustfile, run_s, locustfile,
                                    once_spawned)
        lost_bind = cluster.master_rc != 0 and "Address already in use" in cluster.master_output
        if not lost_bind or attempt == 2:
            break
    return cluster


def _run_cluster_once(master_args: list[str], env: dict[str, str], tmp_path: Path, host: str,
                      worker_locustfile: str, run_s: int, locustfile: str,
                      once_spawned: Callable[[Program, list[Program]], None] | None) -> Cluster:
    port = free_port()
    summary_json = tmp_path / "summary.json"
    master = start(["-m", "locust", "-f", locustfile, "--master", "--headless", "--expect-workers", "2",
                    "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port), "--host", host,
                    "--users", "4", "--spawn-rate", "4", "--run-time", f"{run_s}s", "--stop-timeout", "10",
                    "--only-summary", "--zoomer-quiet", "--zoomer-summary-json", str(summary_json), *master_args],
                   env)
    workers = [start(["-m", "locust", "-f", worker_locustfile, "--worker", "--master-host", "127.0.0.1",
                      "--master-port", str(port)], env) for _ in range(2)]
    try:
        if once_spawned is not None:
            _wait_for_spawning(master)
            once_spawned(master, workers)
        master_rc = _wait(master, 300)
        if master_rc != 0 and "Address already in use" in master.output:
            worker_rcs = [worker.stop(signal.SIGKILL) for worker in workers]  # no master to wait for
        else:
            worker_rcs = [_wait(worker, 60) for worker in workers]
    finally:
        for program in (master, *workers):
            if program.proc.poll() is None:
                program.stop(signal.SIGKILL)
    summary = json.loads(summary_json.read_text()) if summary_json.is_file() else None
    return Cluster(master_rc, master.output, worker_rcs, [w.output for w in workers], summary)


def _wait_for_spawning(master: Program, timeout_s: float = 240) -> None:
    """Until ``master`` says that spawning is complete."""
    deadline = time.monotonic() + timeout_s
    while not any(done in master.output for done in ("All users spawned", "Spawning is complete")):
        assert time.monotonic() < deadline and master.proc.poll() is None, master.output[-4000:]
        time.sleep(0.05)


def _wait(program: Program, timeout_s: float) -> int:
    """The exit code of ``program`` once it ends by itself (killed after ``timeout_s``: -9), after its last
    output is read."""
    import subprocess

    try:
        program.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    return program.stop(signal.SIGKILL)


def start_server(collector: Any, transport: str, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    env = telemetry_env(collector, SERVER_SERVICE, ZOOMER_ADMIN_TOKEN=TOKEN)
    return start_zoomer_command(["serve-demo", "--port", "0", "--transport", transport, "--profiles-dir",
                                 str(tmp_path / "profiles")], env, "demo model server", timeout_s=240)


def counted_by_worker(rows: list[dict[str, Any]], methods: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Per ``service.instance.id`` of the load generator: its CLIENT spans and the server's spans whose
    parent is one of them, of ``methods``."""
    clients = {(r["trace_id"], r["span_id"]): r for r in rows if r["kind"] == "CLIENT"
               and r["attributes"].get("rpc.method") in methods}
    counts: dict[str, dict[str, int]] = {}
    for client in clients.values():
        instance = client["resource_attributes"]["service.instance.id"]
        counts.setdefault(instance, {"client": 0, "server": 0})["client"] += 1
    for row in rows:
        if row["kind"] == "SERVER" and row["service_name"] == SERVER_SERVICE and \
                row["attributes"]["rpc.method"] in methods:
            parent = clients[(row["trace_id"], row["parent_span_id"])]
            counts[parent["resource_attributes"]["service.instance.id"]]["server"] += 1
    return counts


CASES = {
    "grpc": ("grpc", [], {"grpc": (PREDICT, PREDICT_STREAM)}),
    "thrift option on the master": ("thrift", ["--zoomer-transport", "thrift"], {"thrift": (PREDICT,)}),
    "thrift user class named on the master": ("thrift", ["RankerThriftUser"], {"thrift": (PREDICT,)}),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_a_master_and_two_workers_run_the_transport_chosen_on_the_master_and_count_what_the_server_served(
        collector: Any, tmp_path: Path, case: str) -> None:
    """The transport (option or user class) chosen on the master reaches both workers; what locust reports
    equals what the server's spans count, in all and per method, and per worker (its CLIENT spans'
    ``service.instance.id``)."""
    transport, master_args, expected = CASES[case]
    proc, ready = start_server(collector, transport, tmp_path)
    try:
        run = run_cluster([*master_args, "--zoomer-no-profile"], telemetry_env(collector), tmp_path,
                          f"127.0.0.1:{ready['port']}")
    finally:
        assert stop_process(proc, 60) == 0
    assert run.master_rc == 0, run.master_output[-4000:]
    assert run.worker_rcs == [0, 0], [out[-2000:] for out in run.worker_outputs]
    assert run.summary is not None
    client = {(c["request_type"], c["name"]): c for c in run.summary["client"] if c["name"] != "Aggregated"}
    methods = next(iter(expected.values()))
    assert set(client) == {(kind, m) for kind, names in expected.items() for m in names}
    assert all(c["count"] > 0 and c["failures"] == 0 for c in client.values()), client
    rows = collector.spans()
    served = [r for r in rows if r["kind"] == "SERVER" and r["service_name"] == SERVER_SERVICE]
    assert {r["attributes"]["rpc.system.name"] for r in served} == {transport}
    for (_, name), entry in client.items():
        assert len([r for r in served if r["attributes"]["rpc.method"] == name]) == entry["count"], name
    by_worker = counted_by_worker(rows, methods)
    assert len(by_worker) == 2, by_worker  # both workers sent load
    assert all(c["client"] == c["server"] > 0 for c in by_worker.values()), by_worker
    assert sum(c["server"] for c in by_worker.values()) == sum(c["count"] for c in client.values())


WORKERS_WITHOUT_THE_USER_CLASS = {
    # locust exits a worker 2 after an unhandled error, but 1 when the error came while its init handlers
    # ran: a master sends users to a worker still starting (on a loaded machine the example's start, which
    # starts the export helper, can take seconds), so either code can come.
    "the example's locustfile": ("examples/locust_own_service/locustfile.py", {1, 2}),
    "a locustfile that starts slowly": (SLOW_START_LOCUSTFILE, {1}),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", list(WORKERS_WITHOUT_THE_USER_CLASS))
def test_workers_that_fail_make_the_master_fail_and_a_run_without_requests_is_never_profiled(
        collector: Any, tmp_path: Path, workers: str) -> None:
    """Workers that lack the user class the master names fail at spawning (locust: KeyError; exit 2, or 1
    when it came during their start, which ends them, before their first report on a loaded machine); the
    master, which sent nothing, exits 1 naming both (one that died unreported: missing, no heartbeat; it
    does not wait out the last-report limit for the dead), and its steady-state trigger, whose warm-up time
    passed, never starts a profiling session (it waits for a first request)."""
    worker_locustfile, exit_codes = WORKERS_WITHOUT_THE_USER_CLASS[workers]
    proc, ready = start_server(collector, "grpc", tmp_path)
    try:
        run = run_cluster(["RankerGrpcUser", "--zoomer-warmup-s", "0.5", "--zoomer-profile-requests", "5",
                           "--zoomer-target", f"127.0.0.1:{ready['admin_port']}"],
                          telemetry_env(collector, ZOOMER_ADMIN_TOKEN=TOKEN), tmp_path,
                          f"127.0.0.1:{ready['port']}", worker_locustfile=worker_locustfile)
    finally:
        assert stop_process(proc, 60) == 0
    everything = run.everything()
    assert all(rc in exit_codes for rc in run.worker_rcs), (run.worker_rcs, everything)
    assert all("KeyError: 'RankerGrpcUser'" in out for out in run.worker_outputs), everything
    assert run.master_rc == 1, everything
    failed = re.findall(r"worker (\S+) failed: (an unhandled error|it went missing)", run.master_output)
    assert len({worker for worker, _ in failed}) == 2 == len(failed), everything
    for worker, why in failed:  # a worker that ended unreported (exit 1 at its start) went missing
        assert why == "an unhandled error" or f"Worker {worker} failed to send heartbeat" in run.master_output
    if exit_codes == {1}:  # both ended at their start, after their report; not waited for at the end
        assert "no last report from" not in run.master_output, everything
    assert "the run failed: 2 worker(s) failed; no request was sent (exit code 1)" in run.master_output
    assert run.summary is not None
    profile = run.summary["profile"]
    assert profile["state"] == "warming" and "0 of 1 requests" in profile["reason"], profile
    assert profile["session"] is None
    rows = collector.spans()
    assert [r for r in rows if r["name"] == "zoomer.profile"] == []
    assert [r for r in rows if r["kind"] == "SERVER"] == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_killed_during_the_run_makes_the_master_fail_without_waiting_for_its_last_report(
        collector: Any, tmp_path: Path) -> None:
    """A worker killed (SIGKILL) while its users call: locust's master marks it missing (no heartbeat) and
    goes on with the other; at the end the master names it failed (it went missing before its last report)
    instead of waiting the whole last-report limit for it and exiting 0, and exits 1; the other worker's
    requests are in the figures."""
    proc, ready = start_server(collector, "grpc", tmp_path)
    try:
        run = run_cluster(["--zoomer-no-profile"], telemetry_env(collector), tmp_path, f"127.0.0.1:{ready['port']}",
                          run_s=10, once_spawned=lambda master, workers: workers[0].proc.kill())
    finally:
        assert stop_process(proc, 60) == 0
    everything = run.everything()
    assert run.worker_rcs == [-9, 0], (run.worker_rcs, everything)
    assert run.master_rc == 1, everything
    failed = re.findall(r"worker (\S+) failed: (.*)", run.master_output)
    assert len(failed) == 1 and failed[0][1].startswith("it went missing (no heartbeat"), everything
    assert f"Worker {failed[0][0]} failed to send heartbeat" in run.master_output
    assert "no last report from" not in run.master_output, everything
    assert "the run failed: 1 worker(s) failed (exit code 1)" in run.master_output, everything
    assert run.summary is not None
    reported = sum(c["count"] for c in run.summary["client"] if c["name"] != "Aggregated")
    rows = collector.spans()
    served = [r for r in rows if r["kind"] == "SERVER" and r["service_name"] == SERVER_SERVICE]
    # every call the master counts was served (the killed worker's calls after its last report were served too,
    # uncounted); the surviving worker's client spans and the server spans under them match one for one (the
    # killed worker's last client spans died with it: their server spans have no parent in the store)
    assert 0 < reported <= len(served), (reported, len(served))
    clients = {(r["trace_id"], r["span_id"]): r["resource_attributes"]["service.instance.id"] for r in rows
               if r["kind"] == "CLIENT"}
    per_instance = {i: [sum(1 for v in clients.values() if v == i), 0] for i in set(clients.values())}
    for row in served:
        instance = clients.get((row["trace_id"], row["parent_span_id"]))
        if instance is not None:
            per_instance[instance][1] += 1
    assert 1 <= len(per_instance) <= 2, per_instance  # the killed one may have exported no client span at all
    assert any(n_client == n_server > 0 for n_client, n_server in per_instance.values()), per_instance


@contextmanager
def slow_server(telemetry: Any, latency_s: float) -> Iterator[str]:
    """``/test.Slow/Call`` (raw bytes back after ``latency_s``) with the zoomer interceptor; its target."""
    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        time.sleep(latency_s)
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         interceptors=[ZoomerServerInterceptor(telemetry.recorder)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Slow", {"Call": grpc.unary_unary_rpc_method_handler(call)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_calls_that_end_during_the_graceful_stop_are_in_the_masters_figures(collector: Any, telemetry: Any,
                                                                           tmp_path: Path) -> None:
    """With --stop-timeout, locust's workers let their calls in flight finish when the test ends; locust's
    headless master waited only 0.5 s for their last reports, so the calls that ended later (here every
    call in flight at the end: each takes 1.5 s) were missing from its figures. The master now collects
    every worker's last report first."""
    with slow_server(telemetry, latency_s=1.5) as target:
        run = run_cluster(["--zoomer-no-profile"], telemetry_env(collector), tmp_path, target,
                          worker_locustfile=SLOW_LOCUSTFILE, locustfile=SLOW_LOCUSTFILE)
    assert run.master_rc == 0 and run.worker_rcs == [0, 0], run.master_output[-4000:]
    assert run.summary is not None
    client = {c["name"]: c for c in run.summary["client"]}
    served = [r for r in collector.spans("SERVER") if r["attributes"]["rpc.method"] == "test.Slow/Call"]
    assert client["test.Slow/Call"]["failures"] == 0
    assert client["test.Slow/Call"]["count"] == len(served) > 0


def _terminate_after(delay_s: float) -> Callable[[Program, list[Program]], None]:
    def terminate(master: Program, workers: list[Program]) -> None:
        time.sleep(delay_s)
        master.proc.send_signal(signal.SIGTERM)

    return terminate


@pytest.mark.timeout(600)
def test_a_master_stopped_by_sigterm_counts_the_workers_last_reports_before_it_decides(
        collector: Any, telemetry: Any, tmp_path: Path) -> None:
    """SIGTERM to the master while its workers' users call (their own statistics reports not due yet): locust
    decided the exit code from the reports received so far, none, so the master said that no request was
    sent and exited 1 (as a master stopped within a worker's first 3 s report interval did). It now collects
    the workers' last reports first: exit 0, and its figures equal what the server served."""
    with slow_server(telemetry, latency_s=0.01) as target:
        run = run_cluster(["--zoomer-no-profile"], telemetry_env(collector), tmp_path, target, run_s=120,
                          worker_locustfile=QUIET_LOCUSTFILE, locustfile=QUIET_LOCUSTFILE,
                          once_spawned=_terminate_after(2.0))
    everything = run.everything()
    assert "Got SIGTERM signal" in run.master_output, everything
    assert "no request was sent" not in run.master_output, everything
    assert run.master_rc == 0 and run.worker_rcs == [0, 0], (run.master_rc, run.worker_rcs, everything)
    assert run.summary is not None
    client = {c["name"]: c for c in run.summary["client"]}
    served = [r for r in collector.spans("SERVER") if r["attributes"]["rpc.method"] == "test.Slow/Call"]
    assert client["test.Slow/Call"]["failures"] == 0
    assert client["test.Slow/Call"]["count"] == len(served) > 0, (client, len(served))
