"""Load a Kineto (PyTorch profiler) / Chrome trace JSON file, plain or gzip, into columnar tables.

Reading
-------
:mod:`zoomer_serve.analysis.trace_reader` streams the file in pieces of about ``chunk_bytes`` (each parsed
with ``orjson`` and turned into NumPy columns before the next is read), so peak memory is about the final
tables plus one piece. Measured on the 35 MB, 109k-event ``a100_training_step`` trace
(``benchmarks/ANALYSIS.md``): 1 MiB pieces load it in about 0.65 s of CPU with 27 MB above the imports, where
``ijson`` streaming into the same tables takes about twice the CPU time and 51 MB, and ``orjson.loads`` /
``json.load`` of the whole text alone take 233 / 170 MB. Both the Chrome "JSON object" format
(``{"traceEvents": [...], ...}``) and the bare "JSON array" format are accepted.

Time base
---------
PyTorch >= 2.4 (Kineto since pytorch/kineto#910) writes ``baseTimeNanoseconds`` at the top level and every
``ts`` as microseconds since it: Unix time in ns = ``baseTimeNanoseconds + ts * 1000``. Older traces have no
such key and their ``ts`` are Unix epoch microseconds. :attr:`KinetoTrace.base_time_ns` holds the key (0 when
absent) and :meth:`KinetoTrace.unix_ns` turns table times into Unix ns either way; every place that joins
trace times with span times (the merged timeline) goes through it. A file whose ``ts`` already look like
epoch microseconds (>= 1e15, year 2001) although it names a base is read as epoch time, with a warning.

Odd input (case C18)
--------------------
Nothing in a file that parses as JSON (leniently: see the reader) raises: names that are null, numbers or
objects become text (their JSON), events missing fields are repaired or counted in
:attr:`KinetoTrace.skipped`, and events whose ``ts`` or ``dur`` is NaN / infinite or whose ``dur`` is negative
are dropped from the tables, as are GPU operations (kernels, copies, memsets) of zero duration: they are
counted and said once each in :attr:`KinetoTrace.warnings`. CPU-side events of zero duration are kept:
traces with whole-microsecond times write every call shorter than 0.5 us that way (12k of the 109k events of
``a100_training_step``).

Tables (times in microseconds, ``ts`` relative to :attr:`KinetoTrace.origin_us`)
-------------------------------------------------------------------------------
Every table has ``ts`` (start, us), ``dur`` (duration, us) and is sorted by ``ts``. Ids are -1 when the
event does not carry them.

``kernels`` (cat ``kernel``): ``device``, ``stream``, ``correlation`` (links to the launching runtime call),
``external_id``, ``name``, ``grid_blocks`` (blocks in the grid, product of ``grid``), ``block_threads``
(threads per block), ``registers_per_thread``, ``shared_memory`` (bytes per block), ``blocks_per_sm``,
``warps_per_sm``, ``occupancy`` (Kineto's "est. achieved occupancy %", 0..100, NaN when absent).

``memops`` (cat ``gpu_memcpy`` and ``gpu_memset``): ``device``, ``stream``, ``correlation``, ``external_id``,
``name``, ``op`` ("memcpy" / "memset"), ``direction`` ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP", "" for
memset), ``src`` / ``dst`` (memory kinds from the name: "Pageable", "Pinned", "Device", "Managed", ...),
``bytes``, ``bandwidth`` (GB/s = bytes / dur, NaN when dur is 0).

``runtime`` (cats ``cuda_runtime`` and ``cuda_driver``): ``pid``, ``tid``, ``correlation``, ``external_id``,
``name`` (API function, e.g. ``cudaLaunchKernel``), ``cbid`` (CUPTI callback id), ``api``
("runtime" / "driver").

``syncs`` (cat ``cuda_sync``, CUPTI synchronization records, drawn on the GPU): ``device``, ``stream``
(-1 for device- or event-level syncs), ``correlation`` (the runtime call that synchronized), ``kind``
("Stream Sync", "Event Sync", "Context Sync", "Stream Wait Event"), ``wait_on_stream``.

``cpu_ops`` (cat ``cpu_op``): ``pid``, ``tid``, ``external_id``, ``name`` (e.g. ``aten::mm``).

``annotations`` (cats ``user_annotation`` and ``gpu_user_annotation``: ``record_function`` ranges, profiler
steps): ``pid``, ``tid``, ``name``, ``on_gpu`` (True for the GPU-side copy Kineto draws on a stream),
``device``, ``stream``, ``external_id``.

``flows`` (``ph`` "s"/"f" pairs: ``ac2g`` / ``async_cpu_to_gpu`` CPU-to-GPU launch arrows, ``fwdbwd``
forward-to-backward links): ``cat``, ``id`` (for launch arrows: the correlation id), ``ts`` (start end),
``pid``, ``tid``, ``end_ts``, ``end_pid``, ``end_tid``.

``memory`` (instant events named ``[memory]``, written with ``profile_memory=True``): ``device`` (-1 = CPU),
``bytes`` (the allocation, negative for a free), ``total_allocated``, ``total_reserved`` (bytes).

``counters`` (counter samples, ``ph`` "C": CUPTI PM sampling writes them on a "GPU N Counters" track):
``device`` (the event's pid: the GPU for device counters), ``tid`` (the track, as text), ``counter`` (the
event's name), ``name`` (the series: the ``args`` key, or the counter's name for a key "value"), ``value``.

Kernels replayed from a CUDA graph (``cudaGraphLaunch``) are ordinary rows of ``kernels``: their
``correlation`` is the graph launch's, and ``graph_node_id`` (Kineto's "graph node id") is >= 0.

Events of other kinds are not tabled but counted in :attr:`KinetoTrace.skipped` (by category), so nothing
disappears without a trace.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson

from zoomer_serve.analysis import trace_events as ev
from zoomer_serve.analysis.table import Table
from zoomer_serve.analysis.trace_reader import (
    EXPECTED,
    EventChunks,
    Malformed,
    ReadNotes,
    TraceFormatError,
    open_binary,
    orjson_decode,
    read_bytes_opener,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "KinetoTrace", "TraceFormatError", "load_trace", "load_trace_bytes"]

DEFAULT_CHUNK_BYTES = 1 << 20
NAN = math.nan
EPOCH_US_FLOOR = 1e15
"""``ts`` values at or above this (microseconds: September 2001 as Unix time) are epoch times, not offsets
from ``baseTimeNanoseconds``."""

MAX_TIME_US = 1e17
"""``ts`` / ``dur`` beyond this many microseconds (3,170 years) are out of range: left out like NaN."""
MAX_BASE_TIME_NS = 1 << 62
"""A ``baseTimeNanoseconds`` at or above this (year 2116) is not a time base: ignored."""

_MEMCPY_NAME = re.compile(r"^Memcpy (\w+) \((\w+) -> (\w+)\)")
_INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------------------------------------------------
# Columnar building


def _as_int(value: Any, default: int = -1) -> int:
    """An id as int: ints as they are, numeric strings and finite floats converted, anything else (and
    anything outside int64) ``default``."""
    if type(value) is int and -_INT64_MAX <= value <= _INT64_MAX:
        return value
    try:
        out = int(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return out if -_INT64_MAX <= out <= _INT64_MAX else default


def _text(value: Any) -> str:
    """A value that should have been a string, as text: "" for null, else its JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except (TypeError, orjson.JSONEncodeError):
        return str(value)


