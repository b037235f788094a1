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
             "server_cpu_us_per_request", "helpers_cpu_us_per_request", "errors", "overhead_us", "overhead_us_rounds",
             "overhead_us_median", "throughput_ratio_vs_bare", "p99_ratio_vs_bare", "p99_ratio_vs_bare_rounds",
             "overhead_ratio_vs_contrib", "overhead_ratio_vs_contrib_rounds", "overhead_ratio_vs_contrib_spread"}


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


@pytest.mark.slow
def test_smoke_json_has_every_kind_config_and_thread_count(smoke: dict) -> None:
    assert set(smoke) == {*KINDS, "extra_rows", "meta"}
    assert smoke["meta"]["lead_s"] == overhead.MODES["smoke"][5]
    assert smoke["meta"]["paired_scale"] == {}  # only the full run lengthens the model's paired phases
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_thrift_control_row_adds_plain_python_and_no_spans(smoke: dict) -> None:
    """The python_work control row: thriftpy2's plain server with PYTHON_WORK_US of plain Python per call; its
    overhead over bare is reported beside the zoomer row's, and it exports nothing."""
    thrift = smoke["thrift_echo"]
    control = thrift["configs"]["python_work"]
    assert control["spans_lost"] is None and control["requests_answered"] > 0
    assert thrift["control_overhead_us"] == {n: control["threads"][n]["overhead_us"] for n in ("1", "8")}
    assert "python_work" in thrift["paired"]["configs"]
    assert "control row python_work" in overhead.markdown(smoke)
    assert thrift["control_rows"] == {"python_work": {
        "overhead_us": thrift["control_overhead_us"],
        "p99_ratio_vs_bare": {n: control["threads"][n]["p99_ratio_vs_bare"] for n in ("1", "8")}}}
    helpers = smoke["meta"]["helper_processes"]
    assert all(n == 0 for s, n in helpers.items() if "-python_work-" in s), helpers
    counters = [c for s, c in smoke["meta"]["instrumentation_counters"].items() if "-python_work-" in s]
    assert counters and all(c["python_work_us"] == 15.0 and c["loop_iterations"] >= 1 for c in counters)


