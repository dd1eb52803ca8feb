"""Sliding windows and attention sinks for attention by segment (segment_attention.attend_rows with `window` /
`sinks`): gpt-oss's attention.

Window W (HF `sliding_window`; Megatron / Transformer Engine's `window_size` (W - 1, 0)): a query at position i of
its unit sees the keys at positions j with i - W < j <= i, itself and the W - 1 before it (transformers'
`sliding_window_overlay`: kv_idx > q_idx - W). Positions count from the unit's start, so a window restarts with
each sequence of a packed row; a completion's query i sits at position P + i (P: its prefix), so it reaches into
the prefix only as far as the window: the prefix keys before P - W + 1 are never gathered for it.

Sinks s_h (one learned logit per query head, HF `sinks`, Megatron's `softmax_offset` with softmax_type
'learnable'): each softmax gets one more term that no value follows,

    out_i = sum_j exp(l_ij) v_j / (exp(s_h) + sum_j exp(l_ij)),     l_ij = scale * q_i . k_j

Torch's fused CPU kernel returns its log-sum-exp without a gradient, so the sink is made one more key per head,
exact in values and gradients: every query gets one more dimension holding s_h / scale, every key a zero there, and
one extra key, first in the keys, is zero except 1 in that dimension, with a zero value. Its score is
scale * (s_h / scale) * 1 = s_h for every query of head h, so the kernel's softmax is the one above, and the
gradient reaches s_h through the query's extra dimension (d score / d s_h = 1). The sink key lives on the K/V heads
and the sink logit on the query heads, so GQA is untouched. V gets a zero dimension too (the fused kernels take
equal q / v widths) and the output is sliced back.

Masks. The sink key is visible to every query; the real keys by causality and the window. These calls pass an
explicit boolean mask [q, 1 + keys] (what torch builds on CPU for causal_lower_right anyway; on CUDA it is the
memory-efficient kernel's attn_mask: not run here). Padding queries are never attended (attend_rows outputs zeros).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def with_sink_dimension(query: Tensor, key: Tensor, value: Tensor, sinks: Tensor | None, scale: float):
    """[S, B, H, D] tensors -> the same with one more dimension: the query's holds sinks[h] / scale, the key's and
    value's 0 (without sinks: unchanged)."""
    if sinks is None:
        return query, key, value
    width, batch, heads, _ = query.shape
    column = (sinks.to(query.dtype) / scale).view(1, 1, heads, 1).expand(width, batch, heads, 1)
    return torch.cat((query, column), dim=-1), F.pad(key, (0, 1)), F.pad(value, (0, 1))


def sink_key(like: Tensor) -> tuple[Tensor, Tensor]:
    """The sink's key and value for pieces like `like` ([1, Hkv, n, D + 1]): key e_D (1 in the sink dimension),
    value 0."""
    key = like.new_zeros(1, like.shape[1], 1, like.shape[3])
    key[..., -1] = 1.0
    return key, like.new_zeros(1, like.shape[1], 1, like.shape[3])


def visible(query_positions: Tensor, key_positions: Tensor, window: int | None, sink: bool) -> Tensor:
    """[q, sink + k] bool: the sink column (always seen) where there is one, then the keys a query sees: causal,
    and within the window."""
    q, k = query_positions[:, None], key_positions[None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    if not sink:
        return mask
    return torch.cat((torch.ones(len(query_positions), 1, dtype=torch.bool, device=mask.device), mask), dim=1)


def prefix_reach(prefix: int, window: int | None) -> int:
    """The first prefix position a completion's query can see (its first query, at position P, reaches back to
    P - W + 1)."""
    return 0 if window is None else max(0, prefix - window + 1)


def attend_windowed_unit(qs, ks, vs, scale: float, gqa: bool, window: int | None, sink: bool, recompute) -> list[Tensor]:
    """One unit's pieces ([1, H, n, D (+ 1 with a sink)] each, from with_sink_dimension: the prefix, then its
    completions) -> their outputs (empty pieces dropped), with the sink key (`sink`) and the window. `recompute(fn, *args)` runs a completion
    call (checkpointed by the caller where it gathers the prefix)."""
    p = qs[0].shape[2]
    out = []
    if p:
        out.append(attend_keys(qs[0], ks[0][:, :, :0], ks[0], vs[0][:, :, :0], vs[0], scale, gqa, window, sink, 0))
    for j in range(1, len(qs)):
        if qs[j].shape[2] == 0:
            continue
        start = prefix_reach(p, window)
        args = (qs[j], ks[0][:, :, start:], ks[j], vs[0][:, :, start:], vs[j], scale, gqa, window, sink,
                p - start)
        out.append(recompute(attend_keys, *args) if p > start else attend_keys(*args))
    return out


def attend_keys(q: Tensor, k_prefix: Tensor, k: Tensor, v_prefix: Tensor, v: Tensor, scale: float, gqa: bool,
                window: int | None, sink: bool, reach: int) -> Tensor:
    """Queries q [1, H, c, D (+ 1)] (the last c positions of keys [sink ; prefix tail ; own]) against the sink
    (`sink`), the prefix tail of `reach` keys and their own keys, lower-right causal within the window."""
    count = q.shape[2]
    keys, values = (k_prefix, k), (v_prefix, v)
    if sink:
        sink_k, sink_v = sink_key(k)
        keys, values = (sink_k, *keys), (sink_v, *values)
    keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    key_positions = torch.arange(reach + count, device=q.device)
    mask = visible(key_positions[reach:], key_positions, window, sink)
    if gqa and q.is_cuda:  # torch's memory-efficient kernel (an explicit mask) refuses enable_gqa: repeat K/V heads
        repeat = q.shape[1] // keys.shape[1]
        keys, values, gqa = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1), False
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