GPU_TABLES = frozenset({"kernels", "memops"})
"""Tables whose zero-duration rows are dropped (a GPU operation without duration is no work to place)."""


class _Builder:
    """Rows of one table, converted to NumPy column parts after every parsed piece.

    Rows hold the raw JSON values (with defaults for missing keys); conversion to the column dtypes is
    vectorised in :meth:`flush`, falling back to value-by-value conversion for odd values (an id given as
    a string, a null). :meth:`collect` joins the parts and drops rows whose times cannot be placed.
    """

    __slots__ = ("name", "spec", "rows", "parts", "columns", "excluded")

    def __init__(self, name: str, spec: tuple[tuple[str, Any], ...]) -> None:
        self.name = name
        self.spec = spec
        self.rows: list[tuple[Any, ...]] = []
        self.parts: list[list[np.ndarray]] = []
        self.columns: dict[str, np.ndarray] = {}
        self.excluded: Counter[str] = Counter()

    def flush(self) -> None:
        if not self.rows:
            return
        cols = list(zip(*self.rows))
        self.parts.append([_column(col, dtype) for col, (_, dtype) in zip(cols, self.spec)])
        self.rows = []

    def collect(self) -> None:
        """Join the parts into :attr:`columns`, dropping (and counting in :attr:`excluded`) rows with a
        non-finite ``ts`` / ``dur``, a negative ``dur`` and, for GPU tables, a zero ``dur``."""
        self.flush()
        columns: dict[str, np.ndarray] = {}
        for i, (col, dtype) in enumerate(self.spec):
            if self.parts:
                columns[col] = np.concatenate([p[i] for p in self.parts]) if len(self.parts) > 1 \
                    else self.parts[0][i]
            else:
                columns[col] = np.empty(0, dtype=dtype)
        self.parts = []
        ts = columns["ts"]
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(ts) <= MAX_TIME_US)
            if "dur" in columns:
                dur = columns["dur"]
                bad |= ~(np.abs(dur) <= MAX_TIME_US)
                negative = ~bad & (dur < 0)
                zero = (dur == 0) if self.name in GPU_TABLES else np.zeros(len(dur), dtype=bool)
                self.excluded["a negative duration"] += int(negative.sum())
                self.excluded["zero duration"] += int(zero.sum())
                self.excluded["a NaN, infinite or out-of-range ts / dur"] += int(bad.sum())
                bad |= negative | zero
            else:
                self.excluded["a NaN, infinite or out-of-range ts"] += int(bad.sum())
        if bad.any():
            columns = {k: v[~bad] for k, v in columns.items()}
        self.columns = columns

    def empty(self) -> Table:
        """The table without rows."""
        return Table(self.name, {col: np.empty(0, dtype=dtype) for col, dtype in self.spec},
                     {k: u for k, u in UNITS.items() if k in dict(self.spec)})

    def min_ts(self) -> float:
        ts = self.columns["ts"]
        return float(ts.min()) if len(ts) else math.inf

    def finish(self, origin_us: float, units: dict[str, str]) -> Table:
        """The table, times relative to ``origin_us``, sorted by ``ts`` (call :meth:`collect` first)."""
        columns = dict(self.columns)
        self.columns = {}
        for col in ("ts", "end_ts"):
            if col in columns:
                columns[col] = columns[col] - origin_us
        if "ts" in columns and len(columns["ts"]) > 1:
            order = np.argsort(columns["ts"], kind="stable")
            if np.any(order[1:] < order[:-1]):
                columns = {k: v[order] for k, v in columns.items()}
        return Table(self.name, columns, {k: u for k, u in units.items() if k in columns})


