"""Reproducible code generation for ``profiler_control.proto`` (the same steps as
:mod:`zoomer_serve.demo.codegen`: grpc_tools' protoc, then package-relative imports).

Run ``python -m zoomer_serve.profiling.codegen`` to rewrite the committed ``profiler_control_pb2.py``,
``profiler_control_pb2.pyi`` and ``profiler_control_pb2_grpc.py`` next to the proto, or add ``--check`` to
verify they are current (exit 1 if not). Output depends on the installed ``grpcio-tools`` version;
regenerate with the version the committed files name. Requires ``grpcio-tools`` (a dev dependency);
importing this module does not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from zoomer_serve.demo.codegen import CodegenError, _grpc_tools_include, make_imports_relative

PROFILING_DIR = Path(__file__).resolve().parent
PROTO_NAME = "profiler_control.proto"
GENERATED_NAMES = ("profiler_control_pb2.py", "profiler_control_pb2.pyi", "profiler_control_pb2_grpc.py")


def generate(out_dir: Path, proto_dir: Path = PROFILING_DIR) -> list[Path]:
    """Run protoc on ``proto_dir/profiler_control.proto``; write the three generated files to ``out_dir``.

    Returns the written paths in ``GENERATED_NAMES`` order. Raises ImportError without grpcio-tools,
    CodegenError when protoc fails or its output is not the expected one."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    code = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"-I{_grpc_tools_include()}",
                        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
                        str(proto_dir / PROTO_NAME)])
    if code != 0:
        raise CodegenError(f"protoc exited with {code} for {proto_dir / PROTO_NAME}")
    paths = [out_dir / name for name in GENERATED_NAMES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise CodegenError(f"protoc did not write {', '.join(missing)}")
    source = paths[2].read_text(encoding="utf-8")
    rewritten = make_imports_relative(source)
    if rewritten == source:
        raise CodegenError(f"no 'import ..._pb2 as ...' line to rewrite in {paths[2]}")
    paths[2].write_text(rewritten, encoding="utf-8")
    return paths


def stale_files(committed_dir: Path = PROFILING_DIR) -> list[str]:
    """Regenerate into a temp dir; names of files in ``committed_dir`` that differ or are missing."""
    with tempfile.TemporaryDirectory() as tmp:
        return [p.name for p in generate(Path(tmp))
                if not (committed_dir / p.name).is_file() or (committed_dir / p.name).read_bytes() != p.read_bytes()]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m zoomer_serve.profiling.codegen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only verify the committed files are current")
    parser.add_argument("--out", type=Path, default=PROFILING_DIR, help="output folder (default: next to proto)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.out)
        if stale:
            print(f"stale generated files in {args.out}: {', '.join(stale)}", file=sys.stderr)
            return 1
        print("generated files are up to date")
        return 0
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
