"""Build a Megatron-core GPTModel from a HF checkpoint directory (qwen2, qwen3, qwen3_moe, llama, mixtral).

    init_distributed(rank, world, addr, port, tp=..., ep=...)       # gspo_ray.trainer.parallel, first
    model, spec = build_model(hf_dir, dtype=torch.float32, sequence_parallel=None, moe_dispatcher="alltoall",
                              load_weights=True) -> tuple[GPTModel, ModelSpec]

TP/EP sizes come from Megatron's parallel state. Layers use the local (pure torch) spec, the one verified against
transformers here, with our SegmentAttention as core attention (segment_attention.py: the forward's
`attention_mask` is a Segments record, never a dense mask); `use_te=True` (trainer.use_te, resolve_use_te) picks
the Transformer Engine spec on CUDA machines, with the same attention, and for an MoE its experts by grouped GEMM
(TEGroupedMLP) where Transformer Engine has its grouped linear. Their parameter names are listed by
param_names.py and mapped by bridge.py (checked as names and tensors on CPU); the TE layers themselves have not run
here (no GPU, Transformer Engine not installable). Layers without experts in an MoE config (Qwen3-MoE's
mlp_only_layers) get a dense MLP. The maths of each architecture (norms, activation, biases, QK-norm, the MoE
router: for the five families here softmax over experts, top-k, top-k probs renormalised when `norm_topk_prob`) is
its family's (trainer/families/: `Family.transformer_options`); no aux loss. `ModelSpec` is a small picklable
record of the architecture.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from gspo_ray.compat.megatron_expert_fc2_bias import clone_expert_fc2_outputs
from gspo_ray.compat.megatron_mla_tp_grad import replicate_kv_down_projection
from megatron.core.transformer.module import MegatronModule  # noqa: E402  (after the guarded import)

from gspo_ray.trainer.families import family_of
from gspo_ray.trainer.weights.bridge import load_hf_weights
from gspo_ray.trainer.model_spec import ModelSpec, read_hf_config, spec_from_hf_config, te_missing
from gspo_ray.trainer.weights.param_names import LayerKinds
from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows, unsupported
from gspo_ray.trainer.attention.te_attention import thd_attend_rows
from gspo_ray.trainer.attention.context_split import attend_columns
from gspo_ray.trainer.context_parallel import cp_size, cp_split, gather_columns, layer_cp_size
from gspo_ray.trainer.recompute import checkpoint_layers, recomputed
from gspo_ray.trainer.hybrid_spec import final_norm, hybrid_layer
from gspo_ray.trainer.memory import stage_layer_range


RECOMPUTE_MODES = ("none", "selective", "full")
SELECTIVE_MODULES = ("core_attn", "layernorm", "mlp")  # trainer.recompute_modules' default
# modules Megatron recomputes only with Transformer Engine layers (its CheckpointWithoutOutput reads TE's FP8 state;
# moe_act needs grouped GEMM experts): dropped from the list on the local spec
TE_ONLY_MODULES = ("layernorm", "moe_act")


def selective_modules(modules=None, te: bool = False, grouped_gemm: bool = False) -> list[str]:
    """trainer.recompute_modules (None: SELECTIVE_MODULES) less what cannot run on these layers (TE_ONLY_MODULES
    without TE, moe_act without grouped GEMM)."""
    return [m for m in (modules if modules is not None else SELECTIVE_MODULES)
            if m not in TE_ONLY_MODULES or (te and (m != "moe_act" or grouped_gemm))]


def recompute_options(recompute: str = "none", modules=None, te: bool = False, grouped_gemm: bool = False) -> dict:
    """trainer.recompute -> Megatron TransformerConfig keywords: selective -> Megatron's selective granularity over
    selective_modules() less core_attn, which SegmentAttention recomputes itself (trainer/recompute.py says why);
    full (checkpoint_layers, trainer/recompute.py) and none -> {}."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"trainer.recompute {recompute!r}; valid: {', '.join(RECOMPUTE_MODES)}")
    megatron_modules = [m for m in selective_modules(modules, te, grouped_gemm) if m != "core_attn"]
    if recompute == "selective" and megatron_modules:
        return dict(recompute_granularity="selective", recompute_modules=megatron_modules)
    return {}


