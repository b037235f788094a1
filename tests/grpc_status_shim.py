"""A ``grpc.Status`` with trailing metadata, for ``abort_with_status`` tests (what grpcio-status builds)."""

from __future__ import annotations

import collections

import grpc


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    pass


def status_with_trailers() -> grpc.Status:
    return _Status(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded", (("retry-after-ms", "250"),))
