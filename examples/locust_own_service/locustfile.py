"""A locust load test of your own gRPC service (the Ranker of ``examples/grpc_server``) with zoomer-serve's
locust users: each call fires one locust request event named by the RPC method and sends W3C trace context,
so the server's span of each call shares the trace of the load generator's CLIENT span.

Start the server (``examples/grpc_server/server.py``), then, from the repository root::

    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 locust -f examples/locust_own_service/locustfile.py \\
        --headless --host 127.0.0.1:50051 --users 8 --spawn-rate 8 --run-time 30s --stop-timeout 10 \\
        --zoomer-no-profile

Distributed: the same file in a master and its workers (``--master --expect-workers 2`` / ``--worker``); the
options go on the master. ``--zoomer-no-profile``: this server serves no ProfilerControl; a server that
does (``zoomer_serve.profiling.admin.add_profiler_control``, see README.md's profiling section) is profiled
once the load is steady when the option is left out and ``ZOOMER_ADMIN_TOKEN`` is set.
"""

import random
import sys
from pathlib import Path

from locust import between, task

from zoomer_serve.loadtest.plugin import GrpcUser  # before any gRPC channel: sets up grpcio's gevent support

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grpc_server"))

import ranker_pb2_grpc
from model import make_request


class RankerUser(GrpcUser):
    """Sends ``Rank`` requests of 4 to 32 candidates with up to 50 ms of think time."""

    stub_class = ranker_pb2_grpc.RankerStub
    wait_time = between(0.0, 0.05)

    def on_start(self) -> None:
        self.rng = random.Random(id(self))

    @task
    def rank(self) -> None:
        self.stub.Rank(make_request(self.rng, self.rng.randint(4, 32)))
