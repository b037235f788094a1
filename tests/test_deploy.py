"""Deployment files: Dockerfile, docker-compose.yml, deploy/ (OpenTelemetry Collector and Prometheus configs,
GPU override, health probes).

No Docker engine runs in CI, so the files are checked statically: the compose files pass the Compose
Specification JSON schema (vendored in deploy/schema/, plus ``docker compose config`` where a compose CLI is
installed); images are pinned; the collector config names only components of the contrib distribution and
its pipelines connect receivers to exporters; every host:port one service uses to reach another is a port
that service listens on, across compose, the collector config, the Prometheus config and the health checks.
The collector's forwarding path into the embedded zoomer collector is exercised for real: OTLP sent with the
``otlp_grpc/zoomer`` exporter's settings lands in a running embedded collector's store.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from zoomer_serve.collector.collector import DEFAULT_MAX_MESSAGE_BYTES
from zoomer_serve.config import ZoomerConfig

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "deploy" / "compose.gpu.yml"
OTELCOL_CONFIG = ROOT / "deploy" / "otel-collector.yaml"
SCALE_OUT_AGENT = ROOT / "deploy" / "scale-out" / "agent.yaml"
SCALE_OUT_GATEWAY = ROOT / "deploy" / "scale-out" / "gateway.yaml"
COLLECTOR_CONFIGS = [OTELCOL_CONFIG, SCALE_OUT_AGENT, SCALE_OUT_GATEWAY]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
COMPOSE_SCHEMA = ROOT / "deploy" / "schema" / "compose-spec.json"
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CI_RUN = ROOT / ".ci" / "run"
CI_CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
LOCUSTFILE = "benchmarks/locustfile.py"

OTELCOL_SERVICE = "otel-collector"
ZOOMER_COLLECTOR_SERVICE = "zoomer-collector"
ZOOMER_EXPORTER = "otlp_grpc/zoomer"
LOOPBACK = {"127.0.0.1", "localhost"}
IMAGE_WORKDIR = "/app"
MiB = 1024 * 1024

# Components of the OpenTelemetry Collector contrib distribution (otelcol-contrib) this project may name, as
# listed in its build manifest (open-telemetry/opentelemetry-collector-releases,
# distributions/otelcol-contrib/manifest.yaml): type -> (Go module, a release of the contrib image that has
# the name). Every entry is in the manifests of v0.86.0 and v0.136.0; `otlp_grpc` and `otlp_http` are the
# names of the core OTLP exporters since v0.144.0 (collector PRs #14403 and #14397).
CONTRIB_COMPONENTS: dict[str, dict[str, tuple[str, str]]] = {
    "receivers": {
        "otlp": ("go.opentelemetry.io/collector/receiver/otlpreceiver", "0.86.0"),
        "prometheus": ("github.com/open-telemetry/opentelemetry-collector-contrib/receiver/prometheusreceiver",
                       "0.86.0"),
        "hostmetrics": ("github.com/open-telemetry/opentelemetry-collector-contrib/receiver/hostmetricsreceiver",
                        "0.86.0"),
    },
    "processors": {
        "memory_limiter": ("go.opentelemetry.io/collector/processor/memorylimiterprocessor", "0.86.0"),
        "batch": ("go.opentelemetry.io/collector/processor/batchprocessor", "0.86.0"),
        "attributes": ("github.com/open-telemetry/opentelemetry-collector-contrib/processor/attributesprocessor",
                       "0.86.0"),
        "resource": ("github.com/open-telemetry/opentelemetry-collector-contrib/processor/resourceprocessor",
                     "0.86.0"),
        "filter": ("github.com/open-telemetry/opentelemetry-collector-contrib/processor/filterprocessor",
                   "0.86.0"),
        "transform": ("github.com/open-telemetry/opentelemetry-collector-contrib/processor/transformprocessor",
                      "0.86.0"),
        "k8sattributes": ("github.com/open-telemetry/opentelemetry-collector-contrib/processor/"
                          "k8sattributesprocessor", "0.86.0"),
        "resourcedetection": ("github.com/open-telemetry/opentelemetry-collector-contrib/processor/"
                              "resourcedetectionprocessor", "0.86.0"),
        "probabilistic_sampler": ("github.com/open-telemetry/opentelemetry-collector-contrib/processor/"
                                  "probabilisticsamplerprocessor", "0.86.0"),
        "tail_sampling": ("github.com/open-telemetry/opentelemetry-collector-contrib/processor/"
                          "tailsamplingprocessor", "0.86.0"),
    },
    "exporters": {
        "otlp_grpc": ("go.opentelemetry.io/collector/exporter/otlpexporter", "0.144.0"),
        "otlp_http": ("go.opentelemetry.io/collector/exporter/otlphttpexporter", "0.144.0"),
        "debug": ("go.opentelemetry.io/collector/exporter/debugexporter", "0.86.0"),
        "prometheus": ("github.com/open-telemetry/opentelemetry-collector-contrib/exporter/prometheusexporter",
                       "0.86.0"),
        "prometheusremotewrite": ("github.com/open-telemetry/opentelemetry-collector-contrib/exporter/"
                                  "prometheusremotewriteexporter", "0.86.0"),
        "loadbalancing": ("github.com/open-telemetry/opentelemetry-collector-contrib/exporter/"
                          "loadbalancingexporter", "0.86.0"),
        "file": ("github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter", "0.86.0"),
    },
    "extensions": {
        "health_check": ("github.com/open-telemetry/opentelemetry-collector-contrib/extension/"
                         "healthcheckextension", "0.86.0"),
        "pprof": ("github.com/open-telemetry/opentelemetry-collector-contrib/extension/pprofextension", "0.86.0"),
        "zpages": ("go.opentelemetry.io/collector/extension/zpagesextension", "0.86.0"),
    },
    "connectors": {},
}
# Still accepted by the contrib image, but deprecated (a warning at every start): use the new name.
DEPRECATED_COMPONENTS = {("exporters", "otlp"): "otlp_grpc", ("exporters", "otlphttp"): "otlp_http"}
SIGNALS = ("traces", "metrics", "logs")


# -- loading --------------------------------------------------------------------------------------------------
def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def otelcol() -> dict[str, Any]:
    return load_yaml(OTELCOL_CONFIG)


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return load_yaml(PROMETHEUS_CONFIG)


@pytest.fixture(scope="module")
def healthcheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", HEALTHCHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def host_port(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``scheme://host:port/...`` -> (host, port). Raises ValueError without a port."""
    url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    if not url.hostname or url.port is None:
        raise ValueError(f"{endpoint!r} has no host:port")
    return url.hostname, url.port


