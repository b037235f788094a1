"""Smoke tests of benchmarks/overhead.py: it runs end to end (real servers, real OTLP export into the real
embedded collector) and prints one JSON object of the documented shape. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _bench_proc  # noqa: E402
import overhead  # noqa: E402

CELL_KEYS = {"requests", "requests_per_s", "p50_us", "p90_us", "p99_us", "cpu_us_per_request",
             "server_cpu_us_per_request", "helpers_cpu_us_per_request", "errors", "overhead_us", "overhead_us_rounds", "overhead_us_median", "throughput_ratio_vs_bare",
             "p99_ratio_vs_bare", "p99_ratio_vs_bare_rounds", "overhead_ratio_vs_contrib"}


def _run(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / "overhead.py"), *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=str(BENCH.parent))


KINDS = ("echo", "model", "echo_aio", "thrift_echo")
GRPC_KINDS = ("echo", "model", "echo_aio")
SYNC_GRPC_KINDS = ("echo", "model")


@pytest.fixture(scope="module")
def smoke_run() -> subprocess.CompletedProcess[str]:
    """One smoke run of every server kind, with the GPU-telemetry row and the GPU extra rows (the cheap ones)."""
    proc = _run("--smoke", "--gpu", "--extras", "--extra-sections", "gpu", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def smoke(smoke_run: subprocess.CompletedProcess[str]) -> dict:
    """The smoke run's JSON object."""
    lines = smoke_run.stdout.splitlines()
    assert len(lines) == 1, f"stdout must hold only the JSON line, got {len(lines)} lines"
    return json.loads(lines[0])


def test_smoke_json_has_every_kind_config_and_thread_count(smoke: dict) -> None:
    assert set(smoke) == {*KINDS, "extra_rows", "meta"}
    for kind in KINDS:
        configs = smoke[kind]["configs"]
        expected = {"bare", "zoomer", "contrib", "zoomer_gpu_fake"} if kind in SYNC_GRPC_KINDS else \
            {"bare", "zoomer", "contrib"} if kind in GRPC_KINDS else {"bare", "zoomer", "python_work"}
        assert set(configs) == expected, kind
        for name, config in configs.items():
            assert set(config["threads"]) == {"1", "8"}
            for n, cell in config["threads"].items():
                assert set(cell) == CELL_KEYS, (kind, name, n)
                assert cell["requests"] > 0 and cell["errors"] == {}, (kind, name, n, cell["errors"])
                assert cell["p50_us"] <= cell["p99_us"]
                assert cell["cpu_us_per_request"] >= 0
            assert config["requests_answered"] > 0
        bare = configs["bare"]["threads"]["8"]
        assert bare["overhead_us"] == 0 and bare["overhead_ratio_vs_contrib"] is None
        if kind in GRPC_KINDS:
            assert configs["contrib"]["threads"]["8"]["overhead_ratio_vs_contrib"] in (1.0, None)  # None: 0 overhead
        assert set(smoke[kind]["overhead_ratio_vs_contrib"]) == {"1", "8"}
        assert set(smoke[kind]["p99_ratio_vs_bare"]) == {"1", "8"}
        assert smoke[kind]["targets"]["p99_threads"] == 8
        assert set(smoke[kind]["phases"]) == {"1", "8"}


