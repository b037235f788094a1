"""The ``zoomer-serve`` command line. Each subcommand lives with its concern and registers itself here."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from zoomer_serve import __version__
    from zoomer_serve.analysis import cli as analysis_cli
    from zoomer_serve.collector import cli as collector_cli
    from zoomer_serve.demo import cli as demo_cli
    from zoomer_serve.fleet import cli as fleet_cli
    from zoomer_serve.loadtest import cli as loadtest_cli
    from zoomer_serve.profiling import cli as profiling_cli
    from zoomer_serve.report import cli as report_cli

    parser = argparse.ArgumentParser(prog="zoomer-serve", description="Profiling middleware for PyTorch "
                                     "inference servers: demo, embedded collector, reports, analysis, profiling.")
    parser.add_argument("--version", action="version", version=f"zoomer-serve {__version__}")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (demo_cli, collector_cli, report_cli, analysis_cli, profiling_cli, loadtest_cli, fleet_cli):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from zoomer_serve.processes import die_with_parent

    die_with_parent()  # a collector or server that a demo or loadtest started goes when that command goes
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader of stdout is gone (``| head``): stop quietly
        _drop_stdout()
        return 1
    except KeyboardInterrupt:  # Ctrl+C before the command handles it itself (while it imports and starts)
        print("zoomer-serve: interrupted", file=sys.stderr)
        return 130


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that nothing more is flushed into the closed pipe at exit (Python's recipe
    for SIGPIPE: https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
