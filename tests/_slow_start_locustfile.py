"""A locustfile for tests/test_loadtest_distributed.py: a worker whose start (locust's ``init`` event) takes
3 s, as on a loaded machine, and that lacks the user class its master names. Its runner is connected before
``init`` runs, so the master's users reach it while it starts: the spawn fails (KeyError) during ``init`` and
locust exits the worker 1 at the end of ``init``, without a word and before its first report."""

import gevent
from locust import constant, events, task

from zoomer_serve.loadtest.plugin import GrpcUser

START_S = 3.0


@events.init.add_listener
def _slow_start(**_: object) -> None:
    gevent.sleep(START_S)  # yields: the runner's greenlets go on receiving the master's messages


class OtherUser(GrpcUser):
    wait_time = constant(1)

    @task
    def nothing(self) -> None:
        pass
