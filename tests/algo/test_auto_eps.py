"""algorithm.eps auto: eps = k * sigma / sqrt(L), k0 = Phi^-1(1 - target), multiplicative feedback on the measured
sequence clip fraction of reuse mini-batches. Golden numbers by hand in the comments."""
import math

import pytest

from gspo_ray.algo.auto_eps import (
    HIGH_LOW_RATIO,
    AutoEpsController,
    drift_eps,
    feedback_factor,
    gaussian_k,
    logr_sigma,
)


def test_formulas_by_hand():
    # Phi^-1(0.85) = 1.0364: a Gaussian exceeds +1.0364 sd with probability 0.15
    assert round(gaussian_k(0.15), 4) == 1.0364
    # sigma = sqrt(E[x^2] - E[x]^2) = sqrt(0.0005 - 0.01^2) = sqrt(0.0004) = 0.02
    assert logr_sigma(0.01, 0.0005) == pytest.approx(0.02)
    assert logr_sigma(0.01, 0.0001) == 0.0  # rounding below 0 is clamped
    # seed 000 §5's numbers: sigma 5%, L 2000 -> sigma / sqrt(L) = 0.001118; the paper's 3e-4 is k = 0.27
    assert round(drift_eps(1.0, 0.05, 2000), 6) == 0.001118
    assert round(3e-4 / drift_eps(1.0, 0.05, 2000), 2) == 0.27
    # feedback: exp(0.5 * (0.30 - 0.15) / 0.15) = e^0.5 = 1.6487; at c = 0: e^-0.5 = 0.6065; far off: bounded by 2
    assert round(feedback_factor(0.30, 0.15, 0.5, 2.0), 4) == 1.6487
    assert round(feedback_factor(0.0, 0.15, 0.5, 2.0), 4) == 0.6065
    assert feedback_factor(0.9, 0.15, 0.5, 2.0) == 2.0 and feedback_factor(0.9, 0.15, 0.5, 1.5) == 1.5


def _observe(ctl, clip, sigma=0.02, mean=0.01, n_seqs=100, length=4):
    # token means that give spread `sigma`: E[x^2] = sigma^2 + mean^2
    ctl.observe(mean, sigma**2 + mean**2, n_tokens=n_seqs * length, n_seqs=n_seqs, clip_frac_seq=clip)


def test_controller_init_then_feedback():
    ctl = AutoEpsController(target_clip_frac=0.15)
    assert ctl.band() == (3e-4, 3e-4 * HIGH_LOW_RATIO)  # the level default until a reuse batch is measured
    assert ctl.update() == {}  # nothing observed (one on-policy mini-batch per batch): no move
    # first measurement: sigma 0.02, L 4 -> eps = 1.0364 * 0.02 / 2 = 0.010364 (the clip fraction is not used yet)
    _observe(ctl, clip=0.9)
    m = ctl.update()
    assert m["train/auto_eps_sigma"] == pytest.approx(0.02) and m["train/auto_eps_len"] == 4
    assert round(ctl.eps_low, 6) == 0.010364
    assert ctl.band()[1] == pytest.approx(ctl.eps_low * 4 / 3)
    # measured 0.30 > target 0.15: k = 1.0364 * e^0.5 = 1.7088 -> eps = 1.7088 * 0.01 = 0.017088 (wider band)
    _observe(ctl, clip=0.30)
    ctl.update()
    assert round(ctl.k, 4) == 1.7088 and round(ctl.eps_low, 6) == 0.017088
    # measured 0: k = 1.7088 * e^-0.5 = 1.0364 -> back to 0.010364 (narrower band)
    _observe(ctl, clip=0.0)
    ctl.update()
    assert round(ctl.eps_low, 6) == 0.010364
    # at the target the band stays, whatever the drift: the band that hit the target is kept, and k records it
    # as a multiple of the new drift: k = 0.010364 * 2 / 0.04 = 0.5182
    _observe(ctl, clip=0.15, sigma=0.04)
    ctl.update()
    assert round(ctl.eps_low, 6) == 0.010364 and round(ctl.k, 4) == 0.5182


def test_observations_are_weighted_by_tokens_and_sequences():
    ctl = AutoEpsController()
    ctl.observe(0.0, 0.01**2, n_tokens=100, n_seqs=25, clip_frac_seq=0.2)
    ctl.observe(0.0, 0.03**2, n_tokens=300, n_seqs=75, clip_frac_seq=0.6)
    m = ctl.update()
    # E[x^2] = (100 * 1e-4 + 300 * 9e-4) / 400 = 7e-4 -> sigma = 0.026458; clip = (25*0.2 + 75*0.6) / 100 = 0.5
    assert round(m["train/auto_eps_sigma"], 6) == 0.026458 and m["train/auto_eps_clip_frac"] == pytest.approx(0.5)


