"""Context parallelism's collectives (trainer.cp): the CP group of Megatron's parallel state, the all-gather of
keys and values, and the sum of per-token log-probs over the CP ranks.

    split = cp_split(width)                # None at CP 1; else this rank's columns of rows of that width
    k_full = gather_columns(k_local, split)   # [W / cp, B, ..] -> [W, B, ..] in column order
    logp = cp_sum(logp_partial)            # every rank's scored tokens, on every rank

The layout (which columns a rank holds, how its queries attend) is attention/context_split.py. Every CP rank of a
data-parallel rank forwards the same micro-batch, each its own columns; the model sees [B, W / cp] tokens.

Gradients. gather_columns' backward sums the gradient of the gathered keys / values over the CP group (all-reduce)
and keeps this rank's columns: each key's gradient is that of every rank's queries that attended to it. cp_sum's
forward adds the ranks' partial log-probs (each token scored on the one rank holding the column that predicts it,
0 elsewhere); its backward hands each rank the loss gradient unchanged: every rank computes the same loss from the
same summed log-probs, and rank r's backward carries it into the tokens it scored. A parameter's gradient is then
the SUM of the CP ranks' partial gradients; Megatron's DDP reduces over data-parallel x CP ranks and divides by
their count, so the worker scales its loss by dp x cp (worker.py, "Loss scaling").

The backward of the gather all-reduces the whole [W, ..] gradient and slices it: about twice the volume of a
reduce-scatter, which would do as well (not built). Never run on a GPU (NCCL) here: gloo only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_ray.trainer.attention.context_split import cp_columns, natural_order


@dataclass(frozen=True)
class CPSplit:
    """This rank's share of rows of `width` columns: `columns` [W / cp] (its local order), `order` (cat of all
    ranks' columns -> column order), `local_of` [W] (a column's local index on this rank, -1: another rank's)."""

    width: int
    size: int
    rank: int
    columns: Tensor
    order: Tensor
    local_of: Tensor
    group: object


def cp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def layer_cp_size(config) -> int:
    """The context-parallel size a layer is built to run at: the process groups' (build_transformer_config leaves
    Megatron's context_parallel_size at 1, which keeps Megatron's own CP code paths, its rotary and layer ones,
    off: the split is ours), or a hand-built config's own where it names a larger one."""
    return max(cp_size(), getattr(config, "context_parallel_size", 1))


def cp_split(width: int) -> CPSplit | None:
    """This rank's CPSplit of rows of `width` (a multiple of 2 cp), or None at CP 1."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return None
    rank = parallel_state.get_context_parallel_rank()
    columns = cp_columns(width, size, rank)
    local_of = torch.full((width,), -1, dtype=torch.long)
    local_of[columns] = torch.arange(len(columns))
    return CPSplit(width, size, rank, columns, natural_order(width, size), local_of,
                   parallel_state.get_context_parallel_group())


def gather_columns(x: Tensor, split: CPSplit) -> Tensor:
    """x [W / cp, ...] (this rank's columns) -> [W, ...] in column order, differentiable (module docstring)."""
    return _GatherColumns.apply(x, split)


def cp_sum(x: Tensor, split: CPSplit) -> Tensor:
    """The sum of x over the CP ranks; backward: the gradient unchanged (module docstring)."""
    return _SumOverCP.apply(x, split)


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split):
        ctx.split = split
        parts = [torch.empty_like(x) for _ in range(split.size)]
        dist.all_gather(parts, x.contiguous(), group=split.group)
        return torch.cat(parts)[split.order.to(x.device)]

    @staticmethod
    def backward(ctx, grad):
        split = ctx.split
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=split.group)
        return grad[split.columns.to(grad.device)], None


class _SumOverCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=split.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
