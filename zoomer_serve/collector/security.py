"""Who may write into the collector: optional bearer-token authentication and TLS for both receivers, as the
OpenTelemetry Collector offers them (``bearertokenauth``; ``tls.cert_file`` / ``tls.key_file``).

====================== ================================== ===============================================
setting                 ``zoomer-serve collector``          meaning
====================== ================================== ===============================================
token                   ``ZOOMER_COLLECTOR_TOKEN`` (env     every export must carry ``authorization: Bearer
                        only: a command line shows in       <token>`` (HTTP header / gRPC metadata); missing
                        ``ps``)                             or wrong: HTTP 401 (``WWW-Authenticate: Bearer``,
                                                            body not read), gRPC ``UNAUTHENTICATED``;
                                                            counted in ``rejected_unauthenticated``;
                                                            the answer names
                                                            ``OTEL_EXPORTER_OTLP_HEADERS``, which sends it
TLS                     ``--tls-cert PATH --tls-key PATH``  both receivers speak TLS with this PEM
                        (``ZOOMER_COLLECTOR_TLS_CERT`` /    certificate chain and key (HTTPS; gRPC with
                        ``ZOOMER_COLLECTOR_TLS_KEY``)       ``ssl_server_credentials``)
open                    ``--insecure-open``                 allow a non-loopback bind with neither: anyone
                        (``ZOOMER_COLLECTOR_INSECURE_OPEN``)  who can connect can write
====================== ================================== ===============================================

A collector bound to a non-loopback address (``0.0.0.0``, ``::``, a LAN address, a host name that is not
``localhost``) with neither a token nor TLS refuses to start unless it is told it is open; the ready line
says ``"open": true`` then. On loopback the receivers are open unless a token is set, as before.
"""

from __future__ import annotations

import hmac
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from zoomer_serve import envvars
from zoomer_serve.config import ConfigError
from zoomer_serve.netaddr import is_loopback_host

TOKEN_ENV = "ZOOMER_COLLECTOR_TOKEN"
TLS_CERT_ENV = "ZOOMER_COLLECTOR_TLS_CERT"
TLS_KEY_ENV = "ZOOMER_COLLECTOR_TLS_KEY"
INSECURE_OPEN_ENV = "ZOOMER_COLLECTOR_INSECURE_OPEN"
UNAUTHENTICATED_MESSAGE = ("missing or wrong bearer token: send 'authorization: Bearer <token>' (an OpenTelemetry "
                           f"exporter: {envvars.BEARER_HEADERS_HINT})")
"""The answer to an export without the right token (gRPC ``UNAUTHENTICATED`` details, HTTP 401 status message)."""


@dataclass(frozen=True)
class ReceiverSecurity:
    """Authentication and transport security of both receivers (see the module docstring).

    Attributes:
        token: bearer token every export must carry; None: no token asked.
        tls_cert / tls_key: PEM certificate chain and private key; both or neither.
        insecure_open: allow a non-loopback bind with neither token nor TLS.

    Raises:
        ConfigError: an empty token or one that cannot travel as a header (not printable ASCII), or only one
            of ``tls_cert`` / ``tls_key``.
    """

    token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    insecure_open: bool = False

    def __post_init__(self) -> None:
        if self.token is not None:
            envvars.bearer_token(self.token, TOKEN_ENV, ConfigError)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both a certificate and a key (--tls-cert and --tls-key, "
                              f"{TLS_CERT_ENV} and {TLS_KEY_ENV})")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ReceiverSecurity:
        """``ZOOMER_COLLECTOR_TOKEN``, ``..._TLS_CERT``, ``..._TLS_KEY``, ``..._INSECURE_OPEN`` from ``env``
        (default ``os.environ``), then ``overrides`` that are not None.

        Raises:
            ConfigError: a bad value, naming the variable.
        """
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        if TOKEN_ENV in env:
            values["token"] = env[TOKEN_ENV]
        for key, var in (("tls_cert", TLS_CERT_ENV), ("tls_key", TLS_KEY_ENV)):
            if (env.get(var) or "").strip():
                values[key] = Path(env[var].strip())
        values["insecure_open"] = envvars.switch(env, INSECURE_OPEN_ENV, False, ConfigError, "true or false")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def methods(self) -> list[str]:
        """What protects the receivers: any of ``"bearer_token"``, ``"tls"`` (for the ready line)."""
        return [name for name, on in (("bearer_token", self.token is not None), ("tls", self.tls)) if on]

    def is_open(self, host: str) -> bool:
        """Whether binding ``host`` leaves the receivers writable by anyone on the network."""
        return not self.methods and not is_loopback_host(host)

    def check_bind(self, host: str) -> None:
        """Refuse an open non-loopback bind unless ``insecure_open``.

        Raises:
            ConfigError: the message says what to set.
        """
        if self.is_open(host) and not self.insecure_open:
            raise ConfigError(
                f"refusing to listen on non-loopback address {host!r} with neither a token nor TLS: anyone who "
                f"can connect could write into the store. Set {TOKEN_ENV} and/or --tls-cert/--tls-key, or pass "
                f"--insecure-open ({INSECURE_OPEN_ENV}=true) to run open on purpose")

    def authorized(self, authorization: str | None) -> bool:
        """Whether an ``authorization`` header / metadata value passes (always, when no token is set)."""
        if self.token is None:
            return True
        if not authorization:
            return False
        scheme, _, credentials = authorization.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(),
                                                                   self.token.strip().encode())

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The HTTP receiver's TLS context, None without TLS.

        Raises:
            ConfigError: the certificate or key cannot be loaded (names the files).
        """
        if self.tls_cert is None or self.tls_key is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load TLS certificate {self.tls_cert} / key {self.tls_key}: {exc}") from exc
        return ctx

    def pem_pair(self) -> tuple[bytes, bytes] | None:
        """(private key, certificate chain) PEM bytes for gRPC's ``ssl_server_credentials``; None without TLS.
        The pair is loaded once with :mod:`ssl` first, so files that hold no PEM certificate or key (or a key
        that does not match) are named here rather than by gRPC's bind failure.

        Raises:
            ConfigError: a file cannot be read, or holds no usable PEM certificate chain / private key.
        """
        if self.tls_cert is None or self.tls_key is None:
            return None
        self.server_ssl_context()
        try:
            return self.tls_key.read_bytes(), self.tls_cert.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read TLS certificate {self.tls_cert} / key {self.tls_key}: {exc}") from exc
