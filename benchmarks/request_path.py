"""What the sync gRPC interceptor's request path costs per call, in a hot loop, against an older tree.

Usage::

    python benchmarks/request_path.py                                  # this tree: µs and instructions per call
    python benchmarks/request_path.py --baseline COMMIT [--repeat 3]   # side by side with an older tree
    python benchmarks/request_path.py --measure time                   # without valgrind (µs only)

On a saturated server each µs of Python that a call adds costs several µs of the server's CPU (``RESULTS.md``,
"echo's tail at 8 client threads": 5 µs here were +40 to +65 µs there), so the request path is measured on its
own here, where a change of a few hundred instructions can be seen: wall-clock timings on a shared 2-vCPU VM move
by 30 % between runs of one build; callgrind's instruction counts move by about 1 %.

Each measurement is a fresh process. It wraps one unary-unary handler with
:class:`~interceptors.ZoomerServerInterceptor` (``ZOOMER_EXPORT_MODE=none``: the span is built and handed to
the sink, which drops it; the default per-request CPU-time sample of 1 in 16 applies) and calls the wrapped
handler, then the wrapped response serializer, as grpc's sync server does, with a stand-in for grpc's
``ServicerContext`` that answers as grpc's ``_Context`` does for a plain call (one ``user-agent`` metadata
entry, the peer as bytes decoded to text, ``is_active()`` under a condition lock, no code set). Kinds:

- ``echo``: raw bytes in and out (no serializers), 1 KiB, the overhead benchmark's echo method;
- ``model``: the demo's ``PredictRequest`` (16 candidates) through its protobuf deserializer and the response
  serializer, the handler returning a prepared response;
- ``bare``: the echo handler called directly (no interceptor): the loop's own floor;
- ``model_bare``: the ``model`` kind's deserializer, handler and serializer called directly (no interceptor).

Measures: ``instructions`` (callgrind: the instructions of N2 - N1 calls, divided by N2 - N1; needs valgrind) and
``time`` (µs per call: the best of 7 rounds of 20 000 calls, timeit). With ``--baseline`` the package folders of
that commit (``git archive``) and of this tree alternate, ``--repeat`` pairs; the medians and ratios are printed.
Results: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _bench_args import Range, parse  # noqa: E402

KINDS = ("bare", "echo", "model_bare", "model")
PACKAGES = ("zoomer_serve", "interceptors")
CALLS = (2_000, 12_000)  # callgrind: the instructions of the second count minus the first, per call


class _State:
    """The fields of grpc's ``_RPCState`` that the interceptor reads."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.client: object = None
        self.code: object = None
        self.details: object = None
        self.statused = False


class StandInContext:
    """Answers the ``ServicerContext`` calls of the interceptor's unary path as grpc's sync ``_Context`` does."""

    def __init__(self) -> None:
        self._state = _State()
        self._metadata = (("user-agent", "grpc-python/1.85.3 grpc-c/58.0.0 (linux; chttp2)"),)
        self._peer = b"ipv4:127.0.0.1:54321"

    def invocation_metadata(self) -> Any:
        return self._metadata

    def peer(self) -> str:
        return self._peer.decode("utf8")

    def is_active(self) -> bool:
        with self._state.condition:
            return self._state.client is None and not self._state.statused

    def code(self) -> Any:
        return self._state.code

    def details(self) -> Any:
        return self._state.details

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback: Any) -> bool:
        return True


def _echo(request: Any, context: Any) -> Any:
    return request


def _model_handler() -> Any:
    """The demo's ``Predict`` method as grpc holds it, its handler returning a prepared 16-score response."""
    import grpc

    from zoomer_serve.demo import ranker_pb2

    response = ranker_pb2.PredictResponse(scores=[0.5] * 16)
    return grpc.unary_unary_rpc_method_handler(lambda request, ctx: response, ranker_pb2.PredictRequest.FromString,
                                               ranker_pb2.PredictResponse.SerializeToString)


def _model_request() -> bytes:
    import numpy as np

    from zoomer_serve.demo.load import make_request

    return make_request(np.random.default_rng(0), 16).SerializeToString()


