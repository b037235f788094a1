"""On-demand kernel profiling against the real demo model server under load: the CLI and the admin gRPC
service, real torch.profiler sessions (CPU), real OTLP export into the embedded collector.

Cases: C04 (start/stop twice, in sequence and concurrently), C05 (many rounds in one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from _profiling_support import (
    TOKEN,
    bounded_session_with_strays,
    check_profile_export,
    phase_ranges,
    read_chrome_trace,
    request_ranges,
    serve_with_profiling,
    traces,
    within,
)

from zoomer_serve.config import ConfigError
from zoomer_serve.demo.load import drive_load
from zoomer_serve.demo.model import DLRM, build_model
from zoomer_serve.profiling import AdminConfig, Result, SessionOptions, State, parse_request_label
from zoomer_serve.profiling.client import ProfilerClient, ProfilerControlError
from zoomer_serve.profiling.config import ProfilerConfig

LOAD = {"clients": 2, "batch_size": 8}


@pytest.fixture(scope="module")
def model() -> DLRM:
    torch.set_num_threads(1)
    return build_model(device="cpu")


@pytest.fixture
def profiles_dir(tmp_path: Path) -> Path:
    return tmp_path / "profiles"


def _cli(*args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ZOOMER_ADMIN_TOKEN"}
    if token is not None:
        env["ZOOMER_ADMIN_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "zoomer_serve", "profile", *args], env=env, capture_output=True,
                          text=True, timeout=60)


@contextmanager
def background_load(target: str) -> Iterator[list[Any]]:
    """Load in rounds of 0.5 s on a thread until the block ends; the load results collected so far."""
    stop = threading.Event()
    results: list[Any] = []

    def run() -> None:
        while not stop.is_set():
            results.append(drive_load(target, 0.5, seed=len(results), **LOAD))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield results
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.slow
def test_on_demand_by_cli_links_the_profile_to_the_covered_requests(model: DLRM, telemetry: Any, collector: Any,
                                                                     profiles_dir: Path) -> None:
    with serve_with_profiling(telemetry, model, profiles_dir) as served:
        started = _cli("start", "--target", served.target, "--requests", "20")
        assert started.returncode == 0, started.stderr
        assert "running" in started.stdout
        again = _cli("start", "--target", served.target, "--requests", "5")
        assert again.returncode == 3 and "already running" in again.stdout, again.stderr
        again_json = _cli("start", "--target", served.target, "--requests", "5", "--json")
        assert again_json.returncode == 3 and json.loads(again_json.stdout)["result"] == "already_running"
        load = drive_load(served.target, 30.0, max_requests=60, **LOAD)
        assert load.unexpected == 0
        assert served.controller.wait_idle(60)
        status = _cli("status", "--target", served.target, "--json")
        assert status.returncode == 0, status.stderr
        stopped = _cli("stop", "--target", served.target)
        assert stopped.returncode == 0 and "not running" in stopped.stdout
    info = served.controller.last
    assert info is not None and info.outcome == "done" and info.stop_reason == "max_requests"
    assert info.requests == 20 and info.requests_incomplete == 0
    assert f'"session_id": "{info.session_id}"' in status.stdout
    assert traces(profiles_dir) == [Path(info.trace_path)]
    assert info.trace_path is not None and info.trace_path.endswith("_on_demand_1.pt.trace.json.gz")
    # the session ended on its own before the stop: the stop still names its files and the command to run next
    assert f"    {info.trace_path}\n" in stopped.stdout, stopped.stdout
    assert f"next: zoomer-serve analyze {info.trace_path}" in stopped.stdout, stopped.stdout
    assert telemetry.config.service_name in Path(info.trace_path).name
    data = read_chrome_trace(Path(info.trace_path))
    assert data["zoomer_session_id"] == info.session_id
    ranges = request_ranges(data)
    assert len(ranges) == 20
    _check_phases_nested(data, ranges)
    rows = collector.spans()
    profile = check_profile_export(rows, info.session_id, set(ranges), "on_demand")
    attrs = profile["attributes"]
    assert attrs["zoomer.profile.requests"] == 20 and attrs["zoomer.profile.max_requests"] == 20
    assert attrs["zoomer.profile.trace.path"] == info.trace_path
    assert attrs["zoomer.profile.activities"] == ["cpu"]
    assert attrs["zoomer.profile.annotation.cpu_us"] > 0
    sessions = collector.metric_points("zoomer.profile.sessions")
    assert [(p["attributes"], p["value"]) for p in sessions][-1] == (
        {"zoomer.profile.trigger": "on_demand", "zoomer.profile.outcome": "done"}, 1.0)
    per_method = {p["attributes"]["rpc.method"]: p for p in
                  collector.metric_points("zoomer.profile.request.kernel.duration")}  # the latest point of each
    assert set(per_method) <= {"zoomer.demo.v1.Ranker/Predict", "zoomer.demo.v1.Ranker/PredictStream"}
    assert sum(p["count"] for p in per_method.values()) == 20 and {p["unit"] for p in per_method.values()} == {"s"}


def test_profile_start_help_documents_the_already_running_exit_code(capsys: Any) -> None:
    from zoomer_serve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "start", "--help"])
    assert "3 when a session was already running" in " ".join(capsys.readouterr().out.split())


def _check_phases_nested(data: dict[str, Any], ranges: dict[tuple[int, int], dict[str, Any]]) -> None:
    """Every request range holds the demo's forward phase as a nested range on its thread (phases become
    profiler ranges on worker threads too)."""
    forwards = [ev for ev in data["traceEvents"] if ev.get("cat") == "user_annotation" and ev["name"] == "forward"]
    for ev in ranges.values():
        inside = [f for f in forwards if f["tid"] == ev["tid"] and ev["ts"] <= f["ts"] <= ev["ts"] + ev["dur"]]
        assert inside, f"no forward range inside {ev['name']}"


@pytest.mark.slow
def test_c04_start_and_stop_twice_in_sequence_and_concurrently(model: DLRM, telemetry: Any,
                                                               profiles_dir: Path) -> None:
    """C04: duplicate starts answer already_running, duplicate stops already_stopping / not_running (a waiting
    already_stopping names the trace too); exactly one trace; the server keeps serving."""
    with serve_with_profiling(telemetry, model, profiles_dir) as served, background_load(served.target) as results:
        clients = [ProfilerClient(served.target, token=TOKEN) for _ in range(2)]
        barrier = threading.Barrier(2)

        def start(client: ProfilerClient) -> Result:
            barrier.wait(10)
            return client.start(max_requests=1000, duration_ms=30_000).result

        answers = _in_threads(start, clients)
        assert sorted(a.value for a in answers) == ["already_running", "started"]
        again = clients[0].start(max_requests=10)
        assert again.result is Result.ALREADY_RUNNING and "already running" in again.message
        assert served.controller.wait_idle(0.5) is False  # still running: the duplicates changed nothing

        def stop(client: ProfilerClient) -> Any:
            barrier.wait(10)
            return client.stop(wait_s=30)

        replies = _in_threads(stop, clients)
        answers = [reply.result for reply in replies]
        assert Result.STOPPED in answers
        assert sorted(a.value for a in answers if a is not Result.STOPPED) in (["already_stopping"],
                                                                               ["not_running"])
        paths = {reply.session.trace_path for reply in replies if reply.session is not None}
        assert len(paths) == 1 and None not in paths  # the duplicate waited too and names the same trace
        after = clients[1].stop()
        assert after.result is Result.NOT_RUNNING and after.message.startswith("not running")
        assert after.state is State.IDLE and after.last is not None and after.last.outcome == "done"
        assert served.controller.wait_idle(5)
        assert drive_load(served.target, 10.0, max_requests=10, **LOAD).count(code="OK") == 10  # still serving
        for c in clients:
            c.close()
    assert len(traces(profiles_dir)) == 1
    assert after.last.stop_reason == "stop_call" and after.last.requests > 0
    assert results and sum(r.unexpected for r in results) == 0


class _HoldWriting:
    """A session companion whose ``stop`` (run on the session thread once the session is writing, before the
    profiler stops) blocks until ``release`` is set: keeps a real session in ``writing`` for as long as a test
    needs."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.release = threading.Event()

    def begin(self, session_id: str, folder: Path, max_duration_ms: int) -> Any:
        return self

    def stop(self) -> None:
        if not self.writing.is_set():
            self.writing.set()
            self.release.wait(60)

    def finish(self) -> dict[str, Any]:
        return {}


