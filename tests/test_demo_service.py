"""The demo Ranker service over a real gRPC server on 127.0.0.1, and the load driver against it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from zoomer_serve.demo import ranker_pb2, ranker_pb2_grpc
from zoomer_serve.demo.load import (
    PREDICT,
    PREDICT_STREAM,
    InvalidKind,
    LoadProgress,
    drive_load,
    make_request,
)
from zoomer_serve.demo.model import DLRM, DLRMConfig, build_model
from zoomer_serve.demo.service import (
    InvalidRequestError,
    RankerServicer,
    ServerBindError,
    ServiceConfig,
    build_server,
    request_to_batch,
)
from zoomer_serve.recording import RequestRecorder
from zoomer_serve.recording import records as rec

MAX_BATCH = 64
SERVICE_CONFIG = ServiceConfig(max_batch_size=MAX_BATCH, max_ids_per_feature=4, model_version="test-v1")
CFG = DLRMConfig()


@pytest.fixture(scope="module")
def model() -> DLRM:
    return build_model(device="cpu")


@pytest.fixture(scope="module")
def server_port(model: DLRM) -> Iterator[int]:
    server, port = build_server(model, config=SERVICE_CONFIG, max_workers=4)
    yield port
    server.stop(None).wait(5)


@pytest.fixture(scope="module")
def stub(server_port: int) -> Iterator[ranker_pb2_grpc.RankerStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server_port}") as channel:
        yield ranker_pb2_grpc.RankerStub(channel)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _abort_of(stub: ranker_pb2_grpc.RankerStub, request: ranker_pb2.PredictRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(request, timeout=10)
    return info.value


# --- valid requests ---------------------------------------------------------------------------


def test_predict_one_score_per_candidate(stub: ranker_pb2_grpc.RankerStub) -> None:
    request = make_request(_rng(), 16, CFG, request_id="req-1")
    response = stub.Predict(request, timeout=10)
    assert len(response.scores) == 16
    assert all(0.0 < s < 1.0 for s in response.scores)
    assert response.request_id == "req-1"
    assert response.model_version == "test-v1"


def test_predict_is_deterministic_and_keeps_candidate_order(stub: ranker_pb2_grpc.RankerStub) -> None:
    request = make_request(_rng(1), 12, CFG)
    first = list(stub.Predict(request, timeout=10).scores)
    assert list(stub.Predict(request, timeout=10).scores) == first
    reversed_request = ranker_pb2.PredictRequest(candidates=list(reversed(request.candidates)))
    reversed_scores = list(stub.Predict(reversed_request, timeout=10).scores)
    np.testing.assert_allclose(reversed_scores[::-1], first, rtol=1e-5)


def test_predict_matches_the_model(stub: ranker_pb2_grpc.RankerStub, model: DLRM) -> None:
    request = make_request(_rng(2), 8, CFG, max_ids_per_feature=4)
    batch = request_to_batch(request, CFG, SERVICE_CONFIG)
    with torch.inference_mode():
        expected = model(batch.dense, batch.ids, batch.offsets).tolist()
    np.testing.assert_allclose(list(stub.Predict(request, timeout=10).scores), expected, rtol=1e-5)


def test_stream_answers_each_message_in_order(stub: ranker_pb2_grpc.RankerStub) -> None:
    rng = _rng(3)
    requests = [make_request(rng, n, CFG, request_id=f"m{i}") for i, n in enumerate((1, 5, 3, 8))]
    responses = list(stub.PredictStream(iter(requests), timeout=10))
    assert [r.request_id for r in responses] == ["m0", "m1", "m2", "m3"]
    assert [len(r.scores) for r in responses] == [1, 5, 3, 8]
    assert all(0.0 < s < 1.0 for r in responses for s in r.scores)


def test_max_batch_size_is_accepted(stub: ranker_pb2_grpc.RankerStub) -> None:
    assert len(stub.Predict(make_request(_rng(), MAX_BATCH, CFG), timeout=10).scores) == MAX_BATCH


# --- invalid requests -------------------------------------------------------------------------

KIND_MESSAGES = {
    InvalidKind.EMPTY_BATCH: "empty batch",
    InvalidKind.BATCH_TOO_LARGE: f"batch too large: {MAX_BATCH + 1} candidates, max_batch_size is {MAX_BATCH}",
    InvalidKind.DENSE_COUNT: f"expected {CFG.num_dense} dense features, got {CFG.num_dense - 1}",
    InvalidKind.SPARSE_COUNT: f"expected {CFG.num_sparse} sparse features, got {CFG.num_sparse - 1}",
    InvalidKind.ID_OUT_OF_RANGE: "out of range",
    InvalidKind.NON_FINITE: "is nan, dense values must be finite",
    InvalidKind.EMPTY_IDS: "0 ids, need 1 to 4",
}


@pytest.mark.parametrize("kind", list(InvalidKind), ids=lambda k: k.value)
def test_each_invalid_kind_is_invalid_argument(stub: ranker_pb2_grpc.RankerStub, kind: InvalidKind) -> None:
    assert set(KIND_MESSAGES) == set(InvalidKind)
    request = make_request(_rng(4), 6, CFG, kind, max_batch_size=MAX_BATCH)
    err = _abort_of(stub, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert KIND_MESSAGES[kind] in err.details()


def _valid(n: int = 4) -> ranker_pb2.PredictRequest:
    return make_request(_rng(5), n, CFG)


def test_id_out_of_range_names_candidate_feature_id_and_table_size(stub: ranker_pb2_grpc.RankerStub) -> None:
    request = _valid()
    request.candidates[2].sparse[3].ids[0] = 10_000_000
    err = _abort_of(stub, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    size = CFG.table_sizes[3]
    assert err.details() == (
        f"candidate 2, sparse feature 3: id 10000000 out of range, table 3 has {size} rows "
        f"(valid ids 0..{size - 1})"
    )


def test_negative_id_is_out_of_range(stub: ranker_pb2_grpc.RankerStub) -> None:
    request = _valid()
    request.candidates[1].sparse[0].ids[0] = -1
    assert "candidate 1, sparse feature 0: id -1 out of range" in _abort_of(stub, request).details()


def test_wrong_dense_count_says_expected_got_and_candidate(stub: ranker_pb2_grpc.RankerStub) -> None:
    request = _valid()
    request.candidates[3].dense.append(1.0)
    err = _abort_of(stub, request)
    assert err.details() == f"candidate 3: expected {CFG.num_dense} dense features, got {CFG.num_dense + 1}"


def test_infinite_dense_value_is_rejected(stub: ranker_pb2_grpc.RankerStub) -> None:
    request = _valid()
    request.candidates[0].dense[5] = float("-inf")
    assert (
        _abort_of(stub, request).details()
        == "candidate 0: dense feature 5 is -inf, dense values must be finite"
    )


def test_too_many_ids_for_one_feature(stub: ranker_pb2_grpc.RankerStub) -> None:
    request = _valid()
    request.candidates[1].sparse[2].ids.extend([1, 2, 3, 4])
    assert _abort_of(stub, request).details() == "candidate 1, sparse feature 2: 5 ids, need 1 to 4"


def test_stream_aborts_on_first_bad_message(stub: ranker_pb2_grpc.RankerStub) -> None:
    rng = _rng(6)
    requests = [
        make_request(rng, 3, CFG, request_id="ok"),
        make_request(rng, 3, CFG, InvalidKind.NON_FINITE, request_id="bad"),
        make_request(rng, 3, CFG, request_id="never"),
    ]
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in stub.PredictStream(iter(requests), timeout=10):
            received.append(response.request_id)
    assert received == ["ok"]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is nan" in info.value.details()


def test_request_to_batch_raises_without_grpc() -> None:
    with pytest.raises(InvalidRequestError, match="empty batch"):
        request_to_batch(ranker_pb2.PredictRequest(), CFG)


# --- phases -----------------------------------------------------------------------------------


def _phase_children(servicer: RankerServicer, request: ranker_pb2.PredictRequest) -> list[tuple]:
    recorder = RequestRecorder(otel_context=False)
    span = recorder.start("zoomer.demo.v1.Ranker/Predict")
    span.activate()
    try:
        servicer.score(request)
    except InvalidRequestError:
        pass
    finally:
        span.deactivate()
    return span.child_records()


def test_score_records_three_phases_inside_a_request(model: DLRM) -> None:
    servicer = RankerServicer(model, config=SERVICE_CONFIG)
    children = _phase_children(servicer, _valid())
    assert [c[rec.R_NAME] for c in children] == ["preprocess", "forward", "postprocess"]
    assert all(c[rec.R_STATUS] == rec.STATUS_UNSET for c in children)


def test_invalid_request_fails_the_preprocess_phase(model: DLRM) -> None:
    servicer = RankerServicer(model, config=SERVICE_CONFIG)
    children = _phase_children(servicer, ranker_pb2.PredictRequest())
    assert [c[rec.R_NAME] for c in children] == ["preprocess"]
    assert children[0][rec.R_STATUS] == rec.STATUS_ERROR
    assert children[0][rec.R_ATTRS]["error.type"] == "InvalidRequestError"


# --- server construction ----------------------------------------------------------------------


def test_bind_failure_names_host_and_port(model: DLRM, server_port: int) -> None:
    with pytest.raises(ServerBindError, match=f"127.0.0.1:{server_port}"):
        build_server(model, port=server_port)


def test_extra_servicers_are_registered(model: DLRM) -> None:
    seen: list[object] = []
    server, _ = build_server(
        model,
        extra_servicers=[seen.append, (lambda servicer, srv: seen.append(servicer), "pair-servicer")],
    )
    try:
        assert seen == [server, "pair-servicer"]
    finally:
        server.stop(None)


# --- load driver ------------------------------------------------------------------------------


def test_make_request_is_reproducible() -> None:
    assert make_request(_rng(9), 5, CFG, max_ids_per_feature=3) == make_request(
        _rng(9), 5, CFG, max_ids_per_feature=3
    )
    assert make_request(_rng(9), 5, CFG) != make_request(_rng(10), 5, CFG)


@pytest.mark.slow
def test_drive_load_counts_both_methods_and_invalid_calls(server_port: int) -> None:
    seen: list[LoadProgress] = []
    result = drive_load(
        f"127.0.0.1:{server_port}",
        duration_s=2.0,
        clients=2,
        stream_share=0.3,
        invalid_share=0.2,
        batch_size=16,
        progress=seen.append,
        seed=1,
        max_batch_size=MAX_BATCH,
    )
    assert result.count(PREDICT, "OK") > 0
    assert result.count(PREDICT_STREAM, "OK") > 0
    assert result.count(code="INVALID_ARGUMENT") > 0
    assert {code for _, code in result.counts} <= {"OK", "INVALID_ARGUMENT"}
    assert result.unexpected == 0
    assert result.stream_messages >= 2 * result.count(PREDICT_STREAM, "OK")
    assert result.latency_ms[PREDICT].count == result.count(PREDICT, "OK")
    assert 0.0 < result.p50_ms <= result.p99_ms
    assert seen and seen[-1].calls == result.total_calls
    assert result.duration_s < 2.0 + 5.0


def test_drive_load_stops_at_max_requests(server_port: int) -> None:
    result = drive_load(
        f"127.0.0.1:{server_port}",
        duration_s=60.0,
        clients=3,
        max_requests=7,
        batch_size=4,
        invalid_share=0.0,
    )
    assert result.total_calls == 7
    assert result.count(code="OK") == 7
    assert result.duration_s < 30.0


def test_drive_load_counts_transport_failures() -> None:
    result = drive_load("127.0.0.1:1", duration_s=5.0, clients=1, max_requests=2, rpc_timeout_s=2.0)
    assert result.total_calls == 2
    assert result.count(code="UNAVAILABLE") == 2
    assert result.unexpected == 2
