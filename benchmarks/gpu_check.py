"""GPU check: the demo model server on a real GPU under load, with every GPU telemetry feature on, then a table.

Usage::

    python benchmarks/gpu_check.py              # about 2 minutes; exits 0 when every check passes
    python benchmarks/gpu_check.py --seconds 10 --out /tmp/gpu-check

On a machine without CUDA it prints why and exits 2 without checking anything, unless ``--cpu`` is given.

What runs, in order (each step adds rows ``(step, what, value, ok)`` to the table; a step that raises is an
error row and the next step still runs):

1. ``load``: the demo DLRM Ranker on ``cuda`` behind ``ZoomerServerInterceptor``, exporting over OTLP to an
   embedded collector, with GPU telemetry on (per-request memory, peak, OOM observer, allocation history with
   Python stacks, NVML sampler every 500 ms), under ``drive_load`` for ``--seconds``. C07: while the load
   runs, a memory snapshot (the pickle pytorch.org/memory_viz opens) is asked for with a time budget.
2. ``oom``: a call whose handler allocates more than the device holds on a side CUDA stream; the handler
   catches ``torch.OutOfMemoryError``; the next Predict must succeed (the server keeps serving).
3. ``overhead``: the observer's ``on_start`` + ``on_end`` with the real source (timeit), the cost of one
   ``torch._C._cuda_memoryStats`` read against ``torch.cuda.memory_stats``, and the client-side latency of
   Predict with GPU telemetry on against off (observer removed), same server, back to back.
4. ``C06``: an allocate/free loop over sizes from 1 B to 8 MiB with history off, then 20 history windows
   on/off, then off again: allocations per second must come back to the baseline (within 15 %) and must not
   degrade with the number of windows (median of the last 5 off windows against the first 5).
5. ``profile`` (:func:`check_profiler_kernels`): a kernel-profiling session (CPU + CUDA activities) over
   ``PROFILE_REQUESTS`` calls captures kernels and attributes GPU kernel time to the request ranges (target
   at least 95 % of all kernel time in the trace), every covered request has kernels; then the client-side
   latency of the same load outside and inside a session (``benchmarks/_bench_profiling.py``).
6. ``aio`` (:func:`check_aio_kernels`): the same on the ``grpc.aio`` demo server, whose model runs in
   ``asyncio.to_thread``: a session over ``AIO_PROFILE_REQUESTS`` calls, at least 95 % of kernel time
   attributed to the requests, every covered request with kernels (its phases open its range on the executor
   thread).
7. ``batching`` (:func:`check_batching`): the demo server with its dynamic batcher (``BATCH_MAX_SIZE`` requests,
   ``BATCH_MAX_DELAY_MS``) on ``cuda`` under 8 clients, inside a CUDA profiling session of
   ``BATCH_PROFILE_REQUESTS`` calls: every call covered, in exactly one batch (one marker each); the members' shares
   of the kernel time inside batch ranges add up to 100 % of it (within 1 %); with the records of the batch spans
   and their members taken from the recorder: per batch, the members' shares of GPU working memory
   (``zoomer.batch.gpu.memory.peak``) and of ``cudaMalloc`` calls add up to the batch's figures exactly, and their
   shares of the forward phase add up to its duration.
8. ``store``: after a flush, the collector's store: requests, spans with memory attributes, allocation-event
   child spans attributed to a request (share), the OOM span (event, status, error.type) and OOM metric,
   NVML metrics seen.
9. ``timeline`` (:func:`check_timeline`, case C19): ``zoomer-serve analyze``'s merged timeline of step 5's
   trace and the store, read back as Perfetto pairs slices: the trace's time base, every covered request's
   profiler range inside its span (within 1 ms); CUDA-only rows: every kernel starts after its launch call
   and lies within the profiled requests' time.

``--cpu`` runs what needs no GPU, on a machine without one: a CPU profiling session of the demo server
(``cpu_profile``), step 7 on the CPU (the batches' ATen operators stand for their kernels: their shares must add
up to 100 %; the GPU memory rows need CUDA) and step 9 on the first trace, each up to its CUDA-only rows, which it
lists as not checked.

Other engineers add steps to :data:`STEPS` (a function ``step(ctx) -> None`` that calls ``ctx.row``); a step
that needs the running server (``ctx.target``) goes before ``check_store``, which stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _bench_args import Range, parse  # noqa: E402

OOM_SERVICE = "zoomer.gpucheck.v1.Check"
OOM_METHOD = "ForceOom"
DEADLINE_S = 230  # the whole check must end within 4 minutes
C06_SIZES = (1, 256, 4096, 64 << 10, 1 << 20, 8 << 20)
C06_WINDOWS = 20
C06_EDGE = 5  # windows at each end compared for degradation
C06_TOLERANCE = 0.15
PROFILE_REQUESTS = 50
PROFILE_MIN_SHARE = 0.95
AIO_PROFILE_REQUESTS = 20
CPU_PROFILE_REQUESTS = 12
TIMELINE_TOLERANCE_NS = 1_000_000
BATCH_MAX_SIZE = 8
BATCH_MAX_DELAY_MS = 5.0
BATCH_PROFILE_REQUESTS = 48
BATCH_CLIENTS = 8


@dataclass
class Context:
    """What the steps share: arguments, the collector, telemetry, the server, results, and the table."""

    args: argparse.Namespace
    out: Path
    store: Path
    cuda: bool = True
    collector: Any = None
    telemetry: Any = None
    server: Any = None
    target: str = ""
    rows: list[tuple[str, str, str, bool | None]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def row(self, step: str, what: str, value: Any, ok: bool | None = None) -> None:
        """Add a table row; ``ok`` None is information only."""
        self.rows.append((step, what, str(value), ok))


# -- steps -------------------------------------------------------------------------------------------------
def check_load(ctx: Context) -> None:
    """Step 1: server, load, and a C07 snapshot while the load runs."""
    from zoomer_serve.demo.load import drive_load

    _start_server(ctx)
    snapshot: dict[str, Any] = {}
    taker = threading.Thread(target=_snapshot_during_load, args=(ctx, snapshot), daemon=True)
    taker.start()
    result = drive_load(ctx.target, duration_s=ctx.args.seconds, clients=4, batch_size=64)
    taker.join(60)
    ctx.facts["requests_sent"] = result.total_calls
    ctx.row("load", "calls (all methods, all codes)", result.total_calls, result.total_calls > 0)
    ctx.row("load", "Predict p50 / p99 ms", f"{result.p50_ms:.2f} / {result.p99_ms:.2f}")
    ctx.row("load", "unexpected status", result.unexpected, result.unexpected == 0)
    if "error" in snapshot:
        ctx.row("C07", "snapshot during load", snapshot["error"], False)
    elif "result" in snapshot:
        res = snapshot["result"]
        ok = res.bytes > 0 and res.trace_entries > 0 and res.seconds < ctx.args.snapshot_budget
        ctx.row("C07", "snapshot during load (memory_viz pickle)",
                f"{res.path.name}: {res.bytes} B, {res.trace_entries} entries, {res.seconds:.2f} s", ok)
    else:
        ctx.row("C07", "snapshot during load", "did not return", False)


def check_oom(ctx: Context) -> None:
    """Step 2: a forced OOM on a side stream is caught in the handler; the server keeps serving."""
    import grpc
    import numpy as np

    from zoomer_serve.demo import ranker_pb2_grpc
    from zoomer_serve.demo.load import make_request

    with grpc.insecure_channel(ctx.target) as channel:
        reply = channel.unary_unary(f"/{OOM_SERVICE}/{OOM_METHOD}")(b"", timeout=60)
        ctx.row("oom", "handler caught torch.OutOfMemoryError on a side stream", reply.decode(), reply == b"caught")
        stub = ranker_pb2_grpc.RankerStub(channel)
        resp = stub.Predict(make_request(np.random.default_rng(7), 16), timeout=30)
        ctx.row("oom", "next Predict after the OOM", f"{len(resp.scores)} scores", len(resp.scores) == 16)
    observer = ctx.telemetry.gpu.observer
    ctx.row("oom", "OOMs seen by the observer (marked / outside requests)",
            f"{observer.oom_count - observer.oom_unattributed} / {observer.oom_unattributed}",
            observer.oom_count >= 1 and observer.oom_unattributed == 0)


def check_overhead(ctx: Context) -> None:
    """Step 3: per-request cost of GPU telemetry, direct and end to end."""
    import torch

    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.recording import RequestRecorder

    gpu = ctx.telemetry.gpu
    observer = gpu.observer
    dev = observer.devices[0]
    n = 20_000
    stats_us = min(timeit.repeat(lambda: torch._C._cuda_memoryStats(dev), number=n, repeat=5)) / n * 1e6
    flat_us = min(timeit.repeat(lambda: torch.cuda.memory_stats(dev), number=2000, repeat=5)) / 2000 * 1e6
    ctx.row("overhead", "torch._C._cuda_memoryStats (nested, 1 read) µs", f"{stats_us:.2f}")
    ctx.row("overhead", "torch.cuda.memory_stats (flattened) µs", f"{flat_us:.2f}")
    span = RequestRecorder(otel_context=False).start("gpu_check/Observer")

    def both() -> None:
        observer.on_start(span)
        observer.on_end(span)

    obs_us = min(timeit.repeat(both, number=n, repeat=5)) / n * 1e6
    ctx.row("overhead", "observer on_start+on_end, real source, history on, µs/request", f"{obs_us:.2f}")
    recorder = ctx.telemetry.recorder

    def load() -> Any:
        return drive_load(ctx.target, duration_s=ctx.args.overhead_seconds, clients=4, batch_size=64,
                          stream_share=0.0, invalid_share=0.0)

    on_first = load().p50_ms
    recorder.remove_observer(observer)
    try:
        off_load = load()  # every call of it has ended when it returns: none straddles the switch
    finally:
        recorder.add_observer(observer)
    ctx.facts["observer_off_calls"] = off_load.total_calls
    off = off_load.p50_ms
    on = min(on_first, load().p50_ms)
    ctx.row("overhead", "Predict p50 ms, GPU telemetry on / off", f"{on:.3f} / {off:.3f} ({(on - off) * 1000:+.0f} µs)")


def check_c06(ctx: Context) -> None:
    """Step 4 (C06): history windows on/off around a tight allocate/free loop leave allocation speed as it was."""
    import statistics

    import torch

    gpu = ctx.telemetry.gpu
    gpu.disable_history()  # drains what the load recorded; the loop below runs outside any request
    ctx.facts["unattributed"] = gpu.history.stats.unattributed
    torch.cuda.synchronize()

    def rate(iterations: int = 2000) -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            for size in C06_SIZES:
                torch.empty(size, dtype=torch.uint8, device="cuda")  # freed at once: back to the cache
        return iterations * len(C06_SIZES) / (time.perf_counter() - start)

    rate()  # warm the cache
    baseline = max(rate() for _ in range(3))
    on_rates, off_rates = [], []
    for _ in range(C06_WINDOWS):
        with gpu.history.window():
            on_rates.append(rate(500))
        off_rates.append(rate(500))
    after = max(rate() for _ in range(3))
    # a 500-iteration window lasts ~10 ms: one window alone swings by half (374k vs 231k baseline on an H200)
    first, last = statistics.median(off_rates[:C06_EDGE]), statistics.median(off_rates[-C06_EDGE:])
    ctx.row("C06", "allocs/s history off (baseline)", f"{baseline:,.0f}")
    ctx.row("C06", "allocs/s history on (median of windows)", f"{sorted(on_rates)[len(on_rates) // 2]:,.0f}")
    ctx.row("C06", f"allocs/s history off again after {C06_WINDOWS} windows", f"{after:,.0f} "
            f"({after / baseline:.2f}x baseline)", after >= (1 - C06_TOLERANCE) * baseline)
    ctx.row("C06", f"off-window speed, median of the first {C06_EDGE} vs the last {C06_EDGE} windows",
            f"{first:,.0f} vs {last:,.0f}",
            last >= (1 - C06_TOLERANCE) * first)


def check_profiler_kernels(ctx: Context) -> None:
    """Step 5 (kernel profiling): a CUDA session over PROFILE_REQUESTS calls; kernel time attributed to the
    requests; the latency cost of a session."""
    import statistics

    from _bench_profiling import session_latency_rows

    from zoomer_serve.profiling import ProfilerConfig, ProfilerController

    controller = ProfilerController(ProfilerConfig(profiles_dir=ctx.out / "profiles"), ctx.telemetry).attach()
    try:
        summary = _kernel_session(ctx, "profile", controller, ctx.target, PROFILE_REQUESTS)
        reqs = list(summary.requests.values()) if summary is not None else []
        if reqs:
            median = statistics.median
            ctx.row("profile", "per request (median): kernels, kernel µs, launch (CUDA API) µs, memcpy B",
                    f"{median([r.kernel_count for r in reqs]):.0f}, {median([r.kernel_time_us for r in reqs]):.1f}, "
                    f"{median([r.cuda_runtime_time_us for r in reqs]):.1f}, "
                    f"{median([r.memcpy_bytes for r in reqs]):,.0f}")
            top = summary.totals.top_kernels(1) if summary is not None else []
            ctx.row("profile", "top kernel by GPU time", f"{top[0].name[:60]} ({top[0].time_us:,.0f} µs)"
                    if top else "none")
        if summary is not None:
            for row in session_latency_rows(ctx.target, controller, n_requests=100, rounds=2, cuda=True):
                ctx.row("profile", row["what"], f"{row['value']} {row['unit']}")
    finally:
        controller.close(timeout_s=60)


def check_aio_kernels(ctx: Context) -> None:
    """Step 6 (kernel profiling on the grpc.aio demo server, whose model runs in ``asyncio.to_thread``): the
    request range opens on the event loop's thread and the phases open it again on the executor thread, so
    the kernels launched there are attributed to their requests."""
    from zoomer_serve.demo.aio_server import aio_server_in_thread
    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.demo.model import build_model
    from zoomer_serve.profiling import ProfilerConfig, ProfilerController

    controller = ProfilerController(ProfilerConfig(profiles_dir=ctx.out / "profiles_aio"), ctx.telemetry).attach()
    try:
        with aio_server_in_thread(build_model(device="cuda"), grace_s=2.0, start_timeout_s=60.0) as port:
            target = f"127.0.0.1:{port}"
            ctx.row("aio", "grpc.aio demo server on cuda", target, True)
            drive_load(target, 5.0, clients=4, batch_size=64, max_requests=40, invalid_share=0.0)  # warm-up
            _kernel_session(ctx, "aio", controller, target, AIO_PROFILE_REQUESTS)
    finally:
        controller.close(timeout_s=60)


def _kernel_session(ctx: Context, step: str, controller: Any, target: str, requests: int, cuda: bool = True) -> Any:
    """A CUDA profiling session over ``requests`` calls to ``target``, with the rows both kernel steps share:
    the session starts and ends with one covered request per call, the trace, its kernels, the share of kernel
    time attributed to request ranges (target PROFILE_MIN_SHARE), every covered request with kernels. Returns
    the trace's summary (``summarize_events``), or None when the session wrote no trace."""
    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.profiling import SessionOptions, load_trace, summarize_events

    started = time.monotonic()
    reply = controller.start(SessionOptions(max_requests=requests, cuda=cuda))
    ctx.row(step, "CUDA session starts (CPU + CUDA activities)" if cuda else "CPU session starts", f"{reply.message} "
            f"({time.monotonic() - started:.1f} s)", reply.session is not None and reply.session.cuda == cuda)
    load = drive_load(target, 60.0, clients=4, batch_size=64, max_requests=requests, stream_share=0.2,
                      invalid_share=0.0)
    finished = controller.wait_idle(120)
    info = controller.last
    ctx.row(step, "session done, one covered request per call",
            f"{info.outcome if info else 'none'}: {info.requests if info else 0} of {load.total_calls} calls, "
            f"{(info.error or '') if info else ''}", bool(finished and info and info.outcome == "done"
                                                        and info.requests == load.total_calls == requests))
    if info is None or info.trace_path is None:
        return None
    ctx.row(step, "trace (gzip Chrome trace)", f"{info.trace_path} ({info.trace_bytes:,} B)", info.trace_bytes > 0)
    ctx.facts.setdefault("kernel_traces", []).append(info.trace_path)
    summary = summarize_events(load_trace(info.trace_path)["traceEvents"])
    if not cuda:
        ctx.row(step, "kernel rows (kernels, attribution to request ranges)", "needs CUDA: not checked")
        return summary
    share = summary.attributed_share or 0.0
    ctx.row(step, "kernels in the trace; GPU kernel time", f"{summary.totals.kernel_count:,}; "
            f"{summary.totals.kernel_time_us:,.0f} µs", summary.totals.kernel_count > 0)
    ctx.row(step, f"kernel time attributed to request ranges (target >= {PROFILE_MIN_SHARE:.0%})",
            f"{share:.1%} ({summary.attributed.kernel_time_us:,.0f} µs)", share >= PROFILE_MIN_SHARE)
    reqs = list(summary.requests.values())
    with_kernels = [r for r in reqs if r.kernel_count > 0]
    ctx.row(step, "requests in the trace with kernels", f"{len(with_kernels)} of {len(reqs)}",
            len(reqs) == info.requests and len(with_kernels) == len(reqs))
    return summary


