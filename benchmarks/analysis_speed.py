"""zoomer-serve's trace analysis against Holistic Trace Analysis (HTA, package ``traceinsight``;
``pip install -e '.[hta]'``) on the same files, in one run: speed, memory, and the figures both compute.

Each measurement is a fresh Python process, the tools alternating, ``--repeat`` rounds per trace. The process
imports its libraries, loads the trace and computes the same three breakdowns on both sides:

- ours: ``load_trace`` + ``time_breakdown`` (temporal) + ``kernel_breakdown`` + ``gpu_utilization`` (idle
  time per stream, host wait / kernel wait / other), our default conventions;
- HTA: ``TraceAnalysis(...)`` (its defaults) + ``get_temporal_breakdown`` + ``get_gpu_kernel_breakdown`` +
  ``get_idle_time_breakdown``;
- ``ours_full`` (information): load + every analyzer and detector ``zoomer-serve analyze`` runs.

Wall time is the child process from start to exit as the parent sees it, so imports count (HTA's pandas
and ours alike); the child also reports its import / load / analysis split and CPU time. Peak RSS is the
process's maximum resident set. Targets, as ratios in one run: ours >= 5x faster than HTA (wall time), peak
RSS <= 0.3x HTA's.

Traces: the largest shared trace (``a100_training_step``, 109k events) and, with ``--million``, a
1-million-event trace made from it (copies shifted in time, ids renumbered; plain JSON in a temporary
folder). Then the parity table: every figure both compute, ours under HTA's conventions
(``benchmarks/_hta_parity.py``) against HTA, with HTA's default steps and with all steps; and our load time
of the trace with every event's nested objects before its other keys against Kineto's key order (C18:
at most 2x).

    python benchmarks/analysis_speed.py [--trace PATH] [--repeat 5] [--million] [--no-html]
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _bench_args import Range, parse  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "kineto" / "a100_training_step.json.gz"
TOOLS = ("ours", "hta", "ours_full")
SPEEDUP_TARGET = 5.0
RSS_TARGET = 0.3


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _child_ours(trace: str, full: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    if full:
        from zoomer_serve.analysis.api import analyze_trace
    from zoomer_serve.analysis.breakdown import time_breakdown
    from zoomer_serve.analysis.kernels import kernel_breakdown
    from zoomer_serve.analysis.kineto import load_trace
    from zoomer_serve.analysis.timeline import gpu_utilization

    t1 = time.perf_counter()
    rss_imports = _rss_mb()
    t = load_trace(trace)
    t2 = time.perf_counter()
    if full:
        report = analyze_trace(t)
        extra = {"findings": [f.id for f in report.findings]}
    else:
        time_breakdown(t), kernel_breakdown(t), gpu_utilization(t)
        extra = {}
    t3 = time.perf_counter()
    return {"import_s": t1 - t0, "load_s": t2 - t1, "analyses_s": t3 - t2, "events": t.event_count,
            "rss_imports_mb": rss_imports, **extra}


def _child_hta(trace: str) -> dict[str, Any]:
    import logging

    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis

    t1 = time.perf_counter()
    rss_imports = _rss_mb()
    p = Path(trace)
    ta = TraceAnalysis(trace_files={0: str(p)}, trace_dir=str(p.parent))
    t2 = time.perf_counter()
    ta.get_temporal_breakdown(visualize=False)
    ta.get_gpu_kernel_breakdown(visualize=False)
    ta.get_idle_time_breakdown(visualize=False)
    t3 = time.perf_counter()
    return {"import_s": t1 - t0, "load_s": t2 - t1, "analyses_s": t3 - t2, "rss_imports_mb": rss_imports}


def _child_parity(trace: str, steps: str) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import _hta_parity as parity

    from zoomer_serve.analysis.kineto import load_trace

    mine, theirs = parity.ours(load_trace(trace), steps), parity.hta(trace, steps)
    side = {g: {"ours": mine[g], "hta": theirs[g]} for g in ("temporal", "idle_by_stream", "kernel_type")}
    side["kernel_sum_total"] = {"ours": {"all kernels": sum(mine["kernel_sum"].values())},
                                "hta": {"all kernels": sum(theirs["kernel_sum"].values())}}
    return {"diff": parity.compare(mine, theirs), "side_by_side": side}


def _run_child(tool: str, trace: Path, timeout_s: float = 1800) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", tool, "--trace", str(trace)], capture_output=True,
                          text=True, timeout=timeout_s, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} child failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def _child_main(tool: str, trace: str) -> dict[str, Any]:
    c0 = time.process_time()
    if tool == "ours" or tool == "ours_full":
        out = _child_ours(trace, full=tool == "ours_full")
    elif tool == "hta":
        out = _child_hta(trace)
    else:
        return _child_parity(trace, tool.split(":")[1])
    out["cpu_s"] = time.process_time() - c0
    out["peak_rss_mb"] = _rss_mb()
    return out


def make_million_trace(src: Path, dst: Path, events: int = 1_000_000) -> int:
    """Write a trace of about ``events`` events made of copies of ``src``, each shifted past the previous one
    in time, with correlation ids, External ids and flow ids renumbered per copy. Returns the event count."""
    import gzip

    import orjson

    doc = orjson.loads(gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes())
    evs = doc.pop("traceEvents")
    timed = [e for e in evs if isinstance(e, dict) and isinstance(e.get("ts"), (int, float))]
    lo = min(e["ts"] for e in timed)
    hi = max(e["ts"] + (e.get("dur") or 0) for e in timed)
    span = hi - lo + 1000.0
    ids = [int(e.get("args", {}).get(k, 0)) for e in evs if isinstance(e.get("args"), dict)
           for k in ("correlation", "External id") if isinstance(e["args"].get(k), int)]
    id_step = max(ids, default=0) + 1
    copies = -(-events // len(evs))
    n = 0
    with open(dst, "wb") as fh:
        fh.write(orjson.dumps(doc)[:-1] + (b', "traceEvents": [' if doc else b'{"traceEvents": ['))
        for c in range(copies):
            for e in evs:
                if c and e.get("ph") == "M":
                    continue
                e2 = dict(e)
                if isinstance(e2.get("ts"), (int, float)):
                    e2["ts"] = e2["ts"] + c * span
                if isinstance(e2.get("args"), dict):
                    a = dict(e2["args"])
                    for k in ("correlation", "External id"):
                        if isinstance(a.get(k), int) and a[k] > 0:
                            a[k] += c * id_step
                    e2["args"] = a
                if e2.get("ph") in ("s", "f") and isinstance(e2.get("id"), int):
                    e2["id"] += c * id_step
                fh.write((b",\n" if n else b"") + orjson.dumps(e2))
                n += 1
        fh.write(b"]}\n")
    return n


def make_nested_first_trace(src: Path, dst: Path) -> int:
    """Write ``src`` with every event's keys reordered, nested objects (``args``) first: the layout that
    used to make each piece parse many times over (case C18). Returns the event count."""
    import gzip

    import orjson

    doc = orjson.loads(gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes())
    events = [{k: e[k] for k in sorted(e, key=lambda k: not isinstance(e[k], (dict, list)))}
              if isinstance(e, dict) else e for e in doc["traceEvents"]]
    dst.write_bytes(orjson.dumps({**doc, "traceEvents": events}))
    return len(events)


def make_plain_copy(src: Path, dst: Path) -> int:
    """``src`` decompressed, as it is. Returns its size in bytes."""
    import gzip

    data = gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes()
    dst.write_bytes(data)
    return len(data)


def _make_in_child(src: Path, dst: Path, maker: str = "make_million_trace") -> int:
    """:func:`make_million_trace` in a child process: a child started by a parent that held the trace would
    report the parent's peak RSS as its own (Linux keeps ``ru_maxrss`` across fork and exec)."""
    code = ("import sys, pathlib; sys.path.insert(0, sys.argv[3]); import analysis_speed as a; "
            "print(getattr(a, sys.argv[4])(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])))")
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(dst), str(HERE), maker], capture_output=True,
                          text=True, check=True, timeout=900)
    return int(proc.stdout.strip().splitlines()[-1])


