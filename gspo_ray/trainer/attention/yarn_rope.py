"""YaRN RoPE for attention outside multi-latent attention (gpt-oss): its inverse frequencies and attention factor,
as transformers 5.19 (`_compute_yarn_parameters`) and vLLM 0.32 (`YaRNScalingRotaryEmbedding`) compute them.

    inv_freq, attention_factor = yarn_parameters(head_dim, rope)      # rope: config.json's rope_parameters

With b = rope_theta, d = head_dim, s = factor, L = original_max_position_embeddings:

    extrapolated_i = b^(-2i/d),  interpolated_i = extrapolated_i / s
    corr(r) = d ln(L / (2 pi r)) / (2 ln b);  low, high = corr(beta_fast), corr(beta_slow)  (floor / ceil when
              `truncate`, transformers' default true; gpt-oss ships false), clipped to [0, d - 1]
    ramp_i = clamp((i - low) / (high - low), 0, 1);  inv_freq_i = interpolated_i ramp_i + extrapolated_i (1 - ramp_i)
    attention_factor = 0.1 ln s + 1 (s > 1; else 1)

transformers multiplies cos and sin by the attention factor, so every score q.k is scaled by its square: the
trainer's model takes these inv_freq in its RotaryEmbedding and the factor squared in its softmax scale
(model.build_model), the same numbers. Torch only.
"""
from __future__ import annotations

import math

import torch

from gspo_ray.trainer.attention.mla import yarn_mscale


def yarn_parameters(head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32, attention factor) of a YaRN `rope_parameters` dict (the module docstring)."""
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    original = float(rope["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    extrapolated = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    interpolated = extrapolated / factor
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # transformers' inv_freq_extrapolation_factor
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, yarn_mscale(factor)  # 0.1 ln s + 1 (s > 1; else 1)
