"""Profiling artifacts in object storage: Kineto traces, CPU profiles, memory snapshots and session summaries
uploaded through fsspec to the URL in ``ZOOMER_ARTIFACTS_URL`` (default: the profiles folder), off the request
path, with retries and a bounded queue, each with a manifest beside it so that a job can list a fleet's
artifacts without a database.

- :mod:`~zoomer_serve.artifacts.storage`: URLs and folders through fsspec.
- :mod:`~zoomer_serve.artifacts.layout`: the folder layout and the manifest.
- :mod:`~zoomer_serve.artifacts.uploader`: the upload thread.
- :mod:`~zoomer_serve.artifacts.session`: the profiling-session companion that queues a session's files and
  puts their URLs on its span.
- :mod:`~zoomer_serve.artifacts.inventory`: listing the manifests under a root.

:func:`session_artifacts` builds the companion every :class:`~zoomer_serve.profiling.ProfilerController`
runs; :func:`publish` uploads any other file (a memory snapshot, say) the same way.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path
from typing import Any

from zoomer_serve.artifacts.config import ArtifactsConfig
from zoomer_serve.artifacts.layout import Manifest, kind_of, session_prefix
from zoomer_serve.artifacts.session import SessionArtifacts
from zoomer_serve.artifacts.uploader import ArtifactUploader, UploadJob, UploadStats

__all__ = ["ArtifactUploader", "ArtifactsConfig", "Manifest", "SessionArtifacts", "UploadJob", "UploadStats",
           "kind_of", "publish", "session_artifacts", "session_prefix", "uploader_for"]

EXIT_FLUSH_S = 10.0
"""At interpreter exit, how long queued uploads may still take."""

_uploaders: dict[tuple[Any, ...], ArtifactUploader] = {}
_lock = threading.Lock()


def uploader_for(config: ArtifactsConfig) -> ArtifactUploader:
    """The process's uploader for these settings (one per distinct setting; flushed for up to
    :data:`EXIT_FLUSH_S` at exit)."""
    key = (config.max_pending, config.retries, config.backoff_s, config.max_backoff_s)
    with _lock:
        up = _uploaders.get(key)
        if up is None:
            up = _uploaders[key] = ArtifactUploader(config.max_pending, config.retries, config.backoff_s,
                                                    config.max_backoff_s)
            atexit.register(up.close, EXIT_FLUSH_S)
        return up


def session_artifacts(profiles_dir: str | os.PathLike[str], resource: dict[str, Any],
                      config: ArtifactsConfig | None = None) -> SessionArtifacts | None:
    """The session companion for a process with OpenTelemetry ``resource`` attributes, or None when
    ``ZOOMER_ARTIFACTS_URL=off``. ``config`` defaults to :meth:`ArtifactsConfig.from_env` with
    ``profiles_dir`` as the default root.

    Raises:
        ConfigError: a bad ``ZOOMER_ARTIFACTS_*`` value (named).
    """
    config = config or ArtifactsConfig.from_env(profiles_dir)
    if config.url is None:
        return None
    return SessionArtifacts(config.url, uploader_for(config), resource)


def publish(path: str | os.PathLike[str], resource: dict[str, Any], session_id: str | None = None,
            start_ns: int | None = None, end_ns: int | None = None, config: ArtifactsConfig | None = None) -> bool:
    """Queue one file (a memory snapshot, say) for upload under its session's folder (``session_id``; default
    the file's stem), with the window it covers (default: its modification time). Returns False when uploads
    are off or the queue is full.

    Raises:
        ConfigError: a bad ``ZOOMER_ARTIFACTS_*`` value.
    """
    p = Path(path).resolve()
    config = config or ArtifactsConfig.from_env(p.parent)
    if config.url is None:
        return False
    end = end_ns if end_ns is not None else int(p.stat().st_mtime * 1e9) if p.exists() else time.time_ns()
    start = start_ns if start_ns is not None else end
    companion = SessionArtifacts(config.url, uploader_for(config), resource)
    return companion.uploader.submit(companion.job(session_id or p.name.split(".")[0], [p], start, end))
