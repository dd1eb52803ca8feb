"""Pure algorithm core of gspo_ray: group advantages, the clipped policy loss at three importance-sampling
levels (GRPO / GSPO / GSPO-token), KL estimators, aggregation and metrics. Plain torch; no Ray, no I/O.

    from gspo_ray.algo import compute_group_advantages, compute_policy_loss
    adv, zero_var = compute_group_advantages(rewards)                       # [G, n]
    loss, metrics = compute_policy_loss(logp, old_logp, adv.flatten(), mask, "sequence", 3e-4, 4e-4)
"""

from gspo_ray.algo.advantages import (
    ADV_EPS,
    broadcast_sequence_advantages,
    compute_group_advantages,
    compute_group_advantages_flat,
    compute_ragged_token_advantages,
    compute_reward_to_go,
    compute_token_advantages,
    compute_turn_ids,
    compute_turn_token_advantages,
)
from gspo_ray.algo.aggregation import (
    AGGREGATIONS,
    LENGTH_WEIGHTED_AGGREGATIONS,
    aggregate,
    check_aggregation,
    check_level_aggregation,
    masked_mean,
    masked_sum,
)
from gspo_ray.algo.auto_eps import AutoEpsController
from gspo_ray.algo.dilution import DILUTION_MASKS, compute_dilution
from gspo_ray.algo.kl import KL_ESTIMATORS, compute_kl, get_kl_estimator
from gspo_ray.algo.metrics import (
    compute_clip_metrics,
    compute_mismatch_metrics,
    compute_ratio_metrics,
    compute_token_mean,
)
from gspo_ray.algo.mismatch_correction import CORRECTION_LEVELS, CORRECTION_MODES, compute_mismatch_weights
from gspo_ray.algo.policy_loss import (
    IMPORTANCE_LEVELS,
    MAX_LOG_WEIGHT,
    compute_policy_loss,
    get_importance_level,
)
from gspo_ray.algo.robust_advantages import ROBUST_MODES, compute_robust_group_advantages

__all__ = [
    "ADV_EPS",
    "AGGREGATIONS",
    "AutoEpsController",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "DILUTION_MASKS",
    "ROBUST_MODES",
    "compute_dilution",
    "compute_mismatch_weights",
    "compute_robust_group_advantages",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "LENGTH_WEIGHTED_AGGREGATIONS",
    "MAX_LOG_WEIGHT",
    "aggregate",
    "broadcast_sequence_advantages",
    "check_aggregation",
    "check_level_aggregation",
    "compute_clip_metrics",
    "compute_group_advantages",
    "compute_group_advantages_flat",
    "compute_ragged_token_advantages",
    "compute_reward_to_go",
    "compute_kl",
    "compute_mismatch_metrics",
    "compute_policy_loss",
    "compute_ratio_metrics",
    "compute_token_advantages",
    "compute_turn_ids",
    "compute_turn_token_advantages",
    "compute_token_mean",
    "get_importance_level",
    "get_kl_estimator",
    "masked_mean",
    "masked_sum",
]
