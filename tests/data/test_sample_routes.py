"""Sample.routes (R3): packed routes survive JSON (a checkpoint's open groups), collate lays them out per
position with each token's version, and a batch cut into micro-batches keeps them."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gspo_ray.coordinator.partial_carry import group_from_dict, group_to_dict
from gspo_ray.data.records import Prompt, Sample, collate, pack_routes, unpack_routes
from gspo_ray.trainer.batch_layout import micro_batches


def _sample(p: int, c: int, seed: int, versions=None) -> Sample:
    rng = np.random.default_rng(seed)
    routes = rng.integers(0, 8, (p + c, 2, 2)).astype(np.int16)
    routes[-1] = -1
    return Sample(prompt_uid=f"u{seed}", sample_index=0, prompt_ids=[2] * p, completion_ids=[3] * c,
                  logprobs=[-1.0] * c, loss_mask=[1] * c, versions=versions or [0] * c, finish_reason="aborted",
                  routes=pack_routes(routes))


def test_routes_survive_a_json_round_trip():
    s = _sample(3, 4, 0)
    back = group_from_dict(json.loads(json.dumps(group_to_dict(Prompt(uid="u0", prompt_ids=[2, 2, 2]), [s]))))[1][0]
    np.testing.assert_array_equal(unpack_routes(back.routes), unpack_routes(s.routes))


def test_routes_must_cover_prompt_and_completion():
    s = _sample(3, 4, 0)
    with pytest.raises(ValueError, match="routes covers 7 positions"):
        Sample(**{**s.__dict__, "completion_ids": [3] * 5, "logprobs": [0.0] * 5, "loss_mask": [1] * 5,
                  "versions": [0] * 5})


def test_collate_and_micro_batches_keep_routes_and_versions():
    a, b = _sample(3, 4, 1, versions=[5, 5, 6, 6]), _sample(2, 2, 2, versions=[7, 7])
    batch = collate([a, b], [[1.0] * 4, [1.0] * 2])
    assert batch.routes.shape == (2, 7, 2, 2) and batch.routes.dtype == torch.int16
    assert torch.equal(batch.routes[0], torch.from_numpy(unpack_routes(a.routes)))
    assert torch.equal(batch.routes[1, :4], torch.from_numpy(unpack_routes(b.routes))) and (batch.routes[1, 4:] == -1).all()
    assert batch.versions.tolist() == [[-1, -1, -1, 5, 5, 6, 6], [-1, -1, 7, 7, -1, -1, -1]]
    mb = micro_batches(batch, 1)[1]  # trimmed to its own length
    assert mb.routes.shape == (1, 4, 2, 2) and mb.versions.tolist() == [[-1, -1, 7, 7]]
    assert collate([Sample(**{**a.__dict__, "routes": None})], [[1.0] * 4]).routes is None
