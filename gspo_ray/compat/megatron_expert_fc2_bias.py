"""Workaround for megatron-core 0.16.1's expert MLP with biases (gpt-oss's experts).

The bug. An expert's MLP.forward adds its fc2 bias weighted by the token's routing probability in place
(`output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)`, megatron/core/transformer/mlp.py). The
expert's linear_fc2 is a RowParallelLinear over the expert-TP group (size 1 here), whose reduction over one rank
(a reduce-scatter with sequence parallelism, an all-reduce without) returns its input as is from a custom autograd
Function: a view, and torch refuses the in-place add under grad ("Output 0 of
_ReduceScatterToSequenceParallelRegion / _ReduceFromModelParallelRegion is a view and is being modified
inplace").

The workaround. A forward hook on each expert's linear_fc2 returns a clone of its output (one [tokens, H] copy per
expert and layer, under grad only), so the in-place add runs on a tensor of its own; the values are unchanged.

Guard: megatron-core 0.16.1 (`TESTED_VERSIONS`; others warn). The test
(tests/compat/test_megatron_expert_fc2_bias.py) fails when Megatron's MLP no longer adds the bias in place.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.16.1",)
INPLACE_LINE = "output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)"


def _clone_output(module, args, output):
    if not torch.is_grad_enabled():
        return output
    out, bias = output
    return out.clone(), bias


def clone_expert_fc2_outputs(model) -> int:
    """Hook every local expert's linear_fc2 that has a bias; returns how many."""
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version not in TESTED_VERSIONS:
        log.warning("megatron_expert_fc2_bias: tested with megatron-core %s, found %s; run "
                    "tests/compat/test_megatron_expert_fc2_bias.py", ", ".join(TESTED_VERSIONS), version)
    hooked = 0
    for name, module in model.named_modules():
        if ".local_experts." in name and name.endswith("linear_fc2") and getattr(module, "bias", None) is not None:
            module.register_forward_hook(_clone_output)
            hooked += 1
    return hooked
