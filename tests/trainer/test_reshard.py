"""--resume with another trainer DP size: a DP=1 checkpoint loads into a DP=2 pool with the same weights, the same
optimizer state, and the next step lands where the uninterrupted DP=1 run lands."""
from __future__ import annotations

import pytest
import ray
import torch

from _spawn import algo_cfg, make_batch, trainer_cfg
from gspo_ray.trainer.pool import TrainerPool


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_dp1_checkpoint_resumes_on_dp2(local_ray, tiny_moe_dir, tmp_path):
    batch = make_batch(8)
    one = TrainerPool(tiny_moe_dir, trainer_cfg(1, micro_batch_size=4), algo_cfg())
    try:
        batch.old_logp = one.compute_logprobs(batch)
        one.train_step(batch)
        one.save(tmp_path / "ckpt")
        saved_logp = one.compute_logprobs(batch)
        one.train_step(batch)                       # the uninterrupted run's next step
        expected_next = one.compute_logprobs(batch)
    finally:
        one.shutdown()

    two = TrainerPool(tiny_moe_dir, trainer_cfg(2, micro_batch_size=4, num_cpus_per_worker=1), algo_cfg())
    try:
        assert two.load(tmp_path / "ckpt") == 1
        # same weights -> same log-probs, on a DP=2 pool
        assert torch.allclose(two.compute_logprobs(batch), saved_logp, atol=1e-6, rtol=0)
        two.train_step(batch)                       # Adam moments came along: the step matches DP=1's
        assert two.version() == 2
        assert (two.compute_logprobs(batch) - expected_next).abs().max() <= 1e-5
    finally:
        two.shutdown()
