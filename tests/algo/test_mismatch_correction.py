"""TIS / MIS / IcePop weights rho = pi_old(trainer) / pi_engine at token, sequence and geometric-mean levels, and
their effect on the loss's gradient. Golden numbers by hand in the comments."""
import math

import pytest
import torch

from gspo_ray.algo import compute_policy_loss
from gspo_ray.algo.mismatch_correction import compute_mismatch_weights

F64 = torch.float64
# rho_t per token; row 1 is padded at its last position (nan there must not matter)
RHO = [[3.0, 0.4, 1.0], [3.0, 1.0, float("nan")]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def _weights(level, mode, lower=0.5, upper=2.0):
    rollout = torch.full((2, 3), -1.0, dtype=F64)
    old = rollout + torch.log(torch.tensor(RHO, dtype=F64))
    w, m = compute_mismatch_weights(old, rollout, MASK, level, mode, lower, upper)
    return [[round(x, 4) + 0.0 for x in row] for row in w.tolist()], m


# row 0: rho_t = [3, 0.4, 1]: product 1.2, geometric mean 1.2^(1/3) = 1.0627
# row 1: rho_t = [3, 1]:      product 3,   geometric mean sqrt(3) = 1.7321
EXPECTED = {
    ("token", "truncate"): [[2.0, 0.4, 1.0], [2.0, 1.0, 0.0]],        # min(rho_t, 2)
    ("token", "mask"): [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]],            # 3 > 2 and 0.4 < 0.5 are dropped
    ("sequence", "truncate"): [[1.2] * 3, [2.0, 2.0, 0.0]],           # min(1.2, 2), min(3, 2)
    ("sequence", "mask"): [[1.2] * 3, [0.0, 0.0, 0.0]],               # 3 > 2: the whole row 1 is dropped
    ("geometric", "truncate"): [[1.0627] * 3, [1.7321, 1.7321, 0.0]],
    ("geometric", "mask"): [[1.0627] * 3, [1.7321, 1.7321, 0.0]],     # both inside [0.5, 2]
}


@pytest.mark.parametrize("level,mode", list(EXPECTED))
def test_weights_by_hand(level, mode):
    w, m = _weights(level, mode)
    assert w == EXPECTED[(level, mode)]
    assert round(1.2 ** (1 / 3), 4) == 1.0627 and round(math.sqrt(3), 4) == 1.7321
    # weight mean over the 5 trained tokens
    assert m["train/is_weight_mean"] == pytest.approx(sum(map(sum, EXPECTED[(level, mode)])) / 5, abs=1e-4)


def test_metrics_show_the_effect():
    _, m = _weights("token", "truncate")
    assert m["train/is_truncated_frac_tok"] == pytest.approx(2 / 5)  # the two 3.0 tokens
    assert m["train/is_rho_max"] == pytest.approx(3.0) and m["train/is_rho_min"] == pytest.approx(0.4)
    _, m = _weights("token", "mask")
    assert m["train/is_masked_frac_tok"] == pytest.approx(3 / 5) and m["train/is_masked_frac_seq"] == 1.0
    _, m = _weights("sequence", "mask")
    assert m["train/is_masked_frac_tok"] == pytest.approx(2 / 5) and m["train/is_masked_frac_seq"] == 0.5


def test_weights_scale_the_gradient():
    # GRPO token level, logp = old_logp (ratio 1), A = +1, one completion of 3 tokens, token-mean of 3:
    #   l_t = -w_t * r_t * A -> d loss / d logp_t = -w_t / 3; TIS weights [2, 0.4, 1] -> [-0.6667, -0.1333, -0.3333]
    w, _ = _weights("token", "truncate")
    old = torch.full((1, 3), -1.0, dtype=F64)
    logp = old.clone().requires_grad_()
    loss, _ = compute_policy_loss(logp, old, torch.ones(1, dtype=F64), MASK[:1], "token", 0.2, 0.27,
                                  pg_weight=torch.tensor(w[:1], dtype=F64))
    loss.backward()
    assert [round(g, 4) for g in logp.grad[0].tolist()] == [-0.6667, -0.1333, -0.3333]
    assert round(loss.item(), 4) == round(-(2 + 0.4 + 1) / 3, 4)


