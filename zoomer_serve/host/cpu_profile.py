"""Python CPU profiles of profiling sessions: every session (any trigger) also samples this process's Python
stacks, all threads, for the session's window, and writes them beside the kernel trace.

Samplers, in the order ``ZOOMER_CPU_PROFILE=auto`` tries them:

1. **py-spy** (a helper process that reads the server's memory from outside; the server pays almost nothing):
   ``py-spy record --pid <this process> --rate <rate> --format speedscope --function --nonblocking``. It
   records active samples only (py-spy leaves idle threads out: waiting on a lock, a socket, a sleep). Where
   py-spy is missing or cannot attach (no ptrace permission: containers without ``CAP_SYS_PTRACE``, Yama
   ``ptrace_scope`` 2 or 3), the reason is logged once per process and put on every session's span
   (``zoomer.profile.cpu.unavailable``), and py-spy is not tried again in this process. Under Yama
   ``ptrace_scope`` 1 the server names py-spy its tracer (``prctl(PR_SET_PTRACER)``) right after starting it.
   py-spy runs at a lower CPU priority (nice +10) than the server.
2. **in-process** (``auto``'s fallback, or chosen with ``in-process``): a daemon thread that reads
   ``sys._current_frames()`` at the rate, holding the interpreter lock for each sample (tens of µs with a few
   dozen threads). A thread's sample is *active* when its CPU clock advanced by at least
   :data:`ACTIVE_CPU_SHARE` of the time since the previous sample, else *idle*; idle samples go to separate
   profiles (``... (idle)``) in the file and into no top-N.

Files (``<session_id>`` as the kernel trace's, in the profiles folder):

- ``<session_id>.cpu.speedscope.json``: speedscope JSON, one sampled profile per thread (open it at
  https://www.speedscope.app or with the ``speedscope`` CLI);
- ``<session_id>.cpu.collapsed.txt``: collapsed stacks (``thread;outer (file:line);...;inner (file:line) count``)
  for ``flamegraph.pl``, speedscope, or any flame graph tool;
- ``<session_id>.cpu.pb.gz``: the same samples as pprof (``go tool pprof``, Pyroscope, Perfetto), labelled
  with ``thread`` and, for the in-process sampler, the ``trace_id``, ``span_id`` and ``rpc.method`` of the
  covered request each sample's thread ran (py-spy's samples cannot be tied to requests: see
  :mod:`zoomer_serve.host.pprof`).

A niced child process (:mod:`zoomer_serve.host.cpu_postprocess`) reads the speedscope file and writes the
collapsed stacks and the top-N summary, so a large profile costs the server neither its interpreter lock nor
its memory. The ``zoomer.profile`` span carries the paths, counts and the top-N (:mod:`zoomer_serve.host.names`).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import CodeType
from typing import Any

from zoomer_serve.host import names as n
from zoomer_serve.host.config import HostConfig
from zoomer_serve.host.pprof import PPROF_SUFFIX
from zoomer_serve.host.speedscope import (
    IDLE_SUFFIX,
    CpuProfileSummary,
    Frame,
    SampledProfile,
    write_speedscope,
)
from zoomer_serve.processes import PACKAGE_ROOT, run_module
from zoomer_serve.profiling.labels import THREAD_REQUESTS

logger = logging.getLogger("zoomer_serve.host")
SPEEDSCOPE_SUFFIX = ".cpu.speedscope.json"
COLLAPSED_SUFFIX = ".cpu.collapsed.txt"
ACTIVE_CPU_SHARE = 0.1
"""In-process sampler: a sample is active when the thread ran at least this share of the interval."""
MAX_STACKS = 50_000
"""In-process sampler: distinct (thread, state, stack) entries kept; samples of new stacks beyond are dropped
(counted)."""
MAX_DEPTH = 256
DURATION_MARGIN_S = 60.0
"""A sampler stops on its own this long after the session's longest possible window (when nobody stops it)."""
STOP_TIMEOUT_S = 10.0
POSTPROCESS_TIMEOUT_S = 120.0
HELPER_NICE = 10
"""py-spy runs this much nicer than the server."""
_PR_SET_PTRACER = 0x59616D61


