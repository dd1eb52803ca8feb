"""Transformer Engine's fused attention in THD layout: an alternative kernel for attention by segment (CUDA only).

    layout = thd_layout(segs, width)                       # pure: gather indices and cu_seqlens of a micro-batch
    out = thd_attend_rows(query, key, value, segs, kernel)  # [S, B, Hq, D] x [S, B, Hkv, D] x 2 -> [S, B, Hq * D]
    kernel = TEThdKernel(heads, kv_heads, head_dim, scale)  # TE's DotProductAttention (CUDA + transformer_engine)

The same attention as segment_attention.attend_rows, as one varlen call: every segment of every unit is one
sequence of the THD batch, with separate query and key lengths (a unit is a row, or, in a packed row, each sequence
/ group row laid one after another in it: a unit's columns start where the previous unit's end). A prefix of P
tokens is a sequence of P queries over its P keys; completion j of c_j tokens a sequence of c_j queries over P + c_j
keys, [prefix ; completion j], the prefix's keys and values gathered once per completion segment. TE's
`padding_causal_bottom_right` mask aligns causality to the bottom-right corner of each (queries, keys) block, so the
i-th query of a completion sees the whole prefix and completion tokens 0..i (and a prefix, with as many queries as
keys, is plain causal). Empty segments are left out; padding positions get no query and output 0, as in attend_rows.

    cu_seqlens_q  = [0, P, P + c_1, P + c_1 + c_2, ...]            (over every unit's sequences, in order)
    cu_seqlens_kv = [0, P, P + (P + c_1), ... ]                     (the kv length of a completion is P + c_j)

Memory: the gathered K/V hold sum_r (P_r + sum_j (P_r + c_rj)) positions a layer, the prefix G times over; the
kernel itself holds no score matrix (TE's fused / flash backends). attend_rows keeps no gathered copy between
forward and backward (it recomputes under checkpointing); this kernel keeps TE's saved inputs, so it trades that
memory for one fewer attention forward. Which one is faster at which lengths has not been measured (no GPU here).

What has run: thd_layout and thd_attend_rows on CPU with a torch reference of the THD semantics in place of TE
(tests/trainer/test_te_attention.py: equal to attend_rows, values and gradients, padded and packed rows), and
TEThdKernel against a stand-in DotProductAttention that reads only cu_seqlens as TE documents them. TEThdKernel
calls TE's documented API (transformer_engine.pytorch.DotProductAttention with qkv_format="thd", cu_seqlens_q /
cu_seqlens_kv, max_seqlen_q / max_seqlen_kv) and has not run: Transformer Engine does not install on this machine.
TE's fused kernels take bf16 / fp16; fp32 falls back to TE's unfused path or is refused, per TE version.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from gspo_ray.trainer.attention.segment_attention import Segments


@dataclass(frozen=True)
class ThdLayout:
    """Where the THD batch's rows come from in a flattened [S * B] micro-batch (position s of row b is s * B + b)."""

    q_index: Tensor                  # [total_q] int64: the query positions, sequence after sequence
    kv_index: Tensor                 # [total_kv] int64: the key / value positions (a prefix repeated per completion)
    cu_seqlens_q: Tensor             # [n + 1] int32: query offsets of the n sequences
    cu_seqlens_kv: Tensor            # [n + 1] int32: key offsets
    max_seqlen_q: int
    max_seqlen_kv: int

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    def to(self, device) -> ThdLayout:
        return ThdLayout(*(t.to(device) for t in (self.q_index, self.kv_index, self.cu_seqlens_q,
                                                   self.cu_seqlens_kv)), self.max_seqlen_q, self.max_seqlen_kv)


def _cumulative(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def thd_layout(segs: Segments, width: int) -> ThdLayout:
    """The THD layout of a micro-batch of `segs.num_rows` rows of `width` positions (see the module doc)."""
    batch = segs.num_rows
    q_parts, kv_parts, q_lens, kv_lens = [], [], [], []

    def positions(row: int, start: int, count: int) -> Tensor:
        return torch.arange(start, start + count, dtype=torch.int64) * batch + row

    for b in range(batch):
        if segs.length(b) > width:
            raise ValueError(f"row {b}: segments of {segs.length(b)} tokens in a width of {width}")
        column = 0  # a packed row holds every unit one after another: each unit is its own THD sequences
        for u in segs.units(b):
            p, completions = segs.prefix[u], segs.completions[u]
            prefix = positions(b, column, p)
            if p:
                q_parts.append(prefix)
                kv_parts.append(prefix)
                q_lens.append(p)
                kv_lens.append(p)
            start = column + p
            for c in completions:
                if c:
                    own = positions(b, start, c)
                    q_parts.append(own)
                    kv_parts += [prefix, own]
                    q_lens.append(c)
                    kv_lens.append(p + c)
                start += c
            column = start
    empty = torch.zeros(0, dtype=torch.int64)
    return ThdLayout(torch.cat(q_parts) if q_parts else empty, torch.cat(kv_parts) if kv_parts else empty,
                     _cumulative(q_lens), _cumulative(kv_lens), max(q_lens, default=0), max(kv_lens, default=0))


# kernel(q [total_q, Hq, D], k / v [total_kv, Hkv, D], layout) -> [total_q, Hq, D] or [total_q, Hq * D]
ThdKernel = Callable[[Tensor, Tensor, Tensor, ThdLayout], Tensor]


def thd_attend_rows(query: Tensor, key: Tensor, value: Tensor, segs: Segments, kernel: ThdKernel) -> Tensor:
    """Megatron's [S, B, H, D] query / key / value -> context [S, B, Hq * D] of `segs`, computed by one THD `kernel`
    call over every segment (gather, attend, scatter back; padding positions 0)."""
    width, batch, heads, dim = query.shape
    if segs.num_rows != batch:
        raise ValueError(f"Segments of {segs.num_rows} rows for a micro-batch of {batch}")
    layout = thd_layout(segs, width).to(query.device)
    out = query.new_zeros(width * batch, heads * dim)
    if layout.num_sequences == 0:
        return out.view(width, batch, heads * dim)
    flat_q, flat_k, flat_v = (x.reshape(width * batch, *x.shape[2:]) for x in (query, key, value))
    context = kernel(flat_q[layout.q_index], flat_k[layout.kv_index], flat_v[layout.kv_index], layout)
    return out.index_copy(0, layout.q_index, context.reshape(-1, heads * dim)).view(width, batch, heads * dim)


class TEThdKernel:
    """Transformer Engine's DotProductAttention over a ThdLayout (needs CUDA and transformer_engine).

    Heads are this rank's (TP already split them): TE gets no TP group. The TE module is held, not registered as a
    child: it has no parameters, and its `_extra_state` would otherwise enter the model's state dict (checkpoints).
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float):
        import transformer_engine.pytorch as te

        self.attention: nn.Module = te.DotProductAttention(
            heads, head_dim, num_gqa_groups=kv_heads, attention_dropout=0.0, qkv_format="thd",
            attn_mask_type="padding_causal_bottom_right", softmax_scale=scale)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layout: ThdLayout) -> Tensor:
        return self.attention(q, k, v, cu_seqlens_q=layout.cu_seqlens_q, cu_seqlens_kv=layout.cu_seqlens_kv,
                              max_seqlen_q=layout.max_seqlen_q, max_seqlen_kv=layout.max_seqlen_kv)
