"""The fleet job against a synthetic fleet of 120 replicas built from a shared Kineto trace and perturbed span
data (:mod:`zoomer_serve.fleet.synthetic`), written through the real upload and Parquet paths: the replicas
injected as slow (latency, kernels, host CPU, allocator retries; one of them in the second GPU model's peer
group) are exactly the ones named, the replica with another torch version is named for its kernel mix, the
corrupt, unparsable and unreadable artifacts are reported and skipped. The same on S3 (moto's server, s3fs)
and on a real local Ray cluster; the engines' retries; the robust statistics."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pytest

from zoomer_serve.analysis.findings import AT_STAKE, severity_for_share
from zoomer_serve.collector.store import NO_EXTENSION_DOWNLOADS
from zoomer_serve.fleet.aggregate import ReplicaFigures
from zoomer_serve.fleet.cli import parse_since
from zoomer_serve.fleet.detect import detect_kernel_mix, outliers
from zoomer_serve.fleet.engines import run_local
from zoomer_serve.fleet.job import FleetOptions, run_fleet_job
from zoomer_serve.fleet.spans import LATENCY_BUCKETS_PER_DOUBLING
from zoomer_serve.fleet.stats import binomial_tail, robust
from zoomer_serve.fleet.synthetic import FleetSpec, FleetTruth, build_fleet, instance_name

if TYPE_CHECKING:
    from _object_storage import S3

pytest_plugins = ("_object_storage",)  # the s3 fixture

ROOT = Path(__file__).resolve().parents[1]
BASE_TRACE = ROOT.parent / "shared" / "data" / "kineto" / "a100_alexnet_inference.json.gz"
SPEC = FleetSpec(replicas=120, slow=(3, 40, 112), cpu_hot=(21,), alloc_retries=(58,), kernel_mix=(95,),
                 corrupt=(12, 66), unparsable=(33,), bad_manifest=(101,))


def _need_base_trace() -> None:
    if not BASE_TRACE.is_file():
        pytest.skip(f"the shared Kineto traces are not here ({BASE_TRACE})")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FleetTruth]:
    _need_base_trace()
    root = tmp_path_factory.mktemp("fleet")
    return root, build_fleet(str(root), BASE_TRACE, SPEC)


def _check_report(report: dict[str, Any], truth: FleetTruth, replicas: int) -> None:
    named = {o["instance"] for o in report["outliers"]}
    assert named == truth.slow, (sorted(named), sorted(truth.slow))
    assert [o["rank"] for o in report["outliers"]] == list(range(1, len(report["outliers"]) + 1))
    by_replica = {f["evidence"]["instance"] for f in report["findings"] if f["id"] == "fleet.outlier-replica"}
    assert by_replica == truth.slow
    mix = [f for f in report["findings"] if f["id"] == "fleet.kernel-mix"]
    assert {f["evidence"]["instance"] for f in mix} == truth.kernel_mix
    for f in report["findings"]:  # the analysis's one severity rule, from the share at stake
        assert f["severity"] == severity_for_share(f["evidence"][AT_STAKE]), f
    for i in SPEC.slow:  # latency x 2.5 (kernels x 1.8): 60 % of its tail time lies beyond its peers'
        (f,) = [f for f in report["findings"] if f["id"] == "fleet.outlier-replica"
                and f["evidence"]["instance"] == instance_name(i)]
        assert 0.5 < f["evidence"][AT_STAKE] < 0.7 and f["severity"] == "high", f["evidence"]
    for f in mix:
        assert {"key": "zoomer.torch.version", "value": "2.14.0.dev", "peer_value": "2.13.0", "peer_share": 1.0} \
            in f["evidence"]["resource_differences"]
        assert len(f["evidence"]["only_here"]) == 3 and len(f["evidence"]["missing_here"]) == 3
    failed = {x["artifact"] for x in report["failed"]} | {x["url"] for x in report["failed"]}
    assert truth.failed_traces <= failed and truth.failed_manifests <= failed
    assert report["counts"]["traces_failed"] == len(truth.failed_traces) + len(truth.failed_manifests)
    errors = sorted(x["error"].split(":")[0] for x in report["failed"])
    assert errors == sorted(["CorruptArtifact"] * 2 + ["TraceFormatError", "ArtifactError"])
    assert report["counts"]["traces_analyzed"] == replicas - report["counts"]["traces_failed"]
    assert report["counts"]["replicas"] == replicas and report["counts"]["peer_groups"] == 2
    metrics = {(o["instance"], o["metric"]) for o in report["outliers"]}
    for i, kinds in ((SPEC.slow, {"p99_ms", "kernel_us_per_request"}), (SPEC.cpu_hot, {"host_cpu"}),
                     (SPEC.alloc_retries, {"alloc_retries_per_request"})):
        for n in i:
            assert kinds <= {m for inst, m in metrics if inst == instance_name(n)}, (n, metrics)


@pytest.mark.slow
def test_the_fleet_job_names_exactly_the_injected_replicas(fleet: tuple[Path, FleetTruth], tmp_path: Path) -> None:
    """``zoomer-serve fleet analyze`` (local engine, 2 workers) on 120 replicas: outliers, kernel mix and
    failures as injected; results as Parquet next to the data; the HTML report with three heat maps, the ranked
    outlier list and drill-down pages that exist."""
    root, truth = fleet
    html = tmp_path / "fleet.html"
    done = subprocess.run([sys.executable, "-m", "zoomer_serve", "fleet", "analyze", str(root), "--json",
                           "--html", str(html), "--drill-down", "2", "--workers", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    _check_report(report, truth, SPEC.replicas)
    second = {o["instance"]: o for o in report["outliers"] if o["gpu_model"] == SPEC.second_gpu}
    assert set(second) == {instance_name(112)} and report["outliers"][0]["peers"] >= 5
    out = Path(report["outputs"]["report_json"]).parent
    assert out.parent == root / "fleet" and json.loads((out / "report.json").read_text())["outliers"] == report["outliers"]
    con = duckdb.connect(config=NO_EXTENSION_DOWNLOADS)
    rows = con.execute(f"SELECT status, count(*) FROM read_parquet('{out}/results/traces/*.parquet') GROUP BY 1 "
                       "ORDER BY 1").fetchall()
    assert rows == [("failed", 4), ("ok", 116)]
    assert con.execute(f"SELECT count(*), count(DISTINCT instance) FROM '{out}/replicas.parquet'").fetchone() == \
        (120, 120)
    kernels = con.execute(f"SELECT count(DISTINCT url) FROM read_parquet('{out}/results/trace_kernels/*.parquet')")
    assert kernels.fetchone() == (116,)
    con.close()
    page = html.read_text()
    assert outliers_rows(page) == outliers_rows((out / "report.html").read_text())  # written twice, the same
    for plot in ("latency_p99", "gpu_utilization", "kernel_time"):
        assert f'data-plot="{plot}"' in page
    assert len(outliers_rows(page)) == len(report["outliers"]) + 1  # and the header
    drilled = report["drilldown"]
    assert len(drilled) == 2 and set(drilled) <= truth.slow
    for entries in drilled.values():
        (entry,) = entries
        assert "error" not in entry, entry
        assert (out / entry["html"]).stat().st_size > 10_000 and (out / entry["timeline"]).stat().st_size > 1000
        assert f'href="{entry["html"]}"' in page and f'href="{entry["timeline"]}"' in page
        assert "Requests" in (out / entry["html"]).read_text()


def test_results_that_cannot_be_written_name_where_they_go_not_the_input(tmp_path: Path, capsys: Any) -> None:
    """``--out`` where nothing can be written (under /dev/null) was reported as "cannot read <the input>": the
    message names the results' place and the exit code is 2."""
    _need_base_trace()
    root = tmp_path / "fleet"
    build_fleet(str(root), BASE_TRACE, FleetSpec(replicas=3))
    from zoomer_serve.cli import build_parser
    from zoomer_serve.fleet import cli as fleet_cli

    args = build_parser().parse_args(["fleet", "analyze", str(root), "--out", "/dev/null/x", "--drill-down", "0"])
    assert fleet_cli.run(args) == 2
    err = capsys.readouterr().err
    assert "cannot write the results to /dev/null/x" in err and f"cannot read {root}" not in err, err


