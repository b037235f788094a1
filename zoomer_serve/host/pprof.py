"""CPU profiles as pprof: ``<session_id>.cpu.pb.gz``, a gzip-compressed ``perftools.profiles.Profile``
(:file:`profile.proto`), which ``go tool pprof``, Pyroscope and Perfetto read.

Built from the session's speedscope file (:func:`build_profile`), in the same niced child process that writes
the collapsed stacks (:mod:`zoomer_serve.host.cpu_postprocess`), from the same active samples: the sample
counts of the two files are equal. Idle samples (in-process sampler) are left out, as from the collapsed
file.

- Sample types: ``samples`` / ``count`` and ``cpu`` / ``nanoseconds`` (count x the period, 1e9 / the
  sampling rate); period type ``cpu`` / ``nanoseconds``.
- One function and one location per speedscope frame (its name, source file and first line); a sample's
  locations are its stack, leaf first.
- Labels per sample: ``thread`` (the speedscope profile's name) always; ``trace_id``, ``span_id`` (lowercase
  hex, as the store holds them) and ``rpc.method`` of the request the thread ran when the sample was taken,
  where the sampler knows it. The in-process sampler does: a covered request's profiler range marks its
  thread while it is open (:data:`zoomer_serve.profiling.labels.THREAD_REQUESTS`). py-spy samples from
  another process and knows only threads and stacks, so its samples carry no request labels, nor do samples
  taken outside any covered request's range (another thread, a batch's own work, the server's idle loop).
"""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zoomer_serve.host.speedscope import IDLE_SUFFIX, REQUESTS_KEY

PPROF_SUFFIX = ".cpu.pb.gz"
LABEL_THREAD = "thread"
LABEL_TRACE_ID = "trace_id"
LABEL_SPAN_ID = "span_id"
LABEL_METHOD = "rpc.method"


class _Strings:
    """The profile's string table (index 0 is "")."""

    def __init__(self) -> None:
        self.table = [""]
        self._index = {"": 0}

    def __call__(self, text: str) -> int:
        i = self._index.get(text)
        if i is None:
            i = self._index[text] = len(self.table)
            self.table.append(text)
        return i


def build_profile(data: dict[str, Any], rate_hz: float, time_ns: int = 0) -> Any:
    """A ``perftools.profiles.Profile`` of the active samples of a checked speedscope profile
    (:func:`~zoomer_serve.host.speedscope.read_speedscope`); a sample's count is ``round(weight * rate_hz)``
    (at least 1), as in the collapsed file. ``time_ns``: when sampling started (Unix epoch ns, 0 unknown)."""
    from zoomer_serve.host import profile_pb2 as pb

    s = _Strings()
    period = max(1, round(1e9 / rate_hz))
    profile = pb.Profile()
    profile.sample_type.add(type=s("samples"), unit=s("count"))
    profile.sample_type.add(type=s("cpu"), unit=s("nanoseconds"))
    profile.period_type.type, profile.period_type.unit = s("cpu"), s("nanoseconds")
    profile.period = period
    profile.default_sample_type = s("cpu")
    profile.time_nanos = time_ns
    frames = data["shared"]["frames"]
    table: Sequence[Sequence[str]] = data.get(REQUESTS_KEY) or ()
    counts: Counter[tuple[str, tuple[int, ...], int]] = Counter()
    for p in data["profiles"]:
        name = str(p.get("name", ""))
        if name.endswith(IDLE_SUFFIX):
            continue
        requests = p.get(REQUESTS_KEY) or [-1] * len(p["samples"])
        for stack, weight, request in zip(p["samples"], p["weights"], requests):
            if stack:
                counts[(name, tuple(stack), int(request))] += max(1, round(float(weight) * rate_hz))
    used: set[int] = set()
    for (thread, stack, request), count in counts.items():
        sample = profile.sample.add(location_id=[i + 1 for i in reversed(stack)], value=[count, count * period])
        sample.label.add(key=s(LABEL_THREAD), str=s(thread))
        if 0 <= request < len(table):
            trace_id, span_id, method = (str(v) for v in table[request])
            sample.label.add(key=s(LABEL_TRACE_ID), str=s(trace_id))
            sample.label.add(key=s(LABEL_SPAN_ID), str=s(span_id))
            sample.label.add(key=s(LABEL_METHOD), str=s(method))
        used.update(stack)
    for i in sorted(used):
        frame = frames[i]
        line = int(frame.get("line") or 0)
        profile.function.add(id=i + 1, name=s(str(frame.get("name", "?"))), system_name=s(str(frame.get("name", "?"))),
                             filename=s(str(frame.get("file") or "")), start_line=line)
        profile.location.add(id=i + 1).line.add(function_id=i + 1, line=line)
    profile.string_table.extend(s.table)
    return profile


def write_pprof(path: Path, profile: Any) -> None:
    """Write ``profile`` serialized and gzip-compressed (the on-disk pprof form)."""
    Path(path).write_bytes(gzip.compress(profile.SerializeToString(), mtime=0))


def read_pprof(path: Path) -> Any:
    """Read a ``.pb.gz`` written by :func:`write_pprof` (or any gzip-compressed pprof profile)."""
    from zoomer_serve.host import profile_pb2 as pb

    return pb.Profile.FromString(gzip.decompress(Path(path).read_bytes()))
