"""Profiling one request: a client asks for its request to be profiled, or the server captures the next request
over a latency threshold.

**Asking.** A request asks with gRPC metadata or a Thrift header ``zoomer-profile`` (:data:`PROFILE_KEY`), or a
W3C baggage entry ``zoomer.profile`` (:data:`BAGGAGE_KEY`). It is closed by default, like the admin service
(:class:`~zoomer_serve.profiling.config.AdminConfig`): the ``zoomer-profile`` value must be the admin token
(``<token>`` or ``Bearer <token>``, compared in constant time), unless the server lets loopback callers in
without a token (``ZOOMER_ADMIN_OPEN_LOOPBACK``) and the caller is on a loopback address or a Unix socket. A
baggage entry never carries the token (baggage travels on to every downstream service): it is honoured only for
such loopback callers, or along with a ``zoomer-profile`` header that carries it. Refused asks are counted
(:attr:`RequestProfiler.refused`) and marked on the span (``zoomer.profile.asked`` = ``refused``).

An honoured ask starts a profiling session (trigger ``request``; bounded: :class:`RequestProfilingConfig`
``duration_ms`` and ``max_requests``) and ends it when the asking request ends. The request started before the
profiler, so it is brought in:

- on a thread that may wait (a sync gRPC or threaded Thrift server), the request waits up to ``wait_ms`` for the
  profiler, then its range opens there: it is covered like a request that started inside the session;
- when it is queued for a batch (:mod:`zoomer_serve.batching`), the batch that holds it waits up to ``wait_ms``
  on its batching thread before it runs, and the request is covered through the batch's range (its share of the
  batch's kernels and operators);
- on an event loop (grpc.aio, Thrift asyncio) without batching, nothing may wait: the session starts and covers
  the requests that come after; the asking request is marked ``started``, not covered.

The request span carries ``zoomer.profile.asked`` (``covered``, ``started``, ``busy`` when another session
runs, ``refused``, ``failed``) and ``zoomer.profile.session_id``; the session's ``zoomer.profile`` span links
to it when it was covered.

**Over a threshold.** With ``threshold_ms`` set, the profiler keeps a session armed (trigger
``latency_threshold``, ``threshold_window_ms`` long, at most ``threshold_attempts`` sessions): the first covered
request that takes longer than the threshold ends it (stop reason ``latency_threshold``) and is marked
``zoomer.profile.captured`` = ``latency_threshold``; a session that saw none ends by its duration and the next
is armed. One capture, then the mode is off (:meth:`RequestProfiler.arm_threshold` arms it again).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from zoomer_serve.batching.recorder import add_before_batch, remove_before_batch
from zoomer_serve.config import ConfigError
from zoomer_serve.profiling.config import AdminConfig, SessionOptions
from zoomer_serve.profiling.session import Result, SessionInfo, State
from zoomer_serve.recording import RequestSpan, internal_error
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve.profiling")

PROFILE_KEY = "zoomer-profile"
"""gRPC metadata key / Thrift header that asks for the request to be profiled (value: the admin token)."""
BAGGAGE_KEY = "zoomer.profile"
"""W3C baggage entry that asks for the request to be profiled (loopback callers only; never a token)."""
TRIGGER_REQUEST = "request"
TRIGGER_THRESHOLD = "latency_threshold"
ASKED = "zoomer.profile.asked"
SESSION_ID = "zoomer.profile.session_id"
CAPTURED = "zoomer.profile.captured"
_BEARER = "Bearer "
_POLL_S = 0.005
_MAX_ASKS = 1024  # asked requests tracked at once (more are refused as busy: bounded memory)


@dataclass(frozen=True)
class RequestProfilingConfig:
    """Bounds of request-scoped profiling.

    Attributes:
        wait_ms: longest wait of an asking request (or its batch) for the profiler to start.
        duration_ms / max_requests: bounds of a session started by an ask (it also ends with the request).
        threshold_ms: capture the next request slower than this (ms); None: off.
        threshold_window_ms: length of one armed session of the threshold mode.
        threshold_attempts: most armed sessions before the threshold mode gives up.

    Raises ConfigError: a bound below 1 (the message names it).
    """

    wait_ms: int = 2000
    duration_ms: int = 10_000
    max_requests: int = 50
    threshold_ms: float | None = None
    threshold_window_ms: int = 10_000
    threshold_attempts: int = 6

    def __post_init__(self) -> None:
        for name in ("wait_ms", "duration_ms", "max_requests", "threshold_window_ms", "threshold_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"RequestProfilingConfig.{name} must be a positive integer, got {value!r}")
        if self.threshold_ms is not None and not self.threshold_ms > 0:
            raise ConfigError(f"RequestProfilingConfig.threshold_ms must be > 0, got {self.threshold_ms!r}")


def token_allows(admin: AdminConfig, value: str | bytes | None, loopback: bool) -> bool:
    """The admin access rule for a ``zoomer-profile`` value: the admin token (``<token>`` or ``Bearer
    <token>``), or any non-empty value from a loopback caller when ``admin.open_loopback``."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if admin.open_loopback and loopback and value:
        return True
    if admin.token is None or not value:
        return False
    sent = value[len(_BEARER):] if value.startswith(_BEARER) else value
    return hmac.compare_digest(sent.strip().encode(), admin.token.encode())


