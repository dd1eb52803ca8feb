"""A non-finite loss or gradient skips the optimizer step on the real Megatron trainer: weights, optimizer state,
LR schedule and policy version stay as they were, `train/skipped_steps` counts it, and `trainer.max_skipped_steps`
skips in a row stop training with a clear error. Also: Dr.GRPO refuses to run without a constant norm_len.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg, with_old_logp


def _weights(w) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in w.gpt.named_parameters()}


def _scenario(rank, world_size, ports, model_dir, batch):
    from gspo_ray.trainer.optim import NonFiniteStepsError
    from gspo_ray.trainer.worker import TrainerWorker

    out = {}
    try:  # checked before any process group exists
        TrainerWorker(0, 1, "127.0.0.1", ports[0], model_dir, trainer_cfg(1),
                      algo_cfg(importance_sampling_level="token", aggregation="seq-mean-token-sum-norm"))
    except ValueError as e:
        out["norm_len_error"] = str(e)
    w = TrainerWorker(0, 1, "127.0.0.1", ports[0], model_dir, trainer_cfg(1, max_skipped_steps=2), algo_cfg())
    batch = with_old_logp(batch, w.compute_logprobs(batch))
    poisoned = dataclasses.replace(batch, adv=batch.adv.clone())
    poisoned.adv[3] = float("nan")  # one completion's advantage (a reward that returned NaN)
    before, lr_steps = _weights(w), w.scheduler.num_steps
    out["nan"] = w.train_step(poisoned)
    out["unchanged"] = all(torch.equal(before[n], p) for n, p in w.gpt.named_parameters())
    out["version_after_nan"], out["lr_steps_moved"] = w.version(), w.scheduler.num_steps - lr_steps
    out["good"] = w.train_step(batch)  # a finite step after a skip trains normally
    out["moved"] = max(float((before[n] - p).abs().max()) for n, p in w.gpt.named_parameters())
    out["again"] = w.train_step(poisoned)  # 1 in a row: skipped
    try:
        w.train_step(poisoned)  # 2 in a row: max_skipped_steps reached
    except NonFiniteStepsError as e:
        out["error"] = str(e)
    out["final_version"] = w.version()
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def run(tiny_moe_dir):
    return run_ranks(_scenario, 1, (str(tiny_moe_dir), make_batch(8)))[0]


def test_nan_step_is_skipped_and_keeps_weights_and_version(run):
    m = run["nan"]
    assert m["train/step_ok"] == 0.0 and m["train/skipped_steps"] == 1.0
    assert run["unchanged"], "a skipped step must leave every parameter bit-identical"
    assert run["version_after_nan"] == 0 and m["train/policy_version"] == 0.0
    assert run["lr_steps_moved"] == 0  # the LR schedule did not advance either


def test_finite_step_after_a_skip_trains_and_bumps_the_version(run):
    good = run["good"]
    assert good["train/step_ok"] == 1.0 and good["train/policy_version"] == 1.0
    assert good["train/skipped_steps"] == 1.0  # the running count stays in the metrics
    assert run["moved"] > 0


def test_consecutive_non_finite_steps_stop_with_a_clear_error(run):
    assert run["again"]["train/step_ok"] == 0.0 and run["again"]["train/skipped_steps"] == 2.0
    assert "2 optimizer steps in a row" in run["error"] and "trainer.max_skipped_steps=2" in run["error"]
    assert run["final_version"] == 1


def test_dr_grpo_needs_a_constant_norm_len(run):
    assert "algorithm.norm_len" in run["norm_len_error"]


def test_all_finite_is_exact_when_the_sum_overflows_or_cancels():
    """The gradient check reads one sum per buffer and looks at every element only when that sum is not finite."""
    from gspo_ray.trainer.optim import all_finite

    g = torch.randn(1000)
    assert all_finite(g)
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = g.clone()
        poisoned[17] = bad
        assert not all_finite(poisoned), bad
    both = g.clone()
    both[1], both[2] = float("inf"), float("-inf")  # their sum is NaN, still caught
    assert not all_finite(both)
    huge = torch.full((4,), 3e38)  # every element finite, the fp32 sum overflows to inf
    assert not bool(torch.isfinite(huge.sum())) and all_finite(huge)
