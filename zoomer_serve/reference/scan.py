"""What the code holds: the environment variables it names and the emitted-looking names in its string
constants, found by parsing ``zoomer_serve/`` and ``interceptors/`` (docstrings left out: they describe, the
code reads and writes). An f-string becomes a glob with ``*`` for each replacement field
(``f"rpc.{side}.call.duration"`` is ``rpc.*.call.duration``).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_DIRS = ("zoomer_serve", "interceptors")
ENV_VAR = re.compile(r"\b(?:OTEL|ZOOMER)_[A-Z0-9_]*[A-Z0-9]\b")
ENV_GLOB = re.compile(r"^(?:OTEL|ZOOMER)_[A-Z0-9_*]+$")
DOTTED = re.compile(r"^[a-z][a-z0-9_]*(?:\.(?:[a-z0-9_]+|\*))+$")


@dataclass
class CodeStrings:
    """The string constants of the code: ``literals`` (whole strings) and ``globs`` (f-strings), each mapped to
    the files (relative paths) that hold it."""

    literals: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    globs: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def env_vars(self) -> dict[str, set[str]]:
        """Every ``OTEL_*`` / ``ZOOMER_*`` name in a literal (anywhere in it: messages name what they read)."""
        out: dict[str, set[str]] = defaultdict(set)
        for text, files in self.literals.items():
            for name in ENV_VAR.findall(text):
                out[name] |= files
        return out

    def env_globs(self) -> dict[str, set[str]]:
        """F-strings that build a variable's name (``OTEL_EXPORTER_OTLP_*_ENDPOINT``)."""
        return {g: f for g, f in self.globs.items() if ENV_GLOB.match(g) and "*" in g}

    def dotted(self, namespaces: tuple[str, ...]) -> dict[str, set[str]]:
        """Literals and globs shaped like an OpenTelemetry name (``a.b.c``) in one of ``namespaces``."""
        out: dict[str, set[str]] = {}
        for table in (self.literals, self.globs):
            for text, files in table.items():
                if DOTTED.match(text) and text.startswith(namespaces):
                    out[text] = files
        return out


def _docstring_ids(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings (module, class, function, and attribute docstrings)."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                continue
            if i == 0 and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                ids.add(id(stmt.value))
            elif i > 0 and isinstance(body[i - 1], (ast.Assign, ast.AnnAssign)):
                ids.add(id(stmt.value))
    return ids


def _glob(node: ast.JoinedStr) -> str:
    return "".join(str(v.value) if isinstance(v, ast.Constant) else "*" for v in node.values)


def scan(root: Path) -> CodeStrings:
    """Parse every ``.py`` file under the :data:`SOURCE_DIRS` of ``root`` (generated ``_pb2`` modules left out).

    Raises:
        SyntaxError: a file does not parse.
    """
    found = CodeStrings()
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            skip = _docstring_ids(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.JoinedStr):
                    found.globs[_glob(node)].add(rel)
                    skip.update(id(v) for v in node.values)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                    found.literals[node.value].add(rel)
    return found
