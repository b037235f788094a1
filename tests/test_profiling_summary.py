"""Pieces of kernel profiling that need no server: the request label, the per-request kernel summary on real
Kineto traces from A100 and V100 GPUs, session bounds and admin access rules, the generated gRPC code."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from zoomer_serve.cli import main as cli_main
from zoomer_serve.config import ConfigError
from zoomer_serve.profiling import (
    REQUEST_LABEL_PREFIX,
    AdminConfig,
    SessionOptions,
    load_trace,
    parse_request_label,
    request_label,
    summarize_events,
)
from zoomer_serve.profiling.admin import check_access, is_loopback_peer
from zoomer_serve.profiling.client import ProfilerClient
from zoomer_serve.profiling.config import MAX_DURATION_MS_CAP, MAX_REQUESTS_CAP, check_trigger
from zoomer_serve.profiling.stats import coefficient_of_variation, percentile

KINETO = Path("/work/shared/data/kineto")
if not KINETO.is_dir():
    KINETO = Path(__file__).resolve().parents[1] / "shared" / "data" / "kineto"
needs_traces = pytest.mark.skipif(not (KINETO / "a100_alexnet_inference.json.gz").is_file(),
                                  reason="shared Kineto sample traces not present")


def test_request_label_format_and_round_trip() -> None:
    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7
    label = request_label(trace_id, span_id)
    assert label == "zoomer.request/0af7651916cd43dd8448eb211c80319c/00f067aa0ba902b7"
    assert label.startswith(REQUEST_LABEL_PREFIX)
    assert parse_request_label(label) == (trace_id, span_id)
    for other in ("forward", "zoomer.request/xyz/00f067aa0ba902b7", label.upper(), label + "/extra",
                  "zoomer.request/0af7651916cd43dd8448eb211c80319c/00f067aa0ba902b"):
        assert parse_request_label(other) is None


def test_request_label_agrees_with_the_analysis_reader() -> None:
    analysis = pytest.importorskip("zoomer_serve.analysis.labels")
    trace_id, span_id = 0xA1B2C3D4E5F60718293A4B5C6D7E8F90, 0x1122334455667788
    assert analysis.REQUEST_LABEL_PREFIX == REQUEST_LABEL_PREFIX
    assert analysis.request_label(trace_id, span_id) == request_label(trace_id, span_id)
    assert analysis.parse_request_label(request_label(trace_id, span_id)) == (f"{trace_id:032x}", f"{span_id:016x}")


@needs_traces
def test_summary_of_a100_inference_attributes_every_kernel_to_its_forward_pass() -> None:
    data = load_trace(KINETO / "a100_alexnet_inference.json.gz")
    events = data["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    memcpy = [e for e in events if e.get("cat") == "gpu_memcpy"]
    summary = summarize_events(events, key_of=lambda name: name if name.endswith("|forward]") else None)
    assert summary.totals.kernel_count == len(kernels) == 79
    assert summary.totals.kernel_time_us == pytest.approx(sum(e["dur"] for e in kernels))
    assert summary.totals.memcpy_count == len(memcpy) == 16
    assert summary.totals.memcpy_bytes == sum(e["args"]["bytes"] for e in memcpy)
    assert summary.attributed_share == 1.0
    warmup, measure = (summary.requests[k] for k in ("[param|pytorch.model.alex_net|0|0|0|warmup|forward]",
                                                      "[param|pytorch.model.alex_net|0|0|0|measure|forward]"))
    assert warmup.kernel_count + measure.kernel_count == 79
    # the same network twice; the warm-up pass also draws its random input on the GPU
    extra = {name: stat.count for name, stat in warmup.kernels.items() if name not in measure.kernels}
    assert len(extra) == 1 and next(iter(extra)).startswith("void at::native::(anonymous namespace)::distribution")
    assert warmup.kernel_count - measure.kernel_count == sum(extra.values())
    for req in (warmup, measure):
        assert req.cpu_op_count > 0 and req.cuda_runtime_count >= req.kernel_count
        assert req.kernel_time_us == pytest.approx(sum(k.time_us for k in req.kernels.values()))
        top = req.top_kernels(3)
        assert [k.time_us for k in top] == sorted((k.time_us for k in top), reverse=True)


@needs_traces
@pytest.mark.slow
def test_summary_of_v100_training_steps_is_the_same_for_each_repeated_step() -> None:
    data = load_trace(KINETO / "v100_training_fwdbwd.json.gz")
    summary = summarize_events(data["traceEvents"], key_of=lambda n: n if n.startswith("ProfilerStep#") else None)
    steps = list(summary.requests.values())
    assert len(steps) >= 3
    assert len({s.kernel_count for s in steps}) == 1 and steps[0].kernel_count > 100
    assert len({s.memcpy_bytes for s in steps}) == 1 and steps[0].memcpy_bytes > 0
    # backward kernels are launched from the autograd thread, outside the ProfilerStep ranges
    assert 0 < summary.attributed_share < 1
    assert summary.attributed.kernel_count == sum(s.kernel_count for s in steps)
    assert summary.attributed.kernel_time_us == pytest.approx(sum(s.kernel_time_us for s in steps))


def _ev(cat: str, name: str, ts: float, dur: float, pid: Any = 1, tid: Any = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def test_summary_attribution_rules() -> None:
    a, b = request_label(1, 1), request_label(2, 2)
    events = [
        _ev("user_annotation", a, 0, 100),
        _ev("cpu_op", "aten::mm", 10, 20, **{"External id": 7}),
        _ev("cuda_runtime", "cudaLaunchKernel", 12, 5, correlation=70),
        _ev("kernel", "gemm", 40, 30, pid=0, tid=7, correlation=70),
        # a launch whose thread Kineto could not name: found through the kernel's External id
        _ev("cuda_runtime", "cudaLaunchKernel", 15, 4, tid=-99, correlation=71),
        _ev("kernel", "relu", 80, 10, pid=0, tid=7, correlation=999, **{"External id": 7}),
        _ev("gpu_memcpy", "Memcpy HtoD", 90, 2, pid=0, tid=7, correlation=70, bytes=4096),
        # same thread, after the range: not the request's
        _ev("cuda_runtime", "cudaLaunchKernel", 150, 5, correlation=72),
        _ev("kernel", "late", 160, 50, pid=0, tid=7, correlation=72),
        # a range still open when the profiler stopped is not a request
        {**_ev("user_annotation", b, 200, 300), "args": {"finished": False}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "worker"}},
    ]
    summary = summarize_events(events)
    assert set(summary.requests) == {(1, 1)} and summary.unfinished_requests == 1
    req = summary.requests[(1, 1)]
    assert (req.kernel_count, req.kernel_time_us) == (2, 40.0)
    assert (req.memcpy_count, req.memcpy_bytes, req.memcpy_time_us) == (1, 4096, 2.0)
    assert (req.cuda_runtime_count, req.cuda_runtime_time_us, req.cpu_op_count) == (1, 5.0, 1)
    assert [k.name for k in req.top_kernels(5)] == ["gemm", "relu"]
    assert summary.totals.kernel_time_us == 90.0 and summary.attributed_share == pytest.approx(40 / 90)
    assert summary.event_count == 10


def test_summary_of_a_request_with_ranges_on_several_threads() -> None:
    """A request whose work ran in executor threads has a range on each (its phases open them): every thread's
    operators and launches are its, and its time counts the overlap of its ranges once."""
    a = request_label(1, 1)
    events = [
        _ev("user_annotation", a, 0, 100, tid=1),  # the event loop's thread: the whole request
        _ev("user_annotation", a, 10, 30, tid=2),  # executor thread 2, inside it
        _ev("user_annotation", a, 50, 80, tid=3),  # executor thread 3, past its end: 100 to 130 adds 30
        _ev("user_annotation", a, 200, 10, tid=2),  # a later, separate range of the same request: adds 10
        _ev("cpu_op", "aten::mm", 12, 5, tid=2),
        _ev("cuda_runtime", "cudaLaunchKernel", 14, 2, tid=2, correlation=1),
        _ev("kernel", "gemm", 40, 20, pid=0, tid=7, correlation=1),
        _ev("cpu_op", "aten::relu", 120, 5, tid=3),
        _ev("cpu_op", "aten::add", 45, 1, tid=2),  # thread 2 between its ranges: not the request's
    ]
    # a request with one range keeps its duration exactly (epoch-µs timestamps lose bits in end - start)
    events.append(_ev("user_annotation", request_label(2, 2), 1.7e15 + 0.3, 123.4, tid=4))
    summary = summarize_events(events)
    req = summary.requests[(1, 1)]
    assert (req.start_us, req.duration_us) == (0.0, 140.0)
    assert summary.requests[(2, 2)].duration_us == 123.4
    assert (req.cpu_op_count, req.cuda_runtime_count, req.kernel_time_us) == (2, 1, 20.0)
    assert summary.attributed_share == 1.0


def test_postprocess_writes_the_gzip_trace_and_a_summary_that_reads_back(tmp_path: Path) -> None:
    from zoomer_serve.profiling.postprocess import EXIT_EMPTY, run
    from zoomer_serve.profiling.summary import summary_from_json

    events = [_ev("user_annotation", request_label(1, 2), 0, 100), _ev("cpu_op", "aten::mm", 5, 10),
              _ev("cuda_runtime", "cudaLaunchKernel", 6, 3, correlation=5),
              _ev("kernel", "gemm", 20, 30, pid=0, tid=7, correlation=5),
              _ev("cuda_runtime", "cudaLaunchKernel", 7, 3, correlation=6),
              _ev("kernel", "relu", 60, 5, pid=0, tid=7, correlation=6)]
    raw, packed, digest = tmp_path / "raw.json", tmp_path / "t.json.gz", tmp_path / "s.json"
    raw.write_text(json.dumps({"traceEvents": events}))
    assert run(raw, packed, digest, top_kernels=1) == 0
    assert gzip.decompress(packed.read_bytes()) == raw.read_bytes()
    back = summary_from_json(json.loads(digest.read_text()))
    req = back.requests[(1, 2)]
    assert (req.kernel_count, req.kernel_time_us, req.cuda_runtime_count, req.cpu_op_count) == (2, 35.0, 2, 1)
    assert [(k.name, k.count, k.time_us) for k in req.top_kernels(5)] == [("gemm", 1, 30.0)]  # top 1 kept
    assert back.attributed_share == 1.0 and back.event_count == 6
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {}}]}))
    assert run(empty, tmp_path / "e.gz", tmp_path / "e.json", top_kernels=1) == EXIT_EMPTY
    assert not (tmp_path / "e.gz").exists() and not (tmp_path / "e.json").exists()


def test_load_trace_reads_plain_and_gzip_and_rejects_other_json(tmp_path: Path) -> None:
    body = {"traceEvents": [_ev("cpu_op", "aten::add", 0, 1)]}
    (tmp_path / "t.json").write_text(json.dumps(body))
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(json.dumps(body).encode()))
    (tmp_path / "bad.json").write_text(json.dumps({"events": []}))
    assert load_trace(tmp_path / "t.json") == load_trace(tmp_path / "t.json.gz") == body
    with pytest.raises(ValueError, match="not a Chrome trace"):
        load_trace(tmp_path / "bad.json")


def test_session_bounds_defaults_and_hard_caps() -> None:
    assert SessionOptions().bounded() == (100, MAX_DURATION_MS_CAP)
    assert SessionOptions(max_requests=7).bounded() == (7, MAX_DURATION_MS_CAP)
    assert SessionOptions(duration_ms=500).bounded() == (MAX_REQUESTS_CAP, 500)
    assert SessionOptions(max_requests=3, duration_ms=500).bounded() == (3, 500)
    for options, message in ((SessionOptions(max_requests=MAX_REQUESTS_CAP + 1), "exceeds the hard cap of 1000"),
                             (SessionOptions(duration_ms=60_001), "duration_ms=60001 exceeds the hard cap"),
                             (SessionOptions(max_requests=0), "max_requests must be a positive integer"),
                             (SessionOptions(duration_ms=-5), "duration_ms must be a positive integer")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            options.bounded()
    assert check_trigger("load_test") == "load_test"
    for bad in ("Load", "", "a/b", "x" * 33):
        with pytest.raises(ConfigError, match="trigger must match"):
            check_trigger(bad)


def test_admin_access_rules() -> None:
    token = AdminConfig(token="s3cret")
    ok = (("authorization", "Bearer s3cret"),)
    remote, local = "ipv4:10.1.2.3:5555", "ipv4:127.0.0.1:5555"
    assert check_access(token, ok, remote) is None
    assert check_access(token, (), local)[0] is grpc.StatusCode.UNAUTHENTICATED
    assert check_access(token, (("authorization", "Bearer nope"),), local)[0] is grpc.StatusCode.PERMISSION_DENIED
    assert check_access(token, (("authorization", "s3cret"),), local)[0] is grpc.StatusCode.PERMISSION_DENIED
    closed = AdminConfig()
    assert check_access(closed, ok, local)[0] is grpc.StatusCode.PERMISSION_DENIED
    opened = AdminConfig(open_loopback=True)
    assert check_access(opened, (), local) is None
    assert check_access(opened, (), "ipv6:[::1]:80") is None
    assert check_access(opened, (), remote)[0] is grpc.StatusCode.PERMISSION_DENIED
    assert check_access(AdminConfig(token="s3cret", open_loopback=True), (), remote)[0] is \
        grpc.StatusCode.UNAUTHENTICATED
    assert [is_loopback_peer(p) for p in ("unix:/tmp/s", "ipv6:[::ffff:127.0.0.1]:1", "ipv4:192.168.1.1:1",
                                          "", "weird")] == [True, True, False, False, False]
    assert AdminConfig.from_env({"ZOOMER_ADMIN_TOKEN": "t", "ZOOMER_ADMIN_OPEN_LOOPBACK": "true"}) == \
        AdminConfig(token="t", open_loopback=True)
    with pytest.raises(ConfigError, match="ZOOMER_ADMIN_OPEN_LOOPBACK"):
        AdminConfig.from_env({"ZOOMER_ADMIN_OPEN_LOOPBACK": "yes please"})
    # the same words as every other ZOOMER_* switch (it once took only true/false/1/0)
    assert [AdminConfig.from_env({"ZOOMER_ADMIN_OPEN_LOOPBACK": word}).open_loopback
            for word in ("yes", "On", " 1 ", "no", "off", "FALSE", "")] == [True, True, True, False, False, False, False]
    with pytest.raises(ConfigError, match="ZOOMER_ADMIN_TOKEN is set but empty"):
        AdminConfig.from_env({"ZOOMER_ADMIN_TOKEN": " "})


def test_a_token_that_cannot_travel_as_metadata_is_refused_on_both_sides(capsys: Any) -> None:
    """A token read whole from a file ends with a newline: grpc refused the client's call with "INTERNAL: Invalid
    metadata", and the server's token could never match. Both sides now name the character."""
    for bad, shown in (("secret\n", "'\\n' at position 6"), ("s\u00e9cret", "'\u00e9' at position 1"),
                       ("a\tb", "'\\t' at position 1")):
        with pytest.raises(ConfigError, match=re.escape(f"ZOOMER_ADMIN_TOKEN holds {shown}")):
            AdminConfig.from_env({"ZOOMER_ADMIN_TOKEN": bad})
        with pytest.raises(ConfigError, match=re.escape(shown)):
            ProfilerClient("127.0.0.1:1", token=bad)
    assert AdminConfig(token="Bearer-ok ~!").token == "Bearer-ok ~!"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZOOMER_ADMIN_TOKEN", "secret\r\n")
        with pytest.raises(SystemExit) as exited:
            cli_main(["profile", "status", "--target", "127.0.0.1:1"])
    assert exited.value.code == 2
    assert "ZOOMER_ADMIN_TOKEN holds '\\r' at position 6" in capsys.readouterr().err