def check_store(ctx: Context) -> None:
    """Step 7: flush everything, stop the collector, read the store."""
    from zoomer_serve.collector.store import open_readonly
    from zoomer_serve.telemetry import names as n

    history = ctx.telemetry.gpu.history
    unattributed = ctx.facts.get("unattributed", history.stats.unattributed if history else 0)
    _close_store(ctx)
    con = open_readonly(ctx.store)
    try:
        spans = _rows(con, "SELECT span_id, parent_span_id, name, kind, status_code, attributes, events FROM spans")
        metrics = [r[0] for r in con.execute("SELECT DISTINCT metric_name FROM metric_points").fetchall()]
        oom_points = con.execute("SELECT max(value) FROM metric_points WHERE metric_name = ?",
                                 [n.GPU_OOM_COUNT]).fetchone()[0]
    finally:
        con.close()
    requests = [s for s in spans if s["kind"] in ("SERVER", "SPAN_KIND_SERVER", "2")]
    with_memory = [s for s in requests if n.MEM_PEAK in s["attributes"]]
    with_util = [s for s in requests if n.GPU_UTILIZATION in s["attributes"]]
    ctx.row("store", "request spans", len(requests), len(requests) > 0)
    observed = len(requests) - ctx.facts.get("observer_off_calls", 0)  # step 3 removes the observer for a while
    ctx.row("store", "request spans with zoomer.gpu.memory.* (and peak shared), of those served with the "
            "observer on", f"{len(with_memory)} of {observed} "
            f"({sum(bool(s['attributes'].get(n.MEM_PEAK_SHARED)) for s in with_memory)} shared)",
            len(with_memory) == observed)
    ctx.row("store", "request spans with zoomer.gpu.utilization", len(with_util), len(with_util) > 0)
    request_ids = {s["span_id"] for s in requests}
    children = [s for s in spans if s["name"] == n.EVENTS_SPAN]
    linked = [c for c in children if c["parent_span_id"] in request_ids]
    attributed = sum(sum(c["attributes"].get(n.action_count(a), 0) for a in n.ACTIONS) for c in linked)
    share = attributed / (attributed + unattributed) if attributed + unattributed else 0.0
    ctx.row("store", "allocation-event child spans linked to a request", f"{len(linked)} of {len(children)}",
            len(children) > 0 and len(linked) == len(children))
    ctx.row("store", "allocator entries attributed to a request id", f"{attributed} ({share:.0%}; "
            f"{unattributed} unattributed)", share >= 0.5)
    oom_spans = [s for s in requests if s["name"].endswith(f"/{OOM_METHOD}")]
    oom_ok = bool(oom_spans) and all(
        s["status_code"] in ("ERROR", "STATUS_CODE_ERROR") and s["attributes"].get("error.type")
        and any(e["name"] == n.OOM_EVENT for e in s["events"] or ()) for s in oom_spans)
    ctx.row("store", "OOM span: zoomer.gpu.oom event, status ERROR, error.type", len(oom_spans), oom_ok)
    ctx.row("store", f"{n.GPU_OOM_COUNT} metric", oom_points, bool(oom_points and oom_points >= 1))
    nvml = sorted(m for m in metrics if m.startswith("hw.") or (m.startswith("zoomer.gpu.") and m not in (
        n.GPU_OOM_COUNT, n.EVENTS_UNATTRIBUTED, n.HISTORY_OVERRUNS)))
    needed = {n.HW_GPU_UTILIZATION, n.HW_GPU_MEMORY_USAGE, n.HW_GPU_MEMORY_LIMIT, n.HW_POWER, n.HW_ENERGY}
    ctx.row("store", "NVML metrics seen", ", ".join(nvml) or "none", needed <= set(nvml))


