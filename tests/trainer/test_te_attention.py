"""The THD layout of a Segments record (trainer/attention/te_attention.py) and the gather / attend / scatter around a
THD kernel, on CPU.

Transformer Engine's DotProductAttention cannot run here (no CUDA), so the kernel is `thd_reference` below: the THD
semantics TE documents for qkv_format="thd" with attn_mask_type="padding_causal_bottom_right" (sequence i: queries
cu_seqlens_q[i]:cu_seqlens_q[i+1] over keys cu_seqlens_kv[i]:cu_seqlens_kv[i+1], causal aligned bottom-right),
written in torch. With it, thd_attend_rows must equal attend_rows (values and gradients, fp64) on ragged rows: a
one-token prefix, an empty prefix, empty completions, a group of one, a padded row, an empty row, and packed rows
(several sequences, or several group rows, one after another in one row: every unit its own THD sequences).

TEThdKernel itself runs against `FakeDotProductAttention`, a stand-in module for transformer_engine.pytorch whose
DotProductAttention checks the arguments TE documents for THD (int32 cu_seqlens ending at the token count,
max_seqlen at least every sequence's length) and computes each sequence from cu_seqlens alone.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows
from gspo_ray.trainer.attention.te_attention import thd_attend_rows, thd_layout


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


def test_layout_of_a_packed_row_gives_every_unit_its_sequences():
    # one row [s s s t t t t | pad]: sequence t starts at column 3, its own THD sequence
    layout = thd_layout(Segments.plain([3, 4], packed=True), width=8)
    assert layout.q_index.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert layout.cu_seqlens_q.tolist() == layout.cu_seqlens_kv.tolist() == [0, 3, 7]
    # two group rows packed: [P P a a b | Q c c c]; completion c's keys are [Q ; c] from column 5 on
    layout = thd_layout(Segments(prefix=(2, 1), completions=((2, 1), (3,)), packed=True), width=9)
    assert layout.q_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert layout.kv_index.tolist() == [0, 1] + [0, 1, 2, 3] + [0, 1, 4] + [5] + [5, 6, 7, 8]
    assert layout.cu_seqlens_q.tolist() == [0, 2, 4, 5, 6, 9]
    assert layout.cu_seqlens_kv.tolist() == [0, 2, 6, 9, 10, 14]


CASES = [
    (Segments(prefix=(5, 1, 0, 7), completions=((3, 0, 4), (6,), (2, 3), ())), 12),  # ragged, 1-token prefix
    (Segments(prefix=(4, 0), completions=((), ())), 6),                                # padded rows, an empty row
    (Segments(prefix=(9,), completions=((1,),)), 10),                                   # a group of one member
    (Segments.plain([3, 4, 5], packed=True), 14),                                       # packed sequences, a tail
    (Segments(prefix=(3, 0, 2), completions=((2, 0, 1), (), (4,)), packed=True), 12),   # packed group rows
    (Segments(prefix=(2, 5), completions=((3,), (1, 2)), packed=True), 13),             # packed, no tail
]


@pytest.mark.parametrize("segs,width", CASES)
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


class FakeDotProductAttention:
    """transformer_engine.pytorch.DotProductAttention as TE documents it for qkv_format="thd": q [total_q, Hq, D]
    and k / v [total_kv, Hkv, D], sequence i is rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q over rows
    cu_seqlens_kv[i]:cu_seqlens_kv[i + 1] of k / v, the causal mask aligned bottom-right; output [total_q, Hq * D]."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", softmax_scale=None):
        assert (qkv_format, attn_mask_type, attention_dropout) == ("thd", "padding_causal_bottom_right", 0.0)
        self.heads, self.groups, self.scale = num_attention_heads, num_gqa_groups, softmax_scale

    def __call__(self, q, k, v, *, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv):
        assert cu_seqlens_q.dtype == cu_seqlens_kv.dtype == torch.int32
        assert (q.shape[1], k.shape[1]) == (self.heads, self.groups)
        assert (int(cu_seqlens_q[-1]), int(cu_seqlens_kv[-1])) == (q.shape[0], k.shape[0])
        out = []
        for q0, q1, k0, k1 in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(),
                                  cu_seqlens_kv[:-1].tolist(), cu_seqlens_kv[1:].tolist()):
            nq, nk = q1 - q0, k1 - k0
            assert 0 < nq <= min(nk, max_seqlen_q) and nk <= max_seqlen_kv
            # the groups' keys repeated per query head (TE's GQA), no SDPA GQA flag
            kk, vv = (x[k0:k1].repeat_interleave(self.heads // self.groups, dim=1).transpose(0, 1) for x in (k, v))
            scores = q[q0:q1].transpose(0, 1) @ kk.transpose(1, 2) * self.scale  # [H, nq, nk]
            bottom_right = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
            weights = scores.masked_fill(~bottom_right, float("-inf")).softmax(-1)
            out.append((weights @ vv).transpose(0, 1).reshape(nq, -1))
        return torch.cat(out)


@pytest.mark.parametrize("segs,width", CASES[3:])
def test_te_kernel_on_packed_rows_equals_attend_rows(monkeypatch, segs, width):
    from gspo_ray.trainer.attention.te_attention import TEThdKernel

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.SimpleNamespace(DotProductAttention=FakeDotProductAttention)
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 8
    q, k, v = (torch.randn(width, 1, h, dim, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    got = thd_attend_rows(q, k, v, segs, TEThdKernel(heads, kv_heads, dim, dim ** -0.5))
    want = attend_rows(q, k, v, segs).reshape(width, 1, -1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_attend_rows_repeats_kv_heads_where_the_fused_kernel_takes_no_gqa(monkeypatch):
    """On CUDA only flash takes GQA and flash refuses fp32 (torch's dispatch, read): there attend_rows repeats K/V
    heads itself, so the memory-efficient kernel, not the math one, runs each call. Forced here on CPU: every SDPA
    call sees Hq key heads and no enable_gqa, and the result equals the GQA calls', values and gradients."""
    from gspo_ray.trainer.attention import segment_attention

    segs, width = Segments(prefix=(4, 0, 3), completions=((2, 3), (5,), ()), packed=True), 18
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 6, 2, 8
    q, k, v = (torch.randn(width, 1, h, dim, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    want = attend_rows(q, k, v, segs)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)

    calls, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(query, key, value, **kwargs):
        calls.append((key.shape[1], value.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(segment_attention, "fused_kernel_takes_gqa", lambda *_: False, raising=False)
    monkeypatch.setattr(segment_attention.F, "scaled_dot_product_attention", recording_sdpa)
    got = attend_rows(q, k, v, segs)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert calls and set(calls) == {(heads, heads, False)}
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
