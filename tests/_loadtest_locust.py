"""locust in library mode (an Environment built in code), run as a script by tests/test_loadtest.py in its own
process: importing locust monkeypatches the standard library with gevent, which must not reach the pytest
process.

    python tests/_loadtest_locust.py SCENARIO CONFIG_JSON OUT_JSON

Scenarios:

- ``ranker``: a local runner with ``RankerGrpcUser`` against ``host`` and ``RankerThriftUser`` against
  ``thrift_host``, plus one user per transport that sends only invalid requests (an empty batch); the
  plugin with the given options. It stops ``run_s`` after spawning, or later, once every kind of call has
  happened (each method called, each refusing user refused) and the profiling session has ended (at most
  60 s more): on a loaded machine one greenlet of this CPU-bound process can go seconds without a turn, and
  the warm-up and the session's requests take longer.
- ``interrupt``: ``users`` users calling ``/test.Slow/Call`` against ``host`` with ``stop_timeout`` (default None,
  locust's: users are killed mid-call) and a wait of ``wait_s``, stopped ``run_s`` after ``min_started`` calls
  have started (whatever the machine's speed).
- ``c11``: a master and one worker (two Environments in this process, as locust's own tests do) with
  ``users`` users calling a unary method that takes ``latency_s`` on the server; the plugin on both (the
  master decides about profiling).

OUT_JSON gets: the request events the users fired (per "<request type> <name>": count, failures, and each
call's trace id and exception), the run's wall time
from spawning complete to stop, the trigger record, the summary, and for ``c11`` what the heartbeats did.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import gevent
from locust import constant, task
from locust.env import Environment

from zoomer_serve.loadtest import LoadTestOptions
from zoomer_serve.loadtest.plugin import TRACE_ID, GrpcUser, configure_client_telemetry, install


class EventLog:
    """The request events fired on one Environment: per "<request type> <name>", the count, the failures, and
    each call's ``[trace id, repr of its exception or None]``."""

    def __init__(self) -> None:
        self.by_name: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0, "failures": 0, "calls": []})
        self.spawned_at: float | None = None

    def on_request(self, request_type: str, name: str, exception: Any, context: dict[str, Any], **_: Any) -> None:
        entry = self.by_name[f"{request_type} {name}"]
        entry["count"] += 1
        entry["failures"] += exception is not None
        entry["calls"].append([context.get(TRACE_ID), None if exception is None else repr(exception)])

    def on_spawned(self, **_: Any) -> None:
        self.spawned_at = self.spawned_at or time.time()


def watch(env: Environment) -> EventLog:
    log = EventLog()
    env.events.request.add_listener(log.on_request)
    env.events.spawning_complete.add_listener(log.on_spawned)
    return log


def run_ranker(cfg: dict[str, Any]) -> dict[str, Any]:
    from zoomer_serve.demo import ranker_pb2
    from zoomer_serve.demo.thrift_server import ranker_thrift
    from zoomer_serve.loadtest.ranker_users import RankerGrpcUser, RankerThriftUser

    class GrpcRanker(RankerGrpcUser):
        host = cfg["host"]

    class ThriftRanker(RankerThriftUser):
        host = cfg["thrift_host"]

    def empty_grpc_batch(user: Any) -> None:
        user.stub.Predict(ranker_pb2.PredictRequest(request_id="empty"))

    def empty_thrift_batch(user: Any) -> None:
        user.client.Predict(ranker_thrift().PredictRequest(request_id="empty", candidates=[]))

    class BadGrpcRanker(GrpcRanker):
        fixed_count = 1
        wait_time = constant(0.05)
        tasks = [empty_grpc_batch]

    class BadThriftRanker(ThriftRanker):
        fixed_count = 1
        wait_time = constant(0.05)
        tasks = [empty_thrift_batch]

    env = Environment(user_classes=[GrpcRanker, ThriftRanker, BadGrpcRanker, BadThriftRanker],
                      stop_timeout=10)  # each class has its host
    runner = env.create_local_runner()
    log = watch(env)
    plugin = install(env, LoadTestOptions(**cfg["options"]))
    runner.start(cfg["users"], spawn_rate=cfg["users"])
    gevent.sleep(cfg["run_s"])
    deadline = time.monotonic() + 60
    while not (every_kind_of_call(log) and plugin.trigger.record.state in ENDED) and time.monotonic() < deadline:
        gevent.sleep(0.1)
    stopped_at = time.time()
    runner.stop()
    summary = plugin.finish()
    runner.quit()
    return {"events": log.by_name, "spawned_at": log.spawned_at, "stopped_at": stopped_at,
            "trigger": plugin.trigger.record.to_dict(), "summary": summary.to_dict() if summary else None}