def check_timeline(ctx: Context) -> None:
    """Step 8 (C19): the merged timeline of the first kernel trace and the store; see the module docstring."""
    from zoomer_serve.analysis import analyze
    from zoomer_serve.analysis.perfetto import (
        linked_requests,
        ranges_outside_spans,
        read_timeline,
        write_perfetto,
    )

    traces = ctx.facts.get("kernel_traces") or []
    if not traces:
        ctx.row("timeline", "a trace of the profile step", "none was written", False)
        return
    _close_store(ctx)
    result = analyze([traces[0]], ctx.store)
    trace = result.traces[0].trace
    ctx.row("timeline", "trace time base (baseTimeNanoseconds)", trace.base_time_ns or "none: ts are epoch µs")
    out = ctx.out / "merged.pftrace"
    counts = write_perfetto(out, [trace], result.store)
    tl = read_timeline(out)
    covered = len(result.traces[0].tables["request_gpu_time"])
    ctx.row("timeline", "request ranges linked to their spans in the merged timeline",
            f"{counts['linked_requests']} of {covered} ({out})", covered > 0 and counts["linked_requests"] == covered)
    checked, outside = ranges_outside_spans(tl, TIMELINE_TOLERANCE_NS)
    ctx.row("timeline", "ranges inside their spans (within 1 ms)",
            f"{checked - len(outside)} of {checked}" + (f"; first outside: {outside[0]}" if outside else ""),
            checked > 0 and not outside)
    if not ctx.cuda:
        ctx.row("timeline", "kernels after their launch calls, within the requests' time", "needs CUDA: not checked")
        return
    launches = {fid: s for s in tl.slices if s.category == "cuda_runtime" for fid in s.flows_out}
    kernels = [s for s in tl.slices if s.category == "kernel"]
    early = [k for k in kernels for fid in k.flows_in if fid in launches and k.start_ns < launches[fid].start_ns]
    with_launch = sum(1 for k in kernels if any(fid in launches for fid in k.flows_in))
    ctx.row("timeline", "kernels that start after their launch call starts",
            f"{with_launch - len(early)} of {with_launch} with a launch flow ({len(kernels)} kernels)",
            with_launch > 0 and not early)
    pairs = linked_requests(tl)
    if pairs:
        lo = min(req.start_ns for req, _ in pairs) - TIMELINE_TOLERANCE_NS
        hi = max(req.end_ns for req, _ in pairs) + TIMELINE_TOLERANCE_NS
        inside = sum(1 for k in kernels if lo <= k.start_ns and k.end_ns <= hi)
        ctx.row("timeline", "kernels within the profiled requests' time (first start to last end, ± 1 ms)",
                f"{inside} of {len(kernels)}", inside == len(kernels) > 0)


