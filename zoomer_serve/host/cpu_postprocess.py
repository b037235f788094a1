"""Post-processing of a session's CPU profile, run as a niced child process (as the kernel trace's is), so that
reading a large profile holds neither the server's interpreter lock nor its memory.

``python -m zoomer_serve.host.cpu_postprocess SPEEDSCOPE COLLAPSED_OUT SUMMARY_OUT --rate-hz R --top N
[--strip PREFIX ...] [--pprof PPROF_OUT]`` checks the speedscope file, writes the collapsed stacks (one line
per distinct stack of active samples) to ``COLLAPSED_OUT``, the same samples as pprof to ``PPROF_OUT``
(:mod:`zoomer_serve.host.pprof`) and the summary (:class:`~zoomer_serve.host.speedscope.CpuProfileSummary`
as JSON) to ``SUMMARY_OUT``. ``--strip``: import roots to shorten source paths by (the server's ``sys.path``).
Exit status 0 on success; :data:`EXIT_EMPTY` when the profile holds no active sample (the summary is still
written, the collapsed and pprof files are not); 1 on any other error (the message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from zoomer_serve.host.pprof import build_profile, write_pprof
from zoomer_serve.host.speedscope import SpeedscopeError, read_speedscope, summarize

EXIT_EMPTY = 3


def run(speedscope: Path, collapsed_out: Path, summary_out: Path, rate_hz: float, top: int,
        prefixes: list[str], pprof_out: Path | None = None) -> int:
    """Do the work; returns the exit status."""
    data = read_speedscope(speedscope)
    summary, lines = summarize(data, rate_hz, top, prefixes)
    summary_out.write_text(json.dumps(summary.to_json()), encoding="utf-8")
    if summary.samples == 0:
        print(f"{speedscope}: no active sample (the sampled threads were idle or the window was too short)",
              file=sys.stderr)
        return EXIT_EMPTY
    collapsed_out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if pprof_out is not None:
        write_pprof(pprof_out, build_profile(data, rate_hz))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoomer_serve.host.cpu_postprocess", description=__doc__)
    parser.add_argument("speedscope", type=Path)
    parser.add_argument("collapsed_out", type=Path)
    parser.add_argument("summary_out", type=Path)
    parser.add_argument("--rate-hz", type=float, required=True)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--strip", action="append", default=[])
    parser.add_argument("--pprof", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        return run(args.speedscope, args.collapsed_out, args.summary_out, args.rate_hz, args.top, args.strip,
                   args.pprof)
    except (OSError, SpeedscopeError) as exc:
        print(f"post-processing {args.speedscope} failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
