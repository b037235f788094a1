"""``zoomer-serve analyze``: terminal summary, --json, --html (rendered headless in Chromium when it is
installed) and the merged Perfetto trace, over a real trace and a store filled over real OTLP."""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from zoomer_serve.analysis import analyze, cli, render_findings
from zoomer_serve.analysis import labels as L
from zoomer_serve.analysis.html import PLOTS, render_html

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_analysis_store import MS, normal, record_replica

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
pytestmark = pytest.mark.skipif(not KINETO.is_dir(), reason=f"real Kineto traces not found at {KINETO}")
TRACE = KINETO / "a100_cuda_event_sync.json.gz"


def run_cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["analyze", *argv])
    buf = io.StringIO()
    code = cli.run(args, Console(file=buf, width=120, force_terminal=False))
    return code, buf.getvalue()


@pytest.fixture
def store(collector: Any) -> Path:
    """Two replicas (one slow, with GPU memory attributes) whose requests fall inside the trace's time
    range, one of them labelled as a request range in a copy of the trace (see ``linked_trace``)."""
    trace_start_ns = 1707417525509335 * 1000
    gib = 1 << 30
    fast = normal(25, 1)
    for k, req in enumerate(fast):
        req.attrs.update({L.GPU_MEMORY_ALLOCATED: gib + k * (gib // 50), L.GPU_MEMORY_RESERVED: 2 * gib,
                          L.GPU_MEMORY_PEAK: gib + k * (gib // 40)})
    record_replica(collector, "fast", fast, trace_start_ns - 100 * MS)
    record_replica(collector, "slow", normal(25, 2, pre=10.0), trace_start_ns - 90 * MS)
    collector.finish()
    return collector.store_path


def test_terminal_summary_json_and_exit_codes(store: Path, tmp_path: Path) -> None:
    code, out = run_cli([str(TRACE), "--store", str(store)])
    assert code == 0
    for text in ("GPU busy / idle", "Top kernels", "cuda.host-sync", "request.slow-replica", "Requests"):
        assert text in out
    code, _ = run_cli([str(TRACE), "--fail-on", "high"])
    assert code == 3  # the event-sync trace has a high-severity low-utilisation finding
    assert run_cli([str(tmp_path / "nope.json")])[0] == 2
    assert run_cli(["--store", str(tmp_path / "nope.duckdb")])[0] == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [oops]}')
    assert run_cli([str(bad)])[0] == 2


@pytest.mark.parametrize("content", ["[]", '[{"a": 1}]', '{"a": 1}', '{"traceEvents": []}'])
def test_a_json_file_without_trace_events_is_an_input_error_naming_the_file(tmp_path: Path, capsys: Any,
                                                                             content: str) -> None:
    """Not "No findings" with exit 0: exit 2 and a message naming the file and what a trace holds."""
    empty = tmp_path / "empty.json"
    empty.write_text(content)
    code, out = run_cli([str(empty)])
    err = capsys.readouterr().err
    assert code == 2 and out == ""
    assert err.startswith(f"zoomer-serve analyze: {empty}: ") and "traceEvents" in err
    assert "Traceback" not in err


def test_json_output(store: Path, capsys: Any) -> None:
    code, _ = run_cli([str(TRACE), "--store", str(store), "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    ids = {f["id"] for f in doc["findings"]}
    assert {"cuda.host-sync", "cuda.pageable-copy", "request.slow-replica"} <= ids
    host_sync = next(f for f in doc["findings"] if f["id"] == "cuda.host-sync")
    assert host_sync["evidence"]["sync_calls_count"] == 3
    assert doc["store"]["requests"] == 50
    tables = doc["traces"][0]["tables"]
    assert tables["gpu_utilization"]["rows"][0]["busy_us"] == 51.0
    assert tables["gpu_utilization"]["units"]["busy_us"] == "us"


def test_render_findings_prints_plain_text_names() -> None:
    result = analyze([KINETO / "a100_alexnet_inference.json.gz"])
    buf = io.StringIO()
    render_findings(result.findings, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "aten::to" in out and "HIGH" in out and "cuda.pageable-copy" in out
    buf = io.StringIO()
    render_findings([], Console(file=buf))
    assert "No findings" in buf.getvalue()


def _plots(html_text: str) -> dict[str, bytes]:
    out = {}
    for name, data in re.findall(r'data-plot="([a-z_]+)"[^>]*src="data:image/png;base64,([^"]+)"', html_text):
        out.setdefault(name, base64.b64decode(data))
    return out


@pytest.mark.slow
def test_html_report_has_every_plot(store: Path, tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    out = tmp_path / "report.html"
    code, _ = run_cli([str(TRACE), "--store", str(store), "--html", str(out)])
    assert code == 0
    text = out.read_text()
    assert "src=\"http" not in text and "<script" not in text  # self-contained
    plots = _plots(text)
    assert set(plots) == set(PLOTS)
    for name, png in plots.items():
        img = mpimg.imread(io.BytesIO(png), format="png")
        assert img.shape[0] > 150 and img.shape[1] > 400, name
        assert float(np.std(img)) > 0.01, f"{name} is blank"
    for fid in ("cuda.host-sync", "request.slow-replica", "gpu.low-utilization"):
        assert f'data-finding="{fid}"' in text
    # names with markup-like characters are escaped, never interpreted
    result = analyze([KINETO / "a100_alexnet_inference.json.gz"])
    page = render_html(result)
    assert "[param|cuda]" in page and "<param" not in page


@pytest.mark.slow
def test_html_without_data_says_what_is_missing() -> None:
    page = render_html(analyze([TRACE]))
    assert 'data-plot-missing="latency_over_time"' in page and "--store" in page
    assert 'data-plot="gpu_utilization"' in page


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)")
@pytest.mark.slow
def test_html_report_renders_in_headless_chromium(store: Path, tmp_path: Path) -> None:
    """Chromium loads the page and every plot image decodes (naturalWidth > 0); the screenshot is not blank.
    A copy of the page gets a probe script that records the loaded plots on <body> for --dump-dom."""
    import matplotlib.image as mpimg

    page = render_html(analyze([TRACE], store))
    probe = page.replace("</body>", "<script>document.body.dataset.loadedPlots=[...document.querySelectorAll("
                                    "'img.plot')].filter(i=>i.complete&&i.naturalWidth>0).map(i=>i.dataset.plot)"
                                    ".join(',');</script></body>")
    html_path = tmp_path / "probe.html"
    html_path.write_text(probe)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--virtual-time-budget=5000", "--dump-dom", html_path.as_uri()],
                         capture_output=True, text=True, timeout=120)
    loaded = re.search(r'data-loaded-plots="([^"]*)"', dom.stdout)
    assert loaded is not None, dom.stderr[-2000:]
    assert set(loaded.group(1).split(",")) == set(PLOTS)
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1280,2400", f"--screenshot={shot}", html_path.as_uri()],
                   capture_output=True, timeout=120)
    img = mpimg.imread(shot)
    assert img.shape[0] >= 2000 and float(np.std(img)) > 0.05


def test_json_holds_every_row_of_every_table(capsys: Any) -> None:
    """--json is complete (--rows only limits the terminal summary): every table's rows equal its row count."""
    code, _ = run_cli([str(KINETO / "a100_alexnet_inference.json.gz"), "--json", "--rows", "2"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    tables = doc["traces"][0]["tables"]
    assert tables["kernel_breakdown"]["row_count"] > 10
    for name, t in tables.items():
        assert len(t["rows"]) == t["row_count"], name


@pytest.mark.slow
def test_html_columns_carry_their_unit_and_tables_their_caption() -> None:
    """A column's unit is in its header and every cell of it is in that unit (the window of 13 s in
    seconds, not "12,920,244.00 us" nor a mix); every table has a caption and scrolls inside the page."""
    page = render_html(analyze([KINETO / "a100_alexnet_inference.json.gz"]))
    tables = re.findall(r'<div class="scroll"><table data-table="([a-z_]+)"><caption>', page)
    assert {"gpu_utilization", "time_breakdown", "kernel_breakdown", "launch_stats"} <= set(tables)
    assert page.count("<table data-table=") == len(tables) == page.count("<caption>")
    assert ".scroll{overflow-x:auto" in page
    util = re.search(r'<table data-table="gpu_utilization">(.*?)</table>', page).group(1)
    headers = re.findall(r"<th>([^<]*)</th>", util)
    assert "window (s)" in headers and "utilization (%)" in headers and "window_us" not in headers
    col = headers.index("window (s)")
    first_row = re.findall(r"<td[^>]*>([^<]*)</td>", util.split("</tr>")[1])
    assert first_row[col] == "12.92"  # 12,920,244 us
    assert all(not cell.endswith((" s", " ms", " us")) for cell in first_row)


def test_a_trace_without_gpu_work_says_so_in_one_sentence(tmp_path: Path) -> None:
    """A CPU-only trace: one sentence instead of empty GPU tables and a misleading plot note."""
    from zoomer_serve.analysis.render import NO_GPU_WORK

    doc = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10 * i,
                            "dur": 5} for i in range(20)]}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(doc))
    page = render_html(analyze([path]))
    assert page.count(NO_GPU_WORK) == 1
    for table in ("gpu_utilization", "kernel_breakdown", "launch_stats", "time_breakdown"):
        assert f'data-table="{table}"' not in page
    assert "the traces hold no GPU work" in page and "needs a Kineto trace" not in page
    code, out = run_cli([str(path)])
    assert code == 0 and "holds no GPU work" in out.replace("\n", " ") and "GPU busy / idle" not in out


def test_a_trace_without_gpu_work_shows_its_annotations_and_requests_by_cpu_time_only(tmp_path: Path) -> None:
    """A CPU-only trace of the served model (phases and zoomer.request ranges, no kernels): the per-annotation
    and per-request tables the no-GPU sentence points at are titled and shown by CPU time, without GPU columns
    that could only be zero, in the terminal summary and the HTML report."""
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    events = [{"ph": "X", "cat": "user_annotation", "name": f"zoomer.request/{trace_id}/{span_id}", "pid": 1,
               "tid": 1, "ts": 0, "dur": 100},
              {"ph": "X", "cat": "user_annotation", "name": "forward", "pid": 1, "tid": 1, "ts": 10, "dur": 80}]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 20 + 10 * i, "dur": 5}
               for i in range(5)]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    code, out = run_cli([str(path)])
    flat = out.replace("\n", " ")
    assert code == 0 and "holds no GPU work" in flat
    assert "CPU time per annotation" in out and "CPU time per request" in out, out
    assert "GPU time per" not in out and "gpu_time" not in out and "gpu_ops" not in out, out
    assert trace_id in out and "forward" in out
    page = render_html(analyze([path]))
    assert "CPU time per annotation" in page and "CPU time per request" in page
    assert "GPU time per annotation" not in page and "GPU time per request" not in page
