"""Gated DeltaNet by segment (trainer/gated_delta/): the layer against transformers' Qwen3NextGatedDeltaNet (its
torch path) on padded rows, outputs and weight gradients in fp32; the chunked rule with an initial state against
transformers' token-by-token recurrence; and no leakage between segments, in fp64: a packed row of three
sequences (one shorter than the convolution kernel) equals its own padded rows, outputs and per-sequence
gradients (recurrent and convolution states restart at each sequence); a group row equals its separate rows
[prefix ; completion] (the prefix's states start each completion); a perturbation of one sequence changes no other.

Tolerances: equalities between a packed / group row and separate rows hold only up to rounding, as the chunk
boundaries of the rule (64 tokens) fall elsewhere in a segment than in its own row, which regroups the same sums;
in fp64 that is 1e-10 here. The perturbation checks are exact (each segment is its own computation)."""
from __future__ import annotations

import pytest
import torch

from gspo_ray.trainer.attention.segment_attention import Segments
from gspo_ray.trainer.gated_delta.by_segment import DeltaHeads
from gspo_ray.trainer.gated_delta.delta_rule import chunk_gated_delta_rule, l2norm
from gspo_ray.trainer.gated_delta.layer import GatedDeltaNet

transformers_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

HIDDEN, KERNEL = 32, 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One OpenMP thread: these [64, 64] matmuls run in milliseconds on one, and ~50x slower when two threads
    contend with other work on two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
HEADS = DeltaHeads(key_heads=2, key_dim=8, value_heads=4, value_dim=8)


