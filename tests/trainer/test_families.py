"""The architecture families (trainer/families/) and their registry: each of the five families states what the
converter, the preflight and the LoRA code used to hard-code by model_type, with the same values; the registry
resolves model_types and aliases and imports no torch (the preflight reads it before anything heavy)."""
import json
import subprocess
import sys

import pytest
import torch

from gspo_ray.config.lora import DEFAULT_LORA_TARGETS, LORA_TARGETS, LoRAConfig
from gspo_ray.preflight.model import ENGINE_ARCHITECTURES
from gspo_ray.trainer import families
from gspo_ray.trainer.families import FAMILIES, family_of
from gspo_ray.trainer.lora.adapters import apply_lora
from gspo_ray.trainer.model_spec import SUPPORTED_ARCHS, spec_from_hf_config

DENSE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=32)
CONFIGS = {"llama": DENSE, "qwen2": DENSE, "qwen3": DENSE,
           "qwen3_moe": DENSE | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     mlp_only_layers=[0], decoder_sparse_step=1),
           "mixtral": DENSE | dict(num_local_experts=4, num_experts_per_tok=2)}


FIVE = tuple(CONFIGS)  # the families that moved onto the registry; later ones have their own test modules


def spec_of(model_type, **extra):
    return spec_from_hf_config({"model_type": model_type, **CONFIGS[model_type], **extra}, "m")


def test_the_registry_maps_the_five_model_types_to_their_families_and_nothing_else(monkeypatch):
    assert tuple(FAMILIES) == SUPPORTED_ARCHS == ("qwen2", "qwen3", "qwen3_moe", "llama", "mixtral", "glm4_moe",
                                                  "deepseek_v3", "qwen3_next", "gpt_oss")
    assert all(family_of(t) is f and f.model_type == t for t, f in FAMILIES.items())
    assert [family_of(t) for t in (None, "gpt2", "Llama", ["llama"])] == [None] * 4
    # the classes vLLM loads, as the preflight's table had them
    assert ENGINE_ARCHITECTURES == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                    "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM",
                                    "mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                                    "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                                    "gpt_oss": "GptOssForCausalLM"}
    assert family_of("kimi_k2") is FAMILIES["deepseek_v3"]  # Kimi-K2 checkpoints: DeepseekV3ForCausalLM
    monkeypatch.setitem(families.ALIASES, "my_llama", "llama")  # an alias resolves to its family
    assert family_of("my_llama") is FAMILIES["llama"]


def test_each_family_states_what_the_converter_hard_coded():
    facts = {t: (s.qkv_bias, s.qk_norm, s.is_moe, s.moe_layers, s.moe_ffn_hidden_size, s.extra["norm_topk_prob"])
             for t in FIVE for s in [spec_of(t)]}
    assert facts == {"llama": (False, False, False, (), 0, False), "qwen2": (True, False, False, (), 0, False),
                     "qwen3": (False, True, False, (), 0, False),
                     "qwen3_moe": (False, True, True, (1, 2, 3), 32, False),
                     "mixtral": (False, False, True, (0, 1, 2, 3), 128, True)}  # Mixtral always renormalises
    assert spec_of("qwen3_moe", norm_topk_prob=True).extra["norm_topk_prob"]
    # Mixtral's `sliding_window` turns the window on by itself; Qwen's configs carry it unused
    with pytest.raises(ValueError, match=r"^m/config.json: sliding-window attention is not supported$"):
        spec_of("mixtral", sliding_window=4096)
    assert spec_of("qwen3", sliding_window=4096, use_sliding_window=False).arch == "qwen3"
    with pytest.raises(ValueError, match=r"^m/config.json: model_type 'gpt2' not supported; valid: \('qwen2', "):
        spec_from_hf_config({"model_type": "gpt2", **DENSE}, "m")


def test_each_family_gives_megatron_its_maths_and_router():
    """Family.transformer_options: the TransformerConfig keywords build_transformer_config passed for each model."""
    for t in FIVE:
        options = FAMILIES[t].transformer_options(spec_of(t))
        assert options.pop("activation_func") is torch.nn.functional.silu
        base = dict(normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, add_bias_linear=False,
                    add_qkv_bias=t == "qwen2", qk_layernorm=t in ("qwen3", "qwen3_moe"))
        router = {"qwen3_moe": dict(moe_router_score_function="softmax", moe_router_pre_softmax=True),
                  "mixtral": dict(moe_router_score_function="softmax", moe_router_pre_softmax=False)}
        assert options == base | router.get(t, {}), t
    renormalised = spec_of("qwen3_moe", norm_topk_prob=True)
    assert not FAMILIES["qwen3_moe"].transformer_options(renormalised)["moe_router_pre_softmax"]


HYBRID = dict(model_type="qwen3_next", hidden_size=32, intermediate_size=64, num_hidden_layers=4, vocab_size=32,
              layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)


@pytest.mark.parametrize("change,message", [
    ({"partial_rotary_factor": 0.1}, r"partial_rotary_factor 0.1 rotates 1 of head_dim 16"),
    ({"linear_num_value_heads": 3}, r"linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    ({"linear_conv_kernel_dim": None}, r"linear_conv_kernel_dim is None; expected a positive integer"),
])
def test_the_trainers_qwen3_next_checks_the_keys_the_preflight_checks(change, message):
    """The trainer's own path (spec_from_hf_config), not only the preflight's refusal, names a contradicting key."""
    assert spec_from_hf_config(HYBRID, "m").rotary_percent == 0.25
    with pytest.raises(ValueError, match=r"^m/config.json: " + message):
        spec_from_hf_config(HYBRID | change, "m")


def test_hf_names_are_the_familys():
    mixtral, qwen = FAMILIES["mixtral"], FAMILIES["qwen3_moe"]
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert mixtral.hf_name(expert) == "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    assert mixtral.hf_name("model.layers.1.mlp.gate.weight") == "model.layers.1.block_sparse_moe.gate.weight"
    assert mixtral.hf_name("model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"  # dense
    assert qwen.hf_name(expert) == expert


def test_lora_targets_are_the_configs_and_a_target_the_family_lacks_is_refused(monkeypatch):
    assert all(f.lora_targets == DEFAULT_LORA_TARGETS for t, f in FAMILIES.items()
               if t not in ("deepseek_v3", "qwen3_next", "gpt_oss"))
    assert FAMILIES["qwen3_next"].lora_targets == ()  # no adapter layout for its gated q_proj yet
    assert FAMILIES["gpt_oss"].lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj")  # no per-expert names
    assert set(FAMILIES["deepseek_v3"].lora_targets) < set(LORA_TARGETS)  # no k / v: multi-latent attention
    assert set(LORA_TARGETS) == {t for f in FAMILIES.values() for t in f.lora_targets}  # each one some family's
    monkeypatch.setattr(FAMILIES["llama"], "lora_targets", ("q_proj", "k_proj"))
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules: 'v_proj' is not a linear of llama models; "
                                         r"valid: q_proj, k_proj"):
        apply_lora(torch.nn.Linear(2, 2), spec_of("llama"), LoRAConfig(target_modules=["q_proj", "v_proj"]))


def test_the_registry_imports_no_torch():
    code = ("import sys, json\nimport gspo_ray.trainer.families, gspo_ray.preflight.model\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'transformers'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
