"""gpt-oss (`model_type: gpt_oss`, transformers 5.19 `GptOssForCausalLM`, vLLM 0.32 `GptOssForCausalLM`): attention
with biases, learned sinks and sliding windows on alternate layers, and an MoE in every layer whose router and
experts carry biases.

What it is, and how Megatron states it (no module of our own was needed: megatron-core 0.16 has every piece):
- attention: q / k / v / o biases (`attention_bias`: Megatron's `add_bias_linear` with `add_qkv_bias`); one learned
  sink logit per query head (HF `self_attn.sinks`, Megatron's softmax_type 'learnable', `core_attention.
  softmax_offset`); layers whose `layer_types` entry is `sliding_attention` see `sliding_window` keys (the query's
  own and the W - 1 before it: Megatron's `window_size` (W - 1, 0) on the layers its `window_attn_skip_freq` list
  marks). Attention by segment computes both exactly (trainer/attention/windows.py).
- the router: logits = x W^T + b (`mlp.router.bias`; Megatron's router bias with add_bias_linear), the top-k logits,
  then a softmax over those k (Megatron's softmax router with pre_softmax off: the same weights).
- the experts: fc1 = x W_gu^T + b_gu, gate / up INTERLEAVED in HF's `gate_up_proj` [E, H, 2F] (columns 0, 2, .. the
  gate; stored transposed) and [gate; up] halves in Megatron's linear_fc1 (weights/bridge.py's HFCheckpoint serves
  the per-expert halves); the clamped SwiGLU

      glu = min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + 1)

  is Megatron's gated MLP with activation quick_gelu (x * sigmoid(1.702 x): alpha must be 1.702, refused otherwise),
  `activation_func_clamp_value` L (`swiglu_limit`) and `glu_linear_offset` 1; fc2 = glu W_d^T + b_d, its bias
  weighted by the routing weight as HF does (Megatron adds an expert's fc2 bias times the token's probability).
- RMSNorm, untied embeddings; YaRN RoPE (attention/yarn_rope.py), read as transformers' GptOssConfig reads it
  (`gpt_oss_rope`): `rope_parameters`, or the released checkpoints' `rope_scaling` with a top-level `rope_theta`, or
  with neither key GptOssConfig's defaults (YaRN factor 32 over 4096 positions, `truncate: false`, theta 150000).
Refused by name: a `layer_types` entry other than sliding_attention / full_attention, or any pattern but the
even layers windowed, and a `swiglu_limit` other than 7 (vLLM 0.32's gpt-oss reads neither key: it windows the
even layers and clamps at 7; the trainer computes any); a `swiglu_alpha` other than 1.702; RoPE other than YaRN
(vLLM 0.32's gpt-oss builds YaRN whatever `rope_type` says), a YaRN without factor / original_max_position_embeddings
/ beta_fast / beta_slow (vLLM reads all four), YaRN's `attention_factor` / `mscale` / `mscale_all_dim` (vLLM's
gpt-oss reads none of them); `quantization_config` (the released checkpoints' MXFP4 experts: dequantise them first,
`gspo-ray models dequantize-mxfp4`); context parallelism with its windows / sinks (preflight).
"""
from __future__ import annotations

import re

from gspo_ray.trainer.attention.mla import require_yarn_keys, rope_parameters
from gspo_ray.trainer.families.base import LAYER, LLAMA_NAME_RULES, MoEFamily, Router, every_layer_routes_shape

LAYER_TYPES = ("sliding_attention", "full_attention")
PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)")
QUICK_GELU_ALPHA = 1.702  # megatron.core.activations.quick_gelu: x * sigmoid(1.702 x)
# transformers 5.19's GptOssConfig where config.json names neither rope_parameters nor rope_scaling (the released
# checkpoints' YaRN), and its rope_theta where no key names one (`default_theta`)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")  # vLLM 0.32's gpt-oss reads them


def even_layers_windowed(num_layers: int) -> list[str]:
    """transformers' default `layer_types` for gpt-oss, and the only pattern vLLM 0.32's gpt-oss runs."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def gpt_oss_rope(cfg: dict) -> tuple[dict, str]:
    """(the RoPE dict, the config.json key it came from) as transformers' GptOssConfig reads a config.json:
    rope_parameters (transformers 5), else rope_scaling (the released checkpoints' key, rope_theta at the top
    level), else DEFAULT_ROPE; rope_theta from the dict, else the top level, else 150000; rope_type from `type`
    (4.x) else "default"."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling" if cfg.get("rope_scaling") else None
    rope = rope_parameters(cfg if key else {**cfg, "rope_parameters": DEFAULT_ROPE}, DEFAULT_THETA)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope, key or "rope_parameters"

