"""Clipped policy-gradient loss with three importance-sampling levels: GRPO, GSPO and GSPO-token.

    from gspo_ray.algo.policy_loss import compute_policy_loss
    loss, metrics = compute_policy_loss(logp, old_logp, adv, mask, "sequence", eps_low=3e-4, eps_high=4e-4)
    loss.backward()

``old_logp`` is the rollout engine's log-prob of each sampled token (the clipping anchor, GSPO paper §5.4).
Levels (``IMPORTANCE_LEVELS``), with ``log r_t = logp_t - old_logp_t``:
- ``token`` (GRPO):            log w_t = log r_t
- ``sequence`` (GSPO):         log w_t = log s = mean_t(log r_t) over the completion's loss-masked tokens
- ``sequence_token`` (GSPO-token): log w_t = logp_t - sg(logp_t) + sg(log s)
``sequence`` and ``sequence_token`` have equal values and, when A is the same on every token of a completion,
equal gradients; with per-token advantages only ``sequence_token`` keeps each token's own A in its gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from gspo_ray.algo.aggregation import SEQ_MEAN_TOKEN_MEAN, aggregate, check_level_aggregation, masked_mean
from gspo_ray.algo.kl import compute_kl, get_kl_estimator
from gspo_ray.algo.metrics import (
    compute_clip_metrics,
    compute_logr_moments,
    compute_mismatch_metrics,
    compute_ratio_metrics,
    compute_token_mean,
    to_floats,
)

# log w is clamped to [-20, 20] before exp(), for numerical safety only (e^20 ~ 5e8): any weight that far from 1
# is clipped already unless A has the "wrong" sign, where the loss would blow up (use dual_clip_c for that).
MAX_LOG_WEIGHT = 20.0


def log_weight_token(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GRPO. [B, T] -> [B, T]."""
    # log w_t = log pi(y_t) - log pi_old(y_t)
    return logp - old_logp


