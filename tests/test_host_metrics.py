"""Host telemetry metrics: opentelemetry-instrumentation-system-metrics (psutil) and the GC pause counter on
zoomer-serve's SDK meter provider, exported over real OTLP/gRPC into the real embedded collector, read back
from its ``metric_points`` table; and the ``ZOOMER_HOST*`` settings."""

from __future__ import annotations

import gc
import os
from typing import Any

import psutil
import pytest

import zoomer_serve
from zoomer_serve.config import ConfigError, ZoomerConfig
from zoomer_serve.host import GcPauses, HostConfig, known_metrics, parse_metrics

EXPECTED_UNITS = {
    "system.cpu.time": "s",
    "system.cpu.utilization": "1",
    "process.cpu.time": "s",
    "process.cpu.utilization": "1",
    "system.memory.usage": "By",
    "system.memory.utilization": "1",
    "process.memory.usage": "By",
    "process.memory.virtual": "By",
    "system.disk.io": "By",
    "system.disk.operations": "{operation}",
    "system.network.io": "By",
    "system.network.errors": "{error}",
    "process.open_file_descriptor.count": "{file_descriptor}",
    "process.thread.count": "{thread}",
    "process.context_switches": "{context_switch}",
    "cpython.gc.collections": "{collection}",
    "cpython.gc.pause.time": "s",
}


def latest(points: list[dict[str, Any]]) -> dict[tuple[tuple[str, Any], ...], dict[str, Any]]:
    """The last point of each attribute set."""
    out = {}
    for p in points:
        out[tuple(sorted(p["attributes"].items()))] = p
    return out


@pytest.mark.slow
def test_system_and_process_metrics_reach_the_store_with_conventional_names_units_and_attributes(
        telemetry: Any, collector: Any) -> None:
    assert telemetry.host is not None and telemetry.host.metrics is not None
    for _ in range(3):
        gc.collect()  # full collections: generation 2 pause time and collection count
    rss = psutil.Process(os.getpid()).memory_info().rss
    points = {name: collector.metric_points(name) for name in EXPECTED_UNITS}
    for name, unit in EXPECTED_UNITS.items():
        assert points[name], f"no {name} point in the store"
        assert {p["unit"] for p in points[name]} == {unit}, name
        assert {p["service_name"] for p in points[name]} == {"test-svc"}

    cpu = latest(points["system.cpu.utilization"])
    logical = {dict(k)["cpu.logical_number"] for k in cpu}
    assert logical == set(range(psutil.cpu_count()))  # per core, 0-based
    assert {dict(k)["cpu.mode"] for k in cpu} >= {"user", "system", "idle"}
    assert all(0.0 <= p["value"] <= 1.0 for p in cpu.values())
    assert len(latest(points["system.cpu.time"])) == len(cpu)

    used = latest(points["system.memory.usage"])[(("system.memory.state", "used"),)]["value"]
    assert 0 < used < psutil.virtual_memory().total
    mine = latest(points["process.memory.usage"])[()]["value"]
    assert rss / 2 < mine < rss * 2
    assert set(latest(points["process.cpu.time"])) == {(("cpu.mode", "system"),), (("cpu.mode", "user"),)}

    loopback = latest(points["system.network.io"])
    assert loopback[(("network.interface.name", "lo"), ("network.io.direction", "receive"))]["value"] > 0
    disk_keys = {k for k, _ in next(iter(latest(points["system.disk.io"])))}
    assert disk_keys == {"system.device", "disk.io.direction"}

    assert latest(points["process.thread.count"])[()]["value"] >= 2
    assert latest(points["process.open_file_descriptor.count"])[()]["value"] > 3
    switches = latest(points["process.context_switches"])
    assert {dict(k)["process.context_switch_type"] for k in switches} == {"voluntary", "involuntary"}

    collections = latest(points["cpython.gc.collections"])
    assert collections[(("cpython.gc.generation", 2),)]["value"] >= 3
    pauses = latest(points["cpython.gc.pause.time"])
    assert set(pauses) == {(("cpython.gc.generation", g),) for g in range(3)}
    assert pauses[(("cpython.gc.generation", 2),)]["value"] > 0
    assert all(p["is_monotonic"] for p in pauses.values())


def test_metric_groups_select_what_is_reported(collector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ZOOMER_HOST_METRICS=cpu,process.thread.count`` reports those and nothing else of the host's."""
    monkeypatch.setenv("ZOOMER_HOST_METRICS", "cpu,process.thread.count")
    tel = zoomer_serve.configure(service_name="groups", endpoint=collector.grpc_endpoint, protocol="grpc",
                                 export_mode="thread", timeout_ms=5000, set_global_providers=False)
    assert tel.host is not None and tel.host.metrics is not None and tel.host.metrics.gc_pauses is None
    assert collector.metric_points("process.thread.count")
    assert collector.metric_points("system.cpu.utilization")
    for absent in ("system.memory.usage", "system.network.io", "cpython.gc.collections", "cpython.gc.pause.time"):
        assert collector.metric_points(absent) == [], absent


def test_host_off_installs_nothing(collector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZOOMER_HOST", "off")
    tel = zoomer_serve.configure(service_name="off", endpoint=collector.grpc_endpoint, protocol="grpc",
                                 export_mode="thread", timeout_ms=5000, set_global_providers=False)
    assert tel.host is None
    assert tel.recorder.observers == ()
    span = tel.recorder.start("svc/M")
    span.end()
    assert "zoomer.request.cpu_time_ns" not in span.attributes
    assert collector.metric_points("process.memory.usage") == []


@pytest.mark.slow
def test_gc_pauses_count_time_per_generation() -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.pause_ns[0] > 0 and pauses.pause_ns[2] > 0
    before = list(pauses.pause_ns)
    gc.collect()
    assert pauses.pause_ns == before  # uninstalled: nothing counted
    assert pauses not in gc.callbacks


def test_settings_from_the_environment_and_their_errors() -> None:
    cfg = ZoomerConfig.from_env({"ZOOMER_HOST_METRICS": "gc, memory", "ZOOMER_CPU_PROFILE": "in-process",
                                 "ZOOMER_CPU_PROFILE_RATE_HZ": "250", "ZOOMER_HOST_REQUEST_CPU_TIME": "false"})
    host = cfg.host
    assert host.metrics == tuple(m for m in known_metrics() if m.startswith(("system.memory", "system.swap",
                                                                               "process.memory", "cpython.gc")))
    assert (host.cpu_profile, host.cpu_profile_rate_hz, host.request_cpu_time) == ("in-process", 250, False)
    assert HostConfig.from_env({}) == HostConfig()
    assert parse_metrics("none") == ()
    for env, needle in (({"ZOOMER_HOST": "maybe"}, "ZOOMER_HOST"),
                        ({"ZOOMER_HOST_METRICS": "cpu,temperature"}, "'temperature'"),
                        ({"ZOOMER_CPU_PROFILE": "perf"}, "ZOOMER_CPU_PROFILE"),
                        ({"ZOOMER_CPU_PROFILE_RATE_HZ": "0"}, "ZOOMER_CPU_PROFILE_RATE_HZ"),
                        ({"ZOOMER_CPU_PROFILE_RATE_HZ": "fast"}, "ZOOMER_CPU_PROFILE_RATE_HZ"),
                        ({"ZOOMER_CPU_PROFILE_TOP": "0"}, "ZOOMER_CPU_PROFILE_TOP")):
        with pytest.raises(ConfigError, match=needle):
            ZoomerConfig.from_env(env)
