"""What an architecture family states, with the defaults of the Llama-like decoder every family here starts from:
RMSNorm, a gated SiLU MLP, no linear biases, default RoPE, full causal softmax attention; an MoE family adds a
router (softmax over the experts, plain top-k).

    family = family_of(cfg["model_type"])                     # families/__init__.py: the registry
    family.refuse_unsupported(cfg, hf_dir)                    # ValueError naming the config.json key
    family.num_experts(cfg), family.moe_layers(cfg, layers), family.rope_theta(cfg), family.norm_topk_prob(cfg)
    family.uses_qkv_bias(cfg), family.uses_qk_norm(cfg), family.rotary_percent(cfg)   # attention read from config
    family.shared_expert_ffn_hidden_size(cfg), family.ignored_hf_tensor(cfg, name)   # (GLM-4.5: deepseek_moe.py)
    family.transformer_options(spec)                          # Megatron TransformerConfig keywords (+ its router's)
    family.name_rules, family.hf_name(qwen_style_name)      # Megatron <-> HF names (weights/bridge.param_map)

No torch, no Megatron at import (the preflight reads the registry before anything heavy is imported): what needs
torch imports it inside the method that uses it. A family is a class whose instance the registry holds; a new
family subclasses `Family` (or `MoEFamily`) in its own module and overrides only the facts that differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # model_spec imports this package, never the other way at import time
    from gspo_ray.trainer.model_spec import ModelSpec

# The HF linears a LoRA adapter can target in the Llama-like families, as PEFT and vLLM name them (config.lora's
# DEFAULT_LORA_TARGETS lists the same names, its LORA_TARGETS adds multi-latent attention's; the trainer's LoRA maps
# them to the Megatron linears that hold them).
DENSE_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# Megatron parameter name -> (HF names, how they merge, how TP shards the merged tensor), for the Llama-like layers
# (weights/bridge.py says what merge and shard mean). {i}: layer, {e}: expert. The HF names are Qwen's; a family
# whose checkpoints name a tensor otherwise renames it (Family.hf_renames). Both layer specs' names are here: the
# local spec's and Transformer Engine's (weights/param_names.py lists which names each spec builds).
LAYER = r"decoder\.layers\.(\d+)\."
LLAMA_NAME_RULES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    (r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), "copy", "vocab"),
    (r"output_layer\.weight", ("lm_head.weight",), "copy", "vocab"),
    (r"decoder\.final_layernorm\.weight", ("model.norm.weight",), "copy", "none"),
    # TE specs fuse the input norm into linear_qkv (and the dense pre-MLP norm into linear_fc1)
    (LAYER + r"(?:input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)",
     ("model.layers.{i}.input_layernorm.weight",), "copy", "none"),
    (LAYER + r"self_attention\.linear_qkv\.weight", tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight"
                                                         for p in "qkv"), "qkv", "col"),
    (LAYER + r"self_attention\.linear_qkv\.bias", tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias"
                                                       for p in "qkv"), "qkv", "col"),
    (LAYER + r"self_attention\.q_layernorm\.weight", ("model.layers.{i}.self_attn.q_norm.weight",), "copy", "none"),
    (LAYER + r"self_attention\.k_layernorm\.weight", ("model.layers.{i}.self_attn.k_norm.weight",), "copy", "none"),
    (LAYER + r"self_attention\.linear_proj\.weight", ("model.layers.{i}.self_attn.o_proj.weight",), "copy", "row"),
    (LAYER + r"(?:pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)",
     ("model.layers.{i}.post_attention_layernorm.weight",), "copy", "none"),
    (LAYER + r"mlp\.linear_fc1\.weight", ("model.layers.{i}.mlp.gate_proj.weight",
                                          "model.layers.{i}.mlp.up_proj.weight"), "gated", "col"),
    (LAYER + r"mlp\.linear_fc2\.weight", ("model.layers.{i}.mlp.down_proj.weight",), "copy", "row"),
    (LAYER + r"mlp\.router\.weight", ("model.layers.{i}.mlp.gate.weight",), "copy", "none"),
    (LAYER + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight",
     ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
     "gated", "none"),
    (LAYER + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight",
     ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "copy", "none"),
    # grouped GEMM (TEGroupedMLP): one TE GroupedLinear per projection holding local expert j as `weight{j}`, the
    # same [out, in] tensor SequentialMLP's expert j holds (fc1 = [gate_j; up_j] [2F, H], fc2 = down_j [H, F])
    (LAYER + r"mlp\.experts\.linear_fc1\.weight(\d+)",
     ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
     "gated", "none"),
    (LAYER + r"mlp\.experts\.linear_fc2\.weight(\d+)",
     ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "copy", "none"),
)


# DeepSeekMoE's additions (families/deepseek_moe.py): the shared experts (Megatron's SharedExpertMLP, a TP-sharded
# dense MLP beside the routed experts; the same names under both specs, its pre-MLP norm being the MoE layer's own)
# and the router's expert bias (a buffer, not a parameter: weights/bridge.named_weights carries it with the
# parameters through loads, pushes and exports; checkpoints hold it in the model state dict).
SHARED_EXPERT_NAME_RULES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    (LAYER + r"mlp\.shared_experts\.linear_fc1\.weight", ("model.layers.{i}.mlp.shared_experts.gate_proj.weight",
                                                         "model.layers.{i}.mlp.shared_experts.up_proj.weight"),
     "gated", "col"),
    (LAYER + r"mlp\.shared_experts\.linear_fc2\.weight", ("model.layers.{i}.mlp.shared_experts.down_proj.weight",),
     "copy", "row"),
    (LAYER + r"mlp\.router\.expert_bias", ("model.layers.{i}.mlp.gate.e_score_correction_bias",), "copy", "none"),
)


def partial_rotary(cfg: dict, default: float):
    """config.json's `partial_rotary_factor` (the share of each head RoPE rotates): in rope_parameters /
    rope_scaling (transformers 5), else at the top level, else the family's `default`; as written (unchecked)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))