def log_weight_sequence(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO. [B, T] -> [B, T], the completion's log s on each of its tokens."""
    # log s_i = 1/|y_i| * sum_t log( pi(y_t) / pi_old(y_t) ),  s_i = (prod_t r_t)^(1/|y_i|)
    log_s = masked_mean(logp - old_logp, mask, dim=-1)
    return log_s[:, None].expand_as(logp)


def log_weight_sequence_token(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token. [B, T] -> [B, T]: value log s, gradient d/dlogp_t = 1 on token t only."""
    log_s = masked_mean(logp - old_logp, mask, dim=-1).detach()
    # log w_t = log pi(y_t) - sg[log pi(y_t)] + sg[log s_i]
    return logp - logp.detach() + log_s[:, None]


IMPORTANCE_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": log_weight_token,
    "sequence": log_weight_sequence,
    "sequence_token": log_weight_sequence_token,
}


def get_importance_level(level: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """Look up an importance-sampling level; unknown names raise ValueError listing the valid ones."""
    try:
        return IMPORTANCE_LEVELS[level]
    except KeyError:
        valid = ", ".join(IMPORTANCE_LEVELS)
        raise ValueError(f"unknown importance_sampling_level {level!r}; valid: {valid}") from None


def _check_args(logp, old_logp, adv, mask, eps_low, eps_high, dual_clip_c, ref_logp, beta, entropy) -> None:
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp, mask must all be [B, T]; got {tuple(logp.shape)}, {tuple(old_logp.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if adv.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"adv must be [B] or [B, T] = {tuple(logp.shape)}, got {tuple(adv.shape)}")
    for name, x in (("ref_logp", ref_logp), ("entropy", entropy)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} must be [B, T] = {tuple(logp.shape)}, got {tuple(x.shape)}")
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs ref_logp (the reference policy's log-probs)")


def compute_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    level: str,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
    aggregation: str = SEQ_MEAN_TOKEN_MEAN,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    norm_len: float | None = None,
    pg_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO / GSPO / GSPO-token loss of one micro-batch.

    logp: [B, T] current policy log-prob of each sampled token (with grad); old_logp: [B, T] rollout log-probs;
    adv: [B] (one per completion) or [B, T] (per token); mask: [B, T] bool, True = token is trained on;
    ref_logp: [B, T] reference-policy log-probs (KL term and train/kl metric); entropy: [B, T] (metric only);
    norm_len: Dr.GRPO constant for aggregation="seq-mean-token-sum-norm".
    pg_weight: [B, T] >= 0, no gradient: multiplies each token's policy-gradient term (mismatch corrections);
    a 0 drops the token: no loss, left out of the sequence ratio s, still counted by the aggregation (like a
    clipped token), left out of the clip and ratio metrics (``train/n_kept_tokens`` / ``n_kept_seqs`` count what
    they read), see `mismatch_correction` and `dilution`.
    Padding (mask False) may hold anything, nan/inf included: it never reaches the loss or the gradient.
    Returns (loss: 0-d tensor, metrics: {"train/...": float}).
    """
    log_weight_fn = get_importance_level(level)
    check_level_aggregation(level, aggregation)
    get_kl_estimator(kl_estimator)  # fail on a bad name even when no reference policy is given
    _check_args(logp, old_logp, adv, mask, eps_low, eps_high, dual_clip_c, ref_logp, beta, entropy)
    if pg_weight is not None and pg_weight.shape != logp.shape:
        raise ValueError(f"pg_weight must be [B, T] = {tuple(logp.shape)}, got {tuple(pg_weight.shape)}")
    mask = mask.bool()
    kept = mask if pg_weight is None else mask & (pg_weight > 0)  # tokens that enter the ratio and the loss
    # select padding away before any arithmetic so no nan/inf from it can enter the graph (0 * nan = nan)
    logp = torch.where(mask, logp, 0.0)
    old_logp = torch.where(mask, old_logp, 0.0).detach()
    adv = torch.where(mask, adv[:, None] if adv.dim() == 1 else adv, 0.0).detach()

    log_w = log_weight_fn(logp, old_logp, kept).clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)
    w = torch.exp(log_w)
    # l_t = -min( w_t * A_t, clip(w_t, 1 - eps_low, 1 + eps_high) * A_t )
    pg_tok = -torch.minimum(w * adv, w.clamp(1 - eps_low, 1 + eps_high) * adv)
    if dual_clip_c is not None:
        # dual clip: for A_t < 0, l_t = min(l_t, -c * A_t), i.e. the loss is capped at c * |A_t|
        pg_tok = torch.where(adv < 0, torch.minimum(pg_tok, -dual_clip_c * adv), pg_tok)
    if pg_weight is not None:
        # l_t <- w_t * l_t (w_t = 0: selected away, so an inf/nan l_t of a dropped token cannot leak)
        pg_tok = torch.where(kept, pg_tok * torch.where(kept, pg_weight, 0.0).detach(), 0.0)

    loss_tok = pg_tok
    kl_tok = None
    if ref_logp is not None:
        kl_tok = compute_kl(logp, torch.where(mask, ref_logp, 0.0).detach(), kl_estimator)
        if beta != 0.0:
            # l_t += beta * KL_t
            loss_tok = pg_tok + beta * kl_tok
    loss = aggregate(loss_tok, mask, aggregation, norm_len)

    counts = {"train/n_tokens": mask.sum(), "train/n_seqs": mask.any(dim=-1).sum()}
    if pg_weight is not None:  # the weights of the clip and ratio metrics, which read kept tokens only
        counts |= {"train/n_kept_tokens": kept.sum(), "train/n_kept_seqs": kept.any(dim=-1).sum()}
    metrics = to_floats({
        "train/pg_loss": aggregate(pg_tok.detach(), mask, aggregation, norm_len),
        **counts,  # weights for the caller's reduction over micro-batches and ranks
    })
    # a dropped token (pg_weight 0) is neither clipped nor unclipped: its ratio is not the one trained, and as
    # "unclipped" it would dilute the clip fraction that eps: auto steers by
    metrics |= compute_clip_metrics(w, adv, kept, eps_low, eps_high, dual_clip_c)
    metrics |= compute_ratio_metrics(w, kept, per_sequence=level != "token")
    metrics |= compute_mismatch_metrics(logp, old_logp, mask)
    metrics |= compute_logr_moments(logp, old_logp, mask)
    if kl_tok is not None:
        metrics |= compute_token_mean(kl_tok, mask, "train/kl")
    if entropy is not None:
        metrics |= compute_token_mean(entropy, mask, "train/entropy")
    return loss, metrics
