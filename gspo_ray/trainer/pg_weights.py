"""Per-token weights of the policy-gradient term from the algorithm options: the dilution detector / mask and
the training-inference mismatch correction. Maps `AlgorithmConfig` onto the pure functions of `gspo_ray.algo`.

    weight, metrics = build_pg_weight(logp, old_logp, rollout_logp, adv, mask, algo_cfg, eps_low, eps_high)
    loss, m = compute_policy_loss(..., pg_weight=weight)          # weight None: every token counts fully
"""
from __future__ import annotations

from torch import Tensor

from gspo_ray.algo.dilution import compute_dilution, dilution_keep
from gspo_ray.algo.mismatch_correction import compute_mismatch_weights


def build_pg_weight(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor | None, adv: Tensor, mask: Tensor,
                    algo_cfg, eps_low: float, eps_high: float) -> tuple[Tensor | None, dict[str, float]]:
    """logp (current policy), old_logp (the ratio's anchor), rollout_logp (engine, when old_logp was recomputed),
    adv, mask: [B, T]. Returns (weight [B, T] or None, metrics). Dilution is measured at the sequence levels."""
    weight, metrics = None, {}
    if algo_cfg.importance_sampling_level != "token":
        diluted_tok, diluted_seq, metrics = compute_dilution(logp.detach(), old_logp, adv, mask, eps_low, eps_high,
                                                             algo_cfg.dilution_threshold)
        keep = dilution_keep(diluted_tok, diluted_seq, algo_cfg.dilution_mask)
        if keep is not None:
            weight = keep.to(logp.dtype)
    mc = algo_cfg.mismatch_correction
    if mc.level != "none":
        if rollout_logp is None:
            raise ValueError("algorithm.mismatch_correction needs the engine's log-probs next to recomputed ones: "
                             "set coordinator.recompute_old_logprobs: true")
        w, m = compute_mismatch_weights(old_logp, rollout_logp, mask, mc.level, mc.mode, mc.lower, mc.upper)
        metrics |= m
        weight = w if weight is None else weight * w
    return weight, metrics
