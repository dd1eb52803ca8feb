"""How a mini-batch is laid out over DP ranks and micro-batches, and what its loss averages over.

Every rank holds the whole mini-batch and derives the same split from it, so every rank runs the same number of
forwards (MoE all-to-alls are collective) without an extra collective.

Two layouts, both as `MicroBatch` lists: one row per completion (`row_micro_batches`) and shared-prefix group rows
(`group_micro_batches`, trainer/group_rows.py). Either way a micro-batch carries its rows in the original [b, L]
layout, so the loss, its units and the metrics are computed exactly as without sharing.

Packed (`packed=True`, trainer.packed_rows, the default): a micro-batch is forwarded as ONE packed row, its
sequences (or group rows) one after another, each its own causal unit with positions from 0
(segment_attention.Segments(packed=True)): no padding tokens are forwarded but a tail of fewer than TP tokens under
sequence parallelism (its width a multiple of TP; the tail attends to nothing and scores nothing). Its budget
(`packed_budget`) counts real tokens: at most micro_batch_size sequences and micro_batch_tokens tokens. Unshared
rows are then planned like group rows of one sequence each (`plan_rows`: dealt to DP ranks by cost, first-fit into
micro-batches). Not packed: padded rows (DP ranks take contiguous rows, R = micro_batch_rows rows of the longest
row's width each) and padded group rows; Routing Replay and the routing-noise probe record per padded row, so
their forwards keep this layout.

Group rows over DP (`plan_ranks`, pure lists, also what bench/scale.py runs at cluster shapes):
  1. plan the mini-batch's group rows, at most min(micro_batch_size, ceil(B / dp)) completions each and no wider
     than one micro-batch's tokens (packed: `packed_budget`, micro_batch_tokens real tokens; padded:
     `padded_budget`, R x L, R = micro_batch_rows, L = the longest row, so the shared layout never holds more
     activations than the padded one; attention by segment holds no score matrix, so nothing else caps a group
     row's width); while there are fewer group rows than ranks, the one with the most rows is halved (so B >= dp
     rows leave no rank idle), and group rows costing more than a quarter of a rank's share (SPLIT_SHARE) are
     halved too: their completions dealt over several group rows, each with its own copy of the prompt;
  2. deal the group rows to the ranks by cost (`row_cost`: tokens plus the query-key pairs attention by segment
     computes, weighted: exactly what a packed row computes, which forwards no padding) and tokens at once,
     largest cost first to the rank whose larger normalised load (cost over the mean cost, tokens over the mean
     tokens) is least (LPT on that load);
  3. put each rank's group rows into micro-batches within the budget (rows and tokens).
Ranks with fewer micro-batches than the busiest get dummies (one fully masked copy of row 0).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from gspo_ray.data.records import TrainBatch
from gspo_ray.trainer.group_rows import (
    GroupLayout,
    GroupRow,
    build_layout,
    halve,
    pack_group_rows,
    plan_units,
    prefix_groups,
    warn_once,
)


# A group row costing more than 1 / SPLIT_SHARE of a rank's share of the mini-batch is split (its completions over
# several group rows, each repeating the prompt). 4 rather than 2: finer pieces let the deal even the ranks out at
# large DP, at the cost of more prompt copies forwarded (the scale model's numbers, with the cost-and-token deal
# beside it: docs/scale.md, "What it shows")
SPLIT_SHARE = 4


@dataclass
class MicroBatch:
    """One forward/backward: `batch` holds its rows in the original layout (trimmed to their longest), `rows` their
    indices in the mini-batch (-1: a fully masked padding row that only keeps the ranks' forwards equal), `layout`
    the shared-prefix group rows to forward instead of batch.tokens (None: forward the padded rows)."""

    batch: TrainBatch
    rows: list[int]
    layout: GroupLayout | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the forward computes (padding included)."""
        return self.layout.num_tokens if self.layout is not None else int(self.batch.tokens.numel())


def split_rows(batch: TrainBatch, dp_rank: int, dp_size: int) -> TrainBatch:
    """This DP rank's contiguous share of the rows; the batch is first padded with fully masked rows (copies of
    row 0 with loss_mask 0) so every rank gets the same number of rows and runs the same number of forwards
    (MoE all-to-alls are collective)."""
    b = batch.num_sequences
    per_rank = math.ceil(b / dp_size)
    rows = list(range(b)) + [0] * (per_rank * dp_size - b)
    local = batch.select(rows[dp_rank * per_rank:(dp_rank + 1) * per_rank])
    pad_from = max(0, min(per_rank, b - dp_rank * per_rank))  # local index where padding rows start
    if pad_from < per_rank:
        local.loss_mask[pad_from:] = 0
        local.adv[pad_from:] = 0
    return local


def micro_batch_rows(batch: TrainBatch, micro_batch_size: int, micro_batch_tokens: int | None) -> int:
    """Rows per micro-batch: micro_batch_size, lowered so rows x the longest row of the whole mini-batch fit in
    micro_batch_tokens (padded_budget). Every rank holds the whole mini-batch, so every rank gets the same count
    and runs the same number of forwards (MoE all-to-alls are collective)."""
    if batch.num_sequences == 0:
        return micro_batch_size
    return padded_budget(int(batch.lengths.max()), micro_batch_size, micro_batch_tokens).rows


def micro_batches(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    """Consecutive chunks of `micro_batch_size` rows, each trimmed to its longest row (less padding computed)."""
    return [trim(batch.select(list(range(start, min(start + micro_batch_size, batch.num_sequences)))))
            for start in range(0, batch.num_sequences, micro_batch_size)]


def loss_units(mask: torch.Tensor, aggregation: str) -> float:
    """What the aggregation averages over: tokens for token-mean, sequences with >= 1 trained token otherwise."""
    mask = mask.bool()
    return float(mask.sum()) if aggregation == "token-mean" else float(mask.any(dim=-1).sum())


def routing_keys(mb: TrainBatch) -> list[str]:
    """Per-row keys of recorded routing (R2, drift): the sample uid plus a hash of the row's tokens, so a uid that
    comes back with other tokens (a requeued prompt's fresh samples) is a new sequence, not a replay of the old."""
    rows, lengths = mb.tokens.tolist(), mb.lengths.tolist()
    return [f"{uid}#{hash(tuple(row[:n]))}" for uid, row, n in zip(mb.uids, rows, lengths)]


def trim(batch: TrainBatch) -> TrainBatch:
    """The rows cut to their longest row (width >= 1)."""
    return batch.narrow(max(int(batch.lengths.max()), 1) if batch.num_sequences else 1)


def row_micro_batches(batch: TrainBatch, dp_rank: int, dp_size: int, micro_batch_size: int,
                      micro_batch_tokens: int | None, packed: bool = False, width_multiple: int = 1,
                      score_weight: float = 0.0) -> list[MicroBatch]:
    """One row per completion (the layout without sharing). Packed: plan_rows, each micro-batch one packed row of
    width a multiple of width_multiple (TP under sequence parallelism), ranks short of micro-batches padded with
    dummies. Padded: split_rows, then micro_batches of micro_batch_rows rows."""
    b = batch.num_sequences
    if dp_rank == 0:
        warn_unbalanced(b, dp_size)
    if packed:
        plan = plan_rows([int(n) for n in batch.lengths.tolist()], dp_size, micro_batch_size, micro_batch_tokens,
                         score_weight)
        return pad_forwards([pack_micro_batch(batch, pack, width_multiple, True) for pack in plan[dp_rank]],
                            plan, batch, width_multiple, True)
    per_rank = math.ceil(b / dp_size)
    index = [i if i < b else -1 for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)]
    rows = micro_batch_rows(batch, micro_batch_size, micro_batch_tokens)
    out = []
    for k, mb in enumerate(micro_batches(split_rows(batch, dp_rank, dp_size), rows)):
        out.append(MicroBatch(batch=mb, rows=index[k * rows:k * rows + mb.num_sequences]))
    return out


@dataclass(frozen=True)
class Budget:
    """What one padded micro-batch holds at most: `rows` rows of `tokens` padded tokens in all."""

    rows: int
    tokens: int


def padded_budget(longest: int, micro_batch_size: int, micro_batch_tokens: int | None) -> Budget:
    """The padded path's micro-batch for a mini-batch whose longest row has `longest` tokens: R = micro_batch_rows
    rows of width L = longest, so R x L tokens."""
    if micro_batch_tokens is None:
        rows = micro_batch_size
    else:
        rows = max(1, min(micro_batch_size, micro_batch_tokens // max(longest, 1)))
    width = max(longest, 1)
    return Budget(rows=rows, tokens=rows * width)


def packed_budget(longest: int, micro_batch_size: int, micro_batch_tokens: int | None) -> Budget:
    """The packed path's micro-batch: at most micro_batch_size sequences and micro_batch_tokens real tokens (at
    least the longest row: a row over the cap still trains, alone); without micro_batch_tokens, what one padded
    micro-batch of micro_batch_size rows of the longest row holds."""
    width = max(longest, 1)
    tokens = micro_batch_size * width if micro_batch_tokens is None else max(micro_batch_tokens, width)
    return Budget(rows=micro_batch_size, tokens=tokens)


def attention_score_weight(hidden: int, attn_dim: int, ffn_active: int) -> float:
    """Cost of one query-key pair of attention relative to one token through the layer's matrices, per layer and
    forward: a token costs 2 (4 h d + 3 h f) FLOPs (q, k, v, o projections of width d = heads x head_dim; a gated
    MLP of active width f: experts top-k x their width for an MoE), a pair 4 d (its score in Q K^T and its term
    of A V). Attention by segment computes only the pairs its causal segments allow (GroupRow.pairs:
    P (P + 1) / 2 + sum_j c_j (P + (c_j + 1) / 2)), so a group row costs W + weight x pairs tokens, in a packed
    row as alone (padding, forwarded only at a packed row's tail, computes no pair)."""
    return 2.0 * attn_dim / (4.0 * hidden * attn_dim + 3.0 * hidden * ffn_active)


def model_score_weight(config) -> float:
    """attention_score_weight of a Megatron TransformerConfig (dense or MoE: top-k experts, plus a shared one)."""
    attn = config.num_attention_heads * (config.kv_channels or config.hidden_size // config.num_attention_heads)
    ffn = config.ffn_hidden_size
    if getattr(config, "num_moe_experts", None):
        ffn = (config.moe_ffn_hidden_size or ffn) * config.moe_router_topk
        ffn += getattr(config, "moe_shared_expert_intermediate_size", None) or 0
    return attention_score_weight(config.hidden_size, attn, ffn)


def row_cost(unit: GroupRow, score_weight: float) -> float:
    """The forward cost of one group row in tokens: W + score_weight x its query-key pairs (attention_score_weight)."""
    return unit.length + score_weight * unit.pairs


def split_costly(unit: GroupRow, cap: float, score_weight: float) -> list[GroupRow]:
    """unit halved (recursively) until each part costs at most cap or holds one row."""
    if len(unit.rows) < 2 or row_cost(unit, score_weight) <= cap:
        return [unit]
    a, b = halve(unit)
    return split_costly(a, cap, score_weight) + split_costly(b, cap, score_weight)


def deal_rows(units: list[GroupRow], dp_size: int, score_weight: float) -> list[list[GroupRow]]:
    """Group rows per DP rank, balancing two loads at once: cost (row_cost: FLOPs, what the step waits on) and
    tokens (what the activations and train/dp_imbalance count). Largest cost first, each to the rank whose load
    max(cost / C, tokens / T) is least (C, T: the mean cost and tokens a rank; ties: the lower rank). Dealt by cost
    alone, a rank holding a long row (its attention costs more per token) got few tokens and one of short rows
    many: 1.09-1.15 in tokens at DP 256 (docs/scale.md). Deterministic."""
    cost = [row_cost(u, score_weight) for u in units]
    mean_cost = sum(cost) / dp_size or 1.0
    mean_tokens = sum(u.length for u in units) / dp_size or 1.0
    ranks: list[list[GroupRow]] = [[] for _ in range(dp_size)]
    heap = [(0.0, r, 0.0, 0) for r in range(dp_size)]  # (load, rank, cost, tokens): the least loaded on top
    for i in sorted(range(len(units)), key=lambda i: (-cost[i], i)):
        _, r, c, t = heapq.heappop(heap)
        ranks[r].append(units[i])
        c, t = c + cost[i], t + units[i].length
        heapq.heappush(heap, (max(c / mean_cost, t / mean_tokens), r, c, t))
    return ranks


def plan_rows(lengths: list[int], dp_size: int, micro_batch_size: int, micro_batch_tokens: int | None,
              score_weight: float = 0.0) -> list[list[list[GroupRow]]]:
    """Packed micro-batches of unshared rows for every DP rank: each row a unit of its own (one causal sequence),
    dealt to the ranks by cost (deal_rows), then first-fit into micro-batches within packed_budget."""
    units = [GroupRow((b,), n, (0,)) for b, n in enumerate(lengths)]
    cap = packed_budget(max(lengths, default=1), micro_batch_size, micro_batch_tokens).tokens
    return [pack_group_rows(mine, micro_batch_size, cap, packed=True)
            for mine in deal_rows(units, dp_size, score_weight)]


def plan_ranks(groups: list[tuple[list[int], int]], lengths: list[int], dp_size: int, micro_batch_size: int,
               micro_batch_tokens: int | None, score_weight: float = 0.0, uids: list[str] | None = None,
               packed: bool = False) -> list[list[list[GroupRow]]] | None:
    """Micro-batches (packs of group rows) of every DP rank, or None when nothing is shared (see the module
    docstring). groups: (rows, common prefix) per prompt; lengths: every row's length; packed: the micro-batches
    are packed rows (budget in real tokens) rather than padded ones."""
    num_rows = len(lengths)
    budget = packed_budget if packed else padded_budget
    cap = budget(max(lengths, default=1), micro_batch_size, micro_batch_tokens).tokens
    max_rows = max(1, min(micro_batch_size, math.ceil(num_rows / dp_size)))
    units = plan_units(groups, lengths, max_rows, cap, uids)
    if units is None:
        return None
    while len(units) < dp_size:  # fewer group rows than ranks: halve the one with the most rows
        i = max(range(len(units)), key=lambda i: (len(units[i].rows), -i))
        if len(units[i].rows) < 2:
            break
        units[i:i + 1] = halve(units[i])
    if dp_size > 1:  # no group row above 1 / SPLIT_SHARE of a rank's share, so the deal can even the ranks out
        share = sum(row_cost(u, score_weight) for u in units) / (SPLIT_SHARE * dp_size)
        units = [part for u in units for part in split_costly(u, share, score_weight)]
    return [pack_group_rows(mine, micro_batch_size, cap, packed)
            for mine in deal_rows(units, dp_size, score_weight)]


def warn_unbalanced(num_rows: int, dp_size: int) -> None:
    """Said once per process (rank 0 of the caller's choosing) when some DP ranks get no row at all."""
    if num_rows < dp_size:
        warn_once("dp_starved", "a mini-batch of %d rows over %d DP ranks: %d ranks get no row and forward a fully "
                  "masked dummy (more completions per step, or fewer trainer ranks, balance it)",
                  num_rows, dp_size, dp_size - num_rows)


def group_micro_batches(batch: TrainBatch, dp_rank: int, dp_size: int, micro_batch_size: int,
                        micro_batch_tokens: int | None, width_multiple: int = 1,
                        score_weight: float = 0.0, packed: bool = False,
                        match_routes: bool = False) -> list[MicroBatch] | None:
    """Shared-prefix micro-batches of this DP rank, or None when the batch has nothing to share.

    Every rank runs plan_ranks on the whole mini-batch (the same on every rank) and builds its own packs; ranks
    short of micro-batches get dummies (one fully masked copy of row 0), so every rank runs the same number of
    forwards (MoE all-to-alls are collective). width_multiple: TP under sequence parallelism (the sequence is
    split over TP ranks). score_weight: attention_score_weight of the model (0: cost = tokens). packed: each
    micro-batch one packed row of its group rows. match_routes: a shared prefix also ends where the rows' engine
    routes disagree (R3 replays them; group_rows.prefix_groups)."""
    groups = prefix_groups(batch, match_routes)
    if groups is None:
        return None
    lengths = [int(n) for n in batch.lengths.tolist()]
    plan = plan_ranks(groups, lengths, dp_size, micro_batch_size, micro_batch_tokens, score_weight, batch.uids,
                      packed)
    if plan is None:
        return None
    if dp_rank == 0:
        warn_unbalanced(len(lengths), dp_size)
    out = [pack_micro_batch(batch, pack, width_multiple, packed) for pack in plan[dp_rank]]
    return pad_forwards(out, plan, batch, width_multiple, packed)


def pad_forwards(out: list[MicroBatch], plan: list[list[list[GroupRow]]], batch: TrainBatch, width_multiple: int,
                 packed: bool) -> list[MicroBatch]:
    """This rank's micro-batches `out`, with dummies up to the busiest rank's count in `plan`."""
    while len(out) < max(len(p) for p in plan):
        out.append(dummy_micro_batch(batch, width_multiple, packed))
    return out


def pack_micro_batch(batch: TrainBatch, pack: list[GroupRow], width_multiple: int,
                     packed: bool = False) -> MicroBatch:
    """The MicroBatch of group rows `pack` (whose rows index `batch`): its rows in pack order and their layout."""
    rows = [r for u in pack for r in u.rows]
    local = {r: i for i, r in enumerate(rows)}
    units = [GroupRow(tuple(local[r] for r in u.rows), u.prefix, u.segments) for u in pack]
    sub = trim(batch.select(rows))
    return MicroBatch(batch=sub, rows=rows, layout=build_layout(sub, units, width_multiple, packed))


def dummy_micro_batch(batch: TrainBatch, width_multiple: int, packed: bool = False) -> MicroBatch:
    """One fully masked copy of row 0 (loss_mask and adv 0): a forward/backward that trains nothing."""
    sub = trim(batch.select([0]))
    sub.loss_mask.zero_()
    sub.adv.zero_()
    n = int(sub.lengths[0])
    return MicroBatch(batch=sub, rows=[-1],
                      layout=build_layout(sub, [GroupRow((0,), n, (0,))], width_multiple, packed))