def build_transformer_config(spec: ModelSpec, grouped_gemm: bool = False, recompute: dict | None = None,
                             pp: int = 1):
    """ModelSpec -> Megatron TransformerConfig: the family's maths (`Family.transformer_options`: norms,
    activation, biases, QK-norm, router), every fused kernel off (none exist on CPU); grouped_gemm: MoE experts by
    grouped GEMM (TEGroupedMLP; CUDA and Transformer Engine only); recompute: recompute_options()' keywords.
    pp: pipeline stages (trainer/pipeline.py runs Megatron's 1F1B schedule over them): micro-batches of any shape
    (variable_seq_lengths: each send is preceded by its shape), stage activations in the model dtype."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    family = family_of(spec.arch)
    if family is None:
        raise ValueError(f"model_type {spec.arch!r} has no family (trainer/families/)")
    moe = {}
    if spec.is_moe:
        moe = dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.top_k,
                   moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_router_load_balancing_type="none",
                   moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=spec.moe_dispatcher,
                   moe_grouped_gemm=grouped_gemm, moe_permute_fusion=False,
                   moe_layer_freq=[int(i in spec.moe_layers) for i in range(spec.num_layers)])
    # multi-latent attention (attention/mla.py: MLATransformerConfig's options from the HF config, in spec.extra)
    mla = spec.extra.get("mla") or {}
    config_class, options = MLATransformerConfig if mla else TransformerConfig, family.transformer_options(spec)
    if mla:  # the latent RMSNorms (q_a_layernorm, kv_a_layernorm) are Megatron's q / kv layernorms
        options = options | mla | {"qk_layernorm": True}
    return config_class(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        **options, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=spec.tp, expert_model_parallel_size=spec.ep, expert_tensor_parallel_size=1,
        sequence_parallel=spec.sequence_parallel, use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=spec.dtype, bf16=spec.dtype == torch.bfloat16, fp16=spec.dtype == torch.float16,
        pipeline_dtype=spec.dtype, pipeline_model_parallel_size=pp, variable_seq_lengths=pp > 1,
        # Megatron refuses its (default, unused without experts) allgather dispatcher beside variable_seq_lengths
        **({"moe_token_dispatcher_type": "alltoall"} if pp > 1 and not spec.is_moe else {}),
        **moe, **(recompute or {}))


ATTENTION_KERNELS = ("sdpa", "te_thd")


class SegmentAttention(MegatronModule):
    """Megatron core attention (the `core_attention` of our layer spec) computing attention by segment.
    Built by Megatron's SelfAttention with DotProductAttention's arguments (and `kernel` from the spec's params);
    `attention_mask` must be a segment_attention.Segments record (None: every row is one causal segment of the full
    width). kernel "sdpa": segment_attention.attend_rows (torch SDPA per segment, any device); "te_thd":
    te_attention.thd_attend_rows with Transformer Engine's fused attention (CUDA + TE; not run here). Under context
    parallelism (trainer.cp) the inputs are this rank's columns of the rows (attention/context_split.py): keys and
    values are gathered over the CP group and context_split.attend_columns runs (sdpa only; recomputed as
    attend_rows is, the gather outside the recomputed call)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, kernel: str = "sdpa",
                 k_channels: int | None = None, v_channels: int | None = None, recompute: str = "none"):
        super().__init__(config=config)
        # recompute "call": the whole call checkpointed here (trainer.recompute selective with core_attn); "layer":
        # the layer around it is (full). Either way the completion calls are not checkpointed again inside.
        self.recompute = recompute
        self._attend = recomputed(attend_rows) if recompute == "call" else attend_rows
        self._attend_columns = recomputed(attend_columns) if recompute == "call" else attend_columns  # under CP
        # CP from the process groups: the config Megatron is given keeps context_parallel_size 1
        why = unsupported(config, cp=layer_cp_size(config)) or ("attention dropout" if attention_dropout else None)
        if why is not None:
            raise NotImplementedError(f"SegmentAttention does not cover {why}")
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {kernel!r}; valid: {ATTENTION_KERNELS}")
        # multi-latent attention passes its widths (q / k: nope + rope, v: v_head_dim) and its softmax scale
        # (YaRN's mscale squared over sqrt(q / k width)); other attention has kv_channels for all three
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(k_channels or config.kv_channels))
        if kernel == "te_thd" and getattr(config, "multi_latent_attention", False):
            raise NotImplementedError("attention kernel te_thd with multi-latent attention (never run here; use sdpa)")
        # this layer's window (Megatron's window_size (left, 0) on the layers window_attn_skip_freq picks; layer_number
        # is global and 1-based) as the reach of attend_rows: left + 1 keys, the query's own included
        from megatron.core.transformer.utils import is_layer_window_attention

        self.window = (config.window_size[0] + 1 if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        # learned sinks: one logit per query head of this TP rank, Megatron's name and TP split (dim 0)
        self.softmax_offset = None
        if getattr(config, "softmax_type", "vanilla") == "learnable":
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
        if kernel == "te_thd" and (self.window is not None or self.softmax_offset is not None):
            raise NotImplementedError("attention kernel te_thd with sliding windows / attention sinks (use sdpa)")
        self.kernel = kernel
        self.te_kernel = None
        if kernel == "te_thd":
            from gspo_ray.trainer.attention.te_attention import TEThdKernel

            tp = config.tensor_model_parallel_size
            self.te_kernel = TEThdKernel(config.num_attention_heads // tp, config.num_query_groups // tp,
                                         config.kv_channels, self.softmax_scale)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> Tensor:
        """[S, B, Hq, D] x [S, B, Hkv, D] x [S, B, Hkv, Dv] -> [S, B, Hq * Dv] (what DotProductAttention returns;
        Dv != D with multi-latent attention)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SegmentAttention takes its layout from a Segments record only")
        segs = attention_mask
        if segs is None:
            segs = Segments.plain([query.shape[0]] * query.shape[1])
        if not isinstance(segs, Segments):
            raise TypeError(f"SegmentAttention needs a Segments record as attention_mask, not {type(segs).__name__}")
        if cp_size() > 1:  # this rank's columns against the gathered keys (a recomputed call gathers outside)
            if self.te_kernel is not None:
                raise NotImplementedError("context parallelism with the te_thd kernel")
            split = cp_split(query.shape[0] * cp_size())
            if attention_mask is None:
                segs = Segments.plain([split.width] * query.shape[1])
            out = self._attend_columns(query, gather_columns(key, split), gather_columns(value, split), segs,
                                       split.columns, self.softmax_scale,
                                       checkpoint_completions=self.recompute == "none")
            return out.reshape(out.shape[0], out.shape[1], -1)
        if self.te_kernel is not None:  # recompute "call": the fused call checkpointed whole as well (not run here)
            attend = recomputed(thd_attend_rows) if self.recompute == "call" else thd_attend_rows
            return attend(query, key, value, segs, self.te_kernel)
        out = self._attend(query, key, value, segs, self.softmax_scale,
                           checkpoint_completions=self.recompute == "none", window=self.window,
                           sinks=self.softmax_offset)
        return out.reshape(out.shape[0], out.shape[1], -1)


def _layer_spec(spec: ModelSpec, grouped_gemm: bool, moe: bool, attention: str, recompute: str = "none",
                linear: bool = False):
    """One layer's spec: Megatron's local spec, or with use_te its Transformer Engine spec (fused linears and norms,
    named `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`: param_names.py), with our
    SegmentAttention as core attention either way. MoE experts: SequentialMLP, or with grouped_gemm TEGroupedMLP
    (`experts.linear_fc1.weight{j}`, mapped by bridge.py)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    num_experts, family = spec.num_experts if moe else None, family_of(spec.arch)
    mla = bool(spec.extra.get("mla"))
    if spec.use_te:
        if not family.te_spec:  # its TE names are not mapped (build_model builds the local spec instead)
            raise NotImplementedError(f"{spec.arch} with the Transformer Engine spec (use_te)")
        if mla:  # TE's MLA spec names its fused linears otherwise; never mapped or run here
            raise NotImplementedError("multi-latent attention with the Transformer Engine spec (use_te)")
        layer = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=grouped_gemm and moe, qk_layernorm=spec.qk_norm)
    else:  # MLA: MLASelfAttention, its latent norms as q / kv layernorms
        layer = specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                               qk_layernorm=spec.qk_norm or mla, multi_latent_attention=mla,
                                               normalization=family.normalization)
    layer.submodules.self_attention.submodules.core_attention = ModuleSpec(module=SegmentAttention,
                                                                           params={"kernel": attention,
                                                                                   "recompute": recompute})
    if mla:  # the column-parallel kv_down loses part of the rope key's gradient at TP > 1
        replicate_kv_down_projection(layer.submodules.self_attention.submodules)
    return hybrid_layer(layer, spec, linear) if family.layer_types(spec.hf_config) is not None else layer


