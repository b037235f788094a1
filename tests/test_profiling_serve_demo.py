"""``zoomer-serve serve-demo`` hosts the ProfilerControl admin service on the model server's own port, closed
by default; ``zoomer-serve profile`` drives it; a session still running at SIGTERM is finished (trace and
spans) before the server exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from _profiling_support import TOKEN, read_chrome_trace, request_ranges, traces

from zoomer_serve.demo.load import drive_load
from zoomer_serve.processes import wait_for_event
from zoomer_serve.profiling.client import ProfilerClient


def _profile_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zoomer_serve", "profile", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_serve_demo_mounts_the_closed_admin_service_and_finishes_a_session_on_sigterm(collector: Any,
                                                                                   tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    base = {k: v for k, v in os.environ.items() if k != "ZOOMER_ADMIN_TOKEN"}
    server_env = dict(base, ZOOMER_ADMIN_TOKEN=TOKEN, OTEL_EXPORTER_OTLP_ENDPOINT=collector.grpc_endpoint,
                      OTEL_SERVICE_NAME="ranker-p", OTEL_BSP_SCHEDULE_DELAY="200")
    proc = subprocess.Popen([sys.executable, "-m", "zoomer_serve", "serve-demo", "--port", "0", "--profiles-dir",
                             str(profiles)], stdout=subprocess.PIPE, env=server_env)
    try:
        ready = wait_for_event(proc, "ready", 120)
        assert ready is not None and ready["admin_port"] == ready["port"]
        target = f"127.0.0.1:{ready['port']}"
        refused = _profile_cli("status", "--target", target, env=base)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        with_token = dict(base, ZOOMER_ADMIN_TOKEN=TOKEN)
        started = _profile_cli("start", "--target", target, "--requests", "15", env=with_token)
        assert started.returncode == 0 and "running" in started.stdout, started.stderr
        assert drive_load(target, 30.0, clients=2, batch_size=8, max_requests=30).unexpected == 0
        with ProfilerClient(target, token=TOKEN) as client:
            first = client.wait_finished(1, 60)
            assert first is not None and first.outcome == "done" and first.requests == 15
            second = client.start(max_requests=1000, duration_ms=60_000)
            assert second.session is not None and second.session.number == 2
        drive_load(target, 30.0, clients=2, batch_size=8, max_requests=10)
        proc.send_signal(signal.SIGTERM)
        assert wait_for_event(proc, "stopped", 90) is not None
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    files = traces(profiles)
    assert len(files) == 2
    counts = [len(request_ranges(read_chrome_trace(path))) for path in files]
    assert counts[0] == 15 and counts[1] >= 10
    spans = collector.spans()
    profiles_spans = sorted((r for r in spans if r["name"] == "zoomer.profile"),
                            key=lambda r: r["start_ns"])
    assert [r["attributes"].get("zoomer.profile.stop_reason") for r in profiles_spans] == ["max_requests", "shutdown"]
    assert [len(r["links"]) for r in profiles_spans] == counts
    assert all(r["service_name"] == "ranker-p" for r in profiles_spans)


def test_a_bad_artifacts_url_stops_serve_demo_before_telemetry_starts(monkeypatch: Any, tmp_path: Path) -> None:
    """``ZOOMER_ARTIFACTS_URL=bogus://x`` is refused with the other profiling settings, before telemetry starts
    (it was refused only once the controller read it, after configure(), whose shutdown then spent seconds
    retrying the metrics export)."""
    import pytest

    from zoomer_serve.cli import build_parser
    from zoomer_serve.config import ConfigError
    from zoomer_serve.profiling.serving import ServerProfiling

    monkeypatch.setenv("ZOOMER_ARTIFACTS_URL", "bogus://x")
    args = build_parser().parse_args(["serve-demo", "--profiles-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="ZOOMER_ARTIFACTS_URL: cannot use bogus://x"):
        ServerProfiling.configs(args)
    monkeypatch.setenv("ZOOMER_ARTIFACTS_URL", "off")
    ServerProfiling.configs(args)
