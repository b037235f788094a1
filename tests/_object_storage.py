"""An S3 API on loopback for the object-storage tests: moto's server mode (a real HTTP server speaking the S3
protocol) on 127.0.0.1, port 0, with s3fs as the client, configured the way a deployment configures fsspec:
``FSSPEC_S3_*`` variables (for worker processes) and fsspec's configuration (this process)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class S3:
    """A running S3 server: ``endpoint`` (http://127.0.0.1:PORT), ``bucket`` (created), ``fs`` (an s3fs client)."""

    endpoint: str
    bucket: str
    fs: Any

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


def s3_missing() -> str | None:
    """Why the S3 tests cannot run here, or None."""
    for module, extra in (("s3fs", "zoomer-serve[s3]"), ("moto.server", "moto[server] (in [dev])")):
        try:
            __import__(module)
        except ImportError as exc:
            return f"{module} is not installed ({extra}): {exc}"
    return None


def _configure(endpoint: str) -> dict[str, str]:
    import fsspec.config

    settings = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    fsspec.config.conf["s3"] = dict(settings)
    return {f"FSSPEC_S3_{k.upper()}": v for k, v in settings.items()} | {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def close_s3_sessions(*extra: Any) -> int:
    """Close the aiohttp session of every s3fs filesystem this process made (fsspec's instance cache, and
    ``extra``), waiting for each; returns how many were closed. s3fs closes one only when the filesystem is
    garbage collected, giving fsspec's IO loop 0.1 s to do it; on a busy machine that passes, and the session,
    collected later, logs "Unclosed client session" on the asyncio logger, in whichever test is running then."""
    import fsspec.asyn
    import s3fs

    closed = 0
    for fs in [*s3fs.S3FileSystem._cache.values(), *extra]:
        creator = getattr(fs, "_s3creator", None)  # s3fs's client context (set when it first connected)
        if creator is None or fs.asynchronous:
            continue
        fsspec.asyn.sync(fs.loop, creator.__aexit__, None, None, None, timeout=30)
        fs._s3creator = fs._s3 = None
        closed += 1
    return closed


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 (port 0) with a new bucket; stopped at the end of the module."""
    missing = s3_missing()
    if missing:
        pytest.skip(missing)
    import fsspec.config
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("FSSPEC_S3_ENDPOINT_URL", "FSSPEC_S3_KEY", "FSSPEC_S3_SECRET",
                                            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(_configure(endpoint))
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = f"zoomer-test-{uuid.uuid4().hex[:8]}"  # moto keeps its buckets per process, across servers
    fs.mkdir(bucket)
    try:
        yield S3(endpoint, bucket, fs)
    finally:
        fsspec.config.conf.pop("s3", None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        close_s3_sessions(fs)
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()
