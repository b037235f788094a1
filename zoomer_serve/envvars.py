"""Reading environment variables strictly: a value that is set but unusable raises the caller's configuration
error naming the variable and the value (never silently the default). Shared by the host and GPU telemetry
settings (``ZOOMER_*``) and the export settings (the SDK's numeric ``OTEL_*``); no imports from the rest of the
package."""

from __future__ import annotations

import re
from collections.abc import Mapping

TRUE_WORDS = ("1", "true", "on", "yes")
FALSE_WORDS = ("0", "false", "off", "no")


def switch(env: Mapping[str, str], name: str, default: bool, error: type[Exception], accepted: str) -> bool:
    """``name`` as a boolean: one of :data:`TRUE_WORDS` / :data:`FALSE_WORDS` (any case, spaces around ignored);
    ``default`` when unset or empty.

    Raises:
        error: any other value (the message says "``name`` must be ``accepted``, got ...").
    """
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in TRUE_WORDS:
        return True
    if raw in FALSE_WORDS:
        return False
    raise error(f"{name} must be {accepted}, got {env.get(name)!r}")


INT_MAX = 2**31 - 1
"""The largest integer any variable takes (about 24.8 days in ms): a signed 32-bit int, as the OpenTelemetry SDKs
of other languages read these variables. Larger values are mistakes (a timeout of centuries overflows the
waits at shutdown), refused when read rather than failing later."""


_INTEGER = re.compile(r"[+-]?[0-9]+")


def integer(env: Mapping[str, str], name: str, default: int, error: type[Exception],
            minimum: int | None = None, maximum: int = INT_MAX) -> int:
    """``name`` as an int (spaces around ignored); ``default`` when unset or empty.

    Raises:
        error: not an integer, below ``minimum`` when one is given, or above ``maximum``.
    """
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    if not _INTEGER.fullmatch(raw):  # int() also takes "1_000" and other scripts' digits ("١٠٠")
        raise error(f"{name} must be an integer, got {raw!r}")
    value = int(raw)
    if minimum is not None and value < minimum:
        raise error(f"{name} must be >= {minimum}, got {raw!r}")
    if value > maximum:
        raise error(f"{name} must be <= {maximum}, got {raw!r}")
    return value


BEARER_HEADERS_HINT = "OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>"
"""How an OpenTelemetry exporter sends a bearer token (the collector's ``ZOOMER_COLLECTOR_TOKEN``): said by the
collector's refusal and by the exporter's error when it is refused."""


def bearer_token(token: str, name: str, error: type[Exception]) -> str:
    """``token`` if it can travel as ``authorization: Bearer <token>`` (gRPC metadata, an HTTP header, a Thrift
    header): printable ASCII (0x20 to 0x7E), not blank.

    Raises:
        error: blank, or naming the first character that cannot travel (a newline from a file read whole, for
            example) and its position.
    """
    if not token.strip():
        raise error(f"{name} is set but empty; unset it or give a token")
    for i, ch in enumerate(token):
        if not " " <= ch <= "~":
            raise error(f"{name} holds {ch!r} at position {i}: a token is printable ASCII (it travels as gRPC "
                        "metadata and HTTP or Thrift headers)")
    return token
