"""How a mini-batch is laid out over DP ranks and micro-batches, and what its loss averages over.

Every rank holds the whole mini-batch and derives the same split from it, so every rank runs the same number of
forwards (MoE all-to-alls are collective) without an extra collective.

Two layouts, both as `MicroBatch` lists: padded rows (`row_micro_batches`: one row per completion, DP ranks take
contiguous rows) and shared-prefix group rows (`group_micro_batches`, trainer/group_rows.py: DP ranks take whole
prompt groups). Either way a micro-batch carries its rows in the original [b, L] layout, so the loss, its units
and the metrics are computed exactly as without sharing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gspo_ray.data.records import TrainBatch
from gspo_ray.trainer.group_rows import GroupLayout, GroupRow, build_layout, pack_group_rows, plan_group_rows


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
    micro_batch_tokens. Every rank holds the whole mini-batch, so every rank gets the same count and runs the same
    number of forwards (MoE all-to-alls are collective)."""
    if micro_batch_tokens is None or batch.num_sequences == 0:
        return micro_batch_size
    return max(1, min(micro_batch_size, micro_batch_tokens // max(int(batch.lengths.max()), 1)))


def micro_batches(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    """Consecutive chunks of `micro_batch_size` rows, each trimmed to its longest row (less padding computed)."""
    out = []
    for start in range(0, batch.num_sequences, micro_batch_size):
        mb = batch.select(list(range(start, min(start + micro_batch_size, batch.num_sequences))))
        width = max(int(mb.lengths.max()), 1)
        out.append(TrainBatch(
            tokens=mb.tokens[:, :width], loss_mask=mb.loss_mask[:, :width], old_logp=mb.old_logp[:, :width],
            adv=mb.adv[:, :width], lengths=mb.lengths,
            ref_logp=None if mb.ref_logp is None else mb.ref_logp[:, :width], uids=mb.uids,
            rollout_logp=None if mb.rollout_logp is None else mb.rollout_logp[:, :width]))
    return out


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
    width = max(int(batch.lengths.max()), 1) if batch.num_sequences else 1
    return TrainBatch(
        tokens=batch.tokens[:, :width], loss_mask=batch.loss_mask[:, :width], old_logp=batch.old_logp[:, :width],
        adv=batch.adv[:, :width], lengths=batch.lengths,
        ref_logp=None if batch.ref_logp is None else batch.ref_logp[:, :width], uids=batch.uids,
        rollout_logp=None if batch.rollout_logp is None else batch.rollout_logp[:, :width])


def row_micro_batches(batch: TrainBatch, dp_rank: int, dp_size: int, micro_batch_size: int,
                      micro_batch_tokens: int | None) -> list[MicroBatch]:
    """Padded rows: split_rows, then micro_batches of micro_batch_rows rows (the layout without sharing)."""
    b = batch.num_sequences
    per_rank = math.ceil(b / dp_size)
    index = [i if i < b else -1 for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)]
    rows = micro_batch_rows(batch, micro_batch_size, micro_batch_tokens)
    out = []
    for k, mb in enumerate(micro_batches(split_rows(batch, dp_rank, dp_size), rows)):
        out.append(MicroBatch(batch=mb, rows=index[k * rows:k * rows + mb.num_sequences]))
    return out


def group_micro_batches(batch: TrainBatch, dp_rank: int, dp_size: int, micro_batch_size: int,
                        micro_batch_tokens: int | None, width_multiple: int = 1) -> list[MicroBatch] | None:
    """Shared-prefix micro-batches of this DP rank, or None when the batch has nothing to share.

    Group rows are planned and packed over the whole mini-batch (group_rows.plan_group_rows / pack_group_rows,
    the same on every rank), then dealt to the DP ranks (`deal`), so a prompt group never straddles ranks and
    ranks get similar work; ranks short of micro-batches get dummies (one fully masked copy of row 0), so every
    rank runs the same number of forwards (MoE all-to-alls are collective). width_multiple: TP under sequence
    parallelism (the sequence is split over TP ranks)."""
    units = plan_group_rows(batch, micro_batch_size, micro_batch_tokens)
    if units is None:
        return None
    packs = pack_group_rows(units, micro_batch_size, micro_batch_tokens)
    per_rank = math.ceil(len(packs) / dp_size)
    mine = [packs[i] for i in deal(packs, dp_size, per_rank)[dp_rank]]
    out = [pack_micro_batch(batch, pack, width_multiple) for pack in mine]
    while len(out) < per_rank:
        out.append(dummy_micro_batch(batch, width_multiple))
    return out


def deal(packs: list[list[GroupRow]], dp_size: int, per_rank: int) -> list[list[int]]:
    """Pack indices per DP rank: each pack (largest padded token count first) to the rank with the fewest tokens
    so far among those holding fewer than per_rank packs (ties: the lower rank). Deterministic."""
    cost = [len(p) * max(u.length for u in p) for p in packs]
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in sorted(range(len(packs)), key=lambda i: (-cost[i], i)):
        r = min((r for r in range(dp_size) if len(ranks[r]) < per_rank), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += cost[i]
    return [sorted(r) for r in ranks]


def pack_micro_batch(batch: TrainBatch, pack: list[GroupRow], width_multiple: int) -> MicroBatch:
    """The MicroBatch of group rows `pack` (whose rows index `batch`): its rows in pack order and their layout."""
    rows = [r for u in pack for r in u.rows]
    local = {r: i for i, r in enumerate(rows)}
    units = [GroupRow(tuple(local[r] for r in u.rows), u.prefix, u.segments) for u in pack]
    sub = trim(batch.select(rows))
    return MicroBatch(batch=sub, rows=rows, layout=build_layout(sub, units, width_multiple))


def dummy_micro_batch(batch: TrainBatch, width_multiple: int) -> MicroBatch:
    """One fully masked copy of row 0 (loss_mask and adv 0): a forward/backward that trains nothing."""
    sub = trim(batch.select([0]))
    sub.loss_mask.zero_()
    sub.adv.zero_()
    n = int(sub.lengths[0])
    return MicroBatch(batch=sub, rows=[-1], layout=build_layout(sub, [GroupRow((0,), n, (0,))], width_multiple))
