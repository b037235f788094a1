"""Thin transport adapters over the zoomer-serve request recorder.

- :class:`interceptors.grpc_server.ZoomerServerInterceptor`: ``grpc.ServerInterceptor`` for ``grpc.server``.
- :class:`interceptors.grpc_aio.ZoomerAioServerInterceptor`: ``grpc.aio.ServerInterceptor`` for
  ``grpc.aio.server`` (the same spans, from the same core).
- :class:`interceptors.grpc_client.ZoomerClientInterceptor` (sync channels, with ``grpc.intercept_channel``)
  and :func:`interceptors.grpc_client.aio_client_interceptors` (``grpc.aio`` channels): CLIENT spans and
  W3C trace context in the outgoing metadata.
"""

from interceptors.grpc_aio import ZoomerAioServerInterceptor
from interceptors.grpc_client import ZoomerClientInterceptor, aio_client_interceptors
from interceptors.grpc_server import ZoomerServerInterceptor

__all__ = ["ZoomerAioServerInterceptor", "ZoomerClientInterceptor", "ZoomerServerInterceptor",
           "aio_client_interceptors"]
