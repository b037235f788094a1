"""Locust users of the demo ``Ranker`` (``zoomer-serve serve-demo``), over gRPC and over Thrift; the users
``benchmarks/locustfile.py`` and ``zoomer-serve loadtest`` run. A locustfile (imports locust).

Request mix, per user: ``Predict`` four times as often as ``PredictStream`` (gRPC; Thrift has only
``Predict``); batches of 1 to 128 candidates, most between 8 and 32 (a ranking stage scoring a page of
candidates); sparse features with 1 to 4 ids each (multi-hot); a short think time (0 to 20 ms). Requests are
drawn from a pool built once per process by :func:`zoomer_serve.demo.load.make_request` (building one costs
about as much as the server's forward pass, so they are not built per call).

Transport: ``--zoomer-transport grpc`` (default) or ``thrift`` keeps only that transport's user when no user
class is named on the command line (``locust -f benchmarks/locustfile.py RankerThriftUser`` also works). With
a master and workers, give either on the master only.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from locust import between, events, task

from zoomer_serve.loadtest.config import TRANSPORT_ENV, TRANSPORTS
from zoomer_serve.loadtest.plugin import GrpcUser, ThriftUser
from zoomer_serve.loadtest.trigger import decides

BATCH_SIZES = (1, 4, 8, 16, 24, 32, 48, 64, 128)
BATCH_WEIGHTS = (2, 4, 10, 14, 12, 10, 5, 3, 1)
POOL_SIZE = 48
STREAM_MESSAGES = (2, 5)


@functools.lru_cache(maxsize=1)
def request_pool(seed: int = 0) -> tuple[Any, ...]:
    """``POOL_SIZE`` valid ``PredictRequest`` messages of the mix above (built once per process)."""
    import numpy as np

    from zoomer_serve.demo.load import make_request

    rng = np.random.default_rng(seed)
    sizes = random.Random(seed).choices(BATCH_SIZES, BATCH_WEIGHTS, k=POOL_SIZE)
    return tuple(make_request(rng, n, max_ids_per_feature=4, request_id=f"pool-{i}") for i, n in enumerate(sizes))


@functools.lru_cache(maxsize=1)
def thrift_pool(seed: int = 0) -> tuple[Any, ...]:
    """The pool as Thrift ``PredictRequest`` structs."""
    from zoomer_serve.demo.thrift_load import to_thrift_request

    return tuple(to_thrift_request(r) for r in request_pool(seed))


def _ranker_stub() -> type:
    from zoomer_serve.demo.ranker_pb2_grpc import RankerStub

    return RankerStub


def _thrift_service() -> tuple[Any, str]:
    """The thriftpy2 ``Ranker`` service and the name the demo server gives its spans."""
    from zoomer_serve.demo.thrift_server import SERVICE_NAME, ranker_thrift

    return ranker_thrift().Ranker, SERVICE_NAME


class RankerGrpcUser(GrpcUser):
    """``zoomer.demo.v1.Ranker`` over gRPC."""

    transport = "grpc"
    stub_class = _ranker_stub()
    wait_time = between(0.0, 0.02)

    def on_start(self) -> None:
        self.rng = random.Random(id(self))
        self.pool = request_pool()

    @task(4)
    def predict(self) -> None:
        self.stub.Predict(self.rng.choice(self.pool))

    @task(1)
    def predict_stream(self) -> None:
        n = self.rng.randint(*STREAM_MESSAGES)
        self.stub.PredictStream(iter(self.rng.sample(self.pool, n)))


class RankerThriftUser(ThriftUser):
    """``zoomer.demo.v1.Ranker`` over Thrift (``zoomer-serve serve-demo --transport thrift``)."""

    transport = "thrift"
    thrift_service, service_name = _thrift_service()
    wait_time = between(0.0, 0.02)

    def on_start(self) -> None:
        self.rng = random.Random(id(self))
        self.pool = thrift_pool()

    @task
    def predict(self) -> None:
        self.client.Predict(self.rng.choice(self.pool))


@events.init_command_line_parser.add_listener
def _add_transport(parser: Any, **_: Any) -> None:
    parser.add_argument("--zoomer-transport", choices=TRANSPORTS, default="grpc", env_var=TRANSPORT_ENV,
                        include_in_web_ui=False,
                        help="run the Ranker user of this transport when no user class is named (default grpc)")


@events.init.add_listener
def _keep_transport(environment: Any, **_: Any) -> None:
    """Keep the users of ``--zoomer-transport`` in the process that decides which users run (a single process
    or the master). A worker keeps every user class: the master names those it is to run in each spawn
    message, and its own ``--zoomer-transport`` (the default, unless given on the worker too) may differ from
    the master's, which reaches the worker only with that message."""
    parsed = environment.parsed_options
    if parsed is None or getattr(parsed, "user_classes", None) or not hasattr(parsed, "zoomer_transport"):
        return
    if not decides(environment.runner):
        return
    keep = [u for u in environment.user_classes if getattr(u, "transport", parsed.zoomer_transport)
            == parsed.zoomer_transport]
    environment.user_classes[:] = keep
