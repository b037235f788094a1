"""Programs that the lifecycle tests (signals C12, fork C13) run as processes of their own.

``python tests/lifecycle_apps.py wrapped``: a gRPC server wrapped exactly as README.md shows (the interceptor,
``server.wait_for_termination()``, Ctrl+C handled as README.md says), serving ``test.Echo/Unary``; prints
``{"event": "ready", "port": P}``. ``wrapped-thrift``: the same with a Thrift server built by ``make_thrift_server``
(``serve_forever()``, Ctrl+C handled as ``examples/thrift_server`` does), serving ``Echo.echo`` (:data:`ECHO_IDL`).

``python tests/lifecycle_apps.py fork-os N`` / ``fork-pool N`` / ``fork-pool-recycle N`` / ``fork-grpc N``:
telemetry configured in the parent, then N children made by ``os.fork`` / a ``multiprocessing`` fork pool (plain,
or ``maxtasksperchild=1``) / forked workers that each start a gRPC server; every child records spans; the parent
records some before and after. Prints one JSON line with what was sent: ``{"event": "done", "spans": {name:
count}, "parent_helper": [pid before, pid after]}``.

``python tests/lifecycle_apps.py prefork-grpc N PORT``: a pre-forking server: telemetry configured in the parent (the
interceptor built), then N forked children that each serve ``test.Echo/Unary`` with a gRPC server of their own on
the same ``PORT`` (``grpc.so_reuseport``); prints ``{"event": "ready"}`` once all serve, stops them with SIGTERM
when a line comes on stdin, then prints ``{"event": "done"}``. ``python tests/lifecycle_apps.py load PORT SECONDS
THREADS``: a load client: THREADS threads call ``test.Echo/Unary`` back to back (waiting for the server to
come up), for SECONDS after their first answer; prints ``{"event": "done", "codes": {status: count}}``.

``python tests/lifecycle_apps.py spawn-pool N ENDPOINT`` / ``forkserver-pool`` / ``spawn-executor`` /
``spawn-dataloader``: telemetry configured in code in the parent (``endpoint=ENDPOINT``, ``service_name="spawny"``),
then N tasks run in workers started by the ``spawn`` or ``forkserver`` method (a ``multiprocessing`` pool, a
``ProcessPoolExecutor``, torch ``DataLoader`` workers) that record spans without configuring anything. Prints
the same JSON line (``parent_helper`` null). ``spawn-config-object``: the same as ``spawn-pool`` with the parent
configured by ``configure(config=...)`` (service ``spawny``; endpoint from the environment).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

ECHO = "test.Echo"


def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def echo_handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(ECHO, {"Unary": grpc.unary_unary_rpc_method_handler(echo)})


def wrapped() -> None:
    from interceptors import ZoomerServerInterceptor

    server = grpc.server(futures.ThreadPoolExecutor(8), interceptors=[ZoomerServerInterceptor()])
    server.add_generic_rpc_handlers((echo_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"event": "ready", "port": port}), flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:  # Ctrl+C: let calls in flight finish, as README.md shows
        server.stop(grace=5).wait()


ECHO_IDL = "service Echo { string echo(1: string s) }"


def echo_thrift() -> Any:
    """The thriftpy2 module of :data:`ECHO_IDL` (the test's clients load the same)."""
    import io

    import thriftpy2

    return thriftpy2.load_fp(io.StringIO(ECHO_IDL), module_name="lifecycle_echo_thrift")


class _ThriftEcho:
    def echo(self, s: str) -> str:
        return s


def wrapped_thrift() -> None:
    from interceptors import make_thrift_server

    server = make_thrift_server(echo_thrift().Echo, _ThriftEcho(), "127.0.0.1", 0, client_timeout=None)
    print(json.dumps({"event": "ready", "port": server.port}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # Ctrl+C: stop accepting, let calls in progress finish
        server.stop(grace_s=5)


def _record(name: str, n: int) -> None:
    from zoomer_serve import get_recorder

    recorder = get_recorder()
    for _ in range(n):
        recorder.start(name).end()


def _task(i: int) -> int:
    _record(f"pool/{i}", 3)
    return os.getpid()


class _RecordingDataset:
    """A map-style dataset whose items each record 3 spans in the DataLoader worker that loads them."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        _record(f"loader/{i}", 3)
        return os.getpid()


def configured_in_worker(queue: Any) -> None:
    """A spawned worker's target: configure as a worker that records does (no configure() call), and put on
    ``queue`` the service name it got, or the error."""
    import zoomer_serve

    try:
        queue.put(zoomer_serve.get_telemetry().config.service_name)
    except Exception as exc:
        queue.put(f"{type(exc).__name__}: {exc}")
    finally:
        zoomer_serve.shutdown(timeout_s=1)


def spawn_scenario(mode: str, n: int, endpoint: str) -> None:
    import dataclasses

    import zoomer_serve

    if mode == "spawn-config-object":  # not handed down: the workers configure from the environment
        config = dataclasses.replace(zoomer_serve.ZoomerConfig.from_env(), service_name="spawny")
        zoomer_serve.configure(config=config, set_global_providers=False)
        mode = "spawn-pool"
    else:
        zoomer_serve.configure(service_name="spawny", endpoint=endpoint, schedule_delay_ms=200,
                               set_global_providers=False)
    _record("parent/before", 2)
    spans: dict[str, int] = {"parent/before": 2}
    if mode in ("spawn-pool", "forkserver-pool"):
        with multiprocessing.get_context(mode.split("-")[0]).Pool(2) as pool:
            pool.map(_task, range(n), chunksize=1)
        spans.update({f"pool/{i}": 3 for i in range(n)})
    elif mode == "spawn-executor":
        with futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as executor:
            list(executor.map(_task, range(n)))
        spans.update({f"pool/{i}": 3 for i in range(n)})
    elif mode == "spawn-dataloader":
        from torch.utils.data import DataLoader

        loader = DataLoader(_RecordingDataset(n), batch_size=None, num_workers=2, multiprocessing_context="spawn")
        list(loader)
        spans.update({f"loader/{i}": 3 for i in range(n)})
    _record("parent/after", 2)
    spans["parent/after"] = 2
    print(json.dumps({"event": "done", "spans": spans, "parent_helper": None}), flush=True)


def _serve_worker(port_pipe: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[_INTERCEPTOR[0]])
    server.add_generic_rpc_handlers((echo_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    os.write(port_pipe, f"{port}\n".encode())
    server.wait_for_termination()


_INTERCEPTOR: list = [None]


def _fork_grpc(n: int, spans: dict[str, int]) -> None:
    from interceptors import ZoomerServerInterceptor

    _INTERCEPTOR[0] = ZoomerServerInterceptor()  # built (and telemetry configured) before the fork
    read_end, write_end = os.pipe()
    workers = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _serve_worker(write_end)
            os._exit(0)
        workers.append(pid)
    os.close(write_end)
    reader = os.fdopen(read_end)
    ports = [int(reader.readline()) for _ in range(n)]
    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(f"/{ECHO}/Unary")
            for _ in range(10):
                call(b"x", timeout=30)
    spans[f"{ECHO}/Unary"] = 10 * n
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    for pid in workers:
        os.waitpid(pid, 0)


def prefork_scenario(n: int, port: int) -> None:
    from interceptors import ZoomerServerInterceptor

    interceptor = ZoomerServerInterceptor()  # telemetry configured in the parent, before the fork
    read_end, write_end = os.pipe()
    children = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[interceptor],
                                 options=[("grpc.so_reuseport", 1)])
            server.add_generic_rpc_handlers((echo_handler(),))
            server.add_insecure_port(f"127.0.0.1:{port}")
            server.start()
            os.write(write_end, b"serving\n")
            server.wait_for_termination()  # until the parent's SIGTERM: zoomer-serve flushes, then it dies of it
            os._exit(0)
        children.append(pid)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        for _ in range(n):
            reader.readline()
    print(json.dumps({"event": "ready"}), flush=True)
    sys.stdin.readline()
    for pid in children:
        os.kill(pid, signal.SIGTERM)
    for pid in children:
        os.waitpid(pid, 0)
    print(json.dumps({"event": "done"}), flush=True)


def load(port: int, seconds: float, threads: int) -> None:
    import threading
    import time
    from collections import Counter

    codes: Counter[str] = Counter()
    lock = threading.Lock()

    def run() -> None:
        # a connection of its own (no shared subchannel): the kernel spreads connections over the children
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            call = channel.unary_unary(f"/{ECHO}/Unary")
            stop = None
            while stop is None or time.monotonic() < stop:
                try:
                    call(b"x", timeout=60, wait_for_ready=True)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                if stop is None:
                    stop = time.monotonic() + seconds
                with lock:
                    codes[code] += 1

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    print(json.dumps({"event": "done", "codes": dict(codes)}), flush=True)


def fork_scenario(mode: str, n: int) -> None:
    import zoomer_serve

    telemetry = zoomer_serve.configure(service_name="forky", schedule_delay_ms=200, set_global_providers=False)
    helper_before = telemetry.pipeline.helper_pid if telemetry.pipeline else None
    _record("parent/before", 2)
    spans: dict[str, int] = {"parent/before": 2}
    if mode == "fork-os":
        children = []
        for i in range(n):
            pid = os.fork()
            if pid == 0:
                _record(f"child/{i}", 3)
                sys.exit(0)
            children.append(pid)
            spans[f"child/{i}"] = 3
        for pid in children:
            os.waitpid(pid, 0)
    elif mode in ("fork-pool", "fork-pool-recycle"):
        recycle = 1 if mode == "fork-pool-recycle" else None
        with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=recycle) as pool:
            pool.map(_task, range(n), chunksize=1)
        spans.update({f"pool/{i}": 3 for i in range(n)})
    elif mode == "fork-grpc":
        _fork_grpc(n, spans)
    _record("parent/after", 2)  # the children's exits left the parent's export alone
    spans["parent/after"] = 2
    helper_after = telemetry.pipeline.helper_pid if telemetry.pipeline else None
    print(json.dumps({"event": "done", "spans": spans, "parent_helper": [helper_before, helper_after]}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "wrapped":
        wrapped()
    elif sys.argv[1] == "wrapped-thrift":
        wrapped_thrift()
    elif sys.argv[1] == "prefork-grpc":
        prefork_scenario(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "load":
        load(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1].startswith(("spawn-", "forkserver-")):
        spawn_scenario(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    else:
        fork_scenario(sys.argv[1], int(sys.argv[2]))
