"""Load a Kineto (PyTorch profiler) / Chrome trace JSON file, plain or gzip, into columnar tables.

Reading
-------
The file is decompressed and parsed as a stream: the ``traceEvents`` array is cut into pieces of about
``chunk_bytes`` at event boundaries, each piece is parsed with ``orjson`` and turned into NumPy columns
before the next one is read. At no time is the whole text, or a Python object per event of the whole
file, held in memory: peak memory is about the final tables plus one piece. Measured on the 35 MB,
109k-event ``a100_training_step`` trace (``benchmarks/ANALYSIS.md``): 1 MiB pieces load it in about 0.65 s
of CPU with 27 MB above the imports, where ``ijson`` streaming (one dict per event from its C backend) into
the same tables takes about twice the CPU time and 51 MB, and ``orjson.loads`` / ``json.load`` of the
whole text alone take 233 / 170 MB. A cut is only accepted where the text
before it parses as complete events, so any valid JSON layout works (one event per line or minified).
Both the Chrome "JSON object" format (``{"traceEvents": [...], ...}``) and the bare "JSON array" format
are accepted.

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

Events of other kinds are not tabled but counted in :attr:`KinetoTrace.skipped` (by category), so nothing
disappears without a trace.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson

from zoomer_serve.analysis.table import Table

DEFAULT_CHUNK_BYTES = 1 << 20
NAN = math.nan

_OPEN_EVENTS = re.compile(rb'"traceEvents"\s*:\s*\[')
_MEMCPY_NAME = re.compile(r"^Memcpy (\w+) \((\w+) -> (\w+)\)")
_WS = b" \t\r\n"


class TraceFormatError(ValueError):
    """The file is not a Chrome / Kineto trace JSON (bad gzip, bad JSON, no ``traceEvents``, or no trace event
    at all); the message names the file and, for bad JSON, the byte offset in the decompressed text."""


_EXPECTED = ('expected a Kineto / Chrome trace: a JSON object with a "traceEvents" array (or a bare JSON array) '
             'of events, each an object with a "ph" phase')


# ---------------------------------------------------------------------------------------------------------
# Streaming reader


def _open_binary(path: Path) -> BinaryIO:
    """The file's decompressed bytes: gzip when it starts with the gzip magic bytes, else plain."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


