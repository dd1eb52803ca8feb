"""A gradient that torch.matmul can fold into one mm (a version-guarded workaround).

    logits = foldable_grad(output_layer_output)        # [S, B, V]; identity forward

Why. torch.matmul of a 3-D `a` [S, B, V] by a 2-D `w` [V, H] that needs no gradient runs one `mm` on
a.view(S * B, V) only when `a`'s leading dims are laid out contiguously *by their strides*, size-1 dims included
(aten `should_fold`, torch 2.x). Otherwise it expands `w` to [S, V, H] and runs `bmm`: S matrix-vector products
that each read all of `w`. megatron-core's `LinearWithFrozenWeight.backward` computes `grad_output.matmul(weight)`,
and the output layer's gradient arrives there as [N, 1, V] with strides (V, N * V, 1): GPTModel returns
`logits.transpose(0, 1)`, so the gradient of the [1, N, V] view comes back transposed. Such a tensor is
`is_contiguous()` (size-1 dims are ignored there, so `.contiguous()` is a no-op), yet fails the fold test. With a
frozen, tied output layer (LoRA) that is N reads of the 49152 x 576 embedding per micro-batch: ~3 s of a 12.6 s
SmolLM2 train step (docs/benchmarks.md, "The LoRA train step"). Full fine-tuning never hits it: a weight that
needs a gradient always folds.

What. An autograd identity whose backward returns `grad.view(grad.shape)`: the same memory, strides recomputed
from the sizes, so size-1 dims get the stride the fold test expects. No copy, bit-equal values.

Guard. Tested with torch 2.x as locked; other major versions get a warning. The test
tests/compat/test_torch_matmul_fold.py fails when the workaround stops being needed (matmul folds the transposed
gradient by itself) and when it stops being correct (the restrided gradient does not fold or changes values).
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

TESTED_MAJOR = "2."
_warned: list[str] = []


def check_version() -> str:
    """torch's version; warns once when its major version is not the one this workaround was tested with."""
    version = torch.__version__
    if not version.startswith(TESTED_MAJOR) and version not in _warned:
        _warned.append(version)
        log.warning("torch_matmul_fold: tested with torch %sx, found %s; run tests/compat/test_torch_matmul_fold.py",
                    TESTED_MAJOR, version)
    return version


class _FoldableGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.view(grad.shape)


def foldable_grad(x: Tensor) -> Tensor:
    """x unchanged; its gradient restrided (no copy) so that a matmul by a frozen 2-D weight folds into one mm."""
    check_version()
    return _FoldableGrad.apply(x) if x.requires_grad else x
