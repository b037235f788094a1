"""The OpenTelemetry resource of this process: service, host, process, torch and (where present) GPU."""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
import uuid
from typing import Any

from zoomer_serve.config import ZoomerConfig

logger = logging.getLogger("zoomer_serve")
_INSTANCE_ID = str(uuid.uuid4())


def _new_instance_id() -> None:
    global _INSTANCE_ID
    _INSTANCE_ID = str(uuid.uuid4())


os.register_at_fork(after_in_child=_new_instance_id)  # a forked child is an instance of its own


def build_resource_attributes(cfg: ZoomerConfig) -> dict[str, Any]:
    """Resource attributes: ``service.name``, ``service.instance.id`` (a UUID per process unless
    ``OTEL_RESOURCE_ATTRIBUTES`` sets one), ``host.name``, ``process.pid``, ``process.runtime.*``,
    ``telemetry.sdk.*``, ``zoomer.torch.version`` (when this process has imported torch) and, when CUDA is available,
    ``zoomer.gpu.model`` (``torch.cuda.get_device_name``), ``zoomer.gpu.count`` and
    ``zoomer.gpu.driver_version`` (NVML ``nvmlSystemGetDriverVersion``). Attributes from
    ``OTEL_RESOURCE_ATTRIBUTES`` win over detected ones, except ``service.name`` which comes from the config.
    """
    from zoomer_serve import __version__

    attrs: dict[str, Any] = {
        "service.instance.id": _INSTANCE_ID,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        "process.runtime.name": sys.implementation.name,
        "process.runtime.version": platform.python_version(),
        "telemetry.sdk.name": "zoomer-serve",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.version": __version__,
    }
    attrs.update(_torch_attributes())
    attrs.update(cfg.resource_attributes)
    attrs["service.name"] = cfg.service_name
    return attrs


def child_resource_attributes(parent: dict[str, Any], cfg: ZoomerConfig) -> dict[str, Any]:
    """The resource of a process forked from one whose resource is ``parent``: the same, with this process's
    ``process.pid`` and its own ``service.instance.id`` (unless ``OTEL_RESOURCE_ATTRIBUTES`` set one). Nothing
    is detected again (no torch or NVML calls in a forked child)."""
    attrs = dict(parent)
    attrs["process.pid"] = os.getpid()
    if "service.instance.id" not in cfg.resource_attributes:
        attrs["service.instance.id"] = _INSTANCE_ID
    return attrs


def _torch_attributes() -> dict[str, Any]:
    torch = sys.modules.get("torch")  # only a process that already uses torch; never import it here
    if torch is None:
        return {}
    out: dict[str, Any] = {"zoomer.torch.version": torch.__version__}
    try:
        if torch.cuda.is_available():
            out["zoomer.gpu.model"] = torch.cuda.get_device_name(0)
            out["zoomer.gpu.count"] = torch.cuda.device_count()
            driver = _nvml_driver_version()
            if driver:
                out["zoomer.gpu.driver_version"] = driver
    except Exception as exc:  # a broken CUDA setup must not stop the server
        logger.warning("zoomer-serve: could not read GPU details for the resource: %r", exc)
    return out


def _nvml_driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None
