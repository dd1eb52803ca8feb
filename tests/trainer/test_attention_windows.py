"""Sliding windows and attention sinks by segment (trainer/attention/windows.py through attend_rows) against a
dense-mask reference in fp64: outputs and the gradients of queries, keys, values and the sink logits; windows
shorter and longer than the prefix, of 1, packed rows (the window restarts per sequence), group rows, GQA,
padding; the transformers convention (its sliding-window mask and eager sink attention). Pure torch, no model."""
from __future__ import annotations

import pytest
import torch

from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows


def token_layout(segs: Segments, row: int, width: int):
    """Per column of a row: its unit, its segment (0: prefix, j: completion j, -1: padding) and its position in
    its own sequence (a completion's token i sits at P + i)."""
    unit, seg, pos = (torch.full((width,), -1) for _ in range(3))
    start = 0
    for u in segs.units(row):
        p = segs.prefix[u]
        unit[start:start + p], seg[start:start + p], pos[start:start + p] = u, 0, torch.arange(p)
        start += p
        for j, c in enumerate(segs.completions[u]):
            unit[start:start + c], seg[start:start + c], pos[start:start + c] = u, j + 1, p + torch.arange(c)
            start += c
    return unit, seg, pos


def dense_reference(query, key, value, segs: Segments, window, sinks):
    """One [S, S] mask per row (same unit; the prefix or the query's own segment; causal and within the window by
    position) and the sink as one more softmax column with no value (transformers' eager gpt-oss attention)."""
    width, batch, heads, dim = query.shape
    rep = heads // key.shape[2]
    out = []
    for b in range(batch):
        unit, seg, pos = token_layout(segs, b, width)
        mask = ((unit[None, :] == unit[:, None]) & ((seg[None, :] == 0) | (seg[None, :] == seg[:, None]))
                & (seg[:, None] >= 0) & (seg[None, :] >= 0) & (pos[None, :] <= pos[:, None]))
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        q = query[:, b].transpose(0, 1)
        k = key[:, b].repeat_interleave(rep, 1).transpose(0, 1)
        v = value[:, b].repeat_interleave(rep, 1).transpose(0, 1)
        scores = ((q @ k.transpose(-1, -2)) / dim ** 0.5).masked_fill(~mask, float("-inf"))
        sink = (sinks if sinks is not None else torch.full((heads,), float("-inf"), dtype=q.dtype))
        scores = torch.cat((scores, sink.view(heads, 1, 1).expand(heads, width, 1)), dim=-1)
        probs = torch.softmax(scores, -1)[..., :-1].nan_to_num(0.0) * (seg[:, None] >= 0)  # padding: nothing
        out.append((probs @ v).transpose(0, 1))
    return torch.stack(out, 1)


CASES = {
    # group rows: prefixes 5 / 1 / 6 and their segments (one empty)
    "groups": Segments(prefix=(5, 1, 6), completions=((3, 0, 4), (2, 3), (4,))),
    "plain": Segments.plain([12, 7, 1]),
    # a packed row of three sequences: the window restarts with each
    "packed": Segments.plain([5, 1, 6], packed=True),
    "packed_groups": Segments(prefix=(3, 1, 2), completions=((2, 0, 1), (2, 1), ()), packed=True),
}


@pytest.mark.parametrize("window", [1, 3, 20, None])  # 3: shorter than the prefixes; 20: longer than any row
@pytest.mark.parametrize("name", list(CASES))
def test_windows_and_sinks_equal_the_dense_reference(name, window):
    segs = CASES[name]
    g = torch.Generator().manual_seed(window or 0)
    width, heads, kv, dim = 13, 6, 2, 8
    q, k, v = (torch.randn(width, segs.num_rows, h, dim, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv, kv))
    sinks = torch.randn(heads, generator=g, dtype=torch.float64, requires_grad=True)
    out = attend_rows(q, k, v, segs, window=window, sinks=sinks)
    ref = dense_reference(q, k, v, segs, window, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * up).sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad((ref * up).sum(), (q, k, v, sinks))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert grads[3].abs().sum() > 0
    # a window without sinks too
    torch.testing.assert_close(attend_rows(q, k, v, segs, window=window),
                               dense_reference(q, k, v, segs, window, None), rtol=1e-10, atol=1e-10)


def test_transformers_window_and_sink_convention():
    """transformers' own sliding-window mask (kv_idx > q_idx - W) and eager sink attention of GptOssAttention
    give attend_rows' numbers for one plain row."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(1)
    n, heads, kv, dim, window = 9, 4, 2, 8, 3
    q, k, v = (torch.randn(1, h, n, dim, generator=g, dtype=torch.float64) for h in (heads, kv, kv))
    allowed = and_masks(causal_mask_function, sliding_window_overlay(window))
    positions = torch.arange(n)
    mask = allowed(torch.tensor(0), torch.tensor(0), positions[:, None], positions[None, :])
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = heads // kv, False
    module.sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    want, _ = eager_attention_forward(module, q, k, v, torch.zeros(n, n, dtype=torch.float64).masked_fill(
        ~mask, float("-inf")), scaling=dim ** -0.5)
    got = attend_rows(*(x[0].permute(1, 0, 2)[:, None] for x in (q, k, v)), Segments.plain([n]), window=window,
                      sinks=module.sinks)
    torch.testing.assert_close(got[:, 0], want[0], rtol=1e-10, atol=1e-10)