def test_order_statistics() -> None:
    values = sorted(float(v) for v in range(1, 101))
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([3.0], 99) == 3.0
    assert coefficient_of_variation([2.0, 2.0, 2.0]) == 0.0
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(0.5)


grpc_tools = pytest.importorskip("grpc_tools", reason="grpcio-tools (dev dependency) is needed to regenerate")


@pytest.mark.parametrize("name", ["profiler_control_pb2.py", "profiler_control_pb2.pyi",
                                  "profiler_control_pb2_grpc.py"])
def test_generated_code_matches_a_fresh_protoc_run(tmp_path: Path, name: str) -> None:
    from zoomer_serve.profiling import codegen

    fresh = codegen.generate(tmp_path)
    assert [p.name for p in fresh] == list(codegen.GENERATED_NAMES)
    committed = codegen.PROFILING_DIR / name
    assert (tmp_path / name).read_bytes() == committed.read_bytes(), (
        f"{name} is stale: run python -m zoomer_serve.profiling.codegen and commit the result")
    if name.endswith("_grpc.py"):
        assert "from . import profiler_control_pb2 as profiler__control__pb2" in committed.read_text()


def _peer_seen_by_a_server_on(host: str) -> str:
    """The ``context.peer()`` a real grpc server bound to ``host`` (port 0) sees for a call from a client there."""
    from concurrent import futures

    seen: list[str] = []

    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(context.peer())
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "peer.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(handler)}),))
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    try:
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            assert channel.unary_unary("/peer.Echo/Echo")(b"x", timeout=10) == b"x"
    finally:
        server.stop(None)
    return seen[0]


