"""Training-inference mismatch corrections (TIS / MIS / IcePop), for `coordinator.recompute_old_logprobs: true`.

    from gspo_ray.algo.mismatch_correction import compute_mismatch_weights
    w, metrics = compute_mismatch_weights(old_logp, rollout_logp, mask, "token", "truncate", lower=0.5, upper=2.0)
    loss, m = compute_policy_loss(logp, old_logp, adv, mask, "sequence", eps_low, eps_high, pg_weight=w)

Three policies: the engine that sampled (behaviour, ``rollout_logp``), the trainer's recomputed log-probs of the
same weights (proximal / old policy, ``old_logp``, the anchor of the clipped ratio), and the policy being updated.
The engine and the trainer disagree (kernels, precision, MoE routing), so the samples come from pi_engine, not
from pi_old; the correction weight
    rho_t = pi_old(y_t) / pi_engine(y_t) = exp(old_logp_t - rollout_logp_t)
multiplies each token's policy-gradient term (no gradient through it). Levels (``CORRECTION_LEVELS``):
- ``token``:     log rho_t
- ``sequence``:  sum_t log rho_t        (the whole completion's likelihood ratio, on each of its tokens)
- ``geometric``: mean_t log rho_t       (length-normalised, like GSPO's s)
Modes (``CORRECTION_MODES``):
- ``truncate`` (TIS; slime --use-tis, verl rollout_is, NeMo-RL "tis"):  w = min(rho, upper)
- ``mask``     (MIS / IcePop; verl rollout_rs, NeMo-RL "icepop" / "seq-mask-tis"):
                w = rho if lower <= rho <= upper else 0   (a 0 drops the token from the loss and from s)
Metrics: train/is_weight_mean (token mean of w; 1 = no effect), train/is_rho_min / _max (before truncation),
train/is_truncated_frac_tok, train/is_masked_frac_tok, train/is_masked_frac_seq (completions with a 0 weight).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_ray.algo.aggregation import masked_mean, masked_sum
from gspo_ray.algo.metrics import masked_min_max, to_floats

CORRECTION_LEVELS = ("none", "token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "mask")
MAX_LOG_RHO = 20.0  # exp() safety only, as in policy_loss


def log_rho(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """[B, T] log rho at `level`, 0 off the mask."""
    diff = torch.where(mask, old_logp - rollout_logp, 0.0)
    if level == "token":
        # log rho_t = log pi_old(y_t) - log pi_engine(y_t)
        out = diff
    elif level == "sequence":
        # log rho = sum_t log rho_t
        out = masked_sum(diff, mask, dim=-1)[:, None].expand_as(diff)
    elif level == "geometric":
        # log rho = 1/|y| * sum_t log rho_t
        out = masked_mean(diff, mask, dim=-1)[:, None].expand_as(diff)
    else:
        raise ValueError(f"unknown mismatch correction level {level!r}; valid: {', '.join(CORRECTION_LEVELS[1:])}")
    return torch.where(mask, out, 0.0)


@torch.no_grad()
def compute_mismatch_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str, mode: str, lower: float, upper: float
) -> tuple[Tensor, dict[str, float]]:
    """old_logp (trainer, proximal), rollout_logp (engine, behaviour), mask: [B, T] -> (w [B, T] detached, metrics).
    w is 0 off the mask."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown mismatch correction mode {mode!r}; valid: {', '.join(CORRECTION_MODES)}")
    if not 0 <= lower < 1 < upper:
        raise ValueError(f"mismatch correction needs 0 <= lower < 1 < upper, got lower={lower}, upper={upper}")
    mask = mask.bool()
    rho = torch.exp(log_rho(old_logp, rollout_logp, mask, level).clamp(-MAX_LOG_RHO, MAX_LOG_RHO))
    zero = torch.zeros((), dtype=rho.dtype, device=rho.device)
    if mode == "truncate":
        # w = min(rho, C)
        w = torch.minimum(rho, torch.full_like(rho, upper))
        affected = mask & (rho > upper)
    else:
        # w = rho * 1[lower <= rho <= upper]
        inside = (rho >= lower) & (rho <= upper)
        w = torch.where(inside, rho, zero)
        affected = mask & ~inside
    w = torch.where(mask, w, zero)
    lo, hi = masked_min_max(rho, mask)
    flag = affected.to(rho.dtype)
    metrics = {"train/is_weight_mean": masked_mean(w, mask), "train/is_rho_min": lo, "train/is_rho_max": hi,
               f"train/is_{'truncated' if mode == 'truncate' else 'masked'}_frac_tok": masked_mean(flag, mask)}
    if mode == "mask":
        has_tokens = mask.any(dim=-1)
        metrics["train/is_masked_frac_seq"] = masked_mean(affected.any(dim=-1).to(rho.dtype), has_tokens)
    return w, to_floats(metrics)
