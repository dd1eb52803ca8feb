"""Workaround for megatron-core 0.16.1 failing to build multi-latent attention without Transformer Engine.

The bug. `megatron/core/transformer/multi_latent_attention.py` imports `TELinear` from
`megatron.core.extensions.transformer_engine` inside a try block and sets `HAVE_TE = True` when the import works.
Without transformer_engine that import still works: the extensions module stands a `MagicMock` in for the `te`
package and defines `class TELinear(te.pytorch.Linear)`, which makes TELinear a MagicMock instance, not a class.
`MultiLatentAttention.__init__` then evaluates `HAVE_TE and isinstance(self.linear_proj, TELinear)` (an fp8 /
fp4 detail) and raises `TypeError: isinstance() arg 2 must be a type` on every machine without Transformer Engine
(this one: CPU only), so no MLA model can be built.

The workaround. Where `TELinear` in that module is not a class, its `HAVE_TE` is set to False (what it would be
had the import failed); that flag is read only by the fp8 / fp4 branch above, which needs Transformer Engine
anyway. Applied by model.build_model (and the MLA tests) before a model is built; a no-op where Transformer Engine
is installed.

Guard: megatron-core 0.16.1 (`TESTED_VERSIONS`; other versions get a warning). The test
(tests/compat/test_megatron_mla_without_te.py) fails when the workaround stops being needed (the module's TELinear is
a class, or HAVE_TE is already False without it) or stops being correct (MLASelfAttention still does not build).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.16.1",)


def needs_mla_te_fix() -> bool:
    """True where megatron's MLA module believes Transformer Engine is there but holds a stand-in for TELinear."""
    from megatron.core.transformer import multi_latent_attention as mla

    return bool(mla.HAVE_TE) and not isinstance(mla.TELinear, type)


def apply_mla_te_fix() -> bool:
    """Set the MLA module's HAVE_TE to False where its TELinear is a stand-in (idempotent); False where not needed."""
    import megatron.core
    from megatron.core.transformer import multi_latent_attention as mla

    if not needs_mla_te_fix():
        return False
    version = getattr(megatron.core, "__version__", "unknown")
    if version not in TESTED_VERSIONS:
        log.warning("megatron_mla_without_te: tested with megatron-core %s, found %s; run "
                    "tests/compat/test_megatron_mla_without_te.py", ", ".join(TESTED_VERSIONS), version)
    mla.HAVE_TE = False
    return True