def test_thrift_kind_has_no_contrib_ratio_and_is_compared_with_the_grpc_echo(smoke: dict) -> None:
    thrift = smoke["thrift_echo"]
    assert all(t["overhead_ratio_vs_contrib"] is None for t in thrift["configs"]["zoomer"]["threads"].values())
    assert thrift["overhead_ratio_vs_contrib"] == {"1": None, "8": None}
    assert thrift["overhead_us_grpc"] == {n: smoke["echo"]["configs"]["zoomer"]["threads"][n]["overhead_us"]
                                          for n in ("1", "8")}
    for n, ratio in thrift["overhead_ratio_vs_grpc"].items():
        grpc_us = thrift["overhead_us_grpc"][n]
        if grpc_us > 0:
            assert ratio == round(thrift["configs"]["zoomer"]["threads"][n]["overhead_us"] / grpc_us, 3)
        else:
            assert ratio is None
    targets = thrift["targets"]
    assert targets["overhead_ratio_vs_grpc_max"] == 1.1 and targets["overhead_ratio_vs_contrib_max"] is None
    assert "contrib" in targets["note"]
    # judged in the paired phase, side by side with gRPC echo servers; every thread count's verdict is still given
    assert targets["overhead_judged_in"] == "paired"
    paired = thrift["paired"]["overhead_ratio_vs_grpc"]
    assert targets["overhead_met"] == targets["overhead_met_paired"] == (None if paired is None else paired <= 1.1)
    assert targets["overhead_met_by_threads"] == {n: None if v is None else v <= 1.1
                                                  for n, v in thrift["overhead_ratio_vs_grpc"].items()}
    eight = thrift["overhead_ratio_vs_grpc"]["8"]
    # null when the echo's 8-thread overhead came out ≤ 0 (noise in a smoke run): then there is no ratio to mark
    marked = eight is not None and f"8 thr: {eight:.2f} > 1.1 (" in overhead.markdown(smoke)
    assert marked == (eight is not None and eight > 1.1)


def test_thrift_control_row_adds_plain_python_and_no_spans(smoke: dict) -> None:
    """The python_work control row: thriftpy2's plain server with PYTHON_WORK_US of plain Python per call; its
    overhead over bare is reported beside the zoomer row's, and it exports nothing."""
    thrift = smoke["thrift_echo"]
    control = thrift["configs"]["python_work"]
    assert control["spans_lost"] is None and control["requests_answered"] > 0
    assert thrift["control_overhead_us"] == {n: control["threads"][n]["overhead_us"] for n in ("1", "8")}
    assert "python_work" in thrift["paired"]["configs"]
    assert "control row python_work" in overhead.markdown(smoke)
    helpers = smoke["meta"]["helper_processes"]
    assert all(n == 0 for s, n in helpers.items() if "-python_work-" in s), helpers
    counters = [c for s, c in smoke["meta"]["instrumentation_counters"].items() if "-python_work-" in s]
    assert counters and all(c["python_work_us"] == 15.0 and c["loop_iterations"] >= 1 for c in counters)


def test_gpu_extra_rows_are_measured_per_request(smoke: dict) -> None:
    rows = {r["what"]: r for r in smoke["extra_rows"]["gpu"]}
    assert set(smoke["extra_rows"]) == {"gpu"}
    assert all(r["unit"] == "µs" and r["value"] > 0 for r in rows.values() if not r["what"].startswith("added"))
    off = rows["recorder start+end, GPU telemetry off"]["value"]
    on = rows["recorder start+end, GPU memory observer attached"]["value"]
    assert rows["added per request by GPU telemetry (on - off)"]["value"] == pytest.approx(on - off, abs=0.002)
    assert smoke["meta"]["extras"] == ["gpu"]
    assert "### extra rows: gpu" in overhead.markdown(smoke)


def test_extras_are_on_in_the_full_run_only_and_gpu_row_only_when_asked() -> None:
    full, quick, smoke = overhead.parse_args([]), overhead.parse_args(["--quick"]), overhead.parse_args(["--smoke"])
    assert full.extras == ("gpu", "profiling", "host") and quick.extras == () and smoke.extras == ()
    assert overhead.parse_args(["--no-extras"]).extras == ()
    assert "zoomer_gpu_fake" not in full.configs
    assert "zoomer_gpu_fake" in overhead.parse_args(["--gpu"]).configs
    assert full.kind_configs("thrift_echo") == ("bare", "zoomer", "python_work")
    assert overhead.parse_args(["--gpu"]).kind_configs("echo_aio") == ("bare", "zoomer", "contrib")


def test_a_kind_without_any_applicable_configuration_is_refused() -> None:
    proc = _run("--smoke", "--kinds", "thrift_echo", "--configs", "contrib", timeout_s=60)
    assert proc.returncode == 2 and "thrift_echo" in proc.stderr