class SamplerUnavailable(RuntimeError):
    """py-spy cannot sample this process; the message says why."""


# -- runs -------------------------------------------------------------------------------------------------
class CpuProfileRun:
    """One session's CPU profile (returned by :meth:`CpuProfiler.begin`): :meth:`stop` right before the kernel
    profiler stops, then :meth:`finish` for the ``zoomer.profile`` span attributes. Neither raises."""

    def __init__(self, profiler: CpuProfiler, session_id: str, folder: Path, sampler: Any,
                 attributes: dict[str, Any]) -> None:
        self._profiler = profiler
        self.session_id = session_id
        self.folder = folder
        self.sampler = sampler  # PySpySampler, InProcessSampler, or None (nothing samples)
        self.attributes = attributes

    def stop(self) -> None:
        if self.sampler is not None:
            try:
                self.sampler.stop()
            except Exception as exc:
                self.attributes[n.CPU_ERROR] = f"stopping the sampler failed: {exc!r}"

    def finish(self) -> dict[str, Any]:
        """Write the files and return the span attributes (``zoomer.profile.cpu.*``)."""
        if self.sampler is None or n.CPU_ERROR in self.attributes:
            return self.attributes
        final = self.folder / f"{self.session_id}{SPEEDSCOPE_SUFFIX}"
        collapsed = self.folder / f"{self.session_id}{COLLAPSED_SUFFIX}"
        pprof = self.folder / f"{self.session_id}{PPROF_SUFFIX}"
        partial = self.folder / f".{final.name}.partial"
        collapsed_partial = self.folder / f".{collapsed.name}.partial"
        pprof_partial = self.folder / f".{pprof.name}.partial"
        digest = self.folder / f".{self.session_id}.cpu.summary.json.partial"
        try:
            self.sampler.write(partial)
            summary, empty = self._profiler.postprocess(partial, collapsed_partial, digest, pprof_partial)
            os.replace(partial, final)
            self.attributes[n.CPU_PATH] = str(final.resolve())
            if not empty:
                os.replace(collapsed_partial, collapsed)
                self.attributes[n.CPU_COLLAPSED_PATH] = str(collapsed.resolve())
                os.replace(pprof_partial, pprof)
                self.attributes[n.CPU_PPROF_PATH] = str(pprof.resolve())
            self.attributes.update(summary_attributes(summary, self.sampler.records_idle))
            self.attributes.update(self.sampler.extra_attributes())
        except Exception as exc:  # SamplerUnavailable / OSError / ValueError, or a bug: the session goes on
            self.attributes[n.CPU_ERROR] = str(exc) or repr(exc)
            logger.warning("zoomer-serve: no CPU profile for session %s: %s", self.session_id,
                           self.attributes[n.CPU_ERROR])
        finally:
            for leftover in (partial, collapsed_partial, pprof_partial, digest):
                leftover.unlink(missing_ok=True)
        return self.attributes


def summary_attributes(summary: CpuProfileSummary, with_idle: bool = True) -> dict[str, Any]:
    """The counts and top-N attributes of the ``zoomer.profile`` span (see :mod:`zoomer_serve.host.names`);
    ``with_idle``: the sampler records idle samples (py-spy does not, so it gets no idle count)."""
    attrs: dict[str, Any] = {n.CPU_IDLE_SAMPLES: summary.idle_samples} if with_idle else {}
    return attrs | {
        n.CPU_SAMPLES: summary.samples,
        n.CPU_THREADS: summary.threads,
        n.CPU_TOP_FUNCTION: [t.function for t in summary.top],
        n.CPU_TOP_LOCATION: [t.location for t in summary.top],
        n.CPU_TOP_SELF_SHARE: [t.self_share for t in summary.top],
        n.CPU_TOP_TOTAL_SHARE: [t.total_share for t in summary.top],
    }