class _EventChunks:
    """Iterate over lists of event dicts; after exhaustion :attr:`metadata` holds the other top-level keys."""

    def __init__(self, path: Path, chunk_bytes: int) -> None:
        self.path = path
        self.chunk_bytes = max(1024, int(chunk_bytes))
        self.metadata: dict[str, Any] = {}
        self._consumed = 0  # decompressed bytes dropped from the front of the buffer

    def _error(self, what: str, exc: Exception | None = None, offset: int | None = None) -> TraceFormatError:
        where = f" near byte {offset}" if offset is not None else ""
        detail = f": {exc}" if exc is not None else ""
        return TraceFormatError(f"{self.path}: {what}{where}{detail}")

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        try:
            fh = _open_binary(self.path)
        except OSError as exc:
            raise FileNotFoundError(f"cannot read trace {self.path}: {exc}") from exc
        with fh:
            try:
                yield from self._chunks(fh)
            except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
                raise self._error("cannot decompress", exc) from exc

    def _chunks(self, fh: BinaryIO) -> Iterator[list[dict[str, Any]]]:
        read_size = self.chunk_bytes
        buf = b""
        eof = False

        def more() -> bytes:
            nonlocal eof
            data = fh.read(read_size)
            if not data:
                eof = True
            return data

        # 1. Find where the events start: after '"traceEvents": [' at the top level, or a leading '['.
        array_format = False
        search_from = 0
        while True:
            head = buf.lstrip(_WS)
            if head[:1] == b"[":
                array_format = True
                buf = head[1:]
                self._consumed += len(buf) - len(head) + 1
                break
            m = _OPEN_EVENTS.search(buf, search_from)
            if m is not None:
                try:
                    self.metadata = orjson.loads(buf[:m.end()] + b"]}")
                except orjson.JSONDecodeError:  # the key was not at the top level (or the header is bad)
                    search_from = m.start() + 1
                    continue
                self.metadata.pop("traceEvents", None)
                self._consumed += m.end()
                buf = buf[m.end():]
                break
            if eof:
                if not buf.strip(_WS):
                    raise self._error("empty file")
                raise self._error(f"no top-level \"traceEvents\" array: not a Chrome trace JSON file ({_EXPECTED})")
            search_from = max(0, len(buf) - 64)
            buf += more()

        # 2. Complete events, piece by piece.
        while True:
            while not eof and len(buf) < self.chunk_bytes:
                buf += more()
            if eof:
                break
            cut = self._last_boundary(buf)
            if cut is None:  # no complete event yet (one event larger than a piece): read on
                buf += more()
                continue
            events, rest, closed = cut
            yield events
            self._consumed += len(buf) - len(rest)
            buf = rest
            if closed:  # the array ended in this piece: the rest of the file is the top-level tail
                while not eof:
                    buf += more()
                self._after_array(buf, array_format)
                return

        # 3. The tail: the last events, the closing ']' and (object format) the keys after the array.
        yield self._tail(buf, array_format)

    def _last_boundary(self, buf: bytes) -> tuple[list[dict[str, Any]], bytes, bool] | None:
        """Parse ``buf`` up to its last event boundary ('}' followed by ','): (events, rest, False); or,
        when the event array closes inside ``buf``, (events, what follows the array, True). None when no
        boundary is found."""
        end = len(buf)
        tries = 0
        while tries < 16:
            j = buf.rfind(b"}", 0, end)
            if j < 0:
                return None
            k = j + 1
            n = len(buf)
            while k < n and buf[k] in _WS:
                k += 1
            if k < n and buf[k] == 0x2C:  # ','
                piece = b"[" + buf[:j + 1] + b"]"
                try:
                    return orjson.loads(piece), buf[k + 1:], False
                except orjson.JSONDecodeError as exc:
                    # A cut inside a string or a nested object fails at the very end of the piece. Failing
                    # earlier means either the event array closed inside the piece (what precedes the
                    # error position is then a complete array) or the text itself is broken. orjson
                    # reports character positions: convert to bytes when the text is not ASCII.
                    ascii_ = piece.isascii()
                    length = len(piece) if ascii_ else len(piece.decode("utf-8", "replace"))
                    if exc.pos < length - 2:
                        pos = exc.pos if ascii_ else len(piece.decode("utf-8", "replace")[:exc.pos].encode())
                        closed = self._closed_array(piece[:pos])
                        if closed is not None:
                            return closed, buf[pos - 1:], True
                        raise self._error("invalid JSON", exc, self._consumed + max(0, pos - 1)) from None
                    tries += 1
            end = j
        return None

    @staticmethod
    def _closed_array(text: bytes) -> list[Any] | None:
        """``text`` parsed when it is a complete JSON array (the events up to the array's end), else None."""
        text = text.rstrip(_WS)
        if not text.endswith(b"]"):
            return None
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        return value if isinstance(value, list) else None

    def _after_array(self, rest: bytes, array_format: bool) -> None:
        """Parse what follows the closed event array: the remaining top-level keys (object format)."""
        rest = rest.strip(_WS)
        if array_format:
            if rest:
                raise self._error("unexpected content after the event array", offset=self._consumed)
            return
        body = rest[1:] if rest.startswith(b",") else rest
        try:
            doc = orjson.loads(b"{" + body) if body.strip(_WS) != b"}" else {}
        except orjson.JSONDecodeError as exc:
            raise self._error("invalid JSON after the event array", exc, self._consumed) from None
        if not isinstance(doc, dict):
            raise self._error("the top level is not an object")
        self.metadata.update(doc)

    def _tail(self, buf: bytes, array_format: bool) -> list[dict[str, Any]]:
        if array_format:
            body = buf.rstrip(_WS)
            candidates = [b"[" + body] if body.endswith(b"]") else []
            candidates.append(b"[" + body.rstrip(b"]").rstrip(_WS).rstrip(b",") + b"]")  # no closing ']'
            last: Exception | None = None
            for text in candidates:
                try:
                    events = orjson.loads(text)
                    break
                except orjson.JSONDecodeError as exc:
                    last = exc
            else:
                raise self._error("invalid JSON at the end of the event array", last, self._consumed)
            if not isinstance(events, list):
                raise self._error("the event array is not a list")
            return events
        try:
            doc = orjson.loads(b'{"traceEvents":[' + buf)
        except orjson.JSONDecodeError as exc:
            raise self._error("invalid JSON", exc, self._consumed + max(0, exc.pos - 16)) from None
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            raise self._error("\"traceEvents\" is not an array")
        events = doc.pop("traceEvents")
        self.metadata.update(doc)
        return events


