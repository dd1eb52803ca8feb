"""One rule for comparing floats that were computed in another order.

A sum of n terms computed in floating point is off from the exact sum by at most gamma_n * sum |term_i|, with
gamma_n = n * u / (1 - n * u) and u the unit roundoff (half the machine epsilon; Higham, "Accuracy and Stability
of Numerical Algorithms", 3.1). Two evaluations of the same sum in different orders -- another CPU's kernels
(AVX2 on AMD EPYC, AVX-512 / AMX on Intel Xeon), another TP split, mm instead of bmm -- are each within that of
the exact sum, so they differ by at most 2 * gamma_n * sum |term_i| ~= n * eps * sum |term_i|. That is the bound:

    rounding_bound(n, magnitude, dtype) = n * eps(dtype) * magnitude

with `n` the reduction length and `magnitude` the sum of the terms' absolute values (for a dot product of a and b:
|a| . |b|; elementwise where the magnitudes are). It is a bound, not a typical error (errors of random sign grow
like sqrt(n)), so a test held to it passes on every host whose kernels round correctly, and still fails when the
computation is wrong: a wrong result is off by the size of the values, not by n * eps of them.

A comparison that claims bit-equality (the same kernels on the same data) stays `torch.equal`; one against a
hand-computed value compares at the digits the hand computation wrote.
"""
from __future__ import annotations

import torch


def eps(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps


def rounding_bound(n: int, magnitude, dtype: torch.dtype = torch.float32):
    """The most two evaluations of a sum of `n` terms (absolute values summing to `magnitude`) can differ by."""
    return n * eps(dtype) * magnitude


def assert_within_rounding(actual, expected, n: int, magnitude, dtype: torch.dtype = torch.float32,
                           what: str = "") -> None:
    """|actual - expected| <= rounding_bound(n, magnitude, dtype), elementwise; says where and by how much not."""
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    bound = torch.as_tensor(rounding_bound(n, magnitude, dtype), dtype=torch.float64)
    diff = (actual - expected).abs()
    over = diff > bound
    if over.any():
        i = int(torch.argmax((diff - bound).flatten()))
        raise AssertionError(
            f"{what or 'values'}: {int(over.sum())} of {diff.numel()} elements differ by more than the rounding of "
            f"a {n}-term {dtype} sum; worst {diff.flatten()[i].item():.3g} > bound "
            f"{bound.expand_as(diff).flatten()[i].item():.3g} at flat index {i}")
