"""The compose stack's Grafana, checked statically like the other deployment files (no Docker engine in CI):
the service is pinned, published on loopback only and closed to anonymous editing; its Prometheus data source
points at a port Prometheus listens on, on a shared network; the provisioned dashboard is valid and its
queries name only metrics and labels zoomer-serve exports, as the OpenTelemetry Collector's Prometheus
exporter names them (derived from the instrument names and units in the code)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from zoomer_serve.export import rpc_metrics
from zoomer_serve.telemetry import names as gpu_names
from zoomer_serve.telemetry.nvml import _INSTRUMENTS as NVML_INSTRUMENTS

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
SERVICE = "grafana"
PROMQL_FUNCTIONS = {"sum", "avg", "max", "min", "count", "rate", "increase", "histogram_quantile", "by", "without",
                    "label_values", "irate", "topk", "quantile"}
UNIT_SUFFIX = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "W": "watts", "J": "joules"}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return load_yaml(ROOT / "docker-compose.yml")["services"]


@pytest.fixture(scope="module")
def dashboards() -> list[dict[str, Any]]:
    files = sorted((GRAFANA / "dashboards").glob("*.json"))
    assert files
    return [json.loads(f.read_text(encoding="utf-8")) for f in files]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (bind mounts) or volume name."""
    out = {}
    for m in service.get("volumes", []):
        parts = m.split(":")
        out[parts[1]] = parts[0]
    return out


def prometheus_names() -> dict[str, set[str]]:
    """The Prometheus series zoomer-serve's metrics become (OpenTelemetry -> Prometheus: dots to underscores, the
    unit as suffix, ``_ratio`` for unit-1 gauges, ``_total`` for counters, ``_bucket/_count/_sum`` for
    histograms) -> the labels they carry (attributes, dots to underscores, plus job and instance)."""
    out: dict[str, set[str]] = {}
    base_labels = {"job", "instance"}
    rpc_labels = base_labels | {k.replace(".", "_") for k in rpc_metrics.METRIC_ATTRIBUTE_KEYS}
    for side in ("server", "client"):
        stem = f"rpc_{side}_call_duration_seconds"
        for suffix in ("_bucket", "_count", "_sum"):
            out[stem + suffix] = rpc_labels | ({"le"} if suffix == "_bucket" else set())
    gpu_labels = base_labels | {gpu_names.HW_ID.replace(".", "_"), gpu_names.HW_GPU_TASK.replace(".", "_"),
                                gpu_names.HW_NAME.replace(".", "_"), gpu_names.HW_TYPE.replace(".", "_")}
    for name, kind, unit, _ in NVML_INSTRUMENTS:
        stem = name.replace(".", "_")
        if unit == "1":
            stem += "_ratio" if kind == "gauge" else ""
        elif unit in UNIT_SUFFIX:
            stem += "_" + UNIT_SUFFIX[unit]
        out[stem + ("_total" if kind == "counter" else "")] = gpu_labels
    return out


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """``(metric, labels used in its selector)`` for every ``metric{...}`` in a PromQL expression."""
    found = [(m.group(1), set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2))))
             for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr)]
    bare = re.fullmatch(r"label_values\(([a-zA-Z_:][a-zA-Z0-9_:]*),\s*[a-z_]+\)", expr)  # a variable's query
    return found + ([(bare.group(1), set())] if bare else [])


def grouping(expr: str) -> list[set[str]]:
    return [{x.strip() for x in m.group(1).split(",")} for m in re.finditer(r"\bby\s*\(([^)]*)\)", expr)]


def exprs(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in dashboard.get("templating", {}).get("list", []) if v.get("type") == "query"]
    return out


