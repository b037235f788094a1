"""DLRM-style click-through-rate ranking model used by the demo server.

Architecture (Naumov et al., 2019, simplified):

* dense features  float32 [batch, num_dense] -> bottom MLP -> float32 [batch, embedding_dim]
* sparse feature f: ids into table f (``nn.EmbeddingBag``, mode="sum") -> [batch, embedding_dim]
* pairwise dot products between all of those vectors (strict lower triangle)
* [bottom output, dot products] -> top MLP -> logit -> sigmoid click probability float32 [batch]

Sparse ids are passed the way ``nn.EmbeddingBag`` takes them, one entry per categorical feature:

* one id per candidate and feature (the common case): ``ids[f]`` is int64 [batch] or
  [batch, k] (exactly k ids per candidate, summed), ``offsets`` is None;
* a variable number of ids per candidate: ``ids[f]`` is int64 [total_ids_f] (all candidates'
  ids concatenated) and ``offsets[f]`` is int64 [batch] giving where each candidate's ids start
  (``offsets[f][0] == 0``, non-decreasing). ``pack_sparse`` builds this form from nested lists.

Every id of feature f must be in [0, table_sizes[f]); the model does not check (torch raises an
IndexError on CPU and a device-side assert on CUDA), callers validate first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class DLRMConfig:
    """Shape of a DLRM model.

    Attributes:
        num_dense: number of dense (continuous) input features.
        table_sizes: rows of each embedding table, one table per categorical feature.
        embedding_dim: width of every embedding vector and of the bottom MLP output.
        bottom_mlp: hidden widths of the bottom MLP; a final Linear to ``embedding_dim`` is appended.
        top_mlp: hidden widths of the top MLP; a final Linear to 1 logit is appended.

    The defaults take about 1-3 ms for one forward of 64 candidates on a 2-core x86 CPU
    (~30 MB of weights, nearly all embeddings).
    """

    num_dense: int = 13
    table_sizes: tuple[int, ...] = (100_000, 50_000, 20_000, 10_000, 5_000, 1_000, 200, 50)
    embedding_dim: int = 32
    bottom_mlp: tuple[int, ...] = (256, 128)
    top_mlp: tuple[int, ...] = (256, 128)

    def __post_init__(self) -> None:
        """Raise ValueError on a non-positive size or an empty table list."""
        if self.num_dense < 1:
            raise ValueError(f"num_dense must be >= 1, got {self.num_dense}")
        if not self.table_sizes:
            raise ValueError("table_sizes must name at least one embedding table")
        for name in ("table_sizes", "bottom_mlp", "top_mlp"):
            bad = [v for v in getattr(self, name) if v < 1]
            if bad:
                raise ValueError(f"{name} entries must be >= 1, got {getattr(self, name)}")
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {self.embedding_dim}")

    @property
    def num_sparse(self) -> int:
        """Number of categorical features (= embedding tables)."""
        return len(self.table_sizes)

    @property
    def num_interactions(self) -> int:
        """Pairwise dot products between the bottom output and all embeddings."""
        n = self.num_sparse + 1
        return n * (n - 1) // 2


def _mlp(in_dim: int, hidden: Sequence[int], out_dim: int, final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    dims = [in_dim, *hidden, out_dim]
    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(dims) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM ranking model; see the module docstring for the sparse input format.

    ``forward`` returns click probabilities float32 [batch] in (0, 1).
    """

    _tril_rows: torch.Tensor
    _tril_cols: torch.Tensor

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.embedding_dim
        self.bottom = _mlp(config.num_dense, config.bottom_mlp, d, final_activation=True)
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, d, mode="sum") for n in config.table_sizes)
        self.top = _mlp(d + config.num_interactions, config.top_mlp, 1, final_activation=False)
        n = config.num_sparse + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("_tril_rows", rows, persistent=False)
        self.register_buffer("_tril_cols", cols, persistent=False)

    def forward(
        self,
        dense: torch.Tensor,
        sparse_ids: Sequence[torch.Tensor],
        sparse_offsets: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Score a batch.

        Args:
            dense: float32 [batch, num_dense].
            sparse_ids: one int64 tensor per table: [batch] or [batch, k], or flat [total_ids]
                when ``sparse_offsets`` is given.
            sparse_offsets: None, or one int64 [batch] tensor of start offsets per table.

        Returns:
            float32 [batch] click probabilities.

        Raises:
            ValueError: wrong number of tables or dense features.
        """
        cfg = self.config
        if dense.dim() != 2 or dense.shape[1] != cfg.num_dense:
            raise ValueError(f"dense must be [batch, {cfg.num_dense}], got {list(dense.shape)}")
        if len(sparse_ids) != cfg.num_sparse:
            raise ValueError(f"expected {cfg.num_sparse} sparse id tensors, got {len(sparse_ids)}")
        if sparse_offsets is not None and len(sparse_offsets) != cfg.num_sparse:
            raise ValueError(f"expected {cfg.num_sparse} offset tensors, got {len(sparse_offsets)}")
        x = self.bottom(dense)  # [B, d]
        embedded = [x]
        for f, table in enumerate(self.tables):
            ids = sparse_ids[f]
            if sparse_offsets is None:
                ids = ids.reshape(ids.shape[0], -1)  # [B, k]
                embedded.append(table(ids))
            else:
                embedded.append(table(ids, sparse_offsets[f]))
        stacked = torch.stack(embedded, dim=1)  # [B, F+1, d]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, F+1, F+1]
        pairs = dots[:, self._tril_rows, self._tril_cols]  # [B, (F+1)F/2]
        logits = self.top(torch.cat([x, pairs], dim=1))  # [B, 1]
        return torch.sigmoid(logits).squeeze(1)


def pick_device() -> torch.device:
    """``cuda`` (current device) when CUDA is available, else ``cpu``."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _init_weights(model: DLRM, generator: torch.Generator) -> None:
    """Deterministic init from ``generator``.

    He-uniform weights and zero biases for the ReLU layers, uniform(+-1/sqrt(dim)) embeddings,
    and a small last layer with bias -1, so untrained scores spread inside (0.05, 0.95)
    instead of all sitting at 0.5 or saturating at exactly 0 or 1 in float32.
    """
    last = model.top[-1]
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                gain = 1.0 if module is last else math.sqrt(6.0)
                bound = gain / math.sqrt(module.in_features)
                module.weight.uniform_(-bound, bound, generator=generator)
                module.bias.fill_(-1.0 if module is last else 0.0)
            elif isinstance(module, nn.EmbeddingBag):
                bound = 1.0 / math.sqrt(module.embedding_dim)
                module.weight.uniform_(-bound, bound, generator=generator)


def build_model(
    config: DLRMConfig | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> DLRM:
    """Build a DLRM with deterministic random weights, in eval mode, on ``device``.

    Weights depend only on ``config`` and ``seed`` (drawn on CPU, then moved), not on the
    device or on torch's global RNG, which is left untouched. ``device`` None means
    ``pick_device()``. Nothing is downloaded. Wrap calls in ``torch.inference_mode()``.
    """
    config = config or DLRMConfig()
    with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG
        model = DLRM(config)
    _init_weights(model, torch.Generator().manual_seed(seed))
    return model.to(device if device is not None else pick_device()).eval()


def pack_sparse(
    ids: Sequence[Sequence[Sequence[int]]],
    num_sparse: int,
    device: torch.device | str | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Convert nested ids ``ids[candidate][feature] -> list of ids`` to EmbeddingBag inputs.

    Returns ``(flat_ids, offsets)``: per feature, int64 [total_ids_f] and int64 [batch].
    Raises ValueError if a candidate does not have exactly ``num_sparse`` features.
    """
    flat: list[list[int]] = [[] for _ in range(num_sparse)]
    offsets: list[list[int]] = [[] for _ in range(num_sparse)]
    for c, features in enumerate(ids):
        if len(features) != num_sparse:
            raise ValueError(f"candidate {c}: expected {num_sparse} sparse features, got {len(features)}")
        for f, feature_ids in enumerate(features):
            offsets[f].append(len(flat[f]))
            flat[f].extend(feature_ids)
    return (
        [torch.tensor(v, dtype=torch.int64, device=device) for v in flat],
        [torch.tensor(v, dtype=torch.int64, device=device) for v in offsets],
    )
