"""Client of the ``ProfilerControl`` admin service: what the CLI and load generators call.

Usage::

    with ProfilerClient("127.0.0.1:50051") as client:      # token from ZOOMER_ADMIN_TOKEN
        client.start(max_requests=200, trigger="load_test")
        ...
        reply = client.stop(wait_s=60)                     # reply.session.trace_path

Every method returns a :class:`~zoomer_serve.profiling.session.ControlReply`; a refused or failed call raises
:class:`ProfilerControlError` carrying the gRPC status code and the server's message.
"""

from __future__ import annotations

import os
import time
from typing import Any

import grpc

from zoomer_serve.profiling import profiler_control_pb2 as pb
from zoomer_serve.profiling import profiler_control_pb2_grpc as pb_grpc
from zoomer_serve.profiling import wire
from zoomer_serve.profiling.admin import AUTH_HEADER, BEARER, MAX_STOP_WAIT_MS
from zoomer_serve.profiling.config import TRIGGER_ON_DEMAND, SessionOptions, check_admin_token
from zoomer_serve.profiling.session import ControlReply, SessionInfo


class ProfilerControlError(RuntimeError):
    """A ProfilerControl call failed: ``code`` (a ``grpc.StatusCode``) and the server's ``details``."""

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{code.name if code is not None else 'UNKNOWN'}: {details}")
        self.code = code
        self.details = details


class ProfilerClient:
    """Talks to the admin service at ``target`` (``host:port``).

    Args:
        token: the shared admin token; default ``ZOOMER_ADMIN_TOKEN`` from the environment (None: send none).
        timeout_s: deadline of each call (a stop that waits gets its wait on top).
        channel: an existing channel to use instead of opening one.

    Raises ConfigError when the token cannot travel as gRPC metadata (not printable ASCII).
    """

    def __init__(self, target: str, token: str | None = None, timeout_s: float = 30.0,
                 channel: grpc.Channel | None = None) -> None:
        self.target = target
        token = token if token is not None else os.environ.get("ZOOMER_ADMIN_TOKEN")
        self._metadata = ((AUTH_HEADER, BEARER + check_admin_token(token)),) if token else ()
        self.timeout_s = timeout_s
        self._own_channel = channel is None
        self._channel = channel if channel is not None else grpc.insecure_channel(target)
        self._stub = pb_grpc.ProfilerControlStub(self._channel)

    def __enter__(self) -> ProfilerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._own_channel:
            self._channel.close()

    def _call(self, method: Any, request: Any, timeout_s: float) -> ControlReply:
        try:
            return wire.reply_from_pb(method(request, timeout=timeout_s, metadata=self._metadata))
        except grpc.RpcError as err:
            details = err.details() or ""
            if err.code() is grpc.StatusCode.UNIMPLEMENTED:  # a server without the admin service
                details += (f" ({self.target} does not serve the ProfilerControl admin service: zoomer-serve "
                            "serve-demo does on its gRPC port, or with --server aio or --transport thrift on the "
                            "port its ready line gives as admin_port; add it to a server of your own with "
                            "add_profiler_control(server, controller), see docs/profiling.md)")
            raise ProfilerControlError(err.code(), details) from None

    def start(self, max_requests: int | None = None, duration_ms: int | None = None, *, cuda: bool | None = None,
              record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
              with_flops: bool = False, trigger: str = TRIGGER_ON_DEMAND) -> ControlReply:
        """Start a session (see :class:`~zoomer_serve.profiling.config.SessionOptions` for the bounds).
        Result ``started`` or ``already_running``; raises ProfilerControlError (INVALID_ARGUMENT,
        FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE ...)."""
        options = SessionOptions(max_requests=max_requests, duration_ms=duration_ms, cuda=cuda,
                                 record_shapes=record_shapes, profile_memory=profile_memory,
                                 with_stack=with_stack, with_flops=with_flops)
        return self._call(self._stub.Start, wire.start_request(options, trigger), self.timeout_s)

    def stop(self, wait_s: float = 0.0) -> ControlReply:
        """Ask the active session to end; with ``wait_s`` > 0 wait up to that long (at most 120 s) for its
        trace (result ``stopped``). Results ``stopping``, ``already_stopping`` (the session was already ending;
        the same wait, and once it finished ``reply.session.trace_path``), ``not_running``."""
        wait_ms = min(int(wait_s * 1000), MAX_STOP_WAIT_MS)
        return self._call(self._stub.Stop, pb.StopRequest(wait_ms=wait_ms), self.timeout_s + wait_ms / 1000)

    def status(self) -> ControlReply:
        return self._call(self._stub.Status, pb.StatusRequest(), self.timeout_s)

    def wait_finished(self, number: int, timeout_s: float, poll_s: float = 0.2) -> SessionInfo | None:
        """Poll until session ``number`` has finished; its final info, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            last = self.status().last
            if last is not None and last.number >= number:
                return last if last.number == number else None
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)