def _column(values: tuple[Any, ...], dtype: Any) -> np.ndarray:
    """One column of raw JSON values as an array of ``dtype`` (ids: -1, numbers: NaN where unusable)."""
    if dtype is object:
        return np.fromiter(values, dtype=object, count=len(values))
    try:
        arr = np.array(values, dtype=dtype)
        if arr.shape == (len(values),):  # a list among the values would add a dimension
            return arr
    except (TypeError, ValueError, OverflowError):
        pass
    if dtype is np.int64:
        return np.array([_as_int(v) for v in values], dtype=dtype)
    if dtype is np.bool_:
        return np.array([v is True for v in values], dtype=dtype)
    return np.array([_num(v) for v in values], dtype=dtype)


_F = np.float64
_I = np.int64
_O = object
_KERNEL_SPEC = (("ts", _F), ("dur", _F), ("device", _I), ("stream", _I), ("correlation", _I),
                ("external_id", _I), ("name", _O), ("grid_blocks", _I), ("block_threads", _I),
                ("registers_per_thread", _I), ("shared_memory", _I), ("blocks_per_sm", _F),
                ("warps_per_sm", _F), ("occupancy", _F), ("graph_node_id", _I))
_MEMOP_SPEC = (("ts", _F), ("dur", _F), ("device", _I), ("stream", _I), ("correlation", _I),
               ("external_id", _I), ("name", _O), ("op", _O), ("direction", _O), ("src", _O), ("dst", _O),
               ("bytes", _I))
_RUNTIME_SPEC = (("ts", _F), ("dur", _F), ("pid", _I), ("tid", _I), ("correlation", _I), ("external_id", _I),
                 ("name", _O), ("cbid", _I), ("api", _O))
_SYNC_SPEC = (("ts", _F), ("dur", _F), ("device", _I), ("stream", _I), ("correlation", _I), ("kind", _O),
              ("wait_on_stream", _I))
_CPU_SPEC = (("ts", _F), ("dur", _F), ("pid", _I), ("tid", _I), ("external_id", _I), ("name", _O))
_ANNOT_SPEC = (("ts", _F), ("dur", _F), ("pid", _I), ("tid", _I), ("name", _O), ("on_gpu", np.bool_),
               ("device", _I), ("stream", _I), ("external_id", _I))
_FLOW_END_SPEC = (("cat", _O), ("id", _I), ("ts", _F), ("pid", _I), ("tid", _I))
_EMPTY: dict[str, Any] = {}
_COUNTER_SPEC = (("ts", _F), ("device", _I), ("tid", _O), ("counter", _O), ("name", _O), ("value", _F))
_MEMORY_SPEC = (("ts", _F), ("dur", _F), ("device", _I), ("bytes", _I), ("total_allocated", _I),
                ("total_reserved", _I))

UNITS = {"ts": "us", "dur": "us", "end_ts": "us", "shared_memory": "bytes", "occupancy": "%",
         "bytes": "bytes", "bandwidth": "GB/s", "total_allocated": "bytes", "total_reserved": "bytes"}

_CATEGORY_ALIASES = {
    "kernel": "kernel", "Kernel": "kernel",
    "gpu_memcpy": "memcpy", "Memcpy": "memcpy",
    "gpu_memset": "memset", "Memset": "memset",
    "cuda_runtime": "runtime", "Runtime": "runtime",
    "cuda_driver": "driver",
    "cuda_sync": "sync",
    "cpu_op": "cpu_op", "Operator": "cpu_op", "operator": "cpu_op",
    "user_annotation": "annotation", "gpu_user_annotation": "gpu_annotation",
}


