"""A locustfile for tests/test_loadtest_distributed.py: users that call ``/test.Slow/Call`` (raw bytes) back
to back, on a server whose every call takes long enough that locust's graceful stop waits for the calls in
flight."""

from locust import constant, task

from zoomer_serve.loadtest.plugin import GrpcUser


class SlowCaller(GrpcUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.slow_call = self.channel.unary_unary("/test.Slow/Call")

    @task
    def call(self) -> None:
        self.slow_call(b"ping")