def _summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tool, rs in runs.items():
        if not rs:
            continue
        wall = [r["wall_s"] for r in rs]
        out[tool] = {"wall_median_s": statistics.median(wall), "wall_best_s": min(wall),
                     "cpu_median_s": statistics.median(r["cpu_s"] for r in rs),
                     "import_median_s": statistics.median(r["import_s"] for r in rs),
                     "load_median_s": statistics.median(r["load_s"] for r in rs),
                     "analyses_median_s": statistics.median(r["analyses_s"] for r in rs),
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                     "rss_imports_mb": max(r["rss_imports_mb"] for r in rs), "rounds": len(rs)}
    o, h = out["ours"], out["hta"]
    out["speedup_wall_median"] = h["wall_median_s"] / o["wall_median_s"]
    out["speedup_wall_best"] = h["wall_best_s"] / o["wall_best_s"]
    out["speedup_cpu_median"] = h["cpu_median_s"] / o["cpu_median_s"]
    out["peak_rss_ratio"] = o["peak_rss_mb"] / h["peak_rss_mb"]
    return out


def _bench(trace: Path, repeat: int, tools: tuple[str, ...]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in tools}
    for _ in range(repeat):
        for tool in tools:
            runs[tool].append(_run_child(tool, trace))
    out = _summary(runs)
    out["trace"] = str(trace)
    out["events"] = runs["ours"][0]["events"]
    out["bytes"] = trace.stat().st_size
    out["load_average_1m"] = os.getloadavg()[0]
    if "ours_full" in runs and runs["ours_full"]:
        out["our_findings"] = runs["ours_full"][0]["findings"]
    return out


