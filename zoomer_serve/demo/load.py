"""Load driver for the demo ``Ranker`` service, and request builders for tests and benchmarks.

``drive_load`` runs several client threads, each with its own channel, that send a mix of unary
``Predict`` calls, short ``PredictStream`` calls, and a few deliberately invalid requests, bounded
by both wall time and call count. ``make_request`` builds one valid or invalid ``PredictRequest``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import grpc
import numpy as np

from . import ranker_pb2, ranker_pb2_grpc
from .model import DLRMConfig
from .service import DEFAULT_MAX_BATCH_SIZE

PREDICT = "Predict"
PREDICT_STREAM = "PredictStream"

Metadata = Sequence[tuple[str, str]]


class InvalidKind(str, Enum):
    """Ways ``make_request`` can break a request; each one gets INVALID_ARGUMENT from the server."""

    EMPTY_BATCH = "empty_batch"  # no candidates
    BATCH_TOO_LARGE = "batch_too_large"  # max_batch_size + 1 candidates
    DENSE_COUNT = "dense_count"  # one candidate lacks its last dense feature
    SPARSE_COUNT = "sparse_count"  # one candidate lacks its last sparse feature
    ID_OUT_OF_RANGE = "id_out_of_range"  # one id equals its table's size
    NON_FINITE = "non_finite"  # one dense value is NaN
    EMPTY_IDS = "empty_ids"  # one sparse feature of one candidate carries no ids


def _random_candidates(
    rng: np.random.Generator, n: int, config: DLRMConfig, max_ids_per_feature: int
) -> list[ranker_pb2.Candidate]:
    """``n`` valid random candidates: dense features look like log-transformed counts (Criteo
    style); ids are skewed towards low (popular) rows, the way real item and user ids are."""
    dense = np.log1p(rng.exponential(scale=5.0, size=(n, config.num_dense))).astype(np.float32).tolist()
    counts = rng.integers(1, max_ids_per_feature + 1, size=(n, config.num_sparse))
    per_feature = []  # per feature: list over candidates of id lists
    for f, size in enumerate(config.table_sizes):
        ids = (size * rng.random(int(counts[:, f].sum())) ** 3).astype(np.int64).tolist()
        bounds = np.concatenate(([0], np.cumsum(counts[:, f]))).tolist()
        per_feature.append([ids[bounds[i] : bounds[i + 1]] for i in range(n)])
    SparseFeature = ranker_pb2.SparseFeature
    return [
        ranker_pb2.Candidate(dense=dense[i], sparse=[SparseFeature(ids=ids[i]) for ids in per_feature])
        for i in range(n)
    ]


def _break_request(
    request: ranker_pb2.PredictRequest, kind: InvalidKind, rng: np.random.Generator, config: DLRMConfig
) -> None:
    """Apply one per-candidate defect of ``kind`` to a random candidate of ``request``, in place."""
    candidate = request.candidates[int(rng.integers(len(request.candidates)))]
    f = int(rng.integers(config.num_sparse))
    if kind is InvalidKind.DENSE_COUNT:
        del candidate.dense[-1]
    elif kind is InvalidKind.SPARSE_COUNT:
        del candidate.sparse[-1]
    elif kind is InvalidKind.ID_OUT_OF_RANGE:
        candidate.sparse[f].ids[0] = config.table_sizes[f]
    elif kind is InvalidKind.NON_FINITE:
        candidate.dense[int(rng.integers(config.num_dense))] = float("nan")
    elif kind is InvalidKind.EMPTY_IDS:
        del candidate.sparse[f].ids[:]
    else:
        raise ValueError(f"not a per-candidate defect: {kind}")


def make_request(
    rng: np.random.Generator,
    n_candidates: int,
    config: DLRMConfig | None = None,
    invalid_kind: InvalidKind | str | None = None,
    *,
    max_ids_per_feature: int = 1,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    request_id: str = "",
) -> ranker_pb2.PredictRequest:
    """Build a random ``PredictRequest`` for a model of shape ``config`` (default ``DLRMConfig()``).

    Args:
        rng: source of randomness; the same generator state gives the same request.
        n_candidates: candidates in the request (>= 1 unless ``invalid_kind`` ignores it).
        invalid_kind: None for a valid request, else the defect to introduce (an InvalidKind or its
            value). EMPTY_BATCH sends 0 candidates and BATCH_TOO_LARGE ``max_batch_size + 1``,
            whatever ``n_candidates`` says; the others break one random candidate.
        max_ids_per_feature: each sparse feature gets 1..this many ids (1 = one-hot).
        max_batch_size: the server's limit, used only by BATCH_TOO_LARGE.
        request_id: copied into the request.

    Raises:
        ValueError: ``n_candidates`` < 1 for a kind that needs a candidate, or an unknown kind.
    """
    config = config or DLRMConfig()
    kind = InvalidKind(invalid_kind) if invalid_kind is not None else None
    if kind is InvalidKind.EMPTY_BATCH:
        n_candidates = 0
    elif kind is InvalidKind.BATCH_TOO_LARGE:
        n_candidates = max_batch_size + 1
    elif n_candidates < 1:
        raise ValueError(f"n_candidates must be >= 1, got {n_candidates}")
    request = ranker_pb2.PredictRequest(
        request_id=request_id,
        candidates=_random_candidates(rng, n_candidates, config, max_ids_per_feature),
    )
    if kind not in (None, InvalidKind.EMPTY_BATCH, InvalidKind.BATCH_TOO_LARGE):
        _break_request(request, kind, rng, config)
    return request


@dataclass(frozen=True)
class LatencyStats:
    """Client-side latency summary of one method's OK calls, in milliseconds."""

    count: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> LatencyStats:
        """Summarize latencies in ms; all fields are NaN-free zeros when there are no samples."""
        if not samples_ms:
            return cls(0, 0.0, 0.0, 0.0, 0.0)
        a = np.asarray(samples_ms, dtype=np.float64)
        p50, p99 = np.percentile(a, [50, 99])
        return cls(len(a), float(p50), float(p99), float(a.mean()), float(a.max()))