@dataclass
class KinetoTrace:
    """A loaded trace: the event tables (see the module docstring for their columns) and what else the
    file said.

    Attributes:
        path: the file it came from.
        origin_us: the trace's time origin in the file's own clock: the earliest start of any tabled event,
            in microseconds since :attr:`base_time_ns` (or since the Unix epoch when that is 0). ``ts``
            columns are relative to it; :meth:`unix_ns` turns them into Unix time.
        base_time_ns: ``baseTimeNanoseconds`` from the file (PyTorch >= 2.4), Unix ns; 0 when the file has
            none (its ``ts`` are then Unix epoch microseconds). See "Time base" in the module docstring.
        metadata: the top-level keys other than ``traceEvents`` (``deviceProperties``, ``distributedInfo``,
            ``schemaVersion``, ``baseTimeNanoseconds``, ...).
        process_names / thread_names: from the ``M`` (metadata) events.
        skipped: events not put in a table, by category (``ph`` for events without one).
        event_count: all events read.
        warnings: what was odd about the input, one sentence each with its count (events dropped, names
            that were not text, a file cut short, ...); empty for a clean file.
        reading: the reader's notes (bytes read, pieces parsed leniently, parse attempts, truncation).
        conventions / steps: the definitions the tables were selected with ("zoomer" or "hta"; "all" or
            "complete" profiler steps), see :mod:`zoomer_serve.analysis.conventions`.
        syncs_are_gpu_work: HTA's convention: CUPTI synchronisation records on a stream count as GPU work
            (in :meth:`gpu_ops`); ours (False): they are the host waiting.
    """

    path: Path
    origin_us: float
    kernels: Table
    memops: Table
    runtime: Table
    syncs: Table
    cpu_ops: Table
    annotations: Table
    flows: Table
    memory: Table
    metadata: dict[str, Any] = field(default_factory=dict)
    process_names: dict[int, str] = field(default_factory=dict)
    thread_names: dict[tuple[int, int], str] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    event_count: int = 0
    base_time_ns: int = 0
    counters: Table = field(default_factory=lambda: _Builder("counters", _COUNTER_SPEC).empty())
    warnings: list[str] = field(default_factory=list)
    reading: ReadNotes = field(default_factory=ReadNotes)
    conventions: str = "zoomer"
    steps: str = "all"
    syncs_are_gpu_work: bool = False
    _gpu_ops: Table | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def origin_unix_ns(self) -> int:
        """The time origin as Unix time in ns (``base_time_ns + origin_us * 1000``, rounded to the ns; exact
        also for epoch-microsecond origins, whose product with 1000 a double cannot hold)."""
        whole = math.floor(self.origin_us)
        return self.base_time_ns + int(whole) * 1000 + int(round((self.origin_us - whole) * 1000.0))

    def unix_ns(self, ts_us: np.ndarray | float) -> np.ndarray:
        """Table times (us relative to :attr:`origin_us`) as Unix time in ns (int64), right for traces with
        and without ``baseTimeNanoseconds``."""
        rel = np.rint(np.asarray(ts_us, dtype=np.float64) * 1000.0).astype(np.int64)
        return rel + np.int64(self.origin_unix_ns)

    @property
    def device_properties(self) -> dict[int, dict[str, Any]]:
        """Device id -> the ``deviceProperties`` entry (``name``, ``numSms``, ``computeMajor``, ...)."""
        props = self.metadata.get("deviceProperties")
        if not isinstance(props, list):
            return {}
        return {_as_int(p.get("id")): p for p in props if isinstance(p, dict)}

    @property
    def devices(self) -> list[int]:
        """Devices that ran at least one kernel or memory operation, ascending."""
        ids = np.union1d(np.unique(self.kernels["device"]), np.unique(self.memops["device"]))
        return [int(d) for d in ids]

    def gpu_ops(self) -> Table:
        """Kernels and memory operations together (the work that keeps a GPU busy), sorted by ``ts``:
        columns ``ts``, ``dur``, ``device``, ``stream``, ``correlation``, ``name``, ``kind`` ("kernel",
        "memcpy", "memset"; "sync" for the synchronisation records on a stream when
        :attr:`syncs_are_gpu_work`). Computed once per trace."""
        if self._gpu_ops is None:
            k, m = self.kernels, self.memops
            parts = [k, m]
            kinds = [np.full(len(k), "kernel", dtype=object), m["op"]]
            if self.syncs_are_gpu_work:
                s = self.syncs.take(self.syncs["stream"] != -1)
                parts.append(Table("syncs", {**s.columns, "name": s["kind"]}))
                kinds.append(np.full(len(s), "sync", dtype=object))
            cols = {c: np.concatenate([p[c] for p in parts])
                    for c in ("ts", "dur", "device", "stream", "correlation", "name")}
            cols["kind"] = np.concatenate(kinds)
            order = np.argsort(cols["ts"], kind="stable")
            self._gpu_ops = Table("gpu_ops", {c: v[order] for c, v in cols.items()}, {"ts": "us", "dur": "us"})
        return self._gpu_ops

    def summary(self) -> dict[str, Any]:
        """Event counts per table and the time span covered, for printing."""
        return {
            "path": str(self.path), "events": self.event_count, "kernels": len(self.kernels),
            "memops": len(self.memops), "runtime_calls": len(self.runtime), "syncs": len(self.syncs),
            "cpu_ops": len(self.cpu_ops), "annotations": len(self.annotations), "flows": len(self.flows),
            "memory_events": len(self.memory), "devices": self.devices, "skipped": dict(self.skipped),
            "base_time_ns": self.base_time_ns, "start_unix_ns": self.origin_unix_ns,
            "conventions": self.conventions, "steps": self.steps, "warnings": list(self.warnings),
        }


