"""The trainer's memory model (gspo_ray/trainer/memory.py) against the built model it describes.

* activations: the elements a token keeps for the backward, per mode (none, selective), counted with saved-tensor
  hooks on a built Megatron model (storages counted once) at two token counts, the difference per token: equal to
  the model's per-layer counts summed (plus the final norm's) within 3%, on a dense Llama and a Qwen3-MoE;
* parameters: MemoryShape's counts equal transformers' own parameter count for the same config.json;
* the per-rank terms follow the layout (TP / EP shards, the distributed optimizer, offload, fp32).

The RSS check at real sizes is the memory bench (`gspo-ray bench --suite memory`, docs/scale.md).
"""
from __future__ import annotations

import pytest
import torch

from _spawn import run_ranks
from gspo_ray.trainer.memory import GIB, Layout, MemoryShape, activation_bytes, rank_memory

TOKENS = (128, 256)


def _hf_config(moe: bool):
    from transformers import LlamaConfig, Qwen3MoeConfig

    if moe:  # QK-norm, 4 MoE layers of 8 experts top-2
        return Qwen3MoeConfig(vocab_size=22, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                              num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                              tie_word_embeddings=False)
    return LlamaConfig(vocab_size=22, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                       max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from gspo_ray.models.tiny import build_tokenizer

    out = {}
    for moe in (False, True):
        path = tmp_path_factory.mktemp("memory") / ("moe" if moe else "dense")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_hf_config(moe), dtype=torch.float32)
        model.save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        out[moe] = (str(path), sum(p.numel() for p in model.parameters()))
    return out


def _saved_elements(rank, world_size, ports, model_dirs):
    """{model_dir: {mode: {tokens: elements the forward saves for the backward, storages counted once}}} (fp32:
    bytes / 4)."""
    from gspo_ray.trainer.logprobs import forward_logprobs
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import init_distributed

    init_distributed(0, 1, "127.0.0.1", ports[0], tp=1, ep=1, seed=0)
    out = {}
    for model_dir in model_dirs:
        for mode in ("none", "selective"):
            gpt, _ = build_model(model_dir, recompute=mode)
            gpt.train()
            for tokens in TOKENS:
                seen = {}

                def pack(t):
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    forward_logprobs(gpt, torch.randint(3, 20, (1, tokens)))
                out.setdefault(model_dir, {}).setdefault(mode, {})[tokens] = sum(seen.values()) / 4
    return out


@pytest.fixture(scope="module")
def saved(model_dirs):
    dirs = [model_dirs[moe][0] for moe in (False, True)]
    out = run_ranks(_saved_elements, 1, (dirs,))[0]
    return {moe: out[model_dirs[moe][0]] for moe in (False, True)}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("mode", ["none", "selective"])
def test_activation_counts_match_saved_tensors(saved, model_dirs, moe, mode):
    from gspo_ray.trainer.model_spec import read_hf_config

    shape = MemoryShape.from_hf_config(read_hf_config(model_dirs[moe][0]))
    measured = (saved[moe][mode][TOKENS[1]] - saved[moe][mode][TOKENS[0]]) / (TOKENS[1] - TOKENS[0])
    # the model's kept elements a token: every layer, the final norm and the output layer's input (3 h)
    predicted = shape.layers * shape.layer_act(moe, mode) + 3 * shape.hidden
    assert measured == pytest.approx(predicted, rel=0.03), (measured, predicted)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_parameter_counts_match_transformers(model_dirs, moe):
    from gspo_ray.trainer.model_spec import read_hf_config

    path, hf_params = model_dirs[moe]
    shape = MemoryShape.from_hf_config(read_hf_config(path))
    assert shape.total_params == hf_params
    assert (shape.expert_params > 0) == moe


QWEN3_30B = MemoryShape(name="Qwen3-30B-A3B", vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4,
                        head_dim=128, experts=128, top_k=8, moe_ffn=768, moe_layers=48, qk_norm=True)


def test_terms_follow_the_layout():
    one = rank_memory(QWEN3_30B, Layout(world=1, dtype="bfloat16", micro_batch_tokens=4096)).terms
    assert one["weights"] == 2 * QWEN3_30B.total_params and one["grads"] == 4 * QWEN3_30B.total_params
    assert one["main_params"] == 4 * QWEN3_30B.total_params and one["optimizer"] == 8 * QWEN3_30B.total_params
    ep8 = rank_memory(QWEN3_30B, Layout(world=8, ep=8, dtype="bfloat16", micro_batch_tokens=4096)).terms
    assert ep8["weights"] < one["weights"] / 5  # experts split 8 ways, the rest (~1.5 B) replicated
    # the distributed optimizer: dense state over DP 8, experts' over the expert-DP group (8 / 8 = 1)
    dense, experts = QWEN3_30B.dense_params, QWEN3_30B.expert_params // 8
    assert ep8["optimizer"] == int(8 * (dense / 8 + experts))
    off = rank_memory(QWEN3_30B, Layout(world=8, ep=8, dtype="bfloat16", micro_batch_tokens=4096, offload=True))
    assert off.terms["optimizer"] == off.terms["main_params"] == 0
    assert off.host == ep8["optimizer"] + ep8["main_params"]
    fp32 = rank_memory(QWEN3_30B, Layout(world=1, dtype="float32", micro_batch_tokens=4096)).terms
    assert fp32["main_params"] == 0 and fp32["weights"] == 4 * QWEN3_30B.total_params
    # activations: full recompute keeps a layer's input, the rest scale with tokens and split over TP
    lay = Layout(world=8, tp=2, ep=4, micro_batch_tokens=32768)
    none, full = (activation_bytes(QWEN3_30B, Layout(**{**lay.__dict__, "recompute": m})) for m in ("none", "full"))
    assert full < none / 10
    assert activation_bytes(QWEN3_30B, Layout(**{**lay.__dict__, "tp": 1})) == pytest.approx(2 * none, rel=1e-3)
    assert rank_memory(QWEN3_30B, lay).total / GIB > 80  # the review's layout: no H100 holds it


def test_parameter_counts_of_a_family_with_shared_experts_and_qkv_bias(tmp_path):
    """glm4_moe (trainer/families/): a dense first layer, shared experts, q/k/v biases."""
    from transformers import AutoModelForCausalLM

    from gspo_ray.models.tiny import ensure_tiny_model
    from gspo_ray.trainer.model_spec import read_hf_config

    path = ensure_tiny_model("glm4_moe", tmp_path / "glm4_moe", seed=0)
    shape = MemoryShape.from_hf_config(read_hf_config(path))
    assert shape.shared_ffn > 0 and shape.qkv_bias and shape.moe_layers < shape.layers
    assert shape.total_params == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


@pytest.mark.parametrize("q_lora_rank", [None, 48])
def test_parameter_counts_with_multi_latent_attention(q_lora_rank):
    """deepseek_v3 (multi-latent attention, a dense first layer, shared experts): counted as transformers builds it."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_nope_head_dim=16,
                           qk_rope_head_dim=16, v_head_dim=24, intermediate_size=96, moe_intermediate_size=32,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           n_group=1, topk_group=1, max_position_embeddings=64, rms_norm_eps=1e-6)
    shape = MemoryShape.from_hf_config(cfg.to_dict())
    hf = AutoModelForCausalLM.from_config(cfg)
    assert shape.attn_params is not None and shape.moe_layers == 1
    assert shape.total_params == sum(p.numel() for p in hf.parameters())
