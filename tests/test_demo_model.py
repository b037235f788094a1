"""The DLRM demo model: config validation, shapes, sparse input forms, deterministic weights."""

from __future__ import annotations

import pytest
import torch

from zoomer_serve.demo.model import DLRM, DLRMConfig, build_model, pack_sparse, pick_device

SMALL = DLRMConfig(num_dense=4, table_sizes=(50, 20, 7), embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,))


def _inputs(config: DLRMConfig, batch: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, config.num_dense, generator=g)
    ids = [torch.randint(0, n, (batch,), generator=g) for n in config.table_sizes]
    return dense, ids


def test_default_config_shape() -> None:
    cfg = DLRMConfig()
    assert cfg.num_sparse == len(cfg.table_sizes)
    assert cfg.num_interactions == (cfg.num_sparse + 1) * cfg.num_sparse // 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_dense": 0},
        {"table_sizes": ()},
        {"table_sizes": (10, 0)},
        {"embedding_dim": 0},
        {"top_mlp": (8, -1)},
    ],
)
def test_config_rejects_bad_sizes(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DLRMConfig(**kwargs)


def test_forward_shape_dtype_and_range() -> None:
    model = build_model(SMALL, device="cpu")
    dense, ids = _inputs(SMALL, 5)
    with torch.inference_mode():
        scores = model(dense, ids)
    assert scores.shape == (5,)
    assert scores.dtype == torch.float32
    assert bool(((scores > 0) & (scores < 1)).all())
    assert not model.training


def test_default_model_scores_64_candidates() -> None:
    model = build_model(device="cpu")
    dense, ids = _inputs(model.config, 64)
    with torch.inference_mode():
        scores = model(dense, ids)
    assert scores.shape == (64,)
    assert bool(((scores > 0) & (scores < 1)).all())
    assert float(scores.std()) > 1e-3  # untrained but not constant


def test_weights_depend_only_on_seed_and_leave_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_model(SMALL, device="cpu", seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_model(SMALL, device="cpu", seed=7)
    c = build_model(SMALL, device="cpu", seed=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.state_dict()["tables.0.weight"], c.state_dict()["tables.0.weight"])


def test_same_input_same_scores() -> None:
    model = build_model(SMALL, device="cpu")
    dense, ids = _inputs(SMALL, 9)
    with torch.inference_mode():
        assert torch.equal(model(dense, ids), model(dense, ids))


@pytest.mark.slow
def test_sparse_input_forms_agree() -> None:
    model = build_model(SMALL, device="cpu")
    dense, ids = _inputs(SMALL, 6)
    flat, offsets = pack_sparse([[[int(t[i])] for t in ids] for i in range(6)], SMALL.num_sparse)
    with torch.inference_mode():
        one_d = model(dense, ids)
        two_d = model(dense, [t.unsqueeze(1) for t in ids])
        packed = model(dense, flat, offsets)
    torch.testing.assert_close(one_d, two_d)
    torch.testing.assert_close(one_d, packed)


def test_multi_hot_ids_are_summed() -> None:
    model = build_model(SMALL, device="cpu")
    dense, _ = _inputs(SMALL, 2)
    nested = [[[1, 2], [3], [4, 5, 6]], [[7], [8, 9], [0]]]
    flat, offsets = pack_sparse(nested, SMALL.num_sparse)
    assert [t.tolist() for t in offsets] == [[0, 2], [0, 1], [0, 3]]
    assert flat[2].tolist() == [4, 5, 6, 0]
    table = model.tables[0]
    assert isinstance(table, torch.nn.EmbeddingBag)
    with torch.inference_mode():
        scores = model(dense, flat, offsets)
        bag = table(flat[0], offsets[0])
    assert scores.shape == (2,)
    torch.testing.assert_close(bag[0], table.weight[1] + table.weight[2])


def test_pack_sparse_rejects_wrong_feature_count() -> None:
    with pytest.raises(ValueError, match="candidate 1: expected 3 sparse features, got 2"):
        pack_sparse([[[1], [2], [3]], [[1], [2]]], 3)


def test_forward_rejects_wrong_shapes() -> None:
    model = DLRM(SMALL).eval()
    dense, ids = _inputs(SMALL, 3)
    with pytest.raises(ValueError, match=r"dense must be \[batch, 4\]"):
        model(dense[:, :3], ids)
    with pytest.raises(ValueError, match="expected 3 sparse id tensors, got 2"):
        model(dense, ids[:2])


def test_pick_device_matches_cuda_availability() -> None:
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
