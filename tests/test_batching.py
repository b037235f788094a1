"""Batch recording (zoomer_serve.batching): the recorder over a real RequestRecorder, GPU memory shares over the
fake CUDA source, and the demo's dynamic batcher on real sync, asyncio and Thrift servers exporting over real
OTLP into the embedded collector."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from interceptors import ZoomerServerInterceptor
from zoomer_serve.batching import CUT_DELAY, CUT_FULL, RULE_EQUAL, BatchRecorder
from zoomer_serve.batching import names as bn
from zoomer_serve.batching.shares import split_int, weights
from zoomer_serve.config import ConfigError
from zoomer_serve.demo.load import drive_load
from zoomer_serve.demo.model import build_model
from zoomer_serve.demo.service import ServiceConfig, build_server
from zoomer_serve.recording import RequestRecorder, phase
from zoomer_serve.recording import records as r
from zoomer_serve.telemetry import names as gn
from zoomer_serve.telemetry.memory import GpuMemoryObserver

sys.path.insert(0, str(Path(__file__).parent))
from _fake_gpu import FakeCudaMemory

PREDICT = "zoomer.demo.v1.Ranker/Predict"
BATCH_SPAN = bn.SPAN_NAME_PREFIX + "ranker"


def _recorder() -> tuple[RequestRecorder, list[tuple[Any, ...]]]:
    got: list[tuple[Any, ...]] = []
    return RequestRecorder(sink=got.append, otel_context=False), got


def _by_name(records: list[tuple[Any, ...]], name: str) -> list[tuple[Any, ...]]:
    return [rec for rec in records if rec[r.R_NAME] == name]


# -- the share rule ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("total,w", [(10, [1, 1, 1]), (1_000_003, [32, 7, 64, 1]), (5, [0, 0]), (0, [3, 4]),
                                     (7, [1]), (-10, [1, 2]), (2, [1, 1, 1, 1, 1])])
def test_split_int_parts_add_up_exactly_and_follow_the_weights(total: int, w: list[int]) -> None:
    parts = split_int(total, w)
    assert sum(parts) == total and len(parts) == len(w)
    wsum = sum(w) or len(w)
    for part, weight in zip(parts, w if sum(w) else [1] * len(w)):
        assert abs(part - total * weight / wsum) < 1  # within one unit of the exact share


def test_items_rule_falls_back_to_equal_when_no_member_counts_items() -> None:
    assert weights([32, 8, 0], "items") == [32, 8, 0]
    assert weights([0, 0], "items") == [1, 1]
    assert weights([32, 8], "equal") == [1, 1]


def test_bad_settings_raise_a_config_error_naming_them() -> None:
    rec, _ = _recorder()
    with pytest.raises(ConfigError, match="share_rule"):
        BatchRecorder("q", share_rule="by-size", recorder=rec)
    with pytest.raises(ConfigError, match="max_size"):
        BatchRecorder("q", max_size=0, recorder=rec)
    with pytest.raises(ConfigError, match="queue"):
        BatchRecorder("", recorder=rec)


# -- the recorder ----------------------------------------------------------------------------------------
def _batch_of_three(rule: str = "items") -> tuple[list[tuple[Any, ...]], list[Any], Any]:
    """Three requests on three threads join one batch run on this thread; returns the records, the request spans
    and the batch recorder."""
    rec, got = _recorder()
    batching = BatchRecorder("q", max_size=4, max_delay_ms=5, share_rule=rule, recorder=rec)
    spans = [rec.start(f"svc/M{i}") for i in range(3)]
    tickets: list[Any] = [None] * 3

    def join(i: int, items: int) -> None:
        spans[i].activate()
        try:
            tickets[i] = batching.enqueue(items=items)
        finally:
            spans[i].deactivate()

    for i, items in enumerate((10, 30, 60)):  # one after the other: the first waits longest
        t = threading.Thread(target=join, args=(i, items))
        t.start()
        t.join()
        time.sleep(0.002)
    with batching.begin(tickets, CUT_DELAY):
        with phase("forward"):
            time.sleep(0.01)
        with phase("gather"):
            time.sleep(0.002)
    for s in spans:
        s.end()
    return got, spans, batching


def test_batch_span_links_every_member_and_records_size_fill_reason_and_phases() -> None:
    got, spans, batching = _batch_of_three()
    (batch,) = _by_name(got, "process q")
    attrs = batch[r.R_ATTRS]
    assert batch[r.R_KIND] == r.KIND_INTERNAL and batch[r.R_PARENT_ID] == 0
    assert attrs[bn.SIZE] == attrs[bn.MESSAGING_BATCH_COUNT] == 3
    assert attrs[bn.ITEMS] == 100 and attrs[bn.MAX_SIZE] == 4 and attrs[bn.FILL] == 0.75
    assert attrs[bn.CUT_REASON] == CUT_DELAY and attrs[bn.SHARE_RULE] == "items"
    assert attrs[bn.MESSAGING_OPERATION_TYPE] == "process" and attrs[bn.MESSAGING_DESTINATION] == "q"
    assert [(tid, sid) for tid, sid, _ in batch[r.R_LINKS]] == [(s.trace_id, s.span_id) for s in spans]
    assert [la[bn.SHARE] for _, _, la in batch[r.R_LINKS]] == [0.1, 0.3, 0.6]
    assert [c[r.R_NAME] for c in r.child_records(batch)] == ["forward", "gather"]
    assert batching.stats.batches == 1 and batching.stats.members == 3 and batching.stats.late == 0


def test_members_get_shares_that_add_up_to_the_batch_and_queue_waits_that_end_at_its_start() -> None:
    got, spans, _ = _batch_of_three()
    (batch,) = _by_name(got, "process q")
    phases = {c[r.R_NAME]: c for c in r.child_records(batch)}
    members = [rec for rec in got if rec[r.R_NAME].startswith("svc/")]
    assert len(members) == 3
    shares = [m[r.R_ATTRS][bn.SHARE] for m in members]
    assert abs(sum(shares) - 1.0) < 1e-9
    for j, name in enumerate(("forward", "gather")):
        duration = phases[name][r.R_END_NS] - phases[name][r.R_START_NS]
        parts = [m[r.R_ATTRS][bn.PHASE_SHARE_NS][j] for m in members]
        assert m_names(members) == [["forward", "gather"]] * 3
        assert sum(parts) == duration  # exact: largest remainder
        assert [round(p / duration, 2) for p in parts] == [0.1, 0.3, 0.6]
    for i, m in enumerate(members):
        a = m[r.R_ATTRS]
        assert a[bn.BATCH_ID] == f"{batch[r.R_SPAN_ID]:016x}" and a[bn.SIZE] == 3 and a[bn.INDEX] == i
        queue = [c for c in r.child_records(m) if c[r.R_ATTRS].get("zoomer.phase") == bn.QUEUE_PHASE]
        assert len(queue) == 1
        # enqueue + wait = the batch's start (each span on its own clock: within 1 ms)
        assert abs(queue[0][r.R_START_NS] + a[bn.QUEUE_WAIT] - batch[r.R_START_NS]) < 1_000_000
        assert queue[0][r.R_END_NS] - queue[0][r.R_START_NS] == a[bn.QUEUE_WAIT]
        copies = {c[r.R_NAME]: c for c in r.child_records(m) if c[r.R_ATTRS].get(bn.BATCH_ID) and c is not queue[0]}
        assert set(copies) == {"forward", "gather"}
        for name, c in copies.items():
            assert abs(c[r.R_START_NS] - phases[name][r.R_START_NS]) < 1_000_000
            assert c[r.R_END_NS] - c[r.R_START_NS] == phases[name][r.R_END_NS] - phases[name][r.R_START_NS]
        assert m[r.R_LINKS] == [(batch[r.R_TRACE_ID], batch[r.R_SPAN_ID], None)]
    waits = [m[r.R_ATTRS][bn.QUEUE_WAIT] for m in members]
    assert waits[0] > waits[1] > waits[2] >= 0
    assert batch[r.R_ATTRS][bn.QUEUE_WAIT_MAX] == waits[0]


def m_names(members: list[tuple[Any, ...]]) -> list[list[str]]:
    return [m[r.R_ATTRS][bn.PHASE_NAMES] for m in members]


def test_equal_rule_gives_every_member_the_same_share() -> None:
    got, _, _ = _batch_of_three(RULE_EQUAL)
    members = [rec for rec in got if rec[r.R_NAME].startswith("svc/")]
    assert [round(m[r.R_ATTRS][bn.SHARE], 6) for m in members] == [0.333333] * 3


def test_a_member_that_ended_before_its_batch_is_counted_late_and_left_alone() -> None:
    rec, got = _recorder()
    batching = BatchRecorder("q", recorder=rec)
    early, kept = rec.start("svc/Early"), rec.start("svc/Kept")
    tickets = [batching.enqueue(1, span=early), batching.enqueue(1, span=kept), batching.enqueue(1, span=None)]
    early.end()  # cancelled while queued
    with batching.begin(tickets, CUT_FULL):
        pass
    kept.end()
    assert batching.stats.late == 1 and batching.stats.untraced == 1
    (batch,) = _by_name(got, "process q")
    assert batch[r.R_ATTRS][bn.UNTRACED] == 1 and len(batch[r.R_LINKS]) == 2
    assert bn.BATCH_ID not in _by_name(got, "svc/Early")[0][r.R_ATTRS]
    assert _by_name(got, "svc/Kept")[0][r.R_ATTRS][bn.INDEX] == 1


def test_a_failed_batch_is_an_error_span_and_the_exception_propagates() -> None:
    rec, got = _recorder()
    batching = BatchRecorder("q", recorder=rec)
    span = rec.start("svc/M")
    with pytest.raises(RuntimeError, match="model broke"), batching.begin([batching.enqueue(2, span=span)]):
        raise RuntimeError("model broke")
    span.end()
    (batch,) = _by_name(got, "process q")
    assert batch[r.R_STATUS] == r.STATUS_ERROR and batch[r.R_ATTRS]["error.type"] == "RuntimeError"
    assert batching.stats.errors == 1
    assert _by_name(got, "svc/M")[0][r.R_ATTRS][bn.SHARE] == 1.0


def test_the_batch_span_is_sampled_when_a_member_is() -> None:
    from zoomer_serve.recording import Sampler

    got: list[tuple[Any, ...]] = []
    rec = RequestRecorder(sink=got.append, sampler=Sampler("always_off"), otel_context=False)
    batching = BatchRecorder("q", recorder=rec)
    span = rec.start("svc/M")
    span.trace_flags, span._flags = 1, span._flags | r.F_SAMPLED  # sampled upstream
    with batching.begin([batching.enqueue(1, span=span)]):
        pass
    span.end()
    (batch,) = _by_name(got, "process q")
    assert batch[r.R_FLAGS] & r.F_SAMPLED


def test_gpu_memory_shares_add_up_to_the_batch_working_memory() -> None:
    fake = FakeCudaMemory()
    keep = fake.allocate(5 << 20)  # held before the batch: not the batch's
    rec, got = _recorder()
    rec.add_observer(GpuMemoryObserver(fake, (0,)))
    batching = BatchRecorder("q", recorder=rec)
    spans = [rec.start(f"svc/M{i}") for i in range(4)]
    tickets = [batching.enqueue(items, span=s) for s, items in zip(spans, (1, 2, 3, 7))]
    with batching.begin(tickets), phase("forward"):
        blocks = [fake.allocate(3_000_001), fake.allocate(1_000_000)]
        for b in blocks:
            fake.free(b)
    for s in spans:
        s.end()
    fake.free(keep)
    (batch,) = _by_name(got, "process q")
    ba = batch[r.R_ATTRS]
    working = ba[gn.MEM_PEAK] - ba[gn.MEM_ALLOCATED_START]
    assert working == 4_000_001
    members = [rec for rec in got if rec[r.R_NAME].startswith("svc/")]
    parts = [m[r.R_ATTRS][bn.GPU_PEAK_SHARE] for m in members]
    assert sum(parts) == working
    assert abs(parts[3] / working - 7 / 13) < 1e-6
    allocs = [m[r.R_ATTRS][bn.GPU_DEVICE_ALLOCS_SHARE] for m in members]
    assert sum(allocs) == ba[gn.MEM_DEVICE_ALLOCS] >= 1


def test_the_batch_allocations_from_allocator_history_are_shared_among_its_members() -> None:
    from zoomer_serve.telemetry import AllocationHistory

    fake = FakeCudaMemory()
    rec, got = _recorder()
    history = AllocationHistory(fake, "python", 10_000, 3)
    rec.add_observer(GpuMemoryObserver(fake, (0,), history=history))
    history.enable()
    batching = BatchRecorder("q", recorder=rec)
    spans = [rec.start(f"svc/M{i}") for i in range(3)]
    tickets = [batching.enqueue(items, span=s) for s, items in zip(spans, (1, 1, 2))]
    with batching.begin(tickets), phase("forward"):
        blocks = [fake.allocate(1001), fake.allocate(3 << 20), fake.allocate(7)]  # tagged with the batch
        for b in blocks:
            fake.free(b)
    for s in spans:
        s.end()
    history.drain()
    history.disable()
    (batch,) = _by_name(got, "process q")
    events = [rec for rec in got if rec[r.R_NAME] == gn.EVENTS_SPAN]
    (own,) = [e for e in events if e[r.R_PARENT_ID] == batch[r.R_SPAN_ID]]
    shares = [e for e in events if e[r.R_PARENT_ID] in {s.span_id for s in spans}]
    assert len(shares) == 3 and own[r.R_ATTRS][gn.action_count("alloc")] == 3
    for action in gn.ACTIONS:
        for key in (gn.action_count(action), gn.action_bytes(action)):
            assert sum(e[r.R_ATTRS][key] for e in shares) == own[r.R_ATTRS][key], key
    big = [e for e in shares if e[r.R_ATTRS][bn.SHARE] == 0.5]
    assert len(big) == 1 and big[0][r.R_ATTRS][gn.action_bytes("alloc")] == (1001 + (3 << 20) + 7) // 2
    assert {e[r.R_ATTRS][bn.BATCH_ID] for e in shares} == {f"{batch[r.R_SPAN_ID]:016x}"}


# -- the demo's dynamic batcher on real servers ------------------------------------------------------------
N_REQUESTS = 96
CLIENTS = 8
BATCH_MAX = 8


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(device="cpu")


def _check_batched_store(spans: list[dict[str, Any]], calls: int) -> None:
    """N request spans, every one linked from exactly one batch span; shares that sum to the batch's figures
    (within 1 %); queue waits that add up with the batch's start."""
    requests = [s for s in spans if s["kind"] == "SERVER" and s["name"] == PREDICT]
    batches = [s for s in spans if s["name"] == BATCH_SPAN]
    assert len(requests) == calls
    linked: dict[tuple[str, str], int] = {}
    for b in batches:
        for link in b["links"]:
            key = (link["trace_id"], link["span_id"])
            linked[key] = linked.get(key, 0) + 1
    assert {(s["trace_id"], s["span_id"]) for s in requests} == set(linked)
    assert set(linked.values()) == {1}
    by_id = {b["span_id"]: b for b in batches}
    members: dict[str, list[dict[str, Any]]] = {}
    for s in requests:
        members.setdefault(s["attributes"][bn.BATCH_ID], []).append(s)
    assert set(members) == set(by_id)
    forwards = {s["parent_span_id"]: s for s in spans if s["name"] == "forward" and s["parent_span_id"] in by_id}
    sizes = []
    for batch_id, group in members.items():
        batch = by_id[batch_id]
        ba = batch["attributes"]
        assert ba[bn.SIZE] == len(group) == len(batch["links"]) <= BATCH_MAX
        assert ba[bn.CUT_REASON] in (CUT_FULL, CUT_DELAY)
        assert (ba[bn.CUT_REASON] == CUT_FULL) == (len(group) == BATCH_MAX)
        assert abs(sum(m["attributes"][bn.SHARE] for m in group) - 1.0) < 0.01
        forward = forwards[batch_id]
        j = group[0]["attributes"][bn.PHASE_NAMES].index("forward")
        assert abs(sum(m["attributes"][bn.PHASE_SHARE_NS][j] for m in group) - forward["duration_ns"]) \
            <= 0.01 * forward["duration_ns"]
        for m in group:
            queue = [c for c in spans if c["parent_span_id"] == m["span_id"] and c["name"] == bn.QUEUE_PHASE]
            assert len(queue) == 1
            assert abs(queue[0]["start_ns"] + m["attributes"][bn.QUEUE_WAIT] - batch["start_ns"]) < 1_000_000
            assert m["start_ns"] <= queue[0]["start_ns"] and queue[0]["end_ns"] <= m["end_ns"]
        sizes.append(len(group))
    assert max(sizes) > 1  # concurrent load does batch


