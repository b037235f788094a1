"""The demo Ranker on a grpc.aio server in a background thread, for tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from zoomer_serve.demo.aio_server import serve_aio_forever


@contextmanager
def aio_demo_server(model: Any) -> Iterator[int]:
    """``serve_aio_forever`` (the CLI's entry, with its default ``ZoomerAioServerInterceptor``) on 127.0.0.1,
    port 0, serving ``model``; yields the bound port; stops the server (1 s grace) and checks its thread ended."""
    stop, ready = threading.Event(), []
    thread = threading.Thread(target=serve_aio_forever, args=("127.0.0.1", 0, stop),
                              kwargs={"model": model, "on_ready": ready.append, "grace_s": 1.0}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not ready and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert ready, "the aio demo server did not come up"
        yield ready[0]
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()
