"""Uploading artifacts off the request path: one background thread, a bounded queue, retries with backoff.

:meth:`ArtifactUploader.submit` never blocks: it queues an :class:`UploadJob` (the files of one profiling
session, or one file) or, when ``max_pending`` jobs already wait, refuses it (counted in ``dropped``; the files
stay where they are). The thread uploads each file, then its manifest (:mod:`~zoomer_serve.artifacts.layout`),
retrying a failed step up to ``retries`` times with exponential backoff (``backoff_s`` doubling up to
``max_backoff_s``). A local file that has vanished fails at once (nothing to retry). Counters:
:meth:`ArtifactUploader.stats`.

To a local folder, a file is hard-linked when source and destination share a filesystem (no copy), else
copied.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoomer_serve.artifacts.layout import MANIFEST_SUFFIX, Manifest, kind_of
from zoomer_serve.artifacts.storage import filesystem, join, put_file, url_of

logger = logging.getLogger("zoomer_serve.artifacts")
CHUNK = 1 << 20


@dataclass
class UploadJob:
    """Files to upload into one folder (``prefix``, a URL or path) with what their manifests say.

    ``describe(path) -> dict`` adds manifest fields per file (``trace_ids``, ``requests``); it runs on the
    upload thread, so reading a summary file costs the caller nothing."""

    prefix: str
    files: list[Path]
    service: str
    instance: str
    host: str
    gpu_model: str
    session_id: str
    start_ns: int
    end_ns: int
    resource: dict[str, Any] = field(default_factory=dict)
    describe: Callable[[Path], dict[str, Any]] | None = None


@dataclass(frozen=True)
class UploadStats:
    """Counters of an :class:`ArtifactUploader` (over its lifetime): ``jobs_queued`` (accepted),
    ``jobs_dropped`` (refused: queue full or closed), ``files_uploaded``, ``files_failed`` (given up after the
    retries), ``retries`` (failed attempts that were tried again), ``bytes_uploaded``, ``pending`` (jobs
    accepted and not finished)."""

    jobs_queued: int
    jobs_dropped: int
    files_uploaded: int
    files_failed: int
    retries: int
    bytes_uploaded: int
    pending: int


class ArtifactUploader:
    """Uploads :class:`UploadJob` objects from a daemon thread (started on the first job).

    Args:
        max_pending: jobs that may wait; more are refused.
        retries: further attempts after a failed upload of one file or manifest.
        backoff_s / max_backoff_s: the wait before the first retry, doubled after each, capped.
        sleep: the wait function (tests pass a fast one).
    """

    def __init__(self, max_pending: int = 32, retries: int = 5, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 sleep: Callable[[float], Any] | None = None) -> None:
        if max_pending < 1 or retries < 0 or backoff_s < 0:
            raise ValueError(f"max_pending >= 1, retries >= 0 and backoff_s >= 0 needed, got {max_pending}, "
                             f"{retries}, {backoff_s}")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep or time.sleep
        self._queue: queue.Queue[UploadJob | None] = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._counts = {"jobs_queued": 0, "jobs_dropped": 0, "files_uploaded": 0, "files_failed": 0,
                        "retries": 0, "bytes_uploaded": 0}

    # -- producer ----------------------------------------------------------------------------------------
    def submit(self, job: UploadJob) -> bool:
        """Queue ``job`` without blocking; False (counted in ``jobs_dropped``) when full or closed."""
        with self._lock:
            if self._closed:
                self._counts["jobs_dropped"] += 1
                return False
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self._counts["jobs_dropped"] += 1
                return False
            self._counts["jobs_queued"] += 1
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zoomer-artifacts", daemon=True)
                self._thread.start()
        return True

    def stats(self) -> UploadStats:
        with self._lock:
            return UploadStats(pending=self._pending, **self._counts)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every accepted job finished (uploaded or given up); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Refuse new jobs, wait up to ``timeout_s`` for the queued ones, stop the thread. True when all
        finished."""
        with self._lock:
            self._closed = True
            thread = self._thread
        done = self.flush(timeout_s)
        if thread is not None:
            try:
                self._queue.put(None, timeout=max(timeout_s, 0.1))
            except queue.Full:
                pass
            thread.join(timeout_s)
        return done

    # -- upload thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._upload_job(job)
            except Exception:  # a bug must not stop later uploads
                logger.exception("zoomer-serve: uploading artifacts to %s failed", job.prefix)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _upload_job(self, job: UploadJob) -> None:
        fs, root = filesystem(job.prefix)
        for path in job.files:
            try:
                size, digest = _checksum(path)
                extra = job.describe(path) if job.describe is not None else {}
            except OSError as exc:
                self._count("files_failed")
                logger.warning("zoomer-serve: artifact %s cannot be read, not uploaded: %s", path, exc)
                continue
            target = join(root, path.name)
            manifest = Manifest(kind=kind_of(path.name), file=path.name, url=url_of(fs, target),
                                service=job.service, instance=job.instance, host=job.host, gpu_model=job.gpu_model,
                                session_id=job.session_id, start_ns=job.start_ns, end_ns=job.end_ns, bytes=size,
                                sha256=digest, resource=dict(job.resource), created_ns=time.time_ns(), **extra)
            ok = self._attempt(functools.partial(put_file, fs, path, target), f"{path} -> {manifest.url}") and \
                self._attempt(functools.partial(fs.pipe_file, target + MANIFEST_SUFFIX, manifest.to_json()),
                              f"manifest of {manifest.url}")
            if ok:
                self._count("files_uploaded")
                self._count("bytes_uploaded", size)
            else:
                self._count("files_failed")

    def _attempt(self, step: Callable[[], Any], what: str) -> bool:
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                step()
                return True
            except FileNotFoundError as exc:
                if not _remote_missing(exc):
                    logger.warning("zoomer-serve: uploading %s failed: %s", what, exc)
                    return False
                error: Exception = exc
            except Exception as exc:  # any backend error (network, throttling, permissions) is retried
                error = exc
            if attempt == self.retries:
                logger.warning("zoomer-serve: uploading %s failed after %d attempts: %r", what, attempt + 1, error)
                return False
            self._count("retries")
            self._sleep(wait)
            wait = min(wait * 2, self.max_backoff_s)
        return False

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n


def _checksum(path: Path) -> tuple[int, str]:
    """``(bytes, sha256 hex)`` of a file. Raises OSError."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _remote_missing(exc: FileNotFoundError) -> bool:
    """A FileNotFoundError about the destination (a bucket not there yet, eventual consistency) is retried;
    one about the local source is not."""
    return getattr(exc, "filename", None) is None or not os.path.isabs(str(exc.filename))


