"""RPC metrics computed from span records, off the request path, with the OpenTelemetry SDK.

Instruments (semantic conventions for RPC, stable names):

- ``rpc.server.call.duration`` / ``rpc.client.call.duration``: histogram, unit ``s``, buckets
  0.005 … 10 s as the conventions advise; attributes ``rpc.system.name``, ``rpc.method``,
  ``rpc.response.status_code``, ``error.type`` (when an error), ``server.address``, ``server.port``.
- ``rpc.server.request.size`` / ``rpc.server.response.size`` (and ``rpc.client.*``): histogram, unit
  ``By``, the uncompressed protobuf (or Thrift) payload bytes of all messages of one call.

Every request record counts, sampled or not.
"""

from __future__ import annotations

from typing import Any

from zoomer_serve.recording import records as r

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
SIZE_BUCKETS_BYTES = (0, 100, 1000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000)
METRIC_ATTRIBUTE_KEYS = ("rpc.system.name", "rpc.method", "rpc.response.status_code", "error.type",
                         "server.address", "server.port")
REQUEST_BYTES = "zoomer.rpc.request.bytes"
RESPONSE_BYTES = "zoomer.rpc.response.bytes"


class RpcMetrics:
    """Records the RPC histograms of each request record on a ``MeterProvider``'s meter."""

    def __init__(self, meter: Any) -> None:
        self._instruments: dict[int, tuple[Any, Any, Any]] = {}
        for kind, side in ((r.KIND_SERVER, "server"), (r.KIND_CLIENT, "client")):
            self._instruments[kind] = (
                meter.create_histogram(f"rpc.{side}.call.duration", unit="s",
                                       description=f"Duration of {side}-side RPC calls",
                                       explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS_S)),
                meter.create_histogram(f"rpc.{side}.request.size", unit="By",
                                       description="Uncompressed payload bytes of the request messages of a call",
                                       explicit_bucket_boundaries_advisory=list(SIZE_BUCKETS_BYTES)),
                meter.create_histogram(f"rpc.{side}.response.size", unit="By",
                                       description="Uncompressed payload bytes of the response messages of a call",
                                       explicit_bucket_boundaries_advisory=list(SIZE_BUCKETS_BYTES)),
            )
        self._attr_cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    def record(self, rec: tuple[Any, ...]) -> None:
        """Record one request record (a no-op for records without the ``F_REQUEST`` flag)."""
        if not rec[r.R_FLAGS] & r.F_REQUEST:
            return
        instruments = self._instruments.get(rec[r.R_KIND])
        if instruments is None:
            return
        attrs = rec[r.R_ATTRS]
        key = tuple(attrs.get(k) for k in METRIC_ATTRIBUTE_KEYS)
        metric_attrs = self._attr_cache.get(key)
        if metric_attrs is None:
            metric_attrs = {k: v for k, v in zip(METRIC_ATTRIBUTE_KEYS, key) if v is not None}
            if len(self._attr_cache) < 10_000:
                self._attr_cache[key] = metric_attrs
        duration, req_size, resp_size = instruments
        duration.record((rec[r.R_END_NS] - rec[r.R_START_NS]) / 1e9, metric_attrs)
        req_bytes = attrs.get(REQUEST_BYTES)
        if req_bytes is not None:
            req_size.record(req_bytes, metric_attrs)
        resp_bytes = attrs.get(RESPONSE_BYTES)
        if resp_bytes is not None:
            resp_size.record(resp_bytes, metric_attrs)
