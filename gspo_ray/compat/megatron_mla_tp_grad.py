"""Workaround for megatron-core 0.16.1's multi-latent attention losing part of the rope key's gradient under TP.

The bug. In the local layer spec, MLASelfAttention's `linear_kv_down_proj` is a ColumnParallelLinear: each TP rank
computes a slice of the [kv_lora_rank ; qk_rope_head_dim] latent, and `get_query_key_value_tensors` gathers it
(`gather_from_tensor_model_parallel_region`, whose backward only splits), then keeps the rope key `k_pos_emb`
whole on every rank, where each rank's attention heads use it. In the backward each rank's k_pos_emb gradient
holds its own heads' part only, and the gather's backward keeps, of the rope columns, the part of the rank that
computed them: the other ranks' heads' contributions are dropped. The forward is right; the gradients of the
rope rows of linear_kv_down_proj and of the layer's input are wrong at TP > 1 (measured at TP 2 + SP:
tests/trainer/test_mla_attention.py, the rope rows differ from the 1-process gradient by up to ~90 (relative
~0.4), every other gradient equal to 1e-5). kv_lora_rank's part and the query path are right (the latent is
scattered back to the sequence-parallel region, whose backward sums over ranks).

The workaround. Our MLA layer spec builds `linear_kv_down_proj` as Megatron's replicated `Linear`
(megatron.core.post_training.modelopt.layers; one of the classes MLASelfAttention accepts there, as Transformer
Engine's spec uses a duplicated TELinear): each rank computes the whole latent of its sequence-parallel slice, and
Megatron takes the other branch, gathering k_pos_emb from the sequence-parallel region, whose backward
reduce-scatters (sums every rank's heads). The weight is replicated, marked `sequence_parallel`, so
finalize_model_grads all-reduces its gradient over TP like a norm's. Multi-latent attention at TP > 1 therefore
needs sequence parallelism (without it the replicated projection's input gradient would be one rank's part);
model_spec refuses TP > 1 without it. HF names: attention/mla.py maps kv_a_proj_with_mqa unsharded.

Guard: megatron-core 0.16.1 (`TESTED_VERSIONS`; others warn). The test
(tests/trainer/test_mla_attention.py::test_column_parallel_kv_down_still_loses_rope_gradients) fails when the
workaround stops being needed (the column-parallel spec's gradients equal the 1-process ones), and the TP 2 tests
beside it when it stops being correct.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.16.1",)


def replicated_linear():
    """The replicated Linear class MLASelfAttention accepts for its down projections."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.Linear is None:
        raise RuntimeError("megatron-core's multi_latent_attention has no replicated Linear to build "
                           "linear_kv_down_proj with (megatron.core.post_training.modelopt did not import)")
    return mla.Linear


def replicate_kv_down_projection(submodules) -> None:
    """Make an MLASelfAttentionSubmodules' linear_kv_down_proj the replicated Linear (in place)."""
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version not in TESTED_VERSIONS:
        log.warning("megatron_mla_tp_grad: tested with megatron-core %s, found %s; run "
                    "tests/trainer/test_mla_attention.py", ", ".join(TESTED_VERSIONS), version)
    submodules.linear_kv_down_proj = replicated_linear()