def parse_duration_s(value: str) -> float:
    """A collector duration (``10s``, ``500ms``, ``2m``) in seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(value).strip())
    assert match, f"not a duration: {value!r}"
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[match.group(2)]
    return float(match.group(1)) * scale


def parse_bytes(value: str) -> int:
    """A compose byte size (``1G``, ``512m``, ``1024k``) in bytes."""
    match = re.fullmatch(r"(\d+)([bkmg]?)b?", str(value).strip().lower())
    assert match, f"not a byte size: {value!r}"
    return int(match.group(1)) * {"": 1, "b": 1, "k": 1024, "m": MiB, "g": 1024 * MiB}[match.group(2)]


def pyproject_field(pattern: str) -> str:
    """The first group of ``pattern`` in pyproject.toml (no TOML parser before Python 3.11)."""
    match = re.search(pattern, (ROOT / "pyproject.toml").read_text(encoding="utf-8"), flags=re.M)
    assert match, pattern
    return match.group(1)


def image_tag(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ""


def zoomer_args(service: dict[str, Any]) -> Any:
    """The service's ``zoomer-serve ...`` command parsed by the real CLI parser (unknown flags fail)."""
    from zoomer_serve.cli import build_parser

    command = service["command"]
    assert command[0] == "zoomer-serve", command
    return build_parser().parse_args(command[1:])


def is_zoomer_image(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).startswith("zoomer-serve:")


def service_networks(service: dict[str, Any]) -> set[str]:
    if service.get("network_mode") == "none":
        return set()
    nets = service.get("networks", ["default"])
    return set(nets if isinstance(nets, list) else nets.keys())


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


# -- what each service listens on -----------------------------------------------------------------------------
def otelcol_ports(config: dict[str, Any]) -> dict[str, int]:
    """Ports an OTel Collector config listens on, by role (the roles the config has)."""
    out: dict[str, int] = {}
    for protocol, settings in config["receivers"]["otlp"]["protocols"].items():
        out[f"otlp_{protocol}"] = host_port(settings["endpoint"])[1]
    if "prometheus" in config.get("exporters", {}):
        out["prometheus_exporter"] = host_port(config["exporters"]["prometheus"]["endpoint"])[1]
    for reader in config["service"].get("telemetry", {}).get("metrics", {}).get("readers", []):
        out["internal_metrics"] = int(reader["pull"]["exporter"]["prometheus"]["port"])
    if "health_check" in config.get("extensions", {}):
        out["health_check"] = host_port(config["extensions"]["health_check"]["endpoint"])[1]
    return out


def listening_ports(name: str, services: dict[str, Any], otelcol: dict[str, Any]) -> set[int]:
    """Where each service listens: zoomer-serve commands through the real CLI parser, the OTel Collector from
    its config, third-party images from their documented defaults declared in ``expose``."""
    service = services[name]
    if name == OTELCOL_SERVICE:
        return set(otelcol_ports(otelcol).values())
    if is_zoomer_image(service) and service["command"][0] == "zoomer-serve":
        args = zoomer_args(service)
        if args.command == "serve-demo":
            return {args.port}
        if args.command == "collector":
            return {args.grpc_port, args.http_port}
        return set()
    return {int(p) for p in service.get("expose", [])}


@dataclass(frozen=True)
class Link:
    """One service reaching another (or itself) at host:port, and where that is written."""

    source: str
    where: str
    host: str
    port: int


def healthcheck_urls(service: dict[str, Any]) -> list[str]:
    test = service.get("healthcheck", {}).get("test", [])
    return [tok for tok in test if "://" in tok]


def is_outside_compose(endpoint: str) -> bool:
    """An endpoint with a dotted host name or a ``${env:...}`` placeholder (a vendor's, say) is not a compose
    service; a compose service name has no dot."""
    hostname = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").hostname or ""
    return "${" in endpoint or "." in hostname


