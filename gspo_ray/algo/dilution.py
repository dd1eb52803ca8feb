"""Dilution detector for the sequence levels: one token's large log-ratio hidden inside an unclipped sequence.

    from gspo_ray.algo.dilution import compute_dilution
    diluted_tok, diluted_seq, metrics = compute_dilution(logp, old_logp, adv, mask, 3e-4, 4e-4, threshold=0.2)

Why (seed 000 §6, second reservation): log s = mean_t log r_t, so one token moving by 50% in a 10,000-token
completion changes s by e^(log 1.5 / 10000) ~ 1.00004, inside even GSPO's 3e-4 band: the sequence still trains
although that token's probability changed a lot. Definitions, with log r_t = logp_t - old_logp_t:
- a token is *clipped* when the clip branch of -min(s*A, clip(s)*A) is active: A_t > 0 and s > 1 + eps_high, or
  A_t < 0 and s < 1 - eps_low (so it gets no gradient);
- a token is *diluted* when it is not clipped and |log r_t| > threshold;
- a completion is diluted when it holds a diluted token.
Metrics: ``train/dilution_frac`` = diluted completions / completions (with >= 1 trained token);
``train/dilution_max_abs_logr`` = the largest |log r_t| over diluted tokens (0 if none).
`algorithm.dilution_mask` then drops the diluted tokens (``token``) or whole diluted completions (``sequence``)
from the policy-gradient term, as the token veto of slime / verl does for engine mismatch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_ray.algo.aggregation import masked_mean
from gspo_ray.algo.metrics import to_floats

DILUTION_MASKS = ("none", "token", "sequence")


@torch.no_grad()
def compute_dilution(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float, threshold: float
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """logp, old_logp, mask: [B, T]; adv: [B] or [B, T]. Returns (diluted_tok [B, T] bool, diluted_seq [B] bool,
    metrics)."""
    mask = mask.bool()
    adv = torch.where(mask, adv[:, None] if adv.dim() == 1 else adv, 0.0)
    log_r = torch.where(mask, logp - old_logp, 0.0)
    # s_i = exp( mean_t log r_t )
    s = torch.exp(masked_mean(log_r, mask, dim=-1))[:, None]
    clipped = ((adv > 0) & (s > 1 + eps_high)) | ((adv < 0) & (s < 1 - eps_low))
    diluted_tok = mask & ~clipped & (log_r.abs() > threshold)
    diluted_seq = diluted_tok.any(dim=-1)
    has_tokens = mask.any(dim=-1)
    n_seqs = has_tokens.sum().clamp(min=1)
    biggest = torch.where(diluted_tok, log_r.abs(), torch.zeros((), dtype=log_r.dtype, device=log_r.device)).amax()
    metrics = to_floats({"train/dilution_frac": diluted_seq.sum() / n_seqs,
                         "train/dilution_max_abs_logr": biggest})
    return diluted_tok, diluted_seq, metrics


def dilution_keep(diluted_tok: Tensor, diluted_seq: Tensor, mode: str) -> Tensor | None:
    """[B, T] bool of tokens whose policy-gradient term stays (None for mode ``none``: keep everything)."""
    if mode == "none":
        return None
    if mode == "token":
        return ~diluted_tok
    if mode == "sequence":
        return ~diluted_seq[:, None].expand_as(diluted_tok)
    raise ValueError(f"unknown dilution_mask {mode!r}; valid: {', '.join(DILUTION_MASKS)}")
