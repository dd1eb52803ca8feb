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

from gspo_ray.trainer.families.deepseek_moe import DeepSeekMoEFamily


class Glm4Moe(DeepSeekMoEFamily):
    model_type = "glm4_moe"
    engine_class = "Glm4MoeForCausalLM"
    reads_attention_bias = True
    reads_partial_rotary = True

    def uses_qk_norm(self, cfg: dict) -> bool:
        return bool(cfg.get("use_qk_norm", False))

    def rotary_percent(self, cfg: dict) -> float:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))

    def refuse_unsupported(self, cfg: dict, hf_dir) -> None:
        super().refuse_unsupported(cfg, hf_dir)
        where = f"{hf_dir}/config.json"
        factor = self.rotary_percent(cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rotated = int(head_dim * factor)
        if not 0 < factor <= 1 or rotated < 2 or rotated % 2:
            raise ValueError(f"{where}: partial_rotary_factor {factor!r} rotates {rotated} of head_dim {head_dim} "
                             "dimensions (must be a positive even number, factor in (0, 1])")


FAMILY = Glm4Moe()
