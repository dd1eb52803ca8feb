"""The architecture record of a model: HF config.json + parallel layout -> `ModelSpec` (torch only, no Megatron).

    spec = spec_from_hf_config(read_hf_config(hf_dir), hf_dir, tp=2, ep=1)

Shared by the model builder (model.py), the weight bridge (weights/bridge.py), HF export and the preflight, which
checks a model directory before anything heavy is imported. What differs between architectures (the config keys
read and refused, biases, QK-norm, the router) is the family's (trainer/families/, the registry by model_type); the
record and the checks of the parallel layout are here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gspo_ray.trainer.attention.mla import check_mla_layout, mla_options
from gspo_ray.trainer.families import FAMILIES, family_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config names
SUPPORTED_ARCHS = tuple(FAMILIES)  # the registry's model_types: qwen2, .., glm4_moe, deepseek_v3
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
    shared_expert_ffn_hidden_size: int = 0  # an MoE layer's shared experts as one MLP (0: none)
    expert_bias: bool = False        # the router selects on score + a per-expert bias buffer (router.expert_bias)
    rotary_percent: float = 1.0      # share of each head's dimensions RoPE rotates (the first ones)
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    moe_dispatcher: str = "alltoall"
    dtype: torch.dtype = torch.float32
    use_te: bool = False             # Transformer Engine layers (CUDA); attention is ours either way
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


def spec_from_hf_config(cfg: dict, hf_dir: str, *, tp: int = 1, ep: int = 1, sequence_parallel: bool | None = None,
                        moe_dispatcher: str = "alltoall", dtype: torch.dtype = torch.float32,
                        use_te: bool = False) -> ModelSpec:
    """HF config.json (as a dict) + layout -> ModelSpec; raises on anything the converter cannot represent."""
    arch = cfg.get("model_type")
    family = family_of(arch)
    if family is None:
        raise ValueError(f"{hf_dir}/config.json: model_type {arch!r} not supported; valid: {SUPPORTED_ARCHS}")
    if moe_dispatcher not in MOE_DISPATCHERS:
        raise ValueError(f"moe_dispatcher {moe_dispatcher!r}; valid: {MOE_DISPATCHERS}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if kv_heads % tp or heads % tp:
        raise ValueError(f"tp={tp} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads}")
    num_experts = family.num_experts(cfg)
    ep = ep if num_experts else 1  # a dense model has nothing to split over the EP group
    if num_experts and num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={num_experts}")
    family.refuse_unsupported(cfg, hf_dir)
    mla = mla_options(cfg, f"{hf_dir}/config.json")  # {} unless the family takes multi-latent attention
    shared = family.shared_expert_ffn_hidden_size(cfg) if num_experts else 0
    if shared % tp:  # Megatron splits the shared experts' MLP over TP like a dense one
        raise ValueError(f"tp={tp} must divide the shared experts' width {shared} (n_shared_experts x "
                         "moe_intermediate_size)")
    if sequence_parallel is None:
        sequence_parallel = tp > 1
    check_mla_layout(mla, tp, bool(sequence_parallel), f"{hf_dir}/config.json")
    if num_experts and tp > 1 and not sequence_parallel:
        raise ValueError("Megatron MoE with tp > 1 requires sequence_parallel=True")
    vocab, layers = int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    return ModelSpec(
        arch=arch, hf_config=cfg, hf_dir=str(hf_dir), vocab_size=vocab, padded_vocab_size=-(-vocab // tp) * tp,
        num_layers=layers, hidden_size=cfg["hidden_size"], num_heads=heads, num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_hidden_size=cfg["intermediate_size"],
        num_experts=num_experts, moe_ffn_hidden_size=family.moe_ffn_hidden_size(cfg) if num_experts else 0,
        top_k=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_layers=family.moe_layers(cfg, layers), qkv_bias=family.uses_qkv_bias(cfg),
        qk_norm=family.uses_qk_norm(cfg), rotary_percent=family.rotary_percent(cfg),
        shared_expert_ffn_hidden_size=shared,
        expert_bias=bool(num_experts) and family.router_has_expert_bias,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), tp=tp, ep=ep,
        sequence_parallel=bool(sequence_parallel), moe_dispatcher=moe_dispatcher, dtype=dtype, use_te=use_te,
        extra={"rope_theta": family.rope_theta(cfg), "norm_topk_prob": family.norm_topk_prob(cfg),
               "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
               "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)), "mla": mla})


def te_missing() -> str | None:
    """What Transformer Engine layers lack on this machine (None: CUDA is there and transformer_engine imports)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as e:
        return f"transformer_engine does not import ({e})"
    return None
