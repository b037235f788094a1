"""The fleet job: list the artifacts and span data under a URL, analyse every trace as a task (local process
pool or Ray), fold the results per replica as they arrive, compare replicas with their peers, and write the
results next to the data.

Steps of :func:`run_fleet_job`:

1. list the Kineto trace manifests (:func:`~zoomer_serve.artifacts.inventory.trace_manifest_urls`);
2. run :func:`~zoomer_serve.fleet.tasks.run_task` for each on the engine (:mod:`~zoomer_serve.fleet.engines`):
   retried on storage errors, a corrupt or unreadable artifact recorded as failed with its error;
3. fold each result into its replica (:class:`~zoomer_serve.fleet.aggregate.FleetAggregator`) and write it
   to ``<out>/results/traces/`` as Parquet (:class:`~zoomer_serve.fleet.aggregate.ResultsWriter`);
4. read the span data (``<url>/spans``, ``<url>/metric_points``) with DuckDB: latency, errors, allocator
   retries, host CPU and GPU utilization per replica, and the replica-by-time heat maps
   (:mod:`~zoomer_serve.fleet.spans`);
5. find outliers, kernel spread and kernel mix (:mod:`~zoomer_serve.fleet.detect`);
6. for the first outlier replicas, analyse one of their traces on its own (the single-trace HTML report and
   the merged Perfetto timeline with that replica's requests), the report's drill-down links;
7. write ``replicas.parquet``, ``report.json`` and ``report.html`` to ``<out>`` (default
   ``<url>/fleet/<run_id>``).

Memory: the driver holds one small record per replica (and the list of manifest paths); results stream
through.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoomer_serve.analysis.findings import sort_findings
from zoomer_serve.artifacts.inventory import trace_manifest_urls
from zoomer_serve.artifacts.layout import MANIFEST_SUFFIX
from zoomer_serve.artifacts.storage import StorageError, filesystem, is_local, join, normalize, url_of
from zoomer_serve.fleet.aggregate import FleetAggregator, ReplicaFigures, ResultsWriter, writing_to
from zoomer_serve.fleet.detect import (
    MIN_PEERS,
    detect_kernel_mix,
    detect_kernel_spread,
    detect_outlier_replicas,
    outliers,
    peer_groups,
)
from zoomer_serve.fleet.engines import ENGINES, Outcome, run_local, run_ray
from zoomer_serve.fleet.model import FleetReport
from zoomer_serve.fleet.spans import HeatMap, read_spans
from zoomer_serve.fleet.tasks import run_task

KERNEL_HEATMAP_KERNELS = 30


@dataclass(frozen=True)
class FleetOptions:
    """What to analyse and how.

    Attributes:
        url: the storage root (URL or folder) that holds ``artifacts/`` and span data.
        since_ns: leave out artifacts and spans before this Unix time (ns); None: all.
        engine: "local" (a process pool on this machine) or "ray".
        address: the Ray cluster to join (None: a local Ray instance with ``workers`` CPUs).
        workers: processes of the local pool, CPUs of a local Ray instance.
        retries: further attempts of a task after a storage error.
        out: where results go (default ``<url>/fleet/<run_id>``).
        drill_down: outlier replicas whose first trace gets its own HTML report and timeline.
    """

    url: str
    since_ns: int | None = None
    engine: str = "local"
    address: str | None = None
    workers: int = 2
    retries: int = 2
    out: str | None = None
    drill_down: int = 5

    def __post_init__(self) -> None:
        if not self.url.strip():
            raise ValueError("the storage URL (or folder) is empty")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.workers < 1 or self.retries < 0 or self.drill_down < 0:
            raise ValueError(f"workers >= 1, retries >= 0 and drill_down >= 0 needed, got {self.workers}, "
                             f"{self.retries}, {self.drill_down}")


Progress = Callable[[int, int], None]
"""Called with (tasks done, tasks in all) as results arrive."""


def run_fleet_job(options: FleetOptions, progress: Progress | None = None) -> FleetReport:
    """Run the fleet job (see the module docstring) and return its report.

    When the window holds nothing (:attr:`FleetReport.empty`) nothing is written (``outputs`` names no file).

    Raises:
        StorageError: the URL's fsspec backend is missing, or nothing exists at the URL (the message names it).
        EngineError: the engine cannot run (Ray missing or unreachable).
        zoomer_serve.fleet.aggregate.OutputError: the results cannot be written (an OSError naming where
            they go).
    """
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    source = normalize(options.url)
    _check_exists(source)
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    out = normalize(options.out) if options.out else join(source, "fleet", run_id)
    report = FleetReport(source=source, run_id=run_id, engine=options.engine, since_ns=options.since_ns)
    urls = trace_manifest_urls(source, options.since_ns)
    agg = FleetAggregator()
    writer = ResultsWriter(out)
    counts = {"manifests": len(urls), "traces_analyzed": 0, "traces_failed": 0, "traces_skipped": 0}
    marks["list_s"] = time.monotonic() - t0
    for done, outcome in enumerate(_outcomes(options, [(u, options.since_ns) for u in urls]), 1):
        if done == 1:
            marks["first_result_s"] = time.monotonic() - t0
        url = outcome.task[0]
        if outcome.error:
            counts["traces_failed"] += 1
            report.failed.append({"url": url, "artifact": url[: -len(MANIFEST_SUFFIX)], "error": outcome.error,
                                  "attempts": outcome.attempts})
            writer.add(None, url, outcome.error, outcome.attempts)
        elif outcome.result is None:
            counts["traces_skipped"] += 1
        else:
            counts["traces_analyzed"] += 1
            agg.add_trace(outcome.result)
            writer.add(outcome.result, url, "", outcome.attempts)
        if progress is not None:
            progress(done, len(urls))
    report.outputs["traces"] = writer.close()
    marks["tasks_s"] = time.monotonic() - t0
    report.heatmaps = _span_figures(source, agg, options.since_ns)
    marks["spans_s"] = time.monotonic() - t0
    replicas = sorted(agg.replicas.values(), key=lambda r: (r.service, r.gpu_model, r.instance))
    report.outliers = outliers(replicas)
    report.findings = sort_findings(detect_outlier_replicas(replicas, report.outliers, source)
                                    + detect_kernel_spread(replicas, source) + detect_kernel_mix(replicas, source))
    report.heatmaps["kernel_time"] = kernel_heatmap(replicas)
    report.replicas = [r.row() for r in replicas]
    counts.update(replicas=len(replicas), peer_groups=len(peer_groups(replicas)),
                  span_requests=sum(r.span_requests for r in replicas),
                  peer_groups_too_small=sum(1 for g in peer_groups(replicas).values() if len(g) < MIN_PEERS))
    report.counts = counts
    marks["detect_s"] = time.monotonic() - t0
    report.timings = marks
    if not report.empty:
        _write_outputs(report, out, replicas, source, options)
    report.timings["total_s"] = time.monotonic() - t0
    return report


def _check_exists(source: str) -> None:
    """Raises StorageError when nothing is at ``source`` (a mistyped folder, bucket or prefix), or a file is (a
    store given for the fleet's folder), before anything is listed or written there."""
    fs, base = filesystem(source)
    if not fs.exists(base):
        raise StorageError(f"{source} does not exist (no such folder; on object storage, no object under that "
                           "prefix)")
    if not fs.isdir(base):
        raise StorageError(f"{source} is a file, not a folder: fleet analyze reads the folder (or object-storage "
                           "prefix) that the replicas' trace artifacts and span datasets are under")


def _outcomes(options: FleetOptions, tasks: list[tuple[str, int | None]]) -> Iterator[Outcome]:
    if options.engine == "ray":
        return run_ray(run_task, tasks, options.address, options.workers, options.retries)
    return run_local(run_task, tasks, options.workers, options.retries)


def _span_figures(source: str, agg: FleetAggregator, since_ns: int | None) -> dict[str, HeatMap]:
    from zoomer_serve.collector.parquet import open_dataset

    try:
        con = open_dataset(source, since_ns)
    except FileNotFoundError:
        return {}
    try:
        return read_spans(con, agg, since_ns or 0)
    finally:
        con.close()


def kernel_heatmap(replicas: list[ReplicaFigures], kernels: int = KERNEL_HEATMAP_KERNELS) -> HeatMap:
    """Kernel x replica: µs per request of the ``kernels`` kernels with the most GPU time across the fleet."""
    hm = HeatMap("kernel_time", "GPU time per request of the top kernels, per replica", "us")
    traced = [r for r in replicas if r.requests > 0 and r.kernels]
    totals: dict[str, float] = {}
    for r in traced:
        for name, t in r.kernel_per_request().items():
            totals[name] = totals.get(name, 0.0) + t
    names = [n for n, _ in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:kernels]]
    hm.rows = names
    hm.columns = [r.instance for r in traced]
    hm.groups = [f"{r.service} / {r.gpu_model or 'CPU'}" for r in traced]
    per = [r.kernel_per_request() for r in traced]
    hm.values = [[p.get(n) for p in per] for n in names]
    return hm