# -- the companion ------------------------------------------------------------------------------------------
class CpuProfiler:
    """Starts a CPU profile for each profiling session: a
    :class:`~zoomer_serve.profiling.session.SessionCompanion` (the controller calls :meth:`begin`).

    ``config``: mode, rate, top-N, py-spy binary and attach timeout (see :mod:`zoomer_serve.host.config`).
    ``pid``: the process to sample (default this one; the in-process sampler always samples this one).
    """

    def __init__(self, config: HostConfig, pid: int | None = None) -> None:
        self.config = config
        self.pid = pid  # None: the process that begins the session (right after a fork too)
        self.pyspy_unavailable: str | None = None  # set once py-spy failed; not tried again
        self._lock = threading.Lock()

    def begin(self, session_id: str, folder: Path, max_duration_ms: int) -> CpuProfileRun | None:
        """Start sampling for a session that may last ``max_duration_ms``; None when CPU profiles are off.
        Blocks until py-spy has attached (at most the attach timeout). Never raises."""
        mode = self.config.cpu_profile
        if mode == "off":
            return None
        attrs: dict[str, Any] = {n.CPU_RATE_HZ: self.config.cpu_profile_rate_hz}
        limit_s = max_duration_ms / 1000 + DURATION_MARGIN_S
        sampler: Any = None
        try:
            if mode in ("auto", "py-spy"):
                sampler = self._try_pyspy(limit_s)
            if sampler is not None:
                attrs[n.CPU_SAMPLER] = "py-spy"
            else:
                if self.pyspy_unavailable is not None and mode in ("auto", "py-spy"):
                    attrs[n.CPU_UNAVAILABLE] = self.pyspy_unavailable
                if mode == "py-spy":
                    attrs[n.CPU_SAMPLER] = "none"
                else:
                    sampler = InProcessSampler(self.config.cpu_profile_rate_hz, limit_s)
                    sampler.start()
                    attrs[n.CPU_SAMPLER] = "in-process"
        except Exception as exc:
            attrs[n.CPU_SAMPLER] = "none"
            attrs[n.CPU_ERROR] = f"the CPU sampler did not start: {exc!r}"
            sampler = None
        return CpuProfileRun(self, session_id, folder, sampler, attrs)

    def _try_pyspy(self, limit_s: float) -> PySpySampler | None:
        with self._lock:
            if self.pyspy_unavailable is not None:
                return None
        try:
            return PySpySampler.start(self.config, self.pid or os.getpid(), limit_s)
        except SamplerUnavailable as exc:
            with self._lock:
                first = self.pyspy_unavailable is None
                self.pyspy_unavailable = str(exc)
            if first:
                fallback = ("the in-process sampler records the CPU profiles instead" if self.config.cpu_profile
                            == "auto" else "sessions have no CPU profile (ZOOMER_CPU_PROFILE=py-spy)")
                logger.warning("zoomer-serve: py-spy cannot sample this process: %s; %s (logged once)", exc,
                               fallback)
            return None

    def postprocess(self, speedscope: Path, collapsed: Path, digest: Path, pprof: Path | None = None
                    ) -> tuple[CpuProfileSummary, bool]:
        """Run :mod:`zoomer_serve.host.cpu_postprocess` (writing the pprof file too when ``pprof`` is given);
        returns the summary and whether the profile had no active sample. Raises RuntimeError with the
        child's message on failure."""
        from zoomer_serve.host.cpu_postprocess import EXIT_EMPTY

        strip = [a for p in (*sys.path, PACKAGE_ROOT) if p and os.path.isabs(p) for a in ("--strip", p)]
        args = [str(speedscope), str(collapsed), str(digest), "--rate-hz", str(self.config.cpu_profile_rate_hz),
                "--top", str(self.config.cpu_profile_top), *strip, *(["--pprof", str(pprof)] if pprof else [])]
        try:
            done = run_module("zoomer_serve.host.cpu_postprocess", args, POSTPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"post-processing the CPU profile took longer than {POSTPROCESS_TIMEOUT_S:.0f} s"
                               ) from None
        if done.returncode not in (0, EXIT_EMPTY):
            raise RuntimeError(f"post-processing the CPU profile failed (exit {done.returncode}): "
                               f"{done.stderr.strip()[-500:]}")
        summary = CpuProfileSummary.from_json(json.loads(digest.read_text(encoding="utf-8")))
        return summary, done.returncode == EXIT_EMPTY


