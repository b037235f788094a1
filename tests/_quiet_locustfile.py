"""A locustfile for tests/test_loadtest_distributed.py: users that call ``/test.Slow/Call`` (raw bytes) back
to back, on workers that send no statistics report of their own during the test (locust's report interval,
3 s, set to 10 minutes): the master only learns what was sent from their last reports."""

import locust.runners
from locust import constant, task

from zoomer_serve.loadtest.plugin import GrpcUser

locust.runners.WORKER_REPORT_INTERVAL = 600.0


class QuietCaller(GrpcUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.slow_call = self.channel.unary_unary("/test.Slow/Call")

    @task
    def call(self) -> None:
        self.slow_call(b"ping")
