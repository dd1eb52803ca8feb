"""The THD layout of a Segments record (trainer/te_attention.py) and the gather / attend / scatter around a THD
kernel, on CPU.

Transformer Engine's DotProductAttention cannot run here (no CUDA), so the kernel is `thd_reference` below: the THD
semantics TE documents for qkv_format="thd" with attn_mask_type="padding_causal_bottom_right" (sequence i: queries
cu_seqlens_q[i]:cu_seqlens_q[i+1] over keys cu_seqlens_kv[i]:cu_seqlens_kv[i+1], causal aligned bottom-right),
written in torch. With it, thd_attend_rows must equal attend_rows (values and gradients, fp64) on ragged rows: a
one-token prefix, an empty prefix, empty completions, a group of one, a padded row, an empty row.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gspo_ray.trainer.segment_attention import Segments, attend_rows
from gspo_ray.trainer.te_attention import thd_attend_rows, thd_layout


def thd_reference(q, k, v, layout, scale=None):
    """Per THD sequence: SDPA of its queries over its keys, query i seeing keys 0 .. n_kv - n_q + i."""
    cu_q, cu_kv, out = layout.cu_seqlens_q.tolist(), layout.cu_seqlens_kv.tolist(), []
    for i in range(layout.num_sequences):
        qi, ki, vi = (x.transpose(0, 1)[None] for x in (q[cu_q[i]:cu_q[i + 1]], k[cu_kv[i]:cu_kv[i + 1]],
                                                          v[cu_kv[i]:cu_kv[i + 1]]))
        nq, nk = qi.shape[2], ki.shape[2]
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        out.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(out)


def test_layout_of_a_group_row_and_a_padded_row():
    segs = Segments(prefix=(3, 2), completions=((2, 0, 1), ()))  # row 0: [P P P a a c], row 1: 2 tokens + padding
    layout = thd_layout(segs, width=6)
    # position s of row r is s * B + r (B = 2)
    assert layout.q_index.tolist() == [0, 2, 4, 6, 8, 10, 1, 3]
    # completion a: [prefix ; a], completion c: [prefix ; c] (the prefix gathered once per completion segment)
    assert layout.kv_index.tolist() == [0, 2, 4] + [0, 2, 4, 6, 8] + [0, 2, 4, 10] + [1, 3]
    assert layout.cu_seqlens_q.tolist() == [0, 3, 5, 6, 8]
    assert layout.cu_seqlens_kv.tolist() == [0, 3, 8, 12, 14]
    assert layout.cu_seqlens_q.dtype == torch.int32 and layout.q_index.dtype == torch.int64
    assert (layout.max_seqlen_q, layout.max_seqlen_kv) == (3, 5)


def test_layout_refuses_segments_wider_than_the_row():
    with pytest.raises(ValueError, match="row 0"):
        thd_layout(Segments(prefix=(4,), completions=((3,),)), width=6)


@pytest.mark.parametrize("segs,width", [
    (Segments(prefix=(5, 1, 0, 7), completions=((3, 0, 4), (6,), (2, 3), ())), 12),  # ragged, 1-token prefix
    (Segments(prefix=(4, 0), completions=((), ())), 6),                                # padded rows, an empty row
    (Segments(prefix=(9,), completions=((1,),)), 10),                                   # a group of one member
])
def test_thd_attend_rows_equals_attend_rows(segs, width):
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim = segs.num_rows, 6, 2, 8
    q, k, v = (torch.randn(width, batch, h, dim, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    got = thd_attend_rows(q, k, v, segs, thd_reference)
    want = attend_rows(q, k, v, segs).reshape(width, batch, -1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_no_segment_at_all_outputs_zeros_without_calling_the_kernel():
    def kernel(*_):
        raise AssertionError("called")

    q = torch.randn(4, 2, 2, 3)
    out = thd_attend_rows(q, q, q, Segments(prefix=(0, 0), completions=((), (0,))), kernel)
    assert out.shape == (4, 2, 6) and not out.any()