def links(services: dict[str, Any], otelcol: dict[str, Any], prometheus: dict[str, Any]) -> list[Link]:
    """Every host:port a service uses, from compose (OTLP endpoint, commands, health checks), the collector
    config (exporters) and the Prometheus config (scrape targets)."""
    out: list[Link] = []
    for name, svc in services.items():
        env = svc.get("environment", {})
        if "OTEL_EXPORTER_OTLP_ENDPOINT" in env:
            out.append(Link(name, "OTEL_EXPORTER_OTLP_ENDPOINT", *host_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"])))
        for url in healthcheck_urls(svc):
            out.append(Link(name, f"healthcheck {url}", *host_port(url)))
        command = svc.get("command", [])
        for i, tok in enumerate(command):
            if tok == "--host" and command[0] == "locust":
                out.append(Link(name, f"locust --host {command[i + 1]}", *host_port(command[i + 1])))
            elif "://" in tok:
                out.append(Link(name, f"command {tok}", *host_port(tok)))
    for exp_id, exp in otelcol["exporters"].items():
        endpoint = str(exp.get("endpoint", ""))
        if exp_id != "prometheus" and endpoint and not is_outside_compose(endpoint):
            out.append(Link(OTELCOL_SERVICE, f"exporter {exp_id}", *host_port(endpoint)))
    for job in prometheus["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                out.append(Link("prometheus", f"scrape job {job['job_name']}", *host_port(target)))
    return out


# -- compose file -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE], ids=["docker-compose.yml", "compose.gpu.yml"])
def test_compose_files_pass_the_compose_specification_schema(path: Path) -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    errors = sorted(validator_cls(schema).iter_errors(load_yaml(path)), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_rejects_what_compose_rejects(compose: dict[str, Any]) -> None:
    """The vendored schema is the strict one: an unknown service key and a malformed healthcheck fail."""
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(schema)(schema)
    broken = json.loads(json.dumps(compose))
    broken["services"]["model-server"]["helthcheck"] = {"test": ["CMD", "true"]}
    broken["services"]["jaeger"]["healthcheck"]["interval"] = ["10s"]
    messages = [e.message for e in validator.iter_errors(broken)]
    assert any("helthcheck" in m for m in messages), messages
    assert any("10s" in m for m in messages), messages


COMPOSE_VERSION = re.compile(r"version v?(\d+)\.(\d+)\.(\d+)")


def compose_cli() -> tuple[list[str] | None, str]:
    """The Compose v2 command (the ``docker compose`` plugin, else a standalone ``docker-compose`` of version 2
    or later) and its version line, or None and why there is none. Compose v1 (``docker-compose`` 1.x, end of
    life since 2023) is not used: it has no ``config --format json`` and predates parts of the Compose
    Specification these files use."""
    found = []
    for cli in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cli[0]) is None:
            continue
        try:
            probe = subprocess.run([*cli, "version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            found.append(f"`{' '.join(cli)} version` failed: {exc}")
            continue
        output = (probe.stdout + probe.stderr).strip()
        line = output.splitlines()[0] if output else ""
        version = COMPOSE_VERSION.search(line) if probe.returncode == 0 else None
        if version is None:
            found.append(f"`{' '.join(cli)} version` gave no Compose version (exit {probe.returncode}: {line[:100]!r})")
        elif int(version.group(1)) < 2:
            found.append(f"{' '.join(cli)} is Compose v1 ({line[:100]!r}); these checks need Compose v2")
        else:
            return cli, line
    return None, "; ".join(found) or "neither docker (with the compose plugin) nor docker-compose is on PATH"


@pytest.mark.slow
def test_compose_cli_accepts_the_stack_with_every_profile_and_the_gpu_override() -> None:
    cli, why = compose_cli()
    if cli is None:
        pytest.skip(f"no Compose v2 CLI here ({why}); the JSON schema test validates the files")
    for files in ([COMPOSE], [COMPOSE, GPU_OVERRIDE]):
        args = [a for f in files for a in ("-f", str(f))]
        done = subprocess.run([*cli, *args, "--profile", "load", "--profile", "tools", "config", "--format",
                               "json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        merged = json.loads(done.stdout)
        assert {"model-server", "locust", "report", ZOOMER_COLLECTOR_SERVICE} <= set(merged["services"])
        gpu = merged["services"]["model-server"].get("deploy", {}).get("resources", {}).get("reservations", {})
        assert bool(gpu.get("devices")) == (GPU_OVERRIDE in files)


def _tools_on_path(folder: Path, monkeypatch: pytest.MonkeyPatch, **scripts: str) -> None:
    """PATH holds only ``folder`` with the given shell scripts (named by the keyword, ``_`` for ``-``)."""
    folder.mkdir()
    for name, body in scripts.items():
        tool = folder / name.replace("_", "-")
        tool.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))


NO_COMPOSE_PLUGIN = 'if [ "$1" = compose ]; then echo "docker: unknown command: docker compose" >&2; exit 1; fi'


def test_compose_v1_on_path_is_not_used_and_the_cli_check_skips_naming_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``docker-compose`` 1.29.2 (Compose v1, which has no ``config --format json``) on PATH and a docker without
    the compose plugin: the compose check skips and says why; v1 is asked for its version only."""
    calls = tmp_path / "calls.txt"
    _tools_on_path(tmp_path / "bin", monkeypatch, docker=NO_COMPOSE_PLUGIN, docker_compose=(
        f'echo "$*" >> {calls}\n'
        'if [ "$1" = version ]; then echo "docker-compose version 1.29.2, build 5becea4c"; exit 0; fi\n'
        'echo "Usage: config [options]" >&2; exit 1'))
    cli, why = compose_cli()
    assert cli is None
    assert "docker-compose is Compose v1 ('docker-compose version 1.29.2, build 5becea4c')" in why, why
    assert "`docker compose version` gave no Compose version (exit 1" in why, why
    with pytest.raises(pytest.skip.Exception, match="no Compose v2 CLI here .*1.29.2"):
        test_compose_cli_accepts_the_stack_with_every_profile_and_the_gpu_override()
    assert calls.read_text(encoding="utf-8").splitlines() == ["version", "version"]


@pytest.mark.parametrize(("scripts", "expected"), [
    ({"docker": '[ "$1 $2" = "compose version" ] && echo "Docker Compose version v2.29.7"'}, ["docker", "compose"]),
    ({"docker": NO_COMPOSE_PLUGIN, "docker_compose": 'echo "Docker Compose version v2.20.2"'}, ["docker-compose"]),
    ({"docker_compose": 'echo "Docker Compose version 2.40.3"'}, ["docker-compose"]),
    ({}, None),
], ids=["plugin", "standalone-v2", "standalone-v2-without-v", "none"])
def test_a_compose_v2_cli_is_found_as_the_plugin_or_standalone(scripts: dict[str, str], expected: list[str] | None,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tools_on_path(tmp_path / "bin", monkeypatch, **scripts)
    cli, why = compose_cli()
    assert cli == expected
    assert ("Docker Compose version" in why) if expected else ("neither docker" in why)


def test_every_image_is_pinned(services: dict[str, Any]) -> None:
    project_version = pyproject_field(r'^version = "([^"]+)"')
    for name, svc in services.items():
        image = svc.get("image")
        assert image, f"service {name} has no image"
        tag = image_tag(image)
        assert tag and tag != "latest", f"service {name}: image {image!r} is not pinned to a tag"
        if is_zoomer_image(svc):
            variant = svc["build"]["args"]["TORCH_VARIANT"]
            assert tag == f"{project_version}-{variant}", f"service {name}: {image} vs version and variant"
        else:
            assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"service {name}: {image!r} is not a release tag"
    gpu = load_yaml(GPU_OVERRIDE)["services"]["model-server"]
    assert image_tag(gpu["image"]) == f"{project_version}-{gpu['build']['args']['TORCH_VARIANT']}"


def test_the_stack_runs_the_commands_the_issue_names(services: dict[str, Any]) -> None:
    assert services["model-server"]["command"] == ["zoomer-serve", "serve-demo", "--host", "0.0.0.0",
                                                   "--port", "50051"]
    col = zoomer_args(services[ZOOMER_COLLECTOR_SERVICE])
    assert (col.command, col.host, col.grpc_port, col.http_port, str(col.store)) == (
        "collector", "0.0.0.0", 4317, 4318, "/data/zoomer.duckdb")
    assert services[OTELCOL_SERVICE]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert "127.0.0.1:16686:16686" in services["jaeger"]["ports"]


def test_the_embedded_collector_is_reachable_from_the_internal_network_only(compose: dict[str, Any],
                                                                              services: dict[str, Any]) -> None:
    svc = services[ZOOMER_COLLECTOR_SERVICE]
    assert "ports" not in svc, "the embedded collector accepts writes from anyone: publish no port"
    nets = service_networks(svc)
    assert nets and all(compose["networks"][n].get("internal") is True for n in nets), nets
    peers = {n for n, s in services.items() if n != ZOOMER_COLLECTOR_SERVICE and service_networks(s) & nets}
    assert peers == {OTELCOL_SERVICE}, f"services that can connect to the embedded collector: {peers}"


def test_published_ports_bind_loopback_and_lead_to_a_listener(services: dict[str, Any],
                                                               otelcol: dict[str, Any]) -> None:
    for name, svc in services.items():
        for spec in svc.get("ports", []):
            host_ip, host_port_, container_port = str(spec).split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {spec} beyond loopback"
            assert int(container_port) in listening_ports(name, services, otelcol), f"{name}: {spec}"
            assert host_port_ == container_port


def test_every_host_and_port_a_service_uses_is_one_the_target_listens_on(
        services: dict[str, Any], otelcol: dict[str, Any], prometheus: dict[str, Any]) -> None:
    found = links(services, otelcol, prometheus)
    # What the files must contain, at least: the server's endpoint, both exporters, both scrape targets,
    # the readiness wait and one health check per service that has one.
    wheres = {(link.source, link.where.split(" ")[0]) for link in found}
    assert {("model-server", "OTEL_EXPORTER_OTLP_ENDPOINT"), (OTELCOL_SERVICE, "exporter"),
            ("prometheus", "scrape"), ("otel-collector-ready", "command"), ("locust", "locust")} <= wheres
    assert len([lk for lk in found if lk.source == OTELCOL_SERVICE]) == 2
    for link in found:
        if link.host in LOOPBACK:
            target = link.source
        else:
            target = link.host
            assert target in services, f"{link.source} ({link.where}) names {target!r}, not a compose service"
            shared = service_networks(services[link.source]) & service_networks(services[target])
            assert shared, f"{link.source} ({link.where}) cannot reach {target}: no common network"
        ports = listening_ports(target, services, otelcol)
        assert link.port in ports, (f"{link.source} ({link.where}) uses {link.host}:{link.port}, but "
                                    f"{target} listens on {sorted(ports)}")


def test_the_servers_otlp_settings_point_at_the_collectors_receiver_of_that_protocol(
        services: dict[str, Any], otelcol: dict[str, Any]) -> None:
    """The server's OTEL_* variables go through the real configuration parser; the port must be the
    receiver of the configured protocol, not merely some open port."""
    cfg = ZoomerConfig.from_env(services["model-server"]["environment"])
    ports = otelcol_ports(otelcol)
    host, port = host_port(cfg.export.traces_endpoint)
    assert host == OTELCOL_SERVICE
    assert port == ports["otlp_grpc" if cfg.export.protocol == "grpc" else "otlp_http"]
    assert host_port(cfg.export.metrics_endpoint) == (host, port)


def test_the_zoomer_exporter_targets_the_embedded_collectors_grpc_port(services: dict[str, Any],
                                                                       otelcol: dict[str, Any]) -> None:
    host, port = host_port(otelcol["exporters"][ZOOMER_EXPORTER]["endpoint"])
    assert host == ZOOMER_COLLECTOR_SERVICE
    assert port == zoomer_args(services[ZOOMER_COLLECTOR_SERVICE]).grpc_port


def test_start_order_waits_for_health(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            target = services[dep]
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in target, f"{name} waits for {dep} to be healthy; {dep} has no healthcheck"
            elif cond["condition"] == "service_completed_successfully":
                assert target.get("restart") == "no", f"{dep} is a one-shot for {name}: restart must be 'no'"

    def waits_for(name: str) -> set[str]:
        out: set[str] = set()
        for dep in services[name].get("depends_on", {}):
            out |= {dep, *waits_for(dep)}
        return out

    assert {OTELCOL_SERVICE, "otel-collector-ready", ZOOMER_COLLECTOR_SERVICE, "jaeger"} <= waits_for("model-server")
    assert services["model-server"]["depends_on"]["otel-collector-ready"]["condition"] == \
        "service_completed_successfully"
    assert services["locust"]["depends_on"]["model-server"]["condition"] == "service_healthy"
    assert services[OTELCOL_SERVICE]["depends_on"][ZOOMER_COLLECTOR_SERVICE]["condition"] == "service_healthy"


def test_health_checks_probe_their_own_service(services: dict[str, Any], healthcheck_module: ModuleType) -> None:
    """Each health check probes loopback (its own container); the zoomer ones call deploy/healthcheck.py with
    targets it accepts, at the path the image has it."""
    checked = 0
    for name, svc in services.items():
        test = svc.get("healthcheck", {}).get("test")
        if not test:
            continue
        assert test[0] == "CMD", f"{name}: exec form, no shell needed"
        for url in healthcheck_urls(svc):
            assert host_port(url)[0] in LOOPBACK, f"{name} health check probes {url}"
        if is_zoomer_image(svc):
            assert test[1:3] == ["python", f"{IMAGE_WORKDIR}/deploy/healthcheck.py"]
            for target in test[3:]:
                healthcheck_module.parse_target(target)
        checked += 1
    assert checked >= 4


def test_the_gpu_is_off_by_default_and_reserved_by_the_override(compose: dict[str, Any]) -> None:
    text = json.dumps(compose)
    assert '"devices"' not in text and '"gpus"' not in text, "the base file must not reserve a GPU"
    override = load_yaml(GPU_OVERRIDE)["services"]["model-server"]
    devices = override["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert re.fullmatch(r"cu\d{3}", override["build"]["args"]["TORCH_VARIANT"])
    assert override["environment"]["ZOOMER_GPU"] == "on"


def test_volumes_hold_the_store_and_the_profile_traces(services: dict[str, Any]) -> None:
    def mounts(name: str) -> dict[str, str]:
        return {m.split(":")[1]: m.split(":")[0] for m in services[name].get("volumes", [])}

    store = zoomer_args(services[ZOOMER_COLLECTOR_SERVICE]).store
    assert mounts(ZOOMER_COLLECTOR_SERVICE)[str(store.parent)] == "zoomer-data"
    report = zoomer_args(services["report"])
    assert Path(report.store) == store and mounts("report")[str(store.parent)] == "zoomer-data"
    for name in ("model-server", "locust"):
        profile_dir = services[name]["environment"]["ZOOMER_PROFILES_DIR"]
        assert mounts(name)[profile_dir] == "profile-traces", name


def test_locust_runs_the_benchmarks_locustfile_against_the_model_server(services: dict[str, Any]) -> None:
    command = services["locust"]["command"]
    assert command[:3] == ["locust", "-f", LOCUSTFILE]
    assert "--headless" in command
    assert command[command.index("--host") + 1] == "model-server:50051"
    assert services["locust"]["profiles"] == ["load"]


def test_the_locustfile_exists() -> None:
    if not (ROOT / LOCUSTFILE).exists():
        pytest.skip(f"{LOCUSTFILE} is not written yet (its own issue); the locust service already runs it")
    assert "benchmarks" in dockerfile_copies()


# -- OpenTelemetry Collector config ---------------------------------------------------------------------------
def used_components(otelcol: dict[str, Any]) -> dict[str, set[str]]:
    """Component types by kind, from every section and pipeline of the config."""
    used: dict[str, set[str]] = {kind: set() for kind in CONTRIB_COMPONENTS}
    for kind in CONTRIB_COMPONENTS:
        used[kind] |= {component_type(c) for c in (otelcol.get(kind) or {})}
    used["extensions"] |= {component_type(c) for c in otelcol["service"].get("extensions", [])}
    return used


collector_configs = pytest.mark.parametrize("path", COLLECTOR_CONFIGS,
                                            ids=[str(p.relative_to(ROOT / "deploy")) for p in COLLECTOR_CONFIGS])


@collector_configs
def test_collector_config_names_only_contrib_components(path: Path) -> None:
    config = load_yaml(path)
    unknown_sections = set(config) - {*CONTRIB_COMPONENTS, "service"}
    assert not unknown_sections, unknown_sections
    for kind, types in used_components(config).items():
        for ctype in types:
            new_name = DEPRECATED_COMPONENTS.get((kind, ctype))
            assert new_name is None, f"{kind} {ctype!r} is deprecated: use {new_name!r}"
            assert ctype in CONTRIB_COMPONENTS[kind], f"{kind} {ctype!r} is not in the contrib allowlist"


@collector_configs
def test_the_pinned_collector_image_has_every_component(path: Path, services: dict[str, Any]) -> None:
    """The scale-out configs are meant for the same image as the compose stack."""
    pinned = Version(image_tag(services[OTELCOL_SERVICE]["image"]))
    for kind, types in used_components(load_yaml(path)).items():
        for ctype in types:
            since = Version(CONTRIB_COMPONENTS[kind][ctype][1])
            assert pinned >= since, f"{kind} {ctype} needs otelcol-contrib >= {since}, the image is {pinned}"


@collector_configs
def test_collector_pipelines_connect_receivers_to_exporters(path: Path) -> None:
    """Each pipeline receives and exports, names only defined components, limits memory first and batches
    within the embedded collector's request limit (at most 4 KiB per span assumed); nothing is defined
    that no pipeline uses."""
    config = load_yaml(path)
    defined = {kind: set(config.get(kind) or {}) for kind in CONTRIB_COMPONENTS}
    used: dict[str, set[str]] = {kind: set() for kind in ("receivers", "processors", "exporters")}
    for pname, pipe in config["service"]["pipelines"].items():
        assert component_type(pname) in SIGNALS, f"pipeline {pname}: not a signal"
        assert pipe.get("receivers") and pipe.get("exporters"), f"pipeline {pname} must receive and export"
        for kind in ("receivers", "processors", "exporters"):
            for cid in pipe.get(kind, []):
                assert cid in defined[kind] | defined["connectors"], f"pipeline {pname}: {cid} is not defined"
                used[kind].add(cid)
        processors = pipe.get("processors", [])
        assert processors[:1] == ["memory_limiter"], f"pipeline {pname}: memory_limiter must come first"
        assert processors[-1:] == ["batch"], f"pipeline {pname}: batch must come last"
    for kind in used:
        assert defined[kind] == used[kind], f"{kind} defined but in no pipeline: {defined[kind] - used[kind]}"
    assert set(config["service"]["extensions"]) == defined["extensions"]
    batch = config["processors"]["batch"]
    assert batch["send_batch_size"] <= batch["send_batch_max_size"]
    assert batch["send_batch_max_size"] * 4096 <= DEFAULT_MAX_MESSAGE_BYTES


def test_compose_collector_sends_traces_to_jaeger_metrics_to_prometheus_and_both_to_zoomer(
        otelcol: dict[str, Any]) -> None:
    """(More exporters, e.g. to a vendor, may be added next to these.)"""
    pipelines = otelcol["service"]["pipelines"]
    assert {"otlp_grpc/jaeger", ZOOMER_EXPORTER} <= set(pipelines["traces"]["exporters"])
    assert {"prometheus", ZOOMER_EXPORTER} <= set(pipelines["metrics"]["exporters"])


def test_scale_out_agents_route_traces_by_trace_id_and_gateways_tail_sample(otelcol: dict[str, Any]) -> None:
    """Agent: traces only through the load-balancing exporter keyed by trace id. Gateway: a traces pipeline
    with tail sampling to the backend, and every span, unsampled, to the embedded collector with the wire
    settings of the compose stack's zoomer exporter."""
    agent, gateway = load_yaml(SCALE_OUT_AGENT), load_yaml(SCALE_OUT_GATEWAY)
    assert agent["service"]["pipelines"]["traces"]["exporters"] == ["loadbalancing"]
    balancer = agent["exporters"]["loadbalancing"]
    assert balancer["routing_key"] == "traceID"
    assert balancer["resolver"]["dns"]["port"] == otelcol_ports(gateway)["otlp_grpc"]
    traces = {name: pipe for name, pipe in gateway["service"]["pipelines"].items() if name.startswith("traces")}
    sampled = [p for p in traces.values() if "tail_sampling" in p.get("processors", [])]
    assert sampled and all(ZOOMER_EXPORTER not in p["exporters"] for p in sampled)
    unsampled = [p for p in traces.values() if ZOOMER_EXPORTER in p["exporters"]]
    assert unsampled and all("tail_sampling" not in p["processors"] for p in unsampled)
    ours, theirs = (GrpcExporterSettings.from_config(c["exporters"][ZOOMER_EXPORTER]) for c in (otelcol, gateway))
    assert (theirs.insecure, theirs.compression, theirs.timeout_s) == (ours.insecure, ours.compression,
                                                                       ours.timeout_s)
    assert theirs.endpoint.endswith(f":{host_port(ours.endpoint)[1]}")


def test_memory_limiter_and_batch_fit_the_limits_around_them(services: dict[str, Any],
                                                             otelcol: dict[str, Any]) -> None:
    """The limiter refuses data before the container's memory limit is reached."""
    limit = parse_bytes(services[OTELCOL_SERVICE]["deploy"]["resources"]["limits"]["memory"])
    limiter = otelcol["processors"]["memory_limiter"]
    assert 0 < limiter["spike_limit_mib"] < limiter["limit_mib"]
    assert limiter["limit_mib"] * MiB <= 0.85 * limit


def test_prometheus_keeps_the_exporters_job_and_instance_labels(prometheus: dict[str, Any],
                                                                 otelcol: dict[str, Any]) -> None:
    exporter_port = otelcol_ports(otelcol)["prometheus_exporter"]
    jobs = [j for j in prometheus["scrape_configs"]
            if any(host_port(t)[1] == exporter_port for s in j["static_configs"] for t in s["targets"])]
    assert len(jobs) == 1 and jobs[0].get("honor_labels") is True


# -- the zoomer forwarding path, for real -----------------------------------------------------------------------
@dataclass(frozen=True)
class GrpcExporterSettings:
    """What an ``otlp_grpc`` exporter section of the collector config says about the wire."""

    endpoint: str
    insecure: bool
    compression: str
    timeout_s: float
    headers: dict[str, str]

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> GrpcExporterSettings:
        return cls(endpoint=section["endpoint"], insecure=bool(section.get("tls", {}).get("insecure", False)),
                   compression=str(section.get("compression", "gzip")),  # the exporter's default is gzip
                   timeout_s=parse_duration_s(section.get("timeout", "5s")),
                   headers=dict(section.get("headers") or {}))

    def sdk_kwargs(self, endpoint: str) -> dict[str, Any]:
        """Arguments for the OpenTelemetry SDK's OTLP/gRPC exporters with these settings at ``endpoint``."""
        import grpc

        compressions = {"gzip": grpc.Compression.Gzip, "none": grpc.Compression.NoCompression,
                        "": grpc.Compression.NoCompression}
        assert self.compression in compressions, (
            f"compression {self.compression!r}: the embedded collector (Python gRPC) reads gzip or none only")
        return {"endpoint": endpoint, "insecure": self.insecure, "compression": compressions[self.compression],
                "timeout": self.timeout_s, "headers": self.headers or None}


def test_otlp_sent_with_the_zoomer_exporters_settings_lands_in_the_store(collector: Any, otelcol: dict[str, Any],
                                                                        services: dict[str, Any]) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import SpanKind

    settings = GrpcExporterSettings.from_config(otelcol["exporters"][ZOOMER_EXPORTER])
    assert (settings.insecure, settings.compression) == (True, "gzip")
    # Same endpoint shape (host:port, no scheme); only the host and port become the test collector's.
    host, port = host_port(settings.endpoint)
    assert settings.endpoint == f"{host}:{port}"
    assert port == zoomer_args(services[ZOOMER_COLLECTOR_SERVICE]).grpc_port
    endpoint = f"127.0.0.1:{collector.collector.grpc_port}"
    resource = Resource.create({"service.name": "deploy-forwarding", "service.instance.id": "fwd-1"})

    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(**settings.sdk_kwargs(endpoint))))
    tracer = tracer_provider.get_tracer("deploy-test")
    with tracer.start_as_current_span("ranker.Ranker/Predict", kind=SpanKind.SERVER,
                                      attributes={"rpc.method": "ranker.Ranker/Predict"}) as server_span:
        with tracer.start_as_current_span("forward", attributes={"zoomer.phase": "forward"}):
            pass
    trace_id = format(server_span.get_span_context().trace_id, "032x")
    assert tracer_provider.force_flush(10_000)
    tracer_provider.shutdown()

    reader = PeriodicExportingMetricReader(OTLPMetricExporter(**settings.sdk_kwargs(endpoint)),
                                           export_interval_millis=3_600_000)
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    histogram = meter_provider.get_meter("deploy-test").create_histogram("rpc.server.call.duration", unit="s")
    for seconds in (0.010, 0.020, 0.030):
        histogram.record(seconds, {"rpc.method": "ranker.Ranker/Predict"})
    meter_provider.shutdown()  # one final collection, exported once

    assert collector.collector.stats()["rejected_invalid"] == 0
    spans = collector.spans()
    assert [(s["name"], s["trace_id"], s["service_name"]) for s in spans] == [
        ("ranker.Ranker/Predict", trace_id, "deploy-forwarding"), ("forward", trace_id, "deploy-forwarding")]
    assert spans[0]["attributes"]["rpc.method"] == "ranker.Ranker/Predict"
    assert spans[1]["parent_span_id"] == spans[0]["span_id"]
    points = collector.metric_points("rpc.server.call.duration")
    assert [(p["count"], round(p["sum"], 6), p["service_name"]) for p in points] == [
        (3, 0.06, "deploy-forwarding")]


def test_a_compression_the_embedded_collector_cannot_read_is_refused() -> None:
    settings = GrpcExporterSettings.from_config({"endpoint": "zoomer-collector:4317", "compression": "zstd"})
    with pytest.raises(AssertionError, match="zstd"):
        settings.sdk_kwargs("127.0.0.1:1")


# -- Dockerfile -------------------------------------------------------------------------------------------------
def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.M))


def dockerfile_copies() -> set[str]:
    out: set[str] = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            out |= set(line.split()[1:-1])
    return out


def test_dockerfile_installs_cpu_torch_from_the_pytorch_index_before_the_project() -> None:
    text = DOCKERFILE.read_text()
    args = dockerfile_args()
    assert args["TORCH_VARIANT"] == "cpu"
    torch_line = text.index("--index-url https://download.pytorch.org/whl/${TORCH_VARIANT} torch==${TORCH_VERSION}")
    assert torch_line < text.index("RUN pip install .")
    assert CI_RUN.read_text().count("-c .ci/constraints.txt") >= 2  # the torch install and the project's
    ci_torch = re.search(r"^torch==([\d.]+)$", CI_CONSTRAINTS.read_text(), re.M)  # what .ci/run holds torch at
    assert ci_torch and args["TORCH_VERSION"] == ci_torch.group(1), "the image and CI must test one torch"
    requirement = pyproject_field(r'^\s*"torch([^"]+)",')
    assert Version(args["TORCH_VERSION"]) in SpecifierSet(requirement)


def test_torch_range_admits_2_15_and_dev_installs_stay_light() -> None:
    """torch 2.15 is admitted (and the torch CI holds); Holistic Trace Analysis, which pulls jupyterlab, pandas
    and plotly, is only in the ``hta`` extra (as ``traceinsight``), never in ``dev``."""
    requirement = SpecifierSet(pyproject_field(r'^\s*"torch([^"]+)",'))
    assert Version("2.15.0") in requirement and Version("2.15.3") in requirement and Version("2.4.0") in requirement
    assert Version("2.16.0") not in requirement
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    extras = dict(re.findall(r"^(\w+) = \[\n(.*?)^\]", text, flags=re.M | re.S))
    dev = extras["dev"].lower()
    assert not any(name in dev for name in ("traceinsight", "holistictraceanalysis", "jupyter", "notebook"))
    assert '"traceinsight>=' in extras["hta"]


def test_dockerfile_base_image_is_pinned_and_the_default_command_is_the_compose_one(
        services: dict[str, Any]) -> None:
    base = dockerfile_args()["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base), base
    cmd = re.search(r"^CMD (.+)$", DOCKERFILE.read_text(), flags=re.M)
    assert cmd and json.loads(cmd.group(1)) == services["model-server"]["command"]
    user = re.findall(r"^USER (\S+)$", DOCKERFILE.read_text(), flags=re.M)
    assert user and user[-1] not in ("root", "0")


def test_the_build_context_keeps_what_the_image_copies() -> None:
    """Every path the Dockerfile copies exists and no .dockerignore pattern drops it (or its files)."""
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    copied = dockerfile_copies()
    assert {"pyproject.toml", "README.md", "zoomer_serve", "interceptors", "benchmarks", "deploy"} <= copied
    for path in copied:
        assert (ROOT / path).exists(), path
        members = [path] if (ROOT / path).is_file() else [
            str(p.relative_to(ROOT)) for p in (ROOT / path).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for member in members:
            for pattern in patterns:
                assert not Path(member).match(pattern) and not member.startswith(pattern.rstrip("/") + "/"), (
                    f".dockerignore {pattern!r} drops {member}, which the image needs")
    assert {".git", ".venv", "zoomer-data"} <= set(patterns)


# -- deploy/healthcheck.py --------------------------------------------------------------------------------------
@pytest.fixture
def http_server() -> Iterator[tuple[int, dict[str, int]]]:
    """A local HTTP server answering GET with the status in ``state['status']``."""
    state = {"status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(state["status"])
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server.server_address[1], state
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthcheck_passes_against_the_running_embedded_collector(collector: Any) -> None:
    """The collector service's health check, as compose runs it, against a real embedded collector."""
    col = collector.collector
    done = subprocess.run([sys.executable, str(HEALTHCHECK), f"grpc://127.0.0.1:{col.grpc_port}",
                           f"tcp://127.0.0.1:{col.http_port}"], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.slow
def test_healthcheck_fails_naming_the_target_that_did_not_answer(collector: Any, http_server: Any) -> None:
    port = closed_port()
    http_port, state = http_server
    state["status"] = 503
    done = subprocess.run([sys.executable, str(HEALTHCHECK), "--timeout-s", "0.5",
                           f"grpc://127.0.0.1:{collector.collector.grpc_port}", f"grpc://127.0.0.1:{port}",
                           f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}/"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["grpc", "tcp", "http"]
    assert f"grpc://127.0.0.1:{port}: the gRPC channel did not become ready" in lines[0]
    assert lines[2].endswith(f"http://127.0.0.1:{http_port}/: HTTP status 503")


@pytest.mark.slow
def test_healthcheck_http_and_wait(http_server: Any, healthcheck_module: ModuleType) -> None:
    http_port, state = http_server
    target = healthcheck_module.parse_target(f"http://127.0.0.1:{http_port}/")
    assert healthcheck_module.check([target], timeout_s=2) == []
    state["status"] = 503
    timer = threading.Timer(1.2, lambda: state.update(status=200))
    timer.start()
    try:  # unhealthy at first, healthy after about a second: --wait-s keeps probing
        assert healthcheck_module.check([target], timeout_s=2, wait_s=10) == []
    finally:
        timer.cancel()


@pytest.mark.parametrize("bad", ["grpc://127.0.0.1", "ftp://h:1", "tcp://:80", "http://h:port/"])
def test_healthcheck_rejects_a_malformed_target(bad: str) -> None:
    done = subprocess.run([sys.executable, str(HEALTHCHECK), bad], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and f"target {bad!r}" in done.stderr


def test_model_server_admin_service_needs_a_token(services: dict[str, Any]) -> None:
    """The profiler admin service is closed by default: compose refuses to start without a token (an empty
    one would make serve-demo refuse to start), and the profiles go to the shared volume."""
    env = services["model-server"]["environment"]
    assert env["ZOOMER_ADMIN_TOKEN"].startswith("${ZOOMER_ADMIN_TOKEN:?")
    assert env["ZOOMER_PROFILES_DIR"] == "/profiles"