RANKER_CALLS = ("grpc zoomer.demo.v1.Ranker/Predict", "grpc zoomer.demo.v1.Ranker/PredictStream",
                "thrift zoomer.demo.v1.Ranker/Predict")
REFUSED_CALLS = ("grpc zoomer.demo.v1.Ranker/Predict", "thrift zoomer.demo.v1.Ranker/Predict")
ENDED = ("finished", "failed", "refused")  # the trigger's profiling session is over (or never came)


def every_kind_of_call(log: EventLog) -> bool:
    """Each Ranker method has been called and each refusing user has been refused."""
    seen = log.by_name
    return all(k in seen and seen[k]["count"] > 0 for k in RANKER_CALLS) and \
        all(k in seen and seen[k]["failures"] > 0 for k in REFUSED_CALLS)


class SlowUser(GrpcUser):
    """Calls ``/test.Slow/Call`` (raw bytes) back to back; ``started`` counts the calls begun by all users."""

    wait_time = constant(0)
    started = 0

    def on_start(self) -> None:
        self.slow_call = self.channel.unary_unary("/test.Slow/Call")

    @task
    def call(self) -> None:
        SlowUser.started += 1
        self.slow_call(b"ping")


def run_c11(cfg: dict[str, Any]) -> dict[str, Any]:
    options = LoadTestOptions(**cfg["options"])
    master_env = Environment(user_classes=[SlowUser], host=cfg["host"], stop_timeout=10)
    worker_env = Environment(user_classes=[SlowUser], host=cfg["host"], stop_timeout=10)
    master = master_env.create_master_runner("127.0.0.1", 0)
    worker = worker_env.create_worker_runner("127.0.0.1", master.server.port)
    log = watch(worker_env)
    heartbeats: list[float] = []
    worker_env.events.heartbeat_received.add_listener(lambda **_: heartbeats.append(time.time()))
    master_plugin = install(master_env, options)
    worker_plugin = install(worker_env, options)
    deadline = time.monotonic() + 30
    while not master.clients.ready and time.monotonic() < deadline:
        gevent.sleep(0.1)
    master.start(cfg["users"], spawn_rate=cfg["users"])
    missing_seen = 0
    end = time.monotonic() + cfg["run_s"]
    while time.monotonic() < end:
        gevent.sleep(0.25)
        missing_seen += len(master.clients.missing)
    stopped_at = time.time()
    workers = len(master.clients.all)
    master.stop()
    summary = master_plugin.finish()
    worker_summary = worker_plugin.finish()
    master.quit()
    worker.quit()
    return {"events": log.by_name, "spawned_at": log.spawned_at, "stopped_at": stopped_at,
            "trigger": master_plugin.trigger.record.to_dict(), "worker_trigger": worker_plugin.trigger.record.to_dict(),
            "summary": summary.to_dict() if summary else None, "worker_summary": worker_summary,
            "heartbeats": len(heartbeats), "missing_samples": missing_seen,
            "workers_before_stop": workers}


def run_interrupt(cfg: dict[str, Any]) -> dict[str, Any]:
    class Waiting(SlowUser):
        wait_time = constant(cfg.get("wait_s", 0))

    configure_client_telemetry()  # as install() does: before any user runs, not lazily inside the first call
    env = Environment(user_classes=[Waiting], host=cfg["host"], stop_timeout=cfg.get("stop_timeout"))
    runner = env.create_local_runner()
    log = watch(env)
    gevent.get_hub().loop.update_now()
    runner.start(cfg["users"], spawn_rate=100)
    deadline = time.monotonic() + 60
    while SlowUser.started < cfg["min_started"] and time.monotonic() < deadline:
        gevent.sleep(0.02)
    gevent.sleep(cfg["run_s"])
    runner.stop()
    runner.quit()
    return {"events": log.by_name, "started": SlowUser.started}


def main() -> None:
    scenario, cfg_json, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    cfg = json.loads(cfg_json)
    result = {"ranker": run_ranker, "c11": run_c11, "interrupt": run_interrupt}[scenario](cfg)
    from zoomer_serve.runtime import shutdown

    stats = shutdown(timeout_s=60)  # the users' CLIENT spans reach the collector before the process ends
    result["client_spans"] = {"exported": stats.exported, "dropped": stats.dropped} if stats else None
    out.write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
