"""The engine-trainer anchor gap's statistics and the rule that keeps or stops the engine's log-probs as GSPO's
anchor (gspo_ray/algo/anchor_gap.py), on hand-made tensors with hand-worked numbers."""
import math

import pytest
import torch

from gspo_ray.algo.anchor_gap import (
    GAP_SHARE_OF_BAND,
    anchor_gap_fits,
    anchor_gap_floor,
    anchor_gap_stop_line,
    compute_anchor_gap,
)


def _gap_tensors():
    """Row 0: d = [+0.002, +0.004] (s = +0.003); row 1: d = [-0.001, -0.001, -0.004] (s = -0.002); row 2 has no
    masked token (left out). Padding (mask 0) carries a gap of 5 that must never count."""
    d = torch.tensor([[0.002, 0.004, 5.0, 5.0],
                      [-0.001, -0.001, -0.004, 5.0],
                      [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.float)
    engine = torch.full_like(d, -1.25)
    return engine + d, engine, mask


def test_gap_statistics_by_hand():
    logp, engine, mask = _gap_tensors()
    gap = compute_anchor_gap(logp, engine, mask, eps_low=3e-4, eps_high=4e-4)
    assert (gap.n_seqs, gap.n_tokens) == (2, 5)
    # |d|: .002 .004 .001 .001 .004 -> mean .0024, max .004; rms sqrt((4+16+1+1+16)e-6 / 5) = sqrt(7.6e-6)
    assert gap.token_mean == pytest.approx(0.0024, abs=1e-6) and gap.token_max == pytest.approx(0.004, abs=1e-6)
    assert gap.token_rms == pytest.approx(math.sqrt(7.6e-6), rel=1e-3)
    # s = [+.003, -.002]: population std .0025, |s| max .003, rms sqrt((9 + 4)e-6 / 2) = .0025495
    assert gap.seq_std == pytest.approx(0.0025, rel=1e-3) and gap.seq_absmax == pytest.approx(0.003, rel=1e-3)
    assert gap.seq_rms == pytest.approx(math.sqrt(6.5e-6), rel=1e-3)
    assert gap.outside_band == 1.0  # both s far outside 3e-4/4e-4
    # a band of .0025/.0033: s = +.003 < log(1.0033) = .003295 and -.002 > log(1 - .0025) = -.002503: both inside
    assert compute_anchor_gap(logp, engine, mask, 0.0025, 0.0033).outside_band == 0.0
    # at the token level the unit is the token: .004 > log(1.0035) = .003494 twice, so 2 of 5 tokens are out
    assert compute_anchor_gap(logp, engine, mask, 0.0035, 0.0035, level="token").outside_band == pytest.approx(0.4)
    m = gap.metrics()
    assert m["train/anchor_gap_samples"] == 2.0 and m["train/anchor_gap_seq_std"] == gap.seq_std
    assert {"train/anchor_gap_token_mean", "train/anchor_gap_token_max", "train/anchor_gap_seq_absmax",
            "train/anchor_gap_outside_band"} <= set(m)


def test_the_rule_keeps_the_engine_anchor_up_to_a_third_of_the_band():
    logp, engine, mask = _gap_tensors()
    gap = compute_anchor_gap(logp, engine, mask, 3e-4, 4e-4)
    # floor = rms(s) / (1/3) = 3 * .0025495 = .0076485
    assert GAP_SHARE_OF_BAND == pytest.approx(1 / 3)
    assert anchor_gap_floor(gap) == pytest.approx(3 * math.sqrt(6.5e-6), rel=1e-3)
    assert anchor_gap_fits(gap, eps_low=0.0077) and not anchor_gap_fits(gap, eps_low=0.0076)
    assert not anchor_gap_fits(gap, eps_low=3e-4)  # the paper's band: 25x too narrow
    # token level: per-token rms; GRPO's 0.2 holds it (floor 3 * .0027568 = .00827)
    assert anchor_gap_floor(gap, "token") == pytest.approx(3 * math.sqrt(7.6e-6), rel=1e-3)
    assert anchor_gap_fits(gap, 0.2, "token")


def test_an_offset_costs_the_band_like_scatter():
    """Every sequence off by the same +1e-4: std 0, but the rms (what the rule reads) is 1e-4, floor 3e-4."""
    engine = torch.full((4, 3), -2.0)
    gap = compute_anchor_gap(engine + 1e-4, engine, torch.ones(4, 3), 3e-4, 4e-4)
    # fp32: -2 + 1e-4 rounds to within 1e-3 of it
    assert gap.seq_std == pytest.approx(0.0, abs=1e-9) and gap.seq_rms == pytest.approx(1e-4, rel=1e-3)
    assert anchor_gap_fits(gap, 3.01e-4) and not anchor_gap_fits(gap, 2.99e-4)


def test_no_token_to_compare_is_an_error_not_a_zero_gap():
    engine = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="no masked token"):
        compute_anchor_gap(engine, engine, torch.zeros(2, 3), 3e-4, 4e-4)


def test_the_stop_line_names_the_gap_the_band_and_the_ways_out():
    logp, engine, mask = _gap_tensors()
    gap = compute_anchor_gap(logp, engine, mask, 3e-4, 4e-4)
    line = anchor_gap_stop_line(gap, (3e-4, 4e-4), "sequence", step=1)
    assert "\n" not in line and line.startswith("step 1: ")
    assert "0.00255 rms per sequence" in line and "100% of sequences outside the band" in line
    assert "clip band 0.0003/0.0004" in line and "at most 0.0001" in line and "nothing was trained" in line
    for way in ("algorithm.eps: auto", "coordinator.recompute_old_logprobs: true", "algorithm.mismatch_correction",
                "rollout.head_dtype", "trainer.head_dtype", "trainer.dtype float32"):
        assert way in line, way
    # under eps auto the band is auto's, bounded by auto_eps.max_eps: auto is no way out then
    auto = anchor_gap_stop_line(gap, (3e-4, 4e-4), "sequence", step=11, auto_max_eps=0.005)
    assert "eps_low >= 0.00765" in auto and "max_eps 0.005" in auto and "algorithm.eps: auto" not in auto