@pytest.mark.slow
def test_offload_work_control_row_burns_its_cpu_per_call_in_a_child_process() -> None:
    """The offload_work control row (not a default one): a plain Thrift server, and a gRPC echo server with a
    pass-through interceptor, that hand OFFLOAD_WORK_US of CPU per call to a child process at niceness 5, as
    zoomer-serve hands its export to a helper. The child is found as the server's helper process, its CPU counts
    in the row's (about OFFLOAD_WORK_US per call), no byte was skipped, nothing is exported, and the Thrift
    verdict lines give its overhead and p99 beside python_work's."""
    proc = _run("--smoke", "--kinds", "echo,thrift_echo", "--configs", "bare,zoomer,python_work,offload_work",
                "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)
    thrift = run["thrift_echo"]
    assert set(thrift["control_rows"]) == {"python_work", "offload_work"}
    assert thrift["control_rows"]["offload_work"]["p99_ratio_vs_bare"] == {
        n: thrift["configs"]["offload_work"]["threads"][n]["p99_ratio_vs_bare"] for n in ("1", "8")}
    helpers = run["meta"]["helper_processes"]
    for kind in ("echo", "thrift_echo"):
        row = run[kind]["configs"]["offload_work"]
        assert row["spans_lost"] is None and row["requests_answered"] > 0
        servers = [s for s in helpers if s.startswith(f"bench-{kind}-offload_work-")]
        assert servers and all(helpers[s] == 1 for s in servers), helpers
        counters = [c for s, c in run["meta"]["instrumentation_counters"].items()
                    if s.startswith(f"bench-{kind}-offload_work-")]
        assert counters and all(c["offload_work_us"] == 15.0 and c["loop_iterations"] >= 1
                                and c["bytes_skipped"] == 0 for c in counters), counters
        for c in counters:  # the child ran 15 µs of loop per call, in bytes of 64 calls (calibrated: at least half)
            assert c["calls"] >= row["requests_answered"] and c["child_cpu_s"] >= 0.5 * (c["calls"] // 64) * 64 * 15e-6
    text = overhead.markdown(run)
    assert "control row offload_work (plain server, 15 µs of CPU per call in a child process" in text
    assert "control row python_work (plain processor, 15 µs of plain Python per call" in text


@pytest.mark.slow
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
    assert full.kind_configs("thrift_echo") == ("bare", "zoomer", "python_work")  # offload_work: asked for only
    assert "offload_work" not in full.configs
    assert overhead.parse_args(["--gpu"]).kind_configs("echo_aio") == ("bare", "zoomer", "contrib")


def test_a_kind_without_any_applicable_configuration_is_refused() -> None:
    proc = _run("--smoke", "--kinds", "thrift_echo", "--configs", "contrib", timeout_s=60)
    assert proc.returncode == 2 and "thrift_echo" in proc.stderr


@pytest.mark.slow
def test_paired_phase_measures_every_configuration_against_bare_and_contrib(smoke: dict) -> None:
    """A paired phase per client thread count (1 and 8 calls in flight per server, every thread calling all
    servers in turn) gives each configuration calls and a CPU per request; the overhead is the median over rounds
    of each round's difference to bare, the ratio to contrib's the median of the rounds' ratios. A Thrift round's
    paired phases also measure a gRPC echo bare and zoomer server, side by side with its own rows, and compare
    the two zoomer overheads; the judged paired phase (``paired``) is the one at the most client threads."""
    for kind in KINDS:
        by_threads = smoke[kind]["paired_by_threads"]
        assert set(by_threads) == {"1", "8"} and smoke[kind]["paired"] == by_threads["8"], kind
        for n, paired in by_threads.items():
            _check_paired(smoke, kind, int(n), paired)


def _check_paired(smoke: dict, kind: str, n: int, paired: dict) -> None:
    rows = paired["configs"]
    references = {"echo:bare", "echo:zoomer"} if kind == "thrift_echo" else set()
    assert set(rows) == set(smoke[kind]["configs"]) | references, kind
    assert paired["threads"] == n and paired["client_threads"] == n * len(rows)  # n calls in flight per server
    assert paired["rounds"] == smoke["meta"]["rounds"] == 1
    calls = {row["requests"] for row in rows.values()}
    assert min(calls) > 0 and max(calls) - min(calls) <= paired["client_threads"], (kind, calls)  # in turn
    for name, row in rows.items():
        bare = rows["echo:bare" if name in references else "bare"]["cpu_us_per_request"]
        assert row["cpu_us_per_request"] == pytest.approx(
            row["server_cpu_us_per_request"] + row["helpers_cpu_us_per_request"], abs=0.11)
        assert row["overhead_us_totals"] == pytest.approx(row["cpu_us_per_request"] - bare, abs=0.11)
        assert len(row["overhead_us_rounds"]) == 1  # one per round, bare's too (0)
        assert row["overhead_us"] == row["overhead_us_rounds"][0] == pytest.approx(row["overhead_us_totals"],
                                                                                    abs=0.25)
        if name in smoke[kind]["configs"]:  # the table's row at n threads shows the paired phase's CPU figures
            cell = smoke[kind]["configs"][name]["threads"][str(n)]
            assert (cell["cpu_us_per_request"], cell["overhead_us"], cell["overhead_ratio_vs_contrib"]) == (
                row["cpu_us_per_request"], row["overhead_us"], row["overhead_ratio_vs_contrib"])
    if "contrib" in rows:
        contrib = rows["contrib"]["overhead_us_rounds"][0]
        zoomer = rows["zoomer"]
        if contrib <= 0:
            assert zoomer["overhead_ratio_vs_contrib"] is None and zoomer["overhead_ratio_vs_contrib_spread"] is None
        else:
            assert zoomer["overhead_ratio_vs_contrib_rounds"] == [round(zoomer["overhead_us_rounds"][0] / contrib, 3)]
            assert zoomer["overhead_ratio_vs_contrib"] == zoomer["overhead_ratio_vs_contrib_rounds"][0]
            assert zoomer["overhead_ratio_vs_contrib_spread"] == [zoomer["overhead_ratio_vs_contrib"]] * 2
        ratio = zoomer["overhead_ratio_vs_contrib"]
        assert smoke[kind]["overhead_ratio_vs_contrib"][str(n)] == ratio
        if n == 8:
            assert smoke[kind]["targets"]["overhead_met_paired"] == (None if ratio is None else ratio <= 0.5)
    else:
        assert rows["zoomer"]["overhead_ratio_vs_contrib"] is None
        reference = rows["echo:zoomer"]["overhead_us"]
        ratio = paired["overhead_ratio_vs_grpc"]
        if reference > 0:
            assert ratio == pytest.approx(rows["zoomer"]["overhead_us"] / reference, rel=1e-3, abs=2e-3)
        else:
            assert ratio is None
        if n == 8:
            by_round = zip(rows["zoomer"]["overhead_us_rounds"], rows["echo:zoomer"]["overhead_us_rounds"])
            assert paired["overhead_ratio_vs_grpc_rounds"] == [round(a / b, 3) if b > 0 else None
                                                               for a, b in by_round]
            assert smoke[kind]["targets"]["overhead_met_paired"] == (None if ratio is None else ratio <= 1.1)
        # the reference servers' calls are counted and their spans checked like every row's
        assert rows["echo:zoomer"]["spans_lost"] == 0 and rows["echo:zoomer"]["requests_answered"] > 0
        assert rows["echo:bare"]["spans_lost"] is None and rows["echo:bare"]["requests_answered"] > 0


@pytest.mark.slow
def test_thrift_p99_is_compared_with_the_grpc_interceptors_p99(smoke: dict) -> None:
    """Thrift latency target: zoomer's p99 ÷ bare's within 1.3 × the gRPC echo's zoomer p99 ÷ bare at 8 client
    threads, both from the slices of the same run."""
    thrift, echo = smoke["thrift_echo"], smoke["echo"]
    for n in ("1", "8"):
        assert thrift["p99_ratio_vs_grpc"][n] == round(thrift["p99_ratio_vs_bare"][n] / echo["p99_ratio_vs_bare"][n], 3)
    judged = thrift["p99_ratio_vs_grpc"]["8"]
    assert thrift["targets"]["p99_ratio_vs_grpc_max"] == 1.3
    assert thrift["targets"]["p99_met_vs_grpc"] == (judged <= 1.3)
    assert f"8 thr: {judged:.2f} (target ≤ 1.3 at 8 threads: {'met' if judged <= 1.3 else 'MISSED'})" in \
        overhead.markdown(smoke)


def test_the_markdown_prints_the_median_ratio_with_its_spread() -> None:
    """With several rounds a row's ratio to contrib's is printed as the median and, next to it, the lowest and
    highest of the rounds' ratios."""
    cell = {"overhead_ratio_vs_contrib": 0.4, "overhead_ratio_vs_contrib_rounds": [0.3, 0.4, None, 0.6],
            "overhead_ratio_vs_contrib_spread": [0.3, 0.6]}
    assert overhead._ratio_cell(cell) == "0.40 (0.30 to 0.60)"
    assert overhead._ratio_cell({**cell, "overhead_ratio_vs_contrib_rounds": [0.4]}) == "0.40"
    assert overhead._ratio_cell({"overhead_ratio_vs_contrib": None}) == "–"
    assert overhead._median([3.0, 1.0, 2.0, 10.0]) == 2.5 and overhead._median([5.0, 1.0, 9.0]) == 5.0


@pytest.mark.slow
def test_paired_phases_run_first_on_the_fresh_servers_after_a_warm_up(
        smoke_run: subprocess.CompletedProcess[str]) -> None:
    """The paired phases (one per client thread count) run before the slices, so that they start with no export
    work left over from them (a zoomer server's records not yet handed to its helper, contrib's unexported batch),
    which the reference rows of a Thrift round, idle during the slices, did not have; each starts after a warm-up
    of all its servers."""
    log = smoke_run.stderr.splitlines()
    for kind in KINDS:
        mine = [line for line in log if line.startswith(f"round 1/1  {kind} ") and "servers ready" not in line]
        assert len(mine) == 4, mine
        assert all("paired phase" in line and " 0.2 s warm-up" in line for line in mine[:2]), mine
        assert "(1 per server)" in mine[0] and "(8 per server)" in mine[1]
        assert all("paired phase" not in line for line in mine[2:]), mine


def _dropped(smoke: dict, kind: str, name: str) -> int:
    """What a configuration's servers counted as dropped (their span queue was full), over the run's rounds."""
    counters = smoke["meta"]["instrumentation_counters"]
    return sum(c.get("dropped", 0) for service, c in counters.items() if service.startswith(f"bench-{kind}-{name}-r"))


@pytest.mark.slow
def test_smoke_every_request_reaches_the_collector_as_one_server_span(smoke: dict) -> None:
    """Every answered request is one stored span. The Thrift echo answers 10 000 to 30 000 calls a second, more
    than the export path encodes on 2 cores when neighbours load them (a CI run at load 7 stored 11 231 of
    12 863): what its full span queue refused must then be exactly what its counter says, never silently gone.
    The gRPC kinds, at a third of that rate, lose nothing."""
    for kind in KINDS:
        for name in ("zoomer", "contrib", "zoomer_gpu_fake"):
            if name not in smoke[kind]["configs"]:
                continue
            config = smoke[kind]["configs"][name]
            dropped = _dropped(smoke, kind, name) if name != "contrib" else 0
            assert config["spans_lost"] == dropped, (kind, name, config, dropped)
            assert config["server_spans_stored"] + dropped == config["requests_answered"]
            assert kind == "thrift_echo" or dropped == 0, (kind, name, dropped)
        assert smoke[kind]["configs"]["bare"]["spans_lost"] is None


@pytest.mark.slow
def test_zoomer_export_helper_cpu_is_counted(smoke: dict) -> None:
    meta = smoke["meta"]
    assert meta["machine"]["cpus"] >= 1 and meta["mode"] == "smoke"
    counters = meta["instrumentation_counters"]
    zoomer = [v for k, v in counters.items() if "-zoomer" in k]
    assert zoomer and all(c["exported"] > 0 for c in zoomer)
    assert all(c["dropped"] == 0 for k, c in counters.items() if "-zoomer" in k and "thrift_echo" not in k)
    helpers = meta["helper_processes"]
    assert all(n >= 1 for s, n in helpers.items() if "-zoomer" in s), helpers  # the export helper
    assert all(n == 0 for s, n in helpers.items() if "-bare-" in s or "-contrib-" in s), helpers
    # the helper process is a child of the server: its CPU shows up apart from the server's
    assert smoke["echo"]["configs"]["zoomer"]["threads"]["8"]["helpers_cpu_us_per_request"] >= 0
    assert smoke["echo"]["configs"]["bare"]["threads"]["8"]["helpers_cpu_us_per_request"] == 0


@pytest.mark.slow
def test_the_http_row_exports_every_span_over_otlp_http() -> None:
    """``zoomer_http`` is zoomer's default path with ``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`` pointed at the
    benchmark collector's HTTP port: every answered request is one stored span, and all of it (spans and
    metrics) arrived over HTTP, none over gRPC."""
    proc = _run("--smoke", "--kinds", "echo", "--configs", "bare,zoomer_http", "--threads", "8", "--json",
                timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    row = result["echo"]["configs"]["zoomer_http"]
    assert row["requests_answered"] > 0 and row["server_spans_stored"] == row["requests_answered"], row
    assert row["spans_lost"] == 0
    collector = result["meta"]["collector"]
    assert collector["http_requests"] > 0 and collector["grpc_requests"] == 0, collector


@pytest.mark.parametrize("option, value", [("--rounds", "0"), ("--cycles", "0"), ("--slice", "0"),
                                           ("--rounds", "-1"), ("--slice", "-0.5"), ("--warmup", "-1"),
                                           ("--paired-s", "0"), ("--lead", "-1"), ("--collector-nice", "20")])
def test_an_out_of_range_number_is_refused_naming_the_option_and_value(
        option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An explicit 0 is refused like any other number out of range, not replaced by the mode's default (``--rounds
    0`` and ``--cycles 0`` used to run one round or cycle, ``--slice 0`` the mode's slice); the error names the
    option and the value given."""
    with pytest.raises(SystemExit) as exit_info:
        overhead.parse_args(["--smoke", option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{option} {value}" in err or f"{option} {float(value):g}" in err, err


def test_numbers_in_range_are_taken_as_given() -> None:
    plan = overhead.parse_args(["--smoke", "--rounds", "3", "--cycles", "2", "--slice", "0.3", "--warmup", "0",
                                "--lead", "0", "--paired-s", "1.5", "--collector-nice", "19"])
    assert (plan.rounds, plan.cycles, plan.slice_s, plan.warmup_s, plan.lead_s, plan.paired_s,
            plan.collector_nice) == (3, 2, 0.3, 0.0, 0.0, 1.5, 19)


def test_unknown_configuration_is_named_in_the_error() -> None:
    proc = _run("--smoke", "--configs", "bare,nosuch", timeout_s=60)
    assert proc.returncode == 2
    assert "nosuch" in proc.stderr and "zoomer" in proc.stderr


def test_process_cpu_is_read_from_the_process_clock_in_ns() -> None:
    """A server's CPU comes from its process CPU clock (ns, read from outside), not the 10 ms ticks of
    ``/proc/<pid>/stat``: a short phase of a few hundred model requests would otherwise be off by up to 50 µs per
    request. The two agree to a few ticks."""
    burn = "import time\nend = time.process_time() + 0.25\nwhile time.process_time() < end: pass\n" \
           "import sys; sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while _bench_proc.process_cpu_s(child.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        clock_ns = _bench_proc.process_clock_ns(child.pid)
        ticks_s = _bench_proc.cpu_ticks(child.pid, with_reaped_children=False) / os.sysconf("SC_CLK_TCK")
    finally:
        child.communicate(b"", timeout=20)
    assert clock_ns is not None and clock_ns >= 250_000_000
    assert abs(clock_ns / 1e9 - ticks_s) < 0.05
    assert _bench_proc.process_clock_ns(child.pid) is None  # gone: no clock to read
    assert _bench_proc.cpu_s(child.pid, with_reaped_children=True) == 0


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert overhead.percentile(values, 50) == 50
    assert overhead.percentile(values, 99) == 99
    assert overhead.percentile([7], 99) == 7
    assert overhead.percentile([], 50) != overhead.percentile([], 50)  # NaN


@pytest.mark.slow
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
    assert full.longest_pause_s("thrift_echo") == pytest.approx(
        2 * (len(full.kind_configs("thrift_echo")) - 1) * (full.lead_s + full.slice_s))
    for mode in overhead.MODES:
        plan = overhead.parse_args([f"--{mode}"] if mode != "full" else [])
        assert _bench_configs.THRIFT_CLIENT_TIMEOUT_MS / 1000 > 2 * plan.longest_pause_s("thrift_echo"), mode
    with pytest.raises(SystemExit):
        overhead.parse_args(["--kinds", "thrift_echo", "--slice", "10"])
    assert overhead.parse_args(["--kinds", "echo", "--slice", "10"]).slice_s == 10  # gRPC: no idle timeout


def test_modes_use_many_short_slices_and_paired_phases_sized_by_their_servers() -> None:
    """Latency comes from several short slices per configuration (a burst of the neighbours' load falls on every
    row alike), each after a lead-in at least as long as the export writer's period, so that the previous row's
    leftover export work falls there and not in the slice; a paired phase lasts a fixed time per server in it
    (in the full run three times as long for the model), or ``--paired-s``."""
    from zoomer_serve.export.pipeline import _WRITER_PERIOD_S

    quick, full = overhead.parse_args(["--quick"]), overhead.parse_args([])
    assert quick.cycles >= 2 and full.cycles >= 8
    assert quick.slice_s * quick.cycles == pytest.approx(0.5) and full.slice_s * full.cycles == pytest.approx(4.0)
    assert quick.lead_s >= _WRITER_PERIOD_S and full.lead_s >= _WRITER_PERIOD_S
    assert overhead.parse_args(["--lead", "0"]).lead_s == 0 and overhead.parse_args(["--lead", "2"]).lead_s == 2
    with pytest.raises(SystemExit):
        overhead.parse_args(["--lead", "-1"])
    assert quick.paired_seconds(3) == pytest.approx(0.9) and quick.paired_seconds(5) == pytest.approx(1.5)
    assert full.paired_seconds(3) == pytest.approx(9.0) and full.paired_seconds(3, "echo") == pytest.approx(9.0)
    assert full.paired_seconds(4, "model") == pytest.approx(36.0)  # the model's per-round ratio needs longer
    assert quick.paired_seconds(4, "model") == pytest.approx(1.2)  # the quick run stays under two minutes
    assert overhead.parse_args(["--quick", "--paired-s", "7"]).paired_seconds(3, "model") == 7
    for bad in ("0", "301"):
        with pytest.raises(SystemExit):
            overhead.parse_args(["--paired-s", bad])


def test_a_slices_lead_in_is_answered_but_not_measured() -> None:
    """The client's slices: the calls of a slice's lead-in reach the server (``answered``, which the phase's CPU
    per request divides by) but not the measured ``requests`` and latencies, and the slices' length leaves the
    lead-ins out. A bare gRPC echo server in this process, two rows on it, 0.5 s of lead-in before 0.1 s slices.
    Before the lead-in, the previous row's leftover export work fell into the next row's measured slice."""
    import _bench_client
    import _bench_configs

    kind = _bench_configs.server_kind("echo")
    server = kind.start([])
    try:
        target = {"target": f"127.0.0.1:{server.port}", "server_pid": os.getpid(), "helper_pids": []}
        cmd = {"kind": "echo", "threads": 2, "warmup_s": 0.0, "slice_s": 0.1, "cycles": 2, "lead_s": 0.5,
               "collector_pid": 0, "targets": [{"name": "a", **target}, {"name": "b", **target}]}
        result = _bench_client.run_phase(cmd, {})
    finally:
        server.stop()
    for name, run in result["per_target"].items():
        assert run["requests"] == len(run["latency_us"]) > 0, name
        assert run["answered"] >= 2 * run["requests"], run["answered"]  # 5 × as long as the slices: not measured
        assert run["total_ok"] >= run["answered"]
        assert run["slices_s"] < 2 * 0.5, run["slices_s"]  # the two slices (0.2 s), shorter than their lead-ins


def test_request_path_benchmark_calls_the_wrapped_handler_as_grpc_does() -> None:
    """benchmarks/request_path.py's loop body: the interceptor's wrapped handler and serializer answer what the
    handler answers, and each call ends one request span (the sink sees it)."""
    import request_path

    from zoomer_serve.demo import ranker_pb2
    from zoomer_serve.recording import RequestRecorder

    seen: list[tuple] = []
    recorder = RequestRecorder(sink=seen.append)
    assert request_path.build("bare", recorder)() == b"x" * 1024
    assert request_path.build("echo", recorder)() == b"x" * 1024
    response = ranker_pb2.PredictResponse.FromString(request_path.build("model", recorder)())
    assert request_path.build("model_bare", recorder)() == response.SerializeToString()
    assert list(response.scores) == [0.5] * 16
    assert [rec[6] for rec in seen] == ["bench.Echo/Echo", "zoomer.demo.Ranker/Predict"]
    assert seen[0][12]["zoomer.rpc.request.bytes"] == 1024 and seen[0][12]["rpc.response.status_code"] == "OK"


def test_passthrough_work_control_row_runs_its_loop_and_answers() -> None:
    """The ``passthrough_work`` control row: a real gRPC echo server behind the pass-through interceptor with
    ``PASSTHROUGH_WORK_US`` µs of calibrated plain Python per call answers as the bare server does, and its
    counters name the loop it ran; the plain pass-through row runs none. gRPC sync only."""
    import _bench_configs

    kind = _bench_configs.server_kind("echo")
    work = _bench_configs.configuration("passthrough_work").instrument(_bench_configs.GRPC)
    counters = work.shutdown()
    assert counters["work_us"] == _bench_configs.PASSTHROUGH_WORK_US and counters["loop_iterations"] > 0
    assert _bench_configs.passthrough_interceptor().shutdown()["loop_iterations"] == 0
    server = kind.start(work.interceptors)
    try:
        call, close = kind.caller(f"127.0.0.1:{server.port}")
        try:
            assert call(b"abc") == b"abc"
        finally:
            close()
    finally:
        server.stop()
    with pytest.raises(ValueError, match="no 'thrift' form"):
        _bench_configs.passthrough_work(_bench_configs.THRIFT)