class _Normalizer:
    """Turns parsed event dicts into table rows (raw values; :class:`_Builder` converts them)."""

    def __init__(self) -> None:
        self.kernels = _Builder("kernels", _KERNEL_SPEC)
        self.memops = _Builder("memops", _MEMOP_SPEC)
        self.runtime = _Builder("runtime", _RUNTIME_SPEC)
        self.syncs = _Builder("syncs", _SYNC_SPEC)
        self.cpu_ops = _Builder("cpu_ops", _CPU_SPEC)
        self.annotations = _Builder("annotations", _ANNOT_SPEC)
        self.memory = _Builder("memory", _MEMORY_SPEC)
        self.counters = _Builder("counters", _COUNTER_SPEC)
        self.flow_starts = _Builder("flow_starts", _FLOW_END_SPEC)
        self.flow_ends = _Builder("flow_ends", _FLOW_END_SPEC)
        self.names: dict[str, str] = {}
        self.skipped: Counter[str] = Counter()
        self.process_names: dict[int, str] = {}
        self.thread_names: dict[tuple[int, int], str] = {}
        self.count = 0
        self.not_events = 0  # items of the event array that are no trace event (not an object, or no "ph")
        self.odd_names = 0  # names that were null, numbers or objects
        self.unpaired_flows = 0
        self._memcpy_cache: dict[str, tuple[str, str, str]] = {}

    def builders(self) -> tuple[_Builder, ...]:
        return (self.kernels, self.memops, self.runtime, self.syncs, self.cpu_ops, self.annotations, self.memory,
                self.counters)

    def _memcpy_kind(self, name: str) -> tuple[str, str, str]:
        kind = self._memcpy_cache.get(name)
        if kind is None:
            m = _MEMCPY_NAME.match(name)
            kind = (m.group(1), m.group(2), m.group(3)) if m else ("", "", "")
            self._memcpy_cache[name] = kind
        return kind

    def _odd_name(self, value: Any) -> str:
        self.odd_names += 1
        return _text(value)

    def consume(self, events: list[Any]) -> None:
        """Add one parsed piece of events (event structs, or dicts where the piece did not fit the schema).
        The common case (a complete ``X`` event of a known category) takes the fast path; anything unusual
        is repaired by :meth:`_repair` and taken again, or counted."""
        self.count += len(events)
        if events and not isinstance(events[0], ev.STRUCTS) and not isinstance(events[-1], ev.STRUCTS):
            events = ev.from_dicts(events)
        retry = self._take(events, repaired=False)
        if retry:
            self._take(ev.from_dicts(retry), repaired=True)
        for b in self.builders():
            b.flush()
        self.flow_starts.flush()
        self.flow_ends.flush()

    def _take(self, events: list[Any], repaired: bool) -> list[dict[str, Any]]:
        """Rows from ``events``; returns the repaired events to take again (none when ``repaired``)."""
        names = self.names
        aliases = _CATEGORY_ALIASES
        kernels, memops, runtime = self.kernels.rows, self.memops.rows, self.runtime.rows
        syncs, cpu_ops, annotations = self.syncs.rows, self.cpu_ops.rows, self.annotations.rows
        flow_starts, flow_ends = self.flow_starts.rows, self.flow_ends.rows
        x_type, s_type, f_type = _X_EVENT, _S_EVENT, _F_EVENT
        empty = ev.EMPTY_ARGS
        retry: list[dict[str, Any]] = []
        for e in events:
            try:
                et = type(e)
                if et is x_type:
                    kind = aliases[e.cat]
                    name = e.name
                    if type(name) is not str:
                        name = self._odd_name(name)
                    name = names.setdefault(name, name)
                    a = e.args or empty
                    ts = e.ts
                    dur = e.dur
                    if ts is None or ts is True or ts is False or dur is True or dur is False:
                        raise TypeError("no ts, or a bool for a time")  # repaired or counted by _repair
                    if kind == "cpu_op":
                        cpu_ops.append((ts, dur, e.pid, e.tid, a.external_id, name))
                    elif kind == "runtime" or kind == "driver":
                        runtime.append((ts, dur, e.pid, e.tid, a.correlation, a.external_id, name, a.cbid,
                                        "runtime" if kind == "runtime" else "driver"))
                    elif kind == "kernel":
                        device, stream = a.device, a.stream
                        kernels.append((
                            ts, dur, e.pid if device is None else device, e.tid if stream is None else stream,
                            a.correlation, a.external_id, name, _product(a.grid), _product(a.block),
                            a.registers_per_thread, a.shared_memory, a.blocks_per_sm, a.warps_per_sm, a.occupancy,
                            a.graph_node_id))
                    elif kind == "memcpy" or kind == "memset":
                        direction, src, dst = self._memcpy_kind(name) if kind == "memcpy" else ("", "", "")
                        device, stream = a.device, a.stream
                        memops.append((ts, dur, e.pid if device is None else device,
                                       e.tid if stream is None else stream, a.correlation, a.external_id, name, kind,
                                       direction, src, dst, a.bytes))
                    elif kind == "sync":
                        sk = a.cuda_sync_kind or name
                        if type(sk) is not str:
                            sk = self._odd_name(sk)
                        device, stream = a.device, a.stream
                        syncs.append((ts, dur, e.pid if device is None else device, -1 if stream is None else stream,
                                      a.correlation, names.setdefault(sk, sk), a.wait_on_stream))
                    else:  # annotation / gpu_annotation
                        on_gpu = kind == "gpu_annotation"
                        device, stream = a.device, a.stream
                        annotations.append((ts, dur, e.pid, e.tid, name, on_gpu,
                                            (e.pid if device is None else device) if on_gpu else -1,
                                            (e.tid if stream is None else stream) if on_gpu else -1, a.external_id))
                elif et is f_type or et is s_type:
                    cat = e.cat
                    if type(cat) is not str or e.ts is None:
                        raise TypeError("flow category")
                    (flow_ends if et is f_type else flow_starts).append((cat, e.id, e.ts, e.pid, e.tid))
                elif repaired:
                    self.skipped["malformed event"] += 1
                else:
                    fixed = self._other(e)
                    if fixed is not None:
                        retry.append(fixed)
            except (KeyError, TypeError, AttributeError, ValueError, OverflowError):
                if repaired:
                    self.skipped["malformed event"] += 1
                    continue
                fixed = self._repair(ev.as_dict(e))
                if fixed is not None:
                    retry.append(fixed)
        return retry

    def _other(self, e: Any) -> dict[str, Any] | None:
        """Events of other phases: metadata, memory instants, counters; the rest counted."""
        if isinstance(e, ev.CounterEvent):
            self._counter(e)
            return None
        if not isinstance(e, ev.Event):
            return self._repair(ev.as_dict(e))
        ph = ev.phase_of(e)
        a = e.args or ev.EMPTY_ARGS
        if ph == "M":
            if e.name == "process_name":
                self.process_names[_as_int(e.pid)] = _text(a.name or "")
            elif e.name == "thread_name":
                self.thread_names[(_as_int(e.pid), _as_int(e.tid))] = _text(a.name or "")
            return None
        if ph in ("i", "I") and e.name == "[memory]" and e.ts is not None:
            device = _as_int(a.device_id, -1) if _as_int(a.device_type, 0) == 1 else -1
            self.memory.rows.append((e.ts, 0.0, device, a.memory_bytes, a.total_allocated, a.total_reserved))
            return None
        return self._repair(ev.as_dict(e))

    def _counter(self, e: Any) -> None:
        """A counter sample (``ph`` "C"): one row per numeric value in its ``args`` (Chrome's counter format:
        the event names the counter, each key a series; a key "value" is the counter itself)."""
        args = e.args if isinstance(e.args, dict) else {}
        name = e.name if isinstance(e.name, str) else _text(e.name)
        numeric = {k: v for k, v in args.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if e.ts is None or not numeric:
            self.skipped[f"counter:{_key(name)}"] += 1
            return
        tid = e.tid if isinstance(e.tid, str) else _text(e.tid)
        for key, value in numeric.items():
            self.counters.rows.append((e.ts, e.pid, tid, name, name if key == "value" else key, value))

    def _repair(self, e: Any) -> dict[str, Any] | None:
        """An event (as a dict) the fast path did not take: an ``X`` / flow event missing a field or with a
        value of the wrong type is returned repaired (to take again); anything else is counted in
        :attr:`skipped` (None)."""
        if type(e) is not dict:
            self.skipped["<not an object>"] += 1
            self.not_events += 1
            return None
        ph = e.get("ph")
        if not isinstance(ph, str) or not ph:
            self.not_events += 1
            self.skipped[f"ph={_key(ph)}"] += 1
            return None
        args = e.get("args")
        a: dict[str, Any] = args if isinstance(args, dict) else {}
        cat = e.get("cat")
        cat_key = cat if isinstance(cat, str) else _key(cat)
        if ph == "M":
            name = e.get("name")
            if name == "process_name":
                self.process_names[_as_int(e.get("pid"))] = _text(a.get("name", ""))
            elif name == "thread_name":
                self.thread_names[(_as_int(e.get("pid")), _as_int(e.get("tid")))] = _text(a.get("name", ""))
            return None
        ts = e.get("ts")
        has_ts = ts is not None and not isinstance(ts, bool)  # true would be read as 1: a time 53 years off
        if ph in ("X", "s", "f") and has_ts and (cat_key in _CATEGORY_ALIASES or ph != "X"):
            fixed = {"pid": -1, "tid": -1, "name": "", "id": -1, **e, "cat": cat_key,
                     "args": {k: v for k, v in a.items() if isinstance(k, str)}}
            if not isinstance(fixed["name"], str):
                fixed["name"] = self._odd_name(fixed["name"])
            for key in ("pid", "tid"):
                if not isinstance(fixed[key], (int, float, str)):
                    fixed[key] = -1
            if "dur" in fixed and (fixed["dur"] is None or isinstance(fixed["dur"], bool)):
                fixed["dur"] = NAN
            return fixed
        if ph in ("i", "I"):
            self.skipped[f"instant:{_key(e.get('cat') or e.get('name'))}"] += 1
        elif ph == "X":
            self.skipped[cat_key if has_ts else f"{cat_key} without ts"] += 1
        else:
            self.skipped[f"ph={_key(ph)}"] += 1
        return None

    def _flows(self, origin: float) -> Table:
        for b in (self.flow_starts, self.flow_ends):
            b.collect()
        starts = self.flow_starts.finish(origin, UNITS)
        ends = self.flow_ends.finish(origin, UNITS)
        # pair each end with the (last) start of the same category and id
        n_s = len(starts)
        cats = np.concatenate([starts["cat"], ends["cat"]]).astype(str)
        _, cat_code = np.unique(cats, return_inverse=True)
        keys = np.stack([cat_code.reshape(-1), np.concatenate([starts["id"], ends["id"]])], axis=1)
        if len(keys):
            _, group = np.unique(keys, axis=0, return_inverse=True)
            group = group.reshape(-1)
        else:
            group = np.zeros(0, dtype=np.int64)
        last_start = np.full(int(group.max()) + 1 if len(group) else 0, -1, dtype=np.int64)
        np.maximum.at(last_start, group[:n_s], np.arange(n_s, dtype=np.int64))
        matched = last_start[group[n_s:]] if len(ends) else np.zeros(0, dtype=np.int64)
        e_idx = np.flatnonzero(matched >= 0)
        s_idx = matched[e_idx]
        self.unpaired_flows = len(starts) + len(ends) - 2 * len(s_idx)
        cols = {"cat": starts["cat"][s_idx], "id": starts["id"][s_idx], "ts": starts["ts"][s_idx],
                "pid": starts["pid"][s_idx], "tid": starts["tid"][s_idx], "end_ts": ends["ts"][e_idx],
                "end_pid": ends["pid"][e_idx], "end_tid": ends["tid"][e_idx]}
        order = np.argsort(cols["ts"], kind="stable")
        return Table("flows", {k: v[order] for k, v in cols.items()}, {"ts": "us", "end_ts": "us"})

    def finish(self, path: Path, metadata: dict[str, Any], notes: ReadNotes | None = None) -> KinetoTrace:
        """The trace. Raises TraceFormatError when no item of the event array was a trace event."""
        notes = notes or ReadNotes()
        if self.count == self.not_events:
            found = "the event array is empty" if self.count == 0 else \
                f"{self.count} item(s) in the event array, none an object with a \"ph\""
            cut = f"; {notes.truncated}" if notes.truncated else ""
            raise TraceFormatError(f"{path}: holds no Kineto/Chrome trace events ({found}{cut}); {EXPECTED}")
        for b in self.builders():
            b.collect()
        origin = min((b.min_ts() for b in self.builders()), default=math.inf)
        if origin == math.inf:
            origin = 0.0
        warnings: list[str] = []
        base_ns = _base_time_ns(metadata, origin, warnings)
        tables = {b.name: b.finish(origin, UNITS) for b in self.builders()}
        memops = tables["memops"]
        with np.errstate(divide="ignore", invalid="ignore"):
            bw = np.where(memops["dur"] > 0, memops["bytes"] / (memops["dur"] * 1e3), NAN)
        memops.columns["bandwidth"] = bw.astype(np.float64)
        memops.units["bandwidth"] = "GB/s"
        flows = self._flows(origin)
        skipped = dict(self.skipped)
        if self.unpaired_flows:
            skipped["flow without its other end"] = self.unpaired_flows
        warnings.extend(self._warnings(notes))
        overlapping = _overlapping_on_a_stream(tables["kernels"], memops)
        if overlapping:
            warnings.append(f"{overlapping} GPU operation(s) start before the one ahead of them on the same stream "
                            "has ended (a stream runs one at a time: duplicated events?); busy and idle time count "
                            "the overlap once")
        return KinetoTrace(
            path=path, origin_us=float(origin), kernels=tables["kernels"], memops=memops,
            runtime=tables["runtime"], syncs=tables["syncs"], cpu_ops=tables["cpu_ops"],
            annotations=tables["annotations"], flows=flows, memory=tables["memory"], counters=tables["counters"],
            metadata=metadata, process_names=self.process_names, thread_names=self.thread_names,
            skipped=skipped, event_count=self.count, base_time_ns=base_ns, warnings=warnings, reading=notes)

    def _warnings(self, notes: ReadNotes) -> list[str]:
        out = []
        if notes.truncated:
            out.append(f"file cut short: {notes.truncated}")
        if notes.lenient_pieces:
            out.append(f"{notes.lenient_pieces} piece(s) of the file held NaN / Infinity, raw control characters "
                       f"or invalid UTF-8 (not strict JSON) and were read leniently")
        if self.not_events:
            out.append(f"{self.not_events} item(s) of the event array are not trace events (not a JSON object, or "
                       f"without a \"ph\" phase) and were skipped")
        if self.odd_names:
            out.append(f"{self.odd_names} event(s) had a name that is not a string (null, a number or an object); "
                       f"they are named by its JSON text")
        for b in (*self.builders(), self.flow_starts, self.flow_ends):
            for reason, n in sorted(b.excluded.items()):
                if n:
                    out.append(f"{n} {b.name.replace('_', ' ')} event(s) with {reason} left out of every figure")
        if self.skipped.get("malformed event"):
            out.append(f"{self.skipped['malformed event']} malformed event(s) skipped (fields of the wrong type)")
        for key, n in sorted(self.skipped.items()):
            category = key.removesuffix(" without ts")
            if category != key and category in _CATEGORY_ALIASES:
                out.append(f"{n} {category} event(s) without a \"ts\" (missing, null or true/false) skipped")
        return out


def _overlapping_on_a_stream(kernels: Table, memops: Table) -> int:
    """Kernels and memory operations that start before an earlier one on their (device, stream) has ended."""
    ts = np.concatenate([kernels["ts"], memops["ts"]])
    if len(ts) < 2:
        return 0
    end = ts + np.concatenate([kernels["dur"], memops["dur"]])
    device = np.concatenate([kernels["device"], memops["device"]])
    stream = np.concatenate([kernels["stream"], memops["stream"]])
    order = np.lexsort((ts, stream, device))
    ts, end, device, stream = ts[order], end[order], device[order], stream[order]
    first = np.ones(len(ts), dtype=bool)
    first[1:] = (device[1:] != device[:-1]) | (stream[1:] != stream[:-1])
    reach = end.copy()  # the latest end so far within each stream
    starts = np.flatnonzero(first)
    for start, stop in zip(starts, [*starts[1:], len(ts)]):
        reach[start:stop] = np.maximum.accumulate(end[start:stop])
    return int(np.count_nonzero(~first[1:] & (ts[1:] < reach[:-1])))


_X_EVENT = ev.EVENT_TYPES["X"]
_S_EVENT = ev.EVENT_TYPES["s"]
_F_EVENT = ev.EVENT_TYPES["f"]


def _key(value: Any) -> str:
    """A short, hashable label for a value used as a counter key."""
    text = value if isinstance(value, str) else _text(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _base_time_ns(metadata: dict[str, Any], origin_us: float, warnings: list[str]) -> int:
    """``baseTimeNanoseconds`` as int (0 when absent or unusable, with a warning for the latter)."""
    if "baseTimeNanoseconds" not in metadata:
        return 0
    raw = metadata["baseTimeNanoseconds"]
    base = _as_int(raw, -1) if not isinstance(raw, bool) else -1
    if base < 0 or base >= MAX_BASE_TIME_NS or (isinstance(raw, float) and not math.isfinite(raw)):
        warnings.append(f"baseTimeNanoseconds {_key(raw)} is not a Unix time in ns: ignored (ts read as epoch us)")
        return 0
    if origin_us >= EPOCH_US_FLOOR:
        warnings.append("the ts values are already Unix epoch microseconds although the file names a "
                        "baseTimeNanoseconds: it was ignored")
        return 0
    return base


def _product(dims: Any) -> int:
    if not dims:
        return -1
    try:
        out = 1
        for d in dims:
            out *= int(d)
        return out
    except (TypeError, ValueError):
        return -1


def _num(value: Any) -> float:
    if value is None or isinstance(value, (list, dict)):
        return NAN
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return NAN


def load_trace(path: str | os.PathLike[str], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               on_chunk: Callable[[int], None] | None = None) -> KinetoTrace:
    """Load a Kineto / Chrome trace JSON file (``.json`` or gzip-compressed, detected from its first bytes).

    ``chunk_bytes``: size of the decompressed pieces parsed at a time (memory/speed trade-off).
    ``on_chunk``: called with the number of events after each piece (progress).

    Odd content is repaired or left out and said in :attr:`KinetoTrace.warnings` (see "Odd input" above).

    Raises:
        FileNotFoundError: the file cannot be opened.
        TraceFormatError: not gzip/JSON, no ``traceEvents`` array, JSON broken in the middle, or not one
            trace event (an object with a ``ph`` phase) in the event array.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace not found: {p}")
    return _load(p, EventChunks(p, chunk_bytes, lambda: open_binary(p), _decode_events), on_chunk)


def load_trace_bytes(data: bytes, name: str = "<memory>", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> KinetoTrace:
    """Load a trace from bytes (plain or gzip JSON); for tests and small in-memory traces.

    Raises:
        TraceFormatError: as :func:`load_trace`.
    """
    return _load(Path(name), EventChunks(Path(name), chunk_bytes, read_bytes_opener(data), _decode_events), None)


_BYTE_AT = re.compile(r"\(byte (\d+)\)")


def _decode_events(piece: bytes) -> Any:
    """A piece of the event array as event structs (:mod:`~zoomer_serve.analysis.trace_events`), or as
    dicts when it is JSON of another shape.

    Raises:
        Malformed: not strict JSON (with the byte offset of the failure).
    """
    try:
        return ev.DECODER.decode(piece)
    except msgspec.ValidationError:
        return orjson_decode(piece)
    except msgspec.DecodeError as exc:
        m = _BYTE_AT.search(str(exc))
        pos = int(m.group(1)) if m else len(piece)
        if m and "trailing characters" in str(exc):
            pos -= 1  # msgspec names the byte after the first trailing one; orjson (and the callers) that one
        raise Malformed(pos, str(exc)) from None
    except UnicodeDecodeError as exc:  # invalid UTF-8 in a string: the lenient reader replaces it
        raise Malformed(0, str(exc)) from None


def _load(path: Path, reader: EventChunks, on_chunk: Callable[[int], None] | None) -> KinetoTrace:
    norm = _Normalizer()
    for events in reader:
        norm.consume(events)
        if on_chunk is not None:
            on_chunk(norm.count)
    return norm.finish(path, reader.metadata, reader.notes)
