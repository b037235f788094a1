"""The report over a store filled through real OTLP (OpenTelemetry SDK -> EmbeddedCollector)."""

from __future__ import annotations

import argparse
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from _collector_fixtures import TRACE_EXPORT, raw_trace_request, running_collector, tracer_provider
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from rich.console import Console

from zoomer_serve.report import build_report, render_report
from zoomer_serve.report import cli as report_cli
from zoomer_serve.report.build import MIN_RATE_WINDOW_S

T0 = 1_800_000_000_000_000_000  # ns
PHASES = {"preprocess": 0.2, "forward": 0.6, "postprocess": 0.1}  # fraction of each request's duration


@dataclass
class Expected:
    """What the test sent, per (service, method)."""

    durations_ns: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    windows: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    statuses: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    phase_ns: dict[tuple[str, str], dict[str, list[int]]] = field(default_factory=dict)
    traces: list[tuple[int, str, str, str]] = field(default_factory=list)  # (duration, trace id, method, status)

    def add(self, service: str, method: str, start: int, duration: int, status: str, error: bool,
            trace_id: str) -> None:
        key = (service, method)
        self.durations_ns.setdefault(key, []).append(duration)
        lo, hi = self.windows.get(key, (start, start + duration))
        self.windows[key] = (min(lo, start), max(hi, start + duration))
        counts = self.statuses.setdefault(key, {})
        counts[status] = counts.get(status, 0) + 1
        self.errors[key] = self.errors.get(key, 0) + int(error)
        self.traces.append((duration, trace_id, method, status))


def _request(tracer: trace.Tracer, exp: Expected, service: str, method: str, start: int, duration: int,
             rpc_status: str | None, span_error: bool, with_method_attr: bool = True,
             phases: bool = True) -> None:
    attrs = {"rpc.system": "grpc"}
    if with_method_attr:
        attrs["rpc.method"] = method
    if rpc_status is not None:
        attrs["rpc.response.status_code"] = rpc_status
    span = tracer.start_span(f"zoomer.demo.v1.Ranker/{method}" if with_method_attr else method,
                             kind=SpanKind.SERVER, attributes=attrs, start_time=start)
    ctx = trace.set_span_in_context(span)
    offset = start
    for phase, fraction in PHASES.items():
        if not phases:
            break
        length = int(duration * fraction)
        tracer.start_span(phase, context=ctx, attributes={"zoomer.phase": phase}, start_time=offset).end(
            end_time=offset + length)
        exp.phase_ns.setdefault((service, method), {}).setdefault(phase, []).append(length)
        offset += length
    if span_error:
        span.set_status(Status(StatusCode.ERROR, "failed"))
    span.end(end_time=start + duration)
    label = rpc_status if rpc_status is not None else ("ERROR" if span_error else "UNSET")
    # an error is what the instrumentation marked so (span status ERROR), not any status code but OK
    exp.add(service, method, start, duration, label, span_error, format(span.get_span_context().trace_id, "032x"))


def _noise(tracer: trace.Tracer) -> None:
    """Spans that are not requests: a CLIENT span with a phase-tagged child; must not be counted."""
    client = tracer.start_span("downstream", kind=SpanKind.CLIENT, start_time=T0)
    tracer.start_span("tokenize", context=trace.set_span_in_context(client),
                      attributes={"zoomer.phase": "preprocess"}, start_time=T0).end(end_time=T0 + 5)
    client.end(end_time=T0 + 10)


@pytest.fixture(scope="module")
def filled_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Expected]:
    tmp = tmp_path_factory.mktemp("report")
    exp = Expected()
    rng = random.Random(7)
    with running_collector(tmp) as collector:
        ranker = tracer_provider(collector, "grpc", service="ranker")
        tracer = ranker.get_tracer("test")
        used: set[int] = set()

        def unique_duration(lo_ms: float, hi_ms: float) -> int:
            while True:
                d = int(rng.uniform(lo_ms, hi_ms) * 1_000_000)
                if d not in used:
                    used.add(d)
                    return d

        for i in range(40):  # Predict: 36 OK, 3 INVALID_ARGUMENT, 1 INTERNAL with span status ERROR
            rpc_status = "OK" if i % 10 else ("INVALID_ARGUMENT" if i < 30 else "INTERNAL")
            _request(tracer, exp, "ranker", "Predict", T0 + i * 25_000_000, unique_duration(2, 40),
                     rpc_status, span_error=rpc_status == "INTERNAL")
        for i in range(15):  # Rank: no rpc.method attribute (name fallback), one span-level error
            _request(tracer, exp, "ranker", "Rank", T0 + 7_000_000 + i * 50_000_000, unique_duration(1, 5),
                     None, span_error=i == 4, with_method_attr=False, phases=False)
        _noise(tracer)
        ranker.shutdown()
        embedder = tracer_provider(collector, "http", service="embedder")
        for i in range(5):
            _request(embedder.get_tracer("test"), exp, "embedder", "Predict", T0 + i * 100_000_000,
                     unique_duration(50, 60), "OK", span_error=False)
        embedder.shutdown()
        # The same export delivered twice (a client retry) must be counted once.
        dup = raw_trace_request(1, service="dup").SerializeToString()
        with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
            call = channel.unary_unary(TRACE_EXPORT, request_serializer=None, response_deserializer=None)
            call(dup, timeout=10)
            call(dup, timeout=10)
        exp.add("dup", "raw-0", 1_700_000_000_000_000_000, 1_000_000, "UNSET", False,
                raw_trace_request_trace_id(dup))
        stats = collector.stop()
    assert stats["spans_received"] == 40 * 4 + 15 + 2 + 5 * 4 + 2
    return collector.store_path, exp