def check_batching(ctx: Context) -> None:
    """Step 7: kernel time and GPU memory of batches shared among their members (see the module docstring)."""
    from interceptors import ZoomerServerInterceptor
    from zoomer_serve.batching import names as bn
    from zoomer_serve.demo.load import drive_load
    from zoomer_serve.demo.model import build_model
    from zoomer_serve.demo.service import ServiceConfig, build_server
    from zoomer_serve.profiling import ProfilerConfig, ProfilerController, SessionOptions, load_trace
    from zoomer_serve.profiling.labels import parse_batch_label, parse_member_label
    from zoomer_serve.profiling.summary import summarize_events
    from zoomer_serve.recording import records as r

    device = "cuda" if ctx.cuda else "cpu"
    recorder = ctx.telemetry.recorder
    taken: list[tuple[Any, ...]] = []
    forward_sink = recorder.sink

    def tap(record: tuple[Any, ...]) -> None:  # keep the batch spans and their members, hand everything on
        if record[r.R_NAME] == bn.SPAN_NAME_PREFIX + "ranker" or bn.BATCH_ID in record[r.R_ATTRS]:
            taken.append(record)
        forward_sink(record)

    server, port = build_server(build_model(device=device), interceptors=[ZoomerServerInterceptor(recorder)],
                                max_workers=BATCH_CLIENTS + 2,
                                config=ServiceConfig(batch_max_size=BATCH_MAX_SIZE, batch_max_delay_ms=BATCH_MAX_DELAY_MS))
    target = f"127.0.0.1:{port}"
    controller = ProfilerController(ProfilerConfig(profiles_dir=ctx.out / "profiles_batching"), ctx.telemetry).attach()
    recorder.sink = tap
    try:
        drive_load(target, 5.0, clients=4, batch_size=64, max_requests=40, invalid_share=0.0, stream_share=0.0)
        reply = controller.start(SessionOptions(max_requests=BATCH_PROFILE_REQUESTS, cuda=ctx.cuda))
        ctx.row("batching", f"session on the batching demo server ({device}, batches of up to {BATCH_MAX_SIZE})",
                reply.message, reply.session is not None)
        load = drive_load(target, 60.0, clients=BATCH_CLIENTS, batch_size=64, max_requests=BATCH_PROFILE_REQUESTS,
                          invalid_share=0.0, stream_share=0.0)
        finished = controller.wait_idle(120)
    finally:
        controller.close(timeout_s=60)
        server.stop(2.0).wait(10)
        recorder.sink = forward_sink
    info = controller.last
    ok = bool(finished and info and info.outcome == "done" and info.requests == load.total_calls)
    ctx.row("batching", "session done, one covered request per call",
            f"{info.requests if info else 0} of {load.total_calls} calls", ok)
    if info is None or info.trace_path is None:
        return
    events = load_trace(info.trace_path)["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and parse_batch_label(str(e.get("name", "")))]
    markers = [m for m in (parse_member_label(str(e.get("name", ""))) for e in events
                           if e.get("cat") == "user_annotation") if m is not None]
    sizes = sorted({len([m for m in markers if m[0] == parse_batch_label(b["name"])[1]]) for b in ranges})
    ctx.row("batching", "batch ranges in the trace; members marked (batch sizes seen)",
            f"{len(ranges)}; {len(markers)} ({', '.join(map(str, sizes))})",
            len(ranges) > 0 and len(markers) == load.total_calls)
    full = summarize_events(events)
    own = summarize_events([e for e in events if not str(e.get("name", "")).startswith("zoomer.batch")])
    what, field = ("kernel time", "kernel_time_us") if ctx.cuda else ("CPU operators (no CUDA)", "cpu_op_count")
    # without the batch labels the batches' kernels are nobody's: the difference is what the batch ranges held
    held = full.attributed.kernel_time_us - own.attributed.kernel_time_us if ctx.cuda \
        else sum(1 for e in events if e.get("cat") == "cpu_op" and _inside_any(e, ranges))
    shared = sum(getattr(p, field) for p in full.requests.values()) - sum(getattr(p, field)
                                                                          for p in own.requests.values())
    ratio = shared / held if held else 0.0
    ctx.row("batching", f"members' shares of the {what} inside batch ranges (target 100 % +- 1 %)",
            f"{shared:,.1f} of {held:,.1f} ({ratio:.1%})", held > 0 and abs(ratio - 1.0) <= 0.01)
    _check_batch_records(ctx, taken)


def _inside_any(ev: dict[str, Any], ranges: list[dict[str, Any]]) -> bool:
    return any((ev.get("pid"), ev.get("tid")) == (b.get("pid"), b.get("tid")) and b["ts"] <= ev["ts"] <= b["ts"] + b["dur"]
               for b in ranges)


def _check_batch_records(ctx: Context, taken: list[tuple[Any, ...]]) -> None:
    """The rows of step 7 on the recorded batch spans and members: phase time and GPU memory shares."""
    from zoomer_serve.batching import names as bn
    from zoomer_serve.recording import records as r
    from zoomer_serve.telemetry import names as gn

    batches = {f"{rec[r.R_SPAN_ID]:016x}": rec for rec in taken if rec[r.R_NAME].startswith(bn.SPAN_NAME_PREFIX)}
    members: dict[str, list[dict[str, Any]]] = {}
    for rec in taken:
        if bn.BATCH_ID in rec[r.R_ATTRS] and rec[r.R_KIND] == r.KIND_SERVER:
            members.setdefault(rec[r.R_ATTRS][bn.BATCH_ID], []).append(rec[r.R_ATTRS])
    phase_bad = 0
    for bid, group in members.items():
        batch = batches.get(bid)
        if batch is None:
            continue
        for j, child in enumerate([c for c in r.child_records(batch) if c[r.R_ATTRS].get("zoomer.phase")]):
            if sum(m[bn.PHASE_SHARE_NS][j] for m in group) != child[r.R_END_NS] - child[r.R_START_NS]:
                phase_bad += 1
    ctx.row("batching", "batches recorded; members' phase-time shares add up to each phase (exact)",
            f"{len(batches)} batches, {sum(map(len, members.values()))} members; {phase_bad} phases off",
            bool(batches) and phase_bad == 0)
    if not ctx.cuda:
        ctx.row("batching", "members' shares of GPU working memory and cudaMalloc calls", "needs CUDA: not checked")
        return
    checked = bad = 0
    for bid, group in members.items():
        batch = batches.get(bid)
        if batch is None or gn.MEM_PEAK not in batch[r.R_ATTRS]:
            continue
        a = batch[r.R_ATTRS]
        checked += 1
        working = a[gn.MEM_PEAK] - a[gn.MEM_ALLOCATED_START]
        if sum(m.get(bn.GPU_PEAK_SHARE, 0) for m in group) != max(0, working) or \
                sum(m.get(bn.GPU_DEVICE_ALLOCS_SHARE, 0) for m in group) != a[gn.MEM_DEVICE_ALLOCS]:
            bad += 1
    peaks = sorted(batch[r.R_ATTRS][gn.MEM_PEAK] - batch[r.R_ATTRS][gn.MEM_ALLOCATED_START]
                   for batch in batches.values() if gn.MEM_PEAK in batch[r.R_ATTRS])
    ctx.row("batching", "members' shares of GPU working memory (peak - allocated at start) and cudaMalloc calls "
            "add up to their batch's (exact)", f"{checked - bad} of {checked} batches; median working memory "
            f"{peaks[len(peaks) // 2] if peaks else 0:,} B", checked > 0 and bad == 0)


def check_cpu_profile(ctx: Context) -> None:
    """``--cpu``: a CPU profiling session of CPU_PROFILE_REQUESTS calls on the demo server (for step 8)."""
    from zoomer_serve.profiling import ProfilerConfig, ProfilerController

    _start_server(ctx, device="cpu")
    controller = ProfilerController(ProfilerConfig(profiles_dir=ctx.out / "profiles"), ctx.telemetry).attach()
    try:
        _kernel_session(ctx, "cpu_profile", controller, ctx.target, CPU_PROFILE_REQUESTS, cuda=False)
    finally:
        controller.close(timeout_s=60)


STEPS: list[Callable[[Context], None]] = [check_load, check_oom, check_overhead, check_c06, check_profiler_kernels,
                                          check_aio_kernels, check_batching, check_store, check_timeline]
CPU_STEPS: list[Callable[[Context], None]] = [check_cpu_profile, check_batching, check_timeline]


# -- helpers -----------------------------------------------------------------------------------------------
def _start_server(ctx: Context, device: str = "cuda") -> None:
    import grpc

    from interceptors import ZoomerServerInterceptor
    from zoomer_serve.demo.model import build_model
    from zoomer_serve.demo.service import build_server

    def add_oom_service(server: grpc.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            OOM_SERVICE, {OOM_METHOD: grpc.unary_unary_rpc_method_handler(_force_oom)}),))

    model = build_model(device=device)
    ctx.server, port = build_server(model, "127.0.0.1", 0, interceptors=[ZoomerServerInterceptor()],
                                    extra_servicers=[add_oom_service])
    ctx.target = f"127.0.0.1:{port}"


