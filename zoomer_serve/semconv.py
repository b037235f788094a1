"""The OpenTelemetry semantic conventions zoomer-serve follows: one version, and the RPC names it emits.

zoomer-serve follows semantic conventions **v1.44.0** (:data:`SEMCONV_VERSION`), the newest release; every
scope it exports (spans and metrics) carries :data:`SCHEMA_URL`. What that release says about RPC, and what
zoomer-serve does (docs/semantic-conventions.md has the page):

- RPC spans carry ``rpc.system.name``, ``rpc.method`` (``pkg.Service/Method``), ``rpc.method_original``,
  ``rpc.response.status_code``, ``error.type``, ``server.address`` / ``server.port``,
  ``network.peer.address`` / ``network.peer.port`` (:data:`RPC_SPAN_ATTRIBUTES`).
- Removed from RPC spans and metrics: ``network.type`` (v1.38), ``network.transport``,
  ``network.protocol.name`` / ``.version`` (v1.40), ``client.address`` / ``client.port`` on server spans
  (v1.42) (:data:`REMOVED`): not emitted.
- Deprecated: the ``rpc.{server,client}.{request,response}.size`` metrics (v1.40); ``rpc.system``,
  ``rpc.service``, ``rpc.grpc.status_code`` (v1.39) (:data:`DEPRECATED`): emitted only with
  ``OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup``.
- Exceptions: v1.40 defines the ``rpc.server.call.exception`` / ``rpc.client.call.exception`` events as log
  records and deprecates exception span events, but tells existing instrumentations to keep span events by
  default and offer ``OTEL_SEMCONV_EXCEPTION_SIGNAL_OPT_IN`` (``logs``, ``logs/dup``). zoomer-serve exports no
  logs, so it keeps the ``exception`` span event (``exception.type`` / ``.message`` / ``.stacktrace``) and
  answers those values with a warning (:func:`exception_signal_note`).

The stability opt-in, as OpenTelemetry instrumentations read it (:func:`rpc_opt_in`):
``OTEL_SEMCONV_STABILITY_OPT_IN`` (comma-separated) containing ``rpc`` emits the names of the conventions'
unreleased main where they differ from v1.44.0 (:data:`NEXT_RENAMES`: ``rpc.status_code`` for
``rpc.response.status_code``) instead of them; ``rpc/dup`` (which wins over ``rpc``) emits every name: the
v1.44.0 ones, the deprecated ones and the next ones. By default only v1.44.0's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

SEMCONV_VERSION: Final = "1.44.0"
"""The semantic-conventions release zoomer-serve follows."""
SCHEMA_URL: Final = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
"""The schema URL of that release: set on every exported instrumentation scope (spans and metrics)."""

# -- RPC span attributes of v1.44.0 ----------------------------------------------------------------------------
RPC_SYSTEM_NAME: Final = "rpc.system.name"
RPC_METHOD: Final = "rpc.method"
RPC_METHOD_ORIGINAL: Final = "rpc.method_original"
RPC_RESPONSE_STATUS_CODE: Final = "rpc.response.status_code"
ERROR_TYPE: Final = "error.type"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
NETWORK_PEER_ADDRESS: Final = "network.peer.address"
NETWORK_PEER_PORT: Final = "network.peer.port"

RPC_SPAN_ATTRIBUTES: Final = frozenset({
    RPC_SYSTEM_NAME, RPC_METHOD, RPC_METHOD_ORIGINAL, RPC_RESPONSE_STATUS_CODE, ERROR_TYPE, SERVER_ADDRESS,
    SERVER_PORT, NETWORK_PEER_ADDRESS, NETWORK_PEER_PORT,
})
"""The attributes v1.44.0 defines on RPC client and server spans (docs/rpc/rpc-spans.md at that tag)."""

RPC_SERVER_CALL_DURATION: Final = "rpc.server.call.duration"
RPC_CLIENT_CALL_DURATION: Final = "rpc.client.call.duration"
RPC_METRICS: Final = frozenset({RPC_SERVER_CALL_DURATION, RPC_CLIENT_CALL_DURATION})
"""The RPC metrics of v1.44.0 (docs/rpc/rpc-metrics.md at that tag)."""

EXCEPTION_EVENT: Final = "exception"
"""The exception span event (deprecated in v1.40 in favour of log records; kept by default, see above)."""

# -- what v1.44.0 removed or deprecated --------------------------------------------------------------------------
REMOVED: Final = frozenset({
    "network.type", "network.transport", "network.protocol.name", "network.protocol.version", "client.address",
    "client.port",
})
"""Attributes removed from RPC spans (and metrics) by v1.44.0 or earlier: never emitted on them."""

RPC_SYSTEM: Final = "rpc.system"
RPC_SERVICE: Final = "rpc.service"
RPC_GRPC_STATUS_CODE: Final = "rpc.grpc.status_code"
DEPRECATED_ATTRIBUTES: Final = frozenset({RPC_SYSTEM, RPC_SERVICE, RPC_GRPC_STATUS_CODE})
DEPRECATED_METRICS: Final = frozenset({
    f"rpc.{side}.{what}.size" for side in ("server", "client") for what in ("request", "response")})
DEPRECATED: Final = DEPRECATED_ATTRIBUTES | DEPRECATED_METRICS
"""Deprecated by v1.44.0: emitted only with ``rpc/dup``."""

# -- the unreleased main -------------------------------------------------------------------------------------------
RPC_STATUS_CODE: Final = "rpc.status_code"
NEXT_RENAMES: Mapping[str, str] = {RPC_RESPONSE_STATUS_CODE: RPC_STATUS_CODE}
"""Renames that only the conventions' unreleased main has (v1.44.0 name -> next name): under the opt-in."""

