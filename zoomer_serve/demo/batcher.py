"""A small dynamic batcher for the demo Ranker, recorded with :mod:`zoomer_serve.batching`: the reference for
users who write their own.

Requests are validated and turned into tensors on their own thread (their ``preprocess`` phase), then wait in a
queue. One batching thread takes the oldest request, waits up to ``max_delay_ms`` from that request's enqueue
for more, up to ``max_size`` requests, cuts the batch (``full`` or ``delay``), runs one forward pass over all of
their candidates under the batch's ``forward`` phase, ends the batch (so every member gets its figures) and only
then hands each request its scores; the request builds its response in its own ``postprocess`` phase. The
sync gRPC and Thrift servers wait on a ``concurrent.futures.Future``; the asyncio servers await it
(:meth:`DynamicBatcher.run_async`), so a waiting request holds no thread.

A failed forward pass fails every request of the batch with the same exception; the batcher goes on with the
next batch. :meth:`DynamicBatcher.close` runs what is still queued (cut reason ``drain``) and stops the thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zoomer_serve.batching import CUT_DELAY, CUT_DRAIN, CUT_FULL, BatchRecorder, QueuedRequest
from zoomer_serve.recording import RequestRecorder, phase

if TYPE_CHECKING:
    from .model import DLRM
    from .service import Batch

QUEUE_NAME = "ranker"
_STOP = object()


@dataclass
class _Waiting:
    ticket: QueuedRequest
    inputs: Batch
    future: Future[list[float]]


def concat_inputs(parts: list[Batch]) -> Batch:
    """One model input of all ``parts`` (in order): dense rows stacked, each sparse feature's ids
    concatenated and its offsets shifted by the ids before them."""
    from .service import Batch

    if len(parts) == 1:
        return parts[0]
    dense = torch.cat([p.dense for p in parts])
    ids, offsets = [], []
    for f in range(len(parts[0].ids)):
        shift, feature_offsets = 0, []
        for p in parts:
            feature_offsets.append(p.offsets[f] + shift)
            shift += int(p.ids[f].shape[0])
        ids.append(torch.cat([p.ids[f] for p in parts]))
        offsets.append(torch.cat(feature_offsets))
    return Batch(dense=dense, ids=ids, offsets=offsets)


class DynamicBatcher:
    """Batches forward passes of ``model`` (see the module docstring).

    Args:
        model: the DLRM, in eval mode.
        max_size: most requests in one batch (>= 1).
        max_delay_ms: longest wait, from the oldest queued request's enqueue, for a batch to fill (>= 0).
        recorder: where spans go (default: the process's).

    Raises:
        ValueError: ``max_size`` < 1 or ``max_delay_ms`` < 0.
    """

    def __init__(self, model: DLRM, max_size: int, max_delay_ms: float,
                 recorder: RequestRecorder | None = None) -> None:
        if max_size < 1 or max_delay_ms < 0:
            raise ValueError(f"need max_size >= 1 and max_delay_ms >= 0, got {max_size}, {max_delay_ms}")
        self.model = model
        self.max_size = max_size
        self.max_delay_ns = int(max_delay_ms * 1e6)
        self.recording = BatchRecorder(QUEUE_NAME, max_size=max_size, max_delay_ms=max_delay_ms, recorder=recorder)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ranker-batcher", daemon=True)
        self._thread.start()

    # -- request side ------------------------------------------------------------------------------------
    def submit(self, inputs: Batch) -> Future[list[float]]:
        """Queue the current request's ``inputs``; the future gets its scores (floats, one per candidate).
        Raises RuntimeError once the batcher is closed."""
        if self._closed:
            raise RuntimeError("the batcher is closed")
        future: Future[list[float]] = Future()
        self._queue.put(_Waiting(self.recording.enqueue(items=inputs.size), inputs, future))
        return future

    def run(self, inputs: Batch) -> list[float]:
        """Queue ``inputs`` and wait for the scores (on this thread); re-raises the batch's exception."""
        return self.submit(inputs).result()

    async def run_async(self, inputs: Batch) -> list[float]:
        """Queue ``inputs`` from a coroutine (the request's task) and await the scores."""
        return await asyncio.wrap_future(self.submit(inputs))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests, run what is queued, stop the thread (waits up to ``timeout_s``)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout_s)

    # -- batching thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                break
            batch = [first]
            deadline = first.ticket.enqueued_mono_ns + self.max_delay_ns
            while len(batch) < self.max_size:
                wait_s = (deadline - time.monotonic_ns()) / 1e9
                try:
                    item = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
            self._run(batch, CUT_FULL if len(batch) == self.max_size else CUT_DRAIN if stopping else CUT_DELAY)
        self._drain()

    def _drain(self) -> None:
        left = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                left.append(item)
        for start in range(0, len(left), self.max_size):
            self._run(left[start:start + self.max_size], CUT_DRAIN)

    def _run(self, batch: list[_Waiting], reason: str) -> None:
        """One forward pass over the batch; the batch ends before any request gets its scores."""
        try:
            with self.recording.begin([w.ticket for w in batch], reason):
                with phase("forward"), torch.inference_mode():
                    merged = concat_inputs([w.inputs for w in batch])
                    scores = self.model(merged.dense, merged.ids, merged.offsets).float().cpu().tolist()
        except BaseException as exc:  # every request of the batch fails with it; the next batch runs
            for w in batch:
                w.future.set_exception(exc)
            return
        start = 0
        for w in batch:
            w.future.set_result(scores[start:start + w.inputs.size])
            start += w.inputs.size
