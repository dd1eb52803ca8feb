"""Attention by segment (trainer/attention/segment_attention.py) against a dense-mask reference: outputs and gradients
of queries, keys and values in fp64, GQA, an empty segment, a one-token prefix, a group of one, packed rows (sequences,
and group rows, one after another in one row: an empty sequence, a one-token one, a tail of padding), padding; the
pair count the planner uses. Pure torch, no model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows, row_pairs


def dense_reference(query, key, value, segs: Segments):
    """The same attention through one [S, S] boolean mask per row and the math kernel (what the trainer used to
    build): a prefix query sees its unit's prefix causally, a segment query that prefix and its own earlier
    tokens, nothing of another unit. Returns the output and the mask's count of query-key pairs."""
    width, batch, heads, _ = query.shape
    rep = heads // key.shape[2]
    out, pairs = [], 0
    for b in range(batch):
        unit, seg = torch.full((width,), -1), torch.full((width,), -1)
        start = 0
        for u in segs.units(b):
            p = segs.prefix[u]
            unit[start:start + p], seg[start:start + p] = u, 0
            start += p
            for j, c in enumerate(segs.completions[u]):
                unit[start:start + c], seg[start:start + c] = u, j + 1
                start += c
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = (causal & (unit[None, :] == unit[:, None]) & ((seg[None, :] == 0) | (seg[None, :] == seg[:, None]))
                & (seg[:, None] >= 0))
        pairs += int(mask.sum())
        q = query[:, b].transpose(0, 1)
        k = key[:, b].repeat_interleave(rep, 1).transpose(0, 1)
        v = value[:, b].repeat_interleave(rep, 1).transpose(0, 1)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)  # padding: nothing
        out.append((probs @ v).transpose(0, 1))
    return torch.stack(out, 1), pairs


