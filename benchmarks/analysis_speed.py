"""Loading and analysing the largest shared Kineto trace: zoomer-serve's analysis vs Holistic Trace Analysis
(HTA) ``TraceAnalysis`` on the same file, in one run; plus the HTML report rendered headless in Chromium.

Each measurement runs in a fresh Python process (so peak RSS is that of the work alone): it imports its
libraries, records the RSS, then loads the trace and computes

- ours: every analyzer (GPU utilisation per device/stream with the idle split, kernel breakdown by name and
  kind, launch statistics, copy bandwidth, GPU time per annotation and per request) and every trace detector;
- HTA: ``TraceAnalysis(...)`` (parsing), ``get_temporal_breakdown``, ``get_gpu_kernel_breakdown`` and
  ``get_idle_time_breakdown`` (the figures it shares with us);
- for the loader decision: ``ijson_tables`` (``ijson`` streaming into the same tables, the alternative
  design), and parse-only baselines: ``ijson`` streaming of every event (no tables) and ``orjson.loads`` of
  the whole decompressed file.

It reports wall time and CPU time of the process (median and best of ``--repeat`` runs, alternating the
tools; on a shared machine CPU time is the steadier figure) and peak RSS (total, and above the post-import
baseline), checks that the shared figures agree within 1%, and writes the HTML report
for the trace and a store (``--store``, else a store made by ``zoomer-serve demo``) with a Chromium
screenshot (``--screenshot``).

    python benchmarks/analysis_speed.py [--trace PATH] [--repeat 3] [--store PATH]
                                        [--screenshot docs/analysis-report.png] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "kineto" / "a100_training_step.json.gz"
TOOLS = ("ours", "hta", "ijson_tables", "ijson", "orjson")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _child_ours(trace: str) -> dict[str, Any]:
    from zoomer_serve.analysis import analyze_trace, load_trace

    base = _rss_mb()
    c0 = time.process_time()
    t0 = time.perf_counter()
    t = load_trace(trace)
    t_load = time.perf_counter() - t0
    report = analyze_trace(t)
    seconds = time.perf_counter() - t0
    peak = _rss_mb()
    kb = report.tables["kernel_breakdown"]
    util = report.tables["gpu_utilization"]
    figures = {
        "kernels": dict(zip(kb["name"].tolist(), kb["total_us"].tolist())),
        "idle": {f"{r['stream']}/{c}": r[f"{c}_us" if c != "other" else "other_idle_us"]
                 for r in util.rows() if r["stream"] >= 0 for c in ("host_wait", "kernel_wait", "other")},
        "temporal_idle": util.rows()[0]["idle_us"], "window": util.rows()[0]["window_us"],
        "findings": [f.id for f in report.findings],
    }
    return {"seconds": seconds, "cpu_seconds": time.process_time() - c0, "load_seconds": t_load, "peak_mb": peak,
            "base_mb": base, "figures": figures}


def _child_hta(trace: str) -> dict[str, Any]:
    import logging

    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis

    base = _rss_mb()
    c0 = time.process_time()
    t0 = time.perf_counter()
    ta = TraceAnalysis(trace_files={0: trace}, trace_dir=str(Path(trace).parent), include_last_profiler_step=True)
    t_load = time.perf_counter() - t0
    temporal = ta.get_temporal_breakdown(visualize=False)
    _, kernels = ta.get_gpu_kernel_breakdown(visualize=False, num_kernels=10**9, duration_ratio=1.0,
                                             include_memory_kernels=True)
    idle, _ = ta.get_idle_time_breakdown(visualize=False)
    seconds = time.perf_counter() - t0
    peak = _rss_mb()
    figures = {
        "kernels": dict(zip(kernels["name"].tolist(), kernels["sum (us)"].astype(float).tolist())),
        "idle": {f"{s}/{c}": float(v) for s, c, v in zip(idle["stream"], idle["idle_category"], idle["idle_time"])},
        "temporal_idle": float(temporal["idle_time(us)"].iloc[0]), "window": float(temporal["kernel_time(us)"].iloc[0]),
    }
    return {"seconds": seconds, "cpu_seconds": time.process_time() - c0, "load_seconds": t_load, "peak_mb": peak,
            "base_mb": base, "figures": figures}


def _child_ijson_tables(trace: str) -> dict[str, Any]:
    """The alternative loader design: ijson streaming into the same tables (batches of 10k events)."""
    import gzip
    from itertools import islice
    from pathlib import Path as P

    import ijson

    from zoomer_serve.analysis.kineto import _Normalizer

    base = _rss_mb()
    c0 = time.process_time()
    t0 = time.perf_counter()
    norm = _Normalizer()
    with gzip.open(trace) as fh:
        it = ijson.items(fh, "traceEvents.item", use_float=True)
        while batch := list(islice(it, 10_000)):
            norm.consume(batch)
    t = norm.finish(P(trace), {})
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "peak_mb": _rss_mb(),
            "base_mb": base, "events": t.event_count}


def _child_ijson(trace: str) -> dict[str, Any]:
    import gzip

    import ijson

    base = _rss_mb()
    c0 = time.process_time()
    t0 = time.perf_counter()
    n = 0
    with gzip.open(trace) as fh:
        for _ in ijson.items(fh, "traceEvents.item", use_float=True):
            n += 1
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "peak_mb": _rss_mb(),
            "base_mb": base, "events": n}


def _child_orjson(trace: str) -> dict[str, Any]:
    import gzip

    import orjson

    base = _rss_mb()
    c0 = time.process_time()
    t0 = time.perf_counter()
    with gzip.open(trace) as fh:
        doc = orjson.loads(fh.read())
    n = len(doc["traceEvents"])
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "peak_mb": _rss_mb(),
            "base_mb": base, "events": n}


def _run_child(tool: str, trace: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", tool, "--trace", str(trace)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _agreement(ours: dict[str, Any], hta: dict[str, Any]) -> dict[str, float]:
    """Largest relative differences between our figures and HTA's (over the kernel names we both list)."""
    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-9) if (a or b) else 0.0

    k = max((rel(v, hta["kernels"][n]) for n, v in ours["kernels"].items() if n in hta["kernels"]), default=0.0)
    total = rel(sum(v for n, v in ours["kernels"].items() if n in hta["kernels"]),
                sum(hta["kernels"][n] for n in ours["kernels"] if n in hta["kernels"]))
    idle = max((rel(v, hta["idle"].get(key, 0.0)) if abs(v - hta["idle"].get(key, 0.0)) > 0.01 else 0.0
                for key, v in ours["idle"].items()), default=0.0)
    return {"kernel_max_rel": k, "kernel_total_rel": total, "idle_per_stream_max_rel": idle,
            "temporal_idle_rel": rel(ours["temporal_idle"], hta["temporal_idle"]),
            "window_rel": rel(ours["window"], hta["window"]),
            "names_only_in_ours": float(len(set(ours["kernels"]) - set(hta["kernels"]))),
            "names_only_in_hta": float(len(set(hta["kernels"]) - set(ours["kernels"])))}


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def _html_and_screenshot(trace: Path, store: Path | None, screenshot: Path | None, work: Path) -> dict[str, Any]:
    from zoomer_serve.analysis import analyze
    from zoomer_serve.analysis.html import PLOTS, render_html

    if store is None:
        store = work / "demo.duckdb"
        subprocess.run([sys.executable, "-m", "zoomer_serve.cli", "demo", "--store", str(store), "--duration-s", "8"],
                       check=True, capture_output=True, timeout=300, cwd=work)
    t0 = time.perf_counter()
    page = render_html(analyze([trace], store))
    html_seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"html_seconds": html_seconds, "html_bytes": len(page), "store": str(store)}
    chromium = _chromium()
    if chromium is None:
        out["chromium"] = "not installed: skipped"
        return out
    probe = page.replace("</body>", "<script>document.body.dataset.loadedPlots=[...document.querySelectorAll("
                                    "'img.plot')].filter(i=>i.complete&&i.naturalWidth>0).map(i=>i.dataset.plot)"
                                    ".join(',');</script></body>")
    path = work / "report.html"
    path.write_text(probe)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={work / 'chromium-profile'}"]
    dom = subprocess.run([chromium, *flags, "--virtual-time-budget=5000", "--dump-dom", path.as_uri()],
                         capture_output=True, text=True, timeout=120)
    m = re.search(r'data-loaded-plots="([^"]*)"', dom.stdout)
    loaded = set(m.group(1).split(",")) if m and m.group(1) else set()
    out["plots_loaded"] = sorted(loaded)
    out["plots_missing"] = sorted(set(PLOTS) - loaded)
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([chromium, *flags, "--window-size=1280,3000", "--hide-scrollbars",
                        f"--screenshot={screenshot}", path.as_uri()], capture_output=True, timeout=120)
        out["screenshot"] = str(screenshot)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--store", type=Path, default=None, help="store for the HTML report (default: run the demo)")
    p.add_argument("--screenshot", type=Path, default=None, help="where to write the Chromium screenshot")
    p.add_argument("--no-html", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write all results as JSON")
    p.add_argument("--child", choices=TOOLS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        fn = {"ours": _child_ours, "hta": _child_hta, "ijson_tables": _child_ijson_tables, "ijson": _child_ijson,
              "orjson": _child_orjson}[args.child]
        print(json.dumps(fn(str(args.trace))))
        return 0
    if not args.trace.is_file():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TOOLS}
    for _ in range(args.repeat):
        for tool in TOOLS:
            runs[tool].append(_run_child(tool, args.trace))
    summary: dict[str, Any] = {"trace": str(args.trace), "repeat": args.repeat, "cpus": os.cpu_count(),
                               "load_average": os.getloadavg()[0]}
    for tool, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        cpu = [r["cpu_seconds"] for r in rs]
        summary[tool] = {"median_s": statistics.median(secs), "best_s": min(secs),
                         "cpu_median_s": statistics.median(cpu), "cpu_best_s": min(cpu),
                         "peak_rss_mb": max(r["peak_mb"] for r in rs),
                         "peak_above_imports_mb": max(r["peak_mb"] - r["base_mb"] for r in rs),
                         "load_median_s": statistics.median(r.get("load_seconds", r["seconds"]) for r in rs)}
    o, h = summary["ours"], summary["hta"]
    summary["speedup_median"] = h["median_s"] / o["median_s"]
    summary["speedup_best"] = h["best_s"] / o["best_s"]
    summary["cpu_speedup_median"] = h["cpu_median_s"] / o["cpu_median_s"]
    summary["cpu_speedup_best"] = h["cpu_best_s"] / o["cpu_best_s"]
    summary["peak_rss_ratio"] = o["peak_rss_mb"] / h["peak_rss_mb"]
    summary["peak_above_imports_ratio"] = o["peak_above_imports_mb"] / h["peak_above_imports_mb"]
    summary["agreement"] = _agreement(runs["ours"][0]["figures"], runs["hta"][0]["figures"])
    summary["our_findings"] = runs["ours"][0]["figures"]["findings"]
    if not args.no_html:
        with tempfile.TemporaryDirectory() as tmp:
            summary["html"] = _html_and_screenshot(args.trace, args.store, args.screenshot, Path(tmp))
    print(json.dumps(summary, indent=2))
    print()
    print("| tool | wall median s | wall best s | CPU median s | CPU best s | load wall s (median) | peak RSS MB "
          "| peak above imports MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tool in TOOLS:
        s = summary[tool]
        print(f"| {tool} | {s['median_s']:.2f} | {s['best_s']:.2f} | {s['cpu_median_s']:.2f} | {s['cpu_best_s']:.2f} | "
              f"{s['load_median_s']:.2f} | {s['peak_rss_mb']:.0f} | {s['peak_above_imports_mb']:.0f} |")
    print(f"\nspeed-up (HTA / ours): wall median {summary['speedup_median']:.1f}x, best {summary['speedup_best']:.1f}x; "
          f"CPU time median {summary['cpu_speedup_median']:.1f}x, best {summary['cpu_speedup_best']:.1f}x; "
          f"peak RSS ours/HTA {summary['peak_rss_ratio']:.2f}, above imports {summary['peak_above_imports_ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    agree = summary["agreement"]
    ok = max(agree["kernel_max_rel"], agree["kernel_total_rel"], agree["idle_per_stream_max_rel"],
             agree["temporal_idle_rel"]) <= 0.01
    print("figures agree with HTA within 1%" if ok else f"DISAGREEMENT with HTA: {agree}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
