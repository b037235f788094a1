"""Every profiling session's files to the artifact store: a session companion.

:class:`SessionArtifacts` is a :class:`~zoomer_serve.profiling.session.SessionCompanion` that the profiling
controller runs with every session (after the CPU profiler, so its files exist by then). When the session's
files are written it queues them for upload (:mod:`~zoomer_serve.artifacts.uploader`) and returns, for the
``zoomer.profile`` span:

- ``zoomer.profile.artifacts.url``: the session's folder in the store (:func:`~zoomer_serve.artifacts.layout.session_prefix`);
- ``zoomer.profile.trace.url``: the Kineto trace's URL there;
- ``zoomer.profile.artifacts.files``: how many files were queued;
- ``zoomer.profile.artifacts.error``: why nothing was queued (upload queue full), instead of the above.

The URLs are where the files will be once uploaded: the upload runs after the span is made, and a file's
manifest appears once it is there. The covered trace ids in the manifests come from the session's summary
(``<session_id>.summary.json``), read on the upload thread.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from zoomer_serve.artifacts.layout import TRACE_SUFFIX, session_prefix
from zoomer_serve.artifacts.storage import filesystem, join, url_of
from zoomer_serve.artifacts.uploader import ArtifactUploader, UploadJob

ARTIFACTS_URL = "zoomer.profile.artifacts.url"
TRACE_URL = "zoomer.profile.trace.url"
ARTIFACTS_FILES = "zoomer.profile.artifacts.files"
ARTIFACTS_ERROR = "zoomer.profile.artifacts.error"
SUMMARY_SUFFIX = ".summary.json"


class SessionArtifacts:
    """Uploads each session's files under ``root`` (see the module docstring) for the process described by
    ``resource`` (its OpenTelemetry resource attributes: ``service.name``, ``service.instance.id``,
    ``host.name``, ``zoomer.gpu.model``)."""

    def __init__(self, root: str, uploader: ArtifactUploader, resource: dict[str, Any]) -> None:
        self.root = root
        self.uploader = uploader
        self.resource = dict(resource)

    def begin(self, session_id: str, folder: Path, max_duration_ms: int) -> _Run:
        return _Run(self, session_id, Path(folder).resolve(), time.time_ns())

    def job(self, session_id: str, files: list[Path], start_ns: int, end_ns: int) -> UploadJob:
        r = self.resource
        service = str(r.get("service.name") or "unknown_service")
        instance = str(r.get("service.instance.id") or "unknown")
        prefix = session_prefix(self.root, service, start_ns, instance, session_id)
        return UploadJob(prefix=prefix, files=files, service=service, instance=instance,
                         host=str(r.get("host.name") or ""), gpu_model=str(r.get("zoomer.gpu.model") or ""),
                         session_id=session_id, start_ns=start_ns, end_ns=end_ns, resource=self.resource,
                         describe=_Describer(files))


class _Run:
    def __init__(self, owner: SessionArtifacts, session_id: str, folder: Path, start_ns: int) -> None:
        self.owner = owner
        self.session_id = session_id
        self.folder = folder
        self.start_ns = start_ns
        self.end_ns = 0

    def stop(self) -> None:
        if not self.end_ns:
            self.end_ns = time.time_ns()

    def finish(self) -> dict[str, Any]:
        self.stop()
        files = sorted(p for p in self.folder.glob(f"{self.session_id}.*") if p.is_file())
        if not files:
            return {}
        job = self.owner.job(self.session_id, files, self.start_ns, self.end_ns)
        if not self.owner.uploader.submit(job):
            return {ARTIFACTS_ERROR: f"artifact upload queue full; the files stay in {self.folder}"}
        fs, prefix = filesystem(job.prefix)
        attrs: dict[str, Any] = {ARTIFACTS_URL: url_of(fs, prefix), ARTIFACTS_FILES: len(files)}
        for p in files:
            if p.name.endswith(TRACE_SUFFIX):
                attrs[TRACE_URL] = url_of(fs, join(prefix, p.name))
        return attrs


class _Describer:
    """Manifest fields from the session's summary: the covered requests' trace ids."""

    def __init__(self, files: list[Path]) -> None:
        self.summary = next((p for p in files if p.name.endswith(SUMMARY_SUFFIX)), None)
        self._fields: dict[str, Any] | None = None

    def __call__(self, path: Path) -> dict[str, Any]:
        if self._fields is None:
            self._fields = {}
            if self.summary is not None:
                try:
                    data = json.loads(self.summary.read_text(encoding="utf-8"))
                    ids = sorted({str(r["key"][0]) for r in data.get("requests", [])})
                    self._fields = {"trace_ids": ids, "requests": len(data.get("requests", []))}
                except (OSError, ValueError, KeyError, TypeError, IndexError):
                    self._fields = {}
        return self._fields
