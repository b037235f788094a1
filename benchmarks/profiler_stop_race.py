"""How often stopping a profiling capture crashes the process while other threads start running operators, with
and without :meth:`zoomer_serve.profiling.capture.Capture.stop`'s quiescing (see that module's docstring).

Each run is a child process that starts and stops a real :class:`~zoomer_serve.profiling.capture.Capture`
(``profile_all_threads``, trace only) ``--cycles`` times, 50 ms each, while two threads keep starting short-lived
threads that run an ``EmbeddingBag`` 20 times each (what a server's pool does when it grows, and what crashed
the test suite once: a thread's first operator in the session during the stop). A run that dies by a signal
crashed. The two modes alternate run by run.

Usage::

    python benchmarks/profiler_stop_race.py --runs 12 --cycles 150

Run of 2026-12-02 (RESULTS.md): plain 3 of 12 runs crashed, quiesce 0 of 12 (530 s on 2 cores).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_args import Range, parse


def child(quiesce: bool, cycles: int) -> None:
    import torch

    from zoomer_serve.profiling.capture import Activities, Capture
    from zoomer_serve.profiling.config import SessionOptions

    torch.set_num_threads(1)
    bag = torch.nn.EmbeddingBag(10_000, 32, mode="sum")
    ids, offsets = torch.randint(0, 10_000, (256,)), torch.arange(0, 256, 8)
    stop = threading.Event()

    def burst() -> None:
        with torch.no_grad():
            for _ in range(20):
                bag(ids, offsets)

    def spawner() -> None:
        while not stop.is_set():
            threads = [threading.Thread(target=burst) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    spawners = [threading.Thread(target=spawner) for _ in range(2)]
    for t in spawners:
        t.start()
    for _ in range(cycles):
        capture = Capture(SessionOptions(), Activities(cuda=False))
        if not quiesce:
            capture._quiesce = lambda: None  # type: ignore[method-assign]
        capture.start()
        time.sleep(0.05)
        capture.stop()
        capture.release()
    stop.set()
    for t in spawners:
        t.join()


RANGES = (Range("--runs", 1, 1000), Range("--cycles", 1, 100_000))
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=12, help="child processes per mode (default 12)")
    p.add_argument("--cycles", type=int, default=150, help="captures started and stopped per child (default 150)")
    p.add_argument("--child", choices=["quiesce", "plain"], help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parse(build_parser(), argv, RANGES)
    if args.child:
        child(args.child == "quiesce", args.cycles)
        return
    crashed = {"plain": 0, "quiesce": 0}
    started = time.monotonic()
    for _ in range(args.runs):
        for mode in crashed:
            proc = subprocess.run([sys.executable, __file__, "--child", mode, "--cycles", str(args.cycles)],
                                  capture_output=True, timeout=600)
            crashed[mode] += proc.returncode < 0
    for mode, n in crashed.items():
        print(f"{mode}: {n} of {args.runs} runs crashed ({args.cycles} stops each)")
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
