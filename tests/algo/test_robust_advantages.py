"""advantage.robust: none | clip | rank on seed 002 §5's outlier group (one looping transcript scoring -200).

Golden numbers by hand in the comments; A_i = (R'_i - mean R') / (std(R', ddof=1) + 1e-4) after each transform.
"""
import pytest
import torch

from gspo_ray.algo.robust_advantages import (
    ROBUST_MODES,
    compute_robust_group_advantages,
    rank_group_rewards,
    winsorize_group_rewards,
)

F64 = torch.float64
# The seed's case: 7 transcripts at 1.0, one looping one at -200.
SEED_GROUP = torch.tensor([[1.0] * 7 + [-200.0]], dtype=F64)
# The seed's complaint made concrete: "fully right and three characters wrong get almost the same score".
SPREAD_GROUP = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.9, 0.9, 0.8, -200.0]], dtype=F64)


def _adv(rewards, robust):
    adv, zero_var = compute_robust_group_advantages(rewards, robust)
    return [round(a, 3) + 0.0 for a in adv[0].tolist()], bool(zero_var[0])


def test_seed_outlier_group():
    # none: -7/sqrt(8) = -2.475 for the outlier, +1/sqrt(8) = +0.354 for the rest (the seed's numbers)
    assert _adv(SEED_GROUP, "none") == ([0.354] * 7 + [-2.475], False)
    # rank: ranks [5]*7 + [1] (ties 2..8 share 5); mean 4.5; deviations +0.5 / -3.5; SS = 7*0.25 + 12.25 = 14;
    # std = sqrt(14/7) = 1.41421 -> +0.5/1.41431 = +0.354, -3.5/1.41431 = -2.475: one outlier among equals is
    # already "one place lower", so rank changes nothing here
    assert _adv(SEED_GROUP, "rank") == ([0.354] * 7 + [-2.475], False)
    # clip (q = 0.1): Q_0.1 rounded inwards = sorted[ceil(0.1 * 7)] = sorted[1] = 1.0, so -200 -> 1.0; all equal:
    # A = 0 and the group is flagged (no signal left; the coordinator filters it)
    assert _adv(SEED_GROUP, "clip") == ([0.0] * 8, True)


def test_spread_group_each_option():
    # none: mean = (4 + 1.8 + 0.8 - 200) / 8 = -24.175, std = 71.04 (dominated by -200):
    #   A(1.0) = 25.175/71.04 = 0.354, A(0.9) = 0.353, A(0.8) = 0.352 -> right and wrong look alike
    adv, _ = compute_robust_group_advantages(SPREAD_GROUP, "none")
    assert adv[0, 0] - adv[0, 6] < 0.004  # 1.0 vs 0.8: 0.003 apart
    assert round(adv[0, 7].item(), 3) == -2.475
    # clip: bounds sorted[1] = 0.8 and sorted[6] = 1.0 -> R' = [1, 1, 1, 1, .9, .9, .8, .8]; mean 0.925;
    #   SS = 4 * 0.075^2 + 2 * 0.025^2 + 2 * 0.125^2 = 0.055; std = sqrt(0.055 / 7) = 0.088641
    #   A = 0.075 / 0.088741 = 0.845; -0.025 / 0.088741 = -0.282; -0.125 / 0.088741 = -1.409 (0.8 and -200 alike)
    assert _adv(SPREAD_GROUP, "clip") == ([0.845] * 4 + [-0.282] * 2 + [-1.409] * 2, False)
    # rank: ranks [6.5]*4 + [3.5]*2 + [2, 1]; mean 4.5; SS = 4*4 + 2*1 + 6.25 + 12.25 = 36.5;
    #   std = sqrt(36.5 / 7) = 2.28348 -> 2/2.28358 = 0.876, -1/.. = -0.438, -2.5/.. = -1.095, -3.5/.. = -1.533
    assert _adv(SPREAD_GROUP, "rank") == ([0.876] * 4 + [-0.438] * 2 + [-1.095, -1.533], False)


def test_transforms_by_hand():
    assert winsorize_group_rewards(SPREAD_GROUP, 0.1)[0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.9, 0.9, 0.8, 0.8]
    assert winsorize_group_rewards(SPREAD_GROUP, 0.0)[0].tolist() == SPREAD_GROUP[0].tolist()  # q = 0: no-op
    assert rank_group_rewards(SPREAD_GROUP)[0].tolist() == [6.5] * 4 + [3.5] * 2 + [2.0, 1.0]
    # several groups at once, each ranked on its own
    two = torch.tensor([[3.0, 1.0, 2.0], [0.0, 0.0, 5.0]])
    assert rank_group_rewards(two).tolist() == [[3.0, 1.0, 2.0], [1.5, 1.5, 3.0]]


@pytest.mark.parametrize("robust", ROBUST_MODES)
def test_all_equal_group_stays_zero_and_flagged(robust):
    adv, zero_var = compute_robust_group_advantages(torch.ones(1, 8), robust)
    assert zero_var.tolist() == [True] and torch.equal(adv, torch.zeros(1, 8))


def test_unknown_mode_and_bad_quantile():
    with pytest.raises(ValueError, match="valid: none, clip, rank"):
        compute_robust_group_advantages(SEED_GROUP, "median")
    with pytest.raises(ValueError, match="clip quantile"):
        winsorize_group_rewards(SEED_GROUP, 0.5)
