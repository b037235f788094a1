"""``zoomer_serve.force_flush()`` says whether the flush got the spans stored: False when the collector refused
them (an error reply, or a partial success that rejected some), True only when everything recorded since the
previous flush was accepted. Real OTLP receivers on 127.0.0.1 (``_scripted_otlp``), both export modes (the
helper process and the in-process thread), both protocols."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _scripted_otlp import Reply, ScriptedOtlp

import zoomer_serve

REFUSED = Reply(grpc_code="INVALID_ARGUMENT", http_status=400, message="refused: bad data")
"""Not retryable (OTLP): answered at once, every span of the request lost."""


@pytest.fixture(params=[("grpc", "process"), ("http/protobuf", "thread")], ids=["grpc-process", "http-thread"])
def exporting_to(request: pytest.FixtureRequest) -> Iterator[Any]:
    """``start(traces_script)``: a scripted receiver answering trace exports with the script (then success), and
    zoomer-serve configured to export there (no scheduled export: only flushes send). Shut down at the end."""
    protocol, mode = request.param
    receivers: list[ScriptedOtlp] = []

    def start(traces: list[Reply]) -> ScriptedOtlp:
        receiver = ScriptedOtlp(protocol, traces=traces).__enter__()
        receivers.append(receiver)
        zoomer_serve.configure(service_name="flush", endpoint=f"http://127.0.0.1:{receiver.port}", protocol=protocol,
                               export_mode=mode, schedule_delay_ms=600_000, timeout_ms=5000,
                               set_global_providers=False)
        return receiver

    yield start
    zoomer_serve.shutdown(timeout_s=5)
    for receiver in receivers:
        receiver.__exit__(None, None, None)


def _record(n: int) -> None:
    recorder = zoomer_serve.get_recorder()
    for i in range(n):
        span = recorder.start("svc.S/M", attributes={"rpc.method": "svc.S/M", "rpc.system.name": "grpc", "i": i})
        span.set_attribute("rpc.response.status_code", "OK")
        span.end()


def test_force_flush_is_false_when_the_collector_refuses_every_span(exporting_to):
    """C15: the receiver answers every trace export with a non-retryable error: the flush sent the 30 spans,
    none was stored, and force_flush says so (it said True: "sent or counted as dropped")."""
    receiver = exporting_to([REFUSED] * 10)
    _record(30)
    assert zoomer_serve.force_flush(10) is False
    assert sum(r.items for r in receiver.requests("traces")) == 30 and receiver.accepted("traces") == 0
    stats = zoomer_serve.shutdown(timeout_s=5)
    assert stats is not None and (stats.exported, stats.dropped_export) == (0, 30)


def test_force_flush_is_false_when_a_partial_success_rejects_spans(exporting_to):
    """C15: a partial success that rejects 3 of 20 spans: those 3 are not stored, the flush did not succeed.
    A partial success that rejects none (a warning message only) is a success."""
    receiver = exporting_to([Reply(rejected=3, message="spans older than 1h"), Reply(message="slow down")])
    _record(20)
    assert zoomer_serve.force_flush(10) is False
    assert receiver.accepted("traces") == 17
    _record(5)
    assert zoomer_serve.force_flush(10) is True
    assert receiver.accepted("traces") == 22
    stats = zoomer_serve.shutdown(timeout_s=5)
    assert stats is not None and (stats.exported, stats.dropped_rejected) == (22, 3)


def test_force_flush_after_a_refused_one_is_true_once_everything_new_is_stored(exporting_to):
    """A flush answers for what was recorded since the previous flush: after a refused export (False), the next
    flush of 12 new spans that the receiver takes is True; a flush with nothing new to send is True too."""
    receiver = exporting_to([REFUSED])
    _record(8)
    assert zoomer_serve.force_flush(10) is False
    _record(12)
    assert zoomer_serve.force_flush(10) is True
    assert receiver.accepted("traces") == 12
    assert zoomer_serve.force_flush(10) is True
    stats = zoomer_serve.shutdown(timeout_s=5)
    assert stats is not None and (stats.exported, stats.dropped_export) == (12, 8)
