"""Parity with Holistic Trace Analysis (HTA; its successor package ``traceinsight`` on the index, installed
by ``pip install -e '.[hta]'``): with HTA's conventions selected (``Conventions("hta", steps)``), every figure
both compute agrees within 1 % on the real shared traces, for HTA's default (``--steps complete``: all but
the last profiler step) and with ``include_last_profiler_step=True`` (``--steps all``). The figures and the
comparison are those of ``benchmarks/_hta_parity.py``: the temporal breakdown (window, busy, idle,
computation, non-computation), idle time per stream and category, GPU time per combination of kernel
types, and per kernel name its sum, mean, min and max. The largest trace is compared in
``benchmarks/analysis_speed.py``.

Without HTA installed, the tests of our conventions themselves (no HTA needed) still run."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zoomer_serve.analysis import analyze_trace, load_trace
from zoomer_serve.analysis.conventions import Conventions, apply_conventions, profiler_steps

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
pytestmark = [pytest.mark.skipif(not KINETO.is_dir(), reason=f"real Kineto traces not found at {KINETO}"),
              pytest.mark.filterwarnings("ignore:::hta")]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _hta_parity as parity  # noqa: E402

TRACES = ("a100_cuda_event_sync", "a100_alexnet_inference", "v100_training_fwdbwd")
REL = 0.01


def path(name: str) -> Path:
    return KINETO / f"{name}.json.gz"


@pytest.mark.parametrize("steps", ["complete", "all"])
@pytest.mark.parametrize("name", TRACES)
@pytest.mark.slow
def test_every_shared_figure_is_within_1_percent_of_hta(name: str, steps: str) -> None:
    pytest.importorskip("hta.trace_analysis", reason="HTA is not installed (pip install -e '.[hta]')")
    diff = parity.compare(parity.ours(load_trace(path(name)), steps), parity.hta(path(name), steps))
    assert parity.worst(diff) <= REL, diff
    assert diff["kernel_sum"]["compared"] > 0 and diff["idle_by_stream"]["compared"] > 0
    for group in ("kernel_sum", "kernel_type"):
        assert diff[group]["only_ours"] == [] and diff[group]["only_hta"] == [], (group, diff[group])


def test_our_default_differs_from_hta_by_its_conventions_on_the_v100_trace() -> None:
    """The V100 trace has 5 profiler steps and sub-microsecond times. Our default counts all of it; HTA's
    default leaves the last step out and rounds times: its window is 20 % shorter. Our figures with
    ``--steps complete`` alone (no rounding) come within 0.1 % of that window."""
    trace = load_trace(path("v100_training_fwdbwd"))
    ours = parity.ours(trace, "all", "zoomer")["temporal"]
    like_hta = parity.ours(trace, "complete", "hta")["temporal"]
    complete = parity.ours(trace, "complete", "zoomer")["temporal"]
    assert like_hta["window"] < 0.85 * ours["window"]
    assert complete["window"] == pytest.approx(like_hta["window"], rel=0.001)


@pytest.mark.slow
def test_complete_steps_leave_out_the_last_step_and_what_it_launched() -> None:
    trace = load_trace(path("a100_training_step"))
    steps = profiler_steps(trace)
    assert steps["step"].tolist() == [1009, 1010, 1011, 1012, 1013, 1014]
    assert steps["last"].tolist() == [False] * 5 + [True]
    cutoff = float(steps["start_us"][-1])
    t = apply_conventions(trace, Conventions("zoomer", "complete"))
    assert len(t.cpu_ops) and float(t.cpu_ops["ts"].max()) < cutoff and float(t.runtime["ts"].max()) < cutoff
    k, rt = trace.kernels, trace.runtime
    launched_before = np.isin(k["correlation"], rt["correlation"][rt["ts"] < cutoff])
    unlaunched_before = ~np.isin(k["correlation"], rt["correlation"]) & (k["ts"] < cutoff)
    assert len(t.kernels) == int((launched_before | unlaunched_before).sum())
    assert 0 < len(t.kernels) < len(trace.kernels)
    assert any("last profiler step is left out" in w for w in t.warnings)
    assert t.summary()["steps"] == "complete"
    # per step: every GPU operation launched in a step counted once, the steps' GPU time adds up
    assert int(steps["gpu_ops"].sum()) <= len(trace.kernels) + len(trace.memops)
    assert np.all(steps["gpu_busy_us"] <= steps["gpu_time_us"] + 1e-6)


@pytest.mark.slow
def test_hta_conventions_round_times_and_count_stream_syncs_as_gpu_work() -> None:
    v100 = apply_conventions(load_trace(path("v100_training_fwdbwd")), Conventions("hta", "all"))
    abs_ts = v100.origin_us + v100.kernels["ts"]
    assert np.all(abs_ts % 1 == 0) and np.all(v100.kernels["dur"] % 1 == 0)
    assert any("rounded to whole microseconds" in w for w in v100.warnings)
    alexnet = load_trace(path("a100_alexnet_inference"))
    hta = apply_conventions(alexnet, Conventions("hta", "all"))
    on_streams = int((alexnet.syncs["stream"] != -1).sum())
    assert on_streams > 0
    assert len(hta.gpu_ops()) == len(alexnet.gpu_ops()) + on_streams
    assert hta.gpu_ops()["kind"].tolist().count("sync") == on_streams
    # the stream rows of the idle breakdown never count them; the device row does
    ours_util, hta_util = analyze_trace(alexnet).tables["gpu_utilization"], analyze_trace(
        alexnet, Conventions("hta", "all")).tables["gpu_utilization"]
    streams = ours_util["stream"] >= 0
    assert ours_util["other_idle_us"][streams].tolist() == hta_util["other_idle_us"][hta_util["stream"] >= 0].tolist()
    assert float(hta_util["busy_us"][0]) > float(ours_util["busy_us"][0])


@pytest.mark.slow
def test_conventions_are_named_in_the_json_output(tmp_path: Path, capsys: Any) -> None:
    import argparse
    import io

    from rich.console import Console

    from zoomer_serve.analysis import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["analyze", str(path("a100_training_step")), "--conventions", "hta", "--json"])
    assert cli.run(args, Console(file=io.StringIO())) == 0
    doc = json.loads(capsys.readouterr().out)
    summary = doc["traces"][0]["summary"]
    assert summary["conventions"] == "hta" and summary["steps"] == "complete"
    steps = doc["traces"][0]["tables"]["profiler_steps"]["rows"]
    assert [r["step"] for r in steps] == [1009, 1010, 1011, 1012, 1013]  # the last one left out
    with pytest.raises(ValueError, match="steps must be one of"):
        Conventions("hta", "some")
    raw = json.loads(gzip.decompress(path("a100_training_step").read_bytes()))
    assert "baseTimeNanoseconds" not in raw  # a 2022 trace: ts are epoch microseconds
