"""Helpers of the profiling tests: the real demo model server with a profiling controller and the admin
service mounted, a Chrome-trace reader that checks the format, and the checks of the exported spans."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from interceptors import ZoomerServerInterceptor
from zoomer_serve.demo.service import build_server
from zoomer_serve.profiling import (
    AdminConfig,
    ProfilerConfig,
    ProfilerController,
    SessionOptions,
    State,
    parse_request_label,
)
from zoomer_serve.profiling.admin import add_profiler_control

TOKEN = "test-admin-token-7f3a"
PREDICT = "zoomer.demo.v1.Ranker/Predict"


@dataclass
class Served:
    target: str
    controller: ProfilerController
    profiles_dir: Path


@contextmanager
def serve_with_profiling(telemetry: Any, model: Any, profiles_dir: Path, admin: AdminConfig | None = None,
                         attach: bool = True, **config: Any) -> Iterator[Served]:
    """The demo Ranker on 127.0.0.1 (port 0) with the zoomer interceptor, a controller attached to
    ``telemetry`` (with ``attach=False``, as built: ``add_profiler_control`` has to) and the admin service
    (token :data:`TOKEN` unless ``admin`` is given) on the same port."""
    controller = ProfilerController(ProfilerConfig(profiles_dir=profiles_dir, **config), telemetry)
    if attach:
        controller.attach()
    admin = admin if admin is not None else AdminConfig(token=TOKEN)
    server, port = build_server(model, interceptors=[ZoomerServerInterceptor(telemetry.recorder)], max_workers=4,
                                extra_servicers=[lambda s: add_profiler_control(s, controller, admin)])
    try:
        yield Served(f"127.0.0.1:{port}", controller, profiles_dir)
    finally:
        controller.close(timeout_s=60)
        server.stop(None).wait(5)


def traces(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.pt.trace.json.gz"))


def read_chrome_trace(path: Path) -> dict[str, Any]:
    """Read a gzip Chrome trace and check the trace-event format Perfetto and chrome://tracing load: a
    ``traceEvents`` list whose events have a phase, a name, pid/tid and numeric µs times (``X`` events a
    non-negative ``dur``). Returns the JSON object."""
    raw = path.read_bytes()
    assert raw[:2] == b"\x1f\x8b", f"{path} is not gzip"
    data = json.loads(gzip.decompress(raw))
    events = data["traceEvents"]
    assert isinstance(events, list) and events, f"{path} has no trace events"
    complete = 0
    for ev in events:
        assert isinstance(ev.get("ph"), str) and "name" in ev and "pid" in ev, ev
        if ev["ph"] == "X":
            complete += 1
            assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0, ev
            assert "tid" in ev, ev
    assert complete > 0
    return data


def request_ranges(data: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """Finished request ranges of a trace by ``(trace_id, span_id)``."""
    out = {}
    for ev in data["traceEvents"]:
        if ev.get("ph") == "X" and ev.get("cat") == "user_annotation":
            ids = parse_request_label(ev["name"])
            if ids is not None and (ev.get("args") or {}).get("finished", True):
                out[ids] = ev
    return out


def hex_ids(ids: tuple[int, int]) -> tuple[str, str]:
    return f"{ids[0]:032x}", f"{ids[1]:016x}"


def check_profile_export(rows: list[dict[str, Any]], session_id: str, covered: set[tuple[int, int]],
                         trigger: str) -> dict[str, Any]:
    """The store holds exactly one ``zoomer.profile`` span of ``session_id``, linked to exactly the
    ``covered`` request spans, which are SERVER spans in the store, each with one ``zoomer.profile.request``
    child inside its time range (with CPU operators when the request succeeded). Returns the profile span row."""
    profiles = [r for r in rows if r["name"] == "zoomer.profile"
                and r["attributes"]["zoomer.profile.session_id"] == session_id]
    assert len(profiles) == 1, [r["attributes"] for r in rows if r["name"] == "zoomer.profile"]
    profile = profiles[0]
    assert profile["attributes"]["zoomer.profile.trigger"] == trigger
    assert profile["status_code"] == "OK"
    links = {(link["trace_id"], link["span_id"]) for link in profile["links"]}
    expected = {hex_ids(ids) for ids in covered}
    assert links == expected
    assert len(profile["links"]) == len(covered)
    servers = {(r["trace_id"], r["span_id"]): r for r in rows if r["kind"] == "SERVER"}
    assert links <= set(servers), "a link points at a request span missing from the store"
    children = [r for r in rows if r["name"] == "zoomer.profile.request"
                and r["attributes"]["zoomer.profile.session_id"] == session_id]
    assert len(children) == len(covered)
    for child in children:
        parent = servers[(child["trace_id"], child["parent_span_id"])]
        assert parent["start_ns"] <= child["start_ns"] < child["end_ns"] <= parent["end_ns"]
        ops = child["attributes"]["zoomer.profile.cpu_op.count"]
        # an OK request ran the model; a rejected one may have ended before any operator (count checks)
        assert ops > 0 if parent["attributes"]["rpc.response.status_code"] == "OK" else ops >= 0
        assert child["attributes"]["zoomer.profile.kernel.count"] == 0  # CPU-only torch here
        assert [(lk["trace_id"], lk["span_id"]) for lk in child["links"]] == [(profile["trace_id"],
                                                                              profile["span_id"])]
    assert {(c["trace_id"], c["parent_span_id"]) for c in children} == expected
    return profile


class SessionGate:
    """A session companion that holds the session thread while the profiler runs: in ``begin`` (the profiler
    started, no request admitted yet) and in ``stop`` (the bound was reached, the profiler not yet stopped), each
    until the test lets it go; so that requests run in both windows, every time."""

    def __init__(self) -> None:
        self.begun, self.stopping = threading.Event(), threading.Event()
        self.go_on, self.go_stop = threading.Event(), threading.Event()

    def begin(self, session_id: str, folder: Path, max_duration_ms: int) -> SessionGate:
        self.begun.set()
        self.go_on.wait(30)
        return self

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            self.go_stop.wait(30)

    def finish(self) -> dict[str, Any]:
        return {}


def bounded_session_with_strays(controller: ProfilerController, send: Callable[[int], None], bound: int,
                                strays: int) -> Any:
    """Run a session of ``bound`` requests on ``controller`` with ``strays`` requests sent (``send(n)`` sends n,
    one after another) while its profiler runs but the session does not admit: as it starts, and after its bound
    was reached (held there by a :class:`SessionGate`). Returns the finished session's info."""
    gate = SessionGate()
    controller.companions = [gate]
    controller.start(SessionOptions(max_requests=bound), wait=False)
    assert gate.begun.wait(30)
    send(strays)
    gate.go_on.set()
    deadline = time.monotonic() + 30
    while controller.state is not State.RUNNING and time.monotonic() < deadline:
        time.sleep(0.01)
    send(bound)
    assert gate.stopping.wait(30)
    send(strays)
    gate.go_stop.set()
    assert controller.wait_idle(60)
    return controller.last


def phase_ranges(data: dict[str, Any], names: tuple[str, ...] = ("preprocess", "forward", "postprocess")
                 ) -> list[dict[str, Any]]:
    """The ``record_function`` ranges of a trace named one of ``names`` (the demo's phases)."""
    return [ev for ev in data["traceEvents"] if ev.get("ph") == "X" and ev.get("cat") == "user_annotation"
            and ev["name"] in names]


def within(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    """``inner`` lies in ``outer`` on the same thread (trace events, µs)."""
    return ((inner["pid"], inner["tid"]) == (outer["pid"], outer["tid"]) and outer["ts"] <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"])
