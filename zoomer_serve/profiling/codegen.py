"""Reproducible code generation for ``profiler_control.proto`` (the same steps as
:mod:`zoomer_serve.demo.codegen`: grpc_tools' protoc, then package-relative imports).

Run ``python -m zoomer_serve.profiling.codegen`` to rewrite the committed ``profiler_control_pb2.py``,
``profiler_control_pb2.pyi`` and ``profiler_control_pb2_grpc.py`` next to the proto, or add ``--check`` to
verify they are current (exit 1 if not). Output depends on the installed ``grpcio-tools`` version;
regenerate with the version the committed files name. Requires ``grpcio-tools`` (a dev dependency);
importing this module does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zoomer_serve.demo.codegen import codegen_main, protoc_generate, stale_generated

PROFILING_DIR = Path(__file__).resolve().parent
PROTO_NAME = "profiler_control.proto"
GENERATED_NAMES = ("profiler_control_pb2.py", "profiler_control_pb2.pyi", "profiler_control_pb2_grpc.py")


def generate(out_dir: Path, proto_dir: Path = PROFILING_DIR) -> list[Path]:
    """Run protoc on ``proto_dir/profiler_control.proto``; write the three generated files to ``out_dir``.

    Returns the written paths in ``GENERATED_NAMES`` order. Raises ImportError without grpcio-tools,
    CodegenError when protoc fails or its output is not the expected one."""
    return protoc_generate(proto_dir, PROTO_NAME, GENERATED_NAMES, out_dir)


def stale_files(committed_dir: Path = PROFILING_DIR) -> list[str]:
    """Regenerate into a temp dir; names of files in ``committed_dir`` that differ or are missing."""
    return stale_generated(generate, committed_dir)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    return codegen_main("python -m zoomer_serve.profiling.codegen", __doc__, PROFILING_DIR, generate, argv)


if __name__ == "__main__":
    sys.exit(main())
