"""gRPC ``zoomer.demo.v1.Ranker`` service backed by the DLRM demo model.

Every scored request runs three phases of the project's phase API, so the profiling
middleware can attribute time within a request:

* ``preprocess``: validate the request and build tensors on the model's device (plus, when
  ``ServiceConfig.slow_preprocess_iterations`` is set, ``hash_ids_slowly``: a deliberately slow
  pure-Python step that makes requests CPU-bound, for demonstrating CPU profiles);
* ``forward``: the model call under ``torch.inference_mode()``, including copying the scores
  back to the CPU (so on CUDA the phase covers the kernels, not just their launch); with
  ``ServiceConfig.batch_max_size`` set, requests wait in a dynamic batcher (``batcher``) and the
  forward phase is their batch's (recorded with ``zoomer_serve.batching``);
* ``postprocess``: build the ``PredictResponse``.

Invalid requests end the call with ``INVALID_ARGUMENT`` and a message naming the candidate,
the feature and the offending value; see ``InvalidRequestError``.

``RankerCore`` is the transport-neutral part (validation, phases, model call); the gRPC
``RankerServicer`` here and the Thrift handler in ``thrift_server`` both call it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from zoomer_serve.netaddr import bind_probe, format_hostport
from zoomer_serve.recording import phase

from . import ranker_pb2, ranker_pb2_grpc
from .model import DLRM, DLRMConfig, build_model

DEFAULT_MAX_BATCH_SIZE = 1024
DEFAULT_MAX_IDS_PER_FEATURE = 64

R = TypeVar("R")

# build_server(extra_servicers=...) accepts either a callable that registers something on the
# server, or an (add_XServicer_to_server, servicer) pair as produced by protoc.
ExtraServicer = Callable[[grpc.Server], Any] | tuple[Callable[[Any, grpc.Server], Any], Any]


@dataclass(frozen=True)
class ServiceConfig:
    """Serving limits and labels.

    Attributes:
        max_batch_size: most candidates accepted in one PredictRequest.
        max_ids_per_feature: most ids accepted for one sparse feature of one candidate.
        model_version: returned in every PredictResponse.model_version.
        slow_preprocess_iterations: when > 0, every scored request also runs ``hash_ids_slowly``
            with this many iterations in its preprocess phase (about 0.15 µs each on one core:
            100000 adds about 15 ms of pure-Python CPU per request). 0 (the default) skips it.
        batch_max_size: when > 0, requests run through a dynamic batcher (``demo.batcher``) of at most
            this many requests per forward pass; 0 (the default) runs one forward pass per request.
        batch_max_delay_ms: the batcher's longest wait, from the oldest queued request, for a batch to
            fill (ms).
    """

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_ids_per_feature: int = DEFAULT_MAX_IDS_PER_FEATURE
    model_version: str = "dlrm-demo-v1"
    slow_preprocess_iterations: int = 0
    batch_max_size: int = 0
    batch_max_delay_ms: float = 2.0

    def __post_init__(self) -> None:
        """Raise ValueError on a limit below 1, a negative ``slow_preprocess_iterations``,
        ``batch_max_size`` or ``batch_max_delay_ms``."""
        if self.batch_max_size < 0 or not self.batch_max_delay_ms >= 0:
            raise ValueError(
                f"batch_max_size and batch_max_delay_ms must be >= 0, got {self.batch_max_size}, "
                f"{self.batch_max_delay_ms}"
            )
        if self.max_batch_size < 1 or self.max_ids_per_feature < 1:
            raise ValueError(
                f"limits must be >= 1, got max_batch_size={self.max_batch_size}, "
                f"max_ids_per_feature={self.max_ids_per_feature}"
            )
        if self.slow_preprocess_iterations < 0:
            raise ValueError(
                f"slow_preprocess_iterations must be >= 0, got {self.slow_preprocess_iterations}"
            )


class InvalidRequestError(ValueError):
    """A PredictRequest the model cannot score; ``str(err)`` says exactly what is wrong."""


class ServerBindError(OSError):
    """The gRPC server could not listen on the requested host:port."""


@dataclass
class Batch:
    """Model inputs built from a validated request.

    Attributes:
        dense: float32 [batch, num_dense].
        ids: per sparse feature, int64 [total_ids_f] (all candidates' ids concatenated).
        offsets: per sparse feature, int64 [batch] start offsets into ``ids``.
    """

    dense: torch.Tensor
    ids: list[torch.Tensor]
    offsets: list[torch.Tensor]

    @property
    def size(self) -> int:
        """Number of candidates."""
        return int(self.dense.shape[0])

    def to(self, device: torch.device) -> Batch:
        """Copy all tensors to ``device`` (non-blocking where possible)."""
        return Batch(
            dense=self.dense.to(device, non_blocking=True),
            ids=[t.to(device, non_blocking=True) for t in self.ids],
            offsets=[t.to(device, non_blocking=True) for t in self.offsets],
        )


def _check_shape(request: Any, model_config: DLRMConfig, config: ServiceConfig) -> None:
    """Check counts (batch, dense and sparse features, ids per feature); raise InvalidRequestError.
    An absent list (None, as a Thrift struct holds an unset field) counts as empty."""
    candidates = request.candidates or ()
    n = len(candidates)
    if n == 0:
        raise InvalidRequestError(
            f"empty batch: PredictRequest.candidates has 0 entries, need 1 to {config.max_batch_size}"
        )
    if n > config.max_batch_size:
        raise InvalidRequestError(
            f"batch too large: {n} candidates, max_batch_size is {config.max_batch_size}"
        )
    num_dense, num_sparse = model_config.num_dense, model_config.num_sparse
    for i, candidate in enumerate(candidates):
        dense, sparse = candidate.dense or (), candidate.sparse or ()
        if len(dense) != num_dense:
            raise InvalidRequestError(
                f"candidate {i}: expected {num_dense} dense features, got {len(dense)}"
            )
        if len(sparse) != num_sparse:
            raise InvalidRequestError(
                f"candidate {i}: expected {num_sparse} sparse features, got {len(sparse)}"
            )
        for f, feature in enumerate(sparse):
            ids = feature.ids or ()
            if not 1 <= len(ids) <= config.max_ids_per_feature:
                raise InvalidRequestError(
                    f"candidate {i}, sparse feature {f}: {len(ids)} ids, "
                    f"need 1 to {config.max_ids_per_feature}"
                )


def _check_dense_finite(dense: torch.Tensor) -> None:
    """Raise InvalidRequestError naming the first NaN/inf in float32 [batch, num_dense]."""
    bad = ~torch.isfinite(dense)
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise InvalidRequestError(
            f"candidate {i}: dense feature {j} is {float(dense[i, j])}, dense values must be finite"
        )


def _check_id_range(f: int, ids: torch.Tensor, offsets: torch.Tensor, table_size: int) -> None:
    """Raise InvalidRequestError naming the first id of feature ``f`` outside [0, table_size)."""
    bad = (ids < 0) | (ids >= table_size)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        candidate = int(torch.searchsorted(offsets, pos, right=True)) - 1
        raise InvalidRequestError(
            f"candidate {candidate}, sparse feature {f}: id {int(ids[pos])} out of range, "
            f"table {f} has {table_size} rows (valid ids 0..{table_size - 1})"
        )


def request_to_batch(
    request: Any,
    model_config: DLRMConfig,
    config: ServiceConfig | None = None,
) -> Batch:
    """Validate ``request`` and convert it to CPU tensors.

    ``request`` is a ``PredictRequest``: the protobuf message, or anything of the same shape
    (``.candidates``, each with ``.dense`` floats and ``.sparse`` features with ``.ids``), such as
    the Thrift struct of ``ranker.thrift``.

    Raises InvalidRequestError (first problem found) for: an empty batch, more than
    ``config.max_batch_size`` candidates, a wrong number of dense or sparse features, a sparse
    feature with no ids or more than ``config.max_ids_per_feature``, a non-finite dense value,
    or an id outside its table.
    """
    config = config or ServiceConfig()
    _check_shape(request, model_config, config)
    dense = torch.tensor([list(c.dense) for c in request.candidates], dtype=torch.float32)
    _check_dense_finite(dense)
    flat: list[list[int]] = [[] for _ in range(model_config.num_sparse)]
    starts: list[list[int]] = [[] for _ in range(model_config.num_sparse)]
    for candidate in request.candidates:
        for f, feature in enumerate(candidate.sparse):
            starts[f].append(len(flat[f]))
            flat[f].extend(feature.ids)
    ids = [torch.tensor(v, dtype=torch.int64) for v in flat]
    offsets = [torch.tensor(v, dtype=torch.int64) for v in starts]
    for f, table_size in enumerate(model_config.table_sizes):
        _check_id_range(f, ids[f], offsets[f], table_size)
    return Batch(dense=dense, ids=ids, offsets=offsets)


def hash_ids_slowly(request: Any, iterations: int) -> int:
    """The demo's deliberately slow preprocessing step (``ServiceConfig.slow_preprocess_iterations``):
    ``iterations`` rounds of 32-bit FNV-1a over the request's sparse ids (cycling through them) in
    pure Python, holding the interpreter lock throughout, as per-request feature engineering written
    in Python loops does. Returns the hash (the model does not use it)."""
    ids = [i for c in request.candidates or () for f in c.sparse or () for i in f.ids or ()] or [0]
    n = len(ids)
    h = 2166136261
    for k in range(iterations):
        h = ((h ^ ids[k % n]) * 16777619) & 0xFFFFFFFF
    return h


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class RankerCore:
    """The transport-neutral Ranker: validation, the three phases and the model call.

    Args:
        model: the model, in eval mode; shared by all worker threads (read-only).
        device: where inputs are placed; None means the device of the model's parameters.
        config: serving limits; None means ``ServiceConfig()``. With ``batch_max_size`` > 0 the
            forward passes go through a ``DynamicBatcher`` (``batcher``; stop it with :meth:`close`).
    """

    def __init__(
        self,
        model: DLRM,
        device: torch.device | str | None = None,
        config: ServiceConfig | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.config = config or ServiceConfig()
        self.batcher: Any = None
        if self.config.batch_max_size:
            from .batcher import DynamicBatcher

            self.batcher = DynamicBatcher(model, self.config.batch_max_size, self.config.batch_max_delay_ms)

    def prepare(self, request: Any) -> Batch:
        """The preprocess phase: validate ``request`` and build its tensors on the model's device.
        Raises InvalidRequestError."""
        with phase("preprocess"):
            batch = request_to_batch(request, self.model.config, self.config).to(self.device)
            if self.config.slow_preprocess_iterations:
                hash_ids_slowly(request, self.config.slow_preprocess_iterations)
            return batch

    def score(self, request: Any, respond: Callable[[list[float]], R]) -> R:
        """Score one ``PredictRequest`` (protobuf or same-shaped, see ``request_to_batch``) and
        return ``respond(scores)``, the transport's response built in the postprocess phase from
        the click probabilities (floats in (0, 1), one per candidate, in request order). With a
        batcher, the forward phase is the batch's (this thread waits for it).

        Raises:
            InvalidRequestError: the request cannot be scored (the message says why).
        """
        batch = self.prepare(request)
        if self.batcher is not None:
            scores = self.batcher.run(batch)
        else:
            with phase("forward"), torch.inference_mode():
                scores = self.model(batch.dense, batch.ids, batch.offsets).float().cpu().tolist()
        with phase("postprocess"):
            return respond(scores)

    async def score_async(self, request: Any, respond: Callable[[list[float]], R]) -> R:
        """:meth:`score` for a coroutine on an event loop: the preprocess phase runs in the default executor
        (``asyncio.to_thread``, which carries the request's context), the request awaits its batch without
        holding a thread (without a batcher the forward pass runs in the executor as well), the postprocess
        phase runs here. Raises InvalidRequestError."""
        if self.batcher is None:
            return await asyncio.to_thread(self.score, request, respond)
        batch = await asyncio.to_thread(self.prepare, request)
        scores = await self.batcher.run_async(batch)
        with phase("postprocess"):
            return respond(scores)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the batcher (if any) once what it holds has run."""
        if self.batcher is not None:
            self.batcher.close(timeout_s)


class RankerServicer(ranker_pb2_grpc.RankerServicer):
    """Serves ``Ranker.Predict`` and ``Ranker.PredictStream`` with a DLRM model (a ``RankerCore``).

    Args:
        model: the model, in eval mode; shared by all worker threads (read-only).
        device: where inputs are placed; None means the device of the model's parameters.
        config: serving limits; None means ``ServiceConfig()``.
    """

    def __init__(
        self,
        model: DLRM,
        device: torch.device | str | None = None,
        config: ServiceConfig | None = None,
    ) -> None:
        self.core = RankerCore(model, device, config)
        self.model, self.device, self.config = self.core.model, self.core.device, self.core.config

    def _responder(self, request: ranker_pb2.PredictRequest) -> Callable[[list[float]], ranker_pb2.PredictResponse]:
        return lambda scores: ranker_pb2.PredictResponse(
            request_id=request.request_id, scores=scores, model_version=self.config.model_version
        )

    def score(self, request: ranker_pb2.PredictRequest) -> ranker_pb2.PredictResponse:
        """Score one request, transport-independent; raises InvalidRequestError."""
        return self.core.score(request, self._responder(request))

    async def score_async(self, request: ranker_pb2.PredictRequest) -> ranker_pb2.PredictResponse:
        """:meth:`score` on an event loop (``RankerCore.score_async``); raises InvalidRequestError."""
        return await self.core.score_async(request, self._responder(request))

    def _score_or_abort(
        self, request: ranker_pb2.PredictRequest, context: grpc.ServicerContext
    ) -> ranker_pb2.PredictResponse:
        try:
            return self.score(request)
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise  # not reached: abort raises

    def Predict(
        self, request: ranker_pb2.PredictRequest, context: grpc.ServicerContext
    ) -> ranker_pb2.PredictResponse:
        """Unary: one response with one score per candidate; INVALID_ARGUMENT on a bad request."""
        return self._score_or_abort(request, context)

    def PredictStream(
        self, request_iterator: Iterator[ranker_pb2.PredictRequest], context: grpc.ServicerContext
    ) -> Iterator[ranker_pb2.PredictResponse]:
        """Bidirectional: one response per request message, in order; the first bad message
        ends the stream with INVALID_ARGUMENT (responses already sent stay delivered)."""
        for request in request_iterator:
            yield self._score_or_abort(request, context)


_address = format_hostport


def check_port_free(host: str, port: int) -> None:
    """Fail now when ``host``:``port`` cannot be bound (in use, not a local address), before telemetry and the
    model start: the server's own bind comes after them, and a failed start then waited for telemetry's shutdown
    flush (13 s with no collector listening). Port 0 always passes; a port taken between this check and the
    server's bind is still reported by the server.

    Raises:
        ServerBindError: the address cannot be bound (why, from :func:`~zoomer_serve.netaddr.bind_probe`).
    """
    if port == 0:
        return
    reason = bind_probe(host, port)
    if reason is not None:
        raise ServerBindError(f"cannot bind {_address(host, port)}: {reason}")


def _register_extra(server: grpc.Server, extra: ExtraServicer) -> None:
    if callable(extra):
        extra(server)
        return
    add_fn, servicer = extra
    add_fn(servicer, server)


def build_server(
    model: DLRM | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_workers: int = 8,
    extra_servicers: Iterable[ExtraServicer] = (),
    config: ServiceConfig | None = None,
) -> tuple[grpc.Server, int]:
    """Build, bind and start a gRPC server hosting ``RankerServicer``.

    Args:
        model: the model to serve; None builds ``build_model()`` (default config, seed 0,
            CUDA if available).
        host, port: where to listen; port 0 picks a free port.
        interceptors: server interceptors, outermost first.
        max_workers: size of the thread pool handling RPCs.
        extra_servicers: more services to host (health, reflection, ...): each a callable
            ``f(server)`` or a pair ``(add_XServicer_to_server, servicer)``.
        config: serving limits; None means ``ServiceConfig()``.

    Returns:
        ``(server, bound_port)``; the server is started, stop it with ``server.stop(grace)``.

    Raises:
        ServerBindError (an OSError): the address cannot be bound (in use, not a local
            address, no permission). SO_REUSEPORT is disabled, so a port held by another
            server is reported instead of silently shared.
    """
    model = model if model is not None else build_model()
    servicer = RankerServicer(model, config=config)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ranker-rpc"),
        interceptors=list(interceptors),
        options=[("grpc.so_reuseport", 0)],
    )
    ranker_pb2_grpc.add_RankerServicer_to_server(servicer, server)
    for extra in extra_servicers:
        _register_extra(server, extra)
    address = _address(host, port)
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError as err:  # grpcio >= 1.50 raises, older versions return 0
        server.stop(None)
        raise ServerBindError(f"cannot bind gRPC server to {address}: {err}") from err
    if bound_port == 0:
        server.stop(None)
        raise ServerBindError(f"cannot bind gRPC server to {address}")
    server.start()
    return server, bound_port
