"""Outputs that are also inputs, or one file twice, are refused before any work (`analyze`, `analyze --diff`):
writing one over an input destroyed what the command had read (a new-user trial: the store, and a Kineto
trace, each replaced by the report with exit 0)."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from zoomer_serve.analysis import cli
from zoomer_serve.cli_paths import output_problem, same_file
from zoomer_serve.collector.store import Store

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
TRACE = KINETO / "a100_cuda_event_sync.json.gz"


def run_cli(argv: list[str], capsys: Any) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    code = cli.run(parser.parse_args(["analyze", *argv]), Console(file=io.StringIO(), width=120))
    return code, capsys.readouterr().err


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "run.duckdb"
    Store(path).close()
    return path


def test_an_html_report_over_the_store_is_refused_and_the_store_kept(store: Path, capsys: Any) -> None:
    before = store.read_bytes()
    code, err = run_cli(["--store", str(store), "--html", str(store)], capsys)
    assert code == 2 and err == f"zoomer-serve analyze: --html {store} is also an input: writing it would overwrite " \
                                "what is read\n"
    assert store.read_bytes() == before


@pytest.mark.skipif(not TRACE.is_file(), reason=f"real Kineto traces not found at {KINETO}")
def test_a_perfetto_timeline_over_its_trace_is_refused_through_another_name(tmp_path: Path, capsys: Any) -> None:
    trace = tmp_path / "t.pt.trace.json.gz"
    shutil.copy(TRACE, trace)
    os.link(trace, tmp_path / "hard.json.gz")  # one file, two names
    for out in (trace, tmp_path / "." / trace.name, tmp_path / "hard.json.gz"):
        code, err = run_cli([str(trace), "--perfetto", str(out)], capsys)
        assert code == 2 and f"--perfetto {out} is also an input" in err, err
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]  # still the Kineto trace
    code, err = run_cli([str(tmp_path), "--perfetto", str(tmp_path / "hard.json.gz")], capsys)  # a folder's traces
    assert code == 2 and "is also an input" in err


def test_two_outputs_naming_one_file_and_outputs_that_cannot_be_written_are_refused_first(
        store: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "r.html"
    code, err = run_cli(["--store", str(store), "--html", str(out), "--perfetto", str(out)], capsys)
    assert code == 2 and f"--html and --perfetto name the same file ({out})" in err
    code, err = run_cli(["--store", str(store), "--html", str(tmp_path / "nodir" / "r.html")], capsys)
    assert code == 2 and f"its folder {tmp_path / 'nodir'} does not exist" in err
    code, err = run_cli(["--store", str(store), "--html", ""], capsys)  # Path("") is the current folder
    assert code == 2 and "--html . is a folder: give the file to write" in err
    assert not out.exists()


def test_diff_refuses_an_html_diff_over_one_of_its_sides(store: Path, tmp_path: Path, capsys: Any) -> None:
    other = tmp_path / "other.duckdb"
    Store(other).close()
    code, err = run_cli(["--diff", f"{store}@..", str(other), "--html", str(store)], capsys)
    assert code == 2 and f"--html {store} is also an input" in err


def test_a_diff_window_not_written_from_to_is_named_as_such(store: Path, capsys: Any) -> None:
    """``STORE@garbage`` said "not found: STORE@garbage" of a store that exists."""
    code, err = run_cli(["--diff", f"{store}@garbage", str(store)], capsys)
    assert code == 2 and "a store's time window is written STORE@FROM..TO" in err and "not found" not in err


def test_same_file_follows_links_and_relative_names(tmp_path: Path, monkeypatch: Any) -> None:
    target = tmp_path / "a.duckdb"
    target.write_bytes(b"x")
    (tmp_path / "link.duckdb").symlink_to(target)
    monkeypatch.chdir(tmp_path)
    assert same_file(Path("a.duckdb"), target) and same_file(Path("link.duckdb"), target)
    assert same_file(Path("new.html"), tmp_path / "new.html")  # neither exists yet
    assert not same_file(Path("b.duckdb"), target)
    assert output_problem([("--html", Path("r.html"))], [target]) is None
