"""The base parameter names of the GPTModel that build_model makes, per layer spec, and their HF tensors both ways.
Pure (names and ModelSpec only: no Megatron import, no process group), so the Transformer Engine names are
checked here on a machine where Transformer Engine cannot be built.

    names = megatron_param_names(spec, LayerKinds(te=True, grouped_gemm=True))   # one EP rank's names
    hf = hf_names_by_param(spec, kinds)        # {(EP rank, Megatron name): HF names, in merge order}
    back = params_by_hf_name(spec, kinds)      # {HF name: (EP rank, Megatron name, index in the merge)}

What each spec names (megatron-core 0.16.1, models/gpt/gpt_layer_specs.py and extensions/transformer_engine.py):
- local spec: `input_layernorm.weight`, `self_attention.linear_qkv.weight` (`.bias` for qwen2),
  `self_attention.{q,k}_layernorm.weight` (QK-norm), `self_attention.linear_proj.weight` (multi-latent attention
  instead: attention/mla.py's `mla_param_names`), `pre_mlp_layernorm.weight`,
  then `mlp.linear_fc1.weight` / `mlp.linear_fc2.weight` (dense) or `mlp.router.weight` and the experts.
- Transformer Engine spec: the input norm is fused into the QKV linear (TELayerNormColumnParallelLinear:
  `self_attention.linear_qkv.layer_norm_weight`, no `input_layernorm`); a dense MLP's pre-MLP norm is fused into
  fc1 likewise (`mlp.linear_fc1.layer_norm_weight`, no `pre_mlp_layernorm`); an MoE layer keeps a separate
  `pre_mlp_layernorm.weight` (TENorm: the router and the experts both read the normed input). QK-norms are TENorm
  (`weight`). RMSNorm has no bias, and TE registers no bias parameter for a linear built without one.
- Shared experts (DeepSeekMoE: GLM-4.5, DeepSeek-V3): `mlp.shared_experts.linear_fc{1,2}.weight` after the
  experts, either spec (SharedExpertMLP; no gate weight: moe_shared_expert_gate is off). A biased router's
  `mlp.router.expert_bias` is a buffer (`carried_buffer_names`), HF `mlp.gate.e_score_correction_bias`.
- Experts without grouped GEMM (SequentialMLP, either spec): `mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`.
  With grouped GEMM (TEGroupedMLP: one TE GroupedLinear per projection): `mlp.experts.linear_fc1.weight{j}`
  ([gate_j; up_j], [2F, H]) and `mlp.experts.linear_fc2.weight{j}` (down_j, [H, F]), j the local expert. The
  legacy GroupedMLP (`experts.weight1` / `weight2`, one [H, E * 2F] tensor) is never built here (model.py asks for
  TEGroupedMLP only) and has no mapping: bridge.param_map refuses its names.
Local expert j of EP rank r is global expert r * num_local_experts + j (bridge.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from gspo_ray.trainer.attention.mla import mla_param_names
from gspo_ray.trainer.weights.bridge import param_map
from gspo_ray.trainer.model_spec import ModelSpec


@dataclass(frozen=True)
class LayerKinds:
    """Which layers build_model built: Transformer Engine's spec or the local one; experts by grouped GEMM or not."""

    te: bool = False
    grouped_gemm: bool = False

    def __post_init__(self):
        if self.grouped_gemm and not self.te:
            raise ValueError("grouped GEMM experts exist only with the Transformer Engine spec (TEGroupedMLP)")

    @property
    def label(self) -> str:
        return ("transformer_engine" if self.te else "local") + (", grouped GEMM" if self.grouped_gemm else "")


