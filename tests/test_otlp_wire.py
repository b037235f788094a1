"""The hand-written OTLP encoder produces messages that the official protobuf classes parse back exactly."""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from zoomer_serve.export.otlp_wire import SpanEncoder, encode_any_value
from zoomer_serve.recording import records as r


def _record(**over):
    rec = [0] * 17
    rec[r.R_TRACE_ID] = 0x0123456789ABCDEF0123456789ABCDEF
    rec[r.R_SPAN_ID] = 0x1122334455667788
    rec[r.R_PARENT_ID] = 0x99AABBCCDDEEFF00
    rec[r.R_PARENT_REMOTE] = True
    rec[r.R_TRACE_FLAGS] = 1
    rec[r.R_TRACE_STATE] = "vendor=x"
    rec[r.R_NAME] = "pkg.Svc/Method"
    rec[r.R_KIND] = r.KIND_SERVER
    rec[r.R_START_NS] = 1_700_000_000_000_000_000
    rec[r.R_END_NS] = 1_700_000_000_002_500_000
    rec[r.R_STATUS] = r.STATUS_ERROR
    rec[r.R_STATUS_MSG] = "boom"
    rec[r.R_ATTRS] = {"rpc.method": "pkg.Svc/Method", "server.port": 50051, "neg": -5, "ratio": 0.25,
                      "ok": True, "list": ["a", "b"], "ints": [1, 2], "none": None}
    rec[r.R_EVENTS] = [(1_700_000_000_001_000_000, "exception", {"exception.type": "ValueError"})]
    rec[r.R_LINKS] = [(0xAB, 0xCD, {"k": "v"})]
    rec[r.R_CHILDREN] = None
    rec[r.R_FLAGS] = r.F_SAMPLED | r.F_REQUEST
    for key, value in over.items():
        rec[getattr(r, key)] = value
    return tuple(rec)


def _attrs(kvs):
    out = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        value = getattr(kv.value, which)
        if which == "array_value":
            value = [getattr(v, v.WhichOneof("value")) for v in value.values]
        out[kv.key] = value
    return out


def test_span_round_trips_through_official_messages():
    enc = SpanEncoder({"service.name": "svc", "process.pid": 42}, "zoomer_serve", "0.1.0")
    payload = enc.encode_request([enc.encode_span(_record()), enc.encode_span(_record(R_PARENT_ID=0))])
    req = ExportTraceServiceRequest.FromString(payload)
    rs = req.resource_spans[0]
    assert _attrs(rs.resource.attributes) == {"service.name": "svc", "process.pid": 42}
    assert rs.scope_spans[0].scope.name == "zoomer_serve"
    assert rs.scope_spans[0].scope.version == "0.1.0"
    first, second = rs.scope_spans[0].spans
    assert first.trace_id.hex() == "0123456789abcdef0123456789abcdef"
    assert first.span_id.hex() == "1122334455667788"
    assert first.parent_span_id.hex() == "99aabbccddeeff00"
    assert second.parent_span_id == b""
    assert first.trace_state == "vendor=x"
    assert first.name == "pkg.Svc/Method"
    assert first.kind == Span.SPAN_KIND_SERVER
    assert first.end_time_unix_nano - first.start_time_unix_nano == 2_500_000
    assert _attrs(first.attributes) == {"rpc.method": "pkg.Svc/Method", "server.port": 50051, "neg": -5,
                                        "ratio": 0.25, "ok": True, "list": ["a", "b"], "ints": [1, 2]}
    assert first.status.code == 2 and first.status.message == "boom"
    assert first.events[0].name == "exception"
    assert _attrs(first.events[0].attributes) == {"exception.type": "ValueError"}
    assert first.links[0].trace_id == (0xAB).to_bytes(16, "big")
    assert _attrs(first.links[0].attributes) == {"k": "v"}
    assert first.flags == 0x1 | 0x100 | 0x200  # sampled, has-is-remote, is-remote


def test_cached_attribute_encodings_stay_correct_across_spans():
    enc = SpanEncoder({}, "s", "v")
    spans = [enc.encode_span(_record(R_ATTRS={"code": c, "n": i})) for i, c in enumerate(["OK", "OK", "X"])]
    req = ExportTraceServiceRequest.FromString(enc.encode_request(spans))
    got = [_attrs(s.attributes) for s in req.resource_spans[0].scope_spans[0].spans]
    assert got == [{"code": "OK", "n": 0}, {"code": "OK", "n": 1}, {"code": "X", "n": 2}]


def test_any_value_of_unknown_type_is_its_string():
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    assert AnyValue.FromString(encode_any_value(object)).string_value == str(object)
    assert AnyValue.FromString(encode_any_value({"a": 1})).kvlist_value.values[0].value.int_value == 1


