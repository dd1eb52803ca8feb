"""KL estimators, advantage variants (GRPO, Dr.GRPO, ragged groups, per-token) and metric helpers."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gspo_ray.algo import (
    KL_ESTIMATORS,
    broadcast_sequence_advantages,
    compute_group_advantages,
    compute_group_advantages_flat,
    compute_kl,
    compute_mismatch_metrics,
    compute_policy_loss,
    compute_ratio_metrics,
    compute_token_advantages,
    compute_turn_ids,
    compute_turn_token_advantages,
)

F64 = torch.float64
finite = st.floats(-30, 0, allow_nan=False, allow_infinity=False)


# ---------------------------------------------------------------- KL
@settings(max_examples=60, deadline=None)
@given(logp=finite, ref_logp=finite)
@example(logp=-7.513346844940941e-17, ref_logp=0.0)  # exp(x) - x - 1 rounded to -1.1e-16 here
def test_k2_k3_non_negative(logp, ref_logp):
    x, r = torch.tensor([logp], dtype=F64), torch.tensor([ref_logp], dtype=F64)
    assert compute_kl(x, r, "k3").item() >= 0  # exp(x) >= 1 + x
    assert compute_kl(x, r, "k2").item() >= 0


@pytest.mark.parametrize("estimator", list(KL_ESTIMATORS))
def test_kl_zero_at_equality(estimator):
    x = torch.log(torch.tensor([[0.1, 0.5, 0.99]], dtype=F64))
    assert torch.equal(compute_kl(x, x.clone(), estimator), torch.zeros_like(x))


@pytest.mark.parametrize("estimator,expected", [
    # pi = 0.5, pi_ref = 0.25: x = log(pi_ref / pi) = log 0.5 = -0.693147
    ("k1", 0.693147),   # -x
    ("k2", 0.240227),   # x^2 / 2 = 0.480453 / 2
    ("k3", 0.193147),   # exp(x) - x - 1 = 0.5 + 0.693147 - 1
])
def test_kl_hand_values(estimator, expected):
    kl = compute_kl(torch.tensor([math.log(0.5)], dtype=F64), torch.tensor([math.log(0.25)], dtype=F64), estimator)
    assert kl.item() == pytest.approx(expected, abs=1e-6)


def test_unknown_kl_estimator_lists_valid():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        compute_kl(torch.zeros(1), torch.zeros(1), "k9")


def test_kl_term_in_loss():
    # ratio 1 and A = 0, so the loss is beta * mean(k3) only: 0.1 * 0.193147 = 0.0193147
    logp = torch.full((1, 2), math.log(0.5), dtype=F64, requires_grad=True)
    ref = torch.full((1, 2), math.log(0.25), dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = compute_policy_loss(logp, logp.detach(), torch.zeros(1, dtype=F64), mask, "sequence", 3e-4, 4e-4,
                                  ref_logp=ref, beta=0.1)
    assert loss.item() == pytest.approx(0.0193147, abs=1e-7)
    assert m["train/kl"] == pytest.approx(0.193147, abs=1e-6)
    loss.backward()
    # d k3 / d logp = -exp(x) + 1 = 0.5; times beta / T = 0.1 / 2
    torch.testing.assert_close(logp.grad, torch.full((1, 2), 0.025, dtype=F64))


# ---------------------------------------------------------------- advantages
def test_dr_grpo_no_std_scaling():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]], dtype=F64)
    adv, zero_var = compute_group_advantages(rewards, scale_by_std=False)
    # group 0 mean 0.5 -> [0.5, -0.5, 0, 0]; group 1 all equal -> zeros, flagged
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, 0.0, 0.0], [0.0] * 4], dtype=F64))
    assert zero_var.tolist() == [False, True]


def test_group_advantages_reject_single_completion_groups():
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        compute_group_advantages(torch.ones(3, 1))


def test_flat_ragged_groups_by_hand():
    # group "a" [1, 0]: mean 0.5, std(ddof=1) = 0.70711 -> A = +-0.5 / 0.70721 = +-0.70701
    # group "b" [1, 2, 3]: mean 2, std 1 -> A = -1/1.0001, 0, +1/1.0001
    # group "c" [5]: a single survivor has no relative signal -> 0, flagged
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0, 3.0], dtype=F64)
    gids = torch.tensor([10, 20, 10, 20, 30, 20])  # any labels, any order
    adv, zero_var = compute_group_advantages_flat(rewards, gids)
    expected = [0.5 / (math.sqrt(0.5) + 1e-4), -1 / 1.0001, -0.5 / (math.sqrt(0.5) + 1e-4), 0.0, 0.0, 1 / 1.0001]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64))
    assert zero_var.tolist() == [False, False, False, False, True, False]
    assert round(adv[0].item(), 5) == 0.70701


@settings(max_examples=60, deadline=None)
@given(g=st.integers(1, 4), n=st.integers(2, 8), seed=st.integers(0, 2**31 - 1), scale=st.booleans(),
       discrete=st.booleans())
def test_flat_equals_grid_for_equal_groups(g, n, seed, scale, discrete):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(g, n, generator=gen, dtype=F64)
    if discrete:  # 0/1 rewards: zero-variance groups happen
        rewards = (rewards > 0).to(F64)
    adv, zero_var = compute_group_advantages(rewards, scale_by_std=scale)
    perm = torch.randperm(g * n, generator=gen)
    gids = torch.arange(g).repeat_interleave(n)
    flat, flat_zero = compute_group_advantages_flat(rewards.flatten()[perm], gids[perm], scale_by_std=scale)
    torch.testing.assert_close(flat, adv.flatten()[perm], rtol=1e-12, atol=1e-12)
    assert torch.equal(flat_zero, zero_var.repeat_interleave(n)[perm])
    assert torch.all(adv[zero_var] == 0)


def test_broadcast_sequence_advantages():
    mask = torch.tensor([[True, True, False], [False, True, True]])
    out = broadcast_sequence_advantages(torch.tensor([0.5, -2.0]), mask)
    assert out.tolist() == [[0.5, 0.5, 0.0], [0.0, -2.0, -2.0]]


def test_token_advantages_terminal_reward_by_hand():
    # one group, completions of 2 and 1 tokens, reward on the last token only (padding holds 9 and is ignored):
    # reward-to-go G = [[1, 1], [0.5]]; mean 5/6, std(ddof=1) = sqrt((2 * (1/6)^2 + (1/3)^2) / 2) = 0.288675
    # A = (1 - 5/6) / 0.288775 = +0.57715, (0.5 - 5/6) / 0.288775 = -1.15430
    rewards = torch.tensor([[0.0, 1.0], [0.5, 9.0]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    adv = compute_token_advantages(rewards, mask, torch.tensor([0, 0]))
    torch.testing.assert_close(adv, torch.tensor([[0.57715, 0.57715], [-1.15430, 0.0]], dtype=F64), atol=1e-5, rtol=0)


def test_token_advantages_process_reward():
    # process reward -1 on token 1 of completion 0: reward-to-go G_0 = [-1, -1, 0] (token 0 leads to the penalty
    # too), completion 1 all 0: G_1 = [0, 0, 0]
    # values {-1 x 2, 0 x 4}: mean -1/3, std(ddof=1) = sqrt((2 * 4/9 + 4 * 1/9) / 5) = sqrt(4/15) = 0.516398
    # A(-1) = (-2/3) / 0.516498 = -1.29074; A(0) = (1/3) / 0.516498 = +0.64537
    rewards = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = compute_token_advantages(rewards, mask, torch.tensor([7, 7]))
    a, b = 0.64537, -1.29074
    torch.testing.assert_close(adv, torch.tensor([[b, b, a], [a, a, a]], dtype=F64), atol=1e-5, rtol=0)
    # groups are separate: a second group with equal reward-to-go everywhere gets 0
    adv2 = compute_token_advantages(rewards, mask, torch.tensor([0, 1]))
    assert torch.all(adv2[1] == 0)


def test_turn_ids_follow_runs_of_model_tokens():
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1], [0, 1, 0, 0, 1, 0, 0]], dtype=torch.bool)
    assert compute_turn_ids(mask).tolist() == [[0, 0, -1, 1, -1, 2, 2], [-1, 0, -1, -1, 1, -1, -1]]


def test_turn_baseline_compares_the_same_turn_of_a_group_by_hand():
    # A guessing game, one group of 3 episodes; model turns are 2 tokens (digit, eos), env replies 1 token (mask 0);
    # a turn's reward lands on its eos: -0.05 a wrong guess, +1 the right one.
    #   ep0: wrong, right        token rewards [0, -.05, 0, 0, 1]      G turn0 = 0.95, turn1 = 1
    #   ep1: right               [0, 1]                                 G turn0 = 1
    #   ep2: wrong, wrong        [0, -.05, 0, 0, -.05, 0]               G turn0 = -0.1, turn1 = -0.05
    # turn 0 over {0.95, 1, -0.1}: mean 0.61667, std(ddof=1) = 0.62115; A = +0.53655, +0.61703, -1.15358
    # turn 1 over {1, -0.05}: mean 0.475, std 0.74246; A = +0.70701, -0.70701
    # The group-wide token baseline would rank ep0's first (good) turn below its second: G 0.95 < 1.
    r = torch.zeros(3, 6, dtype=F64)
    r[0, 1], r[0, 4], r[1, 1], r[2, 1], r[2, 4] = -0.05, 1.0, 1.0, -0.05, -0.05
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    adv = compute_turn_token_advantages(r, mask, torch.tensor([4, 4, 4]))
    a0, a1, a2, b0 = 0.53655, 0.61703, -1.15358, 0.70701
    want = torch.tensor([[a0, a0, 0, b0, b0, 0], [a1, a1, 0, 0, 0, 0], [a2, a2, 0, -b0, -b0, 0]], dtype=F64)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)
    # a turn reached by one episode only has nothing to compare with; separate groups never mix
    adv = compute_turn_token_advantages(r[:2], mask[:2], torch.tensor([0, 0]))
    assert torch.all(adv[0, 3:] == 0) and adv[0, 0] < 0 < adv[1, 0]  # 0.95 vs 1 on turn 0
    assert torch.all(compute_turn_token_advantages(r, mask, torch.tensor([0, 1, 2])) == 0)


# ---------------------------------------------------------------- metric helpers
def test_mismatch_metrics_by_hand():
    # row 0 diffs [0.1, -0.3] -> |.| mean over tokens; row mean -0.1 -> |.| 0.1; row 1 diff [0.2] -> 0.2
    trainer = torch.tensor([[0.1, -0.3, 5.0], [0.2, 0.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[0.0, 0.0, math.nan], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    m = compute_mismatch_metrics(trainer, rollout, mask)
    assert m["train/mismatch_tok_mean"] == pytest.approx((0.1 + 0.3 + 0.2) / 3)
    assert m["train/mismatch_tok_max"] == pytest.approx(0.3)
    assert m["train/mismatch_seq_mean"] == pytest.approx((0.1 + 0.2) / 2)
    assert m["train/mismatch_seq_max"] == pytest.approx(0.2)


def test_ratio_metrics_per_sequence_counts_completions_once():
    # s = 2 on a 3-token completion and 1 on a 1-token one: per completion mean 1.5 (per token it would be 1.75)
    w = torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert compute_ratio_metrics(w, mask, per_sequence=True) == pytest.approx(
        {"train/ratio_min": 1.0, "train/ratio_mean": 1.5, "train/ratio_max": 2.0})
    assert compute_ratio_metrics(w, mask, per_sequence=False)["train/ratio_mean"] == pytest.approx(1.75)