def _layer_names(spec: ModelSpec, kinds: LayerKinds, i: int) -> list[str]:
    p = f"decoder.layers.{i}."
    qkv = p + "self_attention.linear_qkv."
    # Attention registers linear_proj before SelfAttention adds linear_qkv and the QK-norms; TE's LayerNormLinear
    # registers its norm weight before its linear weight
    names = [] if kinds.te else [p + "input_layernorm.weight"]
    names += [p + "self_attention.linear_proj.weight"] + ([qkv + "layer_norm_weight"] if kinds.te else [])
    names.append(qkv + "weight")
    if spec.qkv_bias:
        names.append(qkv + "bias")
    if spec.qk_norm:
        names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
    if spec.extra.get("mla"):  # multi-latent attention instead (local spec only: model.py refuses TE with MLA)
        names = [p + "input_layernorm.weight"] + [p + "self_attention." + n for n in mla_param_names(spec.extra["mla"])]
    if i not in spec.moe_layers:
        fc1 = p + "mlp.linear_fc1."
        return names + ([fc1 + "layer_norm_weight"] if kinds.te else [p + "pre_mlp_layernorm.weight"]) + [
            fc1 + "weight", p + "mlp.linear_fc2.weight"]
    names += [p + "pre_mlp_layernorm.weight", p + "mlp.router.weight"]
    experts = range(spec.num_local_experts)
    if kinds.grouped_gemm:
        names += [f"{p}mlp.experts.linear_fc{k}.weight{j}" for k in (1, 2) for j in experts]
    else:
        names += [f"{p}mlp.experts.local_experts.{j}.linear_fc{k}.weight" for j in experts for k in (1, 2)]
    if spec.shared_expert_ffn_hidden_size:  # MoELayer builds them after the experts
        names += [f"{p}mlp.shared_experts.linear_fc{k}.weight" for k in (1, 2)]
    return names


def carried_buffer_names(spec: ModelSpec) -> list[str]:
    """The buffers that are HF checkpoint tensors (bridge.CARRIED_BUFFERS): a biased router's expert bias per MoE
    layer, in module order (the same on every TP / EP rank: it is replicated)."""
    return [f"decoder.layers.{i}.mlp.router.expert_bias" for i in spec.moe_layers] if spec.expert_bias else []


def megatron_param_names(spec: ModelSpec, kinds: LayerKinds) -> list[str]:
    """The base (non-LoRA) parameter names of one rank's GPTModel (every TP rank has the same names; EP ranks too,
    each naming its own local experts), in module order (the local spec's checked against the built model; the
    Transformer Engine spec's as read from megatron-core's and TE's sources)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        names += _layer_names(spec, kinds, i)
    names.append("decoder.final_layernorm.weight")
    if not spec.tied_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names_by_param(spec: ModelSpec, kinds: LayerKinds) -> dict[tuple[int, str], tuple[str, ...]]:
    """{(EP rank, Megatron name): its HF tensors in merge order} over every EP rank, the carried buffers (the
    expert bias) included. A dense parameter is the
    same tensor on every EP rank and is listed once, under rank 0; an expert parameter once per EP rank."""
    out = {}
    for name in megatron_param_names(spec, kinds) + carried_buffer_names(spec):
        pm = param_map(name, spec.arch)
        if pm.local_expert is None:
            out[(0, name)] = pm.hf_names
        else:
            for r in range(spec.ep):
                out[(r, name)] = pm.for_expert(r * spec.num_local_experts + pm.local_expert)
    return out


def param_key(name: str, arch: str | None = None) -> tuple[tuple[str, ...], int | None]:
    """What a parameter is, whichever layers named it: (its HF tensors, its local expert index). Two names with one
    key hold the same tensor, same shape and values (the module doc: TE's fused norm weight is the norm's weight,
    grouped expert j's `weight{j}` is SequentialMLP's expert j), so a checkpoint of one spec resumes under the other
    by this key (trainer/checkpoints/shards.py). KeyError for a name bridge.param_map does not know."""
    pm = param_map(name, arch)
    return pm.hf_names, pm.local_expert


def params_by_hf_name(spec: ModelSpec, kinds: LayerKinds) -> dict[str, tuple[int, str, int]]:
    """{HF name: (EP rank, Megatron name, index among that parameter's HF tensors)}: the load direction (which
    parameter of which rank reads a HF tensor). ValueError when two parameters claim one HF tensor."""
    out: dict[str, tuple[int, str, int]] = {}
    for (rank, name), hf in hf_names_by_param(spec, kinds).items():
        for k, hf_name in enumerate(hf):
            if hf_name in out:
                raise ValueError(f"{hf_name} is read by both {out[hf_name][1]} and {name}")
            out[hf_name] = (rank, name, k)
    return out