def test_numpy_scalars_are_their_python_values_and_numpy_is_never_imported_for_it():
    """np.float32 / np.int64 / np.bool_ (and np.uint64 past int64, np.str_) encode as the AnyValue of their
    ``.item()``; a scalar whose ``item()`` fails is its str(); encoding anything else imports no NumPy."""
    import subprocess
    import sys

    import numpy as np
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    def decoded(value):
        v = AnyValue.FromString(encode_any_value(value))
        return v.WhichOneof("value"), getattr(v, v.WhichOneof("value"))

    assert decoded(np.float32(0.5)) == ("double_value", 0.5)
    assert decoded(np.float16(1.5)) == ("double_value", 1.5)
    assert decoded(np.int64(-7)) == ("int_value", -7)
    assert decoded(np.uint8(200)) == ("int_value", 200)
    assert decoded(np.uint64(2**64 - 1)) == ("string_value", str(2**64 - 1))  # past int64, as a Python int
    assert decoded(np.bool_(True)) == ("bool_value", True) and decoded(np.bool_(False)) == ("bool_value", False)
    assert decoded(np.str_("x")) == ("string_value", "x")

    class Odd(np.float32):
        def item(self):
            raise RuntimeError("no")

    assert decoded(Odd(1.0)) == ("string_value", str(Odd(1.0)))
    script = ("import sys; from zoomer_serve.export.otlp_wire import encode_any_value; "
              "encode_any_value(object()); encode_any_value({'a': [1, 2.0, None]}); "
              "print('numpy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_int_attributes_round_trip_at_the_varint_edges_and_are_not_cached():
    """Large and negative int values take their own path (key prefix cached, value encoded fresh, not cached):
    every varint length, negative int64s and a key whose encoded form is long round-trip; bools stay bools."""
    values = [0, 1, 127, 128, 300, 16_383, 16_384, 2**31, 2**63 - 1, -1, -(2**63), 1_700_000_000_123_456_789]
    enc = SpanEncoder({}, "s", "v")
    long_key = "k" * 200
    spans = [enc.encode_span(_record(R_ATTRS={"n": v, long_key: v, "flag": v == 0})) for v in values]
    got = [_attrs(s.attributes) for s in
           ExportTraceServiceRequest.FromString(enc.encode_request(spans)).resource_spans[0].scope_spans[0].spans]
    assert got == [{"n": v, long_key: v, "flag": v == 0} for v in values]
    assert all(type(g["flag"]) is bool for g in got)
    cached_ints = {key[2] for key in enc._attr_cache if key[1] is int}
    assert cached_ints == {v for v in values if 0 <= v < 1 << 16}  # small ones (counts, sizes, ports) only


def test_equal_values_of_other_types_keep_their_own_encoding():
    """True == 1 == 1.0 in Python, so a cache keyed on (key, value) gave a later int the encoding of an earlier
    bool under the same key (found in review); each value keeps its type."""
    enc = SpanEncoder({}, "s", "v")
    values = [True, 1, 1.0, False, 0, 0.0, "1"]
    spans = [enc.encode_span(_record(R_ATTRS={"v": v})) for v in values]
    got = [_attrs(s.attributes)["v"] for s in
           ExportTraceServiceRequest.FromString(enc.encode_request(spans)).resource_spans[0].scope_spans[0].spans]
    assert [(type(g), g) for g in got] == [(type(v), v) for v in values]


def test_children_with_a_cached_shape_encode_like_encode_span():
    """encode_child caches what follows the timestamps per shape (name, string attributes, status, flags):
    children of several requests, shapes repeated and not, parse back the same as encode_span's."""
    enc, plain = SpanEncoder({}, "s", "v"), SpanEncoder({}, "s", "v")
    children = []
    for i in range(3):
        for name, attrs, status in [("preprocess", {"zoomer.phase": "preprocess"}, r.STATUS_UNSET),
                                    ("forward", {"zoomer.phase": "forward", "error.type": "OOM"}, r.STATUS_ERROR),
                                    ("count", {"zoomer.phase": "count", "n": i}, r.STATUS_UNSET),
                                    ("flag", {"zoomer.phase": "flag", "ok": bool(i)}, r.STATUS_UNSET),
                                    ("flag", {"zoomer.phase": "flag", "ok": i}, r.STATUS_UNSET)]:
            children.append(_record(R_TRACE_ID=i + 1, R_SPAN_ID=10 + i, R_NAME=name, R_KIND=r.KIND_INTERNAL,
                                    R_ATTRS=attrs, R_STATUS=status, R_STATUS_MSG=None, R_EVENTS=None,
                                    R_LINKS=None, R_TRACE_STATE=None, R_PARENT_REMOTE=False))
    cached = ExportTraceServiceRequest.FromString(enc.encode_request([enc.encode_child(c) for c in children]))
    fresh = ExportTraceServiceRequest.FromString(plain.encode_request([plain.encode_span(c) for c in children]))
    assert cached == fresh
    spans = cached.resource_spans[0].scope_spans[0].spans
    assert len(spans) == 15
    assert [type(_attrs(s.attributes)["ok"]) for s in spans if s.name == "flag"] == [bool, int] * 3


def test_phase_entries_encode_byte_for_byte_like_their_full_child_records():
    """encode_phase writes a phase entry from the entry and its record (cached name, kind and tail per name and
    trace flags): the same bytes as encode_span of the expanded child record, for sampled and unsampled trace
    flags, nested phases, a trace state (written by encode_span), a name over the cache's string limit, and a
    phase name cut by the attribute value length limit."""
    from zoomer_serve.config import SpanLimits

    for limits in (None, SpanLimits(attribute_value_length=4)):
        enc, plain = SpanEncoder({}, "s", "v", limits), SpanEncoder({}, "s", "v", limits)
        for i, (flags, state) in enumerate([(1, None), (0, None), (1, "vendor=x"), (1, None)]):
            rec = _record(R_TRACE_ID=(i + 1) << 70 | 7, R_TRACE_FLAGS=flags, R_TRACE_STATE=state,
                          R_PARENT_REMOTE=bool(i % 2))
            entries = [(10 + i, rec[r.R_SPAN_ID], "preprocess", 100, 200 + i),
                       (20 + i, 10 + i, "inner", 110, 150),
                       (30 + i, rec[r.R_SPAN_ID], "p" * 300, 300, 400)]
            for entry in entries * 2:  # the second time from the cache
                expected = plain.encode_span(r.child_record(rec, entry))
                assert enc.encode_phase(rec, entry) == expected
                span = Span.FromString(expected)
                assert (span.span_id, span.parent_span_id) == (entry[0].to_bytes(8, "big"), entry[1].to_bytes(8, "big"))
                assert (span.start_time_unix_nano, span.end_time_unix_nano) == (entry[3], entry[4])
                assert _attrs(span.attributes) == {"zoomer.phase": entry[2][:4] if limits else entry[2]}
    assert not any(name.startswith("ppp") for name, _ in enc._phase_cache)


def test_span_limits_cut_values_and_counts_and_say_how_much_in_the_dropped_fields():
    """C14: the OpenTelemetry span limits, applied when the span is encoded (off the request path): values cut to
    the length limit (strings, bytes, strings in arrays), attributes / events / links and their own attributes cut
    to the count limits, and what was cut counted in the OTLP ``dropped_*_count`` fields (a request span's own
    drops of events and links past the limit come in its record)."""
    from zoomer_serve.config import SpanLimits

    limits = SpanLimits(attribute_value_length=5, attribute_count=3, event_count=2, link_count=1,
                        event_attribute_count=1, link_attribute_count=1)
    enc = SpanEncoder({}, "zs", "1", limits)
    attrs = {"a": "abcdefgh", "b": b"0123456789", "c": ["xxxxxxx", "yy", 3], "d": 4, "e": "kept?",
             r.DROPPED_KEY: (4, 2)}
    events = [(1, f"e{i}", {"k1": "v" * 10, "k2": "w"}) for i in range(3)]
    links = [(0xAB, 0xCD, {"l1": "z" * 9, "l2": "q"}), (0xAB, 0xCE, None)]
    payload = enc.encode_request([enc.encode_span(_record(R_ATTRS=attrs, R_EVENTS=events, R_LINKS=links))])
    span = ExportTraceServiceRequest.FromString(payload).resource_spans[0].scope_spans[0].spans[0]
    assert _attrs(span.attributes) == {"a": "abcde", "b": b"01234", "c": ["xxxxx", "yy", 3]}
    assert span.dropped_attributes_count == 2
    assert [e.name for e in span.events] == ["e0", "e1"] and span.dropped_events_count == 4 + 1
    assert _attrs(span.events[0].attributes) == {"k1": "vvvvv"} and span.events[0].dropped_attributes_count == 1
    assert len(span.links) == 1 and span.dropped_links_count == 2 + 1
    assert _attrs(span.links[0].attributes) == {"l1": "zzzzz"} and span.links[0].dropped_attributes_count == 1


def test_long_strings_are_not_kept_in_the_encoding_cache():
    """C14: the encoder's cache is bounded by entries and by bytes: a burst of unique 1 MB strings (exception
    messages, payload dumps) is encoded each time, never kept."""
    from zoomer_serve.export import otlp_wire

    enc = SpanEncoder({}, "zs", "1")
    for i in range(20):
        enc.encode_span(_record(R_ATTRS={"blob": f"{i}" + "x" * 1_000_000}))
    assert sum(len(v) for v in enc._attr_cache.values()) < 100 * otlp_wire._MAX_CACHED_STR


def test_ints_outside_int64_travel_as_their_decimal_string_and_the_request_stays_valid():
    """``set_attribute("my.bigint", 2**70)`` wrote a varint that no int64 reader accepts: the collector refused the
    whole export ("Wire format was corrupt") and every other span of the request was lost; 2**63 wrapped to
    -2**63. An int outside int64 (in a list, an event or a key-value list too) is its decimal string now."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    big = [2**63, 2**64 - 1, 2**70, -(2**63) - 1, -(2**100)]
    enc = SpanEncoder({}, "s", "v")
    spans = [enc.encode_span(_record(R_ATTRS={"n": v, "in_list": [1, v]},
                                     R_EVENTS=[(1, "e", {"n": v})])) for v in big]
    spans.append(enc.encode_span(_record(R_ATTRS={"n": 2**63 - 1})))
    parsed = ExportTraceServiceRequest.FromString(enc.encode_request(spans)).resource_spans[0].scope_spans[0].spans
    assert [_attrs(s.attributes)["n"] for s in parsed] == [str(v) for v in big] + [2**63 - 1]
    assert [_attrs(s.attributes)["in_list"] for s in parsed[:-1]] == [[1, str(v)] for v in big]
    assert [s.events[0].attributes[0].value.string_value for s in parsed[:-1]] == [str(v) for v in big]
    assert AnyValue.FromString(encode_any_value({"k": 2**64})).kvlist_value.values[0].value.string_value == str(2**64)


def test_keys_and_names_that_are_not_strings_are_their_str_not_a_lost_record():
    """``set_attribute(1, "v")``, ``phase(123)``, an event attribute keyed by an int: the encoder raised and the
    record was lost with all its phases. Their ``str()`` is used, as for values of unknown types (event names and
    status messages too)."""
    enc = SpanEncoder({}, "s", "v")
    rec = _record(R_ATTRS={1: "v", None: "w", ("t",): 2**20, "ok": "x"}, R_NAME=123,
                  R_EVENTS=[(1, "e", {7: "x"}), (2, 404, None)], R_STATUS_MSG=ValueError("boom"))
    span = ExportTraceServiceRequest.FromString(enc.encode_request([enc.encode_span(rec)])) \
        .resource_spans[0].scope_spans[0].spans[0]
    assert span.name == "123"
    assert _attrs(span.attributes) == {"1": "v", "None": "w", "('t',)": 2**20, "ok": "x"}
    assert span.events[0].attributes[0].key == "7" and span.events[1].name == "404"
    assert span.status.message == "boom"


def test_records_of_other_scopes_go_in_their_own_scope_spans_within_the_request_bound():
    """A record with ``R_SCOPE`` (a span made with the OpenTelemetry API) is written in a ``ScopeSpans`` of its own
    scope, beside zoomer-serve's; a link's trace state and flags travel; the request stays within
    ``request_overhead`` plus ``request_bytes`` of each span."""
    from zoomer_serve.export.otlp_wire import request_bytes

    encoder = SpanEncoder({"service.name": "svc"}, "zoomer_serve", "1")
    link = (0xAB, 0xCD, {"k": "v"}, "vendor=y", 0x301)
    user = _record(R_LINKS=[link]) + (("lib.user", "2.0", "https://opentelemetry.io/schemas/1.26.0", {"a": 1}),)
    plain = _record(R_SPAN_ID=7)
    spans = [encoder.scoped(encoder.encode_span(rec), rec) for rec in (plain, user, user, plain)]
    assert [type(s) is bytes for s in spans] == [True, False, False, True]
    payload = encoder.encode_request(spans)
    assert len(payload) <= encoder.request_overhead + sum(map(request_bytes, spans))
    (rs,) = ExportTraceServiceRequest.FromString(payload).resource_spans
    by_scope = {ss.scope.name: ss for ss in rs.scope_spans}
    assert set(by_scope) == {"zoomer_serve", "lib.user"}
    assert len(by_scope["zoomer_serve"].spans) == 2 and len(by_scope["lib.user"].spans) == 2
    user_scope = by_scope["lib.user"]
    assert user_scope.scope.version == "2.0" and _attrs(user_scope.scope.attributes) == {"a": 1}
    assert user_scope.schema_url == "https://opentelemetry.io/schemas/1.26.0"
    (got,) = user_scope.spans[0].links
    assert (got.trace_state, got.flags, _attrs(got.attributes)) == ("vendor=y", 0x301, {"k": "v"})
    only_user = ExportTraceServiceRequest.FromString(encoder.encode_request(spans[1:3])).resource_spans[0]
    assert [ss.scope.name for ss in only_user.scope_spans] == ["lib.user"]