# ---------------------------------------------------------------------------------------------------------
# Columnar building


def _as_int(value: Any, default: int = -1) -> int:
    """An id as int: ints as they are, numeric strings and floats converted, anything else ``default``."""
    if type(value) is int:
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


class _Builder:
    """Rows of one table, converted to NumPy column parts after every parsed piece.

    Rows hold the raw JSON values (with defaults for missing keys); conversion to the column dtypes is
    vectorised in :meth:`flush`, falling back to value-by-value conversion for odd values (an id given as
    a string, a null).
    """

    __slots__ = ("name", "spec", "rows", "parts")

    def __init__(self, name: str, spec: tuple[tuple[str, Any], ...]) -> None:
        self.name = name
        self.spec = spec
        self.rows: list[tuple[Any, ...]] = []
        self.parts: list[list[np.ndarray]] = []

    def flush(self) -> None:
        if not self.rows:
            return
        cols = list(zip(*self.rows))
        self.parts.append([_column(col, dtype) for col, (_, dtype) in zip(cols, self.spec)])
        self.rows = []

    def min_ts(self) -> float:
        return min((float(p[0].min()) for p in self.parts if len(p[0])), default=math.inf)

    def finish(self, origin_us: float, units: dict[str, str]) -> Table:
        self.flush()
        columns: dict[str, np.ndarray] = {}
        for i, (col, dtype) in enumerate(self.spec):
            if self.parts:
                columns[col] = np.concatenate([p[i] for p in self.parts]) if len(self.parts) > 1 \
                    else self.parts[0][i]
            else:
                columns[col] = np.empty(0, dtype=dtype)
        self.parts = []
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
    if dtype is object or dtype is np.bool_:
        return np.array(values, dtype=dtype)
    try:
        return np.array(values, dtype=dtype)
    except (TypeError, ValueError, OverflowError):
        if dtype is np.int64:
            return np.array([_as_int(v) for v in values], dtype=dtype)
        return np.array([_num(v) for v in values], dtype=dtype)