def build(kind: str, recorder: Any = None) -> Any:
    """The function one call runs: grpc's calls of the handler and the serializer for one request (``recorder``:
    the interceptor's; default the process's, configured from the environment)."""
    import grpc

    context = StandInContext()
    if kind == "bare":
        request = b"x" * 1024
        return lambda: _echo(request, context)
    from interceptors import ZoomerServerInterceptor

    if kind == "model_bare":
        handler = _model_handler()
        behavior, deserialize, serialize = handler.unary_unary, handler.request_deserializer, \
            handler.response_serializer
        data = _model_request()
        return lambda: serialize(behavior(deserialize(data), context))
    if kind == "echo":
        handler = grpc.unary_unary_rpc_method_handler(_echo)
        method, data = "/bench.Echo/Echo", b"x" * 1024
    else:
        handler = _model_handler()
        method, data = "/zoomer.demo.Ranker/Predict", _model_request()

    class Details:
        pass

    details = Details()
    details.method, details.invocation_metadata = method, context.invocation_metadata()  # type: ignore[attr-defined]
    wrapped = ZoomerServerInterceptor(recorder).intercept_service(lambda d: handler, details)
    call, deserialize = wrapped.unary_unary, wrapped.request_deserializer
    serialize = wrapped.response_serializer or (lambda r: r)

    if deserialize is None:
        return lambda: serialize(call(data, context))
    return lambda: serialize(call(deserialize(data), context))


def child(kind: str, measure: str, calls: int) -> None:
    """Run in a fresh process: print one JSON line (``time``) or just make ``calls`` calls (callgrind)."""
    os.environ["ZOOMER_EXPORT_MODE"] = "none"
    os.environ.setdefault("OTEL_SERVICE_NAME", "request-path-bench")
    one = build(kind)
    if measure == "instructions":
        for _ in range(calls):
            one()
        return
    for _ in range(20_000):
        one()
    best = min(timeit.repeat(one, number=20_000, repeat=7)) / 20_000 * 1e6
    print(json.dumps({"us_per_call": round(best, 3)}))


def _run(tree: Path, kind: str, measure: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}  # the child sets ZOOMER_EXPORT_MODE
    script = str(Path(__file__).resolve())
    if measure == "time":
        out = subprocess.run([sys.executable, script, "--child", kind, "--measure", "time"], env=env, cwd=tree,
                             check=True, capture_output=True, text=True).stdout
        return float(json.loads(out.strip().splitlines()[-1])["us_per_call"])
    counts = []
    with tempfile.TemporaryDirectory(prefix="zoomer-callgrind-") as tmp:
        for n in CALLS:
            proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
                                   sys.executable, script, "--child", kind, "--measure", "instructions",
                                   "--calls", str(n)], env=env, cwd=tree, check=True, capture_output=True, text=True)
            line = next(x for x in proc.stderr.splitlines() if "Collected" in x)
            counts.append(int(line.split()[-1]))
    return (counts[1] - counts[0]) / (CALLS[1] - CALLS[0])


def measure_trees(trees: dict[str, Path], measures: list[str], repeat: int) -> dict[str, Any]:
    """Alternate the trees, ``repeat`` rounds; per kind and measure the rounds, medians and ratios."""
    results: dict[str, Any] = {}
    for measure in measures:
        for kind in KINDS:
            per_tree: dict[str, list[float]] = {name: [] for name in trees}
            for _ in range(repeat):
                for name, tree in trees.items():
                    value = _run(tree, kind, measure)
                    per_tree[name].append(value)
                    print(f"{measure:12s} {kind:6s} {name:10s} {value:10.2f}", file=sys.stderr, flush=True)
            row: dict[str, Any] = {name: {"rounds": vals, "median": statistics.median(vals)}
                                   for name, vals in per_tree.items()}
            if "baseline" in row and row["baseline"]["median"]:
                row["ratio"] = round(row["this tree"]["median"] / row["baseline"]["median"], 3)
            results.setdefault(measure, {})[kind] = row
    return results


RANGES = (Range("--repeat", 1, 20),)
"""The numbers the options may take (see benchmarks/_bench_args.py)."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="also measure this git revision's packages, alternating")
    ap.add_argument("--repeat", type=int, default=None, help="rounds per tree (default 1; 3 with --baseline)")
    ap.add_argument("--measure", choices=("both", "time", "instructions"), default="both")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = parse(ap, argv, RANGES)
    if args.child:
        child(args.child, args.measure, args.calls)
        return 0
    repeat = args.repeat if args.repeat is not None else 3 if args.baseline else 1
    measures = ["instructions", "time"] if args.measure == "both" else [args.measure]
    if "instructions" in measures and shutil.which("valgrind") is None:
        if args.measure == "instructions":
            ap.error("--measure instructions needs valgrind on PATH")
        measures.remove("instructions")
        print("valgrind not found: time only", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="zoomer-request-path-") as old:
        trees = {"this tree": ROOT}
        if args.baseline:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, *PACKAGES],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
            trees = {"baseline": Path(old), "this tree": ROOT}
        results = measure_trees(trees, measures, repeat)
    results["meta"] = {"baseline": args.baseline, "repeat": repeat, "calls": CALLS,
                       "command": "python benchmarks/request_path.py " + " ".join(argv or sys.argv[1:])}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
