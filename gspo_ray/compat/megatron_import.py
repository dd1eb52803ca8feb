"""megatron-core 0.16 imported without `torch.compile`: ~3.6 s less CPU in every trainer process, the same model.

    from gspo_ray.compat.megatron_import import megatron_core  # before the module's first `from megatron...`

`megatron.core.jit` binds `jit_fuser = torch.compile` when it loads, and the fused kernels (`fusions/`,
`activations.py`, the L2 norm, the flex dispatcher's preprocessing, ...) are decorated with it as their modules
load, so `import megatron.core` imports torch._dynamo and torch._inductor. Measured on 2 cores: 6.6 s of CPU after
torch for `import megatron.core`, 3.0 s without them. None of those kernels runs here: the trainer turns every
fusion off (`model.build_transformer_config`: bias_activation_fusion, bias_dropout_fusion, masked_softmax_fusion,
apply_rope_fusion, ...) and uses neither the grouped-GEMM experts nor the flex dispatcher. Importing megatron.core
while `torch.compile` is the identity leaves them plain eager functions (the same maths, were one ever called) and
restores `torch.compile` right after.

Version-guarded: megatron-core 0.16.x only (read from the package metadata, before importing it); any other version,
or a process that imported megatron.core already, imports it as is. `tests/compat/test_megatron_import.py` fails
when the saving is gone (megatron.core no longer imports torch._dynamo) or the guarded import stops working.
"""
from __future__ import annotations

import sys
from importlib.metadata import version

import torch

GUARDED_VERSION = "0.16."


def _identity_compile(model=None, **_options):
    """Both call forms of torch.compile: `torch.compile(fn, ...)` and `@torch.compile(...)`."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_core():
    """megatron.core, imported with `torch.compile` as the identity when this workaround applies."""
    if "megatron.core" in sys.modules or not version("megatron-core").startswith(GUARDED_VERSION):
        import megatron.core

        return megatron.core
    compile_ = torch.compile
    torch.compile = _identity_compile
    try:
        import megatron.core
    finally:
        torch.compile = compile_
    return megatron.core


megatron_core = import_megatron_core()