def _force_oom(request: bytes, context: Any) -> bytes:
    """Allocate 1.5x the device's memory on a side stream; catch the OOM like a careful handler would."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    side = torch.cuda.Stream()
    try:
        with torch.cuda.stream(side):
            torch.empty(int(total * 1.5), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        return b"caught"
    return b"no OOM"


def _stop_server(ctx: Context) -> None:
    if ctx.server is not None:
        ctx.server.stop(2.0).wait(10)
        ctx.server = None


def _close_store(ctx: Context) -> None:
    """Stop the server, flush telemetry and stop the collector (once), so that the store can be read."""
    import zoomer_serve

    if ctx.facts.get("store_closed"):
        return
    _stop_server(ctx)
    zoomer_serve.shutdown(timeout_s=10)
    ctx.collector.stop()
    ctx.facts["store_closed"] = True


def _snapshot_during_load(ctx: Context, out: dict[str, Any]) -> None:
    time.sleep(min(5.0, ctx.args.seconds / 2))
    try:
        out["result"] = ctx.telemetry.gpu.dump_snapshot(str(ctx.out / "memory_snapshot.pickle"),
                                                        timeout_s=ctx.args.snapshot_budget)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"


def _rows(con: Any, sql: str) -> list[dict[str, Any]]:
    cur = con.execute(sql)
    cols = [d[0] for d in cur.description]
    rows = [dict(zip(cols, row)) for row in cur.fetchall()]
    for row in rows:
        for key in ("attributes", "events"):
            if isinstance(row.get(key), str):
                row[key] = json.loads(row[key])
        row["attributes"] = row.get("attributes") or {}
    return rows


def _configure(ctx: Context) -> None:
    import zoomer_serve
    from zoomer_serve.collector import EmbeddedCollector

    ctx.collector = EmbeddedCollector(ctx.store, host="127.0.0.1", grpc_port=0, http_port=0)
    ctx.collector.start()
    env = dict(os.environ)
    env.update({"ZOOMER_GPU": "on", "ZOOMER_GPU_MEMORY_HISTORY": "true", "ZOOMER_GPU_MEMORY_HISTORY_STACKS": "python",
                "ZOOMER_GPU_MEMORY_HISTORY_DRAIN_MS": "250", "ZOOMER_GPU_NVML_PERIOD_MS": "500"} if ctx.cuda
               else {"ZOOMER_GPU": "off"})
    cfg = zoomer_serve.ZoomerConfig.from_env(env)
    ctx.telemetry = zoomer_serve.configure(service_name="gpu-check", endpoint=f"http://127.0.0.1:{ctx.collector.grpc_port}",
                                           protocol="grpc", export_mode="process", schedule_delay_ms=200,
                                           metric_export_interval_ms=2000, config=cfg)
    gpu = ctx.telemetry.gpu
    if ctx.cuda and (gpu is None or gpu.observer is None or gpu.sampler is None):
        raise RuntimeError(f"GPU telemetry did not start fully: {gpu!r} (see the warning above)")


def _print_table(rows: list[tuple[str, str, str, bool | None]], value_width: int = 72) -> None:
    """Print the rows as a table; long values wrap within their column."""
    import textwrap

    wrapped = [(step, what, textwrap.wrap(value, value_width) or [""], ok) for step, what, value, ok in rows]
    w_step = max([len("step")] + [len(r[0]) for r in rows])
    w_what = max([len("check")] + [len(r[1]) for r in rows])
    w_value = max([len("value")] + [len(line) for r in wrapped for line in r[2]])
    print(f"{'step':<{w_step}}  {'check':<{w_what}}  {'value':<{w_value}}  result")
    for step, what, lines, ok in wrapped:
        mark = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"{step:<{w_step}}  {what:<{w_what}}  {lines[0]:<{w_value}}  {mark}")
        for line in lines[1:]:
            print(f"{'':<{w_step}}  {'':<{w_what}}  {line}")


def _watchdog(ctx: Context) -> None:
    """Ends the process when the check runs past its deadline: a hang is a failure, not a wait."""
    time.sleep(DEADLINE_S)
    ctx.row("deadline", f"the check ran past {DEADLINE_S} s", "aborted", False)
    _print_table(ctx.rows)
    os._exit(3)


RANGES = (Range("--seconds", 0, 3600, low_open=True), Range("--overhead-seconds", 0, 600, low_open=True),
          Range("--snapshot-budget", 0, 600, low_open=True))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="load duration (s)")
    parser.add_argument("--overhead-seconds", type=float, default=8.0, help="each on/off latency run (s)")
    parser.add_argument("--snapshot-budget", type=float, default=20.0, help="C07 snapshot time budget (s)")
    parser.add_argument("--out", type=Path, default=None, help="where to keep the store and the snapshot")
    parser.add_argument("--cpu", action="store_true",
                        help="no GPU: run the CPU profiling session and the timeline check up to the CUDA-only rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv, RANGES)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "nothing checked. Run it on a machine with an NVIDIA GPU and a CUDA build of torch (--cpu runs the "
              "steps that need none).")
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="zoomer-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, out, out / "gpu-check.duckdb", cuda=not args.cpu)
    threading.Thread(target=_watchdog, args=(ctx,), daemon=True).start()
    device = torch.cuda.get_device_name() if ctx.cuda else "CPU only (--cpu)"
    print(f"gpu_check: {device} (torch {torch.__version__}); output in {out}", flush=True)
    started = time.monotonic()
    try:
        _configure(ctx)
    except Exception as exc:
        ctx.row("setup", "collector and GPU telemetry", f"{type(exc).__name__}: {exc}", False)
        _print_table(ctx.rows)
        return 1
    for step in STEPS if ctx.cuda else CPU_STEPS:
        t0 = time.monotonic()
        try:
            step(ctx)
        except Exception as exc:
            ctx.row(step.__name__, "raised", f"{type(exc).__name__}: {exc}", False)
        print(f"gpu_check: {step.__name__} done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    _stop_server(ctx)
    ctx.row("total", "wall time", f"{time.monotonic() - started:.0f} s", time.monotonic() - started < DEADLINE_S)
    _print_table(ctx.rows)
    return 0 if all(ok is not False for *_, ok in ctx.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
