"""GSPO's clip band from measured drift (`algorithm.eps: auto`): a controller that keeps the sequence-level clip
fraction of reuse mini-batches near a target.

    ctl = AutoEpsController(target_clip_frac=0.15)
    eps_low, eps_high = ctl.band()                          # the band for the next rollout batch
    ctl.observe(logr_mean, logr_sq_mean, n_tokens, n_seqs, clip_frac_seq)   # each reuse mini-batch
    metrics = ctl.update()                                  # once per rollout batch

Why (seed 000 §5): the band should pass ordinary drift and stop unusual drift, so it sits at a small multiple of
the spread of the sequence ratio. With per-token log-ratio spread sigma and length L, log s = mean_t log r_t has
spread ~ sigma / sqrt(L) (if tokens drift independently), hence
    eps = k * sigma / sqrt(L).
If log s is Gaussian and its sign unrelated to A, the clipped share is P(z > eps / sd(log s)) = 1 - Phi(k), so
k0 = Phi^{-1}(1 - target) starts the controller where that model would hit the target. Tokens do not drift
independently and the drift follows A, so after that first measurement the band moves by multiplicative
feedback on the sequence clip fraction c it produced on the reuse mini-batches:
    k_used = eps * sqrt(L) / sigma                          (the multiple of the drift the band was)
    k <- k_used * clamp(exp(gain * (c - target) / target), 1 / max_step, max_step),   eps = k * sigma / sqrt(L)
i.e. eps <- eps * factor(c): more clipping than wanted widens the band, a band at its target stays whatever the
drift does, and k is logged as the band's measured multiple of sigma / sqrt(L). eps is bounded to
[min_eps, max_eps]; when a bound binds, k follows it (no wind-up). eps_high = eps_low * 4/3, the paper's
asymmetry (3e-4 / 4e-4).

Only reuse mini-batches are observed (`observe_step`): the policy moved since the log-probs that anchor the ratio
were taken (the sampling policy's, or the trainer's own when old log-probs are recomputed). On the first mini-batch
after the anchor, log r is only the engine-trainer gap (or recompute noise), and its clip fraction says nothing
about the band. Skipped (non-finite) steps and non-finite statistics are never observed: one NaN would otherwise
make the band NaN for the rest of the run and in every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

HIGH_LOW_RATIO = 4.0 / 3.0  # GSPO paper §5.1: eps_high / eps_low = 4e-4 / 3e-4


def gaussian_k(target_clip_frac: float) -> float:
    """k0 = Phi^{-1}(1 - target): the band, in units of sd(log s), that clips `target` of a Gaussian one side."""
    return NormalDist().inv_cdf(1.0 - target_clip_frac)


def logr_sigma(logr_mean: float, logr_sq_mean: float) -> float:
    """sigma = sqrt(E[(log r)^2] - E[log r]^2), from token means (clamped at 0 against rounding)."""
    return math.sqrt(max(logr_sq_mean - logr_mean**2, 0.0))


def drift_eps(k: float, sigma: float, mean_len: float) -> float:
    """eps = k * sigma / sqrt(L)."""
    return k * sigma / math.sqrt(max(mean_len, 1.0))


def feedback_factor(clip_frac: float, target: float, gain: float, max_step: float) -> float:
    """exp(gain * (c - target) / target), bounded to [1 / max_step, max_step]."""
    return min(max(math.exp(gain * (clip_frac - target) / target), 1.0 / max_step), max_step)


@dataclass
class AutoEpsController:
    """State of the controller; plain floats so a checkpoint is a small dict (`state_dict` / `load_state_dict`)."""

    target_clip_frac: float = 0.15
    eps_low: float = 3e-4  # current band (starts at the level default until the first measurement)
    min_eps: float = 1e-5
    max_eps: float = 0.2
    gain: float = 0.5
    max_step: float = 2.0
    k: float | None = None  # None until the first update: then k0 = gaussian_k(target)
    # sums over the reuse mini-batches observed since the last update (token- and sequence-weighted)
    _tok: float = 0.0
    _logr: float = 0.0
    _logr_sq: float = 0.0
    _seqs: float = 0.0
    _clip: float = 0.0
    _clip_seqs: float = 0.0  # the clip fraction's weight: completions the loss kept (a dropped one is neither)

    def band(self) -> tuple[float, float]:
        """(eps_low, eps_high) to train with now."""
        return self.eps_low, self.eps_low * HIGH_LOW_RATIO

    def observe(self, logr_mean: float, logr_sq_mean: float, n_tokens: float, n_seqs: float,
                clip_frac_seq: float, kept_seqs: float | None = None) -> None:
        """Add one reuse mini-batch: token means of log r and (log r)^2, its sizes, its sequence clip fraction
        (over the `kept_seqs` completions a dilution mask or mismatch correction left in the loss; default all)."""
        kept_seqs = n_seqs if kept_seqs is None else kept_seqs
        self._tok += n_tokens
        self._logr += logr_mean * n_tokens
        self._logr_sq += logr_sq_mean * n_tokens
        self._seqs += n_seqs
        self._clip += clip_frac_seq * kept_seqs
        self._clip_seqs += kept_seqs

    def observe_step(self, metrics: dict[str, float], *, reuse: bool, skipped: bool = False) -> bool:
        """Observe one trained mini-batch's metrics if they say something about the band: a reuse mini-batch
        (`reuse`: the policy moved since the anchoring log-probs) whose step was not skipped, with finite
        statistics. Returns whether it was observed."""
        if not reuse or skipped:
            return False
        stats = [float(metrics[k]) for k in ("train/logr_mean", "train/logr_sq_mean", "train/n_tokens",
                                              "train/n_seqs", "train/clip_frac_seq")]
        stats.append(float(metrics.get("train/n_kept_seqs", stats[3])))
        if not all(math.isfinite(v) for v in stats):
            return False
        self.observe(*stats)
        return True

    def update(self) -> dict[str, float]:
        """Move the band from what was observed since the last call; returns the measurements as metrics
        (empty when nothing was observed, e.g. one on-policy mini-batch per rollout batch)."""
        if self._tok <= 0 or self._seqs <= 0:
            return {}
        sigma = logr_sigma(self._logr / self._tok, self._logr_sq / self._tok)
        # no kept completion: the clip fraction is unknown (nan), so the band stays
        mean_len, clip = self._tok / self._seqs, self._clip / self._clip_seqs if self._clip_seqs > 0 else math.nan
        self._tok = self._logr = self._logr_sq = self._seqs = self._clip = self._clip_seqs = 0.0
        metrics = {"train/auto_eps_sigma": sigma, "train/auto_eps_len": mean_len, "train/auto_eps_clip_frac": clip}
        if not (math.isfinite(sigma) and math.isfinite(mean_len) and math.isfinite(clip)) or sigma <= 0.0:
            # the policy did not move (or a value is not a number): no scale to set the band from
            return metrics
        if self.k is None:
            self.k = gaussian_k(self.target_clip_frac)
        else:
            # k in effect for the measured batch, then the feedback step
            k_used = self.eps_low * math.sqrt(max(mean_len, 1.0)) / sigma
            self.k = k_used * feedback_factor(clip, self.target_clip_frac, self.gain, self.max_step)
        eps = drift_eps(self.k, sigma, mean_len)
        self.eps_low = min(max(eps, self.min_eps), self.max_eps)
        if self.eps_low != eps:  # a bound binds: k follows it, so it cannot wind up beyond the bound
            self.k = self.eps_low * math.sqrt(max(mean_len, 1.0)) / sigma
        return metrics | {"train/auto_eps_k": self.k}

    def state_dict(self) -> dict[str, float | None]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    def load_state_dict(self, state: dict) -> None:
        for key in ("eps_low", "k"):  # the band and its scale; settings come from the config
            value = state.get(key)
            if key in state and (value is None or math.isfinite(value)):  # a NaN saved earlier is not restored
                setattr(self, key, value)
