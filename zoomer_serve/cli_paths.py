"""Checks of the files a command will write, made before it does any work: an output that is also one of the
command's inputs (writing it would destroy what the command reads), two outputs that are one file, an output
that names a folder or whose folder does not exist."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once resolved (links followed, whether it exists or
    not), or two existing names of one file (a hard link)."""
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return False


def output_problem(outputs: Sequence[tuple[str, Path]], inputs: Sequence[Path]) -> str | None:
    """Why the ``outputs`` (``(option, path)`` pairs, e.g. ``("--html", Path("r.html"))``) cannot be written as
    asked, or None: one is a folder, its folder does not exist, it is one of the ``inputs`` (local files or
    folders the command reads), or two are the same file. The message names the option and the path."""
    for i, (option, out) in enumerate(outputs):
        if out.is_dir():
            return f"{option} {out} is a folder: give the file to write"
        if not out.parent.is_dir():
            return f"{option} {out}: its folder {out.parent} does not exist"
        for read in inputs:
            if same_file(out, read):
                return f"{option} {out} is also an input: writing it would overwrite what is read"
        for earlier, other in outputs[:i]:
            if same_file(out, other):
                return f"{earlier} and {option} name the same file ({out})"
    return None
