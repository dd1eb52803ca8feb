"""Routing-induced log-ratio: the part of log r_t that a change of MoE routing alone causes.

    from gspo_ray.algo.routing_noise import routing_noise_counts, routing_noise_metrics
    counts = routing_noise_counts(logp_free, logp_held, old_logp, adv, mask)   # additive: sum micro-batches
    metrics = routing_noise_metrics(counts)                                    # {"moe/routing_logratio_std": ...}

Seed 000: after an update the experts a token is routed to change, so the token-level ratio
r_t = pi_theta(y_t | x, y_<t) / pi_old(y_t | x, y_<t) swings for reasons unrelated to the policy's intent.
Both log-probs here come from the *current* weights on the same tokens:
- logp_free: the routing the routers pick now (what every training forward without Routing Replay uses);
- logp_held: the routing recorded when the sequence was first seen (R2's records, the sampling policy's routing).
So d_t = logp_free_t - logp_held_t is routing change alone, and log r_t = (logp_held_t - old_t) + d_t splits the
ratio into the weights' own change and the routing's.

What the noise does to each objective, with A the advantage (one per sequence, broadcast, or per token):
- a token is GRPO-clipped when the clip branch of -min(r A, clip(r, 1 - e_lo, 1 + e_hi) A) is active:
  A_t > 0 and r_t > 1 + e_hi, or A_t < 0 and r_t < 1 - e_lo (it gets no gradient);
- a sequence is GSPO-clipped by the same rule on s_i = exp( mean_t log r_t ) (length-normalised, so a routing
  flip on one token of a long completion moves log s_i by d_t / |y_i|).
`*_clips_removed` is the share of the clips under free routing that disappear when routing is held (clips that
routing change alone caused); `*_clips_added` the share of held-routing clips that free routing hides.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gspo_ray.algo.aggregation import masked_mean

GRPO_BAND = (0.2, 0.27)   # token-level band (DEFAULT_CLIP["token"])
GSPO_BAND = (3e-4, 4e-4)  # sequence-level band (DEFAULT_CLIP["sequence"], the paper's)
# what routing_noise_counts returns: sums over tokens / sequences, except abs_d_max (a maximum)
COUNT_KEYS = ("tokens", "seqs", "abs_d", "d", "d2", "abs_d_max", "abs_log_r", "tok_clip_free", "tok_clip_held",
              "tok_removed", "tok_added", "seq_clip_free", "seq_clip_held", "seq_removed", "seq_added")


def _clipped(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """The clip branch is active: the sample (token or sequence) gets no policy gradient."""
    return ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))


@torch.no_grad()
def routing_noise_counts(logp_free: Tensor, logp_held: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
                         token_band: tuple[float, float] = GRPO_BAND,
                         seq_band: tuple[float, float] = GSPO_BAND) -> dict[str, float]:
    """logp_free, logp_held, old_logp, mask: [B, T]; adv: [B] or [B, T]. Rows without a loss token are ignored.

    Additive counts (sums over tokens / sequences, plus `abs_d_max`), so micro-batches and DP ranks combine by
    summing (max for `abs_d_max`) before `routing_noise_metrics` turns them into shares."""
    mask = mask.bool()
    rows = mask.any(dim=-1)
    adv_t = adv[:, None].expand_as(mask) if adv.dim() == 1 else adv
    d = (logp_free - logp_held)[mask].double()
    log_r_free = torch.where(mask, logp_free - old_logp, 0.0)
    log_r_held = torch.where(mask, logp_held - old_logp, 0.0)
    tok_free = _clipped(log_r_free.exp(), adv_t, *token_band) & mask
    tok_held = _clipped(log_r_held.exp(), adv_t, *token_band) & mask
    adv_seq = masked_mean(adv_t.float(), mask, dim=-1)  # the sequence's advantage (equal on its tokens)
    seq_free = _clipped(masked_mean(log_r_free, mask, dim=-1).exp(), adv_seq, *seq_band) & rows
    seq_held = _clipped(masked_mean(log_r_held, mask, dim=-1).exp(), adv_seq, *seq_band) & rows
    return {"tokens": float(mask.sum()), "seqs": float(rows.sum()),
            "abs_d": float(d.abs().sum()), "d": float(d.sum()), "d2": float((d * d).sum()),
            "abs_d_max": float(d.abs().max()) if d.numel() else 0.0,
            "abs_log_r": float(log_r_free[mask].abs().double().sum()),
            "tok_clip_free": float(tok_free.sum()), "tok_clip_held": float(tok_held.sum()),
            "tok_removed": float((tok_free & ~tok_held).sum()), "tok_added": float((tok_held & ~tok_free).sum()),
            "seq_clip_free": float(seq_free.sum()), "seq_clip_held": float(seq_held.sum()),
            "seq_removed": float((seq_free & ~seq_held).sum()), "seq_added": float((seq_held & ~seq_free).sum())}


def merge_routing_noise_counts(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Counts of two parts (micro-batches, ranks) -> counts of both."""
    keys = set(a) | set(b)
    return {k: max(a.get(k, 0.0), b.get(k, 0.0)) if k == "abs_d_max" else a.get(k, 0.0) + b.get(k, 0.0)
            for k in keys}


def routing_noise_metrics(c: dict[str, float]) -> dict[str, float]:
    """Counts -> moe/routing_logratio_{abs_mean,std,max} (d_t over loss tokens), moe/routing_logratio_share
    (mean |d_t| / mean |log r_t| under free routing), GRPO-band token clip fractions moe/grpo_token_clip_{free,held}
    and moe/grpo_token_clips_{removed,added}, the GSPO-band sequence ones moe/gspo_seq_clip_{free,held} and
    moe/gspo_seq_clips_{removed,added}, and moe/routing_noise_{tokens,seqs}."""
    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 0.0

    n, m = c.get("tokens", 0.0), c.get("seqs", 0.0)
    mean = ratio(c.get("d", 0.0), n)
    return {
        "moe/routing_logratio_abs_mean": ratio(c.get("abs_d", 0.0), n),
        "moe/routing_logratio_std": max(ratio(c.get("d2", 0.0), n) - mean * mean, 0.0) ** 0.5,
        "moe/routing_logratio_max": c.get("abs_d_max", 0.0),
        "moe/routing_logratio_share": ratio(c.get("abs_d", 0.0), c.get("abs_log_r", 0.0)),
        "moe/grpo_token_clip_free": ratio(c.get("tok_clip_free", 0.0), n),
        "moe/grpo_token_clip_held": ratio(c.get("tok_clip_held", 0.0), n),
        "moe/grpo_token_clips_removed": ratio(c.get("tok_removed", 0.0), c.get("tok_clip_free", 0.0)),
        "moe/grpo_token_clips_added": ratio(c.get("tok_added", 0.0), c.get("tok_clip_held", 0.0)),
        "moe/gspo_seq_clip_free": ratio(c.get("seq_clip_free", 0.0), m),
        "moe/gspo_seq_clip_held": ratio(c.get("seq_clip_held", 0.0), m),
        "moe/gspo_seq_clips_removed": ratio(c.get("seq_removed", 0.0), c.get("seq_clip_free", 0.0)),
        "moe/gspo_seq_clips_added": ratio(c.get("seq_added", 0.0), c.get("seq_clip_held", 0.0)),
        "moe/routing_noise_tokens": n,
        "moe/routing_noise_seqs": m,
    }
