"""The reference tables of the docs match the code: generated pages are up to date, every environment variable
and emitted name the code holds is listed, every listed one is in the code, and the docs name none it lacks.

After changing a variable or a name: ``.venv/bin/python -m zoomer_serve.reference`` (see
:mod:`zoomer_serve.reference`)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from zoomer_serve.reference import BEGIN, END, main, replace_between_markers, stale_pages
from zoomer_serve.reference.names import NAMES, NAMESPACES, NOT_EMITTED
from zoomer_serve.reference.scan import scan
from zoomer_serve.reference.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
CODE = scan(ROOT)
SETTING_NAMES = {s.name for s in SETTINGS}
LISTED_NAMES = {n.name for n in NAMES}
FAMILIES = [n for n in NAMES if "<" in n.name]


def _family_glob(name: str) -> str:
    return re.sub(r"<[^>]+>", "*", name)


def _covered(name: str) -> bool:
    """``name`` (from the code: a literal or a glob) is listed, a member of a listed family, or not emitted."""
    if name in LISTED_NAMES or name in NOT_EMITTED:
        return True
    if "*" in name:
        return any(fnmatch.fnmatchcase(listed, name) or fnmatch.fnmatchcase(name, _family_glob(listed))
                   for listed in LISTED_NAMES)
    return any(fnmatch.fnmatchcase(name, _family_glob(f.name)) for f in FAMILIES)


def test_generated_pages_are_up_to_date() -> None:
    assert stale_pages(ROOT, write=False) == [], "run: .venv/bin/python -m zoomer_serve.reference"
    assert main(["--check", "--root", str(ROOT)]) == 0


def test_marker_replacement_keeps_the_hand_written_text_and_needs_both_markers() -> None:
    page = f"intro\n{BEGIN}\nold table\n{END}\noutro\n"
    assert replace_between_markers(page, "| new |") == f"intro\n{BEGIN}\n\n| new |\n\n{END}\noutro\n"
    with pytest.raises(ValueError, match="needs the lines"):
        replace_between_markers("no markers", "| new |", "docs/x.md")


def test_every_variable_the_code_reads_is_listed() -> None:
    missing = {name: sorted(files) for name, files in CODE.env_vars().items() if name not in SETTING_NAMES}
    assert missing == {}, "add these to zoomer_serve/reference/settings.py"


def test_every_listed_variable_is_read_by_the_code() -> None:
    literal = CODE.env_vars()
    globs = CODE.env_globs()
    unread = [name for name in SETTING_NAMES
              if name not in literal and not any(fnmatch.fnmatchcase(name, g) for g in globs)]
    assert unread == []


def test_every_variable_glob_in_the_code_matches_a_listed_variable() -> None:
    unmatched = [g for g in CODE.env_globs() if not any(fnmatch.fnmatchcase(s, g) for s in SETTING_NAMES)]
    assert unmatched == []


def test_settings_have_a_default_and_a_meaning() -> None:
    assert len(SETTING_NAMES) == len(SETTINGS), "a variable is listed twice"
    assert [s.name for s in SETTINGS if not s.default or not s.meaning] == []


def test_every_emitted_name_in_the_code_is_listed() -> None:
    missing = {name: sorted(files) for name, files in CODE.dotted(NAMESPACES).items() if not _covered(name)}
    assert missing == {}, "add these to zoomer_serve/reference/names.py (NAMES, or NOT_EMITTED with the reason)"


def test_every_listed_name_is_in_the_code() -> None:
    held = CODE.dotted(NAMESPACES)
    literals = set(CODE.literals)
    absent = []
    for n in NAMES:
        if n.evidence:
            found = n.evidence in literals or n.evidence in CODE.globs
        else:
            found = n.name in held or any("*" in g and fnmatch.fnmatchcase(n.name, g) for g in held)
        if not found:
            absent.append(n.name)
    assert absent == []
    assert [name for name in NOT_EMITTED if name not in literals] == []


def test_names_have_a_known_kind_and_are_listed_once() -> None:
    from zoomer_serve.reference.names import KINDS

    assert [n.name for n in NAMES if n.kind not in KINDS] == []
    seen: set[str] = set()
    twice = [n.name for n in NAMES if n.name in seen or seen.add(n.name)]  # type: ignore[func-returns-value]
    assert twice == []
    assert [n.name for n in NAMES if "<" in n.name and not n.evidence] == []


# Names the docs mention that are not ours, each with its reason.
DOCS_FOREIGN = {
    "dotnet.gc.pause.time": "the .NET convention our cpython.gc.pause.time is modelled on",
    "rpc.server.call.exception": "the conventions' exception log record (v1.40); we export no logs",
    "rpc.client.call.exception": "the conventions' exception log record (v1.40); we export no logs",
    "rpc.*.call.exception": "the conventions' exception log records (v1.40); we export no logs",
}
_BACKTICKED = re.compile(r"`([a-z][a-z0-9_]*(?:\.(?:[a-z0-9_]+|\*|<[a-z_ ]+>))+)`")


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_docs_name_no_attribute_or_metric_the_code_lacks() -> None:
    """A backticked name in one of the namespaces, anywhere in README.md or docs/, is listed, not emitted but
    held by the code, or named as foreign. Wildcards (``zoomer.profile.memcpy.*``) must match a listed name."""
    unknown: dict[str, list[str]] = {}
    for page in _doc_pages():
        for name in _BACKTICKED.findall(page.read_text(encoding="utf-8")):
            if not name.startswith(NAMESPACES) or name in DOCS_FOREIGN:
                continue
            glob = _family_glob(name)
            ok = (name in LISTED_NAMES or name in NOT_EMITTED
                  or any(fnmatch.fnmatchcase(listed, glob) for listed in LISTED_NAMES)
                  or any(fnmatch.fnmatchcase(name, _family_glob(f.name)) for f in FAMILIES))
            if not ok:
                unknown.setdefault(name, []).append(page.relative_to(ROOT).as_posix())
    assert unknown == {}


def _defaults() -> dict[str, object]:
    """What the code uses when each variable is unset, read from the configuration objects it builds."""
    from zoomer_serve.artifacts.config import ArtifactsConfig
    from zoomer_serve.collector.http_receiver import HttpLimits
    from zoomer_serve.collector.rotation import ParquetConfig
    from zoomer_serve.config import ZoomerConfig
    from zoomer_serve.profiling.config import AdminConfig, ProfilerConfig

    cfg = ZoomerConfig.from_env({})
    ex, gpu, host, lim = cfg.export, cfg.gpu, cfg.host, cfg.span_limits
    http = HttpLimits.from_env({})
    artifacts = ArtifactsConfig.from_env("/tmp", {})
    return {
        "OTEL_SERVICE_NAME": cfg.service_name, "OTEL_EXPORTER_OTLP_PROTOCOL": ex.protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": ex.traces_endpoint, "OTEL_EXPORTER_OTLP_TIMEOUT": ex.timeout_ms,
        "OTEL_EXPORTER_OTLP_COMPRESSION": ex.compression, "OTEL_TRACES_SAMPLER": cfg.sampler,
        "OTEL_TRACES_SAMPLER_ARG": cfg.sampler_ratio, "OTEL_BSP_MAX_QUEUE_SIZE": ex.max_queue_size,
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": ex.max_export_batch_size, "OTEL_BSP_SCHEDULE_DELAY": ex.schedule_delay_ms,
        "OTEL_METRIC_EXPORT_INTERVAL": ex.metric_export_interval_ms, "OTEL_SDK_DISABLED": cfg.sdk_disabled,
        "OTEL_ATTRIBUTE_COUNT_LIMIT": lim.attribute_count, "OTEL_SPAN_EVENT_COUNT_LIMIT": lim.event_count,
        "OTEL_SPAN_LINK_COUNT_LIMIT": lim.link_count,
        "ZOOMER_EXCEPTION_VALUE_LENGTH_LIMIT": lim.exception_value_length, "ZOOMER_EXPORT_MODE": ex.mode,
        "ZOOMER_EXPORT_MAX_REQUEST_BYTES": ex.max_request_bytes, "ZOOMER_SIGNAL_HANDLERS": cfg.signal_handlers,
        "ZOOMER_EXCLUDED_METHODS": ",".join(cfg.excluded_methods),
        "ZOOMER_GPU": gpu.mode, "ZOOMER_GPU_PEAK": gpu.peak, "ZOOMER_GPU_OOM": gpu.oom,
        "ZOOMER_GPU_MEMORY_HISTORY": gpu.history, "ZOOMER_GPU_MEMORY_HISTORY_STACKS": gpu.history_stacks,
        "ZOOMER_GPU_MEMORY_HISTORY_MAX_ENTRIES": gpu.history_max_entries,
        "ZOOMER_GPU_MEMORY_HISTORY_DRAIN_MS": gpu.history_drain_ms,
        "ZOOMER_GPU_MEMORY_HISTORY_TOP_EVENTS": gpu.history_top_events, "ZOOMER_GPU_NVML_PERIOD_MS": gpu.nvml_period_ms,
        "ZOOMER_HOST": host.enabled, "ZOOMER_HOST_REQUEST_CPU_TIME": host.request_cpu_time,
        "ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN": host.request_cpu_time_one_in,
        "ZOOMER_CPU_PROFILE": host.cpu_profile, "ZOOMER_CPU_PROFILE_RATE_HZ": host.cpu_profile_rate_hz,
        "ZOOMER_CPU_PROFILE_TOP": host.cpu_profile_top,
        "ZOOMER_CPU_PROFILE_ATTACH_TIMEOUT_MS": host.cpu_profile_attach_timeout_ms,
        "ZOOMER_PROFILES_DIR": f"./{ProfilerConfig.from_env({}).profiles_dir}",
        "ZOOMER_ADMIN_OPEN_LOOPBACK": AdminConfig.from_env({}).open_loopback,
        "ZOOMER_ARTIFACTS_QUEUE": artifacts.max_pending, "ZOOMER_ARTIFACTS_RETRIES": artifacts.retries,
        "ZOOMER_COLLECTOR_MAX_CONNECTIONS": http.max_connections,
        "ZOOMER_COLLECTOR_HEADER_TIMEOUT_S": http.header_timeout_s,
        "ZOOMER_COLLECTOR_BODY_TIMEOUT_S": http.body_timeout_s, "ZOOMER_COLLECTOR_IDLE_TIMEOUT_S": http.idle_timeout_s,
        "ZOOMER_COLLECTOR_PARQUET_ROTATE_S": ParquetConfig("/tmp/x").rotate_s,
    }


def _as_text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer() and value >= 10:
        return str(int(value))
    return str(value)


def test_listed_defaults_are_what_the_code_uses() -> None:
    """The default column (its first word, backticks off) equals the value the code builds from an empty
    environment, for every variable whose default is a plain value."""
    listed = {s.name: s.default for s in SETTINGS}
    wrong = {}
    for name, value in _defaults().items():
        first = listed[name].split(" (")[0].strip("`")
        if first not in (_as_text(value), {"true": "on", "false": "off"}.get(_as_text(value))):
            wrong[name] = (listed[name], value)
    assert wrong == {}


def test_listed_metric_units_are_the_units_the_code_gives_its_instruments() -> None:
    """Where the code keeps its instruments in a table (NVML, the export worker's counters and batching
    histograms, the host metrics' conventional units), the listed unit is that unit."""
    from zoomer_serve.export import rpc_metrics
    from zoomer_serve.host.names import SEMCONV
    from zoomer_serve.telemetry import nvml

    code_units = {name: unit for name, _kind, unit, _desc in nvml._INSTRUMENTS}
    code_units.update({name: unit for name, (_desc, unit) in rpc_metrics._COUNTERS.items()})
    code_units.update({name: unit for name, (_desc, unit) in rpc_metrics._BATCH_HISTOGRAMS.items()})
    code_units.update({name: unit for name, (unit, _keys) in SEMCONV.items() if unit})
    listed = {n.name: n.unit for n in NAMES}  # zoomer.batch.size is a span attribute and a metric
    assert len(code_units) > 40
    assert {name: (listed.get(name), unit) for name, unit in code_units.items() if listed.get(name) != unit} == {}


def test_run_outside_the_repository_root_says_so(tmp_path, capsys):
    """Run from another folder it ended in a FileNotFoundError traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--check", "--root", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "is not the repository root: no docs/reference/configuration.md" in capsys.readouterr().err