@dataclass(frozen=True)
class LoadProgress:
    """Snapshot passed to ``drive_load``'s progress callback (on the calling thread).

    ``calls``: finished calls; ``ok``: of those, status OK; ``unexpected``: calls whose status was
    not the expected one (OK for valid requests, INVALID_ARGUMENT for invalid ones).
    """

    elapsed_s: float
    calls: int
    ok: int
    unexpected: int


@dataclass
class LoadResult:
    """Outcome of ``drive_load``.

    Attributes:
        duration_s: wall time from the first client start to the last client's end.
        counts: finished calls per (method, status code name), e.g. ("Predict", "OK") -> 812.
            A PredictStream call counts once, whatever its number of messages. Besides gRPC
            status names, "WRONG_SCORE_COUNT" marks an OK call whose responses did not carry one
            score per candidate (or one response per stream message).
        latency_ms: per method, client-side latency of OK calls (a whole stream for PredictStream).
        unexpected: calls whose status differed from the expected one (see LoadProgress).
        stream_messages: request messages sent on OK PredictStream calls.
    """

    duration_s: float
    counts: dict[tuple[str, str], int]
    latency_ms: dict[str, LatencyStats]
    unexpected: int
    stream_messages: int = 0

    @property
    def total_calls(self) -> int:
        """All finished calls."""
        return sum(self.counts.values())

    def count(self, method: str | None = None, code: str | None = None) -> int:
        """Calls matching ``method`` and ``code`` (None matches any)."""
        return sum(n for (m, c), n in self.counts.items() if method in (None, m) and code in (None, c))

    @property
    def p50_ms(self) -> float:
        """Median latency of OK unary Predict calls (0.0 if none)."""
        return self.latency_ms.get(PREDICT, LatencyStats.from_samples(())).p50_ms

    @property
    def p99_ms(self) -> float:
        """99th-percentile latency of OK unary Predict calls (0.0 if none)."""
        return self.latency_ms.get(PREDICT, LatencyStats.from_samples(())).p99_ms


