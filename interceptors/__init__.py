"""Thin transport adapters over the zoomer-serve request recorder.

- :class:`interceptors.grpc_server.ZoomerServerInterceptor`: ``grpc.ServerInterceptor`` for ``grpc.server``.
- :class:`interceptors.grpc_aio.ZoomerAioServerInterceptor`: ``grpc.aio.ServerInterceptor`` for
  ``grpc.aio.server`` (the same spans, from the same core).
- :class:`interceptors.grpc_client.ZoomerClientInterceptor` (sync channels, with ``grpc.intercept_channel``)
  and :func:`interceptors.grpc_client.aio_client_interceptors` (``grpc.aio`` channels): CLIENT spans and
  W3C trace context in the outgoing metadata.
- Thrift (thriftpy2), the same span shape: :class:`interceptors.thrift_server.TracedProcessor` and
  ``TracedMultiplexedProcessor`` for sync servers, :class:`interceptors.thrift_aio.TracedAsyncProcessor` for
  ``thriftpy2.contrib.aio``; ``make_thrift_server`` / ``make_thrift_aio_server`` build a traced server in one
  call (as ``thriftpy2.rpc.make_server``); ``make_thrift_client`` / ``make_thrift_aio_client`` send W3C trace
  context in thriftpy2's ``contrib.tracking`` request header.
"""

from interceptors.grpc_aio import ZoomerAioServerInterceptor
from interceptors.grpc_client import ZoomerClientInterceptor, aio_client_interceptors
from interceptors.grpc_server import ZoomerServerInterceptor
from interceptors.thrift_aio import TracedAsyncProcessor
from interceptors.thrift_aio import make_aio_server as make_thrift_aio_server
from interceptors.thrift_client import make_aio_client as make_thrift_aio_client
from interceptors.thrift_client import make_client as make_thrift_client
from interceptors.thrift_common import MeteredTransportFactory, ThriftLimits, protocol_error_counts
from interceptors.thrift_server import TracedMultiplexedProcessor, TracedProcessor
from interceptors.thrift_server import make_server as make_thrift_server

__all__ = ["MeteredTransportFactory", "ThriftLimits", "TracedAsyncProcessor", "TracedMultiplexedProcessor",
           "TracedProcessor", "ZoomerAioServerInterceptor", "ZoomerClientInterceptor", "ZoomerServerInterceptor",
           "aio_client_interceptors", "make_thrift_aio_client", "make_thrift_aio_server", "make_thrift_client",
           "make_thrift_server", "protocol_error_counts"]