def hf_layer(dtype=torch.float32):
    """transformers' layer with random weights (A_log, dt_bias, norm too), and ours holding the same tensors."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=HEADS.key_heads, linear_key_head_dim=HEADS.key_dim,
                          linear_num_value_heads=HEADS.value_heads, linear_value_head_dim=HEADS.value_dim,
                          linear_conv_kernel_dim=KERNEL, num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    hf = transformers_next.Qwen3NextGatedDeltaNet(cfg, 0).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = GatedDeltaNet(HIDDEN, HEADS, KERNEL, cfg.rms_norm_eps, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def test_layer_equals_transformers_on_padded_rows():
    hf, ours = hf_layer()
    lengths = [70, 3, 130]  # across a chunk boundary; shorter than the kernel; two chunks and more
    x = torch.randn(3, 130, HIDDEN)
    mask = (torch.arange(130)[None] < torch.tensor(lengths)[:, None]).long()
    ref = hf(x, attention_mask=mask)
    got = ours(x.transpose(0, 1), Segments.plain(lengths)).transpose(0, 1)
    weight = torch.randn_like(ref) * mask[..., None]  # a loss on the real tokens only
    (ref * weight).sum().backward()
    (got * weight).sum().backward()
    for i, n in enumerate(lengths):
        assert torch.allclose(got[i, :n], ref[i, :n], atol=1e-5, rtol=0)
        assert torch.count_nonzero(got[i, n:]) == 0  # padding outputs 0
    ours_params = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        assert torch.allclose(ours_params[name].grad, p.grad, atol=1e-4, rtol=1e-4), name


def test_chunked_rule_with_initial_state_equals_the_recurrence():
    """fp64 against the token-by-token formula (delta_rule's docstring), and against transformers' recurrence,
    which computes in fp32 (hence 1e-6 there)."""
    torch.manual_seed(1)
    t, h, dk, dv = 90, 3, 8, 5
    q, k = (l2norm(torch.randn(t, h, dk, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(t, h, dv, dtype=torch.float64)
    g, beta = -torch.rand(t, h, dtype=torch.float64), torch.rand(t, h, dtype=torch.float64)
    state = torch.randn(h, dk, dv, dtype=torch.float64)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    s, expected = state.clone(), []
    for i in range(t):
        s = s * g[i].exp()[:, None, None]
        s = s + k[i][..., None] * (beta[i][:, None] * (v[i] - torch.einsum("hkv,hk->hv", s, k[i])))[:, None]
        expected.append(torch.einsum("hkv,hk->hv", s, q[i]) / dk ** 0.5)
    assert torch.allclose(out, torch.stack(expected), atol=1e-12) and torch.allclose(final, s, atol=1e-12)
    ref, ref_final = transformers_next.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True)
    assert torch.allclose(out, ref[0].double(), atol=1e-6) and torch.allclose(final, ref_final[0].double(), atol=1e-6)


def _run(layer, rows: list[torch.Tensor], segs: Segments):
    """rows of [n, H] inputs laid out as `segs` says (packed: one row) -> the layer's output [S, B, H]."""
    width = max(r.shape[0] for r in rows) + 2  # tail padding
    x = torch.zeros(width, len(rows), HIDDEN, dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        x[:r.shape[0], b] = r
    return layer(x, segs)


def _grads(layer, out, weight):
    """d(sum out * weight) / d(parameters)."""
    return torch.autograd.grad((out * weight).sum(), list(layer.parameters()), retain_graph=True)


def test_packed_row_equals_its_padded_rows_and_leaks_nothing():
    _, layer = hf_layer(torch.float64)
    torch.manual_seed(2)
    lengths = [67, 2, 45]
    seqs = [torch.randn(n, HIDDEN, dtype=torch.float64, requires_grad=True) for n in lengths]
    packed = _run(layer, [torch.cat(seqs)], Segments.plain(lengths, packed=True))[:, 0]
    alone = _run(layer, seqs, Segments.plain(lengths))
    starts = [0, 67, 69]
    weights = [torch.randn(n, HIDDEN, dtype=torch.float64) for n in lengths]  # a loss on every real token
    w_packed, w_alone = torch.zeros_like(packed), torch.zeros_like(alone)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        assert torch.allclose(packed[s:s + n], alone[:n, i], atol=1e-10, rtol=0), f"sequence {i}"
        w_packed[s:s + n], w_alone[:n, i] = weights[i], weights[i]
    # gradients of the inputs: sequence i's tokens receive only what sequence i's own loss sends them (a state
    # crossing a boundary would send sequence j's loss to them); of the weights: the separate rows' sum
    params = list(layer.parameters())
    grads_packed = torch.autograd.grad((packed * w_packed).sum(), seqs + params)
    grads_alone = torch.autograd.grad((alone * w_alone).sum(), seqs + params)
    for i, (gp, ga) in enumerate(zip(grads_packed, grads_alone)):
        assert torch.allclose(gp, ga, atol=1e-9, rtol=1e-9), f"gradient {i}"
    # perturb the middle sequence: the others' outputs do not change at all
    with torch.no_grad():
        seqs[1] += 1.0
        moved = _run(layer, [torch.cat(seqs)], Segments.plain(lengths, packed=True))[:, 0]
    assert torch.equal(moved[:67], packed[:67]) and torch.equal(moved[69:114], packed[69:114])
    assert not torch.allclose(moved[67:69], packed[67:69])


def test_group_row_equals_its_separate_rows_with_the_prefix_state_shared():
    _, layer = hf_layer(torch.float64)
    torch.manual_seed(3)
    prefix, completions = 66, (5, 70, 1)
    p = torch.randn(prefix, HIDDEN, dtype=torch.float64)
    cs = [torch.randn(c, HIDDEN, dtype=torch.float64) for c in completions]
    group = _run(layer, [torch.cat([p, *cs])], Segments(prefix=(prefix,), completions=(completions,)))[:, 0]
    alone = _run(layer, [torch.cat([p, c]) for c in cs], Segments.plain([prefix + c for c in completions]))
    assert torch.allclose(group[:prefix], alone[:prefix, 0], atol=1e-10, rtol=0)
    at = prefix
    for j, c in enumerate(completions):
        assert torch.allclose(group[at:at + c], alone[prefix:prefix + c, j], atol=1e-10, rtol=0), f"completion {j}"
        at += c
    # gradients of a loss on every completion token: the group row's equal the separate rows' summed (the prefix
    # computed once receives every completion's gradient through its states)
    weights = [torch.randn(c, HIDDEN, dtype=torch.float64) for c in completions]
    w_group = torch.zeros_like(group)
    w_group[prefix:prefix + sum(completions)] = torch.cat(weights)
    w_alone = torch.zeros_like(alone)
    for j, (c, w) in enumerate(zip(completions, weights)):
        w_alone[prefix:prefix + c, j] = w
    for gg, ga in zip(_grads(layer, group, w_group), _grads(layer, alone, w_alone)):
        assert torch.allclose(gg, ga, atol=1e-9, rtol=1e-9)
    # perturb completion 1: the prefix and the other completions do not change at all
    cs[1] = cs[1] + 1.0
    with torch.no_grad():
        moved = _run(layer, [torch.cat([p, *cs])], Segments(prefix=(prefix,), completions=(completions,)))[:, 0]
    keep = [range(0, prefix + 5), range(prefix + 75, prefix + 76)]
    for r in keep:
        assert torch.equal(moved[r.start:r.stop], group[r.start:r.stop])
    assert not torch.allclose(moved[prefix + 5:prefix + 75], group[prefix + 5:prefix + 75])


def test_varlen_packing_of_many_sequences():
    """The CUDA path's packing (delta_rule.run_varlen: concatenation, cu_seqlens, stacked initial states, outputs
    split back) through a kernel with flash-linear-attention's varlen API built from the torch rule (fla itself is
    not installed here): equal to the torch rule per sequence, initial states where given."""
    from gspo_ray.trainer.gated_delta.delta_rule import run_varlen

    def varlen_kernel(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
        bounds = cu_seqlens.tolist()
        runs = [chunk_gated_delta_rule(q[0, a:z], k[0, a:z], v[0, a:z], g[0, a:z], beta[0, a:z], initial_state[i])
                for i, (a, z) in enumerate(zip(bounds, bounds[1:]))]
        return torch.cat([o for o, _ in runs])[None], torch.stack([s for _, s in runs])

    torch.manual_seed(4)
    h, dk, dv = 2, 8, 4
    pieces = [(l2norm(torch.randn(n, h, dk)), l2norm(torch.randn(n, h, dk)), torch.randn(n, h, dv),
               -torch.rand(n, h), torch.rand(n, h)) for n in (5, 70, 1)]
    states = [None, torch.randn(h, dk, dv), torch.randn(h, dk, dv)]
    got = run_varlen(pieces, states, varlen_kernel)
    for (out, final), piece, state in zip(got, pieces, states):
        want, want_final = chunk_gated_delta_rule(*piece, initial_state=state)
        assert torch.equal(out, want) and torch.equal(final, want_final)
    assert [o.shape[0] for o, _ in got] == [5, 70, 1]
