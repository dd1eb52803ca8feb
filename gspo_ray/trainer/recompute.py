"""Activation recomputation (trainer.recompute) where Megatron's own cannot run: the layers that take attention by
segment's `Segments` record.

    checkpoint_layers(gpt, count)        # full: the first `count` layers (None: all) keep their input only
    recomputed(fn)(*args, **kwargs)       # one call under torch.utils.checkpoint (non-reentrant)
    in_recompute()                        # True while a forward is being rerun in the backward (routing hooks)

Megatron's full recompute (`recompute_granularity="full"`) and its selective `core_attn` run the layer or the core
attention through its CheckpointFunction, whose `save_for_backward` takes every argument: the `Segments` record
that travels as `attention_mask` is not a tensor, and megatron-core 0.16.1 fails there ("save_for_backward can
only save variables"). So those two are done here with torch's non-reentrant checkpoint, which keeps non-tensor
arguments by reference and needs no input that requires grad (a frozen embedding under LoRA is fine): a layer (or
the core attention) keeps its inputs, and its forward runs again in the backward, with the same kernels on the same
inputs (the step is bit for bit the same). Megatron's selective modules that take tensors only (`mlp`, `moe`,
`layernorm` and `moe_act` with Transformer Engine) stay Megatron's (model.recompute_options).

Torch only: the routing hooks (trainer/routing/) import `in_recompute`.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

_RERUNS = 0  # > 0 while a checkpointed forward of ours is being rerun in the backward


@contextlib.contextmanager
def _rerun():
    global _RERUNS
    _RERUNS += 1
    try:
        yield
    finally:
        _RERUNS -= 1


def in_recompute() -> bool:
    """Whether the forward running now is a recomputation in the backward: ours (checkpoint_layers, recomputed)
    or Megatron's (its CheckpointFunction rerunning a selective module with grad on; its first pass runs with grad
    off). Forward hooks that count (routing drift, agreement, churn) skip it: that forward was counted once."""
    if _RERUNS:
        return True
    from megatron.core.tensor_parallel.random import is_checkpointing

    return is_checkpointing() and torch.is_grad_enabled()


def recomputed(fn: Callable) -> Callable:
    """fn run under torch.utils.checkpoint (non-reentrant) when grad is on; as is under no_grad (nothing to keep).
    Its rerun in the backward is marked for in_recompute."""

    def call(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        calls = [0]

        def run(*a, **kw):
            calls[0] += 1
            if calls[0] == 1:
                return fn(*a, **kw)
            with _rerun():
                return fn(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return call


def checkpoint_layers(gpt: torch.nn.Module, count: int | None = None) -> int:
    """trainer.recompute full: the first `count` transformer layers (None: every layer; Megatron's recompute_method
    block) run under `recomputed`; returns how many. Each keeps its input hidden states for the backward, and
    while one layer's backward runs, that layer's activations live again."""
    layers = list(gpt.decoder.layers)
    n = len(layers) if count is None else min(count, len(layers))
    for layer in layers[:n]:
        layer.forward = recomputed(layer.forward)
    return n
