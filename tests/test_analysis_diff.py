"""``zoomer-serve analyze --diff BEFORE AFTER``: two real traces (the A100 AlexNet trace and a copy changed in
known ways) and two windows of one real store (filled over real OTLP), in the terminal, JSON and HTML."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from zoomer_serve.analysis import cli
from zoomer_serve.analysis.diff import diff, parse_side

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_analysis_store import MS, Req, record_replica

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
pytestmark = pytest.mark.skipif(not KINETO.is_dir(), reason=f"real Kineto traces not found at {KINETO}")
ALEXNET = KINETO / "a100_alexnet_inference.json.gz"
T0_NS = 1_790_000_000_000_000_000


def run_cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    buf = io.StringIO()
    code = cli.run(parser.parse_args(["analyze", *argv]), Console(file=buf, width=160))
    out, err = capsys.readouterr()
    return code, out + buf.getvalue(), err


@pytest.fixture(scope="module")
def changed(tmp_path_factory: Any) -> dict[str, Any]:
    """AlexNet before, and after: one kernel name gone, one new, one twice as long, every pageable copy
    pinned."""
    doc = json.loads(gzip.decompress(ALEXNET.read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    names = sorted({k["name"] for k in kernels})
    gone, slower, cloned = names[0], names[1], names[2]
    after = []
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and e["name"] == gone:
            continue
        e = dict(e)
        if e.get("cat") == "kernel" and e["name"] == slower:
            e["dur"] = e["dur"] * 2
        if e.get("cat") == "gpu_memcpy":
            e["name"] = e["name"].replace("Pageable", "Pinned")
        after.append(e)
        if e.get("cat") == "kernel" and e["name"] == cloned:
            after.append({**e, "name": "new_fused_kernel", "ts": e["ts"] + e["dur"], "dur": 3})
    folder = tmp_path_factory.mktemp("diff")
    path = folder / "after.json"
    path.write_text(json.dumps({**doc, "traceEvents": after}))
    return {"path": path, "gone": gone, "slower": slower, "cloned": cloned,
            "gone_time": sum(k["dur"] for k in kernels if k["name"] == gone),
            "slower_time": sum(k["dur"] for k in kernels if k["name"] == slower),
            "gone_count": sum(1 for k in kernels if k["name"] == gone),
            "new_count": sum(1 for k in kernels if k["name"] == cloned)}


def test_trace_diff_names_what_appeared_vanished_and_changed(changed: dict[str, Any]) -> None:
    report = diff(ALEXNET, changed["path"])
    k = {r["name"]: r for r in report.tables["kernels"].rows()}
    assert k[changed["gone"]]["status"] == "vanished" and k[changed["gone"]]["count_after"] == 0
    assert k["new_fused_kernel"]["status"] == "appeared"
    assert k["new_fused_kernel"]["count_after"] == changed["new_count"]
    assert k["new_fused_kernel"]["launches_after"] == changed["new_count"]  # same correlation as their twin
    slow = k[changed["slower"]]
    assert slow["status"] == "changed" and slow["count_before"] == slow["count_after"]
    assert slow["time_after_us"] == pytest.approx(2 * changed["slower_time"])
    assert slow["change"] == pytest.approx(1.0)
    rank = {"appeared": 0, "vanished": 1, "changed": 2, "same": 3}
    statuses = [rank[s] for s in report.tables["kernels"]["status"].tolist()]
    assert statuses == sorted(statuses)
    renamed = [r for r in k.values() if r["kind"] == "memcpy" and r["status"] != "same"]
    assert {r["status"] for r in renamed} == {"appeared", "vanished"}  # Pageable copies became Pinned ones
    assert all(("Pinned" in r["name"]) == (r["status"] == "appeared") for r in renamed)
    fig = {r["figure"]: r for r in report.tables["figures"].rows()}
    expected = changed["slower_time"] - changed["gone_time"] + 3 * changed["new_count"]
    assert fig["kernel time"]["delta"] == pytest.approx(expected)
    assert fig["kernels"]["delta"] == changed["new_count"] - changed["gone_count"]
    f = {(r["id"], r["scope"]): r for r in report.tables["findings"].rows()}
    assert f[("cuda.pageable-copy", "")]["status"] == "went away"
    assert f[("cuda.host-sync", "")]["status"] == "stayed"
    assert report.tables["cpu_ops"]["status"].tolist().count("same") == len(report.tables["cpu_ops"])


def test_diff_in_the_terminal_json_and_html(changed: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    code, out, err = run_cli(["--diff", str(ALEXNET), str(changed["path"])], capsys)
    # the only warning: the doubled kernels now overlap the ones after them on their stream
    assert code == 0 and [line for line in err.splitlines() if "on the same stream" not in line] == []
    for text in ("Figures", "new_fused_kernel", "vanished", "went away", "cuda.pageable-copy"):
        assert text in out
    html_path = tmp_path / "diff.html"
    code, out, _ = run_cli(["--diff", str(ALEXNET), str(changed["path"]), "--json", "--html", str(html_path)], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["before"] == str(ALEXNET) and set(doc["tables"]) == {"figures", "kernels", "cpu_ops", "phases",
                                                                     "findings"}
    assert all(len(t["rows"]) == t["row_count"] for t in doc["tables"].values())
    page = html_path.read_text()
    assert "new_fused_kernel" in page and 'data-table="findings"' in page and "<script" not in page


@pytest.mark.slow
def test_two_windows_of_one_store(collector: Any, capsys: Any) -> None:
    """The same replica before and after a fix that made preprocess 4x faster, ten seconds apart in one
    store: the windows split them, and the phase and the latency say so."""
    slow = [Req([("preprocess", 2.0), ("forward", 1.0)]) for _ in range(30)]
    fast = [Req([("preprocess", 0.5), ("forward", 1.0)]) for _ in range(30)]
    record_replica(collector, "r1", slow, T0_NS)
    record_replica(collector, "r1", fast, T0_NS + 10_000 * MS)
    collector.finish()
    store = collector.store_path
    middle = (T0_NS + 5_000 * MS) / 1e9
    report = diff(f"{store}@..{middle}", f"{store}@{middle}..")
    fig = {r["figure"]: r for r in report.tables["figures"].rows()}
    assert fig["requests"]["before"] == 30 and fig["requests"]["after"] == 30
    p50 = next(r for name, r in fig.items() if name.endswith(" p50"))
    assert p50["delta"] == pytest.approx(-1.5, abs=0.01)
    ph = {r["phase"]: r for r in report.tables["phases"].rows()}
    assert ph["preprocess"]["mean_before_ms"] == pytest.approx(2.0, abs=0.01)
    assert ph["preprocess"]["mean_after_ms"] == pytest.approx(0.5, abs=0.01)
    assert ph["forward"]["delta_ms"] == pytest.approx(0.0, abs=0.01)
    iso = "2026-10-01T00:00:00+00:00"
    assert parse_side(f"{store}@{iso}..").start_ns == 1_790_812_800_000_000_000


@pytest.mark.slow
def test_latency_figures_are_per_service_and_method(collector: Any) -> None:
    """Two services serving the same method: each has its own percentile rows. The figures were keyed by the
    method alone, so one service's percentiles stood for both, and a service missing from one side showed as a
    latency change of the other."""
    record_replica(collector, "a1", [Req([("forward", 1.0)]) for _ in range(20)], T0_NS, service="fast")
    record_replica(collector, "b1", [Req([("forward", 5.0)]) for _ in range(20)], T0_NS, service="slow")
    record_replica(collector, "a1", [Req([("forward", 1.0)]) for _ in range(20)], T0_NS + 10_000 * MS,
                   service="fast")
    collector.finish()
    middle = (T0_NS + 5_000 * MS) / 1e9
    report = diff(f"{collector.store_path}@..{middle}", f"{collector.store_path}@{middle}..")
    fig = {r["figure"]: r for r in report.tables["figures"].rows()}
    fast = next(r for name, r in fig.items() if name.startswith("fast ") and name.endswith(" p50"))
    slow = next(r for name, r in fig.items() if name.startswith("slow ") and name.endswith(" p50"))
    assert fast["before"] == pytest.approx(1.5, abs=0.01) and fast["delta"] == pytest.approx(0.0, abs=0.01)
    assert slow["before"] == pytest.approx(5.5, abs=0.01) and slow["after"] is None  # none after


@pytest.mark.parametrize("text", ["99999999999999999999", "1e400", "-1e308", "nan", "-5"])
def test_times_outside_what_unix_ns_hold_are_refused(text: str) -> None:
    """``--since 99999999999999999999`` and ``STORE@-1e308..1e308`` ended in OverflowError tracebacks."""
    from zoomer_serve.fleet.cli import parse_since

    with pytest.raises(ValueError, match="is not a time between 1970 and 2262"):
        parse_since(text)
    with pytest.raises(ValueError, match="is not a time between 1970 and 2262"):
        parse_side(f"x.duckdb@{text}..")
    with pytest.raises(ValueError, match="--since: '99999d' is not a time"):
        parse_since("99999d")


@pytest.mark.parametrize("before, message", [
    (f"{ALEXNET}@1..2", "a time window needs a store"),
    ("nope.duckdb@soon..", "neither ISO 8601 time nor Unix seconds"),
    ("missing.json.gz", "not found"),
])
def test_bad_sides_are_one_line_with_exit_2(capsys: Any, before: str, message: str) -> None:
    code, out, err = run_cli(["--diff", before, str(ALEXNET)], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
