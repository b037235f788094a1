"""The request recorder: the framework-neutral core that every transport adapter calls.

An adapter calls :meth:`RequestRecorder.start` when a request arrives, sets attributes and status on the
returned :class:`RequestSpan` while the request runs, and calls :meth:`RequestSpan.end` exactly once
(later calls are ignored). Ending a span builds one compact record (:mod:`zoomer_serve.recording.records`)
and hands it to the sink (the export pipeline), which only appends it to a bounded queue: encoding and
sending happen off the request path. Phases (:func:`phase`) become child spans of the current request.

While a request span is *active* (between :meth:`RequestSpan.activate` and :meth:`RequestSpan.deactivate`,
on the thread or task that runs the handler), spans that user code starts with the OpenTelemetry API
become its children, and :func:`current_request` returns it.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import sys
import threading
import time
import traceback
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from zoomer_serve.config import SpanLimits
from zoomer_serve.recording import records as r
from zoomer_serve.recording.errors import internal_error
from zoomer_serve.recording.propagation import ParentContext, new_span_id, random_bits
from zoomer_serve.recording.sampling import Sampler

Sink = Callable[[tuple[Any, ...]], None]
HOLD_S = 2.0
"""The longest a request waits in :meth:`RequestRecorder.start` while new requests are held (seconds): the
process was to end long before (fail open)."""
F = TypeVar("F", bound=Callable[..., Any])

_current: contextvars.ContextVar[RequestSpan | None] = contextvars.ContextVar("zoomer_request", default=None)


class _PhaseNode:
    """An open phase as the context sees it: its request, its span id, the phase it was entered under, and
    whether it has ended (a phase ended from another context cannot reset this one: the next phase entered here
    skips it)."""

    __slots__ = ("request", "span_id", "outer", "ended")

    def __init__(self, request: RequestSpan, span_id: int, outer: _PhaseNode | None) -> None:
        self.request = request
        self.span_id = span_id
        self.outer = outer
        self.ended = False


# The innermost phase open in this thread or task, the parent of a phase entered under it. A context variable,
# not a stack on the request: phases of one request that run at once (coroutines under asyncio.gather,
# executor threads) each nest under their own caller's phase, not under each other.
_phase_parent: contextvars.ContextVar[_PhaseNode | None] = contextvars.ContextVar("zoomer_phase", default=None)
_time_ns = time.time_ns  # wall clock: where a span starts
_mono_ns = time.monotonic_ns  # how long it lasts: an NTP step of the wall clock during a request changes nothing


def _drop(record: tuple[Any, ...]) -> None:
    """The sink of a recorder that has nowhere to send records."""


class RequestSpan:
    """One request (or any span an adapter records) between its start and its end.

    Attributes: ``trace_id`` (128-bit int), ``span_id`` (64-bit int), ``parent_id`` (int, 0 for a root),
    ``start_ns`` (Unix epoch ns, read from the wall clock once), ``mono_ns`` (``time.monotonic_ns()`` at that
    start), ``sampled`` (bool: the span is exported; metrics count it either way). Every later time of the span
    (its end, its phases, its events) is ``start_ns`` plus a monotonic delta (:meth:`now_ns`), as OpenTelemetry
    SDKs do, so durations never go negative or jump when the wall clock is stepped.
    Methods never raise into the caller's request handling beyond argument type errors.
    """

    __slots__ = (
        "_recorder", "trace_id", "span_id", "parent_id", "parent_remote", "trace_flags", "trace_state",
        "name", "kind", "start_ns", "attributes", "events", "links", "children", "status", "status_message",
        "_open", "_tokens", "_flags", "otel_parent_context", "thread_joins", "home_thread",
        "mono_ns", "dropped_events", "dropped_links",
    )

    def __init__(self, recorder: RequestRecorder, name: str, kind: int, attributes: dict[str, Any],
                 parent: ParentContext | None, start_ns: int, sampled: bool, is_request: bool,
                 mono_ns: int = 0) -> None:
        self._recorder = recorder
        self.name = name
        self.kind = kind
        self.start_ns = start_ns
        self.mono_ns = mono_ns or _mono_ns()
        self.dropped_events = 0
        self.dropped_links = 0
        self.attributes = attributes
        self.span_id = random_bits(64) or 1  # new_span_id() / new_trace_id() without the calls
        if parent is None:
            self.trace_id = random_bits(128) or 1
            self.parent_id = 0
            self.parent_remote = False
            self.trace_state = None
        else:
            self.trace_id = parent.trace_id
            self.parent_id = parent.span_id
            self.parent_remote = parent.remote
            self.trace_state = parent.trace_state
        self.trace_flags = 1 if sampled else 0
        self._flags = (r.F_SAMPLED if sampled else 0) | (r.F_REQUEST if is_request else 0)
        self.events: list[tuple[int, str, dict[str, Any] | None]] | None = None
        self.links: list[tuple[int, int, dict[str, Any] | None]] | None = None
        self.children: list[tuple[Any, ...]] | None = None
        self.status = r.STATUS_UNSET
        self.status_message: str | None = None
        self._open = [True]  # list.pop() is atomic: the first end() wins
        self._tokens: list[Any] | None = None  # created by the first activate()
        self.otel_parent_context: Any = None  # an OpenTelemetry Context carrying the caller's baggage
        self.thread_joins: tuple[ThreadJoin, ...] = ()  # see add_thread_join
        self.home_thread = 0  # the thread the joins were added on

    @property
    def sampled(self) -> bool:
        return bool(self.trace_flags & 1)

    def now_ns(self) -> int:
        """Now on this span's clock: Unix epoch ns, ``start_ns`` plus the monotonic time since the start."""
        return self.start_ns + (_mono_ns() - self.mono_ns)

    def time_at(self, mono_ns: int) -> int:
        """The Unix epoch ns on this span's clock of a ``time.monotonic_ns()`` reading."""
        return self.start_ns + (mono_ns - self.mono_ns)

    @property
    def is_open(self) -> bool:
        return bool(self._open)

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one span attribute (str, bool, int, float, or a list of those)."""
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str, attributes: dict[str, Any] | None = None, time_ns: int | None = None) -> None:
        """Add a span event at ``time_ns`` (Unix epoch ns; now when omitted). Past the span's event count limit
        (``OTEL_SPAN_EVENT_COUNT_LIMIT``) the event is dropped and counted (``dropped_events_count``)."""
        events = self.events
        if events is None:
            events = self.events = []
        elif len(events) >= self._recorder.limits.event_count:
            self.dropped_events += 1
            return
        events.append((time_ns or self.now_ns(), name, attributes))

    def add_link(self, trace_id: int, span_id: int, attributes: dict[str, Any] | None = None) -> None:
        """Link this span to another span (ids as ints). Past the link count limit (``OTEL_SPAN_LINK_COUNT_LIMIT``)
        the link is dropped and counted (``dropped_links_count``)."""
        links = self.links
        if links is None:
            links = self.links = []
        elif len(links) >= self._recorder.limits.link_count:
            self.dropped_links += 1
            return
        links.append((trace_id, span_id, attributes))

    def record_exception(self, exc: BaseException, attributes: Mapping[str, Any] | None = None,
                         time_ns: int | None = None) -> None:
        """Add the semantic-convention ``exception`` event (type, message, stacktrace), the message and the stack
        trace bounded (``ZOOMER_EXCEPTION_VALUE_LENGTH_LIMIT``, see :class:`~zoomer_serve.config.SpanLimits`);
        ``attributes`` are added to the event's (they win), ``time_ns`` is its time (Unix epoch ns; now when
        omitted)."""
        limit = self._recorder.limits.exception_value_length
        parts = traceback.format_exception(type(exc), exc, exc.__traceback__)
        if limit:  # a long message must not push the frames out: each part gets a share
            parts = [bounded_text(part, max(80, limit // 4)) for part in parts]
        stack = "".join(parts)
        event = {
            "exception.type": type(exc).__qualname__,
            "exception.message": bounded_text(str(exc), limit),
            "exception.stacktrace": bounded_text(stack, limit, keep_tail=True),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, time_ns)

    def set_status(self, status: int, message: str | None = None) -> None:
        """Set the span status: ``records.STATUS_OK`` / ``STATUS_ERROR`` / ``STATUS_UNSET``; an error message is
        bounded like exception text."""
        self.status = status
        if status == r.STATUS_ERROR and message is not None:
            self.status_message = bounded_text(message, self._recorder.limits.exception_value_length)
        else:
            self.status_message = None

    def add_child(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any],
                  status: int = r.STATUS_UNSET, parent_id: int | None = None,
                  span_id: int | None = None,
                  events: list[tuple[int, str, dict[str, Any] | None]] | None = None) -> int:
        """Record a finished child span (a phase) of this span, with optional ``events`` (``(time_ns, name,
        attrs)``); returns its span id."""
        span_id = span_id or new_span_id()
        rec = (self.trace_id, span_id, parent_id or self.span_id, False, self.trace_flags, self.trace_state,
               name, r.KIND_INTERNAL, start_ns, end_ns, status, None, attributes, events or None, None, None,
               self._flags & r.F_SAMPLED)
        if self._open:
            if self.children is None:
                self.children = []
            self.children.append(rec)
        else:  # the request already left: send the child on its own
            self._recorder.sink(rec)
        return span_id

    def add_phase(self, span_id: int, parent_id: int, name: str, start_ns: int, end_ns: int) -> None:
        """Record a plain phase (ended normally, no attributes of its own) as a phase entry
        (:mod:`~zoomer_serve.recording.records`: exported as :meth:`add_child` would, pickled in under half the
        bytes). After the span has ended, the phase is sent on its own as a full record."""
        if self._open:
            children = self.children
            if children is None:
                children = self.children = []
            children.append((span_id, parent_id, name, start_ns, end_ns))
        else:
            self.add_child(name, start_ns, end_ns, {r.PHASE_KEY: name}, r.STATUS_UNSET, parent_id, span_id)

    def child_records(self) -> list[tuple[Any, ...]]:
        """The children recorded so far as full records (phase entries expanded), in the order they ended."""
        sampled = self._flags & r.F_SAMPLED
        return [c if len(c) != r.PHASE_ENTRY_LEN
                else r.phase_record(self.trace_id, self.trace_flags, self.trace_state, sampled, c)
                for c in self.children or ()]

    def add_thread_join(self, join: ThreadJoin) -> None:
        """Carry ``join`` to the other threads this request's work runs on: on each thread other than this one
        (the one calling, the request's own), the request's outermost :class:`phase` there calls
        ``join.enter()`` when it starts and ``join.exit(token)`` with what enter returned when it ends. For
        per-thread state that should follow the request: a profiler range, an allocator tag."""
        self.home_thread = threading.get_ident()
        self.thread_joins = (*self.thread_joins, join)

    def remove_thread_join(self, join: ThreadJoin) -> None:
        """Stop carrying ``join`` (phases already running on other threads still call its exit)."""
        self.thread_joins = tuple(j for j in self.thread_joins if j is not join)

    def activate(self) -> None:
        """Make this span current on this thread or task (see the module docstring). Pair with
        :meth:`deactivate` on the same thread or task."""
        tokens = self._tokens
        if tokens is None:
            tokens = self._tokens = []
        tokens.append(_current.set(self))
        otel = self._recorder.otel_attach
        tokens.append(otel(self) if otel is not None else None)

    def deactivate(self) -> None:
        """Undo the latest :meth:`activate`."""
        try:
            tokens = self._tokens or []
            otel_token = tokens.pop()
            if otel_token is not None:
                self._recorder.otel_detach(otel_token)
            _current.reset(tokens.pop())
        except (IndexError, ValueError) as exc:
            internal_error("RequestSpan.deactivate", exc)

    def end(self, end_ns: int | None = None) -> bool:
        """End the span and hand its record to the sink. Returns True the first time, False after.
        Observers' ``on_end`` run first (they may still set attributes)."""
        try:
            self._open.pop()
        except IndexError:
            return False
        if self._flags & r.F_REQUEST:
            next(self._recorder._ended)
        for observer in self._recorder.observers:
            try:
                observer.on_end(self)
            except Exception as exc:
                internal_error(f"observer.on_end:{type(observer).__name__}", exc)
        if self.dropped_events or self.dropped_links:
            self.attributes[r.DROPPED_KEY] = (self.dropped_events, self.dropped_links)
        rec = (self.trace_id, self.span_id, self.parent_id, self.parent_remote, self.trace_flags,
               self.trace_state, self.name, self.kind, self.start_ns,
               end_ns or self.start_ns + (_mono_ns() - self.mono_ns), self.status,
               self.status_message, self.attributes, self.events, self.links, self.children, self._flags)
        try:
            self._recorder.sink(rec)
        except Exception as exc:  # the sink is ours; never let it break the server
            internal_error("sink", exc)
        return True


class RequestObserver(Protocol):
    """Something that adds to every request span: GPU memory, profiler ranges, ... Registered with
    :meth:`RequestRecorder.add_observer`. ``on_start`` runs right after a request span starts (on the thread
    or task that received the request), ``on_end`` right before its record is built (it may set attributes
    and add events). Both must be cheap and must not block; exceptions are counted and logged once."""

    def on_start(self, span: RequestSpan) -> None: ...

    def on_end(self, span: RequestSpan) -> None: ...


class ThreadJoin(Protocol):
    """Per-thread state that follows a request onto the other threads its phases run on (see
    :meth:`RequestSpan.add_thread_join`). ``enter`` runs on such a thread as the request's outermost phase
    there starts and returns a token; ``exit(token)`` runs on the same thread as that phase ends. Both must be
    cheap; exceptions are counted and logged once."""

    def enter(self) -> Any: ...

    def exit(self, token: Any) -> None: ...


class ProfileScope(Protocol):
    """Which work the running profiler records as ranges, set by the profiling session that runs it
    (:func:`set_profile_scope`; :class:`~zoomer_serve.profiling.session.Session`). ``holds(span)``: the
    :class:`phase` ranges of ``span`` (a request, or a batch, or None outside any) go into the trace.
    ``hold_batch(batch, members)``: a batch starts with those member spans; True (and the batch is held until
    ``release_batch(batch)``) when it serves at least one request of the session. None of them may raise."""

    def holds(self, span: RequestSpan | None) -> bool: ...

    def hold_batch(self, batch: RequestSpan, members: Sequence[RequestSpan | None]) -> bool: ...

    def release_batch(self, batch: RequestSpan) -> None: ...


_profile_scope: ProfileScope | None = None


def set_profile_scope(scope: ProfileScope | None, replacing: ProfileScope | None = None) -> bool:
    """Set the scope of the profiler that runs now (None: every phase under any running profiler becomes a range,
    as for a ``torch.profiler`` session of the application's own). With ``replacing``, only when that is the
    scope set now (a session clears only its own); True when set."""
    global _profile_scope
    if replacing is not None and _profile_scope is not replacing:
        return False
    _profile_scope = scope
    return True


def profile_scope() -> ProfileScope | None:
    """The scope set by :func:`set_profile_scope` (None when no zoomer-serve session runs the profiler)."""
    return _profile_scope


class RequestRecorder:
    """Starts request spans and sends their records to ``sink``.

    Args:
        sink: called with each finished record; must be cheap and must not block (the export pipeline's
            ``submit``).
        sampler: head sampler for new traces (see :class:`~zoomer_serve.recording.sampling.Sampler`).
        otel_context: when True, an active request span is also made the current OpenTelemetry span so
            that user spans become its children (about 1-2 µs per activation).
    """

    def __init__(self, sink: Sink | None = None, sampler: Sampler | None = None, otel_context: bool = True,
                 limits: SpanLimits | None = None) -> None:
        self.sink: Sink = sink or _drop
        self.sampler = sampler or Sampler()
        self.limits = limits or SpanLimits()
        self.observers: tuple[RequestObserver, ...] = ()
        self.otel_attach: Callable[[RequestSpan], Any] | None = None
        self.otel_detach: Callable[[Any], None] = lambda token: None
        self.before_shutdown: tuple[Callable[[], None], ...] = ()
        self._started = itertools.count()  # next() is atomic: request spans started and ended, for in_flight
        self._ended = itertools.count()
        self._hold: threading.Event | None = None  # set by hold_new_requests(): start() waits on it
        if otel_context:
            self._setup_otel_bridge()

    @property
    def in_flight(self) -> int:
        """Request spans (``is_request``) started and not yet ended: requests in progress (one never ended stays
        counted)."""
        return next(self._started) - next(self._ended)  # both advance by one: the difference stays right

    def hold_new_requests(self) -> None:
        """Make :meth:`start` wait (off the main thread, up to :data:`HOLD_S`) until :meth:`release_requests`:
        for a process that is about to end, so that no request starts, and gets answered, after its last count
        of what was recorded (see :meth:`zoomer_serve.Telemetry.finish_before_exit`)."""
        if self._hold is None:
            self._hold = threading.Event()

    def release_requests(self) -> None:
        """Let the requests that :meth:`hold_new_requests` held go on."""
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.set()

    def _setup_otel_bridge(self) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace as otel_trace

        set_span = otel_trace.set_span_in_context
        attach = otel_context.attach
        bridge_cls = _otel_bridge_class()

        def bridge_attach(span: RequestSpan) -> Any:
            return attach(set_span(bridge_cls(span), span.otel_parent_context))

        self.otel_attach = bridge_attach
        self.otel_detach = otel_context.detach
        direct = _direct_otel_context(bridge_cls)
        if direct is not None:
            self.otel_attach, self.otel_detach = direct

    def reconfigure(self, sink: Sink | None, sampler: Sampler, limits: SpanLimits, otel_context: bool) -> None:
        """Point this recorder at another telemetry's export (``configure()`` again): adapters built earlier
        keep it and go on recording into the new one. Observers and shutdown hooks stay."""
        self.sink = sink or _drop
        self.sampler = sampler
        self.limits = limits
        if not otel_context:
            self.otel_attach = None  # otel_detach stays: spans activated before still detach
        elif self.otel_attach is None:
            self._setup_otel_bridge()

    def add_observer(self, observer: RequestObserver) -> None:
        """Add an observer of request spans (see :class:`RequestObserver`)."""
        self.observers = (*self.observers, observer)

    def remove_observer(self, observer: RequestObserver) -> None:
        self.observers = tuple(o for o in self.observers if o is not observer)

    def add_before_shutdown(self, hook: Callable[[], None]) -> None:
        """Have telemetry's shutdown call ``hook`` first (once per hook, however often added): an adapter ends
        there the spans it holds open for a step of the server that may no longer come."""
        if hook not in self.before_shutdown:
            self.before_shutdown = (*self.before_shutdown, hook)

    def run_before_shutdown(self) -> None:
        """Call the hooks of :meth:`add_before_shutdown` (a hook's error is counted and logged, never raised)."""
        for hook in self.before_shutdown:
            try:
                hook()
            except Exception as exc:
                internal_error("before_shutdown", exc)

    def start(self, name: str, kind: int = r.KIND_SERVER, attributes: dict[str, Any] | None = None,
              parent: ParentContext | None = None, start_ns: int | None = None,
              is_request: bool = True, start_mono_ns: int | None = None,
              sampled: bool | None = None) -> RequestSpan:
        """Start a span named ``name`` (for RPCs, the fully qualified method ``pkg.Service/Method``).

        ``parent``: the caller's context from :func:`~zoomer_serve.recording.propagation.parse_traceparent`,
        or None to start a new trace. The start is now unless given: ``start_mono_ns`` (a ``time.monotonic_ns()``
        reading, preferred: the span's duration stays monotonic) or ``start_ns`` (Unix epoch ns). ``is_request``:
        count it in the ``rpc.*.call.duration`` metrics. ``sampled``: None lets the sampler decide; True or False
        decides instead (a batch span follows its member requests).
        """
        hold = self._hold
        if hold is not None and threading.current_thread() is not threading.main_thread():
            hold.wait(HOLD_S)
        if is_request:
            next(self._started)
        trace_id = parent.trace_id if parent is not None else 0
        if sampled is None and parent is not None:
            sampled = self.sampler.should_sample(trace_id, parent)
        wall, mono = _time_ns(), _mono_ns()
        if start_mono_ns:
            wall -= mono - start_mono_ns
            mono = start_mono_ns
        elif start_ns:
            mono -= max(0, wall - start_ns)
            wall = start_ns
        span = RequestSpan(self, name, kind, attributes if attributes is not None else {}, parent, wall, True,
                           is_request, mono)
        if sampled is None:
            sampler = self.sampler
            sampled = sampler.roots_always or sampler.should_sample(span.trace_id, None)
        if not sampled:
            span.trace_flags = 0
            span._flags &= ~r.F_SAMPLED
        for observer in self.observers:
            try:
                observer.on_start(span)
            except Exception as exc:
                internal_error(f"observer.on_start:{type(observer).__name__}", exc)
        return span


@functools.lru_cache(maxsize=1)
def _otel_bridge_class() -> type:
    """An OpenTelemetry ``Span`` that stands for a request span in the OpenTelemetry context
    (``trace.get_current_span()`` in a handler).

    It builds its ``SpanContext`` only when asked (when user code starts a child span), which keeps
    activation at about 1 µs. What a handler does to it through the OpenTelemetry API goes to the request span:
    attributes, events, links, recorded exceptions and status. It is recording while the request span is open
    and sampled. ``end()`` and ``update_name()`` do nothing: the adapter ends and names the request span.
    """
    from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, TraceFlags, TraceState

    class RequestSpanBridge(NonRecordingSpan):
        _ctx: SpanContext | None = None  # built on first ask

        def __init__(self, request: RequestSpan) -> None:  # NonRecordingSpan.__init__ is not called
            self._request = request

        def get_span_context(self) -> SpanContext:
            if self._ctx is None:
                req = self._request
                state = TraceState.from_header([req.trace_state]) if req.trace_state else None
                self._ctx = SpanContext(req.trace_id, req.span_id, False, TraceFlags(req.trace_flags), state)
            return self._ctx

        def is_recording(self) -> bool:
            request = self._request
            return request.is_open and request.sampled

        def set_attribute(self, key: str, value: Any) -> None:
            self._request.set_attribute(key, value)

        def set_attributes(self, attributes: Mapping[str, Any]) -> None:
            self._request.set_attributes(attributes)

        def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                      timestamp: int | None = None) -> None:
            self._request.add_event(name, dict(attributes) if attributes else None, timestamp)

        def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
            if context is not None and context.is_valid:
                self._request.add_link(context.trace_id, context.span_id, dict(attributes) if attributes else None)

        def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                             timestamp: int | None = None, escaped: bool = False) -> None:
            self._request.record_exception(exception, attributes, timestamp)

        def set_status(self, status: Any, description: str | None = None) -> None:
            if isinstance(status, Status):
                status, description = status.status_code, status.description
            code = getattr(status, "value", None)  # a StatusCode: UNSET 0, OK 1, ERROR 2, as OTLP's
            if code in (r.STATUS_UNSET, r.STATUS_OK, r.STATUS_ERROR):
                self._request.set_status(code, description)

        def __repr__(self) -> str:
            return f"RequestSpanBridge({self._request.name!r})"

    return RequestSpanBridge


