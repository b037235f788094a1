"""Every name batch recording writes: span names and attributes, phase names, metrics, with unit and source.

One place for each name; the recorder, the export worker's metrics and the analysis import them from here.

Batch span (kind INTERNAL, a trace of its own; linked to every member request span, the way the OpenTelemetry
messaging conventions relate one batch operation to the messages it processes):

| attribute | unit | meaning |
| --- | --- | --- |
| ``messaging.operation.type`` | | ``process`` |
| ``messaging.destination.name`` | | the queue's name (:class:`~zoomer_serve.batching.BatchRecorder` ``queue``) |
| ``messaging.batch.message_count`` | {request} | member requests in the batch |
| ``zoomer.batch.size`` | {request} | the same, under the batching namespace |
| ``zoomer.batch.items`` | {item} | items of all members (candidates, sequences, images: what the batcher counts) |
| ``zoomer.batch.max_size`` | {request} | the batcher's maximum batch size (when given) |
| ``zoomer.batch.fill`` | 1 | size / max_size (when the maximum is given) |
| ``zoomer.batch.max_delay_ms`` | ms | the batcher's longest wait for a batch to fill (when given) |
| ``zoomer.batch.cut_reason`` | | why the batch was cut: ``full`` (max size reached), ``delay`` (the delay expired), or the batcher's own word (``drain``) |
| ``zoomer.batch.share_rule`` | | ``items`` (shares by items, the default) or ``equal`` |
| ``zoomer.batch.queue_wait.max_ns`` | ns | the longest queue wait among the members |
| ``zoomer.batch.untraced`` | {request} | members that had no request span (counted, not linked) |

Each link carries ``zoomer.batch.index`` and ``zoomer.batch.share`` of its member. The batch's phases
(``zoomer_serve.phase`` on the batch thread) are its child spans.

Member request span (the SERVER span of each request in the batch):

| attribute | unit | meaning |
| --- | --- | --- |
| ``zoomer.batch.id`` | | the batch span's span id (16 lowercase hex digits) |
| ``zoomer.batch.size`` | {request} | members of its batch |
| ``zoomer.batch.index`` | | its position in the batch (0-based, the order the batcher gave) |
| ``zoomer.batch.items`` | {item} | its own items |
| ``zoomer.batch.share`` | 1 | its share of the batch (see :mod:`zoomer_serve.batching.shares`) |
| ``zoomer.batch.queue_wait_ns`` | ns | from its enqueue to the batch's start (monotonic clock) |
| ``zoomer.batch.phase.names`` / ``zoomer.batch.phase.share_ns`` | ns | the batch's phases and its share of each phase's time (parallel arrays; the shares of one phase sum to the phase's duration exactly) |
| ``zoomer.batch.gpu.memory.peak`` | By | its share of the batch's GPU working memory: the batch's ``zoomer.gpu.memory.peak`` minus its ``zoomer.gpu.memory.allocated.start`` (when GPU telemetry runs) |
| ``zoomer.batch.gpu.memory.device_allocs`` | {call} | its share of the batch's ``zoomer.gpu.memory.device_allocs`` |

With allocation history on (``ZOOMER_GPU_MEMORY_HISTORY``), the batch's allocations are tagged with the batch
span and come back as its ``zoomer.gpu.memory.events`` child when drained; each member then gets a child of the
same name with its share of every count and byte figure, marked with ``zoomer.batch.id`` and
``zoomer.batch.share`` (the members' parts add up to the batch's: sum either the batch's child or the members',
not both).

A streaming call whose messages are queued one by one joins one batch per message: it is linked from each of
those batches, gets a ``queue`` child and phase copies per message, and its ``zoomer.batch.*`` attributes are
those of its last message's batch. Figures over all its messages (the report's Batching table, the queue-wait
findings) read the ``queue`` children instead: one per message, with its ``zoomer.batch.id``, over its queue wait.

Besides, each member gets child spans: ``queue`` (``zoomer.phase`` = ``queue``, from its enqueue to the batch's
start) and one per top-level phase of its batch, over the same time as the batch's phase (``zoomer.phase`` = its
name, ``zoomer.batch.id``): a request waited through its batch's whole forward pass, so the latency picture
(the report's phases) stays a request's own; the shares above are the cost picture. The request links back to
its batch span.

Metrics (computed by the export worker from the member records, like ``rpc.server.call.duration``, with the
same attributes, ``rpc.method`` among them): ``zoomer.batch.queue_wait.duration`` (histogram, s) and
``zoomer.batch.size`` (histogram, {request}: the size of the batch each request ran in).
"""

from __future__ import annotations

from typing import Final

SPAN_NAME_PREFIX: Final = "process "
"""The batch span is named ``process <queue>`` (messaging conventions: ``{operation} {destination}``)."""

# -- batch span ------------------------------------------------------------------------------------------
MESSAGING_OPERATION_TYPE: Final = "messaging.operation.type"
MESSAGING_DESTINATION: Final = "messaging.destination.name"
MESSAGING_BATCH_COUNT: Final = "messaging.batch.message_count"
OPERATION_PROCESS: Final = "process"
SIZE: Final = "zoomer.batch.size"
ITEMS: Final = "zoomer.batch.items"
MAX_SIZE: Final = "zoomer.batch.max_size"
FILL: Final = "zoomer.batch.fill"
MAX_DELAY_MS: Final = "zoomer.batch.max_delay_ms"
CUT_REASON: Final = "zoomer.batch.cut_reason"
SHARE_RULE: Final = "zoomer.batch.share_rule"
QUEUE_WAIT_MAX: Final = "zoomer.batch.queue_wait.max_ns"
UNTRACED: Final = "zoomer.batch.untraced"

CUT_FULL: Final = "full"
CUT_DELAY: Final = "delay"
CUT_DRAIN: Final = "drain"

# -- member request span -----------------------------------------------------------------------------
BATCH_ID: Final = "zoomer.batch.id"
INDEX: Final = "zoomer.batch.index"
SHARE: Final = "zoomer.batch.share"
QUEUE_WAIT: Final = "zoomer.batch.queue_wait_ns"
PHASE_NAMES: Final = "zoomer.batch.phase.names"
PHASE_SHARE_NS: Final = "zoomer.batch.phase.share_ns"
GPU_PEAK_SHARE: Final = "zoomer.batch.gpu.memory.peak"
GPU_DEVICE_ALLOCS_SHARE: Final = "zoomer.batch.gpu.memory.device_allocs"
QUEUE_PHASE: Final = "queue"
"""The ``zoomer.phase`` of a member's child span from its enqueue to its batch's start."""

# -- metrics -------------------------------------------------------------------------------------------
METRIC_QUEUE_WAIT: Final = "zoomer.batch.queue_wait.duration"
METRIC_SIZE: Final = "zoomer.batch.size"