CASES = {
    # group rows: prefix 5 and segments 3, 0 (empty), 4; then a one-token prefix; then a group of one; padding
    "groups": Segments(prefix=(5, 1, 6), completions=((3, 0, 4), (2, 3), (4,))),
    "plain": Segments.plain([12, 7, 1]),
    "empty_prefix": Segments(prefix=(0,), completions=((4, 6, 2),)),  # three segments of an empty prefix
    # packed rows: sequences of 4, 1 (one token), 0 (empty) and 6 tokens in one row, 2 of padding at its tail
    "packed": Segments.plain([4, 1, 0, 6], packed=True),
    # two group rows and a plain sequence packed in one row (each group row's segments offset), 1 of padding
    "packed_groups": Segments(prefix=(3, 1, 2), completions=((2, 0, 1), (2, 1), ()), packed=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_segments_equal_the_dense_mask_and_its_gradients(name):
    segs = CASES[name]
    g = torch.Generator().manual_seed(0)
    width, heads, kv = 13, 6, 2
    q, k, v = (torch.randn(width, segs.num_rows, h, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv, kv))
    got = attend_rows(q, k, v, segs)
    want, pairs = dense_reference(q, k, v, segs)
    assert (got - want).abs().max() < 1e-12
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    refs = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for a, b in zip(grads, refs):
        assert (a - b).abs().max() < 1e-12
    for b in range(segs.num_rows):  # padding columns output 0 and pass no gradient back
        assert not got[segs.length(b):, b].any()
        assert not grads[0][segs.length(b):, b].any()
    assert segs.pairs() == pairs == sum(row_pairs(p, c) for p, c in zip(segs.prefix, segs.completions))


def test_a_packed_row_equals_its_sequences_as_padded_rows():
    """Sequences of 5, 1 and 3 tokens packed in one row (a tail of 2) give each sequence's output of a padded row
    of its own (what the trainer's packed layout relies on); a one-token sequence sees only itself."""
    lengths = [5, 1, 3]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(11, 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    packed = attend_rows(q, k, v, Segments.plain(lengths, packed=True))
    start = 0
    for n in lengths:
        alone = attend_rows(*(x[start:start + n] for x in (q, k, v)), Segments.plain([n]))
        assert (packed[start:start + n] - alone).abs().max() < 1e-12
        start += n
    assert (packed[5, 0] - v[5, 0].repeat_interleave(2, 0)).abs().max() < 1e-12  # softmax over one key
    assert not packed[start:].any()


def test_fp32_and_bf16_match_the_reference():
    segs = CASES["groups"]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(13, 3, h, 16, generator=g) for h in (4, 2, 2))
    want, _ = dense_reference(q.double(), k.double(), v.double(), segs)
    assert (attend_rows(q, k, v, segs).double() - want).abs().max() < 1e-5
    got16 = attend_rows(q.bfloat16(), k.bfloat16(), v.bfloat16(), segs)
    assert got16.dtype == torch.bfloat16 and (got16.double() - want).abs().max() < 3e-2


def test_bad_records_are_refused():
    with pytest.raises(ValueError):
        Segments(prefix=(1, 2), completions=((1,),))
    with pytest.raises(ValueError):
        attend_rows(*(torch.zeros(4, 1, 2, 8) for _ in range(3)), Segments(prefix=(3,), completions=((2,),)))


def test_completions_keep_no_gathered_prefix_for_the_backward():
    """A group row of a long prefix and many completions: what the forward keeps for the backward, outside the
    inputs' own storage, is about the output (the prefix is not held once per completion); the gradients are
    those of the reference."""
    prefix, count, groups, heads, dim = 64, 4, 8, 2, 8
    segs = Segments(prefix=(prefix,), completions=((count,) * groups,))
    width = prefix + count * groups
    q, k, v = (torch.randn(width, 1, heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(3))
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    kept = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            kept.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attend_rows(q, k, v, segs)
    gathered = groups * (prefix + count) * heads * dim  # one gathered K (or V) per completion
    assert sum(kept) < gathered, (sum(kept), gathered)
    want, _ = dense_reference(q, k, v, segs)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(got, torch.autograd.grad(want.sum(), (q, k, v))):
        assert (a - b).abs().max() < 1e-12


def _graph_names(t) -> set[str]:
    """Names of the autograd nodes behind `t`."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("value_dim", [5, 20])
def test_value_width_other_than_query_key_width(value_dim):
    """Multi-latent attention's V (v_head_dim) is narrower or wider than q / k: equal to the dense reference
    (outputs and gradients, fp64, scale 1 / sqrt(q / k width)), and in fp32 the fused CPU kernel runs (torch's SDPA
    sends unequal widths to its math kernel, a materialised score matrix: attend_rows pads)."""
    segs = CASES["groups"]
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(13, 3, h, 12, generator=g, dtype=torch.float64, requires_grad=True) for h in (6, 2))
    v = torch.randn(13, 3, 2, value_dim, generator=g, dtype=torch.float64, requires_grad=True)
    got = attend_rows(q, k, v, segs)
    want, _ = dense_reference(q, k, v, segs)
    assert got.shape == (13, 3, 6, value_dim) and (got - want).abs().max() < 1e-12
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got * weights).sum(), (q, k, v)),
                    torch.autograd.grad((want * weights).sum(), (q, k, v))):
        assert (a - b).abs().max() < 1e-12
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    names = _graph_names(attend_rows(q32, k32, v32, Segments.plain([13, 9, 4])))
    assert "ScaledDotProductFlashAttentionForCpuBackward0" in names
    unpadded = unpadded_sdpa(q32, k32, v32)
    assert "ScaledDotProductFlashAttentionForCpuBackward0" not in _graph_names(unpadded)  # why the padding


def unpadded_sdpa(q, k, v):
    """Row 0 as one causal SDPA call on the unequal widths, as torch takes them without padding."""
    q, k, v = (x[:, 0].repeat_interleave(q.shape[2] // x.shape[2], 1).transpose(0, 1)[None] for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # 4-d, as attend_rows calls it