OptIn = Literal["default", "next", "dup"]


def rpc_opt_in(value: str | None) -> OptIn:
    """The RPC names to emit for an ``OTEL_SEMCONV_STABILITY_OPT_IN`` value: ``"dup"`` when it lists
    ``rpc/dup``, else ``"next"`` when it lists ``rpc``, else ``"default"`` (v1.44.0 names only). Other
    categories (``http``, ``database``) are not ours and are ignored."""
    items = {part.strip() for part in (value or "").split(",")}
    if "rpc/dup" in items:
        return "dup"
    if "rpc" in items:
        return "next"
    return "default"


EXCEPTION_SIGNAL_OPT_IN: Final = "OTEL_SEMCONV_EXCEPTION_SIGNAL_OPT_IN"


def exception_signal_note(value: str | None) -> str | None:
    """What to tell a user who set ``OTEL_SEMCONV_EXCEPTION_SIGNAL_OPT_IN`` to ``logs`` or ``logs/dup``
    (exceptions as log records): zoomer-serve exports no logs, so exceptions stay span events. None when the
    variable asks for nothing we do not do."""
    items = {part.strip() for part in (value or "").split(",")}
    asked = sorted(items & {"logs", "logs/dup"})
    if not asked:
        return None
    return (f"{EXCEPTION_SIGNAL_OPT_IN}={value!r} asks for exceptions as log records; zoomer-serve exports no logs, "
            "so exceptions stay span events ('exception', semantic conventions v1.44.0's default)")


def status_attributes(status: str, opt_in: OptIn) -> dict[str, str]:
    """The status code attribute(s) of an RPC span or metric for ``status`` (``OK``, ``INVALID_ARGUMENT``)."""
    if opt_in == "default":
        return {RPC_RESPONSE_STATUS_CODE: status}
    if opt_in == "next":
        return {RPC_STATUS_CODE: status}
    return {RPC_RESPONSE_STATUS_CODE: status, RPC_STATUS_CODE: status}


def method_sql(alias: str = "", fallback: str | None = None) -> str:
    """The SQL expression (DuckDB, over a store's ``spans``; ``alias`` = a table alias such as ``"s."``) that
    names a request's method: ``rpc.method`` when it is ``pkg.Service/Method`` (these conventions); under the
    older ones, which other instrumentations still emit (``rpc.service`` = ``pkg.A``, ``rpc.method`` = ``Get``),
    ``rpc.service/rpc.method``, so that ``pkg.A/Get`` and ``pkg.B/Get`` stay apart; else ``fallback`` (an SQL
    expression; default: the span name, ``{alias}name``). Over ``metric_points`` pass a fallback such as
    ``"'_OTHER'"`` (a data point has no name)."""
    method = f"({alias}attributes->>'$.\"{RPC_METHOD}\"')"  # parenthesised: || binds tighter than ->>
    service = f"({alias}attributes->>'$.\"{RPC_SERVICE}\"')"
    otherwise = f"{alias}name" if fallback is None else fallback
    return (f"CASE WHEN {service} IS NOT NULL AND {method} IS NOT NULL AND strpos({method}, '/') = 0 "
            f"THEN {service} || '/' || {method} ELSE coalesce({method}, {otherwise}) END")