def raw_trace_request_trace_id(payload: bytes) -> str:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    return ExportTraceServiceRequest.FromString(payload).resource_spans[0].scope_spans[0].spans[0].trace_id.hex()


def test_per_method_counts_rates_errors_and_percentiles(filled_store: tuple[Path, Expected]) -> None:
    store, exp = filled_store
    report = build_report(store)
    assert [(m.service_name, m.method) for m in report.methods] == [
        ("dup", "raw-0"), ("embedder", "Predict"), ("ranker", "Predict"), ("ranker", "Rank")]
    assert report.total_requests == 40 + 15 + 5 + 1
    assert report.total_errors == 1 + 1  # span status ERROR: Predict's INTERNAL, Rank's one; not INVALID_ARGUMENT
    for m in report.methods:
        key = (m.service_name, m.method)
        durations = np.array(exp.durations_ns[key], dtype=np.float64)
        assert m.count == len(durations)
        assert m.status_counts == exp.statuses[key]
        assert m.error_count == exp.errors[key]
        assert m.error_rate == pytest.approx(exp.errors[key] / len(durations))
        p50, p90, p99 = np.percentile(durations, [50, 90, 99]) / 1e6
        assert (m.p50_ms, m.p90_ms, m.p99_ms) == pytest.approx((p50, p90, p99), rel=1e-9)
        assert m.max_ms == pytest.approx(durations.max() / 1e6)
        assert m.mean_ms == pytest.approx(durations.mean() / 1e6)
        lo, hi = exp.windows[key]
        window_s = (hi - lo) / 1e9  # a rate only over at least MIN_RATE_WINDOW_S (1 s)
        assert m.rate_per_s == (pytest.approx(len(durations) / window_s) if window_s >= MIN_RATE_WINDOW_S else None)
    assert next(m for m in report.methods if m.service_name == "dup").rate_per_s is None  # one request, 1 ms
    predict = next(m for m in report.methods if m.method == "Predict" and m.service_name == "ranker")
    assert predict.status_counts == {"OK": 36, "INVALID_ARGUMENT": 3, "INTERNAL": 1}
    assert (predict.error_count, predict.error_rate) == (1, pytest.approx(0.025))  # INTERNAL, ERROR; 3 UNSET
    rank = next(m for m in report.methods if m.method == "Rank")
    assert rank.status_counts == {"UNSET": 14, "ERROR": 1} and rank.phases == []
    assert rank.unattributed_share is None


def test_phase_shares(filled_store: tuple[Path, Expected]) -> None:
    store, exp = filled_store
    report = build_report(store)
    for m in report.methods:
        key = (m.service_name, m.method)
        if key not in exp.phase_ns:
            continue
        total_request_ns = sum(exp.durations_ns[key])
        assert [p.phase for p in m.phases] == ["forward", "preprocess", "postprocess"]  # largest share first
        for p in m.phases:
            lengths = exp.phase_ns[key][p.phase]
            assert p.count == len(lengths)
            assert p.share == pytest.approx(sum(lengths) / total_request_ns, rel=1e-9)
            assert p.mean_ms == pytest.approx(np.mean(lengths) / 1e6)
            assert p.share == pytest.approx(PHASES[p.phase], abs=1e-6)
        assert m.unattributed_share == pytest.approx(0.1, abs=1e-6)


