"""Where the fleet job's tasks run: a process pool on this machine, or a Ray cluster.

Both take the task arguments as an iterable, keep at most ``in_flight`` tasks submitted at a time (so neither
the driver nor the cluster holds every task or result of a large fleet at once) and yield one
:class:`Outcome` per task as tasks finish, in completion order. Retries:

- a task that raised OSError (storage not reachable, throttled, a timeout) runs again, up to ``retries``
  more times; any other error (a corrupt or missing artifact: ValueError) is final at once;
- a worker that died (killed, out of memory) costs its tasks one attempt each: the local engine starts a new
  pool, Ray re-runs them itself (``max_retries``).

A task that still fails is an :class:`Outcome` with its ``error``; the job goes on.

The Ray engine needs the ``fleet`` extra (``pip install 'zoomer-serve[fleet]'``). Without ``address`` it
starts a local Ray instance with ``workers`` CPUs (and stops it after the job); with one it joins that
cluster (``ray://host:10001`` or ``auto``), whose workers must have zoomer-serve installed.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

ENGINES = ("local", "ray")
RAY_OBJECT_STORE_BYTES = 128 << 20
"""Object store of a local Ray instance: results are small dicts, traces never pass through it."""


class EngineError(RuntimeError):
    """The engine cannot run (Ray not installed, cluster unreachable); the message says what to do."""


@dataclass(frozen=True)
class Outcome:
    """One finished task: its argument, ``result`` (None when it failed), ``error`` ("" when it succeeded),
    and ``attempts`` (runs it took; on Ray, where Ray retries on its own, 1)."""

    task: Any
    result: Any
    error: str
    attempts: int


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_local(fn: Callable[[Any], Any], tasks: Iterable[Any], workers: int = 2, retries: int = 2,
              in_flight: int | None = None) -> Iterator[Outcome]:
    """Run ``fn(task)`` for each task in a pool of ``workers`` processes (spawned: no state is inherited from
    the driver, as on a cluster). ``fn`` must be importable by name."""
    limit = in_flight or workers * 4
    ctx = multiprocessing.get_context("spawn")
    pending = iter(tasks)
    futures: dict[cf.Future[Any], tuple[Any, int]] = {}
    retry: list[tuple[Any, int]] = []
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    try:
        while True:
            while len(futures) < limit:
                item = retry.pop() if retry else _next(pending)
                if item is None:
                    break
                futures[pool.submit(fn, item[0])] = item
            if not futures:
                return
            done, _ = cf.wait(futures, return_when=cf.FIRST_COMPLETED)
            broken = False
            for fut in done:
                task, attempt = futures.pop(fut)
                try:
                    result = fut.result()
                except BrokenProcessPool as exc:
                    broken = True
                    if attempt <= retries:
                        retry.append((task, attempt + 1))
                    else:
                        yield Outcome(task, None, f"worker died: {exc}", attempt)
                    continue
                except Exception as exc:
                    if _retryable(exc) and attempt <= retries:
                        retry.append((task, attempt + 1))
                    else:
                        yield Outcome(task, None, _describe(exc), attempt)
                    continue
                yield Outcome(task, result, "", attempt)
            if broken:  # every other task of the dead pool failed with it: run them again in a new pool
                for task, attempt in list(futures.values()):
                    retry.append((task, attempt + 1) if attempt <= retries else (task, attempt))
                futures.clear()
                pool.shutdown(wait=False, cancel_futures=True)
                pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _next(it: Iterator[Any]) -> tuple[Any, int] | None:
    try:
        return next(it), 1
    except StopIteration:
        return None


def run_ray(fn: Callable[[Any], Any], tasks: Iterable[Any], address: str | None = None, workers: int = 2,
            retries: int = 2, in_flight: int | None = None) -> Iterator[Outcome]:
    """Run ``fn(task)`` for each task as Ray tasks (see the module docstring). Raises EngineError: Ray missing
    or the cluster cannot be joined."""
    try:
        import ray
    except ImportError:
        raise EngineError("the ray engine needs Ray: pip install 'zoomer-serve[fleet]'") from None
    started = False
    if not ray.is_initialized():
        _init_ray(ray, address, workers)
        started = True
    # retry_exceptions takes a list of exception types (the stub says bool)
    remote: Any = ray.remote(max_retries=retries, retry_exceptions=[OSError])(fn)  # type: ignore[call-overload]
    limit = in_flight or max(workers, int(ray.available_resources().get("CPU", workers))) * 4
    pending = iter(tasks)
    refs: dict[Any, Any] = {}
    try:
        while True:
            while len(refs) < limit:
                item = _next(pending)
                if item is None:
                    break
                refs[remote.remote(item[0])] = item[0]
            if not refs:
                return
            ready, _ = ray.wait(list(refs), num_returns=1)
            for ref in ready:
                task = refs.pop(ref)
                try:
                    yield Outcome(task, ray.get(ref), "", 1)
                except Exception as exc:
                    cause = getattr(exc, "cause", None) or exc
                    yield Outcome(task, None, _describe(cause) if cause is not exc else _ray_error(exc), 1)
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


def _init_ray(ray: Any, address: str | None, workers: int) -> None:
    """Join ``address``, or start a local instance (tried twice: on a loaded machine its first start can time
    out). Raises EngineError."""
    error: Exception | None = None
    for _ in range(1 if address else 2):
        try:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                         object_store_memory=RAY_OBJECT_STORE_BYTES)
            return
        except Exception as exc:
            error = exc
            ray.shutdown()
    raise EngineError(f"cannot start or join Ray ({address or 'local'}): {_describe(error or RuntimeError())}")


def _ray_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"
