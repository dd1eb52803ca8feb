"""GLM-4.5 / 4.6 (`model_type: glm4_moe`): DeepSeekMoE blocks (deepseek_moe.py: shared experts, the sigmoid router
with its correction bias, dense first layers) under Llama-like attention with partial rotary, optional q/k/v biases
and optional QK-norm.

Read (transformers 5.19 `Glm4MoeForCausalLM`, vLLM 0.32 `Glm4MoeForCausalLM`):
- `partial_rotary_factor` (in `rope_parameters`, or at the top level; 0.5 when absent, transformers' and vLLM's
  default): RoPE rotates the first `int(head_dim * factor)` dimensions of each head, rotate-half pairing (not
  interleaved), the rest pass through: Megatron's `rotary_percent` with `rotary_interleaved=False`;
- `attention_bias`: biases on q / k / v (never on o_proj): Megatron's `add_qkv_bias`;
- `use_qk_norm`: RMSNorm per head on queries and keys before RoPE: Megatron's `qk_layernorm`.
Skipped: the multi-token-prediction layers a GLM-4.5 checkpoint carries after its decoder
(`model.layers.{num_hidden_layers + j}.*`, `num_nextn_predict_layers`), which transformers and vLLM's sampler do not
run either; the trainer's HF export copies them unchanged (trainer/weights/hf_export.py), so the exported
checkpoint keeps them.
"""
from __future__ import annotations

from gspo_ray.trainer.families.base import check_rotated_share, partial_rotary
from gspo_ray.trainer.families.deepseek_moe import DeepSeekMoEFamily


class Glm4Moe(DeepSeekMoEFamily):
    model_type = "glm4_moe"
    engine_class = "Glm4MoeForCausalLM"
    reads_attention_bias = True
    reads_partial_rotary = True

    def uses_qk_norm(self, cfg: dict) -> bool:
        return bool(cfg.get("use_qk_norm", False))

    def rotary_percent(self, cfg: dict) -> float:
        return float(partial_rotary(cfg, 0.5))

    def refuse_unsupported(self, cfg: dict, hf_dir) -> None:
        super().refuse_unsupported(cfg, hf_dir)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        check_rotated_share(partial_rotary(cfg, 0.5), head_dim, f"{hf_dir}/config.json")


FAMILY = Glm4Moe()