# -- py-spy -------------------------------------------------------------------------------------------------
def find_pyspy(configured: str | None = None) -> str | None:
    """The py-spy binary: ``configured`` (a path or a name on PATH), else ``py-spy`` beside the Python
    interpreter (a virtual environment's ``bin``), else on ``PATH``; None when there is none."""
    if configured:
        return configured if os.path.isfile(configured) and os.access(configured, os.X_OK) \
            else shutil.which(configured)
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


class PySpySampler:
    """A running ``py-spy record`` helper process (see the module docstring). Use :meth:`start`."""

    records_idle = False

    def __init__(self, proc: subprocess.Popen[bytes], output: Path, stdout: Path, stderr: Path,
                 workdir: tempfile.TemporaryDirectory[str]) -> None:
        self.proc = proc
        self.output = output
        self._stdout = stdout
        self._stderr = stderr
        self._workdir = workdir
        self.returncode: int | None = None
        self.errors: int | None = None

    @classmethod
    def start(cls, config: HostConfig, pid: int, limit_s: float) -> PySpySampler:
        """Start py-spy on ``pid`` and wait until it samples. Raises SamplerUnavailable (missing binary, it
        exited, it did not attach within ``config.cpu_profile_attach_timeout_ms``)."""
        binary = find_pyspy(config.cpu_profile_pyspy)
        if binary is None:
            where = (f"ZOOMER_CPU_PROFILE_PYSPY={config.cpu_profile_pyspy!r} is not an executable"
                     if config.cpu_profile_pyspy else "looked beside the interpreter and on PATH")
            raise SamplerUnavailable(f"the py-spy binary was not found ({where}; pip install py-spy)")
        workdir = tempfile.TemporaryDirectory(prefix="zoomer-pyspy-")
        base = Path(workdir.name)
        output, out_log, err_log = base / "profile.speedscope.json", base / "stdout.txt", base / "stderr.txt"
        cmd = [binary, "record", "--pid", str(pid), "--rate", str(config.cpu_profile_rate_hz), "--format",
               "speedscope", "--output", str(output), "--function", "--nonblocking", "--duration",
               str(max(1, int(limit_s)))]
        try:
            with open(out_log, "wb") as out, open(err_log, "wb") as err:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                        close_fds=True)
        except OSError as exc:
            workdir.cleanup()
            raise SamplerUnavailable(f"py-spy ({binary}) could not be started: {exc}") from None
        _allow_tracer(proc.pid)
        _lower_priority(proc.pid)
        sampler = cls(proc, output, out_log, err_log, workdir)
        sampler._wait_attached(config.cpu_profile_attach_timeout_ms / 1000)
        return sampler

    def _wait_attached(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if b"Sampling process" in _read(self._stdout):
                return
            if self.proc.poll() is not None:
                reason = _pyspy_error(_read(self._stderr)) or f"py-spy exited with status {self.proc.returncode}"
                self._workdir.cleanup()
                raise SamplerUnavailable(reason)
            time.sleep(0.01)
        self._kill()
        self._workdir.cleanup()
        raise SamplerUnavailable(f"py-spy did not start sampling within {timeout_s * 1000:.0f} ms")

    def stop(self) -> None:
        """Ask py-spy to stop (SIGINT: it writes its file and exits); kill it after :data:`STOP_TIMEOUT_S`."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill()
        self.returncode = self.proc.returncode

    def write(self, path: Path) -> None:
        """Move py-spy's speedscope file to ``path``. Raises RuntimeError when py-spy wrote none."""
        try:
            out = _read(self._stdout).decode(errors="replace")
            self.errors = _errors(out)
            if not self.output.is_file() or self.output.stat().st_size == 0:
                reason = _pyspy_error(_read(self._stderr)) or f"exit status {self.returncode}"
                raise RuntimeError(f"py-spy wrote no profile ({reason})")
            shutil.move(str(self.output), str(path))
        finally:
            self._workdir.cleanup()

    def extra_attributes(self) -> dict[str, Any]:
        return {n.CPU_SAMPLER_ERRORS: self.errors} if self.errors is not None else {}

    def _kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _pyspy_error(stderr: bytes) -> str:
    """The message of a py-spy failure: its error lines, without the Rust backtrace."""
    lines = []
    for raw in stderr.decode(errors="replace").splitlines():
        line = raw.strip()
        if line.startswith("Stack backtrace"):
            break
        if line:
            lines.append(line)
    return " ".join(lines)[:500]


def _errors(stdout: str) -> int | None:
    """The error count of py-spy's final ``Samples: N Errors: M`` line."""
    at = stdout.rfind("Errors:")
    if at < 0:
        return None
    digits = stdout[at + len("Errors:"):].strip().split()[0] if stdout[at + len("Errors:"):].strip() else ""
    return int(digits) if digits.isdigit() else None


def _lower_priority(pid: int) -> None:
    """Nice the helper by :data:`HELPER_NICE` right after it started (before py-spy starts its sampling
    threads, which inherit it), so that under CPU contention the server's threads run first."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + HELPER_NICE))
    except (OSError, AttributeError):
        pass


def _allow_tracer(pid: int) -> None:
    """Under Yama ``ptrace_scope`` 1 only ancestors may read a process's memory: name ``pid`` (py-spy, our
    child) as this process's tracer. A no-op elsewhere (the call fails harmlessly without Yama)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):
        pass


