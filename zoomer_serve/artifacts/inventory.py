"""Listing a fleet's artifacts: the manifests under a storage root, without a database.

:func:`list_manifests` walks ``<root>/artifacts/service=*/date=*/instance=*/<session>/*.manifest.json``
(:mod:`~zoomer_serve.artifacts.layout`), skipping date folders before ``since``, and reads each manifest. A
manifest that cannot be read or parsed is returned as an :class:`Unreadable` entry (with the error), never
dropped and never fatal.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zoomer_serve.artifacts.layout import ARTIFACTS_DIR, MANIFEST_SUFFIX, Manifest
from zoomer_serve.artifacts.storage import filesystem, join, unpartition, url_of


@dataclass(frozen=True)
class Unreadable:
    """A manifest that could not be read (``url``) and why (``error``)."""

    url: str
    error: str


def _days_since(since_ns: int | None) -> str | None:
    return None if since_ns is None else time.strftime("%Y-%m-%d", time.gmtime(since_ns / 1e9))


def list_manifests(root: str, since_ns: int | None = None, kinds: tuple[str, ...] | None = None,
                   fs: Any = None) -> Iterator[Manifest | Unreadable]:
    """Every artifact manifest under ``root`` (URL or folder), in path order.

    ``since_ns``: leave out artifacts whose window ended before it (Unix ns; whole date folders before its day
    are not even listed). ``kinds``: keep only these kinds (e.g. ``("kineto_trace",)``).

    Raises:
        StorageError: the root's backend is missing.
    """
    if fs is None:
        fs, base = filesystem(root)
    else:
        base = root
    top = join(base, ARTIFACTS_DIR)
    first_day = _days_since(since_ns)
    try:
        services = fs.ls(top, detail=False)
    except FileNotFoundError:
        return
    for service_dir in sorted(services):
        for date_dir in sorted(_ls(fs, service_dir)):
            key = unpartition(date_dir.rstrip("/").rsplit("/", 1)[-1])
            if first_day is not None and key is not None and key[0] == "date" and key[1] < first_day:
                continue
            for path in sorted(fs.glob(join(date_dir, "*", "*", "*" + MANIFEST_SUFFIX))):
                entry = _read(fs, path)
                if isinstance(entry, Manifest):
                    if since_ns is not None and entry.end_ns < since_ns:
                        continue
                    if kinds is not None and entry.kind not in kinds:
                        continue
                yield entry


def _ls(fs: Any, path: str) -> list[str]:
    try:
        return [p for p in fs.ls(path, detail=False) if p.rstrip("/") != path.rstrip("/")]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _read(fs: Any, path: str) -> Manifest | Unreadable:
    try:
        return Manifest.from_json(fs.cat_file(path))
    except (OSError, ValueError) as exc:
        return Unreadable(url_of(fs, path), f"{type(exc).__name__}: {exc}")


def trace_manifest_urls(root: str, since_ns: int | None = None) -> list[str]:
    """The URLs of the Kineto trace manifests under ``root`` (date folders before ``since_ns``'s day left
    out), sorted. Only paths are listed; the manifests are read by whoever analyses them.

    Raises:
        StorageError: the root's backend is missing.
    """
    from zoomer_serve.artifacts.layout import TRACE_SUFFIX

    fs, base = filesystem(root)
    first_day = _days_since(since_ns)
    out: list[str] = []
    for service_dir in sorted(_ls(fs, join(base, ARTIFACTS_DIR))):
        for date_dir in sorted(_ls(fs, service_dir)):
            key = unpartition(date_dir.rstrip("/").rsplit("/", 1)[-1])
            if first_day is not None and key is not None and key[0] == "date" and key[1] < first_day:
                continue
            out.extend(url_of(fs, p) for p in fs.glob(join(date_dir, "*", "*", "*" + TRACE_SUFFIX + MANIFEST_SUFFIX)))
    return sorted(out)
