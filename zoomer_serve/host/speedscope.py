"""Speedscope JSON (the CPU profile file) and what is derived from it: the collapsed-stacks text and the
top-N summary. Pure functions over plain data, used by the post-processing child process
(:mod:`zoomer_serve.host.cpu_postprocess`) and by the in-process sampler's writer.

File format: https://www.speedscope.app/file-format-schema.json. A profile is ``sampled``: ``samples`` lists
stacks of indices into ``shared.frames``, root first, and ``weights`` their weights in seconds (one sample
weighs ``1 / rate_hz``). One profile per thread, named ``Thread <native id> "<name>"`` as py-spy names them;
the in-process sampler writes a thread's idle samples as a separate profile whose name ends with
:data:`IDLE_SUFFIX`, which the collapsed text and the summary leave out.

Frames are functions: ``name`` is the qualified function name, ``file`` its source file, ``line`` its first
line (py-spy records with ``--function``, so a function is one frame whatever line was running).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "https://www.speedscope.app/file-format-schema.json"
IDLE_SUFFIX = " (idle)"


class SpeedscopeError(ValueError):
    """The file is not a speedscope sampled profile (the message says what is wrong)."""


@dataclass(frozen=True)
class Frame:
    """One function: qualified ``name``, source ``file`` (absolute), first ``line``."""

    name: str
    file: str
    line: int


@dataclass
class SampledProfile:
    """One thread's samples: ``stacks`` (frame indices, root first) with ``counts`` (samples of each) and, when
    the sampler knows them, ``requests``: per stack the index of its request in the file's request table
    (:data:`REQUESTS_KEY`), -1 for none."""

    name: str
    stacks: list[tuple[int, ...]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)


REQUESTS_KEY = "zoomer.requests"
"""Our key in a speedscope file (speedscope ignores it): at the top, the request table (``[trace_id, span_id,
rpc.method]`` rows); in a profile, one table index per sample (-1: no request)."""


@dataclass(frozen=True)
class TopFunction:
    """One row of the top-N: ``function`` (qualified name), ``location`` (``short/path.py:first_line``),
    ``self_samples`` (innermost frame), ``total_samples`` (anywhere on the stack, counted once per sample),
    and their shares of the active samples (0..1)."""

    function: str
    location: str
    self_samples: int
    total_samples: int
    self_share: float
    total_share: float


@dataclass
class CpuProfileSummary:
    """What a CPU profile says in numbers: ``samples`` (active), ``idle_samples``, ``threads`` (with active
    samples), ``top`` (by own samples, then total, then name)."""

    samples: int = 0
    idle_samples: int = 0
    threads: int = 0
    top: list[TopFunction] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CpuProfileSummary:
        return cls(samples=int(data["samples"]), idle_samples=int(data["idle_samples"]),
                   threads=int(data["threads"]), top=[TopFunction(**row) for row in data["top"]])


def write_speedscope(path: Path, frames: Sequence[Frame], profiles: Iterable[SampledProfile], rate_hz: float,
                     name: str, exporter: str, requests: Sequence[tuple[str, str, str]] = ()) -> None:
    """Write a speedscope file: each profile's stacks weighted ``count / rate_hz`` seconds; with ``requests``
    (``(trace_id, span_id, rpc.method)`` rows) the request table and each profile's per-sample indices into it
    under :data:`REQUESTS_KEY`."""
    out_profiles = []
    for p in profiles:
        weights = [c / rate_hz for c in p.counts]
        profile: dict[str, Any] = {"type": "sampled", "name": p.name, "unit": "seconds", "startValue": 0.0,
                                   "endValue": sum(weights), "samples": [list(s) for s in p.stacks],
                                   "weights": weights}
        if requests and p.requests:
            profile[REQUESTS_KEY] = p.requests
        out_profiles.append(profile)
    data: dict[str, Any] = {"$schema": SCHEMA, "shared": {"frames": [{"name": f.name, "file": f.file, "line": f.line}
                                                                     for f in frames]},
                            "profiles": out_profiles, "name": name, "activeProfileIndex": 0, "exporter": exporter}
    if requests:
        data[REQUESTS_KEY] = [list(row) for row in requests]
    path.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")


def read_speedscope(path: Path) -> dict[str, Any]:
    """Read and check a speedscope file (``shared.frames``, sampled ``profiles`` whose frame indices exist).
    Raises SpeedscopeError, OSError."""
    try:
        data = json.loads(Path(path).read_bytes())
    except ValueError as exc:
        raise SpeedscopeError(f"{path} is not JSON: {exc}") from None
    try:
        frames = data["shared"]["frames"]
        profiles = data["profiles"]
    except (KeyError, TypeError):
        raise SpeedscopeError(f"{path} has no shared.frames / profiles") from None
    for p in profiles:
        if p.get("type") != "sampled" or len(p.get("samples", ())) != len(p.get("weights", ())):
            raise SpeedscopeError(f"{path}: profile {p.get('name')!r} is not a sampled profile with one weight "
                                  "per sample")
        for stack in p["samples"]:
            if any(not 0 <= i < len(frames) for i in stack):
                raise SpeedscopeError(f"{path}: profile {p.get('name')!r} refers to a frame that does not exist")
    return data  # type: ignore[no-any-return]


def short_path(path: str, prefixes: Sequence[str] = ()) -> str:
    """``path`` relative to the longest of ``prefixes`` (import roots such as ``sys.path`` entries) that
    contains it, else after the last ``site-packages/`` or ``dist-packages/``, else unchanged."""
    best = ""
    for prefix in prefixes:
        p = prefix.rstrip("/") + "/"
        if len(p) > 1 and path.startswith(p) and len(p) > len(best):
            best = p
    if best:
        return path[len(best):]
    for marker in ("site-packages/", "dist-packages/"):
        at = path.rfind(marker)
        if at >= 0:
            return path[at + len(marker):]
    return path


def summarize(data: dict[str, Any], rate_hz: float, top_n: int, prefixes: Sequence[str] = ()
              ) -> tuple[CpuProfileSummary, list[str]]:
    """The summary and the collapsed-stacks lines of a checked speedscope profile (:func:`read_speedscope`).

    A sample's count is ``round(weight * rate_hz)`` (at least 1). Collapsed lines are
    ``<thread profile name>;<function> (<short file>:<line>);... <count>``, root first, one per distinct stack
    of active samples, most samples first. Idle profiles (:data:`IDLE_SUFFIX`) count only as ``idle_samples``.
    """
    frames = [_frame_key(f, prefixes) for f in data["shared"]["frames"]]
    stacks: Counter[tuple[str, tuple[int, ...]]] = Counter()
    own: Counter[int] = Counter()
    total: Counter[int] = Counter()
    idle = 0
    threads = set()
    for p in data["profiles"]:
        is_idle = str(p.get("name", "")).endswith(IDLE_SUFFIX)
        for stack, weight in zip(p["samples"], p["weights"]):
            count = max(1, round(float(weight) * rate_hz))
            if is_idle:
                idle += count
                continue
            if not stack:
                continue
            threads.add(p["name"])
            stacks[(p["name"], tuple(stack))] += count
            own[stack[-1]] += count
            for i in set(stack):
                total[i] += count
    active = sum(stacks.values())
    top = _top(frames, own, total, active, top_n)
    lines = [";".join([_clean(thread)] + [frames[i][2] for i in stack]) + f" {count}"
             for (thread, stack), count in sorted(stacks.items(), key=lambda kv: (-kv[1], kv[0]))]
    return CpuProfileSummary(samples=active, idle_samples=idle, threads=len(threads), top=top), lines


def _frame_key(frame: dict[str, Any], prefixes: Sequence[str]) -> tuple[str, str, str]:
    """(function, location, collapsed frame text) of a speedscope frame."""
    name = str(frame.get("name", "?"))
    file = str(frame.get("file") or "")
    line = frame.get("line")
    location = f"{short_path(file, prefixes)}:{line}" if file else ""
    text = f"{name} ({location})" if location else name
    return name, location, _clean(text)


def _clean(text: str) -> str:
    """A collapsed-stack frame: no ``;`` (the separator) and no line breaks."""
    return text.replace(";", ":").replace("\n", " ")


def _top(frames: list[tuple[str, str, str]], own: Counter[int], total: Counter[int], active: int,
         top_n: int) -> list[TopFunction]:
    """Top ``top_n`` functions by own samples (frames with the same function and location merged)."""
    if active == 0:
        return []
    merged_own: Counter[tuple[str, str]] = Counter()
    merged_total: Counter[tuple[str, str]] = Counter()
    for i, c in own.items():
        merged_own[frames[i][:2]] += c
    for i, c in total.items():
        merged_total[frames[i][:2]] += c
    ranked = sorted(merged_own.items(), key=lambda kv: (-kv[1], -merged_total[kv[0]], kv[0]))[:top_n]
    return [TopFunction(function=fn, location=loc, self_samples=c, total_samples=merged_total[(fn, loc)],
                        self_share=round(c / active, 6), total_share=round(merged_total[(fn, loc)] / active, 6))
            for (fn, loc), c in ranked]
