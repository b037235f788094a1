"""The Kineto capture on the torch versions pyproject.toml admits (torch>=2.4,<2.16)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from zoomer_serve.profiling.capture import Activities, Capture, CaptureError
from zoomer_serve.profiling.config import SessionOptions

REAL_CONFIG = torch.profiler._ExperimentalConfig


def _config_without(*missing: str) -> Any:
    """``_ExperimentalConfig`` as a torch without the ``missing`` keywords builds it: the real class, which
    refuses those keywords with the TypeError pybind11 raises for an unknown keyword."""

    def build(**kwargs: Any) -> Any:
        unknown = sorted(set(kwargs) & set(missing))
        if unknown:
            raise TypeError(f"__init__(): incompatible constructor arguments. Invoked with: kwargs: {unknown}")
        return REAL_CONFIG(**kwargs)

    return build


def _capture_ops(tmp_path: Path) -> set[str]:
    """Profile a matmul on a second thread (profile_all_threads is what lets it be seen); the op names."""
    capture = Capture(SessionOptions(cuda=False), Activities(cuda=False))
    capture.start()
    worker = threading.Thread(target=lambda: torch.mm(torch.ones(64, 64), torch.ones(64, 64)))
    worker.start()
    worker.join()
    capture.stop()
    path = tmp_path / "trace.json"
    capture.export_json(path)
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "cpu_op"}


def test_capture_on_a_torch_without_trace_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 (the CUDA build on the GPU check machine) has ``profile_all_threads`` but not ``trace_only``:
    the capture starts without it and still records the other thread's ops (the GPU check's kernel step
    failed there with 'cannot profile all threads')."""
    monkeypatch.setattr(torch.profiler, "_ExperimentalConfig", _config_without("trace_only"))
    assert "aten::mm" in _capture_ops(tmp_path)


def test_capture_on_a_torch_without_profile_all_threads_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.profiler, "_ExperimentalConfig", _config_without("trace_only", "profile_all_threads"))
    capture = Capture(SessionOptions(cuda=False), Activities(cuda=False))
    with pytest.raises(CaptureError, match=r"cannot profile all threads .*profile_all_threads"):
        capture.start()


def test_capture_records_other_threads_on_this_torch(tmp_path: Path) -> None:
    assert "aten::mm" in _capture_ops(tmp_path)


def test_stop_first_switches_off_operators_on_other_threads(tmp_path: Path) -> None:
    """The stop's quiescing (the race of torch 2.13 that crashed a suite run: see capture's module docstring):
    once it has run, operators that other threads start are no longer recorded, while those before it are."""
    capture = Capture(SessionOptions(cuda=False), Activities(cuda=False))

    def on_a_new_thread(n: int) -> None:
        worker = threading.Thread(target=lambda: [torch.mm(torch.ones(8, 8), torch.ones(8, 8)) for _ in range(n)])
        worker.start()
        worker.join()

    capture.start()
    on_a_new_thread(3)
    capture._quiesce()
    on_a_new_thread(5)
    capture.stop()
    path = tmp_path / "trace.json"
    capture.export_json(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "aten::mm") == 3
