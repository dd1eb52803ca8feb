"""Multi-latent attention (DeepSeek-V2/V3, Kimi-K2): the HF config keys it reads and refuses, Megatron's
`MLATransformerConfig` options, and the HF <-> Megatron names of its projections. No torch at import (the
preflight reads it).

    options = mla_options(cfg, where)        # {} for a config without kv_lora_rank; ValueError naming a key
    MLATransformerConfig(..., **options)     # with get_gpt_layer_local_spec(multi_latent_attention=True, ...)
    MLA_NAME_RULES                           # (Megatron regex, HF names, merge, TP shard), as families/base.py

What runs (Megatron's MLASelfAttention, megatron-core 0.16.1, with our SegmentAttention as core attention):

    q      = q_up(RMSNorm(q_down(x)))                    (q_lora_rank set; else q = q_proj(x))   [S, B, H, nope + rope]
    c, kpe = kv_down(x) split [kv_lora_rank, rope]
    k, v   = kv_up(RMSNorm(c)) split [nope, v_head_dim] per head
    q_pe, kpe rotated (rope part only; DeepSeek's interleaved pairs), kpe shared by every head
    attention by segment over q = [q_nope ; q_pe], k = [k_nope ; kpe], v, softmax scale mscale^2 / sqrt(nope + rope)

The convention, checked against transformers' DeepseekV3Attention and DeepSeek's reference (inference/model.py):
- RoPE on the rope part is interleaved: pairs (x0, x1), (x2, x3), .. rotated by one angle each. Megatron's
  `apply_rotary_pos_emb` with `multi_latent_attention` de-interleaves (x[0::2], x[1::2]) and rotates halves, which
  gives q . k exactly as transformers' `rope_interleave: true`. `rope_interleave: false` (transformers rotates the
  halves as stored) is refused: Megatron cannot express it, and vLLM 0.32 ignores the key (always interleaved), so
  trainer and engine would disagree.
- YaRN (`rope_type: yarn`, what DeepSeek-V3 / Kimi-K2 ship): inv_freq blended by the ramp between beta_fast and
  beta_slow over original_max_position_embeddings (rounded bounds: transformers' `truncate: true`), cos / sin times
  the concentration factor mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the softmax scale times
  mscale(factor, mscale_all_dim)^2 (DeepSeek's `softmax_scale`), mscale(s, m) = 0.1 m ln s + 1. transformers falls
  back to mscale(factor) unless both mscale and mscale_all_dim are set; a config on which Megatron, transformers
  and vLLM would compute different factors is refused by its keys.
- The latent RMSNorms (q_a_layernorm, kv_a_layernorm) use eps 1e-6 in transformers and DeepSeek's reference,
  rms_norm_eps in vLLM and Megatron: equal only at rms_norm_eps 1e-6 (every DeepSeek-V3 / Kimi-K2 config); other
  values are refused.
- vLLM's sampled log-probs equal transformers' once compat/vllm_cpu_mla_rope.py is applied (CPU engines with
  default RoPE; docs/real-models.md has the numbers).
"""
from __future__ import annotations

import math

# transformers' DeepseekV3Attention names under model.layers.{i}.self_attn; Megatron's MLASelfAttention (local spec).
# Column-parallel projections split their output rows over TP (q_down's rows are gathered back whole by Megatron:
# TP must divide q_lora_rank); kv_down is replicated (compat/megatron_mla_tp_grad.py: the column-parallel one loses
# part of the rope key's gradient at TP > 1), so every rank holds kv_a_proj_with_mqa whole.
_ATTN = r"decoder\.layers\.(\d+)\.self_attention\."
_HF = "model.layers.{i}.self_attn."
MLA_NAME_RULES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    (_ATTN + r"linear_q_proj\.weight", (_HF + "q_proj.weight",), "copy", "col"),
    (_ATTN + r"linear_q_down_proj\.weight", (_HF + "q_a_proj.weight",), "copy", "col"),
    (_ATTN + r"q_layernorm\.weight", (_HF + "q_a_layernorm.weight",), "copy", "none"),
    (_ATTN + r"linear_q_up_proj\.weight", (_HF + "q_b_proj.weight",), "copy", "col"),
    (_ATTN + r"linear_kv_down_proj\.weight", (_HF + "kv_a_proj_with_mqa.weight",), "copy", "none"),
    (_ATTN + r"kv_layernorm\.weight", (_HF + "kv_a_layernorm.weight",), "copy", "none"),
    (_ATTN + r"linear_kv_up_proj\.weight", (_HF + "kv_b_proj.weight",), "copy", "col"),
    (_ATTN + r"linear_proj\.weight", (_HF + "o_proj.weight",), "copy", "row"),
)


def mla_param_names(options: dict) -> list[str]:
    """The parameters of one MLASelfAttention (local spec), in module order, relative to `self_attention.`:
    MultiLatentAttention registers linear_proj, then MLASelfAttention its projections and the latent norms."""
    q = ["linear_q_proj.weight"] if options["q_lora_rank"] is None else ["linear_q_down_proj.weight",
                                                                          "linear_q_up_proj.weight"]
    norms = (["q_layernorm.weight"] if options["q_lora_rank"] is not None else []) + ["kv_layernorm.weight"]
    return ["linear_proj.weight", *q, "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", *norms]


# The HF linears of multi-latent attention a LoRA adapter can name (PEFT / vLLM names)
MLA_LORA_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