@pytest.mark.slow
def test_c04_a_stop_while_writing_waits_and_names_the_trace(model: DLRM, telemetry: Any, profiles_dir: Path,
                                                            monkeypatch: Any) -> None:
    """C04: a stop that arrives while the session writes its trace (another stop ended it) waits, as the first
    stop does, and answers already_stopping with the trace path: by the CLI (path, files, next command) and by
    the client; still exactly one trace."""
    from zoomer_serve.profiling.session import Session

    duplicates = threading.Semaphore(0)
    request_stop = Session.request_stop

    def counting_request_stop(self: Session, reason: str) -> bool:
        first = request_stop(self, reason)
        if not first and reason == "stop_call":  # not the session thread's own "duration" call after any stop
            duplicates.release()  # this stop found the session already ending; it waits for it next
        return first

    monkeypatch.setattr(Session, "request_stop", counting_request_stop)
    hold = _HoldWriting()
    with serve_with_profiling(telemetry, model, profiles_dir) as served, \
            ProfilerClient(served.target, token=TOKEN) as first, ProfilerClient(served.target, token=TOKEN) as late:
        served.controller.companions.append(hold)
        assert first.start(max_requests=1000, duration_ms=30_000).result is Result.STARTED
        assert drive_load(served.target, 10.0, max_requests=10, **LOAD).count(code="OK") == 10
        stopping = first.stop(wait_s=0)
        assert stopping.result is Result.STOPPING
        assert hold.writing.wait(30) and served.controller.state is State.WRITING
        answers: dict[str, Any] = {}
        threads = [threading.Thread(target=lambda: answers.update(cli=_cli("stop", "--target", served.target))),
                   threading.Thread(target=lambda: answers.update(client=late.stop(wait_s=30)))]
        for t in threads:
            t.start()
        arrived = [duplicates.acquire(timeout=30) for _ in threads]
        hold.release.set()
        for t in threads:
            t.join(60)
        assert arrived == [True, True]
        assert served.controller.wait_idle(5)
        assert drive_load(served.target, 10.0, max_requests=10, **LOAD).count(code="OK") == 10  # still serving
    info = served.controller.last
    assert info is not None and info.outcome == "done" and info.stop_reason == "stop_call"
    assert info.requests == 10 and info.trace_path is not None
    assert traces(profiles_dir) == [Path(info.trace_path)]
    client_reply = answers["client"]
    assert client_reply.result is Result.ALREADY_STOPPING
    assert client_reply.session is not None and client_reply.session.trace_path == info.trace_path
    assert client_reply.session.outcome == "done" and client_reply.session.requests == 10
    assert f"trace {info.trace_path}" in client_reply.message and "already stopping" in client_reply.message
    cli = answers["cli"]
    assert cli.returncode == 0, cli.stderr
    assert "already stopping" in cli.stdout and f"trace {info.trace_path}" in cli.stdout, cli.stdout
    assert f"    {info.trace_path}\n" in cli.stdout, cli.stdout  # the files it wrote
    assert f"next: zoomer-serve analyze {info.trace_path}" in cli.stdout, cli.stdout