# -- in-process ---------------------------------------------------------------------------------------------
_TRUNCATED = Frame("[truncated]", "", 0)


class InProcessSampler:
    """Samples ``sys._current_frames()`` of this process on a daemon thread (``zoomer-cpu-sampler``) at
    ``rate_hz`` until :meth:`stop` or ``limit_s`` seconds (see the module docstring).

    Counters: ``samples`` (sampling rounds), ``dropped`` (thread samples lost to :data:`MAX_STACKS`).
    """

    records_idle = True

    def __init__(self, rate_hz: int, limit_s: float, max_stacks: int = MAX_STACKS) -> None:
        self.rate_hz = rate_hz
        self.limit_s = limit_s
        self.max_stacks = max_stacks
        self.samples = 0
        self.dropped = 0
        # (thread, active, its request or None, stack) -> samples
        self._stacks: dict[tuple[int, bool, tuple[str, str, str] | None, tuple[int, ...]], int] = {}
        self._codes: dict[int, CodeType] = {}
        self._threads: dict[int, tuple[str, int | None]] = {}
        self._cpu: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._me = 0
        self._last_ns = 0
        self._linux = sys.platform.startswith("linux")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="zoomer-cpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        self._me = threading.get_ident()
        interval = 1.0 / self.rate_hz
        end = time.monotonic() + self.limit_s
        self._last_ns = time.perf_counter_ns()
        due = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= end:
                return
            due = max(due + interval, now)
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            try:
                self.sample()
            except Exception as exc:  # a bug must not kill the server; the profile ends here
                logger.warning("zoomer-serve: the in-process CPU sampler stopped: %r", exc)
                return

    def sample(self) -> None:
        """Take one sample of every thread but the sampler's own."""
        now = time.perf_counter_ns()
        elapsed = now - self._last_ns
        self._last_ns = now
        self.samples += 1
        frames = sys._current_frames()
        try:
            for ident, frame in frames.items():
                if ident == self._me:
                    continue
                info = self._threads.get(ident)
                if info is None:
                    self._refresh_threads()
                    info = self._threads.setdefault(ident, (f"thread {ident}", None))
                active = self._active(info[1], elapsed)
                if active is None:
                    continue
                self._count(ident, active, frame)
        finally:
            del frames

    def _count(self, ident: int, active: bool, frame: Any) -> None:
        codes: list[int] = []
        f = frame
        while f is not None and len(codes) < MAX_DEPTH:
            code = f.f_code
            cid = id(code)
            if cid not in self._codes:
                self._codes[cid] = code
            codes.append(cid)
            f = f.f_back
        if f is not None:
            codes.append(0)  # the root side was cut: a [truncated] frame
        codes.reverse()
        key = (ident, active, THREAD_REQUESTS.get(ident), tuple(codes))
        count = self._stacks.get(key)
        if count is None and len(self._stacks) >= self.max_stacks:
            self.dropped += 1
            return
        self._stacks[key] = (count or 0) + 1

    def _active(self, native_id: int | None, elapsed_ns: int) -> bool | None:
        """True / False from the thread's CPU clock; None for a thread's first sample (it primes the clock).
        Threads without a known native id (or off Linux) count as active."""
        if native_id is None or not self._linux:
            return True
        try:
            cpu = time.clock_gettime_ns((~native_id << 3) | 6)  # the thread's CPUCLOCK_SCHED clock id
        except OSError:  # the thread has ended
            return None
        before = self._cpu.get(native_id)
        self._cpu[native_id] = cpu
        if before is None:
            return None
        return (cpu - before) >= ACTIVE_CPU_SHARE * elapsed_ns

    def _refresh_threads(self) -> None:
        for t in threading.enumerate():
            if t.ident is not None:
                self._threads[t.ident] = (t.name, t.native_id)

    def write(self, path: Path) -> None:
        """Write what was sampled as speedscope JSON (one profile per thread and state)."""
        index: dict[int, int] = {}
        frames: list[Frame] = []
        profiles: dict[tuple[int, bool], SampledProfile] = {}
        table: dict[tuple[str, str, str], int] = {}
        for (ident, active, request, stack), count in self._stacks.items():
            key = (ident, active)
            prof = profiles.get(key)
            if prof is None:
                name, native = self._threads.get(ident, (f"thread {ident}", None))
                label = f'Thread {native if native is not None else ident} "{name}"'
                prof = profiles[key] = SampledProfile(label if active else label + IDLE_SUFFIX)
            indices = []
            for cid in stack:
                i = index.get(cid)
                if i is None:
                    i = index[cid] = len(frames)
                    frames.append(_frame(self._codes.get(cid)))
                indices.append(i)
            prof.stacks.append(tuple(indices))
            prof.counts.append(count)
            prof.requests.append(table.setdefault(request, len(table)) if request is not None else -1)
        ordered = sorted(profiles.values(), key=lambda p: (p.name.endswith(IDLE_SUFFIX), -sum(p.counts), p.name))
        write_speedscope(path, frames, ordered, self.rate_hz, "zoomer-serve CPU profile",
                         "zoomer-serve in-process sampler", requests=list(table))

    def extra_attributes(self) -> dict[str, Any]:
        return {n.CPU_DROPPED_SAMPLES: self.dropped}


def _frame(code: CodeType | None) -> Frame:
    if code is None:
        return _TRUNCATED
    return Frame(getattr(code, "co_qualname", code.co_name), code.co_filename, code.co_firstlineno)
