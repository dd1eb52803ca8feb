"""Golden numbers from seeds/002_*.txt (ms-swift's three importance-sampling levels), through the real loss.

Effective gradient weight of token t (the seed's w_t): w_t = -T * dloss/dlogp_t, for one completion of T tokens
under the default seq-mean-token-mean aggregation; positive pushes p(y_t) up, negative pushes it down.
"""

import math

import pytest
import torch

from gspo_ray.algo import (
    IMPORTANCE_LEVELS,
    compute_group_advantages,
    compute_group_advantages_flat,
    compute_policy_loss,
)

F64 = torch.float64
OLD_P = [0.50, 0.90, 0.60, 0.95]  # "那 / 你是 / 说 / 结束符" under the sampling policy (seed §3)


def effective_weights(level, old_p, new_p, adv, eps=0.2):
    """Run compute_policy_loss on one completion; return (w_eff list, loss, metrics)."""
    old_logp = torch.log(torch.tensor([old_p], dtype=F64))
    logp = torch.log(torch.tensor([new_p], dtype=F64)).requires_grad_()
    adv = torch.tensor([adv], dtype=F64)  # [1] for one A per completion, [1, T] for per-token A
    mask = torch.ones_like(old_logp, dtype=torch.bool)
    loss, metrics = compute_policy_loss(logp, old_logp, adv, mask, level, eps_low=eps, eps_high=eps)
    loss.backward()
    w_eff = (-len(old_p) * logp.grad)[0].tolist()
    return w_eff, loss.item(), metrics


# ---------------------------------------------------------------- §1 group advantages
def test_group_advantage_real_group():
    # "他也会为了你去改变": 9 characters, reward = 1 - CER, so rewards are 1.000 or 0.889 (8/9, logged to 3 places).
    # The stated stats (mean 0.9723, sample std 0.0514) are reproduced by 6 x 1.000 + 2 x 0.889:
    #   mean = (6 + 1.778) / 8 = 0.97225;  SS = 6 * 0.02775^2 + 2 * 0.08325^2 = 0.018481;  std = sqrt(SS/7) = 0.05138
    #   A(1.000) = 0.02775 / (0.05138 + 1e-4) = +0.539;  A(0.889) = -0.08325 / 0.05148 = -1.617
    # (Re-dividing the *rounded* stats would give (0.889 - 0.9723) / 0.0514 = -1.621: the seed's -1.617 comes
    # from the unrounded ones, as here.)
    rewards = torch.tensor([[1.0] * 6 + [0.889] * 2], dtype=F64)
    assert abs(rewards.mean().item() - 0.9723) < 6e-5
    assert round(rewards.std(correction=1).item(), 4) == 0.0514
    adv, zero_var = compute_group_advantages(rewards)
    assert not zero_var.item()
    assert [round(a, 3) for a in adv[0].tolist()] == [0.539] * 6 + [-1.617] * 2


def test_group_advantage_all_equal_is_zero_and_flagged():
    # "底下有条评论我印象深刻": 8 identical correct transcripts, R = 1.0 each, std 0 -> all 8 A are 0.
    rewards = torch.full((1, 8), 1.0)
    adv, zero_var = compute_group_advantages(rewards)
    assert zero_var.tolist() == [True]
    assert torch.equal(adv, torch.zeros(1, 8))  # exactly 0, not float noise


@pytest.mark.parametrize("outlier", [-200.0, -50.0, -10.0])
def test_group_advantage_single_outlier(outlier):
    # 7 equal rewards and one outlier at distance d: mean shifts by d/8, std = d/sqrt(8), so
    #   A(outlier) = -(7d/8) / (d/sqrt(8)) = -7/sqrt(8) = -2.475
    #   A(others)  =   (d/8) / (d/sqrt(8)) = +1/sqrt(8) = +0.354
    # The +1e-4 in the denominator shrinks these by a relative 1e-4/std: invisible at 3 decimals once d >~ 3
    # (a looping transcript at -200 gives std ~ 71); see the next test for d = 1.
    rewards = torch.tensor([[1.0] * 7 + [outlier]], dtype=F64)
    adv, _ = compute_group_advantages(rewards)
    assert round(-7 / math.sqrt(8), 3) == -2.475 and round(1 / math.sqrt(8), 3) == 0.354
    assert [round(a, 3) for a in adv[0].tolist()] == [0.354] * 7 + [-2.475]
    flat, _ = compute_group_advantages_flat(rewards[0], torch.zeros(8, dtype=torch.long))
    torch.testing.assert_close(flat, adv[0])


def test_group_advantage_epsilon_visible_for_small_spread():
    # d = 1: std = 1/sqrt(8) = 0.35355; A(others) = 0.125 / (0.35355 + 1e-4) = 0.35345 -> 0.353, not 0.354
    adv, _ = compute_group_advantages(torch.tensor([[1.0] * 7 + [0.0]], dtype=F64))
    assert round(adv[0, 0].item(), 5) == 0.35345


# ---------------------------------------------------------------- §1.3 step 5: one dropout-perturbed token
def test_single_token_perturbation_barely_moves_s():
    # "也太坑了吧你们这节目", 8 positions; dropout moves p("也") 0.870 -> 0.905: r_0 = 1.040, others 1, so
    # s = 1.040^(1/8) = 1.005, far inside [0.8, 1.2]. log p_old("也") = log 0.870 = -0.139.
    old_p = [0.870, 0.988, 0.972, 0.938, 0.998, 0.983, 1.000, 1.000]
    new_p = [0.905] + old_p[1:]
    assert round(math.log(0.870), 3) == -0.139 and round(0.905 / 0.870, 3) == 1.040
    assert round(math.prod(old_p), 2) == 0.77  # probability of sampling exactly this path
    w, _, m = effective_weights("sequence", old_p, new_p, 1.0)
    assert round(m["train/ratio_mean"], 3) == 1.005
    assert m["train/clip_frac_seq"] == 0.0
    assert [round(x, 3) for x in w] == [1.005] * 8