# DeepSeek-V3.2's sparse-attention indexer (a lightning indexer picking top-k keys per query): not plain attention
INDEXER_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
ROPE_TYPES = ("default", "yarn")
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, DeepSeek's reference RMSNorm default


def is_mla(cfg: dict) -> bool:
    """Whether a HF config.json describes multi-latent attention."""
    return cfg.get("kv_lora_rank") is not None


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's yarn_get_mscale (transformers, vLLM and Megatron alike)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg: dict, default_theta: float = 10000.0) -> dict:
    """The RoPE dict of a config (transformers 5: rope_parameters; 4.x: rope_scaling plus top-level rope_theta;
    `default_theta` where neither names rope_theta: the config class's own default)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    return rope


def require_yarn_keys(rope: dict, keys, where: str, source: str = "rope_parameters") -> None:
    """ValueError naming the first of `keys` a YaRN dict lacks (None or 0; `source`: the config.json key it came
    from)."""
    for key in keys:
        if not rope.get(key):
            raise ValueError(f"{where}: {source}.rope_type 'yarn' without {source}.{key}")


def _yarn_options(rope: dict, where: str) -> dict:
    """Megatron's YaRN keywords for a DeepSeek YaRN dict; refuses what would make the three sides differ."""
    require_yarn_keys(rope, ("factor", "original_max_position_embeddings"), where)
    factor = float(rope["factor"])
    if rope.get("truncate", True) is not True:
        raise ValueError(f"{where}: rope_parameters.truncate {rope['truncate']!r} is not supported (YaRN with "
                         "rounded correction bounds only)")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # transformers: the ratio when both are set, else mscale(factor); Megatron and vLLM: always the ratio
    hf = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
          else yarn_mscale(factor))
    m, m_all = float(mscale if mscale is not None else 1.0), float(mscale_all_dim or 0.0)
    megatron = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    if abs(hf - megatron) > 1e-12:
        raise ValueError(f"{where}: rope_parameters.mscale {mscale!r} with mscale_all_dim {mscale_all_dim!r}: "
                         "transformers and vLLM / Megatron compute different YaRN attention factors; set both")
    if rope.get("attention_factor") is not None:  # vLLM reads attention_factor 1.0 as another scaling altogether
        raise ValueError(f"{where}: rope_parameters.attention_factor {rope['attention_factor']!r} is not supported "
                         "(DeepSeek's YaRN derives it from mscale / mscale_all_dim)")
    return dict(rope_type="yarn", rotary_scaling_factor=factor,
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=m, mscale_all_dim=m_all)


def mla_options(cfg: dict, where: str) -> dict:
    """HF config.json (dict) -> MLATransformerConfig keywords ({} without kv_lora_rank). ValueError naming the
    config.json key and value for what the trainer, transformers and vLLM would not compute alike."""
    bad = [k for k in INDEXER_KEYS if cfg.get(k) is not None]
    if bad:
        raise ValueError(f"{where}: {bad[0]} {cfg[bad[0]]!r}: DeepSeek-V3.2's sparse-attention indexer is not "
                         "supported (dense multi-latent attention only)")
    if not is_mla(cfg):
        return {}
    for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise ValueError(f"{where}: kv_lora_rank {cfg['kv_lora_rank']!r} without {key} (multi-latent attention "
                             "needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim)")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if kv_heads != heads:
        raise ValueError(f"{where}: num_key_value_heads {kv_heads!r} with multi-latent attention (every head has its "
                         f"own keys: num_attention_heads {heads})")
    if cfg.get("rope_interleave", True) is not True:
        raise ValueError(f"{where}: rope_interleave {cfg['rope_interleave']!r} is not supported (DeepSeek's "
                         "interleaved RoPE only; vLLM ignores the key)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias {cfg['attention_bias']!r} is not supported with multi-latent "
                         "attention")
    eps = float(cfg.get("rms_norm_eps", LATENT_NORM_EPS))
    if eps != LATENT_NORM_EPS:
        raise ValueError(f"{where}: rms_norm_eps {eps!r} with multi-latent attention is not supported (transformers "
                         f"fixes the latent norms' eps at {LATENT_NORM_EPS}, vLLM uses rms_norm_eps)")
    rope = rope_parameters(cfg)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_parameters.rope_type {kind!r} is not supported with multi-latent attention "
                         f"(valid: {', '.join(ROPE_TYPES)})")
    options = dict(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_head_dim=int(cfg["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]),
                   v_head_dim=int(cfg["v_head_dim"]), rotary_base=float(rope["rope_theta"]), rotary_percent=1.0,
                   rope_type="rope")
    if kind == "yarn":
        options |= _yarn_options(rope, where)
    return options


def check_mla_layout(options: dict, tp: int, sequence_parallel: bool, where: str) -> None:
    """What a parallel layout needs of multi-latent attention: TP dividing q_lora_rank (Megatron's column-parallel
    q_down), and sequence parallelism at TP > 1 (the replicated kv_down of compat/megatron_mla_tp_grad.py)."""
    if not options or tp == 1:
        return
    if (options["q_lora_rank"] or 0) % tp:
        raise ValueError(f"{where}: tp={tp} must divide q_lora_rank {options['q_lora_rank']}")
    if not sequence_parallel:
        raise ValueError(f"{where}: multi-latent attention at tp={tp} needs sequence_parallel")