@dataclass
class CallTally:
    """Thread-safe outcome counts, latencies and call budget shared by the client threads (gRPC and Thrift
    load drivers)."""

    max_calls: int | None
    started: int = 0
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    samples: dict[str, list[float]] = field(default_factory=lambda: {PREDICT: [], PREDICT_STREAM: []})
    ok: int = 0
    unexpected: int = 0
    stream_messages: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> bool:
        """Reserve one call of the budget; False once ``max_calls`` are taken."""
        with self.lock:
            if self.max_calls is not None and self.started >= self.max_calls:
                return False
            self.started += 1
            return True

    def record(self, method: str, code: str, latency_ms: float, expected: str, messages: int) -> None:
        with self.lock:
            self.counts[(method, code)] += 1
            if code == "OK":
                self.ok += 1
                self.samples[method].append(latency_ms)
                if method == PREDICT_STREAM:
                    self.stream_messages += messages
            if code != expected:
                self.unexpected += 1

    def progress(self, elapsed_s: float) -> LoadProgress:
        with self.lock:
            return LoadProgress(elapsed_s, sum(self.counts.values()), self.ok, self.unexpected)


@dataclass(frozen=True)
class _Plan:
    """Knobs shared by all client threads."""

    target: str
    deadline: float  # time.monotonic() value
    stream_share: float
    invalid_share: float
    batch_size: int
    config: DLRMConfig
    max_batch_size: int
    rpc_timeout_s: float
    metadata: Metadata | None


def _call_predict(stub: ranker_pb2_grpc.RankerStub, request: ranker_pb2.PredictRequest, plan: _Plan) -> str:
    response = stub.Predict(request, timeout=plan.rpc_timeout_s, metadata=plan.metadata)
    return "OK" if len(response.scores) == len(request.candidates) else "WRONG_SCORE_COUNT"


def _call_stream(
    stub: ranker_pb2_grpc.RankerStub, requests: list[ranker_pb2.PredictRequest], plan: _Plan
) -> str:
    responses = list(stub.PredictStream(iter(requests), timeout=plan.rpc_timeout_s, metadata=plan.metadata))
    counts_match = len(responses) == len(requests) and all(
        len(resp.scores) == len(req.candidates) for req, resp in zip(requests, responses)
    )
    return "OK" if counts_match else "WRONG_SCORE_COUNT"


def _one_call(stub: ranker_pb2_grpc.RankerStub, rng: np.random.Generator, plan: _Plan, tally: CallTally) -> None:
    """Build and send one unary or streaming call, and record its outcome."""
    is_stream = rng.random() < plan.stream_share
    kind = None
    if rng.random() < plan.invalid_share:
        kind = list(InvalidKind)[int(rng.integers(len(InvalidKind)))]
    n_messages = int(rng.integers(2, 6)) if is_stream else 1
    bad_index = int(rng.integers(n_messages)) if kind is not None else -1
    requests = [
        make_request(
            rng,
            plan.batch_size,
            plan.config,
            kind if i == bad_index else None,
            max_batch_size=plan.max_batch_size,
            request_id=f"{i}",
        )
        for i in range(n_messages)
    ]
    start = time.perf_counter()
    try:
        code = _call_stream(stub, requests, plan) if is_stream else _call_predict(stub, requests[0], plan)
    except grpc.RpcError as err:
        code = err.code().name if err.code() is not None else "UNKNOWN"
    latency_ms = (time.perf_counter() - start) * 1e3
    expected = "OK" if kind is None else "INVALID_ARGUMENT"
    method = PREDICT_STREAM if is_stream else PREDICT
    tally.record(method, code, latency_ms, expected, n_messages)


def _client(index: int, seed: int, plan: _Plan, tally: CallTally, stop: threading.Event) -> None:
    """One client thread: its own channel, calls until the deadline, the budget or ``stop``."""
    rng = np.random.default_rng([seed, index])
    with grpc.insecure_channel(plan.target) as channel:
        stub = ranker_pb2_grpc.RankerStub(channel)
        while not stop.is_set() and time.monotonic() < plan.deadline and tally.take():
            _one_call(stub, rng, plan, tally)