def _direct_otel_context(bridge_cls: type) -> tuple[Callable[[RequestSpan], Any], Callable[[Any], None]] | None:
    """Attach / detach of a request span's bridge that set OpenTelemetry's context variable directly: what
    ``context.attach(trace.set_span_in_context(bridge))`` and ``context.detach(token)`` do, with four Python
    calls fewer per request. Only where OpenTelemetry runs its default runtime context (a ``ContextVar``);
    None otherwise (another ``OTEL_PYTHON_CONTEXT``, or an SDK whose internals differ), and the API is used."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext

    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    var = getattr(runtime, "_current_context", None)
    if type(runtime) is not ContextVarsRuntimeContext or not isinstance(var, contextvars.ContextVar):
        return None
    probe = otel_trace.set_span_in_context(otel_trace.INVALID_SPAN, otel_context.Context())
    if len(probe) != 1:
        return None
    key = next(iter(probe))  # the key OpenTelemetry keeps the current span under
    context_cls = otel_context.Context
    get, set_ = var.get, var.set
    new = object.__new__

    def attach(span: RequestSpan) -> Any:
        base = span.otel_parent_context
        current = get() if base is None else base
        bridge: Any = new(bridge_cls)  # bridge_cls(span) without its __init__ call
        bridge._request = span
        return set_(context_cls({**current, key: bridge}) if current else context_cls({key: bridge}))

    return attach, var.reset


def bounded_text(text: str, limit: int, keep_tail: bool = False) -> str:
    """``text`` cut to ``limit`` characters (0: not cut), with a note of how many were cut; ``keep_tail`` keeps
    its first and last parts (a stack trace's innermost frames are at its end)."""
    if not limit or len(text) <= limit:
        return text
    note = f" ... [{len(text) - limit} characters cut] ... "
    if keep_tail:
        head = limit // 4
        return text[:head] + note + text[len(text) - (limit - head):]
    return text[:limit] + note


def current_request() -> RequestSpan | None:
    """The request span active on this thread or task, or None."""
    return _current.get()


def _profiler_enabled() -> bool:
    """True while a torch.profiler / autograd profiler session runs: torch's process-wide flag (set by every
    session, so it also covers sessions that profile all threads, started on another thread) or the per-thread
    C check. Cheap; False when torch was never imported, since nobody can be profiling then."""
    global _profiler_probe
    probe = _profiler_probe
    if probe is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        try:
            probe = _profiler_probe = (torch.autograd.profiler, torch.autograd._profiler_enabled)
        except Exception:
            return False
    try:
        return bool(getattr(probe[0], "_is_profiler_enabled", False) or probe[1]())
    except Exception:
        return False


_profiler_probe: tuple[Any, Callable[[], bool]] | None = None  # torch's profiler module and C check, once seen


class _ThreadRequest(threading.local):
    request: RequestSpan | None = None  # the request whose thread joins a phase entered on this thread


_threads = _ThreadRequest()


def _join_thread(req: RequestSpan) -> list[tuple[ThreadJoin, Any]] | None:
    """Enter ``req``'s thread joins on this thread, unless it is the request's own or an outer phase of the
    request already entered them here. Returns what :func:`_leave_thread` needs, or None."""
    if _threads.request is req or req.home_thread == threading.get_ident():
        return None
    entered = []
    for join in req.thread_joins:
        try:
            entered.append((join, join.enter()))
        except Exception as exc:
            internal_error(f"thread_join.enter:{type(join).__name__}", exc)
    _threads.request = req
    return entered


def _leave_thread(entered: list[tuple[ThreadJoin, Any]]) -> None:
    for join, token in reversed(entered):
        try:
            join.exit(token)
        except Exception as exc:
            internal_error(f"thread_join.exit:{type(join).__name__}", exc)
    _threads.request = None


_quiet_exception_tests: list[Callable[[BaseException], bool]] = []


def register_quiet_exception(test: Callable[[BaseException], bool]) -> None:
    """Let a transport adapter name the exceptions that are how its calls end, not failures (grpc's ``abort()``
    raises one through the handler's phases; a cancelled stream's ``GeneratorExit``): a :class:`phase` that one
    leaves keeps status UNSET, as its request span does. Called once per adapter, at import."""
    if test not in _quiet_exception_tests:
        _quiet_exception_tests.append(test)


def _is_quiet(exc: BaseException | None) -> bool:
    return exc is not None and any(test(exc) for test in _quiet_exception_tests)


class phase:
    """Time a block of request work as a child span named ``name`` with attribute ``zoomer.phase``.

    Usable as a context manager or a decorator (:meth:`__call__`: of a function, a coroutine function, whose
    phase is the awaited run, or a generator or async generator function, whose phase is the iteration; each
    call a phase of its own). A phase is the child of the phase open around it in the same task or thread (or
    the one that started it, when its context was copied), else of the request span: coroutines of one request
    gathered together are siblings. While a torch.profiler session runs, the block is also a
    ``torch.profiler.record_function`` range of the same name, so kernel profiles line up with phases; while
    that profiler is a zoomer-serve session's, only for the session's requests and the batches serving them
    (:class:`ProfileScope`: a request outside a bounded session adds no range to its trace). On a
    thread other than the request's own (an executor thread), the request's outermost phase there also enters
    the request's thread joins (:meth:`RequestSpan.add_thread_join`: its profiler range while a profiling
    session covers it, its allocator tag while allocation history records), so that thread's work is the
    request's. Outside a request it only opens that profiler range (when profiling, outside a zoomer-serve
    session) and records nothing. An
    exception leaving the block marks the phase span ERROR (unless an adapter calls it the way its calls end:
    :func:`register_quiet_exception`) and propagates unchanged.
    """

    __slots__ = ("name", "_start_mono", "_request", "_range", "_attrs", "_joined", "_node", "_token")

    def __init__(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self._attrs = dict(attributes) if attributes else None
        self._request: RequestSpan | None = None
        self._range: Any = None
        self._joined: list[tuple[ThreadJoin, Any]] | None = None
        self._start_mono = 0
        self._node: _PhaseNode | None = None
        self._token: contextvars.Token[_PhaseNode | None] | None = None

    def __enter__(self) -> phase:
        req = self._request = _current.get()
        if req is not None and req.thread_joins:
            self._joined = _join_thread(req)
        if _profiler_enabled():
            try:
                scope = _profile_scope
                if scope is None or scope.holds(req):
                    import torch

                    self._range = torch.profiler.record_function(self.name)
                    self._range.__enter__()
            except Exception as exc:
                internal_error("phase.record_function", exc)
                self._range = None
        if req is not None:
            outer = _phase_parent.get()
            while outer is not None and outer.ended:
                outer = outer.outer
            if outer is not None and outer.request is not req:
                outer = None
            node = self._node = _PhaseNode(req, random_bits(64) or 1, outer)  # new_span_id() without the call
            self._token = _phase_parent.set(node)
        self._start_mono = _mono_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        end_mono = _mono_ns()
        if self._range is not None:
            try:
                self._range.__exit__(exc_type, exc, tb)
            except Exception as err:
                internal_error("phase.record_function", err)
            self._range = None
        if self._joined is not None:
            _leave_thread(self._joined)
            self._joined = None
        req = self._request
        if req is None:
            return
        self._request = None
        node, token = self._node, self._token
        self._node = self._token = None
        if node is None:  # entered outside the request (not possible through __enter__); nothing to record
            return
        node.ended = True
        span_id = node.span_id
        parent_id = node.outer.span_id if node.outer is not None else None
        if token is not None:
            try:
                _phase_parent.reset(token)
            except ValueError:  # ended in another context than it started in: ``ended`` makes later phases skip it
                pass
        try:
            base = req.start_ns - req.mono_ns  # req.time_at() of both readings without the calls
            if self._attrs is None and exc_type is None:  # a plain phase: its short form (add_phase, inlined)
                if req._open:
                    children = req.children
                    if children is None:
                        children = req.children = []
                    children.append((span_id, parent_id or req.span_id, self.name, base + self._start_mono,
                                     base + end_mono))
                else:
                    req.add_phase(span_id, parent_id or req.span_id, self.name, base + self._start_mono,
                                  base + end_mono)
                return
            attrs = {r.PHASE_KEY: self.name}
            if self._attrs:
                attrs.update(self._attrs)
            status = r.STATUS_UNSET
            if exc_type is not None and not _is_quiet(exc):
                status = r.STATUS_ERROR
                attrs["error.type"] = exc_type.__qualname__
            req.add_child(self.name, base + self._start_mono, base + end_mono, attrs, status, parent_id, span_id)
        except Exception as err:
            internal_error("phase.exit", err)

    def __call__(self, func: F) -> F:
        """Decorate ``func``: each call runs in a phase of its own (a new :class:`phase`, so concurrent and
        re-entrant calls each get their own span). A coroutine function's phase times the awaited run (from
        when the coroutine starts running to its return or raise, in the request of the task awaiting it); a
        generator function's and an async generator function's from the first ``next()`` / ``__anext__()`` to
        exhaustion, a raise or ``close()`` (a consumer's early close ends the phase normally, not as an error)."""
        name, attrs = self.name, self._attrs
        if inspect.isasyncgenfunction(func):
            return functools.wraps(func)(_async_gen_phase(name, attrs, func))  # type: ignore[return-value]
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def coro_wrapper(*args: Any, **kwargs: Any) -> Any:
                with phase(name, attrs):
                    return await func(*args, **kwargs)

            return coro_wrapper  # type: ignore[return-value]
        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
                with _IterationPhase(name, attrs):
                    return (yield from func(*args, **kwargs))

            return gen_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with phase(name, attrs):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class _IterationPhase(phase):
    """The phase of a decorated generator's or async generator's run: a consumer's ``close()`` /
    ``aclose()`` (GeneratorExit) ends it normally, not as an error."""

    __slots__ = ()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and issubclass(exc_type, GeneratorExit):
            exc_type = exc = tb = None
        super().__exit__(exc_type, exc, tb)


def _async_gen_phase(name: str, attrs: dict[str, Any] | None,
                     func: Callable[..., AsyncGenerator[Any, Any]]) -> Callable[..., AsyncGenerator[Any, Any]]:
    """``phase(name, attrs)`` around each run of the async generator function ``func``: from the first
    ``__anext__()`` to exhaustion, a raise or ``aclose()``. ``asend()`` values and ``athrow()`` exceptions go on
    to the inner generator (as ``yield from`` does for a sync one)."""

    async def agen_wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        with _IterationPhase(name, attrs):
            inner = func(*args, **kwargs)
            try:
                item = await inner.__anext__()
                while True:
                    try:
                        sent = yield item
                    except GeneratorExit:
                        await inner.aclose()
                        raise
                    except BaseException as exc:  # athrow(): into the inner generator
                        item = await inner.athrow(exc)
                    else:
                        item = await inner.asend(sent)
            except StopAsyncIteration:
                pass

    return agen_wrapper
