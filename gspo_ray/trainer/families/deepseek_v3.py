"""DeepSeek-V3 and Kimi-K2 (`model_type: deepseek_v3`, alias `kimi_k2`: Kimi-K2 checkpoints say `kimi_k2` with
`DeepseekV3ForCausalLM` architectures): DeepSeekMoE blocks (deepseek_moe.py: shared experts, the sigmoid router
with its correction bias, group-limited top-k, `routed_scaling_factor`, dense first layers) under multi-latent
attention (attention/mla.py: Megatron's MLASelfAttention with attention by segment as its core, default RoPE or
YaRN, DeepSeek's interleaved rope pairs).

Read: the MLA keys (`q_lora_rank` optional, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`,
`rope_parameters` / 4.x `rope_scaling`); refused by name: what attention/mla.py refuses (DeepSeek-V3.2's indexer,
`rope_interleave: false`, YaRN variants the sides compute differently, ...), an FP8 block-quantised checkpoint
(`quantization_config`: the official DeepSeek-V3 / Kimi-K2 weights; dequantise first). Skipped on load: the
multi-token-prediction layers past the decoder (`num_nextn_predict_layers`), as in GLM-4.5; the HF export copies
them unchanged. Kimi K2.5 and later (`kimi_k25`, multimodal) are another model_type: no family takes it.
"""
from __future__ import annotations

from gspo_ray.trainer.attention.mla import MLA_LORA_TARGETS, MLA_NAME_RULES, rope_parameters
from gspo_ray.trainer.families.base import LLAMA_NAME_RULES, SHARED_EXPERT_NAME_RULES
from gspo_ray.trainer.families.deepseek_moe import DeepSeekMoEFamily


class DeepseekV3(DeepSeekMoEFamily):
    model_type = "deepseek_v3"
    aliases = ("kimi_k2",)
    engine_class = "DeepseekV3ForCausalLM"
    multi_latent_attention = True
    # MLA's rules first: its q_layernorm / linear_proj names shadow the Llama-like attention's
    name_rules = MLA_NAME_RULES + LLAMA_NAME_RULES + SHARED_EXPERT_NAME_RULES
    # multi-latent attention's projections (q_proj only without q_lora_rank) and the MLPs': dense, routed and shared
    # experts (trainer/lora/adapters.py)
    lora_targets = MLA_LORA_TARGETS + ("gate_proj", "up_proj", "down_proj")

    def rope_theta(self, cfg: dict) -> float:
        """The RoPE base (default RoPE or YaRN: attention/mla.py reads and checks the rest)."""
        return float(rope_parameters(cfg)["rope_theta"])

    def refuse_unsupported(self, cfg: dict, hf_dir) -> None:
        super().refuse_unsupported(cfg, hf_dir)
        quant = cfg.get("quantization_config")
        if quant:
            raise ValueError(f"{hf_dir}/config.json: quantization_config {quant.get('quant_method', quant)!r} is not "
                             "supported (FP8 block-quantised weights: dequantise the checkpoint first)")


FAMILY = DeepseekV3()