def run_clients(clients: int, client: Callable[[int, threading.Event], None],
                snapshot: Callable[[float], LoadProgress], start: float,
                progress: Callable[[LoadProgress], None] | None, progress_interval_s: float, name: str,
                cancel: threading.Event | None = None) -> float:
    """Run ``client(index, stop)`` on ``clients`` threads until all return; report ``snapshot(elapsed_s)`` to
    ``progress`` about every ``progress_interval_s`` and once at the end, on this thread. An exception in a
    client stops the others and is re-raised here; ``cancel`` set (a Ctrl+C) stops them too, within about
    ``progress_interval_s`` (calls in flight finish). Returns the elapsed seconds since ``start``
    (``time.monotonic()``)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            client(index, stop)
        except BaseException as exc:  # re-raised on the caller's thread below
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(clients)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(progress_interval_s)
                if cancel is not None and cancel.is_set():
                    stop.set()
                if progress is not None and t.is_alive():
                    progress(snapshot(time.monotonic() - start))
    finally:
        stop.set()
        for t in threads:
            t.join()
    elapsed = time.monotonic() - start
    if errors:
        raise errors[0]
    if progress is not None:
        progress(snapshot(elapsed))
    return elapsed


def drive_load(
    target: str,
    duration_s: float,
    clients: int = 4,
    stream_share: float = 0.2,
    invalid_share: float = 0.02,
    batch_size: int = 32,
    max_requests: int | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
    seed: int = 0,
    metadata: Metadata | None = None,
    *,
    config: DLRMConfig | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    rpc_timeout_s: float = 10.0,
    progress_interval_s: float = 0.5,
    cancel: threading.Event | None = None,
) -> LoadResult:
    """Send load to the Ranker service at ``target`` ("host:port") and tally the outcomes.

    Args:
        duration_s: no call starts after this many seconds; calls in flight finish (each is
            bounded by ``rpc_timeout_s``).
        clients: client threads, each with its own channel, each sending one call at a time.
        stream_share: fraction of calls that are PredictStream calls of 2-5 messages.
        invalid_share: fraction of calls carrying one invalid request (a random InvalidKind;
            in a stream, one random message), expected to fail with INVALID_ARGUMENT.
        batch_size: candidates per valid request.
        max_requests: most calls in total (None: bounded by time only).
        progress: called about every ``progress_interval_s`` and once at the end, on this thread.
        seed: makes the sequence of requests reproducible (not their interleaving).
        metadata: gRPC metadata sent with every call, e.g. (("traceparent", "00-..."),).
        config: the served model's shape (default ``DLRMConfig()``).
        max_batch_size: the server's limit, used to build BATCH_TOO_LARGE requests.
        cancel: once set, no call starts (calls in flight finish): ``zoomer-serve demo``'s Ctrl+C.

    Returns:
        LoadResult; transport failures (e.g. UNAVAILABLE when nothing listens) are counted, not raised.

    Raises:
        ValueError: bad arguments. Any non-gRPC exception in a client thread is re-raised here.
    """
    if duration_s < 0 or clients < 1 or batch_size < 1:
        raise ValueError(
            f"need duration_s >= 0, clients >= 1, batch_size >= 1; got {duration_s}, {clients}, {batch_size}"
        )
    if not (0.0 <= stream_share <= 1.0 and 0.0 <= invalid_share <= 1.0):
        raise ValueError(
            f"shares must be in [0, 1], got stream_share={stream_share}, invalid_share={invalid_share}"
        )
    start = time.monotonic()
    plan = _Plan(
        target,
        start + duration_s,
        stream_share,
        invalid_share,
        batch_size,
        config or DLRMConfig(),
        max_batch_size,
        rpc_timeout_s,
        metadata,
    )
    tally = CallTally(max_requests)
    elapsed = run_clients(clients, lambda i, stop: _client(i, seed, plan, tally, stop), tally.progress, start,
                          progress, progress_interval_s, "load-client", cancel)
    return LoadResult(
        duration_s=elapsed,
        counts=dict(tally.counts),
        latency_ms={m: LatencyStats.from_samples(s) for m, s in tally.samples.items()},
        unexpected=tally.unexpected,
        stream_messages=tally.stream_messages,
    )
