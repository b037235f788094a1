"""The demo Ranker over Thrift (sync and asyncio servers) with the real DLRM model, exporting to the embedded
collector: the same handler code and span shape as gRPC, phases, the declared InvalidRequest, and the Thrift
load driver's LoadResult matching the spans."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from thriftpy2.rpc import make_client

from zoomer_serve.demo.load import InvalidKind, make_request
from zoomer_serve.demo.model import DLRM, DLRMConfig, build_model
from zoomer_serve.demo.service import RankerServicer, ServerBindError
from zoomer_serve.demo.thrift_load import drive_thrift_load, to_thrift_request
from zoomer_serve.demo.thrift_server import (
    SERVICE_NAME,
    build_thrift_server,
    ranker_thrift,
    serve_thrift_forever,
)

CFG = DLRMConfig()
METHOD = f"{SERVICE_NAME}/Predict"


@pytest.fixture(scope="module")
def model() -> DLRM:
    return build_model(device="cpu")


@pytest.fixture(params=["sync", "aio"])
def server(request, model, telemetry):
    srv = build_thrift_server(model, aio=request.param == "aio").start()
    yield srv
    srv.stop()


def _rng(seed: int = 7) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.mark.slow
def test_predict_scores_match_grpc_and_spans_have_phases(server, model, collector):
    pb_request = make_request(_rng(), 12, CFG, request_id="r-1")
    client = make_client(ranker_thrift().Ranker, "127.0.0.1", server.port, timeout=10_000)
    response = client.Predict(to_thrift_request(pb_request))
    assert response.request_id == "r-1" and response.model_version == "dlrm-demo-v1"
    expected = list(RankerServicer(model).score(pb_request).scores)
    np.testing.assert_allclose(response.scores, expected, rtol=1e-6)
    with pytest.raises(ranker_thrift().InvalidRequest) as info:
        client.Predict(to_thrift_request(make_request(_rng(), 4, CFG, InvalidKind.ID_OUT_OF_RANGE)))
    assert "out of range" in info.value.message
    client.close()
    server.stop()
    spans = collector.spans()
    ok, invalid = [s for s in spans if s["kind"] == "SERVER"]
    for span in (ok, invalid):
        assert span["name"] == METHOD and span["attributes"]["rpc.method"] == METHOD
        assert span["attributes"]["rpc.system.name"] == "thrift"
        assert span["status_code"] == "UNSET"
    assert ok["attributes"]["rpc.response.status_code"] == "OK"
    assert ok["attributes"]["zoomer.rpc.request.bytes"] > 12 * (CFG.num_dense * 8)
    phases = {s["name"]: s for s in spans if s["parent_span_id"] == ok["span_id"]}
    assert set(phases) == {"preprocess", "forward", "postprocess"}
    assert invalid["attributes"]["rpc.response.status_code"] == "InvalidRequest"
    assert invalid["attributes"]["zoomer.rpc.business_error"] == "InvalidRequest"
    (pre,) = [s for s in spans if s["parent_span_id"] == invalid["span_id"]]
    assert pre["name"] == "preprocess" and pre["status_code"] == "ERROR"


@pytest.mark.slow
def test_load_driver_counts_match_the_spans(server, collector):
    result = drive_thrift_load(f"127.0.0.1:{server.port}", 30.0, clients=2, invalid_share=0.3,
                               batch_size=8, max_requests=24, seed=3)
    assert result.total_calls == 24 and result.unexpected == 0
    assert set(result.counts) <= {("Predict", "OK"), ("Predict", "INVALID_ARGUMENT")}
    assert result.count("Predict", "INVALID_ARGUMENT") > 0
    assert result.latency_ms["Predict"].count == result.count("Predict", "OK") and result.p50_ms > 0
    # The client has its reply before the server ends the call's span: stop gracefully (calls in progress
    # finish) before telemetry is shut down, or the last span could be recorded after it (it failed so once).
    server.stop(grace_s=5.0)
    spans = collector.spans("SERVER")
    assert len(spans) == 24
    statuses = [s["attributes"]["rpc.response.status_code"] for s in spans]
    assert statuses.count("InvalidRequest") == result.count("Predict", "INVALID_ARGUMENT")


def test_load_driver_rejects_streams_and_counts_an_absent_server():
    with pytest.raises(ValueError, match="no streaming"):
        drive_thrift_load("127.0.0.1:1", 1.0, stream_share=0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = drive_thrift_load(f"127.0.0.1:{port}", 5.0, clients=1, max_requests=3, invalid_share=0.0)
    assert result.counts == {("Predict", "UNAVAILABLE"): 3} and result.unexpected == 3


def test_bind_failure_is_a_server_bind_error(model):
    from zoomer_serve.recording import RequestRecorder

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ServerBindError, match=str(port)):
            build_thrift_server(model, port=port, recorder=RequestRecorder(otel_context=False))


@pytest.mark.parametrize("aio", [False, True])
def test_serve_thrift_forever_serves_until_stopped(model, telemetry, collector, aio):
    """What ``serve-demo --transport thrift`` runs: ready with the bound port, serve, stop on the event."""
    ports: list[int] = []
    ready, stop = threading.Event(), threading.Event()

    def on_ready(port: int) -> None:
        ports.append(port)
        ready.set()

    thread = threading.Thread(target=serve_thrift_forever, kwargs=dict(
        stop_event=stop, model=model, aio=aio, grace_s=1.0, on_ready=on_ready), daemon=True)
    thread.start()
    assert ready.wait(30)
    result = drive_thrift_load(f"127.0.0.1:{ports[0]}", 30.0, clients=1, max_requests=5, batch_size=4)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert result.counts == {("Predict", "OK"): 5}
    assert len(collector.spans("SERVER")) == 5
