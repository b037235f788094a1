"""C05, many rounds: thirty on-demand profiling rounds in one real ``zoomer-serve serve-demo`` process (demo
DLRM, sync gRPC server, admin service on its port, telemetry exported to the test's collector) driven through
the admin API do not grow the server's resident memory (RSS, from ``/proc/<pid>/status``) by more than 20 MB
after the fifth round. A thread per session grew it by about 40 MB per round (see
:mod:`zoomer_serve.profiling.worker`)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _profiling_support import TOKEN, serve_with_profiling

from zoomer_serve.demo.load import drive_load
from zoomer_serve.demo.model import build_model
from zoomer_serve.processes import wait_for_event
from zoomer_serve.profiling import Result, SessionOptions, State
from zoomer_serve.profiling.client import ProfilerClient
from zoomer_serve.profiling.worker import SessionWorker

ROUNDS = 30
SETTLED_ROUND = 5  # rounds before this one may still grow (first sessions, lazily built state)
MAX_GROWTH_MB = 20.0
REQUESTS = 10  # per round: short rounds
LOAD = {"clients": 2, "batch_size": 8, "stream_share": 0.0, "invalid_share": 0.0}


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS line in /proc/{pid}/status")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads RSS from /proc (Linux)")
# about 25 s alone; each round starts child processes (trace and CPU-profile post-processing, py-spy), and 300 s
# ran out at load 22
@pytest.mark.timeout(900)
@pytest.mark.slow
def test_thirty_profiling_rounds_do_not_grow_the_server_rss(collector: Any, tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    env = {k: v for k, v in os.environ.items() if k != "ZOOMER_ADMIN_TOKEN"}
    env.update(ZOOMER_ADMIN_TOKEN=TOKEN, OTEL_EXPORTER_OTLP_ENDPOINT=collector.grpc_endpoint,
               OTEL_SERVICE_NAME="ranker-memory", OTEL_BSP_SCHEDULE_DELAY="200")
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", "serve-demo", "--port", "0", "--profiles-dir",
                             str(profiles)], stdout=subprocess.PIPE, env=env)
    rss: list[float] = []
    try:
        ready = wait_for_event(proc, "ready", 120)
        assert ready is not None, "serve-demo did not start"
        target = f"127.0.0.1:{ready['port']}"
        assert drive_load(target, 60.0, max_requests=4 * REQUESTS, **LOAD).unexpected == 0  # warm-up
        with ProfilerClient(target, token=TOKEN) as client:
            for number in range(1, ROUNDS + 1):
                reply = client.start(max_requests=REQUESTS)
                assert reply.session is not None and reply.session.number == number
                assert drive_load(target, 60.0, max_requests=REQUESTS, **LOAD).unexpected == 0
                info = client.wait_finished(number, 60)
                assert info is not None and info.outcome == "done" and info.requests == REQUESTS, info
                rss.append(rss_mb(proc.pid))
        proc.send_signal(signal.SIGTERM)
        assert wait_for_event(proc, "stopped", 90) is not None
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    per_round = ", ".join(f"{mb:.0f}" for mb in rss)
    growth = max(rss[SETTLED_ROUND:]) - rss[SETTLED_ROUND - 1]
    assert growth <= MAX_GROWTH_MB, f"RSS grew {growth:.1f} MB after round {SETTLED_ROUND} (MB per round: {per_round})"
    sessions = [r for r in collector.spans() if r["name"] == "zoomer.profile"]
    assert len(sessions) == ROUNDS and all(len(r["links"]) == REQUESTS for r in sessions)
    assert len(list(profiles.glob("*.pt.trace.json.gz"))) == ROUNDS


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(device="cpu")


@pytest.mark.slow
def test_every_session_runs_on_one_thread_and_a_start_from_the_end_callback_does_not_wait(
        model: Any, telemetry: Any, tmp_path: Path) -> None:
    """Three sessions of one controller run on the same (named) thread; no thread is left per session; an
    ``on_session_end`` callback (which runs on that thread) that starts the next session gets ``started`` at
    once instead of waiting for a session that can only start after the callback returns."""
    ran_on: list[threading.Thread] = []
    chained: list[Any] = []
    ended: queue.Queue[int] = queue.Queue()
    others = {t for t in threading.enumerate() if t.name.startswith("zoomer-profile")}  # earlier tests' controllers
    with serve_with_profiling(telemetry, model, tmp_path / "profiles") as served:
        controller = served.controller

        def chain(info: Any) -> None:
            ran_on.append(threading.current_thread())
            if info.number == 2:
                chained.append(controller.start(SessionOptions(max_requests=REQUESTS, cuda=False)))
            ended.put(info.number)

        controller.on_session_end.append(chain)
        for number in (1, 2):
            assert controller.start(SessionOptions(max_requests=REQUESTS, cuda=False)).result is Result.STARTED
            assert drive_load(served.target, 60.0, max_requests=REQUESTS, **LOAD).unexpected == 0
            assert ended.get(timeout=60) == number
        assert len(chained) == 1 and chained[0].result is Result.STARTED and chained[0].session.number == 3
        deadline = time.monotonic() + 30
        while controller.state is not State.RUNNING and time.monotonic() < deadline:  # armed: not covering yet
            time.sleep(0.01)
        assert drive_load(served.target, 60.0, max_requests=REQUESTS, **LOAD).unexpected == 0
        assert ended.get(timeout=60) == 3
        assert controller.last is not None and controller.last.number == 3 and controller.last.outcome == "done"
        assert [t for t in threading.enumerate() if t.name.startswith("zoomer-profile") and t not in others
                ] == ran_on[:1]
    assert len(ran_on) == 3 and len(set(ran_on)) == 1 and ran_on[0].name == "zoomer-profile"
    assert not ran_on[0].is_alive()  # the controller's close ended it


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_gets_its_own_session_thread() -> None:
    """The parent's worker thread does not exist in a forked child: the child's first task starts one there
    (and the parent's keeps running its own)."""
    worker = SessionWorker("zoomer-profile")
    ran = threading.Event()
    worker.submit(ran.set)
    assert ran.wait(10)
    parent_thread = worker.thread
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, exit code and one byte only
        code = 1
        try:
            done = threading.Event()
            worker.submit(lambda: (os.write(write_end, b"k" if worker.on_thread() else b"x"), done.set()))
            code = 0 if done.wait(10) and worker.close(10) else 2
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.read(read_end, 1) == b"k"
    os.close(read_end)
    assert worker.thread is parent_thread and parent_thread is not None and parent_thread.is_alive()
    ran.clear()
    worker.submit(ran.set)
    assert ran.wait(10) and worker.close(10) and worker.thread is None


@pytest.mark.timeout(900)  # three model servers start side by side: about 30 s alone, 100 s at load 13
@pytest.mark.slow
def test_the_memory_benchmark_runs_every_variant_side_by_side() -> None:
    """``benchmarks/profiling_memory.py`` in two short rounds: one JSON object with each variant's RSS per round
    (what RESULTS.md's table is made of)."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "profiling_memory.py"
    done = subprocess.run([sys.executable, str(bench), "--rounds", "2", "--requests", "4", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert (result["rounds"], result["requests_per_round"]) == (2, 4)
    assert list(result["rss_mb"]) == ["thread_per_session", "thread_per_session_arena_max_1", "one_thread"]
    assert all(len(v) == 2 and all(100 < mb < 10_000 for mb in v) for v in result["rss_mb"].values())
