"""Reproducible code generation for ``ranker.proto``.

Run ``python -m zoomer_serve.demo.codegen`` to rewrite the committed ``ranker_pb2.py``,
``ranker_pb2.pyi`` and ``ranker_pb2_grpc.py`` next to the proto, or
``python -m zoomer_serve.demo.codegen --check`` to verify they are up to date (exit 1 if not).

Output depends on the installed ``grpcio-tools`` version (it stamps protobuf and grpc
versions into the code), so regenerate with the same version the committed files name.
Requires ``grpcio-tools`` (a dev dependency); importing this module does not.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
PROTO_NAME = "ranker.proto"
GENERATED_NAMES = ("ranker_pb2.py", "ranker_pb2.pyi", "ranker_pb2_grpc.py")

_ABSOLUTE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


class CodegenError(RuntimeError):
    """protoc failed or produced unexpected output."""


def _grpc_tools_include() -> str:
    """Path of the well-known ``.proto`` files shipped with grpc_tools."""
    return str(resources.files("grpc_tools") / "_proto")


def make_imports_relative(source: str) -> str:
    """Rewrite ``import x_pb2 as y`` lines to ``from . import x_pb2 as y``.

    protoc's grpc plugin emits top-level imports that only work when the output folder is on
    ``sys.path``; the package-relative form works from inside ``zoomer_serve.demo``.
    """
    return _ABSOLUTE_IMPORT.sub(r"from . import \1 as \2", source)


def protoc_generate(proto_dir: Path, proto_name: str, generated_names: tuple[str, ...],
                    out_dir: Path) -> list[Path]:
    """Run protoc on ``proto_dir/proto_name`` and write ``generated_names`` (``*_pb2.py``, ``*_pb2.pyi``,
    and for a proto with services ``*_pb2_grpc.py``) to ``out_dir``, the grpc module's imports made
    package-relative. Two names: messages only, no grpc module.

    Returns the written paths in ``generated_names`` order.
    Raises ImportError if grpcio-tools is not installed, CodegenError if protoc fails.
    """
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{_grpc_tools_include()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *([f"--grpc_python_out={out_dir}"] if len(generated_names) > 2 else []),
        str(proto_dir / proto_name),
    ]
    code = protoc.main(args)
    if code != 0:
        raise CodegenError(f"protoc exited with {code} for {proto_dir / proto_name}")
    paths = [out_dir / name for name in generated_names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise CodegenError(f"protoc did not write {', '.join(missing)}")
    if len(paths) < 3:
        return paths
    grpc_path = paths[2]
    source = grpc_path.read_text(encoding="utf-8")
    rewritten = make_imports_relative(source)
    if rewritten == source:
        raise CodegenError(f"no 'import ..._pb2 as ...' line to rewrite in {grpc_path}")
    grpc_path.write_text(rewritten, encoding="utf-8")
    return paths


def stale_generated(generate_into: Callable[[Path], list[Path]], committed_dir: Path) -> list[str]:
    """Regenerate into a temp dir; return names of files in ``committed_dir`` that differ or are missing."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate_into(Path(tmp))
        return [
            path.name
            for path in fresh
            if not (committed_dir / path.name).is_file()
            or (committed_dir / path.name).read_bytes() != path.read_bytes()
        ]


def codegen_main(prog: str, description: str | None, default_dir: Path,
                 generate_into: Callable[[Path], list[Path]], argv: list[str] | None = None) -> int:
    """The ``python -m ...codegen [--check] [--out DIR]`` command line; returns the exit code."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--check", action="store_true", help="only verify the committed files are current")
    parser.add_argument("--out", type=Path, default=default_dir, help="output folder (default: next to proto)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_generated(generate_into, args.out)
        if stale:
            print(f"stale generated files in {args.out}: {', '.join(stale)}", file=sys.stderr)
            return 1
        print("generated files are up to date")
        return 0
    for path in generate_into(args.out):
        print(f"wrote {path}")
    return 0


def generate(out_dir: Path, proto_dir: Path = DEMO_DIR) -> list[Path]:
    """Run protoc on ``proto_dir/ranker.proto`` and write the three generated files to ``out_dir``
    (see :func:`protoc_generate`)."""
    return protoc_generate(proto_dir, PROTO_NAME, GENERATED_NAMES, out_dir)


def stale_files(committed_dir: Path = DEMO_DIR) -> list[str]:
    """Regenerate into a temp dir; return names of files in ``committed_dir`` that differ or are missing."""
    return stale_generated(generate, committed_dir)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    return codegen_main("python -m zoomer_serve.demo.codegen", __doc__, DEMO_DIR, generate, argv)


if __name__ == "__main__":
    sys.exit(main())