# ---------------------------------------------------------------- §3 three scenarios, eps = 0.2
# S1: new 0.57/0.90/0.90/0.95 -> r = 1.14/1/1.5/1; s = (1.14*1.5)^(1/4) = 1.71^(1/4) = 1.1435; A = +1
#     token: "说" (1.5 > 1.2) clipped alone -> w = [1.14, 1, 0, 1]; sequence levels: 1.1435 < 1.2 -> all 1.1435
# S2 (table not in the seed text; built from its description "two tokens drift, geometric mean 1.225 > 1.2"):
#     new 0.75/0.90/0.90/0.95 -> r = 1.5/1/1.5/1; s = sqrt(1.5) = 1.2247; A = +1
#     token: "那" and "说" clipped -> w = [0, 1, 0, 1]; sequence levels: whole completion clipped -> all 0
# S3 (built from "A = -1, '那' below 0.8, sequence mean 0.915"):
#     new 0.35/0.90/0.60/0.95 -> r = 0.7/1/1/1; s = 0.7^(1/4) = 0.9147; A = -1
#     token: "那" (0.7 < 0.8, A < 0) clipped -> w = [0, -1, -1, -1]; sequence levels: 0.915 > 0.8 -> all -0.9147
S1 = dict(new_p=[0.57, 0.90, 0.90, 0.95], adv=1.0)
S2 = dict(new_p=[0.75, 0.90, 0.90, 0.95], adv=1.0)
S3 = dict(new_p=[0.35, 0.90, 0.60, 0.95], adv=-1.0)
S_SEQ = {"S1": 1.1435, "S2": 1.2247, "S3": 0.9147}
EXPECTED = {  # (scenario, level) -> (w_eff rounded to 4, clip_frac_tok)
    ("S1", "token"): ([1.14, 1.0, 0.0, 1.0], 0.25),
    ("S2", "token"): ([0.0, 1.0, 0.0, 1.0], 0.5),
    ("S3", "token"): ([0.0, -1.0, -1.0, -1.0], 0.25),
    ("S1", "sequence"): ([1.1435] * 4, 0.0),
    ("S2", "sequence"): ([0.0] * 4, 1.0),
    ("S3", "sequence"): ([-0.9147] * 4, 0.0),
}
for _s in ("S1", "S2", "S3"):  # GSPO-token: same numbers as GSPO when A is shared by the completion (seed §3 end)
    EXPECTED[(_s, "sequence_token")] = EXPECTED[(_s, "sequence")]


@pytest.mark.parametrize("level", list(IMPORTANCE_LEVELS))
@pytest.mark.parametrize("name,scenario", [("S1", S1), ("S2", S2), ("S3", S3)])
def test_three_scenarios(level, name, scenario):
    w, _, m = effective_weights(level, OLD_P, scenario["new_p"], scenario["adv"])
    expected_w, expected_clip = EXPECTED[(name, level)]
    assert [round(x, 4) + 0.0 for x in w] == expected_w
    assert m["train/clip_frac_tok"] == expected_clip
    if level != "token":
        assert round(m["train/ratio_mean"], 4) == S_SEQ[name]
        assert m["train/clip_frac_seq"] == expected_clip  # one s per completion: token and sequence fractions agree
    side = "high" if scenario["adv"] > 0 else "low"
    assert m[f"train/clip_frac_tok_{side}"] == expected_clip


def test_s1_loss_values():
    # token: -(1.14 + 1 + min(1.5, 1.2) + 1) / 4 = -4.34 / 4 = -1.085 ("说" enters the loss as 1.2 with 0 gradient)
    # sequence levels: -(4 * 1.1435) / 4 = -1.1435
    _, loss_tok, _ = effective_weights("token", OLD_P, **S1)
    _, loss_seq, _ = effective_weights("sequence", OLD_P, **S1)
    _, loss_st, _ = effective_weights("sequence_token", OLD_P, **S1)
    assert round(loss_tok, 4) == -1.085
    assert round(loss_seq, 4) == round(loss_st, 4) == -1.1435


# ---------------------------------------------------------------- §4 S4: per-token advantages
def test_s4_per_token_advantage_split():
    # S1 ratios, A_t = [1, 1, 0.2, 1] ("说" scored down alone):
    #   sequence: w_t = s * mean(A) = 1.1435 * 0.8 = 0.915 on every token (the 0.2 is averaged away)
    #   sequence_token: w_t = s * A_t = 1.144, 1.144, 0.229, 1.144
    #   totals agree: 0.915 * 4 = 3.66 = 1.144 * 3 + 0.229
    adv = [1.0, 1.0, 0.2, 1.0]
    w_seq, loss_seq, _ = effective_weights("sequence", OLD_P, S1["new_p"], adv)
    w_st, loss_st, _ = effective_weights("sequence_token", OLD_P, S1["new_p"], adv)
    assert [round(x, 3) for x in w_seq] == [0.915] * 4
    assert [round(x, 3) for x in w_st] == [1.144, 1.144, 0.229, 1.144]
    assert round(sum(w_seq), 2) == round(sum(w_st), 2) == 3.66
    assert loss_seq == pytest.approx(loss_st, abs=1e-12)  # same value, different gradient split