def test_paired_phase_measures_every_configuration_against_bare_and_contrib(smoke: dict) -> None:
    """The paired phase (8 client threads per server, every thread calling all servers in turn) gives each
    configuration calls and a CPU per request; overhead and the ratio to contrib's follow from those figures.
    A Thrift round's paired phase also measures a gRPC echo bare and zoomer server, side by side with its own
    rows, and compares the two zoomer overheads."""
    for kind in KINDS:
        paired = smoke[kind]["paired"]
        rows = paired["configs"]
        references = {"echo:bare", "echo:zoomer"} if kind == "thrift_echo" else set()
        assert set(rows) == set(smoke[kind]["configs"]) | references, kind
        assert paired["threads"] == 8 and paired["client_threads"] == 8 * len(rows)  # 8 calls in flight per server
        calls = {row["requests"] for row in rows.values()}
        assert min(calls) > 0 and max(calls) - min(calls) <= paired["client_threads"], (kind, calls)  # in turn
        for name, row in rows.items():
            bare = rows["echo:bare" if name in references else "bare"]["cpu_us_per_request"]
            assert row["cpu_us_per_request"] == pytest.approx(
                row["server_cpu_us_per_request"] + row["helpers_cpu_us_per_request"], abs=0.11)
            assert row["overhead_us"] == pytest.approx(row["cpu_us_per_request"] - bare, abs=0.11)
            assert len(row["overhead_us_rounds"]) == smoke["meta"]["rounds"]  # one per round, bare's too (0)
        bare = rows["bare"]["cpu_us_per_request"]
        if "contrib" in rows:
            contrib = rows["contrib"]["cpu_us_per_request"] - bare
            zoomer = rows["zoomer"]
            if contrib == 0:
                assert zoomer["overhead_ratio_vs_contrib"] is None
            else:
                assert zoomer["overhead_ratio_vs_contrib"] == pytest.approx(
                    (zoomer["cpu_us_per_request"] - bare) / contrib, rel=1e-3, abs=2e-3)
            ratio = zoomer["overhead_ratio_vs_contrib"]
            assert smoke[kind]["targets"]["overhead_met_paired"] == (None if ratio is None else ratio <= 0.5)
        else:
            assert rows["zoomer"]["overhead_ratio_vs_contrib"] is None
            reference = rows["echo:zoomer"]["overhead_us"]
            ratio = paired["overhead_ratio_vs_grpc"]
            if reference > 0:
                assert ratio == pytest.approx(rows["zoomer"]["overhead_us"] / reference, rel=1e-3, abs=2e-3)
            else:
                assert ratio is None
            by_round = zip(rows["zoomer"]["overhead_us_rounds"], rows["echo:zoomer"]["overhead_us_rounds"])
            assert paired["overhead_ratio_vs_grpc_rounds"] == [round(a / b, 3) if b > 0 else None for a, b in by_round]
            # the reference servers' calls are counted and their spans checked like every row's
            assert rows["echo:zoomer"]["spans_lost"] == 0 and rows["echo:zoomer"]["requests_answered"] > 0
            assert rows["echo:bare"]["spans_lost"] is None and rows["echo:bare"]["requests_answered"] > 0
            assert smoke[kind]["targets"]["overhead_met_paired"] == (None if ratio is None else ratio <= 1.1)


def test_paired_phase_runs_first_on_the_fresh_servers_after_a_warm_up(
        smoke_run: subprocess.CompletedProcess[str]) -> None:
    """The paired phase runs before the slices, so that it starts with no export work left over from them (a
    zoomer server's records not yet handed to its helper, contrib's unexported batch), which the reference rows
    of a Thrift round, idle during the slices, did not have; it starts after a warm-up of all its servers."""
    log = smoke_run.stderr.splitlines()
    for kind in KINDS:
        mine = [line for line in log if line.startswith(f"round 1/1  {kind} ")]
        assert mine and "paired phase" in mine[0] and " 0.2 s warm-up" in mine[0], mine
        assert all("paired phase" not in line for line in mine[1:]), mine