def test_bounds_hold_and_k_does_not_wind_up():
    ctl = AutoEpsController(max_eps=0.01, min_eps=1e-3)
    _observe(ctl, clip=0.5, sigma=1.0)  # eps would be 1.0364 * 1 / 2 = 0.518
    ctl.update()
    assert ctl.eps_low == 0.01 and ctl.k == pytest.approx(0.01 * 2 / 1.0)  # k follows the bound
    _observe(ctl, clip=0.0, sigma=1.0)  # one step down: k = 0.02 * e^-0.5 -> eps = 0.006065 (moves at once)
    ctl.update()
    assert round(ctl.eps_low, 6) == 0.006065
    for _ in range(20):
        _observe(ctl, clip=0.0, sigma=1.0)
        ctl.update()
    assert ctl.eps_low == 1e-3


def test_no_drift_leaves_the_band():
    ctl = AutoEpsController()
    _observe(ctl, clip=0.0, sigma=0.0, mean=0.0)
    assert "train/auto_eps_k" not in ctl.update() and ctl.band()[0] == 3e-4


def test_state_round_trip():
    ctl = AutoEpsController()
    _observe(ctl, clip=0.3)
    ctl.update()
    other = AutoEpsController()
    other.load_state_dict(ctl.state_dict())
    assert other.band() == ctl.band() and other.k == ctl.k
    assert set(ctl.state_dict()) >= {"eps_low", "k"} and math.isfinite(ctl.state_dict()["k"])


def _step_metrics(logr_mean=1e-3, logr_sq_mean=2e-6, n_tokens=100.0, n_seqs=10.0, clip=0.2) -> dict[str, float]:
    return {"train/logr_mean": logr_mean, "train/logr_sq_mean": logr_sq_mean, "train/n_tokens": n_tokens,
            "train/n_seqs": n_seqs, "train/clip_frac_seq": clip}


def test_a_nan_observation_never_reaches_the_band():
    """One non-finite mini-batch (a skipped step's NaN loss) used to make eps NaN forever, checkpoint included."""
    ctl = AutoEpsController()
    assert not ctl.observe_step(_step_metrics(logr_mean=math.nan), reuse=True)
    assert not ctl.observe_step(_step_metrics(clip=math.inf), reuse=True)
    assert not ctl.observe_step(_step_metrics(), reuse=True, skipped=True)  # a skipped step trained nothing
    assert ctl.update() == {}  # nothing observed: the band stays
    assert ctl.band()[0] == 3e-4
    assert ctl.observe_step(_step_metrics(), reuse=True)
    ctl.update()
    assert math.isfinite(ctl.eps_low) and math.isfinite(ctl.k)


def test_on_policy_minibatches_are_not_observed():
    """The first mini-batch after the anchoring log-probs (sampling, or the trainer's recompute) shows only the
    engine gap or recompute noise: observing it pinned the band at min_eps with one mini-batch per batch."""
    ctl = AutoEpsController()
    assert not ctl.observe_step(_step_metrics(logr_mean=0.0, logr_sq_mean=1e-14, clip=0.0), reuse=False)
    assert ctl.update() == {}
    assert ctl.band()[0] == 3e-4


def test_a_nan_band_in_an_old_checkpoint_is_not_restored():
    ctl = AutoEpsController()
    ctl.load_state_dict({"eps_low": math.nan, "k": math.nan})
    assert ctl.eps_low == 3e-4 and ctl.k is None
    ctl.load_state_dict({"eps_low": 1e-2, "k": 1.5})
    assert (ctl.eps_low, ctl.k) == (1e-2, 1.5)


def test_the_clip_fraction_is_over_the_completions_the_loss_kept():
    # mini-batch 1: 10 completions, 8 dropped by a dilution mask or mismatch correction, 1 of the 2 kept clipped
    # (0.5); mini-batch 2: 10 kept, none clipped -> 1 / 12. Weighted by all completions it read 5 / 20 = 0.25.
    ctl = AutoEpsController()
    assert ctl.observe_step(_step_metrics(clip=0.5) | {"train/n_kept_seqs": 2.0}, reuse=True)
    assert ctl.observe_step(_step_metrics(clip=0.0), reuse=True)
    assert ctl.update()["train/auto_eps_clip_frac"] == pytest.approx(1 / 12)
    # every completion dropped: no clip fraction to steer by, so the band stays
    assert ctl.observe_step(_step_metrics(clip=0.0) | {"train/n_kept_seqs": 0.0}, reuse=True)
    band = ctl.band()
    assert math.isnan(ctl.update()["train/auto_eps_clip_frac"]) and ctl.band() == band