def test_a_missing_path_and_an_empty_window_are_errors_that_say_why(tmp_path: Path, capsys: Any) -> None:
    """A path that does not exist is named in one line (exit 2) and is not created; a ``--since`` window with
    nothing in it (the artifacts ended earlier that day, or on earlier days) exits 2 saying how many trace
    artifacts there are and how many lie outside the window, and writes no empty report; without the window
    the same fleet is analysed (exit 0)."""
    _need_base_trace()
    from zoomer_serve.cli import build_parser
    from zoomer_serve.fleet import cli as fleet_cli

    def fleet_analyze(*argv: str) -> tuple[int, str]:
        args = build_parser().parse_args(["fleet", "analyze", *argv, "--drill-down", "0", "--json"])
        code = fleet_cli.run(args)
        captured = capsys.readouterr()
        outputs.append(captured.out)
        return code, captured.err

    outputs: list[str] = []

    missing = tmp_path / "no-such-fleet"
    for extra in ((), ("--since", "1m")):
        code, err = fleet_analyze(str(missing), *extra)
        assert code == 2 and err == f"zoomer-serve fleet: {missing} does not exist (no such folder; on object " \
            "storage, no object under that prefix)\n", err
    assert not missing.exists()
    a_file = tmp_path / "c1.duckdb"  # a store given where the fleet's folder goes
    a_file.write_bytes(b"not a folder")
    code, err = fleet_analyze(str(a_file))
    assert code == 2 and err == f"zoomer-serve fleet: {a_file} is a file, not a folder: fleet analyze reads the " \
        "folder (or object-storage prefix) that the replicas' trace artifacts and span datasets are under\n", err
    assert a_file.read_bytes() == b"not a folder"
    root = tmp_path / "fleet"
    build_fleet(str(root), BASE_TRACE, FleetSpec(replicas=3))  # every window on 2026-11-18, 11:06 to 12:xx
    for since, start in (("2026-11-18T20:00:00", "2026-11-18T20:00:00Z"),  # same day: listed, then left out
                         ("2026-11-25", "2026-11-25T00:00:00Z")):  # a later day: its folder is not even listed
        code, err = fleet_analyze(str(root), "--since", since)
        assert code == 2 and err.count("\n") == 1, err
        assert f"from --since {since} ({start}) on under {root}: 3 trace artifacts found, 3 of them ended " \
            f"before {start}" in err, err
    assert not (root / "fleet").exists()  # no empty report written
    assert outputs == [""] * 5  # no report on stdout either
    code, err = fleet_analyze(str(root), "--since", "2026-11-18T00:00:00")
    assert code == 0, err
    counts = json.loads(outputs[-1])["counts"]
    assert counts["traces_analyzed"] == 3 and counts["span_requests"] == 3 * FleetSpec().requests
    assert len(list((root / "fleet").iterdir())) == 1


