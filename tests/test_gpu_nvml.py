"""NVML hardware metrics: the sampler over the fake NVML (every field, MIG, GPM, unsupported fields: C08),
exported through the SDK MeterProvider over real OTLP into the embedded collector; and, for real on this
machine, nvidia-ml-py installed without a driver (C09)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pynvml
import pytest

import zoomer_serve
from zoomer_serve.recording import RequestRecorder
from zoomer_serve.recording import records as r
from zoomer_serve.telemetry import GpuTelemetryConfig, NvmlSampler, NvmlUnavailable
from zoomer_serve.telemetry import names as n
from zoomer_serve.telemetry.gpu import install_gpu_telemetry

sys.path.insert(0, str(Path(__file__).parent))
from _fake_gpu import FakeCudaMemory, FakeGpu, FakeNvml

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]


def _latest(points, **attrs):
    """The latest point (the reader may export more than once) whose attributes include ``attrs``; exactly
    one series must match."""
    hits = [p for p in points if all(p["attributes"].get(k) == v for k, v in attrs.items())]
    assert hits and len({tuple(sorted(p["attributes"].items())) for p in hits}) == 1, (attrs, points)
    return max(hits, key=lambda p: p["time_ns"])


@pytest.mark.slow
def test_every_metric_reaches_the_store_with_hardware_attributes(telemetry, collector):
    clock = [100.0]
    nvml = FakeNvml([FakeGpu(processes=[(os.getpid(), 3 * GiB), (1, 5 * GiB)])])
    sampler = NvmlSampler(nvml, clock=lambda: clock[0])
    sampler.open()
    sampler.register_metrics(telemetry.meter_provider.get_meter("zoomer_serve.telemetry.gpu"))
    sampler.sample()
    clock[0] += 2.0
    sampler.sample()  # the second sample: GPM has two samples to compare, PCIe has 2 s to integrate
    sampler.close()
    base = {n.HW_ID: "GPU-fake-0000", n.HW_TYPE: "gpu", n.HW_NAME: "NVIDIA H100 80GB HBM3"}

    def point(metric, **extra):
        return _latest(collector.metric_points(metric), **base, **extra)["value"]

    assert point(n.HW_GPU_UTILIZATION, **{n.HW_GPU_TASK: "general"}) == pytest.approx(0.37)
    assert point(n.HW_GPU_MEMORY_USAGE) == 20 * GiB
    assert point(n.HW_GPU_MEMORY_LIMIT) == 80 * GiB
    assert point(n.HW_GPU_MEMORY_UTILIZATION) == pytest.approx(0.25)
    assert point(n.HW_POWER) == pytest.approx(250.0)
    assert point(n.HW_ENERGY) == pytest.approx(1000.0)
    assert point(n.HW_GPU_IO, **{n.NETWORK_IO_DIRECTION: "receive"}) == pytest.approx(1000 * 1024 * 2.0)
    assert point(n.HW_GPU_IO, **{n.NETWORK_IO_DIRECTION: "transmit"}) == pytest.approx(500 * 1024 * 2.0)
    assert point(n.GPU_MEMORY_BUSY) == pytest.approx(0.12)
    assert point(n.GPU_CLOCK_SM) == 1980
    assert point(n.GPU_TEMPERATURE) == 55
    assert point(n.GPU_CLOCK_EVENT_ACTIVE, **{n.CLOCK_EVENT_REASON: "sw_power_cap"}) == 1
    assert point(n.GPU_CLOCK_EVENT_ACTIVE, **{n.CLOCK_EVENT_REASON: "hw_thermal_slowdown"}) == 0
    assert point(n.GPU_PROCESS_MEMORY_USAGE, **{n.PROCESS_PID: os.getpid()}) == 3 * GiB
    assert point(n.GPU_BAR1_MEMORY_USAGE) == GiB
    assert point(n.GPU_BAR1_MEMORY_LIMIT) == 128 * GiB
    assert point(n.GPU_SM_OCCUPANCY) == pytest.approx(0.40)
    assert point(n.GPU_TENSOR_ACTIVITY) == pytest.approx(0.25)
    assert point(n.GPU_DRAM_BANDWIDTH_UTILIZATION) == pytest.approx(0.60)
    assert collector.metric_points(n.NVML_UNSUPPORTED) == []
    assert nvml.shutdowns == 1 and nvml.gpm_freed == nvml.gpm_allocated == 2


def test_request_spans_carry_the_latest_utilization_sample_without_calling_nvml():
    got: list = []
    rec = RequestRecorder(sink=got.append, otel_context=False)
    nvml = FakeNvml([FakeGpu(util_gpu=81)])
    gpu = install_gpu_telemetry(GpuTelemetryConfig(mode="on"), rec, None, memory_source=FakeCudaMemory(), nvml=nvml)
    try:
        calls = sum(nvml.calls.values())
        for _ in range(3):
            rec.start("svc/M").end()
        assert sum(nvml.calls.values()) == calls  # nothing asked of NVML on the request path
        nvml.gpus[0].util_gpu = 20
        gpu.sample_now()
        rec.start("svc/M").end()
    finally:
        gpu.shutdown()
    assert [rec_[r.R_ATTRS][n.GPU_UTILIZATION] for rec_ in got] == [0.81, 0.81, 0.81, 0.20]


def test_a_cuda_device_is_matched_to_its_nvml_device_by_uuid_bytes():
    """torch reports a MIG instance's UUID without NVML's ``MIG-`` prefix: the request spans of a server on
    that instance still get its utilization and its OOMs its NVML hw.id."""

    class OnMig(FakeCudaMemory):
        def device_uuid(self, device):
            return "GPU-0A1B2C3D-aaaa"

    got: list = []
    rec = RequestRecorder(sink=got.append, otel_context=False)
    mig = FakeGpu(uuid="MIG-0a1b2c3d-AAAA", util_gpu=64, gpm=False)
    nvml = FakeNvml([FakeGpu(uuid="GPU-other", util_gpu=5, mig=[mig], gpm=False)])
    gpu = install_gpu_telemetry(GpuTelemetryConfig(mode="on"), rec, None, memory_source=OnMig(), nvml=nvml)
    try:
        gpu.sample_now()
        rec.start("svc/M").end()
    finally:
        gpu.shutdown()
    assert got[0][r.R_ATTRS][n.GPU_UTILIZATION] == pytest.approx(0.64)
    assert gpu.observer.device_attributes[0][n.HW_ID] == "MIG-0a1b2c3d-AAAA"


def test_unsupported_fields_are_reported_once_and_everything_else_keeps_flowing(caplog):
    """C08: one GPU answers NotSupported for utilization, power and BAR1 memory, and its MIG instance for
    utilization (as MIG instances do). Those fields are logged once and reported by
    zoomer.gpu.nvml.unsupported; NVML is not asked for them again; every other field and device keeps
    being sampled tick after tick."""
    mig = FakeGpu(uuid="MIG-fake-a", name="NVIDIA H100 MIG 1g.10gb", gpu_instance_id=7)
    gpu0 = FakeGpu(uuid="GPU-fake-0000", mig=[mig])
    gpu1 = FakeGpu(uuid="GPU-fake-0001", util_gpu=90)
    nvml = FakeNvml([gpu0, gpu1])
    for fn in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetBAR1MemoryInfo"):
        nvml.fail[("GPU-fake-0000", fn)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml.fail[("MIG-fake-a", "nvmlDeviceGetUtilizationRates")] = pynvml.NVML_ERROR_NOT_SUPPORTED
    sampler = NvmlSampler(nvml)
    sampler.open()
    assert [d.uuid for d in sampler.devices] == ["GPU-fake-0000", "MIG-fake-a", "GPU-fake-0001"]
    with caplog.at_level(logging.INFO, logger="zoomer_serve.telemetry"):
        for _ in range(5):
            sampler.sample()
    sampler.close()
    assert sampler.samples == 5
    unsupported_logs = [m for m in caplog.messages if "not supported" in m]
    assert len(unsupported_logs) == 4  # (gpu0: utilization, power, bar1_memory), (mig: utilization)
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 2 + 5  # once each on gpu0 and the MIG, every tick on gpu1
    unsupported = {(a[n.HW_ID], a[n.NVML_FIELD]) for a, _ in sampler.observations(n.NVML_UNSUPPORTED)}
    assert unsupported == {("GPU-fake-0000", "utilization"), ("GPU-fake-0000", "power"),
                           ("GPU-fake-0000", "bar1_memory"), ("MIG-fake-a", "utilization")}
    util = {a[n.HW_ID]: v for a, v in sampler.observations(n.HW_GPU_UTILIZATION)}
    assert util == {"GPU-fake-0001": pytest.approx(0.90)}
    memory = {a[n.HW_ID] for a, _ in sampler.observations(n.HW_GPU_MEMORY_USAGE)}
    assert memory == {"GPU-fake-0000", "MIG-fake-a", "GPU-fake-0001"}
    power = {a[n.HW_ID] for a, _ in sampler.observations(n.HW_POWER)}
    assert power == {"MIG-fake-a", "GPU-fake-0001"}
    (mig_attrs, _), = [(a, v) for a, v in sampler.observations(n.HW_GPU_MEMORY_USAGE) if a[n.HW_ID] == "MIG-fake-a"]
    assert mig_attrs[n.HW_PARENT] == "GPU-fake-0000"
    assert nvml.calls["nvmlGpmMigSampleGet"] == 5  # the MIG instance's GPM through its GPU and instance id
    assert {a[n.HW_ID] for a, _ in sampler.observations(n.GPU_SM_OCCUPANCY)} == {
        "GPU-fake-0000", "MIG-fake-a", "GPU-fake-0001"}


def test_other_nvml_errors_are_logged_once_and_retried_every_tick(caplog):
    nvml = FakeNvml([FakeGpu()])
    nvml.fail[("GPU-fake-0000", "nvmlDeviceGetTemperature")] = pynvml.NVML_ERROR_UNKNOWN
    nvml.fail[("GPU-fake-0000", "nvmlDeviceGetClockInfo")] = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    sampler = NvmlSampler(nvml)
    sampler.open()
    with caplog.at_level(logging.WARNING, logger="zoomer_serve.telemetry"):
        for _ in range(3):
            sampler.sample()
        assert sampler.observations(n.GPU_TEMPERATURE) == []  # no stale value while it fails
        del nvml.fail[("GPU-fake-0000", "nvmlDeviceGetTemperature")]
        sampler.sample()
    sampler.close()
    assert nvml.calls["nvmlDeviceGetTemperature"] == 4 and nvml.calls["nvmlDeviceGetClockInfo"] == 4
    assert len([m for m in caplog.messages if "temperature" in m]) == 1
    assert len([m for m in caplog.messages if "sm_clock" in m]) == 1
    assert [v for _, v in sampler.observations(n.GPU_TEMPERATURE)] == [55]
    assert sampler.observations(n.NVML_UNSUPPORTED) == []


def test_nvml_that_cannot_initialise_is_unavailable_with_its_reason():
    nvml = FakeNvml()
    nvml.fail[("*", "nvmlInit")] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        NvmlSampler(nvml).open()


def test_no_driver_means_one_warning_no_sampler_and_no_observer(caplog):
    """C09, for real: nvidia-ml-py is installed here, there is no NVIDIA driver and torch is a CPU build.
    GPU telemetry is off with one clear warning, no thread is started and no observer is on the request
    path. (torch is imported first, as in a PyTorch server: the probe never imports it itself.)"""
    import torch  # noqa: F401

    rec = RequestRecorder(otel_context=False)
    with caplog.at_level(logging.DEBUG, logger="zoomer_serve"):
        gpu = install_gpu_telemetry(GpuTelemetryConfig(), rec, None)
    assert gpu is None and rec.observers == ()
    records = [rec_ for rec_ in caplog.records if rec_.name.startswith("zoomer_serve.telemetry")]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "GPU telemetry off" in message and "NVML Shared Library Not Found" in message
    assert "torch.cuda.is_available() is False" in message
    assert not [t for t in threading.enumerate() if t.name == "zoomer-gpu"]


def test_no_driver_import_and_configure_work_without_future_warning(tmp_path):
    """C09, for real, in a fresh interpreter: importing pynvml and zoomer_serve and configuring telemetry
    raise no FutureWarning (we depend on nvidia-ml-py, not the deprecated pynvml package), and the log has
    exactly one GPU line."""
    code = ("import logging, warnings\n"
            "warnings.simplefilter('error', FutureWarning)\n"
            "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s %(message)s')\n"
            "import pynvml, zoomer_serve\n"
            "tel = zoomer_serve.configure(export_mode='none', set_global_providers=False)\n"
            "assert tel.gpu is None and all(o is tel.host.request_cpu for o in tel.recorder.observers)\n"
            "zoomer_serve.shutdown(timeout_s=1)\n"
            "print('OK')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZOOMER_GPU")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"
    gpu_lines = [line for line in proc.stderr.splitlines() if "GPU" in line or "NVML" in line]
    assert len(gpu_lines) == 1 and gpu_lines[0].startswith("WARNING zoomer_serve.telemetry"), proc.stderr
    assert "FutureWarning" not in proc.stderr


def test_configuring_again_does_not_repeat_the_gpu_warning(tmp_path):
    """C09: a server whose interceptor configured zoomer-serve from the environment first, then calls
    configure() in code, prints the GPU-off line once, not once per configure (and a third configure neither)."""
    code = ("import logging\n"
            "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s %(message)s')\n"
            "import zoomer_serve\n"
            "from interceptors import ZoomerServerInterceptor\n"
            "ZoomerServerInterceptor()\n"
            "for _ in range(2):\n"
            "    tel = zoomer_serve.configure(export_mode='none', set_global_providers=False)\n"
            "    assert tel.gpu is None\n"
            "zoomer_serve.shutdown(timeout_s=1)\n"
            "print('OK')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZOOMER_", "OTEL_"))}
    env["ZOOMER_EXPORT_MODE"] = "none"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"
    gpu_lines = [line for line in proc.stderr.splitlines() if "GPU" in line]
    assert len(gpu_lines) == 1 and "GPU telemetry off" in gpu_lines[0], proc.stderr


def test_gpu_off_installs_nothing_and_logs_nothing(caplog):
    with caplog.at_level(logging.DEBUG, logger="zoomer_serve"):
        tel = zoomer_serve.configure(export_mode="none", set_global_providers=False,
                                     config=_config({"ZOOMER_GPU": "off"}))
    try:
        assert tel.gpu is None and all(o is tel.host.request_cpu for o in tel.recorder.observers)  # no GPU one
        assert not [m for m in caplog.messages if "GPU" in m]
    finally:
        zoomer_serve.shutdown(timeout_s=1)


def test_bad_gpu_settings_name_the_variable():
    for env, variable in (({"ZOOMER_GPU": "maybe"}, "ZOOMER_GPU"),
                          ({"ZOOMER_GPU_DEVICES": "0,x"}, "ZOOMER_GPU_DEVICES"),
                          ({"ZOOMER_GPU_MEMORY_HISTORY_STACKS": "all"}, "ZOOMER_GPU_MEMORY_HISTORY_STACKS"),
                          ({"ZOOMER_GPU_NVML_PERIOD_MS": "0"}, "ZOOMER_GPU_NVML_PERIOD_MS"),
                          ({"ZOOMER_GPU_PEAK": "sometimes"}, "ZOOMER_GPU_PEAK")):
        with pytest.raises(zoomer_serve.ConfigError, match=variable):
            _config(env)
    cfg = _config({"ZOOMER_GPU_DEVICES": "1, 3", "ZOOMER_GPU_MEMORY_HISTORY": "on",
                   "ZOOMER_GPU_MEMORY_HISTORY_MAX_ENTRIES": "500", "ZOOMER_GPU_NVML_PERIOD_MS": "250"}).gpu
    assert (cfg.devices, cfg.history, cfg.history_max_entries, cfg.nvml_period_ms) == ((1, 3), True, 500, 250)


def _config(env):
    return zoomer_serve.ZoomerConfig.from_env(env)
