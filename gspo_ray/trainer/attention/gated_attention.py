"""Qwen3-Next's gated softmax attention in Megatron's terms: the output gate's weight layout and the zero-centred
RMSNorm, as the qwen3_next family builds them (trainer/hybrid_spec.py; families/qwen3_next.py).

    fused = merge_gated_qkv(q_proj, k_proj, v_proj, heads, groups, head_dim)   # HF -> Megatron linear_qkv rows
    q_proj, k_proj, v_proj = split_gated_qkv(fused, heads, groups, head_dim)   # and back, exactly
    ModuleSpec(module=ZeroCenteredRMSNorm)                                     # a norm of the layer spec

The output gate. transformers' Qwen3NextAttention projects q_proj to 2 x heads x d rows, per head [q_h | gate_h],
and multiplies the attention output by sigmoid(gate) before o_proj. Megatron's SelfAttention with
`attention_output_gate=True` computes the same (`_apply_output_gate`: x * sigmoid(gate)) from linear_qkv rows laid
out per query group g (heads / groups query heads each): [q of the group's heads | gate of those heads | k_g | v_g]
(attention.get_query_key_value_tensors with output_gate). QK-norm applies to q only, as in transformers.

The zero-centred RMSNorm. Qwen3-Next's norms (input, post-attention, final, q / k) compute
x / sqrt(mean x^2 + eps) * (1 + weight) in fp32 (the weight stored centred on 0); Megatron's torch norm refuses
`layernorm_zero_centered_gamma`, so this module is the layer spec's norm, holding the checkpoint's tensor as is
(no 1 + w on load and w - 1 on export, which would not round-trip bit for bit).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def merge_gated_qkv(q_proj: Tensor, k_proj: Tensor, v_proj: Tensor, heads: int, groups: int,
                    head_dim: int) -> Tensor:
    """HF q_proj [heads * 2d, ...] (per head [q | gate]), k_proj / v_proj [groups * d, ...] -> Megatron's
    linear_qkv [groups * (2 heads / groups + 2) * d, ...], per group [q heads | gate heads | k | v]."""
    rest = q_proj.shape[1:]
    per_head = q_proj.reshape(groups, heads // groups, 2, head_dim, *rest)
    q, gate = per_head[:, :, 0].flatten(1, 2), per_head[:, :, 1].flatten(1, 2)  # [groups, heads/groups * d, ...]
    k, v = (x.reshape(groups, head_dim, *rest) for x in (k_proj, v_proj))
    return torch.cat([q, gate, k, v], dim=1).reshape(-1, *rest)


def split_gated_qkv(fused: Tensor, heads: int, groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of merge_gated_qkv."""
    rest, per = fused.shape[1:], heads // groups * head_dim
    q, gate, k, v = fused.reshape(groups, -1, *rest).split([per, per, head_dim, head_dim], dim=1)
    q_proj = torch.stack([q.reshape(groups, heads // groups, head_dim, *rest),
                          gate.reshape(groups, heads // groups, head_dim, *rest)], dim=2)
    return q_proj.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


class ZeroCenteredRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + weight), in fp32 at least, cast back (transformers' Qwen3NextRMSNorm).
    Built by Megatron's layer spec as its norms are: (config, hidden_size, eps)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **unused):
        super().__init__()
        dtype = getattr(config, "params_dtype", None)
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        y = x.to(wide)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(wide))).to(x.dtype)
