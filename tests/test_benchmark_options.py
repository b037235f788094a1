"""The benchmark scripts' numeric options: a number out of range is refused before anything runs, with the
parser's usage error (exit status 2) naming the option and the value given. Before, ``analysis_speed.py --repeat
0`` ended in a ``KeyError`` traceback, ``fleet.py --workers 0`` in a ``ValueError`` one, and
``profiler_stop_race.py --runs 0`` printed "0 of 0 runs crashed", which reads as a pass."""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _bench_args  # noqa: E402

REFUSED = [
    ("analysis_speed", "--repeat", "0"),
    ("analysis_speed", "--million-repeat", "0"),
    ("batching", "--rounds", "0"),
    ("batching", "--seconds", "0"),
    ("batching", "--seconds", "nan"),
    ("collector_clients", "--clients", "-1"),
    ("collector_clients", "--exports", "0"),
    ("collector_cost", "--spans", "0"),
    ("collector_cost", "--rate", "-1"),
    ("collector_cost", "--linger", "-0.5"),
    ("collector_cost", "--repeat", "0"),
    ("fleet", "--workers", "0"),
    ("fleet", "--requests", "0"),
    ("gpu_check", "--seconds", "0"),
    ("gpu_check", "--overhead-seconds", "-1"),
    ("gpu_check", "--snapshot-budget", "inf"),
    ("profiler_stop_race", "--runs", "0"),
    ("profiler_stop_race", "--cycles", "0"),
    ("profiling_memory", "--rounds", "0"),
    ("profiling_memory", "--requests", "0"),
    ("request_path", "--repeat", "0"),
    ("store_checkpoints", "--rows", "10"),
    ("store_checkpoints", "--pad", "101"),
    ("store_checkpoints", "--repeat", "0"),
    ("overhead", "--rounds", "21"),
]


@pytest.mark.parametrize("script, option, value", REFUSED)
def test_an_out_of_range_number_is_refused_naming_the_option_and_the_value(
        script: str, option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(script).main
    with pytest.raises(SystemExit) as exit_info:
        main([option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{option} {float(value):g} is out of range: need " in err, err


@pytest.mark.parametrize("script", sorted({s for s, _, _ in REFUSED}))
def test_every_numeric_option_of_a_script_has_a_range(script: str) -> None:
    """A new numeric option without a range row would take any number again: the table must name every
    option whose type is int or float (the hidden ``--child`` plumbing options aside)."""
    module = importlib.import_module(script)
    parser: argparse.ArgumentParser = module.build_parser()
    numeric = {a.option_strings[-1] for a in parser._actions
               if a.type in (int, float) and a.help != argparse.SUPPRESS}
    assert numeric and numeric == {r.option for r in module.RANGES}


def test_a_range_admits_its_bounds_and_refuses_what_lies_outside() -> None:
    closed = _bench_args.Range("--rounds", 1, 20)
    open_low = _bench_args.Range("--seconds", 0, 600, low_open=True)
    assert [closed.admits(x) for x in (0, 1, 20, 21)] == [False, True, True, False]
    assert [open_low.admits(x) for x in (0.0, 1e-9, 600.0, 600.1, math.nan, math.inf)] == [
        False, True, True, False, False, False]
    assert open_low.need() == "0 < --seconds <= 600" and closed.need() == "1 <= --rounds <= 20"


def test_numbers_in_range_pass_and_an_unset_option_is_not_checked() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=5.0)
    ranges = (_bench_args.Range("--rounds", 1, 20), _bench_args.Range("--seconds", 0, 600, low_open=True))
    args = _bench_args.parse(parser, ["--seconds", "0.5"], ranges)
    assert (args.rounds, args.seconds) == (None, 0.5)