def check_rotated_share(factor, head_dim: int, where: str) -> float:
    """A partial_rotary_factor must rotate int(head_dim * factor) = a positive even number of dimensions (RoPE
    rotates pairs), factor in (0, 1]; ValueError naming the key otherwise. Returns the factor."""
    numeric = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    rotated = int(head_dim * factor) if numeric else 0
    if not numeric or not 0 < factor <= 1 or rotated < 2 or rotated % 2:
        raise ValueError(f"{where}: partial_rotary_factor {factor!r} rotates {rotated} of head_dim {head_dim} "
                         "dimensions (must be a positive even number, factor in (0, 1])")
    return float(factor)


@dataclass(frozen=True)
class Router:
    """How an MoE family routes a token: what Routing Replay records and replays, and the routing metrics compare.

    score_function: what turns the router logits into scores ("softmax" over all experts; "sigmoid" per expert).
    selection: how the top-k experts are chosen ("topk": the k largest scores; with softmax scores the same as the
      k largest logits).
    normalize_topk: the selected experts' weights are renormalised to sum to 1 (softmax: a softmax over the k
      selected logits); otherwise each weight is that expert's score.
    expert_bias: the selection ranks `score + bias[e]`, a per-expert load-balancing correction (HF
      `e_score_correction_bias`, Megatron's `router.expert_bias` buffer) that the weights never see: they are the
      unbiased scores of the selected experts (DeepSeek-V3's and GLM-4.5's `noaux_tc`).
    bias_update_rate: Megatron's update of that bias after each step (`bias += rate * sign(mean load - load)`);
      0 keeps it frozen, as trained (docs/moe.md).
    scaling_factor: the weights are multiplied by it after normalisation (HF `routed_scaling_factor`).
    num_groups / group_topk: group-limited selection (HF `n_group` / `topk_group`): the experts fall into
      num_groups equal groups, a token's top-k come from its group_topk best groups; a group is ranked by the sum
      of its two best (biased) scores, as transformers and vLLM do (families refuse a top-k that Megatron, which
      ranks a group by its best top_k / group_topk, would rank otherwise). 1 / 1: no groups."""

    score_function: str = "softmax"
    selection: str = "topk"
    normalize_topk: bool = False
    expert_bias: bool = False
    bias_update_rate: float = 0.0
    scaling_factor: float = 1.0
    num_groups: int = 1
    group_topk: int = 1

    def megatron_options(self) -> dict[str, Any]:
        """Megatron TransformerConfig keywords of this router."""
        if self.score_function == "softmax":
            # pre_softmax=False: softmax over the k selected logits == renormalised top-k probs
            return dict(moe_router_score_function=self.score_function, moe_router_pre_softmax=not self.normalize_topk)
        # Megatron's sigmoid router always renormalises k > 1 weights (moe_utils.topk_routing_with_score_function):
        # the family refuses norm_topk_prob values it cannot express
        options = dict(moe_router_score_function=self.score_function, moe_router_dtype="fp32",
                       moe_router_enable_expert_bias=self.expert_bias)
        if self.expert_bias:  # Megatron's default rate is 1e-3: the bias moves unless told otherwise
            options["moe_router_bias_update_rate"] = self.bias_update_rate
        if self.scaling_factor != 1.0:
            options["moe_router_topk_scaling_factor"] = self.scaling_factor
        if self.num_groups > 1:
            options |= dict(moe_router_num_groups=self.num_groups, moe_router_group_topk=self.group_topk)
        return options