def _in_threads(fn: Any, clients: list[ProfilerClient]) -> list[Any]:
    out: list[Any] = [None, None]

    def run(i: int) -> None:
        out[i] = fn(clients[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.slow
def test_c05_three_rounds_then_a_start_that_cannot_capture(model: DLRM, telemetry: Any,
                                                           profiles_dir: Path) -> None:
    """C05: three rounds (the second ends on its own after N requests), each one new non-empty trace; after the
    automatic stop the next start works; a start that cannot capture is an error, not a silent success."""
    with serve_with_profiling(telemetry, model, profiles_dir) as served, \
            ProfilerClient(served.target, token=TOKEN) as client, background_load(served.target) as results:
        seen: set[Path] = set()
        for round_no, bound in enumerate((None, 12, None), start=1):
            reply = client.start(max_requests=bound or 1000, duration_ms=None if bound else 30_000)
            assert reply.result is Result.STARTED and reply.session is not None
            if bound is None:
                served.controller.wait_idle(1.0)  # let requests flow
                stopped = client.stop(wait_s=60)
                assert stopped.result is Result.STOPPED
            else:
                assert client.wait_finished(reply.session.number, 60) is not None
            info = client.status().last
            assert info is not None and info.number == round_no and info.outcome == "done"
            assert info.stop_reason == ("stop_call" if bound is None else "max_requests")
            if bound is not None:
                assert info.requests == bound and info.requests_incomplete == 0
            new = set(traces(profiles_dir)) - seen
            assert new == {Path(info.trace_path)}
            assert len(request_ranges(read_chrome_trace(Path(info.trace_path)))) == info.requests > 0
            seen |= new
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            with pytest.raises(ProfilerControlError) as busy:
                client.start(max_requests=5)
        assert busy.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "another torch.profiler session" in busy.value.details
        assert client.status().state is State.IDLE
    assert sum(r.unexpected for r in results) == 0
    blocked = profiles_dir.parent / "not-a-folder"
    blocked.write_text("a file where the profiles folder should be")
    with pytest.raises(ConfigError, match="profiles_dir .*not-a-folder.* is a file, not a folder"):
        ProfilerConfig(profiles_dir=blocked)  # known at start-up
    with serve_with_profiling(telemetry, model, blocked / "profiles") as served2, \
            ProfilerClient(served2.target, token=TOKEN) as client2:
        with pytest.raises(ProfilerControlError) as unwritable:
            client2.start(max_requests=5)
        assert unwritable.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "cannot start a profiling session" in unwritable.value.details
    assert len(traces(profiles_dir)) == 3


@pytest.mark.slow
def test_admin_refuses_a_missing_or_wrong_token(model: DLRM, telemetry: Any, profiles_dir: Path) -> None:
    with serve_with_profiling(telemetry, model, profiles_dir) as served:
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("", grpc.StatusCode.UNAUTHENTICATED),
                            ("wrong-token", grpc.StatusCode.PERMISSION_DENIED),
                            (TOKEN + "x", grpc.StatusCode.PERMISSION_DENIED)):
            with ProfilerClient(served.target, token=token or "") as client:
                for call in (lambda c: c.start(max_requests=5), lambda c: c.stop(), lambda c: c.status()):
                    with pytest.raises(ProfilerControlError) as err:
                        call(client)
                    assert err.value.code is code
        refused = _cli("start", "--target", served.target, token=None)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        assert served.controller.state is State.IDLE and served.controller.last is None
    closed = AdminConfig()  # no token configured: closed even to loopback callers
    with serve_with_profiling(telemetry, model, profiles_dir, admin=closed) as served, \
            ProfilerClient(served.target, token=TOKEN) as client:
        with pytest.raises(ProfilerControlError) as err:
            client.status()
        assert err.value.code is grpc.StatusCode.PERMISSION_DENIED and "ZOOMER_ADMIN_TOKEN" in err.value.details
    opened = AdminConfig(open_loopback=True)
    with serve_with_profiling(telemetry, model, profiles_dir, admin=opened) as served, \
            ProfilerClient(served.target, token="") as client:
        assert client.status().state is State.IDLE
    assert traces(profiles_dir) == []


@pytest.mark.slow
def test_a_controller_given_to_add_profiler_control_observes_the_requests(model: DLRM, telemetry: Any,
                                                                         profiles_dir: Path) -> None:
    """``add_profiler_control(server, ProfilerController())``, as docs/profiling.md shows it, without
    ``.attach()``: every session said "running" and covered no request (30 calls served, ``requests=0``, a trace
    with no request ranges), and nothing said why. Registering the admin service attaches the controller."""
    with serve_with_profiling(telemetry, model, profiles_dir, attach=False) as served, \
            ProfilerClient(served.target, token=TOKEN) as client:
        assert client.start(max_requests=5).result is Result.STARTED
        load = drive_load(served.target, 30.0, max_requests=12, **LOAD)
        assert load.unexpected == 0
        assert served.controller.wait_idle(60)
    info = served.controller.last
    assert info is not None and info.stop_reason == "max_requests" and info.requests == 5


@pytest.mark.slow
def test_outside_a_session_requests_make_no_profiler_calls(model: DLRM, telemetry: Any, profiles_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"record_function": 0, "increment_step": 0}
    real_rf = torch.profiler.record_function
    real_step = torch.autograd.profiler.KinetoStepTracker.increment_step

    def counting_rf(*args: Any, **kwargs: Any) -> Any:
        calls["record_function"] += 1
        return real_rf(*args, **kwargs)

    def counting_step(requester: str) -> int:
        calls["increment_step"] += 1
        return real_step(requester)

    monkeypatch.setattr(torch.profiler, "record_function", counting_rf)
    monkeypatch.setattr(torch.autograd.profiler.KinetoStepTracker, "increment_step", staticmethod(counting_step))
    with serve_with_profiling(telemetry, model, profiles_dir) as served:
        idle = drive_load(served.target, 10.0, max_requests=20, **LOAD)
        assert idle.total_calls == 20 and calls == {"record_function": 0, "increment_step": 0}
        served.controller.start(SessionOptions(max_requests=10))
        drive_load(served.target, 10.0, max_requests=30, **LOAD)
        assert served.controller.wait_idle(60)
    assert served.controller.last is not None and served.controller.last.requests == 10
    assert calls["increment_step"] == 10
    assert calls["record_function"] >= 10  # the request ranges, plus the phases inside them


@pytest.mark.slow
def test_a_request_rejected_before_any_torch_work_is_covered_with_no_ops(model: DLRM, telemetry: Any,
                                                                         collector: Any, profiles_dir: Path) -> None:
    """A covered request that the demo rejects while checking counts (INVALID_ARGUMENT before any tensor is
    built) has a request range with no operators in it: its ``zoomer.profile.request`` child says 0 CPU ops, and
    the export checks accept it. (The steady-state trigger test failed this check once in a fresh clone's run;
    its load is 2 % invalid requests, and this is the failure such a request in its session gives.)"""
    import numpy as np

    from zoomer_serve.demo import ranker_pb2_grpc
    from zoomer_serve.demo.load import InvalidKind, make_request

    rng = np.random.default_rng(3)
    with serve_with_profiling(telemetry, model, profiles_dir) as served:
        assert served.controller.start(SessionOptions(max_requests=2)).session is not None
        with grpc.insecure_channel(served.target) as channel:
            stub = ranker_pb2_grpc.RankerStub(channel)
            with pytest.raises(grpc.RpcError) as rejected:
                stub.Predict(make_request(rng, 4, invalid_kind=InvalidKind.EMPTY_BATCH), timeout=30)
            assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(stub.Predict(make_request(rng, 4), timeout=30).scores) == 4
        assert served.controller.wait_idle(60)
    info = served.controller.last
    assert info is not None and info.outcome == "done" and info.requests == 2
    ranges = request_ranges(read_chrome_trace(Path(info.trace_path)))
    rows = collector.spans()
    check_profile_export(rows, info.session_id, set(ranges), "on_demand")
    servers = {r["span_id"]: r for r in rows if r["kind"] == "SERVER"}
    ops = {servers[c["parent_span_id"]]["attributes"]["rpc.response.status_code"]:
           c["attributes"]["zoomer.profile.cpu_op.count"] for c in rows if c["name"] == "zoomer.profile.request"}
    assert ops["INVALID_ARGUMENT"] == 0 and ops["OK"] > 0, ops


@pytest.mark.slow
def test_aio_demo_operators_in_the_executor_belong_to_their_request(model: DLRM, telemetry: Any, collector: Any,
                                                                    profiles_dir: Path) -> None:
    """On the grpc.aio demo server a request's range opens on the event loop's thread, while its model runs in
    ``asyncio.to_thread`` on an executor thread. Each phase there opens the request's range on that thread too,
    so the request's operators (and, on a GPU, their kernels) are attributed to it: every OK request's
    ``zoomer.profile.request`` child counts CPU operators, and its range time is the loop thread's range (the
    executor's ranges lie inside it and are not added on top). The two callers' requests interleave on the loop
    thread, opening and closing their ranges out of order: once all ended, no thread is left marked as running
    one for the CPU sampler (a request was left marked on the loop's thread, gone with the test, and a later
    thread with its ident had its samples labelled with that request)."""
    import numpy as np

    from zoomer_serve.demo import ranker_pb2_grpc
    from zoomer_serve.demo.aio_server import aio_server_in_thread
    from zoomer_serve.demo.load import make_request
    from zoomer_serve.profiling import ProfilerConfig, ProfilerController
    from zoomer_serve.profiling.labels import THREAD_REQUESTS
    from zoomer_serve.profiling.summary import summarize_events

    controller = ProfilerController(ProfilerConfig(profiles_dir=profiles_dir), telemetry).attach()
    try:
        with aio_server_in_thread(model, grace_s=1.0) as port:
            assert controller.start(SessionOptions(max_requests=6)).session is not None

            def call(seed: int) -> None:
                rng = np.random.default_rng(seed)
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = ranker_pb2_grpc.RankerStub(channel)
                    for _ in range(3):
                        assert len(stub.Predict(make_request(rng, 8), timeout=30).scores) == 8

            callers = [threading.Thread(target=call, args=(seed,)) for seed in (1, 2)]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join(60)
            assert controller.wait_idle(60)
    finally:
        controller.close(timeout_s=60)
    info = controller.last
    assert info is not None and info.outcome == "done" and info.requests == 6
    assert THREAD_REQUESTS == {}
    data = read_chrome_trace(Path(info.trace_path))
    ranges: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for ev in data["traceEvents"]:
        if ev.get("ph") == "X" and ev.get("cat") == "user_annotation":
            ids = parse_request_label(ev["name"])
            if ids is not None:
                ranges.setdefault(ids, []).append(ev)
    assert len(ranges) == 6
    check_profile_export(collector.spans(), info.session_id, set(ranges), "on_demand")
    summary = summarize_events(data["traceEvents"])
    assert set(summary.requests) == set(ranges)
    for ids, evs in ranges.items():
        assert len({ev["tid"] for ev in evs}) >= 2, evs  # the loop thread's range and the executor's
        outer = max(evs, key=lambda ev: ev["dur"])
        for ev in evs:  # the executor's ranges lie inside the loop thread's
            assert outer["ts"] <= ev["ts"] and ev["ts"] + ev["dur"] <= outer["ts"] + outer["dur"] + 1e-3, evs
        profile = summary.requests[ids]
        assert profile.cpu_op_count > 0, ids
        assert profile.start_us == outer["ts"] and profile.duration_us == pytest.approx(outer["dur"], abs=1e-3)


def test_request_marks_for_the_cpu_sampler_may_close_in_any_order() -> None:
    """The marks the in-process CPU sampler labels samples with, as an asyncio server's interleaved requests
    leave them on the loop's thread: A opens, B opens, A closes (the thread still runs B), B closes (nothing is
    left); and in the usual nested order. Restoring "the mark replaced" on close left A marked after both."""
    from zoomer_serve.profiling.labels import THREAD_REQUESTS, enter_thread_request, exit_thread_request

    me = threading.get_ident()
    a = enter_thread_request(1, 1, "svc.S/A")
    b = enter_thread_request(2, 2, "svc.S/B")
    assert THREAD_REQUESTS[me][2] == "svc.S/B"
    exit_thread_request(a)
    assert THREAD_REQUESTS[me][2] == "svc.S/B"
    exit_thread_request(b)
    assert me not in THREAD_REQUESTS
    a = enter_thread_request(1, 1, "svc.S/A")
    b = enter_thread_request(2, 2, "svc.S/B")
    exit_thread_request(b)
    assert THREAD_REQUESTS[me] == (f"{1:032x}", f"{1:016x}", "svc.S/A")
    exit_thread_request(a)
    assert me not in THREAD_REQUESTS


def test_profile_cli_against_a_server_without_the_admin_service_says_what_is_missing() -> None:
    """A gRPC server that serves no ProfilerControl (a user's own server, not yet given add_profiler_control)
    answers UNIMPLEMENTED "Method not found!"; the CLI says which service is missing and how to add it."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done = _cli("status", "--target", f"127.0.0.1:{port}")
    finally:
        server.stop(0)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zoomer-serve profile: UNIMPLEMENTED"), done.stderr
    assert f"127.0.0.1:{port} does not serve the ProfilerControl admin service" in lines[0]
    assert "add_profiler_control" in lines[0]


@pytest.mark.slow
def test_a_request_bounded_session_records_the_phases_of_its_requests_only(model: DLRM, telemetry: Any,
                                                                           profiles_dir: Path) -> None:
    """A session of 5 requests while 11 were served (3 while its profiler started, 3 after the 5th, before the
    profiler stopped) held 5 request ranges but 11 of each phase range (``preprocess``, ``forward``,
    ``postprocess``), the extra ones outside every request range, so ``analyze`` counted 11 forwards for a
    5-request session. Every phase range belongs to one of the session's requests."""
    import numpy as np

    from zoomer_serve.demo import ranker_pb2_grpc
    from zoomer_serve.demo.load import make_request

    rng = np.random.default_rng(5)
    with serve_with_profiling(telemetry, model, profiles_dir) as served, \
            grpc.insecure_channel(served.target) as channel:
        stub = ranker_pb2_grpc.RankerStub(channel)

        def send(n: int) -> None:
            for _ in range(n):
                assert len(stub.Predict(make_request(rng, 4), timeout=30).scores) == 4

        info = bounded_session_with_strays(served.controller, send, bound=5, strays=3)
    assert info is not None and info.outcome == "done" and info.requests == 5
    data = read_chrome_trace(Path(info.trace_path))
    ranges = request_ranges(data)
    assert len(ranges) == 5
    phases = phase_ranges(data)
    assert {name: sum(ev["name"] == name for ev in phases) for name in ("preprocess", "forward", "postprocess")} \
        == {"preprocess": 5, "forward": 5, "postprocess": 5}
    assert all(any(within(ev, r) for r in ranges.values()) for ev in phases)
