"""A locustfile for tests/test_loadtest_distributed.py: ``_slow_locustfile``'s users (``/test.Slow/Call``
back to back), on workers that send no statistics report of their own during the test (locust's report
interval, 3 s, set to 10 minutes): the master only learns what was sent from their last reports."""

import locust.runners
from _slow_locustfile import SlowCaller  # noqa: F401  (locust takes the user classes of this module)

locust.runners.WORKER_REPORT_INTERVAL = 600.0
