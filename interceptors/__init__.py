"""Thin transport adapters over the zoomer-serve request recorder.

- :class:`interceptors.grpc_server.ZoomerServerInterceptor`: ``grpc.ServerInterceptor`` for ``grpc.server``.
"""

from interceptors.grpc_server import ZoomerServerInterceptor

__all__ = ["ZoomerServerInterceptor"]