def test_sync_grpc_server_batches_under_load_and_every_request_is_linked_once(collector, telemetry, model) -> None:
    server, port = build_server(model, interceptors=[ZoomerServerInterceptor(telemetry.recorder)],
                                max_workers=CLIENTS + 2,
                                config=ServiceConfig(batch_max_size=BATCH_MAX, batch_max_delay_ms=5))
    try:
        result = drive_load(f"127.0.0.1:{port}", 60.0, clients=CLIENTS, batch_size=8, max_requests=N_REQUESTS,
                            stream_share=0.0, invalid_share=0.0)
    finally:
        server.stop(None).wait(5)
    assert result.unexpected == 0 and result.total_calls == N_REQUESTS
    spans = collector.spans()
    _check_batched_store(spans, N_REQUESTS)
    _check_batch_metrics(collector, spans)


def _latest(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The last cumulative point of the one attribute set in ``points``."""
    assert len({str(sorted(p["attributes"].items())) for p in points}) == 1, points
    return max(points, key=lambda p: p["time_ns"])


def _check_batch_metrics(collector: Any, spans: list[dict[str, Any]]) -> None:
    """The queue-wait and batch-size histograms count every batched request, under its method, and their sums
    are the spans' figures."""
    requests = [s for s in spans if s["kind"] == "SERVER" and s["name"] == PREDICT]
    wait = _latest(collector.metric_points(bn.METRIC_QUEUE_WAIT))
    size = _latest(collector.metric_points(bn.METRIC_SIZE))
    for point, unit in ((wait, "s"), (size, "{request}")):
        assert point["attributes"]["rpc.method"] == PREDICT and point["attributes"]["rpc.response.status_code"] == "OK"
        assert point["count"] == len(requests) and point["unit"] == unit and point["metric_type"] == "histogram"
    assert wait["sum"] == pytest.approx(sum(s["attributes"][bn.QUEUE_WAIT] for s in requests) / 1e9, rel=1e-6)
    assert size["sum"] == sum(s["attributes"][bn.SIZE] for s in requests)


def test_aio_grpc_server_batches_under_load(collector, telemetry, model) -> None:
    from zoomer_serve.demo.aio_server import aio_server_in_thread

    with aio_server_in_thread(model, grace_s=2.0,
                              config=ServiceConfig(batch_max_size=BATCH_MAX, batch_max_delay_ms=5)) as port:
        result = drive_load(f"127.0.0.1:{port}", 60.0, clients=CLIENTS, batch_size=8, max_requests=N_REQUESTS,
                            stream_share=0.0, invalid_share=0.0)
    assert result.unexpected == 0 and result.total_calls == N_REQUESTS
    _check_batched_store(collector.spans(), N_REQUESTS)


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
def test_thrift_server_batches_under_load(collector, telemetry, model, aio: bool) -> None:
    from zoomer_serve.demo.thrift_load import drive_thrift_load
    from zoomer_serve.demo.thrift_server import build_thrift_server

    server = build_thrift_server(model, aio=aio, config=ServiceConfig(batch_max_size=BATCH_MAX,
                                                                      batch_max_delay_ms=5)).start()
    try:
        result = drive_thrift_load(f"127.0.0.1:{server.port}", 60.0, clients=CLIENTS, batch_size=8,
                                   max_requests=N_REQUESTS, invalid_share=0.0)
    finally:
        server.stop(grace_s=5)
    assert result.unexpected == 0 and result.total_calls == N_REQUESTS
    _check_batched_store(collector.spans(), N_REQUESTS)


def test_invalid_requests_fail_before_the_queue_and_valid_ones_still_batch(collector, telemetry, model) -> None:
    server, port = build_server(model, interceptors=[ZoomerServerInterceptor(telemetry.recorder)],
                                max_workers=6, config=ServiceConfig(batch_max_size=4, batch_max_delay_ms=5))
    try:
        result = drive_load(f"127.0.0.1:{port}", 60.0, clients=4, batch_size=4, max_requests=40, stream_share=0.0,
                            invalid_share=0.3)
    finally:
        server.stop(None).wait(5)
    assert result.unexpected == 0
    spans = collector.spans()
    requests = [s for s in spans if s["kind"] == "SERVER"]
    bad = [s for s in requests if s["attributes"].get("rpc.response.status_code") == "INVALID_ARGUMENT"]
    good = [s for s in requests if s["attributes"].get("rpc.response.status_code") == "OK"]
    assert len(bad) + len(good) == 40 and bad
    assert all(bn.BATCH_ID not in s["attributes"] for s in bad)
    assert all(bn.BATCH_ID in s["attributes"] for s in good)


def test_the_benchmark_recording_cost_part_runs_both_paths() -> None:
    """Smoke test of benchmarks/batching.py (its figures are written down in benchmarks/BATCHING.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import batching as bench

    row = bench.recording_cost(8, requests=64, repeats=2)
    assert row["batch_size"] == 8 and row["unbatched_us"] > 0 and row["batched_us"] > 0
    assert len(row["rounds_added_us"]) == 2 and row["added_us"] == row["batched_us"] - row["unbatched_us"]
