"""Load-test-driven profiling with locust: locust users that trace their calls, a steady-state profiling
trigger, and one summary of client latency, server latency and the profile of a run.

Importing this package imports neither locust nor gevent (``zoomer-serve`` stays free of gevent's
monkeypatching). The locust parts are in modules that import locust (which patches the standard library
with gevent on import); import them from a locustfile only:

- :mod:`zoomer_serve.loadtest.plugin`: :class:`~zoomer_serve.loadtest.users.GrpcUser`,
  :class:`~zoomer_serve.loadtest.users.ThriftUser`, the ``--zoomer-*`` command-line options and
  :func:`~zoomer_serve.loadtest.plugin.install` (library mode).
- :mod:`zoomer_serve.loadtest.ranker_users`: users of the demo ``Ranker`` (what ``benchmarks/locustfile.py``
  runs).

Locust-free parts: :mod:`zoomer_serve.loadtest.config` (:class:`LoadTestOptions`),
:mod:`zoomer_serve.loadtest.summary` (:class:`LoadTestSummary`) and the ``zoomer-serve loadtest`` command
(:mod:`zoomer_serve.loadtest.cli`), which runs locust in a subprocess.
"""

from zoomer_serve.loadtest.config import LoadTestOptions
from zoomer_serve.loadtest.summary import LoadTestSummary

__all__ = ["LoadTestOptions", "LoadTestSummary"]