def _block_spec(spec: ModelSpec, grouped_gemm: bool, attention: str, recompute: str = "none",
                stage_layers: range | None = None):
    """Per-layer specs of this pipeline stage's layers (`stage_layers`, global indices; None: all): an MoE layer
    where the HF config has one (spec.moe_layers), a dense MLP elsewhere (Qwen3-MoE's mlp_only_layers /
    decoder_sparse_step; one spec for every layer would make them all MoE). The final norm is the one Megatron's
    block picks for a single layer spec (transformer_block.LayerNormImpl)."""
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    indices = stage_layers or range(spec.num_layers)
    types = family_of(spec.arch).layer_types(spec.hf_config)
    kinds = [(i in spec.moe_layers, types is not None and types[i] == "linear_attention") for i in indices]
    layers = {kind: _layer_spec(spec, grouped_gemm, *kind[:1], attention, recompute, linear=kind[1])
              for kind in set(kinds)}
    norm = final_norm(spec) if types is not None else LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=[layers[kind] for kind in kinds], layer_norm=norm)


def stage_layers(num_layers: int) -> range:
    """The global layer indices this pipeline stage builds (memory.stage_layer_range: Megatron's even split; the
    memory model and the planner count the same stages)."""
    from megatron.core import parallel_state

    return stage_layer_range(num_layers, parallel_state.get_pipeline_model_parallel_world_size(),
                             parallel_state.get_pipeline_model_parallel_rank())


