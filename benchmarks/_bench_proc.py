"""CPU time of a process tree (Linux), for the overhead benchmark.

A process's own CPU comes from its process CPU clock, read from outside with ``clock_gettime`` (the clock id
``clock_getcpuclockid(pid)`` gives: ``(~pid << 3) | 2``, the scheduler's runtime of all its threads, exited
ones included, in ns). Linux lets any process read another's process clock, and the reading is exact to the
scheduler's accounting instead of the 10 ms clock ticks of ``/proc/<pid>/stat`` (``utime`` + ``stime``), which
cost short phases up to 50 µs per request of error (a 2-second phase of 200 model requests). Where the clock
cannot be read, the ticks are used. The CPU of children a process has waited for comes from ``/proc/<pid>/stat``
(``cutime`` + ``cstime``, fields 16, 17, in ticks). Descendants are found through
``/proc/<pid>/task/<tid>/children``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses


def cpu_ticks(pid: int, with_reaped_children: bool) -> int:
    """CPU of ``pid`` in clock ticks: utime + stime (+ cutime + cstime); 0 when the process is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0
    # after the name: state(3) ppid(4) ... utime(14) stime(15) cutime(16) cstime(17); index = field - 3
    ticks = int(fields[11]) + int(fields[12])
    if with_reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks


def process_clock_ns(pid: int) -> int | None:
    """CPU of ``pid``'s threads (exited ones included) in ns, from its process CPU clock; None when the clock
    cannot be read (no such process, not Linux)."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the process: clock_getcpuclockid
    except (OSError, OverflowError, AttributeError):
        return None


def cpu_s(pid: int, with_reaped_children: bool) -> float:
    """CPU seconds of ``pid`` (its process clock, else its ticks) plus, when asked, of the children it has waited
    for (ticks); 0 when the process is gone."""
    own_ns = process_clock_ns(pid)
    if own_ns is None:
        return cpu_ticks(pid, with_reaped_children) * _TICK_S
    if not with_reaped_children:
        return own_ns / 1e9
    fields = _stat_fields(pid)
    reaped = int(fields[13]) + int(fields[14]) if fields is not None else 0
    return own_ns / 1e9 + reaped * _TICK_S


def children(pid: int) -> list[int]:
    """Pids of the live children of ``pid`` (all its threads'), [] when it is gone."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out.extend(int(p) for p in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Pids of all live descendants of ``pid`` (bounded to 256)."""
    found: list[int] = []
    todo = [pid]
    while todo and len(found) < 256:
        for child in children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


@dataclass(frozen=True)
class TreeCpu:
    """CPU seconds of a process tree at one instant: ``main_s`` (the process itself, including children it
    has reaped) and ``helpers_s`` (its live descendants, e.g. the export helper process)."""

    main_s: float
    helpers_s: float

    @property
    def total_s(self) -> float:
        return self.main_s + self.helpers_s


def tree_cpu(pid: int, extra_pids: tuple[int, ...] = ()) -> TreeCpu:
    """A :class:`TreeCpu` reading of ``pid`` and its live descendants, plus ``extra_pids`` (helpers that are
    not descendants) when they are not among them.

    A helper that exits and is reaped between two readings moves from ``helpers_s`` into ``main_s``
    (cutime/cstime), so differences of two readings stay right.
    """
    found = descendants(pid)
    found += [p for p in extra_pids if p not in found and p != pid]
    helpers = sum(cpu_s(p, with_reaped_children=True) for p in found)
    return TreeCpu(cpu_s(pid, with_reaped_children=True), helpers)


def process_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` alone (its threads, not its children)."""
    return cpu_s(pid, with_reaped_children=False)
