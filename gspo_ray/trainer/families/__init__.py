"""The architecture families the trainer takes, one module each, and the registry from HF `model_type` to family.

    family = family_of("qwen3_moe")        # a Family, or None for a model_type no family takes (aliases included)
    FAMILIES                               # {model_type: Family}, canonical names, in the order errors list them

    base.py        Family / MoEFamily: the Llama-like defaults every family starts from, and what a family states
    llama.py  qwen2.py  qwen3.py  qwen3_moe.py  mixtral.py  glm4_moe.py  deepseek_v3.py (alias kimi_k2)  gpt_oss.py
    qwen3_next.py  the hybrid (Gated DeltaNet + gated attention); built for the trainer at 1 process, refused by
                   the preflight (hybrid.py) until the engine's parity is shown
    deepseek_moe.py  DeepSeekMoEFamily: shared experts, the biased sigmoid router, dense first layers (no family of
                     its own: GLM-4.5's, and DeepSeek-V3's, MoE block)
    hybrid.py      the config checks of hybrid Gated DeltaNet / softmax models (qwen3_next, qwen3_5_moe): the
                   preflight checks their keys, then refuses them by name

A family states the HF config keys it reads and refuses, its Megatron TransformerConfig options and router, its HF
tensor names (beside weights.bridge's Qwen-style rules), its LoRA targets and the class vLLM loads for it; the
machinery that uses those facts (model_spec, model, weights/, the preflight) is shared. Adding a family is one module
here, its line in FAMILY_MODULES below, and its tests (docs/real-models.md). No torch import (the preflight reads it).
"""
from __future__ import annotations

from gspo_ray.trainer.families import (deepseek_v3, glm4_moe, gpt_oss, llama, mixtral, qwen2, qwen3, qwen3_moe,
                                       qwen3_next)
from gspo_ray.trainer.families.base import Family

FAMILY_MODULES = (qwen2, qwen3, qwen3_moe, llama, mixtral, glm4_moe, deepseek_v3, qwen3_next, gpt_oss)
FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in FAMILY_MODULES}
ALIASES: dict[str, str] = {alias: f.model_type for f in FAMILIES.values() for alias in f.aliases}
if set(ALIASES) & set(FAMILIES) or len(ALIASES) != sum(len(f.aliases) for f in FAMILIES.values()):
    raise ImportError(f"a model_type names two families: {sorted(ALIASES)} / {sorted(FAMILIES)}")


def family_of(model_type: str | None) -> Family | None:
    """The family of a config.json `model_type` (canonical or an alias), None when no family takes it."""
    if not isinstance(model_type, str):
        return None
    return FAMILIES.get(ALIASES.get(model_type, model_type))