def outliers_rows(page: str) -> list[str]:
    table = re.search(r'<table data-table="outliers">(.*?)</table>', page, re.S)
    assert table is not None
    return re.findall(r"<tr>.*?</tr>", table.group(1))


def test_a_tight_fleet_has_no_outlier_and_a_small_group_is_not_judged() -> None:
    """No perturbation: nothing stands out (noise of a few percent); a peer group of four is too small."""
    rng_replicas = []
    for i in range(30):
        r = ReplicaFigures("svc", f"r{i}", gpu_model="A" if i < 26 else "B", requests=10,
                           kernel_time_us=1000.0 * (1 + 0.01 * ((i * 7) % 5 - 2)), busy_us=50, window_us=100,
                           host_cpu=0.3 * (1 + 0.02 * ((i * 3) % 5 - 2)))
        r.methods["m"] = {"count": 100, "p50_ms": 5.0, "p99_ms": 9.0 * (1 + 0.03 * ((i * 5) % 7 - 3)), "errors": 0}
        rng_replicas.append(r)
    assert outliers(rng_replicas) == []
    rng_replicas[27].methods["m"]["p99_ms"] = 90.0  # 10x, but among 4 peers: not judged
    assert outliers(rng_replicas) == []
    rng_replicas[5].methods["m"]["p99_ms"] = 10.0  # z large but only 11 % above the median: not enough
    assert outliers(rng_replicas) == []
    rng_replicas[6].methods["m"]["p99_ms"] = 20.0
    (o,) = outliers(rng_replicas)
    assert (o["instance"], o["metric"], o["method"], o["peers"]) == ("r6", "p99_ms", "m", 26)
    assert detect_kernel_mix(rng_replicas, "x") == []


