"""Fixtures of the trainer tests: tiny HF models and their transformers reference log-probs.

Multi-rank scenarios run through `_spawn.run_ranks` (N spawned processes forming one gloo group; Megatron and its
CPU patches never enter the pytest process). Scenario functions live in the test modules so spawned children can
import them by module name.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# pytest runs with --import-mode=importlib, which puts no test directory on sys.path; the test modules import the
# `_spawn` helper by name, and spawned ranks re-import test modules by name (`tests.trainer.test_x`). Spawned
# children copy sys.path, so making both roots importable here serves them too.
_HERE = Path(__file__).resolve().parent
for _root in (_HERE, _HERE.parents[1]):
    if str(_root) not in sys.path:
        sys.path.append(str(_root))

from gspo_ray.models.tiny import DEFAULT_ALPHABET, ensure_tiny_model

# One extra character makes the qwen2 vocabulary odd (23): under TP=2 Megatron pads it to 24, which the
# log-prob and export code must hide.
ODD_ALPHABET = DEFAULT_ALPHABET + "#"


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """Tiny Qwen3-MoE: vocab 22, hidden 64, 2 layers, 4 experts top-2, 4 heads / 2 kv heads, QK-norm."""
    return ensure_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tiny") / "qwen3_moe", seed=0)


def make_tiny_llama(out):
    """Llama with tied embeddings (SmolLM2's layout): 6 heads / 2 kv heads of 8, hidden 48, rope theta 1e5."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gspo_ray.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
                         max_position_embeddings=128)
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama_tied")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Tiny Qwen2 with qkv bias and an odd vocabulary (23)."""
    return ensure_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2_odd", seed=1, alphabet=ODD_ALPHABET)


def random_batch(vocab: int, batch: int = 4, length: int = 17, seed: int = 0):
    """tokens [B, L] (odd L: TP=2 must pad it), lengths [B] with right padding (pad id 0 past each length)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (batch, length), generator=g)
    lengths = torch.tensor([length, length - 4, 9, 2][:batch] + [length] * max(0, batch - 4))
    tokens[torch.arange(length)[None] >= lengths[:, None]] = 0
    return tokens, lengths


def hf_logprobs(hf_dir, tokens: torch.Tensor, lengths: torch.Tensor):
    """transformers reference: (logp [B, L], entropy [B, L]) aligned like forward_logprobs (0 at t=0 and padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        logsm = torch.log_softmax(model(tokens).logits.float(), dim=-1)[:, :-1]
    logp, entropy = torch.zeros(tokens.shape), torch.zeros(tokens.shape)
    logp[:, 1:] = logsm.gather(-1, tokens[:, 1:, None])[..., 0]
    entropy[:, 1:] = -(logsm.exp() * logsm).sum(-1)
    pos = torch.arange(tokens.shape[1])[None]
    valid = (pos >= 1) & (pos < lengths[:, None])
    return logp * valid, entropy * valid


@pytest.fixture(scope="session")
def tiny_models(tiny_moe_dir, tiny_qwen2_dir, tiny_llama_dir):
    """{arch: (hf_dir, tokens, lengths, ref_logp, ref_entropy)} for the tiny models."""
    out = {}
    for arch, hf_dir, vocab in (("qwen3_moe", tiny_moe_dir, 22), ("qwen2", tiny_qwen2_dir, 23),
                                ("llama", tiny_llama_dir, 22)):
        tokens, lengths = random_batch(vocab, seed=len(arch))
        out[arch] = (str(hf_dir), tokens, lengths, *hf_logprobs(hf_dir, tokens, lengths))
    return out
