"""rollout.head_dtype (pure logic, no engine start): a bf16 engine asks vLLM for an fp32 output layer
(`hf_overrides={"head_dtype": "float32"}`), a float32 engine and head_dtype "model" ask for nothing, and the
override joins other `hf_overrides` instead of replacing them."""
from __future__ import annotations

import pytest

from gspo_ray.config.rollout import RolloutConfig
from gspo_ray.rollout.engine import head_dtype_kwargs, merge_engine_kwargs


@pytest.mark.parametrize("dtype,head_dtype,expected", [
    ("bfloat16", "float32", {"hf_overrides": {"head_dtype": "float32"}}),  # vLLM's own default would be bf16
    ("bfloat16", "model", {}),
    ("float32", "float32", {}),  # the head is fp32 already
    ("float32", "model", {}),
])
def test_bf16_engine_gets_the_fp32_head(dtype, head_dtype, expected):
    assert head_dtype_kwargs(dtype, head_dtype) == expected


def test_the_default_is_the_fp32_head_and_it_merges():
    cfg = RolloutConfig(dtype="bfloat16")
    assert cfg.head_dtype == "float32"
    kwargs = {"seed": 0, "hf_overrides": {"max_position_embeddings": 64}}
    merged = merge_engine_kwargs(kwargs, head_dtype_kwargs(cfg.dtype, cfg.head_dtype))
    assert merged == {"seed": 0, "hf_overrides": {"max_position_embeddings": 64, "head_dtype": "float32"}}
    with pytest.raises(ValueError, match="rollout.head_dtype 'bf16'; valid: float32, model"):
        head_dtype_kwargs("bfloat16", "bf16")
