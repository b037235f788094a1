"""A Thrift (thriftpy2) model server of your own, wrapped with zoomer-serve: ``make_thrift_server`` takes
thriftpy2's ``make_server`` arguments and traces every call (one SERVER span, ``rpc.system.name=thrift``,
with the handler's phases); ``InvalidRequest``, declared in the IDL, is a normal reply.

From the repository root, with a collector listening (e.g. ``zoomer-serve collector --store zoomer.duckdb``)::

    OTEL_SERVICE_NAME=example-ranker-thrift OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
        python examples/thrift_server/server.py --port 9090
    python examples/thrift_server/client.py --target 127.0.0.1:9090 --calls 10

It prints ``Ranker (Thrift) listening on HOST:PORT`` once it accepts calls (``--port 0``, the default, picks
a free port). Ctrl+C stops accepting, lets calls in progress finish (5 s at most), and the exit flushes the
spans; so does a SIGTERM (README.md, "Stopping it without losing data").
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import thriftpy2
import torch

from interceptors import make_thrift_server
from zoomer_serve import phase

ranker_thrift = thriftpy2.load(str(Path(__file__).with_name("ranker.thrift")), module_name="ranker_thrift")
NUM_FEATURES = 8
MAX_CANDIDATES = 256


def build_model(seed: int = 0) -> torch.nn.Module:
    """A 2-layer MLP, ``[batch, NUM_FEATURES] -> [batch, 1]`` scores (float32), in eval mode."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model.eval()


def to_tensor(request: ranker_thrift.RankRequest) -> torch.Tensor:
    """``[candidates, NUM_FEATURES]`` float32; raises ``InvalidRequest`` (the IDL's) naming what is wrong."""
    candidates = request.candidates or []
    if not 1 <= len(candidates) <= MAX_CANDIDATES:
        raise ranker_thrift.InvalidRequest(message=f"1 to {MAX_CANDIDATES} candidates, got {len(candidates)}")
    rows = [list(c.features or []) for c in candidates]
    for candidate, row in zip(candidates, rows):
        if len(row) != NUM_FEATURES or not all(math.isfinite(x) for x in row):
            raise ranker_thrift.InvalidRequest(
                message=f"candidate {candidate.item_id!r}: {NUM_FEATURES} finite features needed")
    return torch.tensor(rows, dtype=torch.float32)


class RankerHandler:
    """The service's methods, by their IDL names; each step is a phase of the call's span."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def Rank(self, request: ranker_thrift.RankRequest) -> ranker_thrift.RankResponse:
        with phase("preprocess"):
            batch = to_tensor(request)
        with phase("forward"), torch.inference_mode():
            scores = self.model(batch).squeeze(1)
        with phase("postprocess"):
            order = torch.argsort(scores, descending=True).tolist()
            values = scores.tolist()
            return ranker_thrift.RankResponse(request_id=request.request_id, items=[
                ranker_thrift.ScoredItem(item_id=request.candidates[i].item_id, score=values[i]) for i in order])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free one)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # a thread per connection: they share the cores
    server = make_thrift_server(ranker_thrift.Ranker, RankerHandler(build_model()), args.host, args.port)
    print(f"Ranker (Thrift) listening on {args.host}:{server.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # Ctrl+C: stop accepting, let calls in progress finish
        server.stop(grace_s=5)


if __name__ == "__main__":
    main()
