"""How a mini-batch is laid out over DP ranks and micro-batches, and what its loss averages over.

Every rank holds the whole mini-batch and derives the same split from it, so every rank runs the same number of
forwards (MoE all-to-alls are collective) without an extra collective.
"""
from __future__ import annotations

import math

import torch

from gspo_ray.data.records import TrainBatch


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