GRPC_SERVER_ERROR_CODES: Final = frozenset({
    "UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})
"""The gRPC status codes (names) that make a SERVER span ERROR, per the gRPC conventions: the server failed.
Client errors (INVALID_ARGUMENT, NOT_FOUND, ...) and CANCELLED do not. The gRPC interceptors set the span status
from this set (``interceptors.grpc_common.SERVER_ERROR_CODES``), and :func:`metric_error_sql` judges the
``rpc.server.call.duration`` points by it: one fact for both."""
CANCELLED_ERROR_TYPE: Final = "CancelledError"
"""The ``error.type`` of a call that ended because it was cancelled (``asyncio.CancelledError``): the Thrift
adapters record it but leave the span status UNSET, so it is no error (:func:`metric_error_sql`)."""


def status_sql(alias: str = "") -> str:
    """The SQL expression (DuckDB, over a store's ``spans``) that labels a request's outcome for per-code
    breakdowns: ``rpc.response.status_code`` (``OK``, ``INVALID_ARGUMENT``, a Thrift exception's name), else its
    name under the opt-in (``rpc.status_code``), else the span status (``UNSET`` / ``OK`` / ``ERROR``)."""
    return (f"coalesce({alias}attributes->>'$.\"{RPC_RESPONSE_STATUS_CODE}\"', "
            f"{alias}attributes->>'$.\"{RPC_STATUS_CODE}\"', {alias}status_code)")


def error_sql(alias: str = "") -> str:
    """The SQL expression (DuckDB, over a store's ``spans``) that is true for a failed request: span status
    ERROR, as the instrumentation that wrote the span decided it. The status code is not judged again: by these
    conventions a gRPC server span is ERROR only for the server-error codes (:data:`GRPC_SERVER_ERROR_CODES`:
    UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS); INVALID_ARGUMENT, NOT_FOUND and the like, and a Thrift exception declared in the
    IDL, leave it UNSET (they show in :func:`status_sql`'s breakdown, not as errors). The metric points' twin:
    :func:`metric_error_sql`."""
    return f"coalesce({alias}status_code = 'ERROR', false)"


def _attr(name: str) -> str:
    return f"attributes->>'$.\"{name}\"'"


def _sql_list(values: frozenset[str]) -> str:
    return ", ".join(f"'{v}'" for v in sorted(values))


def metric_status_sql() -> str:
    """The SQL expression (DuckDB, over a store's ``metric_points``) that labels an RPC call-duration point's
    outcome as :func:`status_sql` labels a span: ``rpc.response.status_code``, else ``rpc.status_code``, else
    ``ERROR`` for a failed call (:func:`metric_error_sql`) and ``UNSET`` for the others (a point has no span
    status; a Thrift call that raised has no status code)."""
    return (f"coalesce({_attr(RPC_RESPONSE_STATUS_CODE)}, {_attr(RPC_STATUS_CODE)}, "
            f"CASE WHEN {metric_error_sql()} THEN 'ERROR' ELSE 'UNSET' END)")


def metric_error_sql() -> str:
    """The SQL expression (DuckDB, over a store's ``metric_points``) that is true for the points of failed calls:
    the rule the recorder applies to a SERVER span's status (:func:`error_sql`), from the attributes a
    ``rpc.server.call.duration`` point carries. gRPC (``rpc.system.name`` or ``rpc.system`` = ``grpc``): the
    status code (``rpc.response.status_code``, or ``rpc.status_code`` under the opt-in) is one of
    :data:`GRPC_SERVER_ERROR_CODES`. Other systems (Thrift): ``error.type`` is set (a TApplicationException, an
    exception the IDL does not declare), but not :data:`CANCELLED_ERROR_TYPE`; a declared exception sets no
    ``error.type``."""
    system = f"coalesce({_attr(RPC_SYSTEM_NAME)}, {_attr(RPC_SYSTEM)})"
    code = f"coalesce({_attr(RPC_RESPONSE_STATUS_CODE)}, {_attr(RPC_STATUS_CODE)})"
    return (f"(CASE WHEN {system} = 'grpc' THEN coalesce({code} IN ({_sql_list(GRPC_SERVER_ERROR_CODES)}), false) "
            f"ELSE coalesce({_attr(ERROR_TYPE)} <> '{CANCELLED_ERROR_TYPE}', false) END)")
