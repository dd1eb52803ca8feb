"""Training metrics of one (micro-)batch as python floats: clipping, ratios, log-prob mismatch, KL, entropy.

    from gspo_ray.algo.metrics import compute_clip_metrics
    m = compute_clip_metrics(w, adv, mask, eps_low=3e-4, eps_high=4e-4)   # {"train/clip_frac_tok": 0.05, ...}

All functions run under ``torch.no_grad`` and read masked tensors with ``torch.where``, so padding never counts.
Values are for the local batch; the caller reduces across micro-batches and DP ranks (``train/n_tokens`` and
``train/n_seqs`` are returned by ``compute_policy_loss`` as weights for that). Each function ends in a single
device-to-host copy.

Clipping: a token is "clipped" when the clip branch of ``-min(w*A, clip(w)*A)`` is the active one, i.e. its
gradient is zero: ``high`` = A > 0 and w > 1 + eps_high; ``low`` = A < 0 and w < 1 - eps_low. ``dual`` = A < 0 and
w > c (dual-clip cap active). ``clip_frac_tok*`` = fraction of loss-masked tokens; ``clip_frac_seq*`` = mean over
completions of the fraction of their tokens clipped, which for the sequence levels (one s and one A per
completion) is exactly the fraction of completions whose sequence ratio s is clipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_ray.algo.aggregation import SEQ_MEAN_TOKEN_MEAN, aggregate, masked_mean


MAX_KEYS = ("train/dilution_max_abs_logr",)  # maxima whose key does not end in `_max`


def is_max_key(key: str) -> bool:
    """Whether a metric is a maximum (reduced by max over micro-batches, ranks and mini-batches, never averaged)."""
    return key.endswith("_max") or key in MAX_KEYS


def to_floats(values: dict[str, Tensor]) -> dict[str, float]:
    """One device-to-host copy for the whole dict."""
    if not values:
        return {}
    host = torch.stack([v.detach().to(torch.float64).reshape(()) for v in values.values()]).tolist()
    return dict(zip(values.keys(), host))


def masked_min_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) of x over mask; (0, 0) when the mask is empty."""
    inf = torch.tensor(torch.inf, dtype=x.dtype, device=x.device)
    lo = torch.where(mask, x, inf).amin()
    hi = torch.where(mask, x, -inf).amax()
    empty = ~mask.any()
    return torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)


@torch.no_grad()
def compute_clip_metrics(
    w: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None = None
) -> dict[str, float]:
    """w (importance weight actually used), adv, mask: [B, T]. Keys train/clip_frac_{tok,seq}[_low|_high]."""
    mask = mask.bool()
    high = mask & (adv > 0) & (w > 1 + eps_high)
    low = mask & (adv < 0) & (w < 1 - eps_low)
    out: dict[str, Tensor] = {}
    for suffix, clipped in (("", high | low), ("_low", low), ("_high", high)):
        flag = clipped.to(w.dtype)
        out[f"train/clip_frac_tok{suffix}"] = masked_mean(flag, mask)
        out[f"train/clip_frac_seq{suffix}"] = aggregate(flag, mask, SEQ_MEAN_TOKEN_MEAN)
    if dual_clip_c is not None:
        out["train/dual_clip_frac_tok"] = masked_mean((mask & (adv < 0) & (w > dual_clip_c)).to(w.dtype), mask)
    return to_floats(out)


@torch.no_grad()
def compute_ratio_metrics(w: Tensor, mask: Tensor, per_sequence: bool) -> dict[str, float]:
    """train/ratio_{min,mean,max} of the importance weight w: [B, T].

    per_sequence=True (sequence levels): over completions, one s each; otherwise over loss-masked tokens.
    """
    mask = mask.bool()
    if per_sequence:
        # s_i is shared by all tokens of completion i, so its masked row mean is s_i itself
        w, mask = masked_mean(w, mask, dim=-1), mask.any(dim=-1)
    lo, hi = masked_min_max(w, mask)
    return to_floats({"train/ratio_min": lo, "train/ratio_mean": masked_mean(w, mask), "train/ratio_max": hi})


@torch.no_grad()
def compute_mismatch_metrics(logp_trainer: Tensor, logp_rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """Rollout-engine vs trainer log-prob mismatch. logp_trainer, logp_rollout, mask: [B, T].

    train/mismatch_tok_{mean,max}: |logp_trainer_t - logp_rollout_t| over loss-masked tokens;
    train/mismatch_seq_{mean,max}: |mean_t(logp_trainer_t - logp_rollout_t)| over completions (= |log s|).
    Pure engine mismatch only while the trainer still holds the sampling weights (first mini-batch of a rollout
    batch); afterwards it also contains the policy's own drift.
    """
    mask = mask.bool()
    diff = torch.where(mask, logp_trainer - logp_rollout, 0.0)
    tok = diff.abs()
    seq = masked_mean(diff, mask, dim=-1).abs()
    has_tokens = mask.any(dim=-1)
    _, tok_max = masked_min_max(tok, mask)
    _, seq_max = masked_min_max(seq, has_tokens)
    return to_floats(
        {
            "train/mismatch_tok_mean": masked_mean(tok, mask),
            "train/mismatch_tok_max": tok_max,
            "train/mismatch_seq_mean": masked_mean(seq, has_tokens),
            "train/mismatch_seq_max": seq_max,
        }
    )


@torch.no_grad()
def compute_token_mean(x: Tensor, mask: Tensor, key: str) -> dict[str, float]:
    """{key: mean of x over loss-masked tokens}, for train/kl and train/entropy. x, mask: [B, T]."""
    mask = mask.bool()
    return to_floats({key: masked_mean(torch.where(mask, x, 0.0), mask)})


@torch.no_grad()
def compute_logr_moments(logp: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Token means of log r_t = logp_t - old_logp_t and of (log r_t)^2 over loss-masked tokens, [B, T] each.

    Token-weighted means combine exactly across micro-batches and ranks, and give the spread
    sigma = sqrt(E[(log r)^2] - E[log r]^2) that `algorithm.eps: auto` sets the band from.
    """
    mask = mask.bool()
    log_r = torch.where(mask, logp - old_logp, 0.0)
    return to_floats({"train/logr_mean": masked_mean(log_r, mask),
                      "train/logr_sq_mean": masked_mean(log_r**2, mask)})
