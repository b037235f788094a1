"""Load test of the demo Ranker with profiling at steady state (locust).

    zoomer-serve serve-demo --port 50051                  # with ZOOMER_ADMIN_TOKEN set, for profiling
    ZOOMER_ADMIN_TOKEN=... locust -f benchmarks/locustfile.py --headless --host 127.0.0.1:50051 \\
        --users 16 --spawn-rate 4 --run-time 2m --zoomer-warmup-s 30 --zoomer-profile-requests 200

The users (gRPC ``RankerGrpcUser``, Thrift ``RankerThriftUser``; ``--zoomer-transport`` picks one when none is
named) and their request mix are in :mod:`zoomer_serve.loadtest.ranker_users`, so that ``zoomer-serve
loadtest`` runs the same users from an installed package. Every ``--zoomer-*`` option is listed by
``locust -f benchmarks/locustfile.py --help``. Distributed (``--master`` / ``--worker``): every process loads
this file; give ``--zoomer-*`` options and user classes on the master only. Your own locustfile: subclass
``zoomer_serve.loadtest.plugin.GrpcUser`` (set ``stub_class``) or ``ThriftUser`` (set ``thrift_service``).
"""

from zoomer_serve.loadtest.ranker_users import RankerGrpcUser, RankerThriftUser

__all__ = ["RankerGrpcUser", "RankerThriftUser"]
