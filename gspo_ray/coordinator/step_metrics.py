"""A step's training metrics from its mini-batches' (num_iterations x num_minibatches optimizer steps).

    from gspo_ray.coordinator.step_metrics import combine_minibatches
    out = combine_minibatches([m1, m2])   # {"train/ratio_max": max, "train/forward_tokens": sum, ...}

Each mini-batch's metrics are already reduced over micro-batches and DP ranks (trainer/metric_accumulator.py).
A mean of maxima is no maximum and a mean of counts is no count, so each key reduces by its kind.
"""
from __future__ import annotations

from gspo_ray.algo.metrics import is_max_key

# counts: what the step's mini-batches did together
STEP_SUMS = ("train/n_tokens", "train/n_seqs", "train/n_kept_tokens", "train/n_kept_seqs", "train/forward_tokens",
             "train/row_tokens")
STEP_SUM_PREFIXES = ("train/forward_passes_",)
# states and running totals: the value after the step's last mini-batch
STEP_LAST = ("train/policy_version", "train/skipped_steps")


def combine_minibatches(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mini-batch metrics, in training order -> the step's: maxima (`is_max_key`) by max, minima (`*_min`) by
    min, counts (`STEP_SUMS`, `train/forward_passes_*`) by sum, states (`STEP_LAST`) by the last value, the rest
    by the mean over the mini-batches that report the key."""
    values: dict[str, list[float]] = {}
    for row in rows:
        for k, v in row.items():
            values.setdefault(k, []).append(float(v))
    out = {}
    for k, vs in values.items():
        if is_max_key(k):
            out[k] = max(vs)
        elif k.endswith("_min"):
            out[k] = min(vs)
        elif k in STEP_SUMS or k.startswith(STEP_SUM_PREFIXES):
            out[k] = sum(vs)
        elif k in STEP_LAST:
            out[k] = vs[-1]
        else:
            out[k] = sum(vs) / len(vs)
    return out
