"""Automatic profiling triggers: steady state after warm-up, and a latency SLO driven by an injected slow
phase, each firing exactly once against the real demo model server under load, with real torch.profiler
sessions and real OTLP export; plus the window rules on exact, synthetic timings."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _profiling_support import (
    PREDICT,
    check_profile_export,
    read_chrome_trace,
    request_ranges,
    serve_with_profiling,
    traces,
)

from zoomer_serve.demo.load import drive_load
from zoomer_serve.demo.model import DLRM, build_model
from zoomer_serve.profiling import (
    LatencySloConfig,
    ProfilerConfig,
    ProfilerController,
    SessionOptions,
    SteadyStateConfig,
)
from zoomer_serve.profiling.triggers import TriggerMonitor

MS = 1_000_000


@pytest.fixture(scope="module")
def model() -> DLRM:
    torch.set_num_threads(1)
    return build_model(device="cpu")


def _load_until(target: str, done: Any, limit_s: float, **load: Any) -> None:
    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        result = drive_load(target, 0.5, **load)
        assert result.unexpected == 0


@pytest.mark.slow
def test_steady_state_trigger_fires_once_after_warm_up(model: DLRM, telemetry: Any, collector: Any,
                                                       tmp_path: Path) -> None:
    steady = SteadyStateConfig(warmup_requests=30, window_ms=300, windows=3, min_requests=4, max_cv=0.5,
                               session=SessionOptions(max_requests=15))
    with serve_with_profiling(telemetry, model, tmp_path / "profiles", steady_state=steady) as served:
        _load_until(served.target, lambda: served.controller.last is not None, 60.0, clients=2, batch_size=8)
        _load_until(served.target, lambda: False, 2.0, clients=2, batch_size=8)  # still steady: no second one
        assert served.controller.wait_idle(30)
        info = served.controller.last
    assert info is not None and info.number == 1 and info.trigger == "steady_state" and info.outcome == "done"
    assert info.requests == 15 and traces(tmp_path / "profiles") == [Path(info.trace_path)]
    ranges = request_ranges(read_chrome_trace(Path(info.trace_path)))
    rows = collector.spans()
    profile = check_profile_export(rows, info.session_id, set(ranges), "steady_state")
    attrs = profile["attributes"]
    assert attrs["zoomer.profile.trigger.cv"] <= 0.5 and attrs["zoomer.profile.trigger.p50_ms"] > 0
    before = [r for r in rows if r["kind"] == "SERVER" and r["end_ns"] < info.start_time_unix_nano]
    assert len(before) >= 30 + 3 * 4  # warm-up, then three counted windows


@pytest.mark.slow
def test_latency_slo_trigger_fires_once_on_a_slow_phase(model: DLRM, telemetry: Any, collector: Any,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = {"on": False}
    forward = model.forward

    def maybe_slow_forward(*args: Any, **kwargs: Any) -> Any:
        if slow["on"]:
            time.sleep(0.3)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", maybe_slow_forward)
    slo = LatencySloConfig(p99_ms=200, window_ms=500, sustain_windows=2, min_requests=4, cooldown_ms=600_000,
                           methods=(PREDICT,), session=SessionOptions(max_requests=10))
    load = {"clients": 4, "batch_size": 8, "stream_share": 0.0, "invalid_share": 0.0}
    with serve_with_profiling(telemetry, model, tmp_path / "profiles", latency_slo=slo) as served:
        _load_until(served.target, lambda: False, 2.0, **load)
        assert served.controller.last is None and served.controller.state.value == "idle"  # fast: quiet
        slow["on"] = True
        slow_since = time.time_ns()
        _load_until(served.target, lambda: served.controller.last is not None, 60.0, **load)
        _load_until(served.target, lambda: False, 2.0, **load)  # still slow, but cooling down
        slow["on"] = False
        _load_until(served.target, lambda: False, 1.0, **load)
        assert served.controller.wait_idle(30)
        info = served.controller.last
    assert info is not None and info.number == 1 and info.trigger == "latency_slo" and info.outcome == "done"
    assert info.start_time_unix_nano > slow_since  # the slow phase set it off (windows are epoch-aligned)
    assert traces(tmp_path / "profiles") == [Path(info.trace_path)]
    ranges = request_ranges(read_chrome_trace(Path(info.trace_path)))
    assert len(ranges) == info.requests == 10
    profile = check_profile_export(collector.spans(), info.session_id, set(ranges), "latency_slo")
    attrs = profile["attributes"]
    assert attrs["zoomer.profile.trigger.method"] == PREDICT
    assert attrs["zoomer.profile.trigger.p99_ms"] > 200 and attrs["zoomer.profile.trigger.threshold_ms"] == 200
    assert attrs["zoomer.profile.request.duration_p50_ms"] >= 300  # it profiled the slow requests


def _spans(telemetry: Any, name: str, ends_ms: list[float], duration_ms: float, t0_ns: int) -> list[tuple[Any, int]]:
    out = []
    for end in ends_ms:
        end_ns = t0_ns + int(end * MS)
        span = telemetry.recorder.start(name, start_ns=end_ns - int(duration_ms * MS))
        out.append((span, end_ns))
    return out


def test_window_rules_on_exact_timings(telemetry: Any, tmp_path: Path) -> None:
    """SLO: a gap or a thin window resets the run; one session per sustained violation, then quiet for the
    cooldown after that session ends. Steady state: only after warm-up, once, when the p50s agree."""
    controller = ProfilerController(ProfilerConfig(profiles_dir=tmp_path / "p"), telemetry)
    quick = SessionOptions(duration_ms=50)
    slo = LatencySloConfig(p99_ms=100, window_ms=100, sustain_windows=2, min_requests=3, cooldown_ms=1000,
                           session=quick)
    steady = SteadyStateConfig(warmup_requests=5, window_ms=100, windows=3, min_requests=3, max_cv=0.05,
                               session=quick)
    monitor = TriggerMonitor(controller, steady, slo)
    t0 = (time.time_ns() // (100 * MS) + 1) * 100 * MS  # a window boundary

    def feed(name: str, ends: list[float], dur: float) -> None:
        for span, end_ns in _spans(telemetry, name, ends, dur, t0):
            monitor.feed(span, end_ns)

    # window 0: slow (4); window 1: only 2 requests (thin); window 2, 3: slow -> fires at window 3's close
    feed(PREDICT, [10, 20, 30, 40], 150)
    feed(PREDICT, [110, 120], 150)
    feed(PREDICT, [210, 220, 230], 150)
    monitor.tick(t0 + 330 * MS)
    assert monitor.slo.fired == 0
    feed(PREDICT, [310, 320, 330], 150)
    monitor.tick(t0 + 430 * MS)
    assert monitor.slo.fired == 1
    first = controller.status().session
    assert first is not None and first.trigger == "latency_slo"
    assert controller.wait_idle(30)
    feed(PREDICT, [510, 520, 530, 610, 620, 630], 150)  # sustained again, but cooling down
    monitor.tick(t0 + 730 * MS)
    assert monitor.slo.fired == 1 and controller.last.number == 1
    # steady state: the first 5 requests were warm-up; windows 5, 6 (p50 150) and 7 (p50 10) disagree
    assert monitor.steady is not None and not monitor.steady.fired
    feed("other.Service/Call", [710, 720, 730], 10)
    monitor.tick(t0 + 830 * MS)
    assert not monitor.steady.fired
    feed("other.Service/Call", [810, 820, 830, 910, 920, 930], 10)
    monitor.tick(t0 + 1030 * MS)
    assert monitor.steady.fired and monitor.steady.session_number == 2
    assert controller.wait_idle(30) and controller.last.trigger == "steady_state"
    feed("other.Service/Call", [1010, 1020, 1030, 1110, 1120, 1130, 1210, 1220, 1230], 10)
    monitor.tick(t0 + 1330 * MS)
    assert controller.last.number == 2  # once
