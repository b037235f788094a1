"""Post-processing of a session's raw trace, run as a child process so that parsing a large trace holds
neither the server's interpreter lock nor its memory.

``python -m zoomer_serve.profiling.postprocess RAW_JSON GZIP_OUT SUMMARY_OUT [--top-kernels N]`` reads the
plain Chrome trace ``RAW_JSON``, writes its per-request summary
(:func:`~zoomer_serve.profiling.summary.summary_to_json`) to ``SUMMARY_OUT`` and the gzip-compressed trace to
``GZIP_OUT``. Exit status 0 on success; :data:`EXIT_EMPTY` when the trace holds no complete event (nothing is
written); 1 on any other error (the message on stderr). It lowers its own CPU priority first.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

from zoomer_serve.profiling.summary import load_trace, summarize_events, summary_to_json

EXIT_EMPTY = 3


def run(raw: Path, gzip_out: Path, summary_out: Path, top_kernels: int) -> int:
    """Do the work; returns the exit status."""
    summary = summarize_events(load_trace(raw)["traceEvents"])
    if summary.event_count == 0:
        print(f"{raw}: the profiler captured no events", file=sys.stderr)
        return EXIT_EMPTY
    with open(raw, "rb") as src, gzip.open(gzip_out, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    summary_out.write_text(json.dumps(summary_to_json(summary, top_kernels)), encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoomer_serve.profiling.postprocess", description=__doc__)
    parser.add_argument("raw", type=Path)
    parser.add_argument("gzip_out", type=Path)
    parser.add_argument("summary_out", type=Path)
    parser.add_argument("--top-kernels", type=int, default=10)
    args = parser.parse_args(argv)
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        return run(args.raw, args.gzip_out, args.summary_out, args.top_kernels)
    except (OSError, ValueError) as exc:
        print(f"post-processing {args.raw} failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
