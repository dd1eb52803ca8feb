"""Gated DeltaNet by segment: the short convolution and the gated delta rule run per segment of a Segments record
(trainer/attention/segment_attention.py), as attention by segment does.

    core = delta_rows(mixed_qkv, log_decay, beta, conv_weight, segs, heads)   # [S, B, C] ... -> [S, B, Hv, Dv]

Both pieces of a GatedDeltaNet layer that carry information along the sequence hold a state: the causal
depthwise convolution (kernel K: its state is the last K - 1 inputs) and the recurrence (S, [Hv, Dk, Dv]). Per unit
of a row (a sequence, or a group row's prefix and its completions):

  - the prefix runs from zero states (zero convolution inputs before its first token, S = 0): a packed row's
    sequences restart at their first token, nothing of the unit before reaches them;
  - each completion runs from the prefix's FINAL states (its last K - 1 convolution inputs, its S), exactly as
    its own row [prefix ; completion] would compute it: the prefix is computed once for the G completions, the
    shared-prefix saving of attention by segment, now for linear attention;
  - padding outputs 0 and reaches no state.

Per segment the input mixed_qkv [n, C] (C = 2 Hk Dk + Hv Dv, the convolution channels [q | k | v]) is convolved
(then SiLU), split into q [n, Hk, Dk], k, v [n, Hv, Dv], q and k L2-normalised and repeated per value head
(Hv / Hk value heads share a key head), and the rule runs (delta_rule.py). The recurrences of all prefixes run as
one batch of sequences, then all completions with their prefixes' states (delta_rule.run_sequences: one varlen
kernel call each on CUDA with flash-linear-attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gspo_ray.trainer.attention.segment_attention import Segments
from gspo_ray.trainer.gated_delta.delta_rule import l2norm, run_sequences


@dataclass(frozen=True)
class DeltaHeads:
    """Head counts and sizes of a GatedDeltaNet layer (Qwen3-Next's linear_num_key_heads, linear_key_head_dim,
    linear_num_value_heads, linear_value_head_dim)."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    def __post_init__(self):
        if min(self.key_heads, self.key_dim, self.value_heads, self.value_dim) <= 0:
            raise ValueError(f"DeltaHeads: non-positive head count or size {self}")
        if self.value_heads % self.key_heads:
            raise ValueError(f"DeltaHeads: {self.value_heads} value heads are not a multiple of {self.key_heads} "
                             "key heads")

    @property
    def channels(self) -> int:
        """Convolution channels [q | k | v]: 2 Hk Dk + Hv Dv."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def causal_conv(x: Tensor, weight: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution then SiLU: x [n, C], weight [C, K], state [K - 1, C] (the inputs just before
    x; None: zeros) -> (y [n, C], the new state: the last K - 1 inputs of [state ; x]).
    y_t = silu(sum_{j<K} weight[:, j] * in_{t - K + 1 + j}) over in = [state ; x]."""
    width = weight.shape[1] - 1
    if state is None:
        state = x.new_zeros(width, x.shape[1])
    if x.shape[0] == 0:  # an empty segment (a unit without prefix): nothing to convolve, the state passes through
        return x, state.to(x.dtype)
    full = torch.cat((state.to(x.dtype), x)).to(weight.dtype)
    n = x.shape[0]
    # K shifted multiply-adds: a depthwise kernel of 4 taps (torch's conv1d on CPU is far slower at this shape)
    y = sum(full[j:j + n] * weight[:, j] for j in range(weight.shape[1]))
    return F.silu(y).to(x.dtype), full[full.shape[0] - width:].to(x.dtype)


def _qkv(y: Tensor, heads: DeltaHeads) -> tuple[Tensor, Tensor, Tensor]:
    """Convolved channels [n, C] -> q, k [n, Hv, Dk] (L2-normalised, repeated per value head), v [n, Hv, Dv]."""
    key_width = heads.key_heads * heads.key_dim
    q, k, v = y.split((key_width, key_width, heads.value_heads * heads.value_dim), dim=-1)
    repeat = heads.value_heads // heads.key_heads
    q, k = (l2norm(x.unflatten(-1, (heads.key_heads, heads.key_dim))).repeat_interleave(repeat, dim=1)
            for x in (q, k))
    return q, k, v.unflatten(-1, (heads.value_heads, heads.value_dim))


def delta_rows(mixed_qkv: Tensor, log_decay: Tensor, beta: Tensor, conv_weight: Tensor, segs: Segments,
               heads: DeltaHeads) -> Tensor:
    """mixed_qkv [S, B, C] (before the convolution), log_decay / beta [S, B, Hv], conv_weight [C, K] -> the rule's
    output [S, B, Hv, Dv] for the segments `segs` (the module docstring); padding columns are 0."""
    width, batch = mixed_qkv.shape[:2]
    if segs.num_rows != batch:
        raise ValueError(f"Segments of {segs.num_rows} rows for a micro-batch of {batch}")
    # per unit: (row, start column, prefix length, completion lengths)
    units = []
    for row in range(batch):
        start = 0
        for u in segs.units(row):
            units.append((row, start, segs.prefix[u], segs.completions[u]))
            start += segs.unit_length(u)
        if start > width:
            raise ValueError(f"row {row}: segments of {start} tokens in a width of {width}")

    def piece(row, start, n, conv_state):
        y, conv_out = causal_conv(mixed_qkv[start:start + n, row], conv_weight, conv_state)
        return (*_qkv(y, heads), log_decay[start:start + n, row], beta[start:start + n, row]), conv_out

    prefixes = [piece(row, start, p, None) for row, start, p, _ in units]
    prefix_runs = run_sequences([p for p, _ in prefixes], [None] * len(prefixes))
    placed = [(row, start, out) for (row, start, _, _), (out, _) in zip(units, prefix_runs)]  # (row, column, out)
    completions, states, places = [], [], []
    for (row, start, p, cs), (_, conv_state), (_, rec_state) in zip(units, prefixes, prefix_runs):
        at = start + p
        for c in cs:
            completions.append(piece(row, at, c, conv_state)[0])
            states.append(rec_state)
            places.append((row, at))
            at += c
    placed += [(row, at, out) for (row, at), (out, _) in zip(places, run_sequences(completions, states))]
    rows = []
    for row in range(batch):  # each row: its pieces in column order, then zero padding
        pieces = [out for _, _, out in sorted((p for p in placed if p[0] == row), key=lambda p: p[1])]
        pad = width - sum(o.shape[0] for o in pieces)
        pieces.append(mixed_qkv.new_zeros(pad, heads.value_heads, heads.value_dim))
        rows.append(torch.cat(pieces))
    return torch.stack(rows, dim=1)
