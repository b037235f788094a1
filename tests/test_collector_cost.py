"""benchmarks/collector_cost.py measures the embedded collector over either OTLP transport: every span sent is
stored, and the CPU is split between the receiver's handler threads, the store writer and the rest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import collector_cost  # noqa: E402


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_every_span_sent_is_stored_and_the_handlers_cpu_is_counted(protocol: str) -> None:
    result = collector_cost.measure(n_spans=1536, batch=512, rate=0, senders=2, protocol=protocol)
    assert (result["protocol"], result["stored"], result["failed_requests"]) == (protocol, 1536, 0)
    assert result["handler_us_per_span"] > 0 and result["store_writer_us_per_span"] > 0, result
    parts = result["handler_us_per_span"] + result["store_writer_us_per_span"] + result["other_threads_us_per_span"]
    assert parts == pytest.approx(result["cpu_us_per_span"], abs=0.3), result