def _latency_replica(i: int, durations_ms: list[float]) -> ReplicaFigures:
    import math

    r = ReplicaFigures("svc", f"r{i:02d}", gpu_model="A")
    d = sorted(durations_ms)
    buckets: dict[int, int] = {}
    for x in d:
        b = math.floor(math.log2(x * 1e6) * LATENCY_BUCKETS_PER_DOUBLING)
        buckets[b] = buckets.get(b, 0) + 1
    p99 = d[min(len(d) - 1, int(round(0.99 * (len(d) - 1))))]
    r.methods["m"] = {"count": len(d), "p50_ms": d[len(d) // 2], "p99_ms": p99, "errors": 0,
                      "latency_buckets": buckets}
    return r


def test_a_high_p99_from_one_slow_request_is_sampling_noise_not_an_outlier() -> None:
    """100 requests each: one replica's p99 is high because of one slow request (most of its requests are as
    fast as everyone's); another's because its whole tail is slow. Only the second is named."""
    base = [10.0 + 0.05 * k for k in range(100)]  # 10 to 15 ms; p99 14.95
    replicas = [_latency_replica(i, [x * (1 + 0.002 * i) for x in base]) for i in range(20)]
    replicas.append(_latency_replica(20, base[:98] + [40.0, 41.0]))  # two unlucky requests: p99 40 ms
    replicas.append(_latency_replica(21, base[:80] + [30.0 + k for k in range(20)]))  # a fifth of them slow
    found = outliers(replicas)
    assert [(o["instance"], o["metric"]) for o in found] == [("r21", "p99_ms")]
    assert found[0]["requests_above_peer_p99"] == 20 and found[0]["tail_p_value"] < 1e-10


def test_binomial_tail() -> None:
    assert binomial_tail(0, 100, 0.01) == 1.0 and binomial_tail(101, 100, 0.01) == 0.0
    assert binomial_tail(1, 100, 0.01) == pytest.approx(1 - 0.99**100)
    assert binomial_tail(3, 100, 0.01) == pytest.approx(1 - 0.99**100 - 100 * 0.01 * 0.99**99
                                                      - 4950 * 0.01**2 * 0.99**98)
    assert binomial_tail(60, 100, 0.01) == 0.0  # far past the mean
    assert 0 < binomial_tail(130, 10_000, 0.01) < 0.01


def test_robust_statistics() -> None:
    s = robust([10, 11, 9, 10, 10, 12, 100, float("nan")])
    assert (s.median, s.mad, s.n) == (10.0, 1.0, 7)
    assert s.z(100) == pytest.approx(0.6745 * 90) and s.z(10) == 0
    flat = robust([0, 0, 0, 0, 1])
    assert flat.mad == 0 and flat.scale == pytest.approx(0.2 / 0.7979)
    same = robust([3, 3, 3])
    assert same.z(3) == 0 and same.z(4) == float("inf")
    with pytest.raises(ValueError):
        robust([])


@pytest.mark.slow
def test_since(fleet: tuple[Path, FleetTruth], tmp_path: Path) -> None:
    """Artifacts and spans before ``--since`` are left out: a day after the fleet's window, nothing is left."""
    root, _ = fleet
    now = 1_795_000_000 * 10**9
    assert parse_since("90m", now) == now - 90 * 60 * 10**9 and parse_since("2d", now) == now - 2 * 86400 * 10**9
    assert parse_since("2026-11-18T10:00:00") == int(dt.datetime(2026, 11, 18, 10, tzinfo=dt.timezone.utc)
                                                      .timestamp()) * 10**9
    with pytest.raises(ValueError, match="--since"):
        parse_since("yesterday-ish")
    report = run_fleet_job(FleetOptions(str(root), since_ns=parse_since("2026-11-20T00:00:00"), drill_down=0,
                                        out=str(tmp_path / "out")))
    assert report.counts["manifests"] == 0 and report.counts["span_requests"] == 0 and report.outliers == []
    assert report.empty and not any(report.outputs.values()) and not (tmp_path / "out").exists()  # nothing written


def _flaky(task: tuple[str, str, int]) -> str:
    """A task that fails its first ``n`` runs (counted in a file) with the given kind of failure."""
    path, kind, n = task
    runs = int(Path(path).read_text()) if Path(path).exists() else 0
    Path(path).write_text(str(runs + 1))
    if runs < n:
        if kind == "oserror":
            raise ConnectionError(f"storage unreachable (run {runs + 1})")
        if kind == "crash":
            os._exit(3)
        raise ValueError("corrupt: retrying will not help")
    return f"{kind} ok after {runs + 1}"


@pytest.mark.slow
def test_the_local_engine_retries_storage_errors_and_dead_workers_not_bad_data(tmp_path: Path) -> None:
    tasks = [(str(tmp_path / "a"), "oserror", 2), (str(tmp_path / "b"), "value", 1),
             (str(tmp_path / "d"), "oserror", 5)]
    got = {Path(o.task[0]).name: (o.result, o.error.split(":")[0], o.attempts)
           for o in run_local(_flaky, tasks, workers=2, retries=2)}
    assert got == {"a": ("oserror ok after 3", "", 3), "b": (None, "ValueError", 1),
                   "d": (None, "ConnectionError", 3)}
    # a worker that dies takes the pool with it: a new pool runs the task again (every task in flight then
    # spends an attempt, so the crash runs alone here)
    (crashed,) = run_local(_flaky, [(str(tmp_path / "c"), "crash", 1)], workers=2, retries=2)
    assert (crashed.result, crashed.error, crashed.attempts) == ("crash ok after 2", "", 2)


@pytest.mark.slow
def test_the_fleet_in_s3(s3: S3, tmp_path: Path) -> None:
    """40 replicas in a bucket (moto's S3 server): the same conclusions, and the results go to the bucket."""
    _need_base_trace()
    spec = FleetSpec(replicas=40, slow=(7,), kernel_mix=(20,), corrupt=(30,), second_gpu_share=0.0, requests=200)
    url = s3.url("fleet-s3")
    truth = build_fleet(url, BASE_TRACE, spec)
    report = run_fleet_job(FleetOptions(url, drill_down=1))
    _check_report_small(report.to_dict(), truth)
    assert report.outputs["report_html"].startswith(f"{url}/fleet/")
    assert s3.fs.exists(report.outputs["report_json"]) and s3.fs.exists(report.outputs["replicas"])
    entry = report.drilldown[instance_name(7)][0]
    assert "error" not in entry and s3.fs.exists(report.outputs["report_html"].rsplit("/", 1)[0] + "/" + entry["html"])


def _check_report_small(report: dict[str, Any], truth: FleetTruth) -> None:
    assert {o["instance"] for o in report["outliers"]} == truth.slow
    assert {f["evidence"]["instance"] for f in report["findings"] if f["id"] == "fleet.kernel-mix"} == truth.kernel_mix
    assert {x["artifact"] for x in report["failed"]} == truth.failed_traces


@pytest.mark.slow
def test_the_ray_engine_on_a_local_cluster(tmp_path: Path) -> None:
    """A real local Ray instance (2 CPUs) runs the tasks: the same conclusions as the local engine, the corrupt
    artifact reported with its error (Ray does not retry a ValueError)."""
    _need_base_trace()
    try:
        import ray
    except ImportError:
        pytest.skip("Ray is not installed (pip install 'zoomer-serve[fleet]')")
    spec = FleetSpec(replicas=24, slow=(5,), corrupt=(11,), second_gpu_share=0.0, requests=200, collectors=2)
    truth = build_fleet(str(tmp_path / "fleet"), BASE_TRACE, spec)
    assert not ray.is_initialized()
    report = run_fleet_job(FleetOptions(str(tmp_path / "fleet"), engine="ray", workers=2, drill_down=0))
    assert not ray.is_initialized()  # the job stopped the instance it started
    _check_report_small(report.to_dict(), truth)
    (failed,) = report.failed
    assert re.match(r"CorruptArtifact: .*SHA-256|CorruptArtifact: .*bytes", failed["error"]), failed
    local = run_fleet_job(FleetOptions(str(tmp_path / "fleet"), engine="local", drill_down=0))
    assert [(o["instance"], o["metric"]) for o in local.outliers] == [(o["instance"], o["metric"])
                                                                      for o in report.outliers]


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end() -> None:
    """benchmarks/fleet.py on a fleet of 12 (no timing asserted): the documented figures, the injected replicas
    named."""
    _need_base_trace()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fleet.py"), "--sizes", "12", "--ray-sizes", "",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)["rows"]
    (job,) = row["jobs"]
    assert row["replicas"] == 12 and row["span_rows"] == 12 * (100 + 2 * 30) and row["parquet_bytes"] > 0
    assert job["engine"] == "local" and job["traces"] == 12 and job["failed"] == 1
    assert job["missed"] == [] and job["also_named"] == [] and job["named"] == row["injected"]
    assert job["tasks_per_s"] > 0 and job["peak_rss_mb"] > 0 and job["startup_s"] > 0