def _gpt_model(spec: ModelSpec, config, block_spec):
    """This pipeline stage's GPTModel: the first stage embeds, the last holds the final norm and the output layer
    (the log-prob head's weight)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config, transformer_layer_spec=block_spec,
        vocab_size=spec.padded_vocab_size, max_sequence_length=spec.extra["max_position_embeddings"],
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope", rotary_percent=spec.rotary_percent, rotary_base=spec.extra["rope_theta"])


def te_grouped_gemm_available() -> bool:
    """Whether megatron-core has Transformer Engine's grouped linear (TE >= 1.9: TEColumnParallelGroupedLinear, what
    TEGroupedMLP is built from); without it Megatron would fall back to the legacy GroupedMLP, never built here."""
    from megatron.core.extensions import transformer_engine as te_ext

    return getattr(te_ext, "TEColumnParallelGroupedLinear", None) is not None


def kernel_summary(model) -> dict[str, str]:
    """What a built model runs, read from its modules: layers (Transformer Engine or local), MoE experts (their
    Megatron class: TEGroupedMLP is grouped GEMM, SequentialMLP one GEMM per expert) and the attention kernel."""
    kinds = layer_kinds(model)
    experts = {type(m.experts).__name__ for m in model.modules() if type(m).__name__ == "MoELayer"}
    attention = {m.kernel for m in model.modules() if isinstance(m, SegmentAttention)}
    return {"layers": "transformer_engine" if kinds.te else "local", "experts": ", ".join(sorted(experts)) or "-",
            "attention": ", ".join(sorted(attention))}


def layer_kinds(model) -> LayerKinds:
    """What a built model holds, read from its modules' classes (not from what was asked): Transformer Engine
    layers or local ones, grouped GEMM experts or not (what make gpu-check prints)."""
    classes = {type(m).__name__ for m in model.modules()}
    return LayerKinds(te=any(c.startswith("TE") for c in classes), grouped_gemm="TEGroupedMLP" in classes)


def resolve_use_te(use_te) -> bool:
    """trainer.use_te -> whether to build the Transformer Engine spec: "auto" when te_missing() says nothing;
    True / False as given (True on a machine without them is refused by the preflight and by build_model)."""
    return te_missing() is None if use_te == "auto" else bool(use_te)


def apply_rotary_override(model, spec: ModelSpec) -> None:
    """A family's own rotary frequencies (gpt-oss's YaRN: `Family.rotary_override`) into the model's
    RotaryEmbedding, before its first (cached) forward, and their attention factor a squared into every core
    attention's softmax scale (transformers scales cos and sin by a: every score q.k by a^2)."""
    override = family_of(spec.arch).rotary_override(spec)
    if override is None:
        return
    inv_freq, factor = override
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None or rotary.inv_freq.shape != inv_freq.shape:
        raise ValueError(f"{spec.arch}: no rotary embedding of {tuple(inv_freq.shape)} frequencies to override")
    rotary.inv_freq = inv_freq.to(device=rotary.inv_freq.device, dtype=rotary.inv_freq.dtype)
    for module in model.modules():
        if isinstance(module, SegmentAttention):
            module.softmax_scale *= factor ** 2


