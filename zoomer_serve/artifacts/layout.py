"""Where artifacts go under a storage root, and the manifest that describes each one.

Layout (hive-style folder names, values percent-encoded, :func:`~zoomer_serve.artifacts.storage.partition`)::

    <root>/artifacts/service=<service.name>/date=<YYYY-MM-DD>/instance=<service.instance.id>/<session_id>/
        <session_id>.pt.trace.json.gz                  Kineto trace
        <session_id>.pt.trace.json.gz.manifest.json    its manifest
        <session_id>.summary.json (+ .manifest.json)   per-request kernel summary of the session
        <session_id>.cpu.speedscope.json (+ ...)       Python CPU profile (and .cpu.collapsed.txt, .cpu.pb.gz)
        <name>.pickle (+ ...)                          a memory snapshot (pytorch.org/memory_viz)

The date is the UTC day the session started. A manifest is written after its artifact, so a manifest that
exists names a complete file (its ``sha256`` lets a reader check). A job lists the fleet's artifacts by
listing manifests (:func:`~zoomer_serve.artifacts.inventory.list_manifests`), no database needed.

Manifest (JSON object, :class:`Manifest`): ``schema`` (:data:`MANIFEST_SCHEMA`), ``kind`` (:data:`KINDS`),
``file`` (name), ``url`` (where the artifact is), ``service``, ``instance``, ``host``, ``gpu_model`` ("" without
a GPU), ``session_id``, ``start_ns`` / ``end_ns`` (the window it covers, Unix epoch ns), ``trace_ids`` (the
covered requests' W3C trace ids, 32 hex digits), ``requests`` (covered requests), ``bytes`` (file size),
``sha256`` (hex digest of the file), ``resource`` (the process's OpenTelemetry resource attributes: torch,
driver and runtime versions, ...), ``created_ns``.
"""

from __future__ import annotations

import builtins
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from zoomer_serve.artifacts.storage import join, partition

ARTIFACTS_DIR = "artifacts"
MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_SCHEMA = "zoomer.artifact/1"
TRACE_SUFFIX = ".pt.trace.json.gz"

KINDS: dict[str, str] = {
    TRACE_SUFFIX: "kineto_trace",
    ".summary.json": "session_summary",
    ".cpu.speedscope.json": "cpu_profile",
    ".cpu.collapsed.txt": "cpu_profile_collapsed",
    ".cpu.pb.gz": "cpu_profile_pprof",
    ".pickle": "memory_snapshot",
}
"""File name suffix -> artifact kind; any other file is kind ``other``."""


def kind_of(name: str) -> str:
    """The artifact kind of a file name (see :data:`KINDS`)."""
    for suffix, kind in KINDS.items():
        if name.endswith(suffix):
            return kind
    return "other"


def session_prefix(root: str, service: str, start_ns: int, instance: str, session_id: str) -> str:
    """The folder (URL or path) of one session's artifacts under ``root``."""
    day = time.strftime("%Y-%m-%d", time.gmtime(start_ns / 1e9))
    return join(root, ARTIFACTS_DIR, partition("service", service), partition("date", day),
                partition("instance", instance or "unknown"), session_id)


@dataclass
class Manifest:
    """What a manifest file holds (see the module docstring)."""

    kind: str
    file: str
    url: str
    service: str
    instance: str
    host: str
    gpu_model: str
    session_id: str
    start_ns: int
    end_ns: int
    bytes: int
    sha256: str
    trace_ids: list[str] = field(default_factory=list)
    requests: int = 0
    resource: dict[str, Any] = field(default_factory=dict)
    created_ns: int = 0
    schema: str = MANIFEST_SCHEMA

    def to_json(self) -> builtins.bytes:
        return json.dumps(asdict(self), sort_keys=True, default=str).encode("utf-8")

    @classmethod
    def from_json(cls, data: builtins.bytes | str) -> Manifest:
        """Parse a manifest. Raises ValueError: not JSON, another schema, or a field missing or mistyped."""
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"manifest is not JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("schema") != MANIFEST_SCHEMA:
            raise ValueError(f"not a {MANIFEST_SCHEMA} manifest")
        try:
            out = cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except TypeError as exc:
            raise ValueError(f"manifest fields missing: {exc}") from None
        for name in ("start_ns", "end_ns", "bytes", "requests"):
            if not isinstance(getattr(out, name), int):
                raise ValueError(f"manifest field {name} is not an integer: {getattr(out, name)!r}")
        return out
