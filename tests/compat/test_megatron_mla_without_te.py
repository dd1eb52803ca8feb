"""megatron_mla_without_te: without Transformer Engine, megatron-core's MLASelfAttention still fails to build, and
builds once the workaround is applied.

This test FAILS
  * when the workaround stops being needed: megatron's multi_latent_attention module holds a real TELinear class
    (or HAVE_TE False) without Transformer Engine, or MLASelfAttention builds unpatched;
  * when it stops being correct: MLASelfAttention (local spec) does not build after apply_mla_te_fix.
One process (a world of one), a tiny MLA config."""
from __future__ import annotations

import pytest

from _spawn import run_ranks


def _build():
    import torch
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from gspo_ray.trainer.model import SegmentAttention

    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=64,
                                  q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16,
                                  v_head_dim=16, rope_type="rope", qk_layernorm=True, use_cpu_initialization=True,
                                  params_dtype=torch.float32, gradient_accumulation_fusion=False,
                                  attention_dropout=0.0)
    layer = specs.get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True)
    # the local DotProductAttention takes no k_channels / v_channels (MLA's widths): ours, as the trainer builds it
    layer.submodules.self_attention.submodules.core_attention = ModuleSpec(module=SegmentAttention)
    return type(build_module(layer.submodules.self_attention, config=config, layer_number=1)).__name__


def _scenario(rank, world_size, ports, rdzv):
    from gspo_ray.compat import megatron_cpu
    from gspo_ray.compat.megatron_mla_without_te import apply_mla_te_fix, needs_mla_te_fix
    from gspo_ray.trainer.parallel import init_distributed

    init_distributed(0, 1, "", 0, init_method=f"file://{rdzv}/single")
    megatron_cpu.apply()
    out = {"needed": needs_mla_te_fix()}
    try:
        out["unpatched"] = _build()
    except TypeError as e:
        out["unpatched"] = f"TypeError: {e}"
    out["applied"] = apply_mla_te_fix()
    out["patched"] = _build()
    return out


def test_mla_builds_only_with_the_workaround(tmp_path):
    pytest.importorskip("megatron.core")
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine is installed: the workaround does not apply")
    except ImportError:
        pass
    got = run_ranks(_scenario, world_size=1, args=(str(tmp_path),))[0]
    assert got["needed"], "megatron's MLA module no longer holds a TELinear stand-in: drop the workaround"
    assert got["unpatched"].startswith("TypeError") and "isinstance" in got["unpatched"], \
        f"MLA builds without the workaround: {got['unpatched']}"
    assert got["applied"] and got["patched"] == "MLASelfAttention"
