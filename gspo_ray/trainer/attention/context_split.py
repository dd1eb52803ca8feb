"""Context parallelism by segment: which columns of a row each CP rank holds, and attention of those columns'
queries against the whole row's keys and values (torch only; the collectives are trainer/context_parallel.py).

    cols = cp_columns(width, cp, rank)          # [width / cp] long: this rank's columns, in its local order
    out = attend_columns(q_local, k_full, v_full, segs, cols, scale)   # [width / cp, B, Hq, Dv]

The split (zig-zag, Megatron's load-balanced CP layout). A row of width W (a multiple of 2 cp: `width_multiple`) is
cut into 2 cp chunks of W / (2 cp) columns; rank r holds chunk r and chunk 2 cp - 1 - r, in that order:

    cp 2, W 8:   rank 0: columns 0 1 | 6 7      rank 1: columns 2 3 | 4 5

Causal attention costs a query at column x about x keys, so an early chunk paired with the mirrored late one gives
every rank the same work on one long causal row. Packed rows and group rows are cut the same way, by column,
whatever their segments: a rank's queries are the columns it holds, each attending exactly as the whole row's
query at that column would (`attend_columns`), so the split is exact for any segment layout; the balance is exact
for one long segment and close when the segments are many and short (each chunk holds pieces of them). RoPE needs
nothing more: each held column keeps its own position (`position_ids[:, cols]`).

Attention of held columns. Each rank holds the keys and values of every column (all-gathered in the natural column
order, context_parallel.gather_columns). For a run of consecutive held columns [a, b) and each segment [s, e) of the
row it meets, the piece [max(a, s), min(b, e)) of n queries attends to

    keys  = [prefix of its unit (a completion only)] ++ columns s .. min(b, e) - 1 of its own segment

with causality aligned bottom-right (query i sees every key up to K - n + i, K keys): the prefix wholly and its own
segment up to itself, which is exactly the row of segment_attention.attend_rows at that column. One SDPA call per
piece (at most 2 runs x the segments they meet per row); padding columns output 0 as there. A completion piece with
a prefix runs under activation checkpointing as in attend_rows (its gathered [prefix ; segment] keys are not kept).

Work per rank: the query-key pairs of its pieces (`column_pairs`); summed over the ranks they are the row's
`Segments.pairs()`, each pair computed once.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gspo_ray.trainer.attention.segment_attention import (Segments, checkpointed_call, equal_widths,
                                                          lower_right_attention)


def width_multiple(cp: int) -> int:
    """What a row's width must be a multiple of at CP size cp: 2 cp chunks (1 without CP)."""
    return 2 * cp if cp > 1 else 1


def cp_columns(width: int, cp: int, rank: int) -> Tensor:
    """This rank's columns of a row of `width` (a multiple of 2 cp): chunk rank, then chunk 2 cp - 1 - rank."""
    if cp == 1:
        return torch.arange(width)
    if width % (2 * cp):
        raise ValueError(f"row width {width} is not a multiple of 2 x cp = {2 * cp}")
    chunk = width // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))


def natural_order(width: int, cp: int) -> Tensor:
    """idx such that cat(rank 0's columns, .., rank cp-1's columns)[idx] is the row in column order."""
    held = torch.cat([cp_columns(width, cp, r) for r in range(cp)])
    return torch.argsort(held)


def runs(columns: Tensor) -> list[tuple[int, int, int]]:
    """Consecutive runs of `columns` as (local offset, first column, end column)."""
    cols = columns.tolist()
    out, start = [], 0
    for i in range(1, len(cols) + 1):
        if i == len(cols) or cols[i] != cols[i - 1] + 1:
            out.append((start, cols[start], cols[i - 1] + 1))
            start = i
    return out


def row_segments(segs: Segments, row: int) -> list[tuple[int, int, int, int]]:
    """Segments of row `row` as (start, end, prefix start, prefix length): a unit's prefix has prefix length 0 (it
    attends to itself), each completion its unit's prefix."""
    out, offset = [], 0
    for u in segs.units(row):
        p = segs.prefix[u]
        if p:
            out.append((offset, offset + p, offset, 0))
        start = offset + p
        for c in segs.completions[u]:
            if c:
                out.append((start, start + c, offset, p))
            start += c
        offset = start
    return out


def column_pairs(segs: Segments, columns: Tensor, row: int = 0) -> int:
    """Query-key pairs the pieces of `columns` in row `row` compute (summed over all ranks: segs' row pairs)."""
    total = 0
    for _, a, b in runs(columns):
        for s, e, _, p in row_segments(segs, row):
            lo, hi = max(a, s), min(b, e)
            total += sum(p + x - s + 1 for x in range(lo, hi))
    return total


def attend_columns(query: Tensor, key: Tensor, value: Tensor, segs: Segments, columns: Tensor,
                   scale: float | None = None, *, checkpoint_completions: bool = True) -> Tensor:
    """query [n, B, Hq, D] at row columns `columns` ([n] long, this rank's); key [W, B, Hkv, D], value
    [W, B, Hkv, Dv], the whole rows in column order -> context [n, B, Hq, Dv]: for each held column exactly what
    attend_rows gives that column of the whole row (module docstring). Dv != D: padded as attend_rows does."""
    value_dim = value.shape[-1]
    if value_dim != query.shape[-1]:
        query, key, value, scale = equal_widths(query, key, value, scale)
        return attend_columns(query, key, value, segs, columns, scale,
                              checkpoint_completions=checkpoint_completions)[..., :value_dim]
    width, batch, heads = key.shape[0], query.shape[1], query.shape[2]
    if segs.num_rows != batch:
        raise ValueError(f"Segments of {segs.num_rows} rows for a micro-batch of {batch}")
    gqa = key.shape[2] != heads
    spans = runs(columns)
    rows = []
    for r, (q, k, v) in enumerate(zip(query.unbind(1), key.unbind(1), value.unbind(1))):
        if segs.length(r) > width:
            raise ValueError(f"row {r}: segments of {segs.length(r)} tokens in a width of {width}")
        # [1, H, n, D] views, as attend_rows hands the fused kernel
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        pieces = []
        for offset, a, b in spans:
            done = a
            for s, e, ps, p in row_segments(segs, r):
                lo, hi = max(a, s), min(b, e)
                if lo >= hi:
                    continue
                if lo > done:  # padding columns between (only at a row's tail): nothing to attend to
                    pieces.append(q.new_zeros(1, heads, lo - done, q.shape[-1]))
                qq = q[:, :, offset + lo - a:offset + hi - a]
                args = (qq, k[:, :, ps:ps + p], k[:, :, s:hi], v[:, :, ps:ps + p], v[:, :, s:hi], scale, gqa)
                pieces.append(checkpointed_call(lower_right_attention, *args) if p and checkpoint_completions
                              else lower_right_attention(*args))
                done = hi
            if done < b:
                pieces.append(q.new_zeros(1, heads, b - done, q.shape[-1]))
        rows.append(torch.cat(pieces, dim=2)[0].transpose(0, 1))  # [n, H, D]
    return torch.stack(rows, dim=1)

