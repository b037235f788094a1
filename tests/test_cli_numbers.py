"""Numeric command-line options: a bad value is refused at parse time (exit 2) with argparse's
``argument OPTION:`` prefix, the value and the accepted range; nothing starts."""

from __future__ import annotations

from typing import Any

import pytest

from zoomer_serve.cli import build_parser


@pytest.mark.parametrize(("argv", "message"), [
    (["report", "--slowest", "abc"], "argument --slowest: 'abc' is not an integer in 0..2147483647"),
    (["report", "--slowest", "-3"], "argument --slowest: '-3' is not an integer in 0..2147483647"),
    # past a 64-bit integer it reached the store's query, whose error called the store "not a zoomer-serve store"
    (["report", "--slowest", "99999999999999999999"],
     "argument --slowest: '99999999999999999999' is not an integer in 0..2147483647"),
    (["analyze", "--rows", "abc"], "argument --rows: 'abc' is not an integer in 0..2147483647"),
    (["analyze", "--rows", "-1"], "argument --rows: '-1' is not an integer in 0..2147483647"),
    (["analyze", "--rows", "99999999999999999999"],
     "argument --rows: '99999999999999999999' is not an integer in 0..2147483647"),
    (["profile", "start", "--target", "h:1", "--requests", "abc"], "argument --requests: 'abc' is not an integer in 1..4294967295"),
    (["profile", "start", "--target", "h:1", "--duration-ms", "1.5"],
     "argument --duration-ms: '1.5' is not an integer in 1..4294967295"),
    (["profile", "start", "--target", "h:1", "--duration-ms", "99999999999999"],
     "argument --duration-ms: '99999999999999' is not an integer in 1..4294967295"),
    (["profile", "start", "--target", "h:1", "--requests", "4294967296"],
     "argument --requests: '4294967296' is not an integer in 1..4294967295"),
    (["profile", "status", "--target", "h:1", "--timeout-s", "x"], "argument --timeout-s: 'x' is not a number > 0"),
    (["profile", "stop", "--target", "h:1", "--wait-s", "nan"], "argument --wait-s: 'nan' is not a number >= 0"),
    (["profile", "stop", "--target", "h:1", "--wait-s", "-1"], "argument --wait-s: '-1' is not a number >= 0"),
    (["serve-demo", "--slo-p99-ms", "-1"], "argument --slo-p99-ms: '-1' is not a number > 0"),
    (["serve-demo", "--slo-p99-ms", "nan"], "argument --slo-p99-ms: 'nan' is not a number > 0"),
    (["serve-demo", "--slo-window-ms", "0"], "argument --slo-window-ms: '0' is not an integer >= 1"),
    (["serve-demo", "--slo-sustain-windows", "x"], "argument --slo-sustain-windows: 'x' is not an integer >= 1"),
    (["serve-demo", "--slo-cooldown-s", "-5"], "argument --slo-cooldown-s: '-5' is not a number >= 0"),
    (["serve-demo", "--steady-warmup-requests", "-1"],
     "argument --steady-warmup-requests: '-1' is not an integer >= 0"),
    (["serve-demo", "--steady-max-cv", "0"], "argument --steady-max-cv: '0' is not a number > 0"),
    (["serve-demo", "--trigger-requests", "0"], "argument --trigger-requests: '0' is not an integer in 1..1000"),
    # past a session's hard cap it was refused later as "max_requests=5000 exceeds the hard cap of 1000"
    (["serve-demo", "--trigger-requests", "5000"],
     "argument --trigger-requests: '5000' is not an integer in 1..1000"),
    (["serve-demo", "--profile-over-ms", "-3"], "argument --profile-over-ms: '-3' is not a number > 0"),
    (["serve-demo", "--profile-over-window-ms", "abc"],
     "argument --profile-over-window-ms: 'abc' is not an integer >= 1"),
    (["serve-demo", "--profile-over-attempts", "0"], "argument --profile-over-attempts: '0' is not an integer >= 1"),
    (["serve-demo", "--torch-threads", "99999999999999"],
     "argument --torch-threads: '99999999999999' is not an integer in 1..1024"),
    # torch.set_num_threads(100000) crashed the server with SIGSEGV
    (["serve-demo", "--torch-threads", "100000"], "argument --torch-threads: '100000' is not an integer in 1..1024"),
    # grpc takes a port modulo 65536: 127.0.0.1:99999 would have called port 34463
    (["profile", "status", "--target", "127.0.0.1:99999"],
     "argument --target: '127.0.0.1:99999' is not HOST:PORT with a port in 1..65535"),
    (["profile", "status", "--target", "localhost"], "argument --target: 'localhost' is not HOST:PORT"),
    (["collector", "--grpc-port", "-1"], "argument --grpc-port: '-1' is not a port number in 0..65535"),
    (["collector", "--http-port", "99999"], "argument --http-port: '99999' is not a port number in 0..65535"),
    (["collector", "--max-message-bytes", "99999999999999"],
     "argument --max-message-bytes: '99999999999999' is not an integer in 1..2147483647"),
    (["collector", "--max-connections", "0"], "argument --max-connections: '0' is not an integer >= 1"),
    (["collector", "--parquet-rotate-s", "-1"], "argument --parquet-rotate-s: '-1' is not a number > 0"),
    (["collector", "--header-timeout-s", "nan"], "argument --header-timeout-s: 'nan' is not a number > 0"),
    (["collector", "--body-timeout-s", "0"], "argument --body-timeout-s: '0' is not a number > 0"),
    (["collector", "--idle-timeout-s", "-2"], "argument --idle-timeout-s: '-2' is not a number > 0"),
    # Path("") is ".": the collector said "cannot open store . for writing: Is a directory"
    (["collector", "--store", ""], "argument --store: the store location is empty"),
    (["collector", "--store", "  "], "argument --store: the store location is empty"),
    (["demo", "--clients", "100000"], "argument --clients: '100000' is not an integer in 1..1024"),
    (["demo", "--clients", "0"], "argument --clients: '0' is not an integer in 1..1024"),
    (["demo", "--duration-s", "1e308"], "argument --duration-s: '1e308' is not a number of seconds in 0..604800"),
    (["demo", "--duration-s", "nan"], "argument --duration-s: 'nan' is not a number of seconds in 0..604800"),
    (["loadtest", "--users", "x"], "argument --users: 'x' is not an integer >= 1"),
    (["loadtest", "--run-time", "0"], "argument --run-time: '0' is not an integer >= 1"),
    (["loadtest", "--spawn-rate", "-1"], "argument --spawn-rate: '-1' is not a number > 0"),
])
def test_a_bad_number_is_refused_naming_the_option_the_value_and_the_range(argv: list[str], message: str,
                                                                           capsys: Any) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"zoomer-serve {argv[0]}" in err and message in err


def test_zero_is_accepted_where_the_range_starts_at_zero() -> None:
    parser = build_parser()
    assert parser.parse_args(["report", "--slowest", "0"]).slowest == 0
    assert parser.parse_args(["analyze", "--rows", "0"]).rows == 0
    assert parser.parse_args(["profile", "stop", "--target", "h:1", "--wait-s", "0"]).wait_s == 0.0