def from_loopback(span: RequestSpan) -> bool:
    """Whether the request came over a Unix socket or from a loopback address (``network.peer.address``): a
    peer without a port whose address is a path (``/run/app.sock``), an abstract name (``@name``) or empty
    (an unnamed Unix socket) came over a Unix socket; TCP peers are IP addresses with a port."""
    attrs = span.attributes
    peer = attrs.get("network.peer.address")
    if peer is None:
        return False
    peer = str(peer)
    if "network.peer.port" not in attrs and (peer == "" or peer.startswith(("/", "@"))):
        return True
    try:
        address = ipaddress.ip_address(peer.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class RequestProfiler:
    """Request-scoped profiling over a :class:`~zoomer_serve.profiling.controller.ProfilerController` (see the
    module docstring). :meth:`attach` makes it the process's (the transport adapters hand it asks) and observes
    the controller's recorder."""

    def __init__(self, controller: Any, admin: AdminConfig | None = None,
                 config: RequestProfilingConfig | None = None) -> None:
        self.controller = controller
        self.admin = admin if admin is not None else AdminConfig.from_env()
        self.config = config or RequestProfilingConfig()
        self.refused = 0
        self.honoured = 0
        self.captured = 0
        self._lock = threading.Lock()
        self._asked: dict[int, tuple[RequestSpan, int]] = {}  # span id -> (span, session number), until it ends
        self._pending: dict[int, RequestSpan] = {}  # asked, started before the profiler, not covered yet
        self._threshold_number = 0  # the armed threshold session, 0 when none
        self._threshold_left = 0
        self._attached = False

    # -- lifecycle ---------------------------------------------------------------------------------------
    def attach(self) -> RequestProfiler:
        """Observe request spans, take the adapters' asks, arm the threshold mode when configured."""
        global _active
        if not self._attached:
            self.controller.recorder.add_observer(self)
            self.controller.on_session_end.append(self._session_ended)
            self._attached = True
        _active = self
        add_before_batch(prepare_batch)
        if self.config.threshold_ms is not None:
            self.arm_threshold()
        return self

    def close(self) -> None:
        global _active
        if _active is self:
            _active = None
            remove_before_batch(prepare_batch)
        if self._attached:
            self.controller.recorder.remove_observer(self)
            if self._session_ended in self.controller.on_session_end:
                self.controller.on_session_end.remove(self._session_ended)
            self._attached = False
        self._threshold_left = 0

    # -- asks ----------------------------------------------------------------------------------------------
    def ask(self, span: RequestSpan, value: str | bytes | None, baggage: bool = False) -> str:
        """A request asked to be profiled (``value``: its ``zoomer-profile`` value; ``baggage``: it asked through
        baggage). Returns what became of it (also set as ``zoomer.profile.asked`` on the span). Never raises."""
        try:
            return self._ask(span, value, baggage)
        except Exception as exc:
            internal_error("profiling.on_request.ask", exc)
            return "failed"

    def _ask(self, span: RequestSpan, value: str | bytes | None, baggage: bool) -> str:
        if span.span_id in self._asked:
            return str(span.attributes.get(ASKED, "covered"))
        loopback = from_loopback(span)
        allowed = token_allows(self.admin, value, loopback) if value else (self.admin.open_loopback and loopback)
        if not allowed:
            with self._lock:
                self.refused += 1
            span.attributes[ASKED] = "refused"
            return "refused"
        cfg = self.config
        trigger_attrs = {"trace_id": f"{span.trace_id:032x}", "span_id": f"{span.span_id:016x}",
                         "source": "baggage" if baggage and not value else "header"}
        try:
            reply = self.controller.start(SessionOptions(max_requests=cfg.max_requests, duration_ms=cfg.duration_ms),
                                          trigger=TRIGGER_REQUEST, trigger_attributes=trigger_attrs, wait=False)
        except Exception as exc:  # ProfilingError: the profiler cannot run here
            span.attributes[ASKED] = "failed"
            internal_error("profiling.on_request.start", exc)
            return "failed"
        if reply.result is not Result.STARTED or reply.session is None:
            span.attributes[ASKED] = "busy"
            return "busy"
        with self._lock:
            self.honoured += 1
            if len(self._asked) >= _MAX_ASKS:
                span.attributes[ASKED] = "busy"
                return "busy"
            self._asked[span.span_id] = (span, reply.session.number)
        span.attributes[SESSION_ID] = reply.session.session_id
        if _on_event_loop():
            with self._lock:
                self._pending[span.span_id] = span
            span.attributes[ASKED] = "started"
            return "started"
        covered = self._wait_running() and self.controller.cover(span)
        span.attributes[ASKED] = "covered" if covered else "started"
        return str(span.attributes[ASKED])

    def _wait_running(self) -> bool:
        deadline = time.monotonic() + self.config.wait_ms / 1000
        while time.monotonic() < deadline:
            state = self.controller.state
            if state is State.RUNNING:
                return True
            if state is State.IDLE:  # it failed to start
                return False
            time.sleep(_POLL_S)
        return False

    def prepare_batch(self, spans: list[RequestSpan | None]) -> None:
        """On a batching thread, before a batch of ``spans`` runs: when one of them asked and is not covered
        yet, wait (up to ``wait_ms``) for the profiler, and count them covered through the batch's range."""
        if not self._pending:
            return
        with self._lock:
            asked = [s for s in spans if s is not None and s.span_id in self._pending]
            for s in asked:
                self._pending.pop(s.span_id, None)
        if asked and self._wait_running():
            for s in asked:
                if self.controller.cover(s, open_range=False):
                    s.attributes[ASKED] = "covered"

    # -- observer --------------------------------------------------------------------------------------------
    def on_start(self, span: RequestSpan) -> None:
        """Nothing: asks come from the adapters, which know the request's metadata and baggage."""

    def on_end(self, span: RequestSpan) -> None:
        if self._asked:
            entry = self._asked.pop(span.span_id, None)
            if entry is not None:
                self._pending.pop(span.span_id, None)
                self._stop(entry[1], "request_done")
        if self._threshold_number and span.kind == r.KIND_SERVER:
            self._check_threshold(span)

    def _stop(self, number: int, reason: str) -> None:
        """Stop session ``number`` if it is the active one (another session is left alone)."""
        status = self.controller.status()
        if status.session is not None and status.session.number == number:
            self.controller.stop(reason=reason)

    # -- threshold mode ----------------------------------------------------------------------------------
    def arm_threshold(self) -> None:
        """(Re)arm the threshold mode: up to ``threshold_attempts`` sessions until one captures a request."""
        if self.config.threshold_ms is None:
            raise ConfigError("RequestProfilingConfig.threshold_ms is not set: there is no threshold to arm")
        self._threshold_left = self.config.threshold_attempts
        self._arm_next()

    def _arm_next(self) -> None:
        if self._threshold_left <= 0:
            self._threshold_number = 0
            return
        self._threshold_left -= 1
        cfg = self.config
        try:
            reply = self.controller.start(
                SessionOptions(max_requests=cfg.max_requests, duration_ms=cfg.threshold_window_ms),
                trigger=TRIGGER_THRESHOLD, trigger_attributes={"threshold_ms": cfg.threshold_ms}, wait=False)
        except Exception as exc:
            internal_error("profiling.on_request.threshold", exc)
            self._threshold_number = 0
            return
        self._threshold_number = reply.session.number if reply.result is Result.STARTED and reply.session else 0

    def _check_threshold(self, span: RequestSpan) -> None:
        threshold_ms = self.config.threshold_ms
        if threshold_ms is None or (span.now_ns() - span.start_ns) / 1e6 <= threshold_ms:
            return
        status = self.controller.status()
        info = status.session
        if info is None or info.number != self._threshold_number or info.state is not State.RUNNING:
            return
        if span.start_ns < info.start_time_unix_nano:  # started before the session: not covered
            return
        self._threshold_number = 0
        self._threshold_left = 0
        self.captured += 1
        span.attributes[CAPTURED] = TRIGGER_THRESHOLD
        span.attributes[SESSION_ID] = info.session_id
        self.controller.stop(reason=TRIGGER_THRESHOLD)

    def _session_ended(self, info: SessionInfo) -> None:
        """A session ended: re-arm the threshold mode when its armed session saw no slow request."""
        if info.number == self._threshold_number and info.trigger == TRIGGER_THRESHOLD:
            self._arm_next()


_active: RequestProfiler | None = None


def asked(span: RequestSpan, value: str | bytes | None) -> None:
    """What a transport adapter calls when a request carries ``zoomer-profile`` (right after its span started,
    on the thread or task that received it). Without a request profiler in this process the ask is ignored
    (``zoomer.profile.asked`` = ``unavailable``). Never raises."""
    profiler = _active
    if profiler is None:
        span.attributes[ASKED] = "unavailable"
        return
    profiler.ask(span, value)


def asked_in_baggage(span: RequestSpan) -> None:
    """What a transport adapter calls when a request's raw ``baggage`` header mentions ``zoomer.profile``, once
    the span holds the parsed baggage (``otel_parent_context``): asks when the entry is really there. Never
    raises."""
    ctx = span.otel_parent_context
    if ctx is None:
        return
    try:
        from opentelemetry import baggage

        if baggage.get_baggage(BAGGAGE_KEY, ctx) is None:
            return
    except Exception as exc:
        internal_error("profiling.on_request.baggage", exc)
        return
    profiler = _active
    if profiler is None:
        span.attributes[ASKED] = "unavailable"
        return
    profiler.ask(span, None, baggage=True)


def prepare_batch(spans: list[RequestSpan | None]) -> None:
    """What :mod:`zoomer_serve.batching` calls before a batch runs (see :meth:`RequestProfiler.prepare_batch`);
    a dictionary check when nobody asked."""
    profiler = _active
    if profiler is not None and profiler._pending:
        profiler.prepare_batch(spans)
