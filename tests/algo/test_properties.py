"""Property tests of compute_policy_loss and aggregate over random batches (float64, hypothesis-driven seeds)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_ray.algo import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    KL_ESTIMATORS,
    LENGTH_WEIGHTED_AGGREGATIONS,
    aggregate,
    check_level_aggregation,
    compute_policy_loss,
)

F64 = torch.float64
SETTINGS = settings(max_examples=60, deadline=None)
EPS = st.sampled_from([(0.2, 0.28), (3e-4, 4e-4), (0.2, 0.2)])
DUAL = st.sampled_from([None, 1.5, 3.0])


def valid_pairs():
    return [(lv, ag) for lv in IMPORTANCE_LEVELS for ag in AGGREGATIONS
            if not (lv == "sequence" and ag in LENGTH_WEIGHTED_AGGREGATIONS)]


@st.composite
def batches(draw, per_token_adv=None):
    """Random [B, T] batch: logp drifting from old_logp by `drift`, a mask with >= 1 token per row."""
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    drift = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5]))
    per_tok = draw(st.booleans()) if per_token_adv is None else per_token_adv
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old_logp = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = old_logp + drift * torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[torch.arange(b), torch.randint(0, t, (b,), generator=g)] = True  # at least one token per row
    adv = torch.randn(b, t, generator=g, dtype=F64) if per_tok else torch.randn(b, generator=g, dtype=F64)
    ref_logp = old_logp + 0.1 * torch.randn(b, t, generator=g, dtype=F64)
    entropy = torch.rand(b, t, generator=g, dtype=F64)
    return dict(logp=logp, old_logp=old_logp, adv=adv, mask=mask, ref_logp=ref_logp, entropy=entropy)


def run(batch, level, **kw):
    """(loss, grad wrt logp, metrics) of one call."""
    logp = batch["logp"].clone().requires_grad_()
    loss, metrics = compute_policy_loss(logp, batch["old_logp"], batch["adv"], batch["mask"], level, **kw)
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return loss.detach(), (torch.zeros_like(logp) if grad is None else grad), metrics


def seq_weight(batch):
    """s_i per completion, [B, 1], computed independently of the library."""
    m = batch["mask"]
    log_r = (batch["logp"] - batch["old_logp"]).masked_fill(~m, 0.0)
    return torch.exp(log_r.sum(-1, keepdim=True) / m.sum(-1, keepdim=True))


@SETTINGS
@given(batch=batches(per_token_adv=False), eps=EPS, dual=DUAL, uniform_2d=st.booleans())
def test_sequence_equals_sequence_token_with_shared_advantage(batch, eps, dual, uniform_2d):
    # one A per completion (given as [B] or broadcast to [B, T]): GSPO and GSPO-token agree in value and gradient,
    # clipped completions included (seed §4: max gradient difference 2e-9 in float32)
    if uniform_2d:
        batch["adv"] = batch["adv"][:, None].expand_as(batch["logp"]).clone()
    kw = dict(eps_low=eps[0], eps_high=eps[1], dual_clip_c=dual)
    loss_s, grad_s, m_s = run(batch, "sequence", **kw)
    loss_st, grad_st, m_st = run(batch, "sequence_token", **kw)
    assert abs(loss_s - loss_st).item() <= 1e-6
    assert (grad_s - grad_st).abs().max().item() <= 1e-6
    assert m_s == pytest.approx(m_st, abs=1e-12)


@SETTINGS
@given(batch=batches(), eps=EPS, dual=DUAL)
def test_all_levels_agree_at_ratio_one(batch, eps, dual):
    # logp == old_logp -> every weight is exactly 1, nothing is clipped.
    # token == sequence_token for any advantages (both give token t the push A_t);
    # sequence gives every token mean(A), so it joins them when A is shared by the completion.
    batch["logp"] = batch["old_logp"].clone()
    kw = dict(eps_low=eps[0], eps_high=eps[1], dual_clip_c=dual)
    results = {lv: run(batch, lv, **kw) for lv in IMPORTANCE_LEVELS}
    torch.testing.assert_close(results["token"][0], results["sequence_token"][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(results["token"][1], results["sequence_token"][1], rtol=0, atol=1e-12)
    assert results["token"][2]["train/clip_frac_tok"] == 0.0
    if batch["adv"].dim() == 1:
        torch.testing.assert_close(results["token"][0], results["sequence"][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(results["token"][1], results["sequence"][1], rtol=0, atol=1e-12)


@SETTINGS
@given(batch=batches(), eps=EPS, level=st.sampled_from(list(IMPORTANCE_LEVELS)))
def test_clipped_tokens_get_exactly_zero_gradient(batch, eps, level):
    eps_low, eps_high = eps
    m = batch["mask"]
    if level == "sequence" and batch["adv"].dim() == 2:  # sequence mixes A across tokens; use a shared A
        batch["adv"] = batch["adv"][:, 0]
    adv = batch["adv"][:, None].expand_as(m) if batch["adv"].dim() == 1 else batch["adv"]
    w = torch.exp(batch["logp"] - batch["old_logp"]) if level == "token" else seq_weight(batch).expand_as(m)
    # clip branch active: A > 0 and w > 1 + eps_high, or A < 0 and w < 1 - eps_low
    clipped = m & (((adv > 0) & (w > 1 + eps_high)) | ((adv < 0) & (w < 1 - eps_low)))
    _, grad, metrics = run(batch, level, eps_low=eps_low, eps_high=eps_high)
    assert torch.all(grad[clipped] == 0)
    assert torch.all(grad[m & ~clipped & (adv != 0)] != 0)  # and the others do move
    assert metrics["train/clip_frac_tok"] == pytest.approx(clipped.sum().item() / m.sum().item())


def with_garbage(batch, extra_cols, extra_rows, g):
    """Same real tokens; masked-out holes overwritten and new padded columns/rows filled with nan/inf/huge."""
    b, t = batch["mask"].shape
    bb, tt = b + extra_rows, t + extra_cols
    pool = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30, 7.0], dtype=F64)
    out = {}
    for key, x in batch.items():
        if key == "mask":
            new = torch.zeros(bb, tt, dtype=torch.bool)
            new[:b, :t] = x
        elif key == "adv" and x.dim() == 1:
            new = torch.cat([x, pool[torch.randint(0, len(pool), (extra_rows,), generator=g)]])
        else:
            new = pool[torch.randint(0, len(pool), (bb, tt), generator=g)]
            new[:b, :t] = torch.where(batch["mask"], x, new[:b, :t])
        out[key] = new
    return out


@SETTINGS
@given(batch=batches(), pair=st.sampled_from(valid_pairs()), eps=EPS, dual=DUAL,
       extra_cols=st.integers(0, 4), extra_rows=st.integers(0, 2), seed=st.integers(0, 1000),
       kl=st.sampled_from(list(KL_ESTIMATORS)))
def test_padding_never_changes_results(batch, pair, eps, dual, extra_cols, extra_rows, seed, kl):
    level, aggregation = pair
    b, t = batch["mask"].shape
    kw = dict(eps_low=eps[0], eps_high=eps[1], dual_clip_c=dual, aggregation=aggregation,
              norm_len=16, beta=0.05, kl_estimator=kl)  # Dr.GRPO needs a fixed norm_len to ignore padding
    dirty = with_garbage(batch, extra_cols, extra_rows, torch.Generator().manual_seed(seed))

    def call(bt):
        return run(bt, level, ref_logp=bt["ref_logp"], entropy=bt["entropy"], **kw)

    loss_c, grad_c, m_c = call(batch)
    loss_d, grad_d, m_d = call(dirty)
    assert torch.isfinite(loss_d) and torch.isfinite(grad_d).all()
    torch.testing.assert_close(loss_d, loss_c, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_d[:b, :t], grad_c, rtol=0, atol=1e-12)
    assert torch.all(grad_d[~dirty["mask"]] == 0)
    assert m_d == pytest.approx(m_c, abs=1e-12)


# ---------------------------------------------------------------- aggregation
def reference_aggregate(x, mask, mode, norm_len):
    """Loop implementation of the documented formulas, rows without tokens skipped."""
    rows = [[x[i, j].item() for j in range(x.shape[1]) if mask[i, j]] for i in range(x.shape[0])]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        flat = [v for r in rows for v in r]
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) / norm_len for r in rows) / len(rows)


@SETTINGS
@given(batch=batches(), mode=st.sampled_from(AGGREGATIONS), norm_len=st.sampled_from([None, 3, 16]))
def test_aggregation_matches_documented_formula(batch, mode, norm_len):
    x, mask = batch["ref_logp"], batch["mask"].clone()
    mask[0] = False  # an empty completion is left out of every mean
    if not mask.any():
        return
    x = torch.where(mask, x, torch.nan)  # padding holds nan: must not leak
    expected = reference_aggregate(x, mask, mode, x.shape[1] if norm_len is None else norm_len)
    assert aggregate(x, mask, mode, norm_len).item() == pytest.approx(expected, rel=1e-12)


def test_aggregation_weights_by_hand():
    # row 0: [1, 2, 3] (3 tokens), row 1: [10] (1 token), padding = 99
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 10.0) / 2)  # 6.0
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(16.0 / 4)  # 4.0
    assert aggregate(x, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 10 / 3) / 2)  # T = 3
    assert aggregate(x, mask, "seq-mean-token-sum-norm", norm_len=8).item() == pytest.approx((6 / 8 + 10 / 8) / 2)


@pytest.mark.parametrize("aggregation", LENGTH_WEIGHTED_AGGREGATIONS)
def test_sequence_with_length_weighted_aggregation_raises(aggregation):
    with pytest.raises(ValueError, match=f"sequence.*{aggregation}"):
        check_level_aggregation("sequence", aggregation)
    x = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError, match=aggregation):
        compute_policy_loss(x, x, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), "sequence", 0.2, 0.2,
                            aggregation=aggregation)


@pytest.mark.parametrize("level,aggregation", valid_pairs())
def test_valid_pairs_accepted(level, aggregation):
    check_level_aggregation(level, aggregation)


def test_unknown_keys_list_valid_ones():
    x = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="token, sequence, sequence_token"):
        compute_policy_loss(x, x, torch.zeros(1), mask, "seq", 0.2, 0.2)
    with pytest.raises(ValueError, match="seq-mean-token-mean, token-mean, seq-mean-token-sum-norm"):
        aggregate(x, mask, "mean")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        compute_policy_loss(x, x, torch.zeros(1), mask, "token", 0.2, 0.2, ref_logp=x, beta=0.1, kl_estimator="k4")


@pytest.mark.parametrize("kw,match", [
    (dict(dual_clip_c=1.0), "dual_clip_c"),
    (dict(eps_low=1.0), "eps_low"),
    (dict(beta=0.1), "ref_logp"),
    (dict(adv=torch.zeros(3)), "adv"),
])
def test_bad_arguments_raise(kw, match):
    x = torch.zeros(2, 4, dtype=F64)
    args = dict(logp=x, old_logp=x, adv=torch.zeros(2), mask=torch.ones(2, 4, dtype=torch.bool), level="token",
                eps_low=0.2, eps_high=0.2) | kw
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(**args)


@pytest.mark.parametrize("level", list(IMPORTANCE_LEVELS))
def test_dual_clip_caps_negative_advantage_loss(level):
    # A = -1, every ratio 5 (log r = log 5): plain PPO loss = -min(5 * -1, 1.2 * -1) = 5; dual clip c = 3 caps it
    # at 3 * |A| = 3 with zero gradient
    old = torch.zeros(1, 3, dtype=F64)
    new = torch.full((1, 3), math.log(5.0), dtype=F64)
    batch = dict(logp=new, old_logp=old, adv=torch.tensor([-1.0], dtype=F64), mask=torch.ones(1, 3, dtype=torch.bool))
    loss, grad, _ = run(batch, level, eps_low=0.2, eps_high=0.2)
    assert loss.item() == pytest.approx(5.0)
    loss, grad, m = run(batch, level, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert torch.all(grad == 0) and m["train/dual_clip_frac_tok"] == 1.0