_F = np.float64
_I = np.int64
_O = object
_KERNEL_SPEC = (("ts", _F), ("dur", _F), ("device", _I), ("stream", _I), ("correlation", _I),
                ("external_id", _I), ("name", _O), ("grid_blocks", _I), ("block_threads", _I),
                ("registers_per_thread", _I), ("shared_memory", _I), ("blocks_per_sm", _F),
                ("warps_per_sm", _F), ("occupancy", _F))
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
        origin_us: the trace's time origin, in the file's own clock (Kineto: Unix epoch microseconds):
            the earliest start of any tabled event. ``ts`` columns are relative to it; add it to get the
            file's timestamps back (``(origin_us + ts) * 1000`` = Unix epoch ns for Kineto >= PyTorch 2.0).
        metadata: the top-level keys other than ``traceEvents`` (``deviceProperties``, ``distributedInfo``,
            ``schemaVersion``, ...).
        process_names / thread_names: from the ``M`` (metadata) events.
        skipped: events not put in a table, by category (``ph`` for events without one).
        event_count: all events read.
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

    @property
    def device_properties(self) -> dict[int, dict[str, Any]]:
        """Device id -> the ``deviceProperties`` entry (``name``, ``numSms``, ``computeMajor``, ...)."""
        props = self.metadata.get("deviceProperties") or []
        return {_as_int(p.get("id")): p for p in props if isinstance(p, dict)}

    @property
    def devices(self) -> list[int]:
        """Devices that ran at least one kernel or memory operation, ascending."""
        ids = np.union1d(np.unique(self.kernels["device"]), np.unique(self.memops["device"]))
        return [int(d) for d in ids]

    def gpu_ops(self) -> Table:
        """Kernels and memory operations together (the work that keeps a GPU busy), sorted by ``ts``:
        columns ``ts``, ``dur``, ``device``, ``stream``, ``correlation``, ``name``, ``kind`` ("kernel",
        "memcpy", "memset")."""
        k, m = self.kernels, self.memops
        cols = {c: np.concatenate([k[c], m[c]]) for c in ("ts", "dur", "device", "stream", "correlation", "name")}
        cols["kind"] = np.concatenate([np.full(len(k), "kernel", dtype=object), m["op"]])
        order = np.argsort(cols["ts"], kind="stable")
        return Table("gpu_ops", {c: v[order] for c, v in cols.items()}, {"ts": "us", "dur": "us"})

    def summary(self) -> dict[str, Any]:
        """Event counts per table and the time span covered, for printing."""
        return {
            "path": str(self.path), "events": self.event_count, "kernels": len(self.kernels),
            "memops": len(self.memops), "runtime_calls": len(self.runtime), "syncs": len(self.syncs),
            "cpu_ops": len(self.cpu_ops), "annotations": len(self.annotations), "flows": len(self.flows),
            "memory_events": len(self.memory), "devices": self.devices, "skipped": dict(self.skipped),
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
        self.flow_starts = _Builder("flow_starts", _FLOW_END_SPEC)
        self.flow_ends = _Builder("flow_ends", _FLOW_END_SPEC)
        self.names: dict[str, str] = {}
        self.skipped: Counter[str] = Counter()
        self.process_names: dict[int, str] = {}
        self.thread_names: dict[tuple[int, int], str] = {}
        self.count = 0
        self.not_events = 0  # items of the event array that are no trace event (not an object, or no "ph")
        self._memcpy_cache: dict[str, tuple[str, str, str]] = {}

    def builders(self) -> tuple[_Builder, ...]:
        return (self.kernels, self.memops, self.runtime, self.syncs, self.cpu_ops, self.annotations, self.memory)

    def _memcpy_kind(self, name: str) -> tuple[str, str, str]:
        kind = self._memcpy_cache.get(name)
        if kind is None:
            m = _MEMCPY_NAME.match(name)
            kind = (m.group(1), m.group(2), m.group(3)) if m else ("", "", "")
            self._memcpy_cache[name] = kind
        return kind

    def consume(self, events: list[Any]) -> None:
        """Add one parsed piece of events. The common case (a complete ``X`` event of a known category)
        takes the fast path; anything unusual goes through :meth:`_slow`."""
        names = self.names
        aliases = _CATEGORY_ALIASES
        kernels, memops, runtime = self.kernels.rows, self.memops.rows, self.runtime.rows
        syncs, cpu_ops, annotations = self.syncs.rows, self.cpu_ops.rows, self.annotations.rows
        flow_starts, flow_ends = self.flow_starts.rows, self.flow_ends.rows
        for e in events:
            try:
                ph = e["ph"]
                if ph == "X":
                    kind = aliases[e["cat"]]
                    name = e["name"]
                    name = names.setdefault(name, name)
                    a = e.get("args") or _EMPTY
                    if kind == "cpu_op":
                        cpu_ops.append((e["ts"], e.get("dur", 0), e["pid"], e["tid"], a.get("External id", -1),
                                        name))
                    elif kind == "runtime" or kind == "driver":
                        runtime.append((e["ts"], e.get("dur", 0), e["pid"], e["tid"], a.get("correlation", -1),
                                        a.get("External id", -1), name, a.get("cbid", -1),
                                        "runtime" if kind == "runtime" else "driver"))
                    elif kind == "kernel":
                        kernels.append((
                            e["ts"], e.get("dur", 0), a.get("device", e["pid"]), a.get("stream", e["tid"]),
                            a.get("correlation", -1), a.get("External id", -1), name,
                            _product(a.get("grid")), _product(a.get("block")), a.get("registers per thread", -1),
                            a.get("shared memory", -1), a.get("blocks per SM", NAN), a.get("warps per SM", NAN),
                            a.get("est. achieved occupancy %", NAN)))
                    elif kind == "memcpy" or kind == "memset":
                        direction, src, dst = self._memcpy_kind(name) if kind == "memcpy" else ("", "", "")
                        memops.append((e["ts"], e.get("dur", 0), a.get("device", e["pid"]),
                                       a.get("stream", e["tid"]), a.get("correlation", -1),
                                       a.get("External id", -1), name, kind, direction, src, dst,
                                       a.get("bytes", 0)))
                    elif kind == "sync":
                        sk = a.get("cuda_sync_kind") or name
                        syncs.append((e["ts"], e.get("dur", 0), a.get("device", e["pid"]), a.get("stream", -1),
                                      a.get("correlation", -1), names.setdefault(sk, sk),
                                      a.get("wait_on_stream", -1)))
                    else:  # annotation / gpu_annotation
                        on_gpu = kind == "gpu_annotation"
                        annotations.append((e["ts"], e.get("dur", 0), e["pid"], e["tid"], name, on_gpu,
                                            a.get("device", e["pid"]) if on_gpu else -1,
                                            a.get("stream", e["tid"]) if on_gpu else -1,
                                            a.get("External id", -1)))
                elif ph == "f":
                    flow_ends.append((e["cat"], e["id"], e["ts"], e["pid"], e["tid"]))
                elif ph == "s":
                    flow_starts.append((e["cat"], e["id"], e["ts"], e["pid"], e["tid"]))
                else:
                    self._slow(e)
            except (KeyError, TypeError, AttributeError):
                self._slow(e)
        self.count += len(events)
        for b in self.builders():
            b.flush()
        self.flow_starts.flush()
        self.flow_ends.flush()

    def _slow(self, e: Any) -> None:
        """Events the fast path did not take: metadata, instants, and events missing a field."""
        if type(e) is not dict:
            self.skipped["<not an object>"] += 1
            self.not_events += 1
            return
        ph = e.get("ph")
        if not isinstance(ph, str) or not ph:
            self.not_events += 1
        if ph == "M":
            a = e.get("args") or {}
            if e.get("name") == "process_name":
                self.process_names[_as_int(e.get("pid"))] = str(a.get("name", ""))
            elif e.get("name") == "thread_name":
                self.thread_names[(_as_int(e.get("pid")), _as_int(e.get("tid")))] = str(a.get("name", ""))
        elif ph in ("i", "I") and e.get("name") == "[memory]" and e.get("ts") is not None:
            a = e.get("args") or {}
            device = _as_int(a.get("Device Id"), -1) if _as_int(a.get("Device Type"), 0) == 1 else -1
            self.memory.rows.append((e["ts"], 0.0, device, a.get("Bytes", 0), a.get("Total Allocated", 0),
                                     a.get("Total Reserved", 0)))
        elif ph in ("X", "s", "f") and e.get("ts") is not None and e.get("cat") in _CATEGORY_ALIASES \
                and isinstance(e.get("args") or {}, dict):
            fixed = {"pid": -1, "tid": -1, "name": "", "id": -1, **e}
            if fixed["name"] is None:
                fixed["name"] = ""
            self.consume_one(fixed)
        elif ph in ("s", "f") and e.get("ts") is not None:
            fixed = {"pid": -1, "tid": -1, "id": -1, "cat": "", **e}
            self.consume_one(fixed)
        elif ph in ("i", "I"):
            self.skipped[f"instant:{e.get('cat') or e.get('name')}"] += 1
        elif ph == "X":
            self.skipped[str(e.get("cat")) if e.get("ts") is not None else f"{e.get('cat')} without ts"] += 1
        else:
            self.skipped[f"ph={ph}"] += 1

    def consume_one(self, e: dict[str, Any]) -> None:
        """One repaired event through the fast path (without counting it again)."""
        count = self.count
        try:
            self.consume([e])
        finally:
            self.count = count

    def _flows(self, origin: float) -> Table:
        starts = self.flow_starts.finish(origin, UNITS)
        ends = self.flow_ends.finish(origin, UNITS)
        index = {(c, i): n for n, (c, i) in enumerate(zip(starts["cat"].tolist(), starts["id"].tolist()))}
        pairs = [(index.get(key, -1), n) for n, key in enumerate(zip(ends["cat"].tolist(), ends["id"].tolist()))]
        s_idx = np.array([p[0] for p in pairs if p[0] >= 0], dtype=np.int64)
        e_idx = np.array([p[1] for p in pairs if p[0] >= 0], dtype=np.int64)
        self.unpaired_flows = len(starts) + len(ends) - 2 * len(s_idx)
        cols = {"cat": starts["cat"][s_idx], "id": starts["id"][s_idx], "ts": starts["ts"][s_idx],
                "pid": starts["pid"][s_idx], "tid": starts["tid"][s_idx], "end_ts": ends["ts"][e_idx],
                "end_pid": ends["pid"][e_idx], "end_tid": ends["tid"][e_idx]}
        order = np.argsort(cols["ts"], kind="stable")
        return Table("flows", {k: v[order] for k, v in cols.items()}, {"ts": "us", "end_ts": "us"})

    def finish(self, path: Path, metadata: dict[str, Any]) -> KinetoTrace:
        """The trace. Raises TraceFormatError when no item of the event array was a trace event."""
        if self.count == self.not_events:
            found = "the event array is empty" if self.count == 0 else \
                f"{self.count} item(s) in the event array, none an object with a \"ph\""
            raise TraceFormatError(f"{path}: holds no Kineto/Chrome trace events ({found}); {_EXPECTED}")
        origin = min((b.min_ts() for b in self.builders()), default=math.inf)
        if origin == math.inf:
            origin = 0.0
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
        return KinetoTrace(
            path=path, origin_us=float(origin), kernels=tables["kernels"], memops=memops,
            runtime=tables["runtime"], syncs=tables["syncs"], cpu_ops=tables["cpu_ops"],
            annotations=tables["annotations"], flows=flows, memory=tables["memory"],
            metadata=metadata, process_names=self.process_names, thread_names=self.thread_names,
            skipped=skipped, event_count=self.count)


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
    if value is None:
        return NAN
    try:
        return float(value)
    except (TypeError, ValueError):
        return NAN


def load_trace(path: str | os.PathLike[str], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               on_chunk: Callable[[int], None] | None = None) -> KinetoTrace:
    """Load a Kineto / Chrome trace JSON file (``.json`` or gzip-compressed, detected from its first bytes).

    ``chunk_bytes``: size of the decompressed pieces parsed at a time (memory/speed trade-off).
    ``on_chunk``: called with the number of events after each piece (progress).

    Raises:
        FileNotFoundError: the file cannot be opened.
        TraceFormatError: not gzip/JSON, no ``traceEvents`` array, or not one trace event (an object with a
            ``ph`` phase) in the event array.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace not found: {p}")
    reader = _EventChunks(p, chunk_bytes)
    norm = _Normalizer()
    for events in reader:
        norm.consume(events)
        if on_chunk is not None:
            on_chunk(norm.count)
    return norm.finish(p, reader.metadata)


def load_trace_bytes(data: bytes, name: str = "<memory>") -> KinetoTrace:
    """Load a trace from bytes (plain or gzip JSON); for tests and small in-memory traces.

    Raises:
        TraceFormatError: as :func:`load_trace`.
    """
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceFormatError(f"{name}: cannot decompress: {exc}") from exc
    reader = _EventChunks(Path(name), DEFAULT_CHUNK_BYTES)
    norm = _Normalizer()
    for events in reader._chunks(io.BytesIO(data)):
        norm.consume(events)
    return norm.finish(Path(name), reader.metadata)
