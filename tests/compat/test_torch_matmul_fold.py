"""torch_matmul_fold: the restrided gradient is still needed and still correct.

The guard of a performance workaround: megatron-core's frozen-weight linear takes its input gradient as
`grad_output.matmul(weight)`, and for the output layer's gradient (an [N, 1, V] tensor with transposed strides, as
GPTModel's `transpose(0, 1)` hands it back) torch.matmul runs a batched matrix-vector `bmm` instead of one `mm`.
This test FAILS
  * when the workaround stops being needed: that backward runs an `mm` without it;
  * when it stops being correct: with it, the backward still runs a `bmm`, or the input gradient changes.
"""
from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

from gspo_ray.compat.torch_matmul_fold import check_version, foldable_grad
from tests.tolerance import assert_within_rounding

pytestmark = pytest.mark.isa  # make test-isa: floats summed by the CPU's kernels
N, H, V = 12, 16, 96


def _output_layer_backward(restride: bool):
    """hidden [N, 1, H] -> frozen linear -> (foldable_grad) -> GPTModel's transpose -> row select -> backward.

    Returns (the matmul kernels the backward ran, the hidden states' gradient, |upstream| @ |weight|: each
    gradient element's sum of absolute terms)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g)  # frozen: requires_grad False
    hidden = torch.randn(N, 1, H, generator=g, requires_grad=True)
    upstream = torch.randn(N, V, generator=g)
    logits = LinearWithFrozenWeight.apply(hidden, weight, None, False, None)  # [N, 1, V]
    if restride:
        logits = foldable_grad(logits)
    scored = logits.transpose(0, 1)[0]  # GPTModel returns [B, S, V]; output_rows takes row 0 -> [N, V]
    with torch.profiler.profile() as prof:
        (scored * upstream).sum().backward()
    kernels = {e.key for e in prof.key_averages()} & {"aten::mm", "aten::bmm"}
    return kernels, hidden.grad, (upstream.abs() @ weight.abs()).unsqueeze(1)


def test_the_transposed_gradient_still_does_not_fold():
    check_version()
    kernels, *_ = _output_layer_backward(restride=False)
    assert kernels == {"aten::bmm"}, (
        f"the frozen output layer's backward ran {sorted(kernels)}: torch.matmul now folds the transposed "
        "gradient by itself; gspo_ray/compat/torch_matmul_fold.py can go")


def test_the_restrided_gradient_folds_and_is_unchanged():
    kernels, grad, magnitude = _output_layer_backward(restride=True)
    assert kernels == {"aten::mm"}, f"with foldable_grad the backward ran {sorted(kernels)}, not one mm"
    _, reference, _ = _output_layer_backward(restride=False)
    # mm and bmm sum each element's V products in their own order (and per host: AVX2 vs AVX-512 kernels)
    assert_within_rounding(grad, reference, V, magnitude, torch.float32, "the restrided gradient")


def test_forward_is_the_identity_and_frozen_inputs_pass_through():
    x = torch.randn(3, 1, 5)
    assert foldable_grad(x) is x
    y = torch.randn(3, 1, 5, requires_grad=True)
    out = foldable_grad(y)
    assert torch.equal(out, y) and out.data_ptr() == y.data_ptr()
