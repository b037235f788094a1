"""The ``zoomer.profiling.v1.ProfilerControl`` admin gRPC service (Start, Stop, Status), closed by default.

Mount it on an existing server::

    add_profiler_control(server, controller)                 # AdminConfig.from_env()

or run it on its own port (127.0.0.1 unless configured)::

    admin_server, port = serve_profiler_control(controller, port=0)

Access policy: :class:`~zoomer_serve.profiling.config.AdminConfig` (token in metadata
``authorization: Bearer <token>``; a missing token is ``UNAUTHENTICATED``, a wrong one ``PERMISSION_DENIED``;
no token configured and not opened to loopback callers: everything ``PERMISSION_DENIED``).
"""

from __future__ import annotations

import hmac
import ipaddress
from concurrent import futures
from typing import Any
from urllib.parse import unquote

import grpc

from zoomer_serve.config import ConfigError
from zoomer_serve.netaddr import is_loopback_host
from zoomer_serve.profiling import profiler_control_pb2 as pb
from zoomer_serve.profiling import profiler_control_pb2_grpc as pb_grpc
from zoomer_serve.profiling import wire
from zoomer_serve.profiling.config import TRIGGER_ON_DEMAND, AdminConfig
from zoomer_serve.profiling.controller import ProfilerController, ProfilingError

AUTH_HEADER = "authorization"
BEARER = "Bearer "
MAX_STOP_WAIT_MS = 120_000


def is_loopback_peer(peer: str | None) -> bool:
    """True for a gRPC peer string on a loopback address (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, which
    grpc writes percent-encoded as ``ipv6:%5B::1%5D:5000``, IPv4-mapped loopback) or a Unix socket."""
    if not peer:
        return False
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = unquote(rest).rpartition(":")[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def check_access(config: AdminConfig, metadata: Any, peer: str | None) -> tuple[grpc.StatusCode, str] | None:
    """None when the caller may use the service, else the status code and message to refuse it with."""
    if config.open_loopback and is_loopback_peer(peer):
        return None
    if config.token is None and config.open_loopback:
        return grpc.StatusCode.PERMISSION_DENIED, (
            f"the profiler admin service is open to loopback callers only, and this caller ({peer}) is not on "
            "loopback: call it from the server's host, or configure ZOOMER_ADMIN_TOKEN on the server and send it")
    if config.token is None:
        return grpc.StatusCode.PERMISSION_DENIED, (
            "the profiler admin service is closed: the server has no ZOOMER_ADMIN_TOKEN configured (set one, "
            "or set ZOOMER_ADMIN_OPEN_LOOPBACK=true to let loopback callers in without a token)")
    sent = None
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            sent = value
            break
    if sent is None:
        return grpc.StatusCode.UNAUTHENTICATED, (
            "missing admin token: send metadata 'authorization: Bearer <token>' (the CLI reads ZOOMER_ADMIN_TOKEN)")
    token = sent[len(BEARER):] if isinstance(sent, str) and sent.startswith(BEARER) else ""
    if not hmac.compare_digest(token.encode(), config.token.encode()):
        return grpc.StatusCode.PERMISSION_DENIED, "wrong admin token"
    return None


class ProfilerControlServicer(pb_grpc.ProfilerControlServicer):
    """Serves Start / Stop / Status for ``controller`` under ``admin`` (see the module docstring)."""

    def __init__(self, controller: ProfilerController, admin: AdminConfig | None = None) -> None:
        self.controller = controller
        self.admin = admin if admin is not None else AdminConfig.from_env()

    def _authorize(self, context: grpc.ServicerContext) -> None:
        refusal = check_access(self.admin, context.invocation_metadata(), context.peer())
        if refusal is not None:
            context.abort(*refusal)

    def Start(self, request: pb.StartRequest, context: grpc.ServicerContext) -> pb.ControlReply:
        self._authorize(context)
        try:
            reply = self.controller.start(wire.options_from(request), trigger=request.trigger or TRIGGER_ON_DEMAND)
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ProfilingError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return wire.reply_to_pb(reply)

    def Stop(self, request: pb.StopRequest, context: grpc.ServicerContext) -> pb.ControlReply:
        self._authorize(context)
        if request.wait_ms > MAX_STOP_WAIT_MS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_ms must be at most {MAX_STOP_WAIT_MS}, "
                          f"got {request.wait_ms}")
        return wire.reply_to_pb(self.controller.stop(wait_s=request.wait_ms / 1000))

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.ControlReply:
        self._authorize(context)
        return wire.reply_to_pb(self.controller.status())


def add_profiler_control(server: grpc.Server, controller: ProfilerController,
                         admin: AdminConfig | None = None) -> ProfilerControlServicer:
    """Register the admin service on ``server`` (before it starts) and attach ``controller`` (it observes the
    request spans: :meth:`ProfilerController.attach`, which does nothing the second time); returns the servicer.

    Without the attach, every session started through the service covered no request, and said nothing."""
    controller.attach()
    servicer = ProfilerControlServicer(controller, admin)
    pb_grpc.add_ProfilerControlServicer_to_server(servicer, server)
    return servicer


def serve_profiler_control(controller: ProfilerController, port: int = 0, admin: AdminConfig | None = None,
                           host: str | None = None) -> tuple[grpc.Server, int]:
    """Run the admin service on its own gRPC server at ``host`` (default ``admin.host``, 127.0.0.1) and
    ``port`` (0: any free port); returns ``(server, bound_port)``.

    Raises:
        ConfigError: a non-loopback host without a token (that would open profiling to the network).
        OSError: the address cannot be bound.
    """
    admin = admin if admin is not None else AdminConfig.from_env()
    host = host or admin.host
    if admin.token is None and not is_loopback_host(host):
        raise ConfigError(f"refusing to serve the profiler admin service on {host!r} without ZOOMER_ADMIN_TOKEN")
    # 4 workers: stops that wait for the trace (each up to MAX_STOP_WAIT_MS) leave room for status calls
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="zoomer-admin"),
                         options=[("grpc.so_reuseport", 0)])
    add_profiler_control(server, controller, admin)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind the profiler admin service to {address}: {exc}") from exc
    if not bound:
        raise OSError(f"cannot bind the profiler admin service to {address}")
    server.start()
    return server, bound
