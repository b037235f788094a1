"""Load driver for the demo ``Ranker`` over Thrift, with the same ``LoadResult`` as the gRPC driver
(``zoomer_serve.demo.load``), so the demo prints the same report for either transport.

Requests are built by ``load.make_request`` (same generator, same data) and converted to the Thrift structs.
Outcomes are counted under gRPC status names so that results compare: a reply is ``OK`` (or
``WRONG_SCORE_COUNT``), the declared ``InvalidRequest`` is ``INVALID_ARGUMENT``, a ``TApplicationException``
is ``UNIMPLEMENTED`` (unknown method) or ``INTERNAL``, a socket timeout ``DEADLINE_EXCEEDED``, any other
transport failure ``UNAVAILABLE`` (the client then reconnects).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from thriftpy2.rpc import make_client as make_plain_client
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TTransportException

from interceptors.thrift_client import make_client as make_tracked_client

from .load import (
    PREDICT,
    CallTally,
    InvalidKind,
    LatencyStats,
    LoadProgress,
    LoadResult,
    make_request,
    run_clients,
)
from .model import DLRMConfig
from .service import DEFAULT_MAX_BATCH_SIZE
from .thrift_server import ranker_thrift


def to_thrift_request(request: Any) -> Any:
    """The Thrift ``PredictRequest`` with the content of a protobuf ``PredictRequest``."""
    t = ranker_thrift()
    sparse_feature, candidate = t.SparseFeature, t.Candidate
    return t.PredictRequest(
        request_id=request.request_id,
        candidates=[candidate(dense=list(c.dense), sparse=[sparse_feature(ids=list(f.ids)) for f in c.sparse])
                    for c in request.candidates])


def _split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"target must be 'host:port', got {target!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class _Plan:
    host: str
    port: int
    deadline: float
    invalid_share: float
    batch_size: int
    config: DLRMConfig
    max_batch_size: int
    timeout_ms: int
    tracked: bool


def _connect(plan: _Plan) -> Any:
    make = make_tracked_client if plan.tracked else make_plain_client
    return make(ranker_thrift().Ranker, plan.host, plan.port, timeout=plan.timeout_ms)


def _call(client: Any, request: Any) -> str:
    t = ranker_thrift()
    try:
        response = client.Predict(request)
    except t.InvalidRequest:
        return "INVALID_ARGUMENT"
    except TApplicationException as exc:
        return "UNIMPLEMENTED" if exc.type == TApplicationException.UNKNOWN_METHOD else "INTERNAL"
    return "OK" if len(response.scores or ()) == len(request.candidates) else "WRONG_SCORE_COUNT"


def _client(index: int, seed: int, plan: _Plan, tally: CallTally, stop: threading.Event) -> None:
    """One client thread: one connection (re-opened after a transport failure), one call at a time."""
    rng = np.random.default_rng([seed, index])
    kinds = list(InvalidKind)
    client = None
    try:
        while not stop.is_set() and time.monotonic() < plan.deadline and tally.take():
            kind = kinds[int(rng.integers(len(kinds)))] if rng.random() < plan.invalid_share else None
            request = to_thrift_request(make_request(rng, plan.batch_size, plan.config, kind,
                                                     max_batch_size=plan.max_batch_size, request_id="0"))
            start = time.perf_counter()
            try:
                if client is None:
                    client = _connect(plan)
                code = _call(client, request)
            except (TTransportException, OSError) as exc:
                timed_out = (isinstance(exc, socket.timeout)
                             or getattr(exc, "type", None) == TTransportException.TIMED_OUT)
                code = "DEADLINE_EXCEEDED" if timed_out else "UNAVAILABLE"
                if client is not None:
                    client.close()
                client = None
            tally.record(PREDICT, code, (time.perf_counter() - start) * 1e3,
                         "OK" if kind is None else "INVALID_ARGUMENT", 0)
    finally:
        if client is not None:
            client.close()


def drive_thrift_load(
    target: str,
    duration_s: float,
    clients: int = 4,
    stream_share: float = 0.0,
    invalid_share: float = 0.02,
    batch_size: int = 32,
    max_requests: int | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
    seed: int = 0,
    *,
    config: DLRMConfig | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    rpc_timeout_s: float = 10.0,
    progress_interval_s: float = 0.5,
    tracked: bool = False,
    cancel: threading.Event | None = None,
) -> LoadResult:
    """Send ``Predict`` load to the Thrift Ranker at ``target`` ("host:port") and tally the outcomes; the
    arguments are those of ``load.drive_load`` (which see), except:

    Args:
        stream_share: must be 0: Thrift has no streaming calls.
        tracked: use ``contrib.tracking`` clients (:func:`interceptors.thrift_client.make_client`), which
            send the current trace context with each call.

    Returns:
        ``LoadResult`` with method ``Predict`` only (``stream_messages`` 0); outcomes named as in the module
        docstring. Transport failures are counted, not raised.

    Raises:
        ValueError: bad arguments (``stream_share`` > 0 included). Any other exception in a client thread
            is re-raised here.
    """
    if duration_s < 0 or clients < 1 or batch_size < 1:
        raise ValueError(
            f"need duration_s >= 0, clients >= 1, batch_size >= 1; got {duration_s}, {clients}, {batch_size}")
    if stream_share != 0.0:
        raise ValueError(f"Thrift has no streaming calls: stream_share must be 0, got {stream_share}")
    if not 0.0 <= invalid_share <= 1.0:
        raise ValueError(f"invalid_share must be in [0, 1], got {invalid_share}")
    host, port = _split_target(target)
    start = time.monotonic()
    plan = _Plan(host, port, start + duration_s, invalid_share, batch_size, config or DLRMConfig(),
                 max_batch_size, max(1, int(rpc_timeout_s * 1000)), tracked)
    tally = CallTally(max_requests)
    elapsed = run_clients(clients, lambda i, stop: _client(i, seed, plan, tally, stop), tally.progress, start,
                          progress, progress_interval_s, "thrift-load", cancel)
    return LoadResult(duration_s=elapsed, counts=dict(tally.counts),
                      latency_ms={PREDICT: LatencyStats.from_samples(tally.samples[PREDICT])},
                      unexpected=tally.unexpected, stream_messages=0)
