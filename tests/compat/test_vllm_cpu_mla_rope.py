"""vllm_cpu_mla_rope: vLLM's CPU rotary kernel still rotates DeepSeek MLA's 3-d queries / keys at wrong positions,
and the wrapped forward_cpu equals vLLM's PyTorch rotary there and DeepSeek's convention (transformers).

This test FAILS
  * when the workaround stops being needed: the unpatched forward_cpu (the `_C.rotary_embedding` kernel) rotates the
    MLA layout (query `q[..., nope:]` of [T, H, nope + rope], key a [T, 1, rope] view of the latent) as
    forward_native does;
  * when it stops being correct: the wrapped forward_cpu differs from forward_native on that layout, changes a 2-d
    call (bit for bit, in place as before), or its attention scores differ from transformers' DeepseekV3 rotary
    (interleaved pairs, `rope_interleave: true`).
The engine-level numbers (log-probs of a tiny DeepseekV3ForCausalLM before / after) are `gspo-ray bench --suite
mla-convention` (docs/real-models.md).
"""
from __future__ import annotations

import pytest
import torch

from gspo_ray.compat.vllm_cpu_mla_rope import apply_mla_rope_fix, mla_rope_fix_undone, needs_mla_rope_fix

T, H, NOPE, ROPE, LORA = 11, 4, 32, 64, 512
TOL = 1e-5  # fp32 rotations of the same numbers (measured: 0.0 against forward_native, ~4e-6 against transformers)


@pytest.fixture(scope="module")
def rope():
    assert needs_mla_rope_fix(), "vLLM's version or platform changed: re-measure whether the workaround is needed"
    assert apply_mla_rope_fix()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    # custom ops on, as in a CPU engine with enforce_eager: dispatch goes to forward_cpu
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(ROPE, max_position=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        is_neox_style=False, dtype=torch.float32)  # what DeepseekV2MLAAttention builds
    return rope


def _mla_inputs(seed: int = 0):
    """The MLA call's operands: q [T, H, nope + rope] and the latent [T, kv_lora_rank + rope], as views."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, NOPE + ROPE, generator=g), torch.randn(T, LORA + ROPE, generator=g)


def _mla_call(forward, positions, q, latent):
    """What vllm/model_executor/layers/mla.py does: rotate q's rope part and k_pe, keep what is returned."""
    q, latent = q.clone(), latent.clone()
    k_pe = latent[:, LORA:].unsqueeze(1)
    q[..., NOPE:], k_pe = forward(positions, q[..., NOPE:], k_pe)
    return q[..., NOPE:], k_pe[:, 0]


def test_kernel_still_wrong_on_the_mla_layout(rope):
    positions = torch.arange(T)
    q, latent = _mla_inputs()
    want_q, want_k = _mla_call(rope.forward_native, positions, q, latent)
    with mla_rope_fix_undone():
        got_q, got_k = _mla_call(rope.forward_cpu, positions, q, latent)
    assert (got_q - want_q).abs().max() > 0.1, "the CPU rotary kernel now takes 3-d queries: drop the workaround"
    assert (got_k - want_k).abs().max() > 0.1, "the CPU rotary kernel now takes strided 3-d keys: drop the workaround"


def test_fixed_forward_cpu_equals_native_and_keeps_2d_calls(rope):
    positions = torch.tensor([3, 0, 1, 2, 7, 8, 9, 4, 5, 6, 10])  # any positions (packed rows restart)
    q, latent = _mla_inputs(1)
    got = _mla_call(rope.forward_cpu, positions, q, latent)
    want = _mla_call(rope.forward_native, positions, q, latent)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0)
    # a 2-d call (every other model here) still goes to the kernel, in place, bit-equal to it
    q2, k2 = torch.randn(T, H * ROPE), torch.randn(T, ROPE)
    with mla_rope_fix_undone():
        want_q, want_k = q2.clone(), k2.clone()
        rope.forward_cpu(positions, want_q, want_k)
    got_q, got_k = q2.clone(), k2.clone()
    out_q, _ = rope.forward_cpu(positions, got_q, got_k)
    assert out_q.data_ptr() == got_q.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_fixed_rotation_is_deepseeks_convention(rope):
    """Scores q_i . k_j of the rope part equal transformers' DeepseekV3 interleaved rotary (DeepSeek's reference)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    positions = torch.arange(T)
    q, latent = _mla_inputs(2)
    got_q, got_k = _mla_call(rope.forward_cpu, positions, q, latent)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q[..., NOPE:].transpose(0, 1)[None], latent[None, None, :, LORA:],
                                                 emb.cos(), emb.sin())
    got_scores = torch.einsum("thd,sd->hts", got_q, got_k)
    hf_scores = hf_q[0] @ hf_k[0].transpose(-1, -2)
    torch.testing.assert_close(got_scores, hf_scores, atol=TOL * 10, rtol=TOL)
