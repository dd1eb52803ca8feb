"""Qwen3-Next (`model_type: qwen3_next`): a hybrid of Gated DeltaNet layers (linear attention, trainer/gated_delta/)
and gated softmax attention (trainer/attention/gated_attention.py), every MLP an MoE with a gated shared expert.

Read (transformers 5.19 `Qwen3NextForCausalLM`): the layer pattern (`layer_types`, or `full_attention_interval`,
checked by families/hybrid.py), the Gated DeltaNet sizes (`linear_*`), `partial_rotary_factor` (0.25 when absent),
QK-norm always, every norm zero-centred (x * (1 + weight)), the router as Qwen3-MoE's (softmax, top-k,
`norm_topk_prob`), `shared_expert_intermediate_size` with a sigmoid gate on the shared expert's output
(`mlp.shared_expert_gate`, Megatron's `moe_shared_expert_gate`). Refused: trainer.tp / trainer.cp > 1 with Gated
DeltaNet layers (gated_delta/megatron_layer.py); the preflight refuses the family as a whole until its engine
parity is shown (families/hybrid.py).
"""
from __future__ import annotations

from gspo_ray.trainer.families.base import LAYER, LLAMA_NAME_RULES, partial_rotary
from gspo_ray.trainer.families.hybrid import check_hybrid, hybrid_layer_types
from gspo_ray.trainer.families.qwen3_moe import Qwen3MoE

DELTA_TENSORS = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
                 "out_proj.weight")
QWEN3_NEXT_NAME_RULES = tuple(
    (rule[0], rule[1], "qkv_gate", rule[3]) if rule[2] == "qkv" else rule for rule in LLAMA_NAME_RULES
) + tuple(
    (LAYER + r"self_attention\.layer\." + t.replace(".", r"\."), (f"model.layers.{{i}}.linear_attn.{t}",), "copy",
     "none") for t in DELTA_TENSORS
) + (
    (LAYER + r"mlp\.shared_experts\.linear_fc1\.weight", ("model.layers.{i}.mlp.shared_expert.gate_proj.weight",
                                                         "model.layers.{i}.mlp.shared_expert.up_proj.weight"),
     "gated", "col"),
    (LAYER + r"mlp\.shared_experts\.linear_fc2\.weight", ("model.layers.{i}.mlp.shared_expert.down_proj.weight",),
     "copy", "row"),
    (LAYER + r"mlp\.shared_experts\.gate_weight", ("model.layers.{i}.mlp.shared_expert_gate.weight",), "copy",
     "none"),
)


class Qwen3Next(Qwen3MoE):
    """Qwen3-MoE's router, QK-norm and MoE layers (`engine_routes_shape` as vLLM's Qwen3-Next reads them too), with
    the hybrid layers and the gated shared expert."""

    model_type = "qwen3_next"
    engine_class = "Qwen3NextForCausalLM"
    reads_partial_rotary = True
    zero_centered_norms = True
    name_rules = QWEN3_NEXT_NAME_RULES
    lora_targets = ()  # q_proj holds [q | gate] per head: no adapter layout for it yet
    te_spec = False  # hybrid_spec.py builds the local spec only

    def layer_types(self, cfg: dict) -> tuple[str, ...]:
        return hybrid_layer_types(cfg, "config.json")

    def rotary_percent(self, cfg: dict) -> float:
        return float(partial_rotary(cfg, 0.25))

    def shared_expert_ffn_hidden_size(self, cfg: dict) -> int:
        return int(cfg.get("shared_expert_intermediate_size") or 0)

    def refuse_unsupported(self, cfg: dict, hf_dir) -> None:
        # the base refuses layer_types and shared experts, which this family reads; the layer pattern, the Gated
        # DeltaNet sizes and partial_rotary_factor are checked as the preflight checks them (hybrid.check_hybrid)
        super().refuse_unsupported({k: v for k, v in cfg.items()
                                    if k not in ("layer_types", "shared_expert_intermediate_size")}, hf_dir)
        check_hybrid(cfg, f"{hf_dir}/config.json")

    def transformer_options(self, spec) -> dict:
        options = super().transformer_options(spec) | {"attention_output_gate": True}
        if spec.is_moe and spec.shared_expert_ffn_hidden_size:
            options["moe_shared_expert_gate"] = True
        return options


FAMILY = Qwen3Next()
