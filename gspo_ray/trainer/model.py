"""Build a Megatron-core GPTModel from a HF checkpoint directory (qwen2, qwen3, qwen3_moe, llama, mixtral).

    init_distributed(rank, world, addr, port, tp=..., ep=...)       # gspo_ray.trainer.parallel, first
    model, spec = build_model(hf_dir, dtype=torch.float32, sequence_parallel=None, moe_dispatcher="alltoall",
                              load_weights=True) -> tuple[GPTModel, ModelSpec]

TP/EP sizes come from Megatron's parallel state. Layers use the local (pure torch) spec, the one verified against
transformers here; `use_te=True` picks the Transformer Engine spec on CUDA machines (its parameter names are mapped
by bridge.py, its numerics are not verified by these tests). MoE routing follows Qwen3-MoE:
softmax over experts, top-k, top-k probs renormalised when `norm_topk_prob` (softmax over the top-k logits, which
is the same thing); no Routing Replay, no aux loss. `ModelSpec` is a small picklable record of the architecture.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

SUPPORTED_ARCHS = ("qwen2", "qwen3", "qwen3_moe", "llama", "mixtral")
MOE_DISPATCHERS = ("alltoall", "allgather")


@dataclass
class ModelSpec:
    """What the converter and the log-prob code need to know about a built model (picklable)."""

    arch: str
    hf_config: dict = field(repr=False)
    hf_dir: str
    vocab_size: int                  # HF vocabulary (what log-probs are normalised over)
    padded_vocab_size: int           # Megatron's embedding/output rows: vocab_size rounded up to a multiple of tp
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int             # dense MLP width
    num_experts: int = 0             # 0 for dense models
    moe_ffn_hidden_size: int = 0
    top_k: int = 0
    moe_layers: tuple[int, ...] = ()  # indices of layers whose MLP is MoE
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    moe_dispatcher: str = "alltoall"
    dtype: torch.dtype = torch.float32
    use_te: bool = False
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep if self.num_experts else 0


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: not a HF model directory (config.json missing)")
    return json.loads(path.read_text())


def _rope_theta(cfg: dict) -> float:
    """transformers 5 keeps it in rope_parameters; 4.x at the top level."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(f"config.json rope type {kind!r} is not supported (only default RoPE)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _moe_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
        return ()
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _refuse_unsupported(cfg: dict, hf_dir) -> None:
    """Features the Megatron config below cannot express would give silently wrong numbers: refuse them."""
    where = f"{hf_dir}/config.json"
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} not supported (only silu)")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"{where}: shared experts are not supported")
    if cfg.get("use_sliding_window") or (cfg.get("model_type") == "mixtral" and cfg.get("sliding_window")):
        raise ValueError(f"{where}: sliding-window attention is not supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):  # (qwen2's q/k/v biases are implied, not configured)
        raise ValueError(f"{where}: attention_bias/mlp_bias are not supported")


def spec_from_hf_config(cfg: dict, hf_dir: str, *, tp: int = 1, ep: int = 1, sequence_parallel: bool | None = None,
                        moe_dispatcher: str = "alltoall", dtype: torch.dtype = torch.float32,
                        use_te: bool = False) -> ModelSpec:
    """HF config.json (as a dict) + layout -> ModelSpec; raises on anything the converter cannot represent."""
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{hf_dir}/config.json: model_type {arch!r} not supported; valid: {SUPPORTED_ARCHS}")
    if moe_dispatcher not in MOE_DISPATCHERS:
        raise ValueError(f"moe_dispatcher {moe_dispatcher!r}; valid: {MOE_DISPATCHERS}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if kv_heads % tp or heads % tp:
        raise ValueError(f"tp={tp} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads}")
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    ep = ep if num_experts else 1  # a dense model has nothing to split over the EP group
    if num_experts and num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={num_experts}")
    _refuse_unsupported(cfg, hf_dir)
    if sequence_parallel is None:
        sequence_parallel = tp > 1
    if num_experts and tp > 1 and not sequence_parallel:
        raise ValueError("Megatron MoE with tp > 1 requires sequence_parallel=True")
    vocab, layers = int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    return ModelSpec(
        arch=arch, hf_config=cfg, hf_dir=str(hf_dir), vocab_size=vocab, padded_vocab_size=-(-vocab // tp) * tp,
        num_layers=layers, hidden_size=cfg["hidden_size"], num_heads=heads, num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_hidden_size=cfg["intermediate_size"],
        # Mixtral's experts have the dense width (intermediate_size); Qwen3-MoE names its own
        num_experts=num_experts, moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        if num_experts else 0,
        top_k=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_layers=_moe_layers(cfg, layers),
        qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "qwen3_moe"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), tp=tp, ep=ep,
        sequence_parallel=bool(sequence_parallel), moe_dispatcher=moe_dispatcher, dtype=dtype, use_te=use_te,
        # Mixtral always renormalises its top-k probabilities (it has no norm_topk_prob field)
        extra={"rope_theta": _rope_theta(cfg),
               "norm_topk_prob": arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
               "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
               "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096))})


def build_transformer_config(spec: ModelSpec):
    """ModelSpec -> Megatron TransformerConfig: Qwen/Llama maths, every fused kernel off (none exist on CPU)."""
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if spec.is_moe:
        moe = dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.top_k,
                   moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_router_load_balancing_type="none",
                   moe_aux_loss_coeff=0.0, moe_router_score_function="softmax",
                   # pre_softmax=False: softmax over the k selected logits == renormalised top-k probs
                   moe_router_pre_softmax=not spec.extra["norm_topk_prob"],
                   moe_token_dispatcher_type=spec.moe_dispatcher, moe_grouped_gemm=False,
                   moe_permute_fusion=False,
                   moe_layer_freq=[int(i in spec.moe_layers) for i in range(spec.num_layers)])
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.extra["rms_norm_eps"], gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=spec.tp, expert_model_parallel_size=spec.ep, expert_tensor_parallel_size=1,
        sequence_parallel=spec.sequence_parallel, use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=spec.dtype, bf16=spec.dtype == torch.bfloat16, fp16=spec.dtype == torch.float16,
        pipeline_dtype=spec.dtype, **moe)


def _layer_spec(spec: ModelSpec):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    num_experts = spec.num_experts or None
    if spec.use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                                qk_layernorm=spec.qk_norm)
    return specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                          qk_layernorm=spec.qk_norm, normalization="RMSNorm")


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def build_model(hf_dir: str, *, dtype: torch.dtype = torch.float32, sequence_parallel: bool | None = None,
                moe_dispatcher: str = "alltoall", load_weights: bool = True, use_te: bool = False,
                routing_replay: bool = False):
    """HF dir -> (GPTModel on this rank's device, ModelSpec). Needs init_distributed() first.

    With load_weights the HF safetensors are loaded into this rank's TP/EP shards (and random init is skipped);
    without, the model keeps Megatron's random init. routing_replay: routers can record/replay top-k choices
    (see routing_replay.py).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from gspo_ray.trainer import megatron_cpu_compat

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_model needs Megatron's parallel state: call parallel.init_distributed() first")
    if use_te and not te_available():
        raise RuntimeError("use_te=True needs CUDA and an importable transformer_engine")
    megatron_cpu_compat.apply()
    spec = spec_from_hf_config(
        read_hf_config(hf_dir), hf_dir, tp=parallel_state.get_tensor_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(), sequence_parallel=sequence_parallel,
        moe_dispatcher=moe_dispatcher, dtype=dtype, use_te=use_te)
    config = build_transformer_config(spec)
    config.perform_initialization = not load_weights  # every parameter is overwritten by the loader
    config.moe_enable_routing_replay = routing_replay and spec.is_moe  # each router gets a RouterReplay
    model = GPTModel(
        config=config, transformer_layer_spec=_layer_spec(spec), vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.extra["max_position_embeddings"], pre_process=True, post_process=True,
        parallel_output=True, share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=spec.extra["rope_theta"])
    if torch.cuda.is_available():
        model = model.cuda()
    for p in model.parameters():  # the torch norm wrappers ignore params_dtype; HF keeps norms in the model dtype
        p.data = p.data.to(dtype)
    model.hf_vocab_size = spec.vocab_size  # forward_logprobs normalises over the real vocabulary only
    if load_weights:
        from gspo_ray.trainer.bridge import load_hf_weights

        load_hf_weights(model, spec, hf_dir)
    return model, spec
