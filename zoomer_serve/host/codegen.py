"""Reproducible code generation for ``profile.proto`` (the pprof format of the CPU profiles,
:mod:`zoomer_serve.host.pprof`), with grpc_tools' protoc as :mod:`zoomer_serve.demo.codegen` runs it.

Run ``python -m zoomer_serve.host.codegen`` to rewrite the committed ``profile_pb2.py`` and ``profile_pb2.pyi``
next to the proto (messages only: no grpc module), or add ``--check`` to verify they are current (exit 1 if not).
Output depends on the installed ``grpcio-tools`` version; regenerate with the version the committed files
name. Requires ``grpcio-tools`` (a dev dependency); importing this module does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zoomer_serve.demo.codegen import codegen_main, protoc_generate, stale_generated

HOST_DIR = Path(__file__).resolve().parent
PROTO_NAME = "profile.proto"
GENERATED_NAMES = ("profile_pb2.py", "profile_pb2.pyi")


def generate(out_dir: Path, proto_dir: Path = HOST_DIR) -> list[Path]:
    """Run protoc on ``proto_dir/profile.proto``; write the two generated files to ``out_dir``.

    Returns the written paths in ``GENERATED_NAMES`` order. Raises ImportError without grpcio-tools,
    CodegenError when protoc fails or its output is not the expected one."""
    return protoc_generate(proto_dir, PROTO_NAME, GENERATED_NAMES, out_dir)


def stale_files(committed_dir: Path = HOST_DIR) -> list[str]:
    """Regenerate into a temp dir; names of files in ``committed_dir`` that differ or are missing."""
    return stale_generated(generate, committed_dir)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    return codegen_main("python -m zoomer_serve.host.codegen", __doc__, HOST_DIR, generate, argv)


if __name__ == "__main__":
    sys.exit(main())
