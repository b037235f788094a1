"""Storage URLs through fsspec: one function turns a URL or a local folder into a filesystem and a path.

A URL is anything fsspec resolves: ``s3://bucket/prefix`` (needs ``s3fs``: ``pip install 'zoomer-serve[s3]'``),
``gs://bucket/prefix`` (``gcsfs``), ``az://`` (``adlfs``), ``file:///abs/path``, ``memory://`` (tests), or a
plain path (a local folder, made absolute). Credentials, endpoints and other options come from fsspec's own
configuration, not from zoomer-serve: the provider's usual variables (``AWS_ACCESS_KEY_ID``, ...), or
``FSSPEC_<PROTOCOL>_<OPTION>`` variables, e.g. ``FSSPEC_S3_ENDPOINT_URL=http://minio:9000`` for an
S3-compatible store.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from zoomer_serve.config import ConfigError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class StorageError(RuntimeError):
    """A storage URL cannot be used: its fsspec backend is not installed, or it is malformed."""


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for ``scheme://...`` (``file://`` included), False for a plain path."""
    return bool(_SCHEME.match(os.fspath(location)))


def normalize(location: str | os.PathLike[str]) -> str:
    """A URL as given (trailing ``/`` removed), or a plain path made absolute (``~`` expanded)."""
    text = os.fspath(location).strip()
    if not text:
        raise ConfigError("a storage location is empty")
    if is_url(text):
        return text.rstrip("/") if not text.endswith("://") else text
    return str(Path(text).expanduser().resolve())


def _missing_package_hint(url: str) -> str:
    return " (install 'zoomer-serve[s3]')" if url.startswith(("s3://", "s3a://")) else ""


def check_protocol(location: str | os.PathLike[str]) -> str:
    """``location`` normalized (see :func:`normalize`) once its protocol is known to fsspec and the package
    it needs is installed: what a setting is checked with when it is read. Nothing is connected or created.

    Raises:
        StorageError: an unknown protocol, or its package is missing (the message names the package).
        ConfigError: an empty location.
    """
    import fsspec

    url = normalize(location)
    if not is_url(url):
        return url
    try:
        fsspec.get_filesystem_class(url.split("://", 1)[0])
    except ImportError as exc:
        raise StorageError(f"cannot use {url}: {exc}{_missing_package_hint(url)}") from None
    except ValueError as exc:
        raise StorageError(f"cannot use {url}: {exc}") from None
    return url


def filesystem(location: str | os.PathLike[str]) -> tuple[Any, str]:
    """``(fs, path)`` for ``location`` (see the module docstring): the fsspec filesystem and the path within it.

    Raises:
        StorageError: the URL's protocol is unknown to fsspec or its package is missing (the message names the
            package to install), or a backend that connects at once (ftp://, sftp://) cannot reach its host.
    """
    import fsspec.core

    url = normalize(location)
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise StorageError(f"cannot open {url}: {exc}{_missing_package_hint(url)}") from None
    except ValueError as exc:
        raise StorageError(f"cannot open {url}: {exc}") from None
    except OSError as exc:
        raise StorageError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    return fs, path


def join(base: str, *parts: str) -> str:
    """``base`` and ``parts`` joined with ``/`` (URLs and local paths alike)."""
    out = base.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def partition(key: str, value: str) -> str:
    """A hive partition folder name ``key=value``, the value percent-encoded as DuckDB writes it (``/`` is
    ``%2F``, a space ``%20``): any value makes one folder name."""
    return f"{key}={urllib.parse.quote(str(value), safe='')}"


def unpartition(segment: str) -> tuple[str, str] | None:
    """``(key, value)`` of a ``key=value`` folder name, decoded; None for any other name."""
    key, sep, value = segment.partition("=")
    if not sep or not key:
        return None
    return key, urllib.parse.unquote(value)


def is_local(fs: Any) -> bool:
    """True when ``fs`` is the local filesystem."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def url_of(fs: Any, path: str) -> str:
    """The URL of ``path`` on ``fs`` (a plain path for the local filesystem)."""
    if is_local(fs):
        return path
    return fs.unstrip_protocol(path)


PARTIAL_SUFFIX = ".partial"
"""What a file being written to the local filesystem is called until it is complete (``<name>.partial``)."""


def put_file(fs: Any, source: Path, target: str) -> None:
    """Upload the file ``source`` to ``target`` on ``fs`` so that ``target`` is never seen half written: on the
    local filesystem (folders made as needed) it is hard-linked, or else copied, to ``<target>.partial`` and renamed
    into place; object stores make an upload visible only once it is complete.

    Raises:
        FileNotFoundError: ``source`` is gone (before an upload to an object store).
        OSError and the fsspec backend's errors: the copy or the upload failed.
    """
    if is_local(fs):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{target}{PARTIAL_SUFFIX}")
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            fs.put_file(str(source), str(tmp))
        os.replace(tmp, target)
        return
    if not source.is_file():
        raise FileNotFoundError(2, "file vanished before its upload", str(source))
    fs.put_file(str(source), target)