def test_slowest_traces_in_order(filled_store: tuple[Path, Expected]) -> None:
    store, exp = filled_store
    report = build_report(store, slowest=7)
    expected = sorted(exp.traces, reverse=True)[:7]
    assert [(t.trace_id, t.method, t.status) for t in report.slowest] == [(e[1], e[2], e[3]) for e in expected]
    assert [t.duration_ms for t in report.slowest] == pytest.approx([e[0] / 1e6 for e in expected])
    assert report.slowest[0].service_name == "embedder"
    assert build_report(store, slowest=0).slowest == []


def _report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    report_cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_cli_json_matches_build_report(filled_store: tuple[Path, Expected],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    store, _ = filled_store
    args = _report_parser().parse_args(["report", "--store", str(store), "--json", "--slowest", "3"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(json.dumps(build_report(store, slowest=3).to_dict()))
    assert out["total_requests"] == 61 and len(out["slowest"]) == 3
    assert out["methods"][2]["phases"][0]["phase"] == "forward"


def test_rendered_tables(filled_store: tuple[Path, Expected]) -> None:
    store, _ = filled_store
    buffer = io.StringIO()
    render_report(build_report(store, slowest=3), Console(file=buffer, width=250, color_system=None))
    text = buffer.getvalue()
    assert "61 requests, 2 errors" in text
    for needle in ("Predict", "Rank", "INVALID_ARGUMENT 3", "forward", "60.0%", "(outside phases)",
                   "Slowest 3 traces", "2.5%", "errors: span status ERROR"):
        assert needle in text, needle


def test_cli_missing_store_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope" / "zoomer.duckdb"
    args = _report_parser().parse_args(["report", "--store", str(missing)])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert str(missing) in captured.err and "Traceback" not in captured.err and captured.out == ""


def test_cli_not_a_store_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "bogus.duckdb"
    bogus.write_bytes(b"this is not a duckdb file" * 100)
    args = _report_parser().parse_args(["report", "--store", str(bogus), "--json"])
    assert args.func(args) == 2
    assert str(bogus) in capsys.readouterr().err


def test_cli_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_collector(tmp_path) as collector:
        pass
    parser = _report_parser()
    args = parser.parse_args(["report", "--store", str(collector.store_path)])
    assert args.func(args) == 0
    assert "no requests recorded" in capsys.readouterr().out
    args = parser.parse_args(["report", "--store", str(collector.store_path), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_requests"] == 0 and out["methods"] == [] and out["slowest"] == []


def test_span_names_are_not_rich_markup(tmp_path: Path) -> None:
    req = raw_trace_request(1, service="[bold]svc")
    req.resource_spans[0].scope_spans[0].spans[0].name = "[/]odd[red]"
    with running_collector(tmp_path) as collector:
        with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
            channel.unary_unary(TRACE_EXPORT, request_serializer=None, response_deserializer=None)(
                req.SerializeToString(), timeout=10)
    buffer = io.StringIO()
    render_report(build_report(collector.store_path), Console(file=buffer, width=200, color_system=None))
    assert "[/]odd[red]" in buffer.getvalue() and "[bold]svc" in buffer.getvalue()


def test_methods_of_the_older_rpc_conventions_keep_their_service(tmp_path: Path) -> None:
    """Spans of other instrumentations that follow the older RPC conventions (``rpc.service`` = ``pkg.A``,
    ``rpc.method`` = ``Get``) were grouped by ``rpc.method`` alone: ``pkg.A/Get`` (10 ms) and ``pkg.B/Get``
    (500 ms) made one row with a p50 of 255 ms. Each is its own row, in the report and in ``analyze``."""
    from zoomer_serve.analysis.store import load_store, request_percentiles

    with running_collector(tmp_path) as collector:
        provider = tracer_provider(collector, "http", service="other-instr")
        tracer = provider.get_tracer("t")
        t0 = 1_700_000_000_000_000_000
        for i in range(20):
            for service, ms in (("pkg.A", 10), ("pkg.B", 500)):
                start = t0 + i * 10**9
                span = tracer.start_span(f"{service}/Get", kind=SpanKind.SERVER, start_time=start,
                                         attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": "Get"})
                span.end(end_time=start + ms * 1_000_000)
        provider.shutdown()
    methods = {m.method: m for m in build_report(collector.store_path).methods}
    assert set(methods) == {"pkg.A/Get", "pkg.B/Get"}
    assert methods["pkg.A/Get"].count == 20 and methods["pkg.B/Get"].p50_ms == pytest.approx(500.0)
    rows = {r["method"]: r for r in request_percentiles(load_store(collector.store_path)).rows()}
    assert set(rows) == {"pkg.A/Get", "pkg.B/Get"} and rows["pkg.A/Get"]["p50_ms"] == pytest.approx(10.0)