class Family:
    """A dense Llama-like decoder family. Subclasses set the class attributes that differ and override methods for
    config keys read another way."""

    model_type: str = ""                       # HF config.json `model_type`
    aliases: tuple[str, ...] = ()              # other model_types whose checkpoints are this family
    engine_class: str = ""                     # the class vLLM loads (config.json `architectures[0]`)
    qkv_bias: bool = False                     # q/k/v projections have biases that no config key announces
    qk_norm: bool = False                      # RMSNorm on each head's queries and keys (Megatron's qk_layernorm)
    reads_attention_bias: bool = False         # config.json `attention_bias` turns the q/k/v biases on (GLM)
    reads_partial_rotary: bool = False         # config.json `partial_rotary_factor` rotates that share of each head
    normalization: str = "RMSNorm"
    zero_centered_norms: bool = False          # norms compute x * (1 + weight) (Qwen3-Next: ZeroCenteredRMSNorm)
    moe: bool = False                          # has routed experts (MoE layers where moe_layers says)
    router_has_expert_bias: bool = False       # its router selects on score + a per-expert bias (a buffer)
    multi_latent_attention: bool = False       # reads kv_lora_rank / q_lora_rank (attention/mla.py), others refuse
    lora_targets: tuple[str, ...] = DENSE_LORA_TARGETS
    # its checkpoint fuses experts that the trainer holds apart (hf_tensors_out): only the trainer's HF export makes
    # them, so vLLM's nccl / ipc senders, which send the planned per-expert tensors, are refused (the preflight)
    fuses_experts_on_export: bool = False
    # Transformer Engine's layer spec is built and mapped for it (trainer.use_te; auto falls back to the local spec
    # where not, an explicit true is refused by the preflight)
    te_spec: bool = True
    # what of its attention has no context-parallel form (trainer.cp > 1 refused by the preflight, naming it)
    not_under_context_parallel: str = ""
    name_rules: tuple[tuple[str, tuple[str, ...], str, str], ...] = LLAMA_NAME_RULES   # Megatron <-> HF names
    # HF tensor names that differ from the Qwen-style names of weights.bridge's rules, applied in order to expert
    # and router names (dense names, attention, norms and embeddings, are the same in every family here)
    hf_renames: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        return f"<family {self.model_type}>"

    def builds_te_layers(self, use_te: bool) -> bool:
        """Whether a model of this family is built with Transformer Engine's layers when trainer.use_te resolved to
        `use_te` (auto on CUDA resolves to true; families without a mapped TE spec build the local one)."""
        return use_te and self.te_spec

    # ---- the HF config keys read --------------------------------------------------------------------------------
    def num_experts(self, cfg: dict) -> int:
        """Routed experts per MoE layer (0: dense)."""
        return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)

    def moe_layers(self, cfg: dict, num_layers: int) -> tuple[int, ...]:
        """Indices of the layers whose MLP is MoE (Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`)."""
        if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
            return ()
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)

    def moe_ffn_hidden_size(self, cfg: dict) -> int:
        """One expert's MLP width (Mixtral's experts have the dense width; Qwen3-MoE names its own)."""
        return int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])

    def norm_topk_prob(self, cfg: dict) -> bool:
        """Whether the selected experts' probabilities are renormalised (config.json `norm_topk_prob`)."""
        return bool(cfg.get("norm_topk_prob", False))

    def uses_qkv_bias(self, cfg: dict) -> bool:
        """Whether the q/k/v projections have biases (Qwen2: always; a family that reads `attention_bias`: as set)."""
        return self.qkv_bias or (self.reads_attention_bias and bool(cfg.get("attention_bias")))

    def uses_qk_norm(self, cfg: dict) -> bool:
        """Whether queries and keys are RMS-normed per head."""
        return self.qk_norm

    def shared_expert_ffn_hidden_size(self, cfg: dict) -> int:
        """The MLP width of an MoE layer's shared experts, all of them as one MLP (0: none)."""
        return 0

    def rotary_percent(self, cfg: dict) -> float:
        """The share of each head's dimensions RoPE rotates (its first ones, rotate-half pairing; Megatron's
        `rotary_percent`)."""
        return 1.0

    def layer_types(self, cfg: dict) -> tuple[str, ...] | None:
        """Per layer "full_attention" or "linear_attention" (Gated DeltaNet) for a hybrid family; None: every
        layer softmax attention."""
        return None

    def ignored_hf_tensor(self, cfg: dict, name: str) -> bool:
        """A checkpoint tensor the trainer's model has no place for by design (not a feature it lacks)."""
        return False

    def rope_theta(self, cfg: dict) -> float:
        """RoPE base; only default RoPE (transformers 5 keeps it in rope_parameters, 4.x at the top level)."""
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"config.json rope type {kind!r} is not supported (only default RoPE)")
        return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))

    def rotary_override(self, spec: ModelSpec):
        """(inv_freq, attention factor) replacing the default RoPE of the built model (model.apply_rotary_override);
        None: Megatron's own from rope_theta."""
        return None

    def sliding_window(self, cfg: dict) -> bool:
        """Whether the config turns sliding-window attention on (Qwen's configs carry `sliding_window` unused)."""
        return bool(cfg.get("use_sliding_window"))

    # ---- the HF config keys refused -----------------------------------------------------------------------------
    def refuse_unsupported(self, cfg: dict, hf_dir) -> None:
        """Features the Megatron config below cannot express would give silently wrong numbers: refuse them."""
        where = f"{hf_dir}/config.json"
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} not supported (only silu)")
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError(f"{where}: shared experts are not supported")
        if self.sliding_window(cfg):
            raise ValueError(f"{where}: sliding-window attention is not supported")
        if (cfg.get("attention_bias") and not self.reads_attention_bias) or cfg.get("mlp_bias"):
            # (qwen2's q/k/v biases are implied, not configured)
            raise ValueError(f"{where}: attention_bias/mlp_bias are not supported")
        partial = partial_rotary(cfg, 1.0)
        if partial not in (1, 1.0, None) and not self.reads_partial_rotary:
            raise ValueError(f"{where}: partial_rotary_factor {partial!r} is not supported by {self.model_type} "
                             "(only 1.0: RoPE over the whole head)")
        # attention by segment (trainer/attention/segment_attention.py) computes plain softmax attention over whole
        # segments
        for key, what in (("layer_types", "per-layer attention types (sliding / full)"),
                          ("sliding_window_pattern", "sliding-window attention"),
                          ("attention_sink_size", "attention sinks"), ("use_sink", "attention sinks"),
                          ("kv_lora_rank", "multi-latent attention"), ("q_lora_rank", "multi-latent attention")):
            value = cfg.get(key)
            if key.endswith("lora_rank") and self.multi_latent_attention:
                continue  # attention/mla.py reads and checks them (model_spec: mla_options)
            if value and not (key == "layer_types" and set(value) <= {"full_attention"}):
                raise ValueError(f"{where}: {key} ({what}) is not supported: the trainer's attention covers full "
                                 "causal softmax attention only")

    # ---- Megatron ---------------------------------------------------------------------------------------------
    def router(self, spec: ModelSpec) -> Router | None:
        """The family's router for this model (None: dense)."""
        return None

    def transformer_options(self, spec: ModelSpec) -> dict[str, Any]:
        """The Megatron TransformerConfig keywords that state this family's maths (the parallel layout, dtypes and
        kernel fusions are model.build_transformer_config's), its router's included for an MoE model."""
        import torch.nn.functional as F

        options = dict(normalization=self.normalization, layernorm_epsilon=spec.extra["rms_norm_eps"],
                       gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                       add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm)
        if spec.is_moe and spec.shared_expert_ffn_hidden_size:  # no sigmoid gate on the shared experts' output
            options |= dict(moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
                            moe_shared_expert_gate=False)
        router = self.router(spec) if spec.is_moe else None
        return options | (router.megatron_options() if router is not None else {})

    # ---- HF names -----------------------------------------------------------------------------------------------
    def hf_name(self, name: str) -> str:
        """A Qwen-style HF tensor name (weights.bridge's rules) -> this family's name for the same tensor."""
        if not self.hf_renames or (".experts." not in name and ".mlp.gate.weight" not in name):
            return name
        for old, new in self.hf_renames:
            name = name.replace(old, new)
        return name

    def hf_tensors_out(self, tensors, spec: ModelSpec):
        """The (HF name, tensor) pairs an export or a push yields, per-expert names as weights.bridge's rules give
        them -> this family's checkpoint layout (unchanged here; gpt-oss fuses its experts)."""
        return tensors

    # ---- the engine -----------------------------------------------------------------------------------------------
    def engine_routes_shape(self, config) -> tuple[int, int, int] | None:
        """(MoE layers, top-k, experts) of the routes a vLLM engine returns, from transformers' config object of
        this model as vLLM's model code reads it; None for a dense family."""
        return None


def every_layer_routes_shape(config) -> tuple[int, int, int]:
    """(MoE layers, top-k, experts) of an engine model that routes in every layer (vLLM's Mixtral and gpt-oss),
    from transformers' config object."""
    return config.num_hidden_layers, config.num_experts_per_tok, config.num_local_experts


class MoEFamily(Family):
    """A family with routed experts: softmax router, plain top-k, renormalised when `norm_topk_prob`."""

    moe = True

    def router(self, spec: ModelSpec) -> Router:
        return Router(normalize_topk=spec.extra["norm_topk_prob"])