def test_smoke_every_request_reaches_the_collector_as_one_server_span(smoke: dict) -> None:
    for kind in KINDS:
        for name in ("zoomer", "contrib", "zoomer_gpu_fake"):
            if name not in smoke[kind]["configs"]:
                continue
            config = smoke[kind]["configs"][name]
            assert config["spans_lost"] == 0, (kind, name, config)
            assert config["server_spans_stored"] == config["requests_answered"]
        assert smoke[kind]["configs"]["bare"]["spans_lost"] is None


def test_zoomer_export_helper_cpu_is_counted(smoke: dict) -> None:
    meta = smoke["meta"]
    assert meta["machine"]["cpus"] >= 1 and meta["mode"] == "smoke"
    counters = meta["instrumentation_counters"]
    zoomer = [v for k, v in counters.items() if "-zoomer" in k]
    assert zoomer and all(c["dropped"] == 0 and c["exported"] > 0 for c in zoomer)
    helpers = meta["helper_processes"]
    assert all(n >= 1 for s, n in helpers.items() if "-zoomer" in s), helpers  # the export helper
    assert all(n == 0 for s, n in helpers.items() if "-bare-" in s or "-contrib-" in s), helpers
    # the helper process is a child of the server: its CPU shows up apart from the server's
    assert smoke["echo"]["configs"]["zoomer"]["threads"]["8"]["helpers_cpu_us_per_request"] >= 0
    assert smoke["echo"]["configs"]["bare"]["threads"]["8"]["helpers_cpu_us_per_request"] == 0


def test_unknown_configuration_is_named_in_the_error() -> None:
    proc = _run("--smoke", "--configs", "bare,nosuch", timeout_s=60)
    assert proc.returncode == 2
    assert "nosuch" in proc.stderr and "zoomer" in proc.stderr


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert overhead.percentile(values, 50) == 50
    assert overhead.percentile(values, 99) == 99
    assert overhead.percentile([7], 99) == 7
    assert overhead.percentile([], 50) != overhead.percentile([], 50)  # NaN


def test_tree_cpu_counts_a_live_child_and_then_its_reaped_time() -> None:
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n" \
           "import sys; sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while _bench_proc.tree_cpu(os.getpid()).helpers_s < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        live = _bench_proc.tree_cpu(os.getpid())
        assert child.pid in _bench_proc.descendants(os.getpid())
        assert live.helpers_s >= 0.25
    finally:
        child.communicate(b"", timeout=20)
    reaped = _bench_proc.tree_cpu(os.getpid())
    assert reaped.main_s - live.main_s >= 0.25  # moved into cutime/cstime once waited for


def test_thrift_connections_outlast_the_longest_pause_between_their_slices() -> None:
    """A client connection waits while the other rows take their slices: up to 2 × (rows − 1) slices when the
    order rotates, or the other rows' warm-ups. With three Thrift rows and 1 s slices that is 4 s, longer than
    thriftpy2's 3 s default idle timeout, after which the server closed the connection and the next calls
    failed (BrokenPipeError in the full run of 18:52); the benchmark's Thrift servers wait longer, and a plan
    whose pauses come near their timeout is refused."""
    import _bench_configs

    full = overhead.parse_args([])
    assert full.longest_pause_s("thrift_echo") == 2 * (len(full.kind_configs("thrift_echo")) - 1) * full.slice_s
    for mode in overhead.MODES:
        plan = overhead.parse_args([f"--{mode}"] if mode != "full" else [])
        assert _bench_configs.THRIFT_CLIENT_TIMEOUT_MS / 1000 > 2 * plan.longest_pause_s("thrift_echo"), mode
    with pytest.raises(SystemExit):
        overhead.parse_args(["--kinds", "thrift_echo", "--slice", "10"])
    assert overhead.parse_args(["--kinds", "echo", "--slice", "10"]).slice_s == 10  # gRPC: no idle timeout
