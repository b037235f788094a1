"""The model the example Ranker serves: a small torch MLP that scores a candidate from its features, and the
conversions between the service's messages and tensors (the part of a server that is yours)."""

from __future__ import annotations

import math
import random

import ranker_pb2
import torch

NUM_FEATURES = 8
MAX_CANDIDATES = 256


class InvalidRequest(ValueError):
    """The request cannot be scored; the message says why (the server answers INVALID_ARGUMENT)."""


def build_model(seed: int = 0) -> torch.nn.Module:
    """A 2-layer MLP, ``[batch, NUM_FEATURES] -> [batch, 1]`` scores (float32), in eval mode."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model.eval()


def to_tensor(request: ranker_pb2.RankRequest) -> torch.Tensor:
    """The candidates' features as a ``[candidates, NUM_FEATURES]`` float32 tensor.

    Raises InvalidRequest: no candidates, more than MAX_CANDIDATES, or a candidate without exactly
    NUM_FEATURES finite features."""
    if not 1 <= len(request.candidates) <= MAX_CANDIDATES:
        raise InvalidRequest(f"1 to {MAX_CANDIDATES} candidates, got {len(request.candidates)}")
    rows = []
    for candidate in request.candidates:
        features = list(candidate.features)
        if len(features) != NUM_FEATURES or not all(math.isfinite(x) for x in features):
            raise InvalidRequest(f"candidate {candidate.item_id!r}: {NUM_FEATURES} finite features needed")
        rows.append(features)
    return torch.tensor(rows, dtype=torch.float32)


def to_response(request: ranker_pb2.RankRequest, scores: torch.Tensor) -> ranker_pb2.RankResponse:
    """The candidates sorted by ``scores`` (``[candidates]``), best first."""
    order = torch.argsort(scores, descending=True).tolist()
    values = scores.tolist()
    return ranker_pb2.RankResponse(request_id=request.request_id, items=[
        ranker_pb2.ScoredItem(item_id=request.candidates[i].item_id, score=values[i]) for i in order])


def make_request(rng: random.Random, candidates: int, request_id: str = "") -> ranker_pb2.RankRequest:
    """A valid request with ``candidates`` random candidates (what the client and the locustfile send)."""
    return ranker_pb2.RankRequest(request_id=request_id, candidates=[
        ranker_pb2.Candidate(item_id=f"item-{rng.randrange(10**6)}",
                             features=[rng.uniform(-1.0, 1.0) for _ in range(NUM_FEATURES)])
        for _ in range(candidates)])
