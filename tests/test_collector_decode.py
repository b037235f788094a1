"""The collector's span decoder: attributes read from the wire (with a cache) store exactly the JSON text that
decoding the official protobuf messages gives; malformed attributes are still rejected; the store writer does
not linger when someone flushes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from zoomer_serve.collector import decode
from zoomer_serve.collector.ingest import Ingestor, Outcome, Signal
from zoomer_serve.collector.store import Store, StoreConfig, WriteResult, WriteStatus


def _reference_json(raws: list[bytes]) -> str:
    """What the store held before the wire-level decoder: official messages -> dict -> compact JSON."""
    attrs = decode.attributes_dict(KeyValue.FromString(r) for r in raws)
    return json.dumps(attrs, ensure_ascii=False, separators=(",", ":"))


def _kv(key: str, **value: object) -> bytes:
    return KeyValue(key=key, value=AnyValue(**value)).SerializeToString()


EDGE_VALUES: list[dict[str, object]] = [
    {"int_value": 0}, {"int_value": 1}, {"int_value": -1}, {"int_value": 127}, {"int_value": 128},
    {"int_value": 2**63 - 1}, {"int_value": -2**63}, {"int_value": 1_700_000_000_123_456_789},
    {"bool_value": True}, {"bool_value": False},
    {"string_value": ""}, {"string_value": "grpc"}, {"string_value": 'quote " back \\ nl \n tab \t \x01 \x7f'},
    {"string_value": "größe ✓ 日本"}, {"string_value": "x" * 125}, {"string_value": "x" * 126},
    {"string_value": "y" * 300},
    {"double_value": 0.25}, {"double_value": 1e16}, {"double_value": 1e-7}, {"double_value": float("nan")},
    {"double_value": float("-inf")}, {"bytes_value": b"\x00\xffzoomer"},
    {"array_value": ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="x")])},
    {"kvlist_value": KeyValueList(values=[KeyValue(key="k", value=AnyValue(bool_value=False))])},
    {},
]


@pytest.mark.parametrize("value", EDGE_VALUES, ids=lambda v: next(iter(v), "empty"))
def test_each_value_kind_gives_the_official_json(value: dict[str, object]) -> None:
    raws = [_kv("rpc.method", string_value="ranker.Ranker/Rank"), _kv("v", **value), _kv("k" * 130, **value)]
    expected = _reference_json(raws)
    assert decode.attributes_json(raws) == expected
    assert decode.attributes_json(raws) == expected  # now from the cache


def test_hand_made_wire_forms_decode_like_the_official_parser() -> None:
    """Encodings the official encoder never writes but must accept: a non-minimal varint, a 10-byte
    negative int, a bool written as 2, the value field before the key, the key repeated."""
    raws = [
        b"\x0a\x01a\x12\x03\x18\x80\x00",  # int 0 as two bytes
        b"\x0a\x01b\x12\x0b\x18" + b"\xff" * 9 + b"\x01",  # int -1
        b"\x0a\x01c\x12\x02\x10\x02",  # bool true written as 2
        b"\x12\x03\x18\x96\x01\x0a\x01d",  # value before key: int 150
        b"\x0a\x01x\x0a\x01e\x12\x02\x18\x05",  # key 'x' then key 'e' (last wins)
    ]
    assert decode.attributes_json(raws) == _reference_json(raws) == '{"a":0,"b":-1,"c":true,"d":150,"e":5}'


def test_random_attribute_lists_match_including_repeated_keys() -> None:
    rng = random.Random(5)
    keys = ["rpc.method", "server.port", "network.peer.port", "ok", "größe", "zoomer.request.cpu_time_ns"]
    for _ in range(300):
        raws = []
        for _ in range(rng.randint(0, 8)):
            pick = rng.random()
            if pick < 0.4:
                value: dict[str, object] = {"int_value": rng.randint(-2**63, 2**63 - 1) >> rng.randint(0, 63)}
            elif pick < 0.7:
                value = {"string_value": "".join(rng.choice('ab"\\\n✓é') for _ in range(rng.randint(0, 140)))}
            elif pick < 0.8:
                value = {"bool_value": rng.random() < 0.5}
            else:
                value = {"double_value": rng.uniform(-1e20, 1e20)}
            raws.append(_kv(rng.choice(keys), **value))
        assert decode.attributes_json(raws) == _reference_json(raws)


def test_span_rows_store_the_official_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole request through parse_traces equals the same request given as official messages (the
    OTLP/JSON path), and the cache, emptied when full, changes nothing."""
    monkeypatch.setattr(decode, "_ATTR_CACHE_MAX", 16)
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name", value=AnyValue(string_value="ranker"))
    spans = rs.scope_spans.add().spans
    for i in range(50):
        spans.add(trace_id=bytes(15) + b"\x01", span_id=(i + 1).to_bytes(8, "big"), name="Rank",
                  kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=10, end_time_unix_nano=30 + i,
                  attributes=[KeyValue(key="n", value=AnyValue(int_value=i)),
                              KeyValue(key="rpc.system.name", value=AnyValue(string_value="grpc"))])
    fast = decode.span_rows(decode.parse_traces(request.SerializeToString()), 7).rows
    assert fast == decode.span_rows(request, 7).rows
    assert [json.loads(row[13]) for row in fast[:2]] == [{"n": 0, "rpc.system.name": "grpc"},
                                                         {"n": 1, "rpc.system.name": "grpc"}]
    assert len(decode._attr_cache) <= 16