def _print_speed(name: str, s: dict[str, Any]) -> None:
    print(f"\n### {name}: {s['events']:,} events, {s['bytes'] / 1e6:.1f} MB on disk "
          f"(load average {s['load_average_1m']:.1f})\n")
    print("| tool | wall median s | wall best s | CPU median s | import s | load s | analyses s | peak RSS MB "
          "| RSS after imports MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tool in TOOLS:
        if tool not in s:
            continue
        r = s[tool]
        print(f"| {tool} | {r['wall_median_s']:.2f} | {r['wall_best_s']:.2f} | {r['cpu_median_s']:.2f} | "
              f"{r['import_median_s']:.2f} | {r['load_median_s']:.2f} | {r['analyses_median_s']:.2f} | "
              f"{r['peak_rss_mb']:.0f} | {r['rss_imports_mb']:.0f} |")
    ok_speed = s["speedup_wall_median"] >= SPEEDUP_TARGET
    ok_rss = s["peak_rss_ratio"] <= RSS_TARGET
    print(f"\nspeed-up (HTA / ours, wall, median of {s['ours']['rounds']}): {s['speedup_wall_median']:.1f}x "
          f"(best {s['speedup_wall_best']:.1f}x, CPU {s['speedup_cpu_median']:.1f}x; target >= {SPEEDUP_TARGET:g}x: "
          f"{'met' if ok_speed else 'NOT met'}); peak RSS ours / HTA {s['peak_rss_ratio']:.2f} "
          f"(target <= {RSS_TARGET:g}: {'met' if ok_rss else 'NOT met'})")


def _print_parity(steps: str, parity: dict[str, Any]) -> None:
    diff, side = parity["diff"], parity["side_by_side"]
    print(f"\n#### figures both compute, HTA {'default' if steps == 'complete' else 'include_last_profiler_step=True'}"
          f" vs ours with --conventions hta --steps {steps}\n")
    print("| figure | HTA (us) | ours (us) |")
    print("| --- | ---: | ---: |")
    for group in ("temporal", "kernel_sum_total", "kernel_type", "idle_by_stream"):
        theirs, mine = side[group]["hta"], side[group]["ours"]
        for key in sorted(set(theirs) | set(mine), key=str):
            print(f"| {group}: {key} | {theirs.get(key, 0.0):,.2f} | {mine.get(key, 0.0):,.2f} |")
    print("\n| figures | compared | largest relative difference | where | only ours | only HTA |")
    print("| --- | ---: | ---: | --- | --- | --- |")
    for group, d in diff.items():
        print(f"| {group} | {d['compared']} | {d['max_rel']:.2e} | {str(d['at'])[:50]} | {len(d['only_ours'])} | "
              f"{len(d['only_hta'])} |")


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
    out: dict[str, Any] = {"html_seconds": time.perf_counter() - t0, "html_bytes": len(page), "store": str(store)}
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


RANGES = (Range("--repeat", 1, 100), Range("--million-repeat", 1, 20))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--million", action="store_true", help="also the 1-million-event trace (HTA needs ~1 min each)")
    p.add_argument("--million-repeat", type=int, default=1)
    p.add_argument("--no-parity", action="store_true")
    p.add_argument("--no-key-order", action="store_true", help="skip the key-order (nested objects first) check")
    p.add_argument("--store", type=Path, default=None, help="store for the HTML report (default: run the demo)")
    p.add_argument("--screenshot", type=Path, default=None, help="where to write the Chromium screenshot")
    p.add_argument("--no-html", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write all results as JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv, RANGES)
    if args.child:
        print(json.dumps(_child_main(args.child, str(args.trace))))
        return 0
    if not args.trace.is_file():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    ok = True
    results["real"] = _bench(args.trace, args.repeat, TOOLS)
    _print_speed(args.trace.name, results["real"])
    ok &= results["real"]["speedup_wall_median"] >= SPEEDUP_TARGET and results["real"]["peak_rss_ratio"] <= RSS_TARGET
    if not args.no_parity:
        for steps in ("complete", "all"):
            parity = _run_child(f"parity:{steps}", args.trace)
            parity.pop("wall_s", None)
            results[f"parity_{steps}"] = parity
            _print_parity(steps, parity)
            ok &= max(d["max_rel"] for d in parity["diff"].values()) <= 0.01
    if not args.no_key_order:
        with tempfile.TemporaryDirectory() as tmp:
            plain, nested = Path(tmp) / "kineto_order.json", Path(tmp) / "nested_first.json"
            _make_in_child(args.trace, nested, "make_nested_first_trace")
            _make_in_child(args.trace, plain, "make_plain_copy")
            ko: dict[str, list[float]] = {"kineto_order": [], "nested_first": []}
            for _ in range(args.repeat):
                ko["kineto_order"].append(_run_child("ours", plain)["load_s"])
                ko["nested_first"].append(_run_child("ours", nested)["load_s"])
            med = {k: statistics.median(v) for k, v in ko.items()}
            ratio = med["nested_first"] / med["kineto_order"]
            results["key_order"] = {**med, "ratio": ratio}
            print(f"\nkey order (C18, plain JSON, load only, median of {args.repeat}): Kineto's order "
                  f"{med['kineto_order']:.2f} s, nested objects first {med['nested_first']:.2f} s: {ratio:.2f}x "
                  f"(target <= 2x: {'met' if ratio <= 2 else 'NOT met'})")
            ok &= ratio <= 2.0
    if args.million:
        with tempfile.TemporaryDirectory() as tmp:
            big = Path(tmp) / "million.json"
            n = _make_in_child(args.trace, big)
            results["million"] = _bench(big, args.million_repeat, ("ours", "hta"))
            results["million"]["events_written"] = n
            _print_speed("1-million-event trace (copies of it)", results["million"])
            m = results["million"]
            ok &= m["speedup_wall_median"] >= SPEEDUP_TARGET and m["peak_rss_ratio"] <= RSS_TARGET
    if not args.no_html:
        with tempfile.TemporaryDirectory() as tmp:
            results["html"] = _html_and_screenshot(args.trace, args.store, args.screenshot, Path(tmp))
            print(f"\nHTML report: {json.dumps(results['html'])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print("\nevery target met" if ok else "\nsome target NOT met (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
