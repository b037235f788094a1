"""One torch.profiler capture: the only place that starts, stops and exports the profiler.

The profiler is started with Kineto's ``profile_all_threads`` so that operators on every thread (the
server's worker threads) are recorded, not only those of the thread that started it. Start and stop
must run on the same thread (the controller's session thread does both). The lines Kineto writes to the
process's stderr on each start and stop go to the log at debug level (:mod:`.native_stderr`).

Stopping while other threads run operators can crash the process in torch 2.13: the profiler's callbacks on
those threads (``profile_all_threads``) still add to its record queue while the stop reads and frees it
(pytorch/pytorch#185741 and #187483 fix it in torch). :meth:`Capture.stop` first switches off the collection of
CPU operators (``toggle_collection_dynamic``) and waits :data:`QUIESCE_S` for the callbacks under way, so that
none is left when the stop reads the queue. A thread that starts operators for the first time in the session
during the stop was what crashed: ``benchmarks/profiler_stop_race.py`` counts crashes with and without this.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoomer_serve.profiling.config import SessionOptions
from zoomer_serve.profiling.native_stderr import kineto_lines_to_log

QUIESCE_S = 0.02
"""Seconds :meth:`Capture.stop` waits after switching off CPU operator collection, before the profiler's stop."""


class CaptureError(RuntimeError):
    """The profiler cannot capture: the message says why (another session, no CUDA, old torch ...)."""


@dataclass(frozen=True)
class Activities:
    """What a capture records: CPU always; ``cuda`` when requested or available."""

    cuda: bool

    @classmethod
    def resolve(cls, options: SessionOptions) -> Activities:
        """Raises CaptureError when CUDA is requested (``options.cuda`` True) but unavailable."""
        import torch

        available = torch.cuda.is_available() and torch.profiler.ProfilerActivity.CUDA in \
            torch.profiler.supported_activities()
        if options.cuda and not available:
            raise CaptureError("CUDA profiling was requested but CUDA (or CUPTI support in this torch build) "
                               "is not available")
        return cls(cuda=available if options.cuda is None else bool(options.cuda))


def profiler_active() -> bool:
    """True while any torch.profiler session runs in this process (torch's process-wide flag)."""
    import torch.autograd.profiler as autograd_profiler

    return bool(getattr(autograd_profiler, "_is_profiler_enabled", False))


class Capture:
    """A Kineto profiler session with ``options`` (see :class:`SessionOptions`).

    It drives ``torch.autograd.profiler.profile(use_kineto=True)`` (what ``torch.profiler.profile`` wraps)
    through its context-manager protocol: ``torch.profiler.profile`` probes ``torch._inductor`` on every
    start, which imports it (seconds of CPU under the interpreter lock in a serving process). The one thing
    that probe is for is kept: when inductor is already loaded with CUDA graphs on, CUPTI lazy re-init and
    teardown are turned off as ``torch.profiler`` does.
    """

    def __init__(self, options: SessionOptions, activities: Activities) -> None:
        self.options = options
        self.activities = activities
        self._prof: Any = None

    def start(self, metadata: dict[str, str] | None = None) -> None:
        """Start recording; ``metadata`` goes into the trace's top-level JSON. Raises CaptureError: another
        profiler session is active, Kineto is missing, or this torch cannot profile all threads; anything
        torch raises is wrapped in CaptureError."""
        import torch
        import torch.autograd.profiler as autograd_profiler

        if not torch.profiler.kineto_available():
            raise CaptureError("this torch build has no Kineto profiler")
        if profiler_active():
            raise CaptureError("another torch.profiler session is already running in this process")
        experimental = _experimental_config(trace_only=not self.options.with_stack)
        opts = self.options
        if self.activities.cuda:
            _keep_cupti_for_cuda_graphs()
        try:
            prof = autograd_profiler.profile(use_cpu=True, use_device="cuda" if self.activities.cuda else None,
                                             record_shapes=opts.record_shapes, profile_memory=opts.profile_memory,
                                             with_stack=opts.with_stack, with_flops=opts.with_flops,
                                             use_kineto=True, experimental_config=experimental)
            with kineto_lines_to_log():
                prof.__enter__()
        except Exception as exc:
            raise CaptureError(f"torch.profiler did not start: {exc!r}") from exc
        self._prof = prof
        for key, value in (metadata or {}).items():
            try:
                torch.autograd._add_metadata_json(key, json.dumps(value))
            except Exception:  # metadata is a nicety; the capture runs without it
                pass

    def stop(self) -> None:
        """Stop recording (with CUDA this synchronizes the device), after switching off CPU operator collection
        on every thread and waiting :data:`QUIESCE_S` (see the module docstring). Raises CaptureError."""
        try:
            with kineto_lines_to_log():
                self._quiesce()
                self._prof.__exit__(None, None, None)
        except Exception as exc:
            raise CaptureError(f"torch.profiler did not stop cleanly: {exc!r}") from exc

    def _quiesce(self) -> None:
        """Switch off the collection of CPU operators (the session's requests have drained by now; the kernels
        they launched are still collected) and let the callbacks under way on other threads finish."""
        import time

        import torch

        try:
            self._prof.toggle_collection_dynamic(False, [torch.profiler.ProfilerActivity.CPU])
        except Exception:  # a torch without it: stop as before
            return
        time.sleep(QUIESCE_S)

    def release(self) -> None:
        """Drop the profiler object and its Kineto results (every recorded event) once the trace is written,
        rather than when the session's last reference goes."""
        self._prof = None

    def export_json(self, path: Path) -> None:
        """Write the Chrome trace (plain JSON) to ``path``. Raises CaptureError."""
        try:
            self._prof.export_chrome_trace(str(path))
        except Exception as exc:
            raise CaptureError(f"exporting the trace to {path} failed: {exc!r}") from exc


def _experimental_config(trace_only: bool) -> Any:
    """Kineto's ``_ExperimentalConfig`` with ``profile_all_threads`` and, where this torch has it (2.13 has,
    2.11 has not), ``trace_only`` (no Python event tree built at stop; only the trace is exported). Raises
    CaptureError: this torch cannot profile all threads."""
    import torch

    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True, trace_only=trace_only)
    except TypeError:
        pass
    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError as exc:
        raise CaptureError(f"torch {torch.__version__} cannot profile all threads "
                           f"(_ExperimentalConfig(profile_all_threads=...) is missing): {exc}") from None


def _keep_cupti_for_cuda_graphs() -> None:
    """As ``torch.profiler.profile.start_trace`` does when inductor uses CUDA graphs (CUPTI teardown and
    lazy re-init crash with them), without importing inductor when it is not loaded."""
    config = sys.modules.get("torch._inductor.config")
    try:
        if config is not None and config.triton.cudagraphs:
            os.environ["DISABLE_CUPTI_LAZY_REINIT"] = "1"
            os.environ["TEARDOWN_CUPTI"] = "0"
    except AttributeError:
        pass
