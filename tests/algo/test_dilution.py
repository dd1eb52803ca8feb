"""Dilution detector (seed 000 §6) and algorithm.dilution_mask, on a hand-built batch, through the real loss."""
import math

import pytest
import torch

from gspo_ray.algo import compute_policy_loss
from gspo_ray.algo.dilution import compute_dilution, dilution_keep
from tests.tolerance import assert_within_rounding

pytestmark = pytest.mark.isa  # make test-isa: floats summed by the CPU's kernels
F64 = torch.float64
EPS = (3e-4, 4e-4)
# log r_t = logp - old_logp per completion, threshold 0.2, band [1 - 3e-4, 1 + 4e-4]:
#   row 0: [0.3, -0.1, -0.1, -0.1]  mean 0      -> s = 1, A = +1: trains; |0.3| > 0.2      -> diluted (0.3)
#   row 1: [0.3,  0,    0,    0  ]  mean 0.075  -> s = 1.0779 > 1.0004, A = +1: clipped   -> not diluted
#   row 2: [0.01, -0.01, 0,   0  ]  mean 0      -> s = 1, trains; nothing above 0.2        -> not diluted
#   row 3: [0,    0,   -0.5, pad ]  mean -0.167 -> s = 0.846, A = +1: only A < 0 clips low -> diluted (0.5)
LOG_R = [[0.3, -0.1, -0.1, -0.1], [0.3, 0.0, 0.0, 0.0], [0.01, -0.01, 0.0, 0.0], [0.0, 0.0, -0.5, float("nan")]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)


def _batch():
    old = torch.full((4, 4), -1.0, dtype=F64)
    return old + torch.tensor(LOG_R, dtype=F64), old, torch.ones(4, dtype=F64)


def test_detector_hand_built():
    logp, old, adv = _batch()
    tok, seq, m = compute_dilution(logp, old, adv, MASK, *EPS, threshold=0.2)
    assert seq.tolist() == [True, False, False, True]
    assert tok[0].tolist() == [True, False, False, False] and tok[3].tolist() == [False, False, True, False]
    assert m["train/dilution_frac"] == 0.5                     # 2 of 4 completions
    assert m["train/dilution_max_abs_logr"] == pytest.approx(0.5)   # row 3's -0.5 (row 1's 0.3 was clipped)
    # the same rows with A = -1: row 3's s = 0.846 < 1 - 3e-4 now clips it (low side), row 1 (s > 1) trains
    tok, seq, m = compute_dilution(logp, old, -adv, MASK, *EPS, threshold=0.2)
    assert seq.tolist() == [True, True, False, False] and m["train/dilution_max_abs_logr"] == pytest.approx(0.3)
    # the seed's number: one token moving by 50% in 10,000 tokens moves s by e^(log 1.5 / 10^4) = 1.0000405
    assert round(math.exp(math.log(1.5) / 10_000), 7) == 1.0000405


def _grads(mode):
    """Row 0 alone (s = 1, A = +1) through the loss, with the mask mode applied."""
    logp, old, adv = _batch()
    logp = logp[:1].clone().requires_grad_()
    tok, seq, _ = compute_dilution(logp.detach(), old[:1], adv[:1], MASK[:1], *EPS, threshold=0.2)
    keep = dilution_keep(tok, seq, mode)
    loss, _ = compute_policy_loss(logp, old[:1], adv[:1], MASK[:1], "sequence", *EPS,
                                  pg_weight=None if keep is None else keep.to(F64))
    loss.backward()
    return loss.item(), logp.grad[0]


# The loss sums 4 token log-ratios of size <= 0.3 into a mean, then exp, then the mean over tokens: in float64 the
# exact -1 and -0.25 come out to the rounding of those 4-term sums of magnitude ~1 (tests/tolerance.py), and in
# another order on another host (-0.9999999999999999 on an AVX-512 host).
N_TOKENS, MAGNITUDE = 4, 1.0


def test_mask_modes_through_the_loss():
    # none: l_t = -s * A = -1 on 4 tokens; loss = -1; d loss / d logp_t = -(1/4) * s = -0.25 on each token
    loss, grads = _grads("none")
    assert_within_rounding(loss, -1.0, N_TOKENS, MAGNITUDE, F64, "loss")
    assert_within_rounding(grads, [-0.25] * 4, N_TOKENS, MAGNITUDE, F64, "gradient")
    # token: token 0 leaves s and the loss: s = exp(mean(-0.1, -0.1, -0.1)) = e^-0.1 = 0.904837, still in the band
    # for A > 0 (min(s, clip(s)) = s); loss = (3 * -0.904837 + 0) / 4 = -0.678628; grad 0 on token 0 and
    # -(3/4) * s / 3 = -s/4 = -0.22621 on tokens 1-3 (hand values to 6 and 5 decimals: compared at those digits)
    loss, grads = _grads("token")
    assert loss == pytest.approx(-0.678628, abs=5e-7)
    assert grads[0] == 0.0 and grads[1:].tolist() == pytest.approx([-0.22621] * 3, abs=5e-6)
    # sequence: the whole completion leaves the policy-gradient term: loss 0, no gradient (exactly: masked)
    loss, grads = _grads("sequence")
    assert loss == 0.0 and torch.equal(grads, torch.zeros(4, dtype=F64))


def test_unknown_mask_mode():
    tok = torch.zeros(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="valid: none, token, sequence"):
        dilution_keep(tok, tok[:, 0], "all")
