"""Server process of ``benchmarks/profiling_memory.py``: ``python benchmarks/_bench_profiling_memory.py VARIANT
PROFILES_DIR``.

The demo Ranker as ``zoomer-serve serve-demo`` runs it (sync gRPC server with 8 workers, one torch thread, the
zoomer interceptor, telemetry from the ``OTEL_*`` / ``ZOOMER_*`` environment, the ``ProfilerControl`` admin
service on its port with the token of ``ZOOMER_ADMIN_TOKEN``) and one profiling controller whose sessions run

- ``one_thread``: on the controller's one long-lived session thread (what zoomer-serve does);
- ``thread_per_session``: each on a new thread, as the controller did before (:class:`ThreadPerSession`).

Prints ``{"event": "ready", "pid": ..., "port": ...}``, serves until stdin closes or says ``stop``, then
closes the controller and telemetry and prints ``{"event": "stopped"}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

VARIANTS = ("thread_per_session", "one_thread")


class ThreadPerSession:
    """The controller's session dispatch before the fix: a new daemon thread for every session."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def submit(self, task: Callable[[], None]) -> None:
        thread = threading.Thread(target=task, name=f"zoomer-profile-{len(self._threads) + 1}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def on_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def close(self, timeout_s: float) -> bool:
        for thread in self._threads:
            thread.join(timeout_s)
        return True


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in VARIANTS:
        print(f"usage: _bench_profiling_memory.py {{{','.join(VARIANTS)}}} PROFILES_DIR", file=sys.stderr)
        return 2
    import torch

    import zoomer_serve
    from interceptors import ZoomerServerInterceptor
    from zoomer_serve.demo.model import build_model
    from zoomer_serve.demo.service import build_server
    from zoomer_serve.profiling import AdminConfig, ProfilerConfig, ProfilerController
    from zoomer_serve.profiling.admin import add_profiler_control

    torch.set_num_threads(1)
    telemetry = zoomer_serve.get_telemetry()
    controller = ProfilerController(ProfilerConfig.from_env(profiles_dir=Path(argv[1])), telemetry).attach()
    if argv[0] == "thread_per_session":
        controller._worker = ThreadPerSession()  # type: ignore[assignment]
    admin = AdminConfig.from_env()
    server, port = build_server(build_model(device="cpu"), interceptors=[ZoomerServerInterceptor()],
                                extra_servicers=[lambda s: add_profiler_control(s, controller, admin)])
    print(json.dumps({"event": "ready", "pid": os.getpid(), "port": port}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    controller.close(60)
    server.stop(None).wait(5)
    zoomer_serve.shutdown()
    print(json.dumps({"event": "stopped"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
