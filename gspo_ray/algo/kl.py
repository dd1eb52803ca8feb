"""Per-token KL estimators between the current policy and a reference policy (Schulman, "Approximating KL").

    from gspo_ray.algo.kl import compute_kl
    kl_tok = compute_kl(logp, ref_logp, "k3")   # [B, T], add beta * kl_tok to the per-token loss

All three are evaluated on tokens sampled from the rollout policy, with ``x = ref_logp - logp``:
- ``k1``: ``-x = logp - ref_logp`` (unbiased, can be negative)
- ``k2``: ``x^2 / 2`` (biased, >= 0)
- ``k3``: ``exp(x) - x - 1`` (unbiased, >= 0; what GRPO/ms-swift use)
Padding is not handled here: the caller passes sanitised tensors (``compute_policy_loss`` does).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# exp() argument bound, for numerical safety only: |ref_logp - logp| > 20 means the policies disagree by e^20.
MAX_LOG_RATIO = 20.0


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    # k1 = log pi(y) - log pi_ref(y)
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    # k2 = 1/2 * (log pi(y) - log pi_ref(y))^2
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    x = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    # k3 = pi_ref/pi - log(pi_ref/pi) - 1 = exp(x) - x - 1, x = log pi_ref(y) - log pi(y); as expm1(x) - x, which
    # stays >= 0 in floating point (exp(x) - x - 1 gave -1.1e-16 at x = -7.5e-17)
    return torch.expm1(x) - x


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """Look up a KL estimator by name; unknown names raise ValueError listing the valid ones."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown kl_estimator {name!r}; valid: {', '.join(KL_ESTIMATORS)}") from None


def compute_kl(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate. logp, ref_logp: [B, T] -> [B, T]."""
    return get_kl_estimator(estimator)(logp, ref_logp)
