"""Settings of artifact uploads; a bad value raises :class:`~zoomer_serve.config.ConfigError` naming the
variable.

| setting | variable | default |
| --- | --- | --- |
| where artifacts go (URL or folder; ``off``: nowhere) | ``ZOOMER_ARTIFACTS_URL`` | the profiles folder (``ZOOMER_PROFILES_DIR``) |
| upload jobs (sessions) that may wait | ``ZOOMER_ARTIFACTS_QUEUE`` | 32 |
| further attempts after a failed upload | ``ZOOMER_ARTIFACTS_RETRIES`` | 5 |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from zoomer_serve import envvars
from zoomer_serve.artifacts.storage import StorageError, check_protocol
from zoomer_serve.config import ConfigError

OFF_WORDS = ("off", "none", "false", "0")


@dataclass(frozen=True)
class ArtifactsConfig:
    """Where profiling artifacts are uploaded and how.

    Attributes:
        url: the storage root (URL or absolute folder, see :mod:`~zoomer_serve.artifacts.storage`); None: off.
        max_pending: upload jobs that may wait before new ones are refused (counted).
        retries: further attempts after a failed upload of one file.
        backoff_s / max_backoff_s: first wait between attempts (doubling) and its cap, seconds.
    """

    url: str | None
    max_pending: int = 32
    retries: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    @classmethod
    def from_env(cls, profiles_dir: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> ArtifactsConfig:
        """``ZOOMER_ARTIFACTS_*`` from ``env`` (default ``os.environ``); the default root is ``profiles_dir``."""
        env = os.environ if env is None else env
        raw = (env.get("ZOOMER_ARTIFACTS_URL") or "").strip()
        if raw.lower() in OFF_WORDS:
            url: str | None = None
        else:
            try:
                url = check_protocol(raw or Path(profiles_dir))
            except (ValueError, StorageError) as exc:
                raise ConfigError(f"ZOOMER_ARTIFACTS_URL: {exc}") from None
        return cls(url=url, max_pending=envvars.integer(env, "ZOOMER_ARTIFACTS_QUEUE", 32, ConfigError, 1),
                   retries=envvars.integer(env, "ZOOMER_ARTIFACTS_RETRIES", 5, ConfigError, 0))