def test_bad_arguments():
    z = torch.zeros(1, 2)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="valid: token, sequence, geometric"):
        compute_mismatch_weights(z, z, m, "batch", "truncate", 0.5, 2.0)
    with pytest.raises(ValueError, match="valid: truncate, mask"):
        compute_mismatch_weights(z, z, m, "token", "clip", 0.5, 2.0)
    with pytest.raises(ValueError, match="lower < 1 < upper"):
        compute_mismatch_weights(z, z, m, "token", "mask", 0.5, 0.9)


def test_a_dropped_completion_is_neither_clipped_nor_unclipped():
    # GSPO, band [0.8, 1.27], A = +1 on both completions of 2 tokens. Row 0: log r_t = 0.5, s = e^0.5 = 1.6487 >
    # 1.27 -> clipped high. Row 1: log r_t = -1, but its weight is 0 (MIS dropped it): no loss, no s. Counted as
    # unclipped it would halve the clip fraction (0.5) and put its empty-row s = e^0 = 1 into ratio_min.
    old = torch.full((2, 2), -1.0, dtype=F64)
    logp = old + torch.tensor([[0.5, 0.5], [-1.0, -1.0]], dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    weight = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64)
    _, m = compute_policy_loss(logp, old, torch.ones(2, dtype=F64), mask, "sequence", 0.2, 0.27, pg_weight=weight)
    assert m["train/clip_frac_seq"] == 1.0 and m["train/clip_frac_tok_high"] == 1.0
    assert m["train/ratio_min"] == pytest.approx(math.exp(0.5)) == m["train/ratio_max"]
    assert (m["train/n_kept_tokens"], m["train/n_kept_seqs"], m["train/n_tokens"]) == (2, 1, 4)


def test_the_trainer_weighs_clip_metrics_by_kept_tokens():
    from gspo_ray.trainer.metric_accumulator import MetricAccumulator

    acc = MetricAccumulator(per_sequence_ratio=True)
    # micro-batch 1: 10 tokens, 4 kept, clip_frac_tok 0.5 (2 tokens); micro-batch 2: 10 tokens, 10 kept, 0.1
    # (1 token) -> 3 / 14 by kept tokens (by all tokens: 0.3). Micro-batch 3 kept nothing: its ratio_min of 0
    # (an empty selection) is not a ratio.
    acc.add({"train/clip_frac_tok": 0.5, "train/ratio_min": 1.1, "train/n_kept_tokens": 4, "train/n_kept_seqs": 1},
            n_tok=10, n_seq=2, n_units=2)
    acc.add({"train/clip_frac_tok": 0.1, "train/ratio_min": 0.9, "train/n_kept_tokens": 10,
             "train/n_kept_seqs": 2}, n_tok=10, n_seq=2, n_units=2)
    acc.add({"train/clip_frac_tok": 0.0, "train/ratio_min": 0.0, "train/n_kept_tokens": 0, "train/n_kept_seqs": 0},
            n_tok=10, n_seq=2, n_units=2)
    out = acc.reduce()
    assert out["train/clip_frac_tok"] == pytest.approx(3 / 14) and out["train/ratio_min"] == 0.9
    assert out["train/n_kept_tokens"] == 14
    nothing = MetricAccumulator(per_sequence_ratio=True)  # no micro-batch kept a token: the keys stay, at 0
    nothing.add({"train/clip_frac_seq": 0.0, "train/ratio_min": 0.0, "train/ratio_max": 0.0,
                 "train/n_kept_tokens": 0, "train/n_kept_seqs": 0}, n_tok=10, n_seq=2, n_units=2)
    assert {k: v for k, v in nothing.reduce().items() if "ratio" in k or "clip" in k} == \
        {"train/clip_frac_seq": 0.0, "train/ratio_min": 0.0, "train/ratio_max": 0.0}
