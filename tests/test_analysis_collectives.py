"""Collectives across ranks. The shared traces are of one rank each; the A100 training step holds NCCL kernels
(42 SendRecv, 18 AllReduce; the V100 trace, of a one-rank job, has NCCL calls on the CPU, 25
``nccl:all_reduce`` and 10 ``nccl:broadcast`` ranges, but no NCCL kernel), so the ranks here are copies of
the A100 trace's GPU work (kernels and copies), each with its own ``distributedInfo.rank``, one of them
delayed by a known amount: written by :func:`write_ranks`."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from zoomer_serve.analysis import analyze, cli, load_trace
from zoomer_serve.analysis.collectives import (
    collective_of,
    collectives_per_rank,
    detect_collectives,
    overlap_per_rank,
    stragglers,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _finding_claims import checked_ids

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
pytestmark = pytest.mark.skipif(not KINETO.is_dir(), reason=f"real Kineto traces not found at {KINETO}")
SOURCE = KINETO / "a100_training_step.json.gz"
DELAY_US = 3000.0
RANKS = 4


def write_ranks(folder: Path, delayed: int | None, delay_us: float = DELAY_US) -> list[Path]:
    """RANKS traces with the source's kernels and copies; rank ``delayed`` shifted ``delay_us`` later."""
    doc = json.loads(gzip.decompress(SOURCE.read_bytes()))
    gpu = [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(RANKS):
        shift = delay_us if r == delayed else 0.0
        events = [{**e, "ts": e["ts"] + shift} for e in gpu]
        meta = {"distributedInfo": {"backend": "nccl", "rank": r, "world_size": RANKS},
                "deviceProperties": doc["deviceProperties"]}
        path = folder / f"rank{r}.json"
        path.write_text(json.dumps({**meta, "traceEvents": events}))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def delayed(tmp_path_factory: Any) -> list[Path]:
    return write_ranks(tmp_path_factory.mktemp("ranks"), delayed=2)


def test_collective_names() -> None:
    assert collective_of("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)") == "AllReduce"
    assert collective_of("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)") == "SendRecv"
    assert collective_of("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "ReduceScatter"
    assert collective_of("ncclDevKernel_AllGather_RING_LL") == "AllGather"
    assert collective_of("ncclKernel_something") == "other"


@pytest.mark.slow
def test_collectives_per_rank_and_overlap(delayed: list[Path]) -> None:
    traces = [load_trace(p) for p in delayed]
    table = collectives_per_rank(traces)
    raw = json.loads(gzip.decompress(SOURCE.read_bytes()))
    expected = {"SendRecv": [e["dur"] for e in raw["traceEvents"] if e.get("cat") == "kernel"
                             and e["name"].startswith("ncclKernel_SendRecv")],
                "AllReduce": [e["dur"] for e in raw["traceEvents"] if e.get("cat") == "kernel"
                              and e["name"].startswith("ncclKernel_AllReduce")]}
    assert sorted(set(table["rank"].tolist())) == [0, 1, 2, 3]
    for row in table.rows():
        durs = expected[row["collective"]]
        assert row["count"] == len(durs) and row["total_us"] == pytest.approx(sum(durs))
        assert row["max_us"] == pytest.approx(max(durs))
    assert {c: len(d) for c, d in expected.items()} == {"SendRecv": 42, "AllReduce": 18}
    overlap = overlap_per_rank(traces)
    assert len(overlap) == RANKS
    assert len(set(np.round(overlap["hidden_us"], 3).tolist())) == 1  # copies: the same on every rank
    row = overlap.rows()[0]
    assert row["hidden_us"] + row["exposed_us"] == pytest.approx(row["communication_us"])
    assert 0.0 <= row["hidden_share"] <= 1.0


@pytest.mark.slow
def test_the_delayed_rank_is_the_straggler(delayed: list[Path]) -> None:
    traces = [load_trace(p) for p in delayed]
    table = stragglers(traces)
    top = table.rows()[0]
    assert top["rank"] == 2 and top["matched"] == 60 and top["last"] == 60 and top["last_share"] == 1.0
    assert top["mean_lateness_us"] == pytest.approx(DELAY_US)
    assert top["others_waited_us"] == pytest.approx(60 * DELAY_US)
    assert all(r["last"] == 0 and r["mean_lateness_us"] == 0.0 for r in table.rows()[1:])
    findings = [f for f in detect_collectives(traces) if f.id == "collective.straggler"]
    assert [f.scope for f in findings] == ["rank 2"] and findings[0].severity == "high"
    checked_ids(detect_collectives(traces))


@pytest.mark.slow
def test_no_straggler_when_ranks_keep_time(tmp_path: Path) -> None:
    traces = [load_trace(p) for p in write_ranks(tmp_path, delayed=None)]
    assert not [f for f in detect_collectives(traces) if f.id == "collective.straggler"]


@pytest.mark.slow
def test_a_folder_of_rank_traces_on_the_command_line(delayed: list[Path], capsys: Any) -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["analyze", str(delayed[0].parent), "--json"])
    assert cli.run(args, Console(file=io.StringIO())) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["traces"]) == RANKS
    assert set(doc["collectives"]) == {"collectives", "communication_overlap", "stragglers"}
    assert doc["collectives"]["stragglers"]["rows"][0]["rank"] == 2
    assert any(f["id"] == "collective.straggler" and f["scope"] == "rank 2" for f in doc["findings"])
    buf = io.StringIO()
    args = parser.parse_args(["analyze", *map(str, delayed)])
    assert cli.run(args, Console(file=buf, width=160)) == 0
    assert "Collectives across 4 ranks" in buf.getvalue()
    result = analyze(delayed)
    assert len(result.collective_tables["collectives"]) == 2 * RANKS
