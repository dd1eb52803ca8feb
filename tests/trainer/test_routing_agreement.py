"""Routing agreement by version lag (trainer/routing/agreement.py), pure tensors: 1.0 when nothing changed, lower
when only the router moved, each lag bucket counted apart, unrecorded positions never compared."""
from __future__ import annotations

import torch

from gspo_ray.trainer.routing.agreement import agreement_counts, metrics_from_counts, position_lags


def _topk(x, w, k=2):
    return torch.topk(x @ w.T, k, dim=-1).indices


def test_one_when_nothing_changed_and_lower_when_only_the_router_moved():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(200, 16, generator=g), torch.randn(8, 16, generator=g)
    sampled = _topk(x, w)
    lag = torch.tensor([0, 1, 2, 5] * 50)
    same = metrics_from_counts(agreement_counts(_topk(x, w), sampled.flip(-1), lag)[None])  # order ignored
    assert {k: v for k, v in same.items() if "hits" not in k} == {
        "moe/route_agree_lag0": 1.0, "moe/route_agree_tokens_lag0": 50.0,
        "moe/route_agree_lag1": 1.0, "moe/route_agree_tokens_lag1": 50.0,
        "moe/route_agree_lag2p": 1.0, "moe/route_agree_tokens_lag2p": 100.0}
    assert same["moe/route_agree_hits_lag2p"] == 100.0
    moved = metrics_from_counts(agreement_counts(_topk(x, w + 0.5 * torch.randn(8, 16, generator=g)), sampled,
                                                 lag)[None])
    assert all(moved[f"moe/route_agree_{b}"] < 0.9 for b in ("lag0", "lag1", "lag2p"))


def test_buckets_and_unrecorded_positions():
    trainer = torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3]])
    sampled = torch.tensor([[1, 0], [0, 2], [-1, -1], [3, 2]])
    counts = agreement_counts(trainer, sampled, torch.tensor([0, 1, 1, 3]))
    assert counts.tolist() == [[1, 1], [0, 1], [1, 1]]  # the unrecorded row is not counted


def test_position_lags_point_at_the_forward_that_drew_each_token():
    versions = torch.tensor([[-1, -1, 3, 3, 4, -1]])  # prompt of 2, three tokens from versions 3, 3, 4, padding
    assert position_lags(versions, 5).tolist() == [[-1, 2, 2, 1, -1, -1]]