# gpt-oss's additions to the Llama-like names: o_proj's bias, the sinks, the router's bias and the experts' biases
# (per-expert names, served from the fused HF tensors by weights/bridge.HFCheckpoint)
GPT_OSS_NAME_RULES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    (LAYER + r"self_attention\.linear_proj\.bias", ("model.layers.{i}.self_attn.o_proj.bias",), "copy", "none"),
    (LAYER + r"self_attention\.core_attention\.softmax_offset", ("model.layers.{i}.self_attn.sinks",), "copy", "col"),
    (LAYER + r"mlp\.router\.bias", ("model.layers.{i}.mlp.router.bias",), "copy", "none"),
    (LAYER + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.bias",
     ("model.layers.{i}.mlp.experts.{e}.gate_proj.bias", "model.layers.{i}.mlp.experts.{e}.up_proj.bias"),
     "gated", "none"),
    (LAYER + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.bias",
     ("model.layers.{i}.mlp.experts.{e}.down_proj.bias",), "copy", "none"),
)


class GptOss(MoEFamily):
    model_type = "gpt_oss"
    engine_class = "GptOssForCausalLM"
    reads_attention_bias = True
    name_rules = GPT_OSS_NAME_RULES + LLAMA_NAME_RULES
    hf_renames = ((".mlp.gate.weight", ".mlp.router.weight"),)
    # attention only: an expert's gate / up are interleaved columns of one fused HF tensor, where a PEFT adapter
    # of per-expert linears has no name (the preflight refuses gate_proj / up_proj / down_proj by name)
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    fuses_experts_on_export = True  # gate_up_proj / down_proj [E, ...] (hf_tensors_out)
    # TE's grouped-GEMM experts hold their biases as experts.linear_fc{1,2}.bias{j}: no name rule maps them, and
    # compat/megatron_expert_fc2_bias.py hooks SequentialMLP's local_experts only
    te_spec = False
    # attention/windows.py's windows and sinks have no column-split form (attention/context_split.py)
    not_under_context_parallel = "sliding windows / attention sinks (config.json layer_types, sliding_window, sinks)"

    # ---- the HF config keys read --------------------------------------------------------------------------------
    # num_experts / moe_layers: the base's (`num_local_experts`, every layer: gpt-oss has no decoder_sparse_step)
    def moe_ffn_hidden_size(self, cfg: dict) -> int:
        return int(cfg["intermediate_size"])

    def norm_topk_prob(self, cfg: dict) -> bool:
        return True  # a softmax over the k selected logits

    def uses_qkv_bias(self, cfg: dict) -> bool:
        return bool(cfg.get("attention_bias", True))

    def sliding_window(self, cfg: dict) -> bool:
        return False  # read per layer below (layer_types), not refused

    def rope_theta(self, cfg: dict) -> float:
        """The RoPE base of gpt-oss's YaRN (`gpt_oss_rope`; `rotary_override` states the rest)."""
        return float(gpt_oss_rope(cfg)[0]["rope_theta"])

    def rotary_override(self, spec):
        """(inv_freq, attention factor) of YaRN (attention/yarn_rope.py; the only RoPE vLLM's gpt-oss builds,
        others refused): the built model's rotary embedding takes the frequencies and its softmax scale the factor
        squared (model.build_model)."""
        from gspo_ray.trainer.attention.yarn_rope import yarn_parameters

        return yarn_parameters(spec.head_dim, gpt_oss_rope(spec.hf_config)[0])

    def windowed_layers(self, cfg: dict) -> list[int]:
        """1 for each layer whose attention is windowed (`layer_types`; transformers' default: even layers)."""
        types = cfg.get("layer_types") or even_layers_windowed(int(cfg["num_hidden_layers"]))
        return [int(t == "sliding_attention") for t in types]

    # ---- the HF config keys refused -----------------------------------------------------------------------------
    def refuse_unsupported(self, cfg: dict, hf_dir) -> None:
        where = f"{hf_dir}/config.json"
        types = cfg.get("layer_types")
        if types is not None:
            unknown = sorted({t for t in types} - set(LAYER_TYPES))
            if unknown or len(types) != int(cfg["num_hidden_layers"]):
                raise ValueError(f"{where}: layer_types {unknown or types!r} is not supported (one entry per layer, "
                                 f"each of {', '.join(LAYER_TYPES)})")
        # vLLM 0.32's gpt-oss windows the even layers whatever layer_types says, and clamps at 7 whatever
        # swiglu_limit says (SwigluOAIAndMul's defaults): the engine would sample another model
        if types is not None and list(types) != even_layers_windowed(int(cfg["num_hidden_layers"])):
            raise ValueError(f"{where}: layer_types {types!r} is not supported (vLLM's gpt-oss windows exactly the "
                             "even layers: sliding_attention, full_attention, ...)")
        if float(cfg.get("swiglu_limit", 7.0)) != 7.0:
            raise ValueError(f"{where}: swiglu_limit {cfg['swiglu_limit']!r} is not supported (only 7.0: vLLM's "
                             "gpt-oss clamps at 7)")
        window = cfg.get("sliding_window")
        if any(self.windowed_layers(cfg)) and not (isinstance(window, int) and window >= 1):
            raise ValueError(f"{where}: sliding_window {window!r} must be a positive integer where layer_types has "
                             "sliding_attention")
        alpha = float(cfg.get("swiglu_alpha", QUICK_GELU_ALPHA))
        if alpha != QUICK_GELU_ALPHA:
            raise ValueError(f"{where}: swiglu_alpha {alpha!r} is not supported (only {QUICK_GELU_ALPHA}: Megatron's "
                             "quick_gelu)")
        quant = cfg.get("quantization_config")
        if quant:
            raise ValueError(f"{where}: quantization_config {quant.get('quant_method', quant)!r} is not supported "
                             "(MXFP4 experts: dequantise the checkpoint first, gspo-ray models dequantize-mxfp4)")
        if cfg.get("attention_dropout"):
            raise ValueError(f"{where}: attention_dropout {cfg['attention_dropout']!r} is not supported (only 0)")
        rope, source = gpt_oss_rope(cfg)
        if rope["rope_type"] != "yarn":  # vLLM's gpt-oss builds YaRN from factor / beta_* whatever rope_type says
            raise ValueError(f"{where}: {source}.rope_type {rope['rope_type']!r} is not supported with gpt_oss "
                             "(only yarn: vLLM's gpt-oss always runs YaRN)")
        for key in ("attention_factor", "mscale", "mscale_all_dim"):  # vLLM's gpt-oss reads none of them
            if rope.get(key) is not None:
                raise ValueError(f"{where}: {source}.{key} {rope[key]!r} is not supported with gpt_oss "
                                 "(its YaRN attention factor is 0.1 ln(factor) + 1)")
        require_yarn_keys(rope, YARN_KEYS, where, source)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{where}: {source}.partial_rotary_factor {rope['partial_rotary_factor']!r} is not "
                             "supported with gpt_oss (vLLM's gpt-oss rotates whole heads)")
        # the base refusals less the per-layer attention keys and the YaRN read above
        super().refuse_unsupported({k: v for k, v in cfg.items()
                                    if k not in ("layer_types", "attention_bias", "rope_parameters", "rope_scaling")},
                                   hf_dir)

    # ---- Megatron ---------------------------------------------------------------------------------------------
    def router(self, spec) -> Router:
        return Router(normalize_topk=True)  # top-k logits, then a softmax over them

    def transformer_options(self, spec) -> dict:
        from megatron.core.activations import quick_gelu

        cfg = spec.hf_config
        options = super().transformer_options(spec) | dict(
            add_bias_linear=True, add_qkv_bias=spec.qkv_bias, activation_func=quick_gelu,
            activation_func_clamp_value=float(cfg.get("swiglu_limit", 7.0)), glu_linear_offset=1.0,
            softmax_type="learnable")
        windowed = self.windowed_layers(cfg)
        if any(windowed):
            options |= dict(window_size=(int(cfg["sliding_window"]) - 1, 0), window_attn_skip_freq=windowed)
        return options

    # ---- HF names -----------------------------------------------------------------------------------------------
    def hf_tensors_out(self, tensors, spec):
        """Per-expert tensors -> gpt-oss's fused ones, emitted once a layer's E experts are all in (an export
        yields them grouped by layer; one layer's experts are held at a time):

            gate_up_proj [E, H, 2F]: [:, :, 0::2] = gate_e^T, [:, :, 1::2] = up_e^T   (interleaved, transposed)
            gate_up_proj_bias [E, 2F] interleaved alike; down_proj [E, F, H] = down_e^T; down_proj_bias [E, H]
        Everything else passes as it comes."""
        import torch

        held: dict[str, dict] = {}
        for name, tensor in tensors:
            m = PER_EXPERT.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            prefix, expert, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            pieces = held.setdefault(f"{prefix}|{kind}|{proj == 'down_proj'}", {})
            pieces[(expert, proj)] = tensor
            per_expert = 1 if proj == "down_proj" else 2
            if len(pieces) < spec.num_experts * per_expert:
                continue
            del held[f"{prefix}|{kind}|{proj == 'down_proj'}"]
            suffix = "_bias" if kind == "bias" else ""
            experts = range(spec.num_experts)
            if proj == "down_proj":
                fused = torch.stack([pieces[(e, "down_proj")] if kind == "bias" else pieces[(e, "down_proj")].T
                                     for e in experts])
                yield f"{prefix}.down_proj{suffix}", fused.contiguous()
                continue
            gate = torch.stack([pieces[(e, "gate_proj")] for e in experts])   # [E, F] or [E, F, H]
            up = torch.stack([pieces[(e, "up_proj")] for e in experts])
            if kind == "weight":
                gate, up = gate.transpose(1, 2), up.transpose(1, 2)              # [E, H, F]
            yield f"{prefix}.gate_up_proj{suffix}", torch.stack((gate, up), dim=-1).flatten(-2).contiguous()
        if held:
            raise ValueError(f"gpt_oss export: experts missing from {sorted(held)[:3]}")

    # ---- the engine -----------------------------------------------------------------------------------------------
    def engine_routes_shape(self, config) -> tuple[int, int, int]:
        return every_layer_routes_shape(config)  # vLLM's gpt-oss routes in every layer


FAMILY = GptOss()