def _write_outputs(report: FleetReport, out: str, replicas: list[ReplicaFigures], source: str,
                   options: FleetOptions) -> None:
    """The report, its replicas table and the drill-down pages under ``out``.

    Raises:
        zoomer_serve.fleet.aggregate.OutputError: any storage error, naming ``out``.
    """
    with writing_to(out):
        _write_report(report, out, replicas, source, options)


def _write_report(report: FleetReport, out: str, replicas: list[ReplicaFigures], source: str,
                  options: FleetOptions) -> None:
    fs, root = filesystem(out)
    with tempfile.TemporaryDirectory(prefix="zoomer-fleet-report-") as tmp:
        local = Path(tmp)
        report.drilldown = drill_down(report, replicas, source, local, options.drill_down)
        _replicas_parquet(report.replicas, local / "replicas.parquet")
        report.outputs.update(replicas=url_of(fs, join(root, "replicas.parquet")),
                              report_json=url_of(fs, join(root, "report.json")),
                              report_html=url_of(fs, join(root, "report.html")))
        (local / "report.json").write_text(json.dumps(report.to_dict(), indent=1), encoding="utf-8")
        from zoomer_serve.fleet.html import write_fleet_html

        write_fleet_html(report, local / "report.html")
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            target = join(root, path.relative_to(local).as_posix())
            if is_local(fs):
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(path), target)