def build_model(hf_dir: str, *, dtype: torch.dtype = torch.float32, sequence_parallel: bool | None = None,
                moe_dispatcher: str = "alltoall", load_weights: bool = True, use_te: bool = False,
                routing_replay: bool = False, grouped_gemm: bool | None = None, attention: str = "sdpa",
                router_bias_update_rate: float = 0.0, recompute: str = "none",
                recompute_num_layers: int | None = None, recompute_modules=None):
    """HF dir -> (GPTModel on this rank's device, ModelSpec). Needs init_distributed() first.

    With load_weights the HF safetensors are loaded into this rank's TP/EP shards (and random init is skipped);
    without, the model keeps Megatron's random init. routing_replay: routers can record/replay top-k choices
    (see routing/replay.py). grouped_gemm (MoE experts as TEGroupedMLP): None = with use_te when Transformer
    Engine has its grouped linear; True without use_te is refused. attention: the kernel of SegmentAttention,
    "sdpa" (torch, any device) or "te_thd" (Transformer Engine's fused attention in THD layout, with use_te only).
    router_bias_update_rate: for a router with an expert bias (DeepSeekMoE), Megatron's update of the bias after
    each optimizer step (finalize_model_grads); 0, the default, keeps it frozen as trained (docs/moe.md).
    recompute / recompute_num_layers / recompute_modules: trainer.recompute and its fields: full checkpoints the
    first recompute_num_layers layers (None: all; trainer/recompute.checkpoint_layers), selective runs Megatron's
    selective modules (recompute_options) and checkpoints the core attention's whole call where core_attn is
    chosen.
    """
    from megatron.core import parallel_state

    from gspo_ray.compat import megatron_cpu
    from gspo_ray.compat.megatron_mla_without_te import apply_mla_te_fix

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_model needs Megatron's parallel state: call parallel.init_distributed() first")
    # trainer.use_te auto resolves to true on CUDA: a family without a mapped TE spec builds the local one
    use_te = family_of(read_hf_config(hf_dir).get("model_type")).builds_te_layers(use_te)
    if use_te and te_missing():
        raise RuntimeError(f"trainer.use_te: true needs CUDA and transformer_engine: {te_missing()}")
    megatron_cpu.apply()
    apply_mla_te_fix()  # multi-latent attention builds without Transformer Engine
    spec = spec_from_hf_config(
        read_hf_config(hf_dir), hf_dir, tp=parallel_state.get_tensor_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(), sequence_parallel=sequence_parallel,
        moe_dispatcher=moe_dispatcher, dtype=dtype, use_te=use_te)
    spec.extra["router_bias_update_rate"] = float(router_bias_update_rate)  # read by the family's Router
    if grouped_gemm and not use_te:
        raise ValueError("grouped GEMM experts need the Transformer Engine spec (use_te)")
    if attention not in ATTENTION_KERNELS or attention == "te_thd" and not use_te:
        raise ValueError(f"attention kernel {attention!r}: valid {ATTENTION_KERNELS}, te_thd with use_te only")
    grouped = spec.is_moe and use_te and (te_grouped_gemm_available() if grouped_gemm is None else grouped_gemm)
    config = build_transformer_config(spec, grouped_gemm=grouped, recompute=recompute_options(
        recompute, recompute_modules, use_te, grouped), pp=parallel_state.get_pipeline_model_parallel_world_size())
    attention_recompute = {"full": "layer", "selective": "call" if "core_attn" in selective_modules(
        recompute_modules, use_te, grouped) else "none"}.get(recompute, "none")
    config.perform_initialization = not load_weights  # every parameter is overwritten by the loader
    config.moe_enable_routing_replay = routing_replay and spec.is_moe  # each router gets a RouterReplay
    layers = stage_layers(spec.num_layers)
    # a tied embedding's last-stage copy is summed with the first stage's at construction, after a `.cuda()`
    # (a no-op in cpu_device_mode; the loaded values are summed again by bridge.sync_tied_output)
    with megatron_cpu.cpu_device_mode() if len(layers) < spec.num_layers else contextlib.nullcontext():
        model = _gpt_model(spec, config, _block_spec(spec, grouped, attention, attention_recompute, layers))
    if torch.cuda.is_available():
        model = model.cuda()
    for p in model.parameters():  # the torch norm wrappers ignore params_dtype; HF keeps norms in the model dtype
        p.data = p.data.to(dtype)
    apply_rotary_override(model, spec)
    model.hf_vocab_size = spec.vocab_size  # forward_logprobs normalises over the real vocabulary only
    model.layer_offset = layers.start  # decoder.layers.{i} is stage-local: global index i + layer_offset
    if load_weights:
        load_hf_weights(model, spec, hf_dir)
    clone_expert_fc2_outputs(model)  # experts with biases (gpt-oss): Megatron adds their fc2 bias in place
    if recompute == "full":
        checkpoint_layers(model, recompute_num_layers)
    return model, spec