def test_grafana_is_pinned_on_loopback_and_closed_to_anonymous_edits(services: dict[str, Any]) -> None:
    svc = services[SERVICE]
    image, tag = svc["image"].rsplit(":", 1)
    assert image == "grafana/grafana" and re.fullmatch(r"\d+\.\d+\.\d+", tag)
    assert svc["ports"] == ["127.0.0.1:3000:3000"] and "3000" in svc["expose"]
    env = svc["environment"]
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?.+\}", env["GF_SECURITY_ADMIN_PASSWORD"]), \
        "no default admin password: compose must refuse to start without one"
    assert svc["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert "grafana-data" in load_yaml(ROOT / "docker-compose.yml")["volumes"]


def test_provisioning_files_are_mounted_where_grafana_reads_them(services: dict[str, Any]) -> None:
    m = mounts(services[SERVICE])
    assert m["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    for host in (m["/etc/grafana/provisioning"], m["/etc/grafana/dashboards"]):
        assert (ROOT / host).is_dir(), host
    providers = load_yaml(GRAFANA / "provisioning" / "dashboards" / "zoomer.yaml")["providers"]
    assert [p["options"]["path"] for p in providers] == ["/etc/grafana/dashboards"]
    home = services[SERVICE]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith("/etc/grafana/dashboards/") and (GRAFANA / "dashboards" / Path(home).name).is_file()


def test_the_data_source_is_the_stacks_prometheus(services: dict[str, Any], dashboards: list[dict[str, Any]]) -> None:
    (source,) = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yaml")["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    host, port = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", source["url"]).groups()  # type: ignore[union-attr]
    assert host == "prometheus" and port in services["prometheus"]["expose"]
    nets = [set(services[n].get("networks", ["default"])) for n in (SERVICE, "prometheus")]
    assert nets[0] & nets[1], "grafana cannot reach prometheus: no common network"
    for dash in dashboards:
        used = [p["datasource"] for p in dash["panels"]] + [t["datasource"] for p in dash["panels"]
                                                            for t in p["targets"]]
        used += [v["datasource"] for v in dash["templating"]["list"]]
        assert used and all(d == {"type": "prometheus", "uid": source["uid"]} for d in used), used


def test_dashboards_are_valid(dashboards: list[dict[str, Any]]) -> None:
    assert len({d["uid"] for d in dashboards}) == len(dashboards)
    for dash in dashboards:
        ids = [p["id"] for p in dash["panels"]]
        assert len(set(ids)) == len(ids)
        for p in dash["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
            assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"])
        names = {v["name"] for v in dash["templating"]["list"]}
        for expr in exprs(dash):
            for var in re.findall(r"\$([a-z_]+)", expr):
                assert var in names or var.startswith("__"), f"${var} is not a dashboard variable"


def test_queries_name_only_what_zoomer_serve_exports(dashboards: list[dict[str, Any]]) -> None:
    known = prometheus_names()
    for dash in dashboards:
        for expr in exprs(dash):
            found = selectors(expr)
            assert found, f"no metric selector in {expr}"
            for metric, labels in found:
                assert metric in known, f"{metric} is not a series zoomer-serve exports ({sorted(known)})"
                assert labels <= known[metric], f"{metric} has no label {labels - known[metric]}"
            series_labels = set().union(*(known[m] for m, _ in found))
            for group in grouping(expr):
                assert group <= series_labels, f"grouping by {group - series_labels} in {expr}"


def test_the_dashboard_shows_the_latency_heat_map_gpu_per_instance_and_errors_per_method(
        dashboards: list[dict[str, Any]]) -> None:
    panels = [p for d in dashboards for p in d["panels"]]
    heat = [p for p in panels if p["type"] == "heatmap"]
    assert len(heat) == 1
    (t,) = heat[0]["targets"]
    assert t["format"] == "heatmap" and grouping(t["expr"]) == [{"le"}]
    assert [m for m, _ in selectors(t["expr"])] == ["rpc_server_call_duration_seconds_bucket"]
    gpu = [p for p in panels if any("hw_gpu_utilization_ratio" in t["expr"] for t in p["targets"])]
    assert len(gpu) == 1 and "instance" in grouping(gpu[0]["targets"][0]["expr"])[0]
    errors = [p for p in panels if "rpc_response_status_code" in p["targets"][0]["expr"]]
    assert len(errors) == 1
    expr = errors[0]["targets"][0]["expr"]
    assert grouping(expr) == [{"rpc_method"}, {"rpc_method"}] and 'rpc_response_status_code!="OK"' in expr
    assert errors[0]["fieldConfig"]["defaults"]["unit"] == "percentunit"