def _replicas_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import duckdb

    from zoomer_serve.collector.store import NO_EXTENSION_DOWNLOADS

    con = duckdb.connect(config=NO_EXTENSION_DOWNLOADS)
    try:
        tmp = path.with_suffix(".json")
        tmp.write_text("\n".join(json.dumps(r) for r in rows) or "", encoding="utf-8")
        if rows:
            con.execute(f"COPY (SELECT * FROM read_json('{_q(tmp)}', format = 'newline_delimited')) TO '{_q(path)}' "
                        "(FORMAT parquet)")
        tmp.unlink()
    finally:
        con.close()


def _q(path: Path) -> str:
    return str(path).replace("'", "''")


def drill_down(report: FleetReport, replicas: list[ReplicaFigures], source: str, folder: Path,
               limit: int) -> dict[str, list[dict[str, Any]]]:
    """For the first ``limit`` replicas on the outlier list (then those with a different kernel mix), the
    single-trace analysis of their first trace: an HTML report and a merged Perfetto timeline (with that
    replica's requests from the span data, when there is span data) under ``folder/drilldown/``. Returns
    instance -> entries with paths relative to ``folder``; a trace that cannot be analysed gets ``error``."""
    by_instance = {r.instance: r for r in replicas}
    chosen = report.outlier_instances + [f.evidence["instance"] for f in report.findings if f.id == "fleet.kernel-mix"]
    out: dict[str, list[dict[str, Any]]] = {}
    for instance in dict.fromkeys(chosen):
        if len(out) >= limit:
            break
        r = by_instance.get(instance)
        if r is None or not r.sessions:
            continue
        session_id, trace_url = r.sessions[0]
        out[instance] = [_drill_one(r, session_id, trace_url, source, folder)]
    return out


def _drill_one(r: ReplicaFigures, session_id: str, trace_url: str, source: str, folder: Path) -> dict[str, Any]:
    from zoomer_serve.analysis.api import analyze
    from zoomer_serve.analysis.html import write_html
    from zoomer_serve.analysis.perfetto import write_perfetto

    entry: dict[str, Any] = {"session_id": session_id, "trace_url": trace_url}
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{r.instance}/{session_id}")
    rel = Path("drilldown") / safe
    target = folder / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zoomer-drill-") as tmp:
        try:
            fs, path = filesystem(trace_url)
            local = Path(tmp) / "trace.pt.trace.json.gz"
            fs.get_file(path, str(local))
            store = _replica_store(source, r.service, r.instance, Path(tmp) / "replica.duckdb")
            result = analyze([local], store)
            write_html(result, target.with_suffix(".html"))
            write_perfetto(target.with_suffix(".pftrace"), [t.trace for t in result.traces], result.store)
        except Exception as exc:  # one drill-down must not stop the report
            entry["error"] = f"{type(exc).__name__}: {exc}"
            return entry
    entry.update(html=rel.with_suffix(".html").as_posix(), timeline=rel.with_suffix(".pftrace").as_posix())
    return entry


def _replica_store(source: str, service: str, instance: str, path: Path) -> Path | None:
    """One replica's span data as a small DuckDB store (for the single-trace analysis), or None without any."""
    from zoomer_serve.collector.parquet import open_dataset

    try:
        con = open_dataset(source)
    except FileNotFoundError:
        return None
    try:
        con.execute(f"ATTACH '{_q(path)}' AS replica")
        where = "coalesce(service_name, 'unknown_service') = ? AND service_instance_id = ?"
        for table in ("spans", "metric_points"):
            con.execute(f"CREATE TABLE replica.{table} AS SELECT * FROM {table} WHERE {where}", [service, instance])
        n = con.execute("SELECT count(*) FROM replica.spans").fetchone()
        con.execute("DETACH replica")
    finally:
        con.close()
    return path if n and n[0] else None