def test_unique_values_stay_out_of_the_cache() -> None:
    """Large ints (ns, ids) and long values are decoded every time; counts, ports and short strings are kept."""
    kept = [_kv("server.port", int_value=50051), _kv("rpc.method", string_value="ranker.Ranker/Rank")]
    fresh = [_kv("zoomer.request.cpu_time_ns", int_value=1_234_567), _kv("big", string_value="z" * 300),
             _kv("neg", int_value=-3)]
    assert json.loads(decode.attributes_json(kept + fresh)) == {
        "server.port": 50051, "rpc.method": "ranker.Ranker/Rank", "zoomer.request.cpu_time_ns": 1_234_567,
        "big": "z" * 300, "neg": -3}
    assert all(raw in decode._attr_cache for raw in kept)
    assert not any(raw in decode._attr_cache for raw in fresh)


@pytest.mark.parametrize("raw", [
    b"\x0a\x02\xff\xfe\x12\x02\x18\x01",  # key is not UTF-8
    b"\x0a\x01k\x12\x04\x0a\x02\xc3\x28",  # string value is not UTF-8
    b"\x0a\x01k\x12\x05\x18\xff\xff",  # truncated varint inside the declared length
])
def test_malformed_attribute_is_an_invalid_request(tmp_path: Path, raw: bytes) -> None:
    with pytest.raises(DecodeError):
        decode.attributes_json([raw])
    span = (b"\x0a\x10" + bytes(15) + b"\x01" + b"\x12\x08" + bytes(7) + b"\x01"
            + b"\x4a" + bytes((len(raw),)) + raw)
    scope_spans = b"\x12" + bytes((len(span),)) + span
    payload = b"\x0a" + bytes((len(scope_spans) + 2,)) + b"\x12" + bytes((len(scope_spans),)) + scope_spans
    store = Store(tmp_path / "s.duckdb")
    try:
        result = Ingestor(store).ingest_bytes(Signal.TRACES, payload)
    finally:
        stats = store.close()
    assert result.outcome is Outcome.INVALID and "DecodeError" in result.message
    assert stats.accepted == 0


@pytest.mark.slow
def test_flush_does_not_wait_out_the_linger(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb", StoreConfig(batch_rows=1000, linger_s=600.0))
    try:
        row = ("ab" * 16, "cd" * 8, None, "n", "SERVER", 1, 2, 1, "UNSET", "", "svc", None, "scope", "{}", "{}",
               "[]", "[]", 3)
        assert store.submit("spans", [row])
        assert store.flush(timeout_s=60.0)  # the writer would sit 600 s on a 1-row batch otherwise
        assert store.stats().written == 1
    finally:
        store.close()


def _span_row(name: str, attributes: str = "{}") -> tuple[object, ...]:
    return ("ab" * 16, "cd" * 8, None, name, "SERVER", 1, 2, 1, "UNSET", "", "svc", None, "scope", attributes,
            "{}", "[]", "[]", 3)


@pytest.mark.slow
def test_write_returns_once_committed_and_reports_refused_rows(tmp_path: Path) -> None:
    """C17: Store.write answers after the commit (its rows are counted written when it returns); a row DuckDB
    refuses (invalid JSON) is reported to that writer as failed, its neighbours are written."""
    store = Store(tmp_path / "s.duckdb")
    try:
        good = store.write("spans", [_span_row(f"g{i}") for i in range(3)])
        assert good == WriteResult(WriteStatus.COMMITTED) and store.stats().written == 3
        mixed = store.write("spans", [_span_row("a"), _span_row("bad", "{not json"), _span_row("b")])
        assert mixed.status is WriteStatus.COMMITTED and mixed.failed == 1 and "JSON" in mixed.error
        stats = store.stats()
        assert (stats.written, stats.failed, stats.queued) == (5, 1, 0)
    finally:
        store.close()
    store.close()
    assert store.write("spans", [_span_row("late")]).status is WriteStatus.REFUSED
