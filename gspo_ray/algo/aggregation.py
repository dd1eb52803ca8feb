"""How per-token losses become one scalar: the single place that averages tokens and sequences.

    from gspo_ray.algo.aggregation import aggregate
    loss = aggregate(loss_tok, mask, "seq-mean-token-mean")

Modes (``AGGREGATIONS``):
- ``seq-mean-token-mean`` (default; GSPO requires it): mean over each completion's loss-masked tokens, then mean
  over completions. Every completion weighs the same whatever its length.
- ``token-mean`` (DAPO): sum over all loss-masked tokens / their count. Long completions weigh more.
- ``seq-mean-token-sum-norm`` (Dr.GRPO): sum over each completion's tokens / a constant ``norm_len``, then mean
  over completions. ``norm_len`` defaults to the padded width T, so pass it explicitly (e.g. the max response
  length) when the padded width varies between batches.

Masked positions never reach the result: they are selected away with ``torch.where`` (never multiplied by 0), so
nan/inf in padding cannot leak into the value or the gradient. Completions with no loss-masked token are left out
of the sequence means.
"""

from __future__ import annotations

import torch
from torch import Tensor

SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
AGGREGATIONS = (SEQ_MEAN_TOKEN_MEAN, TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM_NORM)
# Aggregations where a completion's weight grows with its length; with `sequence` (GSPO) the sequence ratio is
# shared by all tokens, so these would re-weight whole completions by length, which GSPO is defined without.
LENGTH_WEIGHTED_AGGREGATIONS = (TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM_NORM)


def check_aggregation(mode: str) -> None:
    """Raise ValueError naming the valid modes when `mode` is unknown."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def check_level_aggregation(level: str, aggregation: str) -> None:
    """Refuse `sequence` (GSPO) with a length-weighted aggregation; also validates `aggregation` itself.

    The importance level's own validity is checked by ``policy_loss.get_importance_level``.
    """
    check_aggregation(aggregation)
    if level == "sequence" and aggregation in LENGTH_WEIGHTED_AGGREGATIONS:
        raise ValueError(
            f"importance_sampling_level='sequence' needs aggregation={SEQ_MEAN_TOKEN_MEAN!r}, "
            f"got aggregation={aggregation!r}: it weights completions by length, which GSPO is defined without"
        )


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over `mask` (x, mask: [B, T]); masked-out entries are selected away, not multiplied."""
    picked = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over `mask`; an empty selection gives 0 (count clamped to 1)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def aggregate(loss_tok: Tensor, mask: Tensor, mode: str = SEQ_MEAN_TOKEN_MEAN, norm_len: float | None = None) -> Tensor:
    """Reduce per-token losses to a scalar.

    loss_tok: [B, T] float; mask: [B, T] bool (True = token is trained on); norm_len: Dr.GRPO constant (default T).
    Returns a 0-d tensor.
    """
    check_aggregation(mode)
    mask = mask.bool()
    if mode == TOKEN_MEAN:
        # L = sum_{i,t} m_it * l_it / sum_{i,t} m_it
        return masked_mean(loss_tok, mask)
    has_tokens = mask.any(dim=-1)  # [B]; empty completions do not count as a sequence
    n_seqs = has_tokens.sum().clamp(min=1).to(loss_tok.dtype)
    if mode == SEQ_MEAN_TOKEN_MEAN:
        # L = 1/|{i}| * sum_i ( sum_t m_it * l_it / sum_t m_it )
        per_seq = masked_mean(loss_tok, mask, dim=-1)
    else:  # SEQ_MEAN_TOKEN_SUM_NORM
        norm = float(loss_tok.shape[-1] if norm_len is None else norm_len)
        if norm <= 0:
            raise ValueError(f"norm_len must be > 0, got {norm_len}")
        # L = 1/|{i}| * sum_i ( sum_t m_it * l_it / norm_len )
        per_seq = masked_sum(loss_tok, mask, dim=-1) / norm
    return masked_sum(per_seq, has_tokens) / n_seqs
