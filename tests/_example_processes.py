"""Running programs as a user runs them, for the tests of examples/ and of locust's distributed mode: a
server script started as a subprocess that prints the address it listens on, stopped by a signal; the
environment that points a program's telemetry at the test collector; a free loopback port."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on (\S+:\d+)")


def free_port() -> int:
    """A loopback port nothing listens on now, for a program that takes no port 0 (locust's master). Chosen
    below the kernel's ephemeral range, where other tests' port-0 servers and every outgoing connection get
    theirs (a port from that range, released, was taken again before locust bound it in a CI run); a port 0
    bind's when that range leaves no room below it."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(50):
        port = rng.randrange(10_000, low) if low > 10_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def telemetry_env(collector: Any, service: str | None = None, **extra: str) -> dict[str, str]:
    """This environment with the program's spans going to ``collector`` over OTLP/gRPC, as ``service``
    (None: the program's default name), and the repository importable."""
    drop = ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "ZOOMER_EXPORT_MODE", "ZOOMER_ADMIN_TOKEN",
            "ZOOMER_LOADTEST_TRANSPORT", "ZOOMER_LOADTEST_TARGET")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=collector.grpc_endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
               OTEL_BSP_SCHEDULE_DELAY="200", **extra)
    if service is not None:
        env["OTEL_SERVICE_NAME"] = service
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@dataclass
class Program:
    """A started program: its process and every line it printed so far (stdout and stderr)."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, signum: int = signal.SIGINT, timeout_s: float = 60) -> int:
        """Send ``signum`` (if it still runs) and wait for the exit; its exit code (killed after the timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        if self._reader is not None:
            self._reader.join(10)
        return rc


def start(argv: list[str], env: dict[str, str], cwd: Path = ROOT) -> Program:
    """Start ``python ARGV...``; its output is collected in the background."""
    proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    program = Program(proc)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            program.lines.append(line)

    program._reader = threading.Thread(target=read, daemon=True)
    program._reader.start()
    return program


def wait_for_address(program: Program, timeout_s: float = 180) -> str:
    """The ``HOST:PORT`` a server program prints (``... listening on HOST:PORT``) once it accepts calls."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = next((m for m in map(LISTENING.search, list(program.lines)) if m), None)
        if match is not None:
            return match.group(1)
        if program.proc.poll() is not None:
            break
        time.sleep(0.1)
    program.stop(signal.SIGKILL)
    raise AssertionError(f"the server printed no address (exit code {program.proc.poll()}):\n{program.output[-3000:]}")


@contextmanager
def server(argv: list[str], env: dict[str, str]) -> Iterator[tuple[Program, str]]:
    """A server program and its address; killed at the end if the test did not stop it."""
    program = start(argv, env)
    try:
        yield program, wait_for_address(program)
    finally:
        if program.proc.poll() is None:
            program.stop(signal.SIGKILL)
