"""The layer specs of a hybrid family (Qwen3-Next: families/qwen3_next.py): Gated DeltaNet layers beside gated
softmax attention layers, every norm zero-centred.

    layer = hybrid_layer(local_spec, spec, linear)     # model._layer_spec's spec of one layer, made hybrid
    norm = final_norm(spec)                            # the block's final norm

A "linear_attention" layer's self_attention is GatedDeltaAttention (gated_delta/megatron_layer.py) with the
config's sizes; a "full_attention" layer keeps SelfAttention (its output gate is the config's
attention_output_gate). With `zero_centered_norms` the input, pre-MLP and q / k norms are ZeroCenteredRMSNorm
(attention/gated_attention.py), holding the checkpoint's tensors as they are.
"""
from __future__ import annotations

from gspo_ray.trainer.attention.gated_attention import ZeroCenteredRMSNorm
from gspo_ray.trainer.families import family_of
from gspo_ray.trainer.gated_delta.by_segment import DeltaHeads
from gspo_ray.trainer.model_spec import ModelSpec


def delta_heads(cfg: dict) -> DeltaHeads:
    """The Gated DeltaNet sizes of a Qwen3-Next config.json."""
    return DeltaHeads(key_heads=int(cfg["linear_num_key_heads"]), key_dim=int(cfg["linear_key_head_dim"]),
                      value_heads=int(cfg["linear_num_value_heads"]), value_dim=int(cfg["linear_value_head_dim"]))


def hybrid_layer(layer, spec: ModelSpec, linear: bool):
    """A local layer spec -> the hybrid family's: GatedDeltaAttention where `linear`, zero-centred norms."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from gspo_ray.trainer.gated_delta.megatron_layer import GatedDeltaAttention

    if spec.use_te:
        raise NotImplementedError(f"{spec.arch}: the Transformer Engine spec (use_te) is not built for hybrid layers")
    sub = layer.submodules
    if linear:
        sub.self_attention = ModuleSpec(module=GatedDeltaAttention, params={
            "heads": delta_heads(spec.hf_config), "conv_kernel": int(spec.hf_config["linear_conv_kernel_dim"])})
    elif family_of(spec.arch).zero_centered_norms:
        sub.self_attention.submodules.q_layernorm = ModuleSpec(module=ZeroCenteredRMSNorm)
        sub.self_attention.submodules.k_layernorm = ModuleSpec(module=ZeroCenteredRMSNorm)
    if family_of(spec.arch).zero_centered_norms:
        sub.input_layernorm = ModuleSpec(module=ZeroCenteredRMSNorm)
        sub.pre_mlp_layernorm = ModuleSpec(module=ZeroCenteredRMSNorm)
    return layer


def final_norm(spec: ModelSpec):
    """The block's final norm: zero-centred for such a family."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import LayerNormImpl

    return ModuleSpec(module=ZeroCenteredRMSNorm) if family_of(spec.arch).zero_centered_norms else LayerNormImpl
