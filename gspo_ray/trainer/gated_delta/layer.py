"""GatedDeltaNet: Qwen3-Next's linear-attention layer, by segment, in its HF weight layout (transformers'
Qwen3NextGatedDeltaNet; vLLM's Qwen3NextGatedDeltaNet loads the same tensors).

    layer = GatedDeltaNet(hidden_size, heads, conv_kernel=4, eps=1e-6)
    out = layer(hidden [S, B, H], segs)                                  # -> [S, B, H]

For hidden state x of a token:

    [q k v z] = in_proj_qkvz x,  [b a] = in_proj_ba x      (interleaved per key head: see split_projections)
    q, k, v   = conv(q k v) per segment (by_segment.py), q and k L2-normalised
    beta      = sigmoid(b),   g = -exp(A_log) softplus(a + dt_bias)             (per value head; g <= 0)
    o         = gated delta rule (delta_rule.py)
    out       = out_proj( rmsnorm(o) * norm.weight * silu(z) )                   (per value head, gated RMSNorm)

Weight layout (Qwen3-Next's checkpoints): in_proj_qkvz's rows are grouped per KEY head: for each of the Hk key heads
[q (Dk) | k (Dk) | v (r Dv) | z (r Dv)] with r = Hv / Hk value heads per key head; in_proj_ba's rows likewise
[b (r) | a (r)] per key head. The convolution's channels are [q of all heads | k | v] (conv1d.weight [C, 1, K]).
Under tensor parallelism these interleaved rows shard by key-head group (whole groups per rank: q, k, v, z, b, a
and the convolution channels of a group stay together); not built here: the family refuses trainer.tp > 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gspo_ray.trainer.attention.segment_attention import Segments
from gspo_ray.trainer.gated_delta.by_segment import DeltaHeads, delta_rows


class GatedDeltaNet(nn.Module):
    """The layer (module docstring); parameters named as in the HF checkpoints under `linear_attn.`."""

    def __init__(self, hidden_size: int, heads: DeltaHeads, conv_kernel: int = 4, eps: float = 1e-6,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.heads, self.eps = heads, eps
        key_width, value_width = heads.key_heads * heads.key_dim, heads.value_heads * heads.value_dim
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key_width + 2 * value_width, bias=False, dtype=dtype)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * heads.value_heads, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(heads.channels, heads.channels, conv_kernel, groups=heads.channels, bias=False,
                                padding=conv_kernel - 1, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(heads.value_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.log(torch.empty(heads.value_heads, dtype=dtype).uniform_(1, 16)))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(heads.value_dim, dtype=dtype))
        self.out_proj = nn.Linear(value_width, hidden_size, bias=False, dtype=dtype)

    def split_projections(self, qkvz: Tensor, ba: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """[..., rows of in_proj_qkvz], [..., rows of in_proj_ba] (per key-head group, module docstring) ->
        mixed_qkv [..., C] (the convolution's channel order), z [..., Hv, Dv], b, a [..., Hv]."""
        h = self.heads
        ratio = h.value_heads // h.key_heads
        qkvz = qkvz.unflatten(-1, (h.key_heads, -1))
        q, k, v, z = qkvz.split((h.key_dim, h.key_dim, ratio * h.value_dim, ratio * h.value_dim), dim=-1)
        b, a = ba.unflatten(-1, (h.key_heads, 2 * ratio)).split((ratio, ratio), dim=-1)
        mixed = torch.cat([x.flatten(-2) for x in (q, k, v)], dim=-1)
        return (mixed, z.reshape(*z.shape[:-2], h.value_heads, h.value_dim), b.flatten(-2), a.flatten(-2))

    def gated_norm(self, o: Tensor, z: Tensor) -> Tensor:
        """RMSNorm over each value head's Dv, times norm.weight, times silu(z), in fp32 at least."""
        dtype = o.dtype
        x = o.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.norm.weight * x.to(dtype)
        return (x * F.silu(z.to(torch.promote_types(z.dtype, torch.float32)))).to(dtype)

    def forward(self, hidden: Tensor, segs: Segments) -> Tensor:
        """hidden [S, B, H] -> [S, B, H] for the segments `segs` (padding columns: out_proj of 0, i.e. 0)."""
        mixed, z, b, a = self.split_projections(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
        beta = b.sigmoid()
        wide = torch.promote_types(a.dtype, torch.float32)  # fp32 at least (a bf16 A_log.exp() loses the decay)
        log_decay = -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias)
        o = delta_rows(mixed, log_decay, beta, self.conv1d.weight[:, 0], segs, self.heads)
        return self.out_proj(self.gated_norm(o, z).flatten(-2))