def test_an_ipv6_loopback_caller_is_a_loopback_caller() -> None:
    """A server on ``::1`` opened to loopback callers (``--admin-open-loopback``) refused them: grpc writes an
    IPv6 peer percent-encoded (``ipv6:%5B::1%5D:PORT``), which did not parse as an address. A non-loopback
    caller of a server opened to loopback only is told that, not that the server has no token."""
    try:
        peer = _peer_seen_by_a_server_on("[::1]")
    except RuntimeError as exc:  # grpc could not bind [::1]: no IPv6 loopback here
        pytest.skip(f"no IPv6 loopback: {exc}")
    assert peer.startswith("ipv6:") and is_loopback_peer(peer), peer
    assert check_access(AdminConfig(open_loopback=True), (), peer) is None
    assert is_loopback_peer(_peer_seen_by_a_server_on("127.0.0.1"))
    assert [is_loopback_peer(p) for p in ("ipv6:%5B::1%5D:50062", "ipv6:%5B::ffff:127.0.0.1%5D:1",
                                          "ipv6:%5B2001:db8::1%5D:1", "ipv6:%5Bfe80::1%25eth0%5D:1")] == \
        [True, True, False, False]
    code, message = check_access(AdminConfig(open_loopback=True), (), "ipv4:192.0.2.2:5555")
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert "open to loopback callers only" in message and "192.0.2.2" in message and "ZOOMER_ADMIN_TOKEN" in message
